"""Graph IR: ops in execution order tagged forward/backward/update, tensors with byte sizes.

The IR is built once from a traced ``tf.Graph``/``FuncGraph`` and never refers back to
TensorFlow objects, so the planner can be tested on it without running anything.

Classification. Gradient ops sit under a ``gradient_tape/`` (``tf.GradientTape``) or
``gradients/`` (``tf.gradients``) name scope. The name is only the seed of the
classification; the tags themselves are structural:

* backward: the gradient-scoped ops, plus every op that both descends from one and
  feeds one (e.g. a custom gradient's helper ops), plus ops (such as the ``ones``
  seed of the loss gradient) whose every consumer is backward;
* update: every other op that descends from a backward op (optimizer math, variable
  writes, collective ops on gradients), plus ops that only feed update ops (the
  optimizer's reads of its learning rate and slots);
* forward: everything else, i.e. the ops the loss is computed from.

Example:
    >>> import tensorflow as tf
    >>> w = tf.Variable(tf.ones((4, 4)))
    >>> @tf.function
    ... def step(x):
    ...     with tf.GradientTape() as tape:
    ...         loss = tf.reduce_sum(tf.nn.relu(x @ w))
    ...     w.assign_sub(tape.gradient(loss, w))
    ...     return loss
    >>> ir = build_ir(step.get_concrete_function(tf.ones((2, 4))).graph)
    >>> ir.op("Relu").phase.value, ir.op("gradient_tape/ReluGrad").phase.value
    ('forward', 'backward')
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import re
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from lms_tf import _compat
from lms_tf.errors import GraphAnalysisError

_GRADIENT_SCOPE = re.compile(r"^(gradient_tape|gradients)(_\d+)?$")

#: Ops that bring a batch into the step from inside the graph (tf-keras, input pipelines in the step).
DATA_SOURCE_OP_TYPES = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue", "MultiDeviceIteratorGetNextFromShard",
})

#: Control-flow ops: values entering or leaving them are never swapped (their bodies are functions).
CONTROL_FLOW_OP_TYPES = frozenset({
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "Enter", "Exit", "Switch", "Merge", "NextIteration", "LoopCond", "RefEnter", "RefExit",
    "RefSwitch", "RefMerge",
})


class Phase(str, enum.Enum):
    """Which part of the training step an op belongs to.

    Example:
        >>> Phase("backward") is Phase.BACKWARD
        True
    """

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the graph.

    Attributes:
        name: TensorFlow name, e.g. ``"conv2d/Relu:0"``.
        dtype: dtype name, e.g. ``"float32"``.
        shape: Dimensions after resolution; ``None`` entries are still unknown; ``None``
            when even the rank is unknown.
        nbytes: Size in bytes, or ``None`` when a dimension is unknown or the dtype
            has no fixed size (resource, variant, string).
        producer: Name of the op that produces it.
        consumers: Names of the ops that read it (data edges), in execution order.

    Example:
        >>> TensorInfo("a:0", "float32", (2, 3), 24, "a", ()).nbytes
        24
    """

    name: str
    dtype: str
    shape: Optional[Tuple[Optional[int], ...]]
    nbytes: Optional[int]
    producer: str
    consumers: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One op of the graph.

    Attributes:
        name: Op name.
        type: Op type, e.g. ``"Conv2D"``.
        index: Position in the execution order.
        phase: forward, backward or update.
        device: Requested device string (often empty: the placer decides).
        inputs: Input tensor names.
        control_inputs: Names of ops with a control edge into this op.
        outputs: Output tensor names.
        stateful: Whether TensorFlow declares the op stateful (variable access,
            random ops with hidden state, I/O): such ops are never recomputed.

    Example:
        >>> OpInfo("a", "Relu", 0, Phase.FORWARD, "", (), (), ("a:0",)).type
        'Relu'
    """

    name: str
    type: str
    index: int
    phase: Phase
    device: str
    inputs: Tuple[str, ...]
    control_inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    stateful: bool = False


def layer_of(op_name: str) -> str:
    """The layer (name-scope path) an op belongs to, without gradient scopes.

    Example:
        >>> layer_of("gradient_tape/sequential/conv2d/Relu/ReluGrad")
        'sequential/conv2d/Relu'
        >>> layer_of("sequential/conv2d/Relu")
        'sequential/conv2d'
    """
    parts = [p for p in op_name.split("/")[:-1] if not _GRADIENT_SCOPE.match(p)]
    return "/".join(parts)


def is_gradient_scoped(op_name: str) -> bool:
    """Whether an op name lies under a ``gradient_tape/`` or ``gradients/`` name scope.

    Example:
        >>> is_gradient_scoped("train/gradient_tape/dense/MatMul"), is_gradient_scoped("dense/MatMul")
        (True, False)
    """
    return any(_GRADIENT_SCOPE.match(part) for part in op_name.split("/")[:-1])


@dataclasses.dataclass(frozen=True)
class GraphIR:
    """Immutable view of a traced training step.

    Attributes:
        ops: Ops in a deterministic execution order (topological, ties broken by creation).
        tensors: Tensor name -> TensorInfo.
        function_inputs: Names of the ops that are the function's inputs (placeholders).
        resolved_dims: How unknown dimensions were resolved, e.g. ``{"data:0": (32, 224, 224, 3)}``.
        data_dependent: Ops computed from the batch (function inputs that are not
            resources, iterator outputs), not only from constants and variables.

    Example:
        >>> ir = GraphIR(ops=(), tensors={}, function_inputs=frozenset(), resolved_dims={})
        >>> len(ir.ops)
        0
    """

    ops: Tuple[OpInfo, ...]
    tensors: Mapping[str, TensorInfo]
    function_inputs: FrozenSet[str]
    resolved_dims: Mapping[str, Tuple[Optional[int], ...]]
    data_dependent: FrozenSet[str] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "_by_name", {op.name: op for op in self.ops})

    def op(self, name: str) -> OpInfo:
        """Returns the op called ``name``.

        Example:
            >>> GraphIR((), {}, frozenset(), {}).op("missing")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            KeyError: 'missing'
        """
        return self._by_name[name]  # type: ignore[attr-defined]

    def ops_in(self, phase: Phase) -> List[OpInfo]:
        """Ops of one phase, in execution order.

        Example:
            >>> GraphIR((), {}, frozenset(), {}).ops_in(Phase.BACKWARD)
            []
        """
        return [op for op in self.ops if op.phase is phase]

    def phase_counts(self) -> Dict[str, int]:
        """Number of ops per phase.

        Example:
            >>> GraphIR((), {}, frozenset(), {}).phase_counts()
            {'forward': 0, 'backward': 0, 'update': 0}
        """
        counts = {p.value: 0 for p in Phase}
        for op in self.ops:
            counts[op.phase.value] += 1
        return counts


def _execution_order(ops: Sequence[tf.Operation]) -> List[tf.Operation]:
    """Kahn's topological sort over data and control edges; ties go to the op created first."""
    position = {op.name: i for i, op in enumerate(ops)}
    indegree = {op.name: 0 for op in ops}
    successors: Dict[str, List[str]] = {op.name: [] for op in ops}
    for op in ops:
        preds = {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}
        for pred in preds:
            if pred in successors:
                successors[pred].append(op.name)
                indegree[op.name] += 1
    ready = [position[name] for name, deg in indegree.items() if deg == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        op = ops[heapq.heappop(ready)]
        order.append(op)
        for succ in successors[op.name]:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(ready, position[succ])
    if len(order) != len(ops):
        stuck = sorted((n for n, d in indegree.items() if d > 0), key=position.get)[:5]
        raise GraphAnalysisError(f"the graph has a cycle through ops {stuck}; it cannot be analysed.")
    return order


def _data_dependent(order: Sequence[tf.Operation], sources: FrozenSet[str]) -> FrozenSet[str]:
    dependent = set(sources)
    for op in order:
        if any(t.op.name in dependent for t in op.inputs):
            dependent.add(op.name)
    return frozenset(dependent)


def _classify(order: Sequence[tf.Operation], created: Mapping[str, int],
              data_dependent: FrozenSet[str]) -> Dict[str, Phase]:
    names = [op.name for op in order]
    preds = {op.name: {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs} for op in order}
    succs: Dict[str, set] = {n: set() for n in names}
    for name, ps in preds.items():
        for p in ps:
            if p in succs:
                succs[p].add(name)
    # Gradient-scoped ops that only feed ops created before them (or other such ops) were added in place to the
    # forward pass by a gradient function (while_v2 accumulators of the forward loop and their
    # constants): they run in the forward pass whatever their name scope.
    retrofitted = set()
    for n in reversed(names):
        if is_gradient_scoped(n) and succs[n] and all(
                created[s] < created[n] or s in retrofitted for s in succs[n]):
            retrofitted.add(n)
    gradient = {n for n in names if is_gradient_scoped(n) and n not in retrofitted}
    below = set()  # descends from a gradient op
    for n in names:
        # An input from an op created later was added in place by a gradient function (while_v2
        # adds gradient-scoped accumulators to the forward While); it does not make n backward.
        if any((p in gradient or p in below) and created[p] < created[n] for p in preds[n]):
            below.add(n)
    above = set()  # feeds a gradient op
    for n in reversed(names):
        if any(s in gradient or s in above for s in succs[n]):
            above.add(n)
    phase: Dict[str, Phase] = {}
    for n in names:
        if n in retrofitted:
            phase[n] = Phase.FORWARD
        elif n in gradient or (n in below and n in above):
            phase[n] = Phase.BACKWARD
        elif n in below:
            phase[n] = Phase.UPDATE
    # A constant or variable-derived op that only feeds one later phase belongs to it (the
    # loss-gradient seed `ones`, the optimizer's learning-rate read). Data-dependent ops
    # never move: the loss itself feeds only gradient ops until TF adds the outputs.
    for n in reversed(names):
        if n in phase or n in data_dependent or not succs[n]:
            continue
        consumer_phases = {phase.get(s, Phase.FORWARD) for s in succs[n]}
        if consumer_phases == {Phase.UPDATE}:
            phase[n] = Phase.UPDATE
        elif Phase.FORWARD not in consumer_phases:
            phase[n] = Phase.BACKWARD
    return {n: phase.get(n, Phase.FORWARD) for n in names}


def _static_shape(shape: tf.TensorShape) -> Optional[Tuple[Optional[int], ...]]:
    if shape.rank is None:
        return None
    return tuple(shape.as_list())


def _nbytes(dtype: tf.DType, shape) -> Optional[int]:
    if shape is None or any(d is None for d in shape):
        return None
    if dtype in (tf.resource, tf.variant, tf.string):
        return None
    count = 1
    for d in shape:
        count *= d
    return count * dtype.size


def _function_inputs(graph: tf.Graph) -> FrozenSet[str]:
    if _compat.is_function_graph(graph):
        return frozenset(t.op.name for t in graph.inputs)
    return frozenset(op.name for op in graph.get_operations() if op.type in ("Placeholder", "PlaceholderV2"))


def build_ir(graph: tf.Graph, *, input_shapes: Optional[Mapping[str, Sequence[Optional[int]]]] = None,
             batch_size: Optional[int] = None) -> GraphIR:
    """Builds the IR of a traced graph.

    Unknown dimensions are resolved by running TensorFlow's shape inference again with
    concrete shapes for the function inputs: ``input_shapes`` (placeholder name ->
    shape, e.g. taken from the arguments of the call that traced the function) and,
    for inputs whose leading (batch) dimension is still unknown, ``batch_size``.
    Tensors whose size stays unknown get ``nbytes=None``; nothing is ever assumed to be 1.

    Args:
        graph: A ``tf.Graph`` or the ``FuncGraph`` of a ``tf.function``.
        input_shapes: Concrete shapes of input placeholders, by op name (or tensor name).
        batch_size: Size to give unknown leading dimensions of the inputs and iterator outputs.

    Returns:
        The GraphIR.

    Raises:
        GraphAnalysisError: The graph has a cycle or an input shape contradicts the graph.

    Example:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> g = f.get_concrete_function(tf.TensorSpec((None, 8))).graph
        >>> build_ir(g, batch_size=4).tensors["Relu:0"].nbytes
        128
    """
    tf_ops = graph.get_operations()
    order = _execution_order(tf_ops)
    inputs = _function_inputs(graph)
    sources = frozenset(
        {n for n in inputs if graph.get_operation_by_name(n).outputs[0].dtype not in (tf.resource, tf.variant)}
        | {op.name for op in tf_ops if op.type in DATA_SOURCE_OP_TYPES})
    data_dependent = _data_dependent(order, sources)
    phases = _classify(order, {op.name: i for i, op in enumerate(tf_ops)}, data_dependent)

    # Concrete shapes for the batch-carrying tensors, by tensor name.
    resolution: Dict[str, Tuple[Optional[int], ...]] = {}
    for name, shape in (input_shapes or {}).items():
        resolution[name if ":" in name else name + ":0"] = tuple(shape)
    if batch_size is not None:
        for name in sorted(sources):
            for out in graph.get_operation_by_name(name).outputs:
                if out.dtype in (tf.resource, tf.variant) or out.shape.rank in (None, 0):
                    continue
                dims = list(resolution.get(out.name, out.shape.as_list()))
                if dims[0] is None:
                    dims[0] = batch_size
                    resolution[out.name] = tuple(dims)
    inferred: Dict[str, tf.TensorShape] = {}
    needs_inference = any(
        not t.shape.is_fully_defined() and t.dtype not in (tf.resource, tf.variant)
        for op in tf_ops for t in op.outputs)
    if resolution and needs_inference:
        for name, dims in resolution.items():
            static = graph.get_tensor_by_name(name).shape
            if not static.is_compatible_with(tf.TensorShape(dims)):
                raise GraphAnalysisError(
                    f"input {name!r} has traced shape {static} but a concrete shape {tuple(dims)} was given "
                    f"for it; pass a batch_size/input shape compatible with the traced signature.")
        inferred = _compat.infer_shapes_with_inputs(
            graph, {n: tf.TensorShape(d) for n, d in resolution.items()})

    consumers: Dict[str, List[str]] = {}
    for op in order:
        for t in op.inputs:
            consumers.setdefault(t.name, []).append(op.name)

    ops: List[OpInfo] = []
    tensors: Dict[str, TensorInfo] = {}
    for index, op in enumerate(order):
        for out in op.outputs:
            shape = out.shape
            if not shape.is_fully_defined() and out.name in inferred:
                shape = shape.merge_with(inferred[out.name]) if shape.is_compatible_with(inferred[out.name]) else shape
            dims = _static_shape(shape)
            tensors[out.name] = TensorInfo(
                name=out.name, dtype=out.dtype.name, shape=dims, nbytes=_nbytes(out.dtype, dims),
                producer=op.name, consumers=tuple(consumers.get(out.name, ())))
        ops.append(OpInfo(
            name=op.name, type=op.type, index=index, phase=phases[op.name], device=op.device,
            inputs=tuple(t.name for t in op.inputs),
            control_inputs=tuple(c.name for c in op.control_inputs),
            outputs=tuple(t.name for t in op.outputs), stateful=bool(op.op_def.is_stateful)))
    return GraphIR(ops=tuple(ops), tensors=tensors, function_inputs=inputs, resolved_dims=resolution,
                   data_dependent=data_dependent)
