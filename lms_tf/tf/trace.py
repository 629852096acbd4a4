"""Builds the graph IR (:mod:`lms_tf.core.ir`) from a traced TensorFlow graph.

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

import functools
import heapq
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import GraphAnalysisError
from lms_tf.core.ir import GraphIR, OpInfo, Phase, TensorInfo, is_gradient_scoped
from lms_tf.core.op_kinds import DATA_SOURCE_OP_TYPES


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


def trace_step_ir(step: Callable, *args, wrap: Optional[Callable[[Callable], Callable]] = None,
                  batch_size: Optional[int] = None) -> GraphIR:
    """The IR of ``step`` traced on ``args`` as the front-ends see it, without running it.

    The IR is built inside the trace right after ``step`` returns, as the front-ends' driver
    builds it, before TensorFlow adds the automatic control dependencies that end a trace: a plan
    made from it is the plan ``lms_tf.function`` (or, with ``wrap``, ``LMSCallback``) would make.

    Args:
        step: The step function (AutoGraph converts it, as ``tf.function`` does).
        *args: Arguments to trace it with (tensors or specs).
        wrap: Builds the traced function around the capturing step (e.g. Keras's strategy call).
        batch_size: Size to give batch dimensions the trace leaves unknown.

    Example:
        >>> import tensorflow as tf
        >>> ir = trace_step_ir(lambda x: tf.nn.relu(x) * 2.0, tf.TensorSpec((None, 8)), batch_size=4)
        >>> ir.tensors["Relu:0"].nbytes
        128
    """
    captured: Dict[str, GraphIR] = {}

    @tf.autograph.experimental.do_not_convert
    def capture() -> None:
        captured["ir"] = build_ir(_compat.current_graph(), batch_size=batch_size)

    @functools.wraps(step)  # as lms_tf.function's wrapper: the inputs are named after step's parameters
    def capturing(*args):
        outputs = step(*args)
        capture()
        return outputs

    tf.function(wrap(capturing) if wrap else capturing).get_concrete_function(*args)
    return captured["ir"]

