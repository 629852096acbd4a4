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

Examples:
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
from lms_tf.core.errors import GraphAnalysisError, warn_once
from lms_tf.core.ir import GraphIR, OpInfo, Phase, TensorInfo, is_gradient_scoped
from lms_tf.core.op_kinds import (
    DATA_SOURCE_OP_TYPES,
    LIST_CONSTRUCTOR_TYPES,
    STATE_READ_TYPES,
    VARIABLE_READ_TYPES,
    VARIABLE_UPDATE_PREFIXES,
    WHILE_OP_TYPES,
)


def _control_inputs(op: tf.Operation, automatic: Mapping[str, Sequence[str]]) -> Tuple[str, ...]:
    """The ops ``op`` will wait for through control edges: those in the graph now and those
    ``tf.function``'s automatic control dependencies add when the trace ends (``automatic``,
    from :func:`lms_tf._compat.automatic_control_edges`). The pass reads the step while it is
    traced, before they exist; without them, half of Adam's update (the reads of a moment after
    its write) looked like forward ops and ran on the device in the simulator."""
    present = [c.name for c in op.control_inputs]
    return tuple(present + [name for name in automatic.get(op.name, ()) if name not in present])


def _execution_order(ops: Sequence[tf.Operation], automatic: Mapping[str, Sequence[str]]) -> List[tf.Operation]:
    """Kahn's topological sort over data and control edges (``automatic``: those the trace's end
    will add); ties go to the op created first."""
    position = {op.name: i for i, op in enumerate(ops)}
    indegree = {op.name: 0 for op in ops}
    successors: Dict[str, List[str]] = {op.name: [] for op in ops}
    for op in ops:
        preds = {t.op.name for t in op.inputs} | set(_control_inputs(op, automatic))
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
              data_dependent: FrozenSet[str], automatic: Mapping[str, Sequence[str]]) -> Dict[str, Phase]:
    names = [op.name for op in order]
    preds = {op.name: {t.op.name for t in op.inputs} | set(_control_inputs(op, automatic)) for op in order}
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


def pruned_by_the_runtime(graph: tf.Graph, order: Sequence[tf.Operation],
                          outputs: Optional[Sequence[tf.Tensor]]) -> FrozenSet[str]:
    """Ops of a ``tf.function``'s graph that TensorFlow never runs: neither the function's outputs nor
    any stateful op (a variable write, a read, a random op, a loop) depends on them, through data
    or control edges. TensorFlow's function runtime prunes them before the first run
    (``PruneFunctionBody`` keeps what the outputs, the control outputs and the stateful ops need).

    They are not rare in a training step: a custom gradient computes every input's gradient, and
    the ones nobody asked for are dropped. ``tf.nn.silu``'s gradient squares its input for the
    gradient of its constant ``beta``: two activation-sized tensors per swish that, counted,
    made EfficientNetB0's simulated peak 1.46x the real one.

    Where the outputs are not known (a graph that is not a function's, or a trace still going on
    without ``outputs``), every op nothing reads might be fetched: those are kept too.

    Args:
        graph: The step's graph.
        order: Its ops, producers before consumers (``graph.get_operations()`` is such an order).
        outputs: The tensors the function returns, when known.

    Returns:
        The names of the ops the runtime prunes.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.compat.v1.placeholder(tf.float32, name="x")
        ...     kept, dropped = tf.square(x, name="kept"), tf.exp(x, name="dropped")
        >>> sorted(pruned_by_the_runtime(g, g.get_operations(), [kept]))
        ['dropped']
    """
    if outputs is None and _compat.is_function_graph(graph) and graph.outputs:
        outputs = graph.outputs
    if outputs is not None:
        needed = {t.op.name for t in outputs if isinstance(t, tf.Tensor) and t.graph is graph}
    else:
        needed = {op.name for op in order if _compat.is_dead_end(op)}
    if _compat.is_function_graph(graph):
        needed |= {op.name for op in graph.control_outputs}
    needed |= {op.name for op in order if op.op_def.is_stateful and op.name not in needed}
    for op in reversed(order):  # consumers come after their producers in ``order``
        if op.name in needed:
            needed.update(t.op.name for t in op.inputs)
            needed.update(c.name for c in op.control_inputs)
    inputs = _function_inputs(graph)  # the signature's own: an unused argument is still passed
    return frozenset(op.name for op in order if op.name not in needed and op.name not in inputs)


#: Arithmetic Grappler's constant folding removes when one operand is a constant of ones or zeros
#: (``SimplifyArithmeticOperations``): op types -> (the constant's value, whether it may stand first).
_IDENTITY_ARITHMETIC = {
    **{t: (1.0, True) for t in ("Mul", "MulNoNan")},  # 1 * x, x * 1
    **{t: (1.0, False) for t in ("Div", "RealDiv", "DivNoNan", "TruncateDiv")},  # x / 1
    **{t: (0.0, True) for t in ("Add", "AddV2")},  # 0 + x, x + 0
    "BiasAdd": (0.0, False),
    "Sub": (0.0, False),  # x - 0 (0 - x becomes a negation)
}


def _passed_through(op: tf.Operation) -> Optional[int]:
    """The input ``op`` passes on unchanged when Grappler removes it as ``x * 1`` or ``x + 0``;
    None for any other op.

    Grappler's constant folding replaces such an op by its other operand when that operand already
    has the output's shape (an unknown batch dimension is the same symbol in both), and the
    readers then read that operand's buffer: the op allocates nothing. ``tf.nn.silu``'s gradient
    multiplies its input by ``beta = 1.0``: held from the forward pass to the backward, that
    product was counted as one more activation per swish.
    """
    rule = _IDENTITY_ARITHMETIC.get(op.type)
    if rule is None or len(op.inputs) != 2 or op.outputs[0].shape.rank is None:
        return None
    value, either_side = rule
    for position in ((0, 1) if either_side else (1,)):
        constant, other = op.inputs[position], op.inputs[1 - position]
        if (constant.op.type == "Const" and other.shape.as_list() == op.outputs[0].shape.as_list()
                and _all_equal(constant.op, value)):
            return 1 - position
    return None


def _all_equal(const: tf.Operation, value: float) -> bool:
    """Whether every element of a ``Const`` op's value is ``value``."""
    try:
        array = tf.make_ndarray(const.get_attr("value"))
    except (TypeError, ValueError):  # a string or variant constant
        return False
    return array.dtype.kind in "fiuc" and array.size > 0 and bool((array == value).all())


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


@tf.autograph.experimental.do_not_convert  # also called from inside traced steps (tests, tools)
def build_ir(graph: tf.Graph, *, input_shapes: Optional[Mapping[str, Sequence[Optional[int]]]] = None,
             batch_size: Optional[int] = None, outputs: Optional[Sequence[tf.Tensor]] = None) -> GraphIR:
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
        outputs: The tensors the step returns, when its trace is still going on (a finished
            function's graph knows them). Ops that neither these nor a stateful op need are left
            out, as TensorFlow prunes them before running the step. Without them, and in a
            graph that is not a function's, every op nothing reads is taken to be needed.

    Returns:
        The GraphIR.

    Raises:
        GraphAnalysisError: The graph has a cycle or an input shape contradicts the graph.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> g = f.get_concrete_function(tf.TensorSpec((None, 8))).graph
        >>> ir = build_ir(g, batch_size=4)
        >>> ir.tensors["Relu:0"].nbytes, ir.tensors["x:0"].nbytes   # the input itself is sized too
        (128, 128)
    """
    tf_ops = graph.get_operations()
    automatic = _compat.automatic_control_edges(tf_ops)
    order = _execution_order(tf_ops, automatic)
    pruned = pruned_by_the_runtime(graph, order, outputs)
    inputs = _function_inputs(graph)
    sources = frozenset(
        {n for n in inputs if graph.get_operation_by_name(n).outputs[0].dtype not in (tf.resource, tf.variant)}
        | {op.name for op in tf_ops if op.type in DATA_SOURCE_OP_TYPES})
    data_dependent = _data_dependent(order, sources)
    phases = _classify(order, {op.name: i for i, op in enumerate(tf_ops)}, data_dependent, automatic)
    after_gradient = _ordered_after_the_gradient(tf_ops, phases, automatic)

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

    # The step as TensorFlow runs it: without the ops its function runtime prunes.
    order = [op for op in order if op.name not in pruned]
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
            if not shape.is_fully_defined() and out.name in resolution:  # an input itself: the shape it was given
                shape = shape.merge_with(tf.TensorShape(resolution[out.name]))
            dims = _static_shape(shape)
            dtype, nbytes = out.dtype, _nbytes(out.dtype, dims)
            accumulator = _loop_accumulator(op, out, batch_size) if op.type in WHILE_OP_TYPES else None
            if accumulator is not None:
                dtype, dims, shares_a_variable = accumulator
                # A variable read pushed every iteration: the elements are the variable's own buffer.
                nbytes = 0 if shares_a_variable else _nbytes(dtype, dims)
            tensors[out.name] = TensorInfo(
                name=out.name, dtype=dtype.name, shape=dims, nbytes=nbytes,
                producer=op.name, consumers=tuple(consumers.get(out.name, ())))
        ops.append(OpInfo(
            name=op.name, type=op.type, index=index, phase=phases[op.name], device=op.device,
            inputs=tuple(t.name for t in op.inputs),
            control_inputs=_control_inputs(op, automatic),
            outputs=tuple(t.name for t in op.outputs), stateful=bool(op.op_def.is_stateful),
            reads_state_only=(op.type in _FUNCTIONAL_TYPES and _functions_read_state_only(graph, op)
                              and _variables_unwritten_before_gradient(op, after_gradient)),
            inner_kernels=_loop_kernels(op) if op.type in WHILE_OP_TYPES else 0,
            passes_through=_passed_through(op)))
    compiled_for, compiled_scratch = _ask_xla_for_temporaries(graph, order, tensors)
    return GraphIR(ops=tuple(ops), tensors=tensors, function_inputs=inputs, resolved_dims=resolution,
                   data_dependent=data_dependent, compiled_scratch=compiled_scratch, compiled_for=compiled_for)


#: XLA's temporaries per (function, input shapes, device type): a step is traced, and its IR built,
#: more than once (max-batch sizes several batches; each trace of a step names its functions anew).
_COMPILED_SCRATCH: Dict[Tuple[str, Tuple, str], int] = {}


def _ask_xla_for_temporaries(graph: tf.Graph, order: Sequence[tf.Operation],
                             tensors: Mapping[str, TensorInfo]) -> Tuple[str, Dict[str, int]]:
    """The device type the step's XLA-compiled calls are planned for (a GPU when one is visible,
    as the runtime places them) and each call's temporaries, from XLA's own buffer plan
    (:func:`lms_tf._compat.compiled_temp_bytes`). A call XLA cannot be asked about is left out
    with a warning that names it: the simulator then counts its inputs and outputs only."""
    calls = [op for op in order if _compat.must_compile(op)]
    if not calls:
        return "", {}
    device_type = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    scratch: Dict[str, int] = {}
    for op in calls:
        shapes = tuple(tensors[t.name].shape for t in op.inputs)
        key = (op.get_attr("f").name, shapes, device_type)
        if key not in _COMPILED_SCRATCH:
            try:
                _COMPILED_SCRATCH[key] = _compat.compiled_temp_bytes(graph, op, shapes, device_type)
            except (ValueError, tf.errors.OpError) as err:
                warn_once(f"compiled-scratch:{key[0]}",
                          f"lms-tf: the memory XLA takes while {op.name} runs (a function compiled with "
                          f"jit_compile=True inside the step) is not counted: XLA could not be asked for its "
                          f"buffer plan ({err}). This step's predicted peaks can be low by that much.")
                continue
        scratch[op.name] = _COMPILED_SCRATCH[key]
    return device_type, scratch


_FUNCTIONAL_TYPES = WHILE_OP_TYPES | {"If", "StatelessIf"}


def _static_int(tensor: tf.Tensor) -> Optional[int]:
    """The value of a scalar int tensor computed from constants (Keras's ``Max`` of the time steps)."""
    value = tf.get_static_value(tensor)
    op = tensor.op
    if value is None and op.type in ("Max", "Min", "Identity"):
        source = tf.get_static_value(op.inputs[0])
        if source is not None and getattr(source, "ndim", 1) == 0:  # a reduction of a scalar is the scalar
            value = source
    try:
        return int(value) if value is not None and getattr(value, "ndim", 0) == 0 else None
    except (TypeError, ValueError):
        return None


def _loop_accumulator(op: tf.Operation, out: tf.Tensor, batch_size: Optional[int]):
    """(element dtype, (iterations, *element shape), whether the elements are a variable's reads) of a
    ``While`` output that is a TensorList accumulator built by ``EmptyTensorList``/``TensorListReserve``
    with a static size, else None.

    The gradient of a ``While`` loop reads per-iteration values of the forward loop from such
    lists, which the forward loop fills (one element per iteration) and returns as outputs.
    """
    if out.dtype != tf.variant or out.value_index >= len(op.inputs):
        return None
    shares_a_variable = _pushed_values(op).get(out.value_index) in VARIABLE_READ_TYPES
    init = op.inputs[out.value_index].op
    if init.type not in LIST_CONSTRUCTOR_TYPES:
        return None
    count = _static_int(init.inputs[1])
    element = tf.get_static_value(init.inputs[0])
    if count is None or count < 0 or element is None or getattr(element, "ndim", 0) != 1:
        return None
    dims = [int(d) for d in element]
    if dims and dims[0] == -1 and batch_size is not None:
        dims[0] = batch_size  # traced with an unknown batch dimension
    if any(d < 0 for d in dims):
        return None
    return tf.as_dtype(init.get_attr("element_dtype")), (count, *dims), shares_a_variable


def _ordered_after_the_gradient(ops: Sequence[tf.Operation], phases: Mapping[str, Phase],
                                automatic: Mapping[str, Sequence[str]]) -> FrozenSet[str]:
    """Ops that run after some backward op: its data and control descendants, counting the edges
    ``tf.function``'s automatic control dependencies add when the trace ends (``automatic``, from
    :func:`lms_tf._compat.automatic_control_edges`). Through those edges an op reading a variable
    runs after the writes to it created before it, so Keras's momentum SGD and Adam, which write a
    slot and then add a read of it to the weight, update the weight after the gradient."""
    after = set()
    for op in ops:  # creation order: every op an op waits for was created before it
        if (phases.get(op.name) is Phase.BACKWARD or any(t.op.name in after for t in op.inputs)
                or any(c.name in after for c in op.control_inputs)
                or any(name in after for name in automatic.get(op.name, ()))):
            after.add(op.name)
    return frozenset(after)


def _variables_unwritten_before_gradient(op: tf.Operation, after_gradient: FrozenSet[str]) -> bool:
    """Whether every write to a variable ``op`` reads runs after the gradient (so a copy of ``op``
    run in the backward pass reads the values the original read)."""
    for handle in (t for t in op.inputs if t.dtype == tf.resource):
        for reader in handle.consumers():
            if reader.type.startswith(VARIABLE_UPDATE_PREFIXES) and reader.name not in after_gradient:
                return False
    return True


@functools.lru_cache(maxsize=256)
def _pushed_values_of(graph: tf.Graph, body_name: str) -> Dict[int, str]:
    definition = _compat.function_def(graph, body_name)
    if definition is None:
        return {}
    args = {arg.name: i for i, arg in enumerate(definition.signature.input_arg)}
    nodes = {node.name: node for node in definition.node_def}

    def source_type(reference: str) -> str:
        name = reference.split(":")[0]
        while name in nodes and nodes[name].op == "Identity":
            name = nodes[name].input[0].split(":")[0]
        return nodes[name].op if name in nodes else "_Arg"

    return {args[node.input[0].split(":")[0]]: source_type(node.input[1])
            for node in definition.node_def
            if node.op == "TensorListPushBack" and node.input[0].split(":")[0] in args}


def _pushed_values(loop: tf.Operation) -> Dict[int, str]:
    """Loop variable index -> type of the op whose value the body pushes onto that TensorList
    (``"_Arg"`` for a loop variable itself, i.e. the previous iteration's value)."""
    return _pushed_values_of(loop.graph, loop.get_attr("body").name)


_NOT_KERNELS = frozenset({"Const", "Identity", "NoOp", "_Arg", "_Retval"})


def _loop_kernels(loop: tf.Operation) -> int:
    """Kernels a loop runs: its body's (the cheap bookkeeping ops left out) times its static trip
    count (the ``maximum_iterations`` input), or 0 when either is unknown."""
    trips = _static_int(loop.inputs[1]) if len(loop.inputs) > 1 else None
    definition = _compat.function_def(loop.graph, loop.get_attr("body").name)
    if not trips or trips < 0 or definition is None:
        return 0
    return trips * sum(node.op not in _NOT_KERNELS for node in definition.node_def)


def _functions_read_state_only(graph: tf.Graph, op: tf.Operation) -> bool:
    """Whether every stateful op in ``op``'s functions (and the functions they call) only reads state."""
    pending = [attr.func.name for attr in op.node_def.attr.values() if attr.HasField("func")]
    seen = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        definition = _compat.function_def(graph, name)
        if definition is None:
            return False
        for node in definition.node_def:
            for attr in node.attr.values():
                if attr.HasField("func"):
                    pending.append(attr.func.name)
            if node.op in _FUNCTIONAL_TYPES or node.op in ("PartitionedCall", "StatefulPartitionedCall"):
                continue  # its functions are checked in turn
            if _compat.op_is_stateful(node.op) and node.op not in STATE_READ_TYPES:
                return False
    return True


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

    Examples:
        >>> import tensorflow as tf
        >>> ir = trace_step_ir(lambda x: tf.nn.relu(x) * 2.0, tf.TensorSpec((None, 8)), batch_size=4)
        >>> ir.tensors["Relu:0"].nbytes
        128
    """
    captured: Dict[str, GraphIR] = {}

    @tf.autograph.experimental.do_not_convert
    def capture(outputs) -> None:
        graph = _compat.current_graph()
        returned = [t for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor) and t.graph is graph]
        captured["ir"] = build_ir(graph, batch_size=batch_size, outputs=returned)

    @functools.wraps(step)  # as lms_tf.function's wrapper: the inputs are named after step's parameters
    def capturing(*args):
        outputs = step(*args)
        capture(outputs)
        return outputs

    tf.function(wrap(capturing) if wrap else capturing).get_concrete_function(*args)
    return captured["ir"]

