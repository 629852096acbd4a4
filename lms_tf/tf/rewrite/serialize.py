"""The serialization step: the step's ops run one at a time, in an order given by rank.

TFLMS called this serialization. Here the order is the simulator's, so the step really
runs in the order its memory was predicted for. This does two things:

- On a CPU, it validates the simulator's memory rules without the executor's scheduling
  noise. TensorFlow's CPU executor picks among ready ops differently from one process to
  the next.
- On a GPU, it makes the simulated peak hold.

What it inserts: a control edge between consecutive ranked ops, in a topological order of the
graph that follows the ranks where the graph allows it. Unranked ops (alias ops, swap copies)
keep their own edges only, so copies still overlap compute.

Only ops that read the step's inputs are chained, directly or through other ops. The step's
inputs are its non-resource placeholders. The ops left free are constants, variable reads,
and what is computed from them alone. Variables created in the first trace (optimizer slots)
have their initializers lifted out of the graph after the trace, and a control input from
the step would make that impossible.

Collective ops (Horovod's allreduces) and every op downstream of one are left free too: a
collective waits for all ranks, so an op chained behind it would stall this rank's compute on
the slowest rank, and a gradient bucket chained into the backward order could no longer be sent
while the backward pass goes on (the pipelining).

Ops that TensorFlow fuses into one kernel are left free as well, because a control edge
changes the kernel:

- Grappler's remapper fuses Conv2D/MatMul + BiasAdd + activation (and, with oneDNN, more
  patterns) only when no node of the pattern has a control edge. Chaining them would run
  unfused kernels, whose results differ in the last bits: the numbers would change. Which ops
  the default pipeline fuses or rewrites is read off running it offline on the step
  (:func:`grappler_rewritten_ops`).
- After Grappler, oneDNN fuses a ``BiasAddGrad`` into the ``Conv2DBackpropFilter`` or
  ``MatMul`` beside it (only when neither has a control edge), and the fused kernel inherits
  both ops' control edges: chaining only one of them closes a cycle when the chain put
  anything between the two, and chaining both runs unfused kernels. Both are left free. After
  the fusion the bias gradient comes out of the partner, so it waits for the partner's inputs
  too: the order the chain follows counts those as inputs of the ``BiasAddGrad``
  (:func:`fused_kernel_waits`), so the ops that read it (the bias's update) are chained after
  them. Chained in an order that ignored this, the bias's update (the SGD ``Mul`` and
  ``AssignSubVariableOp``) sat before a recomputed activation the partner reads, and closed a
  cycle on ResNet-50 224² with a recompute plan ("778 nodes in a cycle"); left free instead, it
  took the rest of the backward pass off the chain wherever the plan gated a recompute on it.
  The pair itself takes no edge, but the chained op after it waits for an ``Identity`` reading
  the bias gradient (:func:`gate_free_ops`), so it cannot run after its place.
- oneDNN extends a fused contraction by the elementwise op that alone reads it (MatMul +
  BiasAdd + the residual Add, in bfloat16), where the offline pipeline shows no such fusion:
  that reader is left free too.

Left free, such an op would run as soon as its inputs are ready (a recomputed convolution at
once). :func:`serialize_step` holds each at its place instead, with no control edge on it: its
reads of outside values wait behind a kept ``Identity`` gate, and the next chained op waits for
an ``Identity`` that reads its result (:func:`gate_free_ops`). Grappler is then run offline on
the held step, and any gate after which it runs another kernel or reads operands in another
order is taken out again.

An ``IdentityN`` waits for all of its inputs, and Grappler prunes it. Before the chain is
added, its readers are re-pointed to its inputs, so that a rank order that never waited for
it stays feasible. The values are unchanged.

Examples:
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     a = tf.compat.v1.placeholder(tf.float32, name="a")
    ...     b = tf.negative(a, name="b")
    ...     c = tf.sqrt(a, name="c")
    >>> impose_order(g, {"c": 0, "b": 1})
    1
    >>> [op.name for op in g.get_operation_by_name("b").control_inputs]
    ['c']
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from typing import Collection, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import RewriteError
from lms_tf.core.ir import device_kind_and_index
from lms_tf.core.op_kinds import (
    CONV_TYPES,
    FORWARDING_TYPES,
    MATMUL_TYPES,
    FUSABLE_GATE_PARTNER_TYPES,
    FUSABLE_GATE_TYPES,
    is_collective,
)

from lms_tf.tf.rewrite.common import LMS_ATTR, mark
from lms_tf.tf.trace import pruned_by_the_runtime

SERIAL_ATTR = "_lms_serial"  # an op's position in the chain


def bypass_identity_n(graph: tf.Graph) -> int:
    """Re-points every reader of an ``IdentityN`` output to the matching input.

    Returns:
        How many inputs were re-pointed.

    Examples:
        >>> bypass_identity_n(tf.Graph())
        0
    """
    moved = 0
    for op in graph.get_operations():
        if op.type != "IdentityN":
            continue
        for position, output in enumerate(op.outputs):
            for reader in list(output.consumers()):
                for index, tensor in enumerate(reader.inputs):
                    if tensor is output:
                        _compat.update_input(reader, index, op.inputs[position])
                        moved += 1
    return moved


def ranked_topological_order(graph: tf.Graph, rank: Mapping[str, float],
                             extra_waits: Optional[Mapping[str, Collection[str]]] = None) -> List[str]:
    """A topological order of ``graph``'s ops (data and control edges).

    Among ready ops, an unranked one goes first (in creation order), then the lowest rank.

    Args:
        graph: The graph.
        rank: Op name -> rank; lower runs first.
        extra_waits: Op name -> ops it waits for at run time beyond its edges (what a kernel it
            is fused into reads: :func:`fused_kernel_waits`).

    Raises:
        RewriteError: The graph has a cycle.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a = tf.constant(1.0, name="a")
        ...     b, c = tf.negative(a, name="b"), tf.sqrt(a, name="c")
        >>> ranked_topological_order(g, {"b": 1, "c": 0})
        ['a', 'c', 'b']
    """
    ops = graph.get_operations()
    created = {op.name: i for i, op in enumerate(ops)}
    waiting: Dict[str, int] = {}
    readers: Dict[str, List[str]] = {op.name: [] for op in ops}
    for op in ops:
        preds = {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}
        preds |= set((extra_waits or {}).get(op.name, ()))
        waiting[op.name] = len(preds)
        for pred in preds:
            readers[pred].append(op.name)

    def key(name: str):
        return (name in rank, rank.get(name, 0.0), created[name], name)

    ready = [key(name) for name, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: List[str] = []
    while ready:
        name = heapq.heappop(ready)[-1]
        order.append(name)
        for reader in readers[name]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, key(reader))
    if len(order) < len(ops):
        stuck = [name for name, count in waiting.items() if count > 0][:5]
        raise RewriteError(f"graph {getattr(graph, 'name', '')!r} has a cycle through {stuck}; "
                           f"it cannot be serialized.")
    return order


def serial_chain(graph: tf.Graph) -> List[tf.Operation]:
    """The ops :func:`impose_order` chained, in chain order (empty for a graph it did not touch).

    Examples:
        >>> serial_chain(tf.Graph())
        []
    """
    chained = [op for op in graph.get_operations() if SERIAL_ATTR in op.node_def.attr]
    return sorted(chained, key=lambda op: op.get_attr(SERIAL_ATTR))


def grappler_rewritten_ops(graph: tf.Graph, device: str, memory_bytes: int, *,
                           outputs: Optional[Sequence[tf.Tensor]] = None, removed_only: bool = False,
                           folded_shapes_unchanged: bool = False) -> FrozenSet[str]:
    """The ops of ``graph`` that TensorFlow's default Grappler pipeline fuses, folds or regroups
    (with ``removed_only``, those it leaves out of its result: the inner ops of a fused or
    regrouped group, whose last op keeps its name).

    Runs the pipeline offline, as the runtime will before the first run, with every op on one
    virtual device of ``device``'s type (the remapper's patterns differ between CPU and GPU), and
    returns the ops that are gone from its result, have another op type there, or read other
    values (constant folding regroups ``c * (x * y)`` without renaming anything).

    Args:
        graph: The step's graph (it may still be being traced).
        device: The step's device, e.g. ``"/device:GPU:0"``.
        memory_bytes: The memory the runtime tells Grappler the device has.
        outputs: The tensors the step returns, when known. The runtime keeps those and the
            stateful ops and prunes the rest (a gradient nothing reads, Keras's spare identities
            of each gradient); an op such a dead end reads has one more reader offline than at
            run time, which keeps Grappler from regrouping it. Without ``outputs``, every op
            nothing reads is kept: fewer rewrites are found, never a rewrite that does not happen.
        removed_only: Only the ops left out of the result.
        folded_shapes_unchanged: An op whose shape input (a convolution gradient's sizes, a
            ``ShapeN``) Grappler only replaced by the constant it knows is not counted: it runs
            the same kernel on the same values.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        ...     w, b = tf.compat.v1.placeholder(tf.float32, (8, 8)), tf.compat.v1.placeholder(tf.float32, (8,))
        ...     y = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w, name="mm"), b, name="bias"), name="act")
        >>> sorted(grappler_rewritten_ops(g, "/device:CPU:0", 2**28) & {"mm", "bias", "act"})
        ['act', 'bias', 'mm']
        >>> sorted(grappler_rewritten_ops(g, "/device:CPU:0", 2**28, removed_only=True) & {"mm", "bias", "act"})
        ['bias', 'mm']
    """
    graph_def, optimized, in_graph = _offline_default_pipeline(graph, device, memory_bytes, outputs)
    if removed_only:
        kept = {node.name for node in optimized.node}
        return frozenset(node.name for node in graph_def.node if node.name not in kept and node.name in in_graph)
    return frozenset(name for name in _changed_nodes(graph_def, optimized, folded_shapes_unchanged)
                     if name in in_graph)


def _offline_default_pipeline(graph: tf.Graph, device: str, memory_bytes: int,
                              outputs: Optional[Sequence[tf.Tensor]]):
    """Runs Grappler's default pipeline on ``graph`` as the runtime will (see
    :func:`grappler_rewritten_ops`); returns (the graph's GraphDef, the optimized GraphDef, the
    names of ``graph``'s own ops)."""
    kind = tf.DeviceSpec.from_string(device).device_type or "CPU"
    virtual = f"/job:localhost/replica:0/task:0/device:{kind}:0"
    # Variables as the runtime's function arguments, with their shapes: Grappler rewrites by them.
    graph_def = _compat.function_body_graph_def(graph)
    for node in graph_def.node:
        node.device = virtual
    ops = graph.get_operations()
    if outputs is not None:
        returned = {tensor.op.name for tensor in outputs}
    else:  # every dead end may be returned
        returned = {op.name for op in ops if _compat.is_dead_end(op)}
    fetches = sorted(returned | {op.name for op in ops if _compat.op_is_stateful(op.type)})
    optimized = _compat.grappler_default_optimized(graph_def, fetches, (virtual, kind, memory_bytes))
    in_graph = {op.name for op in ops}  # not the defaults function_body_graph_def gives the inputs
    return graph_def, optimized, in_graph


#: The prefix of the op types Grappler's remapper fuses a pattern into (``_FusedConv2D``,
#: ``_FusedMatMul``, ``_FusedBatchNormEx``...): the pattern's last op keeps its name.
_FUSED_KERNEL_PREFIX = "_Fused"


@dataclasses.dataclass(frozen=True)
class FusedKernel:
    """One kernel Grappler's remapper fuses several ops of a step into.

    Attributes:
        name: The fused op's name: the pattern's last op keeps its name.
        kernel: Its op type after Grappler, e.g. ``"_FusedConv2D"``.
        ops: The step's ops the kernel runs: ``name`` and the ops of the pattern it removes.
        entries: ``(op, input index)`` of each read by one of ``ops`` of a value from outside the
            pattern that the fused kernel reads too.

    Examples:
        >>> FusedKernel("act", "_FusedMatMul", frozenset({"mm", "bias", "act"}), (("mm", 0),)).kernel
        '_FusedMatMul'
    """

    name: str
    kernel: str
    ops: FrozenSet[str]
    entries: Tuple[Tuple[str, int], ...]


def grappler_fused_kernels(graph: tf.Graph, device: str, memory_bytes: int, *,
                           outputs: Optional[Sequence[tf.Tensor]] = None) -> List[FusedKernel]:
    """The kernels Grappler's remapper fuses ops of ``graph`` into, read off running the default
    pipeline offline as :func:`grappler_rewritten_ops` does.

    Args:
        graph: The step's graph (it may still be being traced).
        device: The step's device, e.g. ``"/device:GPU:0"``.
        memory_bytes: The memory the runtime tells Grappler the device has.
        outputs: The tensors the step returns, when known.

    Returns:
        One :class:`FusedKernel` per fused op of the optimized graph that keeps a name of ``graph``.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        ...     w, b = tf.compat.v1.placeholder(tf.float32, (8, 8)), tf.compat.v1.placeholder(tf.float32, (8,))
        ...     y = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w, name="mm"), b, name="bias"), name="act")
        >>> [(k.name, k.kernel, sorted(k.ops)) for k in grappler_fused_kernels(g, "/device:CPU:0", 2**28)]
        [('act', '_FusedMatMul', ['act', 'bias', 'mm'])]
    """
    graph_def, optimized, in_graph = _offline_default_pipeline(graph, device, memory_bytes, outputs)
    return _fused_kernels(graph_def, optimized, in_graph)


def _fused_kernels(graph_def, optimized, in_graph) -> List[FusedKernel]:
    before, after = _NodeInputs(graph_def), _NodeInputs(optimized)
    kernels = []
    for node in optimized.node:
        if not node.op.startswith(_FUSED_KERNEL_PREFIX) or node.name not in in_graph or node.name not in before.nodes:
            continue
        members, frontier = {node.name}, [node.name]
        while frontier:  # the removed ops the pattern's last op reads, directly or through each other
            for tensor in before.data_inputs(frontier.pop()):
                source = tensor.split(":")[0]
                if source in in_graph and source not in after.nodes and source not in members:
                    members.add(source)
                    frontier.append(source)
        reads = {after.resolve(tensor) for tensor in after.data_inputs(node.name)}
        entries = tuple(sorted(
            (member, index) for member in members
            for index, tensor in enumerate(before.data_inputs(member))
            if tensor.split(":")[0] not in members and before.resolve(tensor) in reads))
        kernels.append(FusedKernel(node.name, node.op, frozenset(members), entries))
    return kernels


class _NodeInputs:
    """A GraphDef's nodes, their data inputs as ``name:port``, and values traced through identities."""

    def __init__(self, graph_def):
        self.nodes = {node.name: node for node in graph_def.node}

    def data_inputs(self, name: str) -> List[str]:
        return [i if ":" in i else f"{i}:0" for i in self.nodes[name].input if not i.startswith("^")]

    def resolve(self, tensor: str) -> str:
        source, _, port = tensor.partition(":")
        while source in self.nodes and self.nodes[source].op in _PASS_THROUGH and self.nodes[source].input:
            source, _, port = self.nodes[source].input[0].partition(":")
        return f"{source}:{port or 0}"

    def operands(self, name: str) -> list:
        """What node ``name`` computes from, in the order its kernel reads it: each value through
        identities, a constant by its contents (Grappler's common-subexpression pass keeps one of
        several equal constants, which one depends on the graph), and the two operands of a
        commutative op unordered (``a + b`` and ``b + a`` round alike; Grappler sorts them by name)."""
        def operand(tensor: str):
            value = self.resolve(tensor)
            source = self.nodes.get(value.split(":")[0])
            if source is not None and source.op == "Const":
                return "const:" + source.attr["value"].tensor.SerializeToString().hex()
            return value
        operands = [operand(tensor) for tensor in self.data_inputs(name)]
        if self.nodes[name].op in _COMMUTATIVE_BINARY and len(operands) == 2:
            operands.sort()
        return operands


#: Ops whose two operands can swap without changing a bit of the result.
_COMMUTATIVE_BINARY = frozenset({"Add", "AddV2", "Mul", "SquaredDifference", "Equal",
                                 "NotEqual", "LogicalAnd", "LogicalOr", "BitwiseAnd", "BitwiseOr", "BitwiseXor"})


_PASS_THROUGH = frozenset({"Identity", "Snapshot", "StopGradient"})


#: Ops whose output is a shape: constant folding replaces them by the constant they compute.
_SHAPE_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _changed_nodes(before, after, folded_shapes_unchanged: bool = False) -> List[str]:
    """Nodes of ``before`` missing from ``after``, of another op type there, or reading other values
    (inputs compared as sets, through identity ops, which Grappler removes without changing a value).
    With ``folded_shapes_unchanged``, a node that reads a shape compares its other inputs only
    (its shapes and constants, before and after, left out)."""
    def sources(graph_def):
        nodes = {node.name: node for node in graph_def.node}

        def resolve(name: str) -> str:
            source, _, port = name.partition(":")
            while source in nodes and nodes[source].op in _PASS_THROUGH and nodes[source].input:
                source, _, port = nodes[source].input[0].partition(":")
            return f"{source}:{port or 0}"
        return nodes, {node.name: {resolve(i) for i in node.input if not i.startswith("^")} for node in graph_def.node}

    old_nodes, old_inputs = sources(before)
    new_nodes, new_inputs = sources(after)
    if folded_shapes_unchanged:
        def node_type(nodes, tensor: str):
            node = nodes.get(tensor.split(":")[0])
            return node.op if node is not None else None
        folded = _SHAPE_TYPES | {"Const"}
        for name, inputs in old_inputs.items():
            if name in new_inputs and any(node_type(old_nodes, i) in _SHAPE_TYPES for i in inputs):
                old_inputs[name] = {i for i in inputs if node_type(old_nodes, i) not in folded}
                new_inputs[name] = {i for i in new_inputs[name] if node_type(new_nodes, i) not in folded}
    return [name for name, node in old_nodes.items()
            if name not in new_nodes or new_nodes[name].op != node.op or new_inputs[name] != old_inputs[name]]


def _ends_contraction(graph: tf.Graph, name: str, leave_free: Collection[str]) -> bool:
    """Whether op ``name`` is a contraction (a convolution, a matrix product), or the last op of a
    pattern Grappler fuses with one (``MatMul`` + ``BiasAdd`` + activation): it reads one through
    ops that are rewritten too."""
    frontier, seen = [name], set()
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            op = graph.get_operation_by_name(current)
        except KeyError:
            continue
        if op.type in CONV_TYPES | MATMUL_TYPES:
            return True
        frontier += [value.op.name for value in op.inputs if value.op.name in leave_free]
    return False


def _sole_elementwise_reader(graph: tf.Graph, name: str) -> List[tf.Operation]:
    """The elementwise op that is the only reader of op ``name``'s first output, if there is one."""
    try:
        op = graph.get_operation_by_name(name)
    except KeyError:
        return []
    readers = op.outputs[0].consumers() if op.outputs else []
    return readers if len(readers) == 1 and readers[0].type in FORWARDING_TYPES else []


def _fusable_gate_with_partner(op: tf.Operation) -> List[tf.Operation]:
    """The ops oneDNN may fuse ``op`` into, when ``op`` is a ``BiasAddGrad`` (else empty). A
    partner made to wait for ``op`` (a plan's ordering: the bias gradient first, then the filter
    gradient) is not one: the two cannot run as one kernel, and the bias gradient's readers need
    not wait for what the partner reads."""
    if op.type not in FUSABLE_GATE_TYPES:
        return []
    partners = [partner for partner in op.inputs[0].consumers() if partner.type in FUSABLE_GATE_PARTNER_TYPES]
    if not partners:
        return []
    waiting = _waiting_for(op)
    return [partner for partner in partners if partner not in waiting]


def _waiting_for(op: tf.Operation) -> set:
    """Every op that runs after ``op`` (reads it, or waits for it, directly or not)."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for follower in [c for t in current.outputs for c in t.consumers()] + _compat.control_outputs(current):
            if follower not in seen:
                seen.add(follower)
                stack.append(follower)
    return seen


def fused_kernel_waits(graph: tf.Graph) -> Dict[str, FrozenSet[str]]:
    """What each fusable ``BiasAddGrad`` waits for at run time once oneDNN fuses it into its partner.

    After Grappler, oneDNN fuses a ``BiasAddGrad`` into the ``Conv2DBackpropFilter`` or ``MatMul``
    reading the same incoming gradient; the bias gradient then comes out of the fused kernel, which
    waits for the partner's inputs too (a filter gradient's activation, perhaps a recomputed one
    ranked late). An order that ignored this could put a reader of the bias gradient (its update)
    before that activation, and a chain in that order closes a cycle at run time. Every partner
    that may be chosen counts.

    Returns:
        ``BiasAddGrad`` name -> the ops its partners read, data and control.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     dy = tf.compat.v1.placeholder(tf.float32, (2, 8), name="dy")
        ...     x = tf.compat.v1.placeholder(tf.float32, (2, 4), name="x")
        ...     db = tf.raw_ops.BiasAddGrad(out_backprop=dy, name="db")
        ...     dw = tf.matmul(x, dy, transpose_a=True, name="dw")
        >>> sorted(fused_kernel_waits(g)["db"])
        ['dy', 'x']
    """
    waits = {}
    for op in graph.get_operations():
        partners = _fusable_gate_with_partner(op)
        if partners:
            waits[op.name] = frozenset({t.op.name for partner in partners for t in partner.inputs}
                                       | {c.name for partner in partners for c in partner.control_inputs})
    return waits


def impose_order(graph: tf.Graph, rank: Mapping[str, float], leave_free: Collection[str] = (), *,
                 free_through_control: bool = True, onednn_fusions: bool = True) -> int:
    """Chains the ranked ops of ``graph`` with control edges, in rank order where the graph allows.

    Must run while ``graph`` is being traced, after the automatic control dependencies of
    its stateful ops exist. Otherwise the ones TensorFlow adds when the trace ends can close
    a cycle.

    Args:
        graph: The graph to serialize, in place.
        rank: Op name -> rank; lower runs first.
        leave_free: Ops never chained (those Grappler fuses: :func:`grappler_rewritten_ops`).
        free_through_control: Also leave free what waits for a collective only through control
            edges. A pipeline step passes False: each stage's next task waits for the last
            through a control edge, so a wait anywhere would free everything after it.
        onednn_fusions: Leave free what oneDNN fuses after Grappler (a ``BiasAddGrad`` and its
            partner, the elementwise op that alone reads a fused contraction). False when oneDNN
            is off (``TF_ENABLE_ONEDNN_OPTS=0``): nothing is fused then, and chaining them keeps
            two filter gradients, each with its own scratch, from running at once.

    Returns:
        The number of control edges added. Each chained op carries its position in the
        ``_lms_serial`` attribute.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.compat.v1.placeholder(tf.float32, name="x")
        ...     y, z = tf.square(x, name="y"), tf.exp(x, name="z")
        >>> impose_order(g, {"y": 1, "z": 0}), [op.name for op in g.get_operation_by_name("y").control_inputs]
        (1, ['z'])
    """
    bypass_identity_n(graph)
    chain, _ = _chain_and_held(graph, rank, leave_free, free_through_control, onednn_fusions)
    for position, op in enumerate(chain):
        _compat.set_int_attr(op, SERIAL_ATTR, position)
    added = 0
    for before, after in zip(chain, chain[1:]):
        if before not in after.control_inputs:
            _compat.add_control_input(after, before)
            added += 1
    return added


def _chain_and_held(graph: tf.Graph, rank: Mapping[str, float], leave_free: Collection[str],
                    free_through_control: bool = True, onednn_fusions: bool = True):
    """The ops :func:`impose_order` chains, in order, and the ops it leaves free only because
    Grappler rewrites them (which :func:`gate_free_ops` may hold at their place instead)."""
    order = ranked_topological_order(graph, rank, fused_kernel_waits(graph) if onednn_fusions else None)
    reads_inputs, downstream_of_unchainable = _reading_step_inputs(graph, order), set()
    for name in order:
        op = graph.get_operation_by_name(name)
        if (is_collective(op.type)
                or any(t.op.name in downstream_of_unchainable for t in op.inputs)
                or (free_through_control and any(c.name in downstream_of_unchainable for c in op.control_inputs))):
            downstream_of_unchainable.add(name)
    candidates = [graph.get_operation_by_name(name) for name in order
                  if name in rank and name in reads_inputs and name not in downstream_of_unchainable]
    # Fused kernels (see the module docstring): a control edge would change or deadlock them.
    fused_after_grappler = set()
    if onednn_fusions:
        fused_after_grappler = {op.name for op in candidates if op.type in FUSABLE_GATE_TYPES}
        fused_after_grappler |= {partner.name for name in order
                                 for partner in _fusable_gate_with_partner(graph.get_operation_by_name(name))}
        # oneDNN also extends a fused contraction by the elementwise op that alone reads it (the
        # residual Add of MatMul + BiasAdd + Add in bfloat16), where Grappler offline shows no such fusion.
        # (Not only after a contraction: a control edge on such a reader can stop Grappler's
        # rewrites around it too, e.g. removing a redundant reshape of a loss gradient's Neg.)
        fused_after_grappler |= {reader.name for name in leave_free
                                 for reader in _sole_elementwise_reader(graph, name)}
    chain = [op for op in candidates if op.name not in fused_after_grappler and op.name not in leave_free]
    # oneDNN's fusions after Grappler cannot be checked offline, and a BiasAddGrad fuses only with
    # a partner reading the very same tensor: those are neither chained nor held.
    held = [op for op in candidates if op.name not in fused_after_grappler and op.name in leave_free]
    return chain, held


def _reading_step_inputs(graph: tf.Graph, order: Sequence[str]) -> set:
    """The ops of ``order`` (a topological order of ``graph``) that read the step's inputs (its
    non-resource placeholders), directly or through other ops."""
    reads_inputs = set()
    for name in order:
        op = graph.get_operation_by_name(name)
        if (op.type == "Placeholder" and op.outputs[0].dtype != tf.resource
                or any(t.op.name in reads_inputs for t in op.inputs)):
            reads_inputs.add(name)
    return reads_inputs


@dataclasses.dataclass(frozen=True)
class SerialGate:
    """One edge :func:`gate_free_ops` added to hold an op Grappler rewrites at its place.

    Two kinds. An ``"entry"``: ``reader`` (an op of the held pattern) reads ``value`` through an
    Identity that waits for ``after``. An ``"exit"``: ``reader`` is an Identity reading ``value``
    (the held pattern's result), and ``after`` waits for it.

    Attributes:
        kind: ``"entry"`` or ``"exit"``.
        reader: The op that reads through the gate (entry), or the exit Identity.
        index: Which of the reader's inputs.
        value: The tensor it reads (entry: read before the gate).
        after: The ops the entry gate waits for (comma-joined), or the op that waits for the exit.

    Examples:
        >>> SerialGate("entry", "conv", 0, "x:0", "relu_3").after
        'relu_3'
    """

    kind: str
    reader: str
    index: int
    value: str
    after: str


@dataclasses.dataclass
class _Held:
    """Ops Grappler rewrites together, held as one: where they start and end in the order, the
    reads from outside them, and the op whose result is theirs."""

    start: int
    end: int
    entries: List[Tuple[str, int]]
    last: str


def gate_free_ops(graph: tf.Graph, rank: Mapping[str, float], kernels: Sequence[FusedKernel],
                  leave_free: Collection[str], *, onednn_fusions: bool = True,
                  free_through_control: bool = True) -> List[SerialGate]:
    """Holds each op :func:`impose_order` left free because Grappler rewrites it at its place in the
    chain, without a control edge on it.

    A control edge on such an op stops the rewrite (the remapper fuses no pattern one of whose ops
    has one; the arithmetic optimizer regroups no sum that has one), which changes the numbers.
    Left free, an op runs as soon as its inputs are ready: a recomputed convolution whose input is
    a checkpoint would run at once, long before the backward pass needs it, and a batch norm's
    gradient ``Tile`` would run before the ops the simulator put first. So what Grappler rewrites
    together (a fused pattern, or one op) is held as one, between the chained or held item that
    ends before it starts and the one that starts after it ends:

    - **entry**: each read of a value from outside it goes through a kept Identity with control
      inputs from what comes before it: the last chained op before it starts, and every held item
      that ends between that op and its start (from that item's exit). A held pattern spans
      positions (its first op to its kernel), so the item ending last does not imply that the
      others have ended: waiting for that one only, a recompute held between two chained ops ran
      long after its place (U-Net). The gate is the one recompute uses
      (:mod:`lms_tf.tf.rewrite.recompute`). Only values computed from the step's inputs are
      gated (a weight read is ready from the start either way), and a value an item before
      produces needs none.
    - **exit**: a kept Identity reads its result, and the first chained op after it waits for
      that Identity (a held item after it gates on it). A data read, not a control edge, so the
      pattern keeps none. Not made where oneDNN may extend a fused contraction by its sole
      elementwise reader, which a second reader would stop.

    Args:
        graph: A graph :func:`impose_order` chained, in place.
        rank: The ranks it chained by.
        kernels: The fused kernels (:func:`grappler_fused_kernels`, read before the chain).
        leave_free: The ops it left free because Grappler rewrites them.
        onednn_fusions: As :func:`impose_order` was given it.
        free_through_control: As :func:`impose_order` was given it.

    Returns:
        One record per edge added (to check, or undo with :func:`undo_gates`).

    Examples:
        >>> gate_free_ops(tf.Graph(), {}, [], ())
        []
    """
    chain, held = _chain_and_held(graph, rank, leave_free, free_through_control, onednn_fusions)
    waits = fused_kernel_waits(graph) if onednn_fusions else {}
    order = ranked_topological_order(graph, rank, waits or None)
    position = {name: i for i, name in enumerate(order)}
    reads_inputs = _reading_step_inputs(graph, order)
    held_names = {op.name for op in held}
    kernel_names = {kernel.name for kernel in kernels}
    units, in_kernel = [], set()
    for kernel in kernels:  # a fused pattern is held as one: its reads from outside it
        members = [name for name in kernel.ops if name in position]
        if kernel.ops & held_names and kernel.name in position:
            units.append(_Held(min(position[n] for n in members), position[kernel.name], list(kernel.entries),
                               kernel.name))
            in_kernel |= kernel.ops
    for op in held:
        if op.name not in in_kernel:  # what another rewritten op computes is held through that op
            units.append(_Held(position[op.name], position[op.name],
                               [(op.name, index) for index, value in enumerate(op.inputs)
                                if value.op.name not in leave_free], op.name))
    # A bias gradient oneDNN fuses into its partner, and the partner, stay off the chain and take no
    # entry gate (the fusion needs both to read the very same tensor); but what comes after them
    # waits for the bias gradient, which after the fusion comes out of the partner's kernel.
    # Otherwise the pair ran whenever the executor picked it: after a later update, whose buffer it
    # then held (VGG16's first fully connected weight gradient, 392 MiB).
    pairs = []
    for name in waits:
        if name in position and name in reads_inputs:
            members = [name] + [partner.name for partner in _fusable_gate_with_partner(graph.get_operation_by_name(name))]
            pairs.append(_Held(min(position[n] for n in members), max(position[n] for n in members), [], name))
    records: List[SerialGate] = []
    # What each item leaves behind for the next to wait for: a chained op itself, a held one's exit
    # (made when first needed, so that no exit is left that nothing waits for).
    done: List[Tuple[int, object]] = [(position[op.name], op) for op in chain]
    done += [(unit.end, unit) for unit in units if _may_read_for_exit(graph, unit.last, kernel_names, leave_free)]
    done += [(pair.end, pair) for pair in pairs]
    done.sort(key=lambda item: item[0])
    ends = [end for end, _ in done]
    exits: Dict[str, tf.Operation] = {}

    chain_positions = sorted(position[op.name] for op in chain)

    def exit_of(item) -> tf.Operation:
        if isinstance(item, tf.Operation):
            return item
        if item.last not in exits:
            last = graph.get_operation_by_name(item.last)
            with graph.as_default(), graph.colocate_with(None, ignore_existing=True), graph.device(last.device):
                exits[item.last] = tf.identity(last.outputs[0], name="serial_exit").op
            mark(exits[item.last], "serial_exit")
        return exits[item.last]

    def items_before(start: int) -> List[tf.Operation]:
        """What must be done before ``start``: the last chained op before it, and every held item
        that ends between that op and ``start``. A held item spans positions (a fused pattern, from
        its first op to its kernel), so the item ending last need not imply the others ended."""
        slot = bisect.bisect_left(chain_positions, start)
        since = chain_positions[slot - 1] if slot else -1
        return [exit_of(item) for _, item in done[bisect.bisect_left(ends, since):bisect.bisect_left(ends, start)]]

    made = {}
    for unit in units:
        afters = items_before(unit.start)
        if not afters:
            continue
        for reader_name, index in unit.entries:
            reader = graph.get_operation_by_name(reader_name)
            value = reader.inputs[index]
            # A value ready from the start needs no gate, nor does one whose read already waits
            # for it all (it comes from the one item before).
            waits = [after for after in afters if after is not value.op]
            if value.op.name not in reads_inputs or not waits:
                continue
            key = (value.name, tuple(after.name for after in waits))
            if key not in made:
                with graph.as_default(), graph.colocate_with(None, ignore_existing=True), \
                        graph.device(reader.device), graph.control_dependencies(waits):
                    made[key] = tf.identity(value, name="serial_gate")
                mark(made[key].op, "serial_gate")
            _compat.update_input(reader, index, made[key])
            records.append(SerialGate("entry", reader.name, index, value.name, ",".join(key[1])))
    for op in chain:  # a chained op waits for every held item that ends after the chained op before it
        for after in items_before(position[op.name]):
            if _compat.string_attr(after, LMS_ATTR) == "serial_exit" and after not in op.control_inputs:
                _compat.add_control_input(op, after)
    for exit_op in exits.values():
        records.append(SerialGate("exit", exit_op.name, 0, exit_op.inputs[0].name, ""))
    return records


def _may_read_for_exit(graph: tf.Graph, name: str, kernel_names: Collection[str], leave_free: Collection[str]) -> bool:
    """Whether an exit may read op ``name``'s result: a second reader must not stop a rewrite.

    Not when oneDNN may extend a fused contraction by its sole elementwise reader, nor when every
    reader of an op that is not a fused kernel is rewritten too: Grappler rewrites chains only
    through ops with one reader (the arithmetic optimizer regroups ``(dy * rsqrt) * lr``; it drops
    the reshapes around a loss gradient's transpose). An op read by one elementwise op that does
    not end a contraction may have one: a concatenation gradient's ``Slice`` read only by a
    gradient sum (a U-Net's skip connection) ran, without one, just before the sum's other input,
    about a hundred ops after its place, holding the concatenation's whole gradient that much
    longer."""
    op = graph.get_operation_by_name(name)
    if not op.outputs or (_sole_elementwise_reader(graph, name) and _ends_contraction(graph, name, leave_free)):
        return False
    readers = [reader for output in op.outputs for reader in output.consumers()]
    return name in kernel_names or not readers or not all(reader.name in leave_free for reader in readers)


def undo_gates(graph: tf.Graph, gates: Sequence[SerialGate]) -> None:
    """Takes gates out: an entry's reader reads its value again; nothing waits for an exit any more
    (unread gates are pruned at run time).

    Examples:
        >>> undo_gates(tf.Graph(), [])
    """
    exits = {gate.reader for gate in gates if gate.kind == "exit"}
    if exits:
        for op in graph.get_operations():
            for control in [c for c in op.control_inputs if c.name in exits]:
                _compat.remove_control_input(op, control)
    for gate in gates:
        if gate.kind == "entry":
            _compat.update_input(graph.get_operation_by_name(gate.reader), gate.index,
                                 graph.get_tensor_by_name(gate.value))


def kernels_changed_by_gates(before, after, in_graph) -> List[str]:
    """The step's ops whose kernel or operand order differs between two optimized GraphDefs, the
    pipeline's result before gating and after (reads compared through identities, the gates too).

    Examples:
        >>> from tensorflow.core.framework import graph_pb2
        >>> kernels_changed_by_gates(graph_pb2.GraphDef(), graph_pb2.GraphDef(), set())
        []
    """
    old, new = _NodeInputs(before), _NodeInputs(after)
    changed = []
    for name, node in old.nodes.items():
        # Constants and shapes: what constant folding materialises moves with the chain's control
        # edges, not with a value; the ops that read them are compared.
        if name not in in_graph or node.op == "Const" or node.op in _SHAPE_TYPES:
            continue
        if name not in new.nodes or new.nodes[name].op != node.op or old.operands(name) != new.operands(name):
            changed.append(name)
    return changed


@dataclasses.dataclass(frozen=True)
class SerializeReport:
    """What :func:`serialize_step` did.

    Attributes:
        edges: Control edges added between chained ops.
        gates: Fused kernels' reads held at their place in the chain.
        gates_undone: Where Grappler, run on the gated step, ran another kernel or read operands
            in another order (op names, at most five): the gates there were taken out again.
            Empty when every gate held.

    Examples:
        >>> SerializeReport(12, 3, ()).gates
        3
    """

    edges: int
    gates: int
    gates_undone: Tuple[str, ...]


def onednn_may_fuse(device: str) -> bool:
    """Whether oneDNN may fuse kernels of ops on ``device`` after Grappler: only CPU kernels, and
    only with oneDNN on (``TF_ENABLE_ONEDNN_OPTS``). Otherwise the bias gradients and their
    partners are chained like any op: left free, a weight's gradient ran whenever the executor
    picked it, beside the previous weight's update.

    Examples:
        >>> onednn_may_fuse("/device:GPU:0")
        False
    """
    return device_kind_and_index(device)[0] == "CPU" and _compat.onednn_enabled()


def serialize_step(graph: tf.Graph, rank: Mapping[str, float], device: str, memory_bytes: int, *,
                   outputs: Optional[Sequence[tf.Tensor]] = None,
                   onednn_fusions: Optional[bool] = None) -> SerializeReport:
    """Runs ``graph``'s step in the order of ``rank``: the chain (:func:`impose_order`), each op
    Grappler rewrites held at its place (:func:`gate_free_ops`), and a check that Grappler still
    runs the very kernels, with operands in the same order, as it did before.

    Ops Grappler fuses or regroups are left off the chain, then gated. The pipeline is run offline
    once more: where an op's kernel or operand order changed, the gates on its reads (or on its
    fused pattern's) are undone and the check repeated; after the last check, every gate still
    in doubt is undone. The numbers come first, the order second.

    Args:
        graph: The step's graph, being traced, rewritten already.
        rank: Op name -> rank; lower runs first.
        device: The step's device.
        memory_bytes: The memory the runtime tells Grappler the device has.
        outputs: The tensors the step returns, when known.
        onednn_fusions: Whether oneDNN may fuse the step's kernels after Grappler (see
            :func:`impose_order`); by default :func:`onednn_may_fuse` on ``device``.

    Returns:
        What was chained and gated.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        ...     y, z = tf.square(x, name="y"), tf.exp(x, name="z")
        >>> serialize_step(g, {"y": 1, "z": 0}, "/device:CPU:0", 2**28)
        SerializeReport(edges=1, gates=0, gates_undone=())
    """
    if onednn_fusions is None:
        onednn_fusions = onednn_may_fuse(device)
    return serialize_chains(graph, [(rank, onednn_fusions)], device, memory_bytes, outputs=outputs)


def serialize_chains(graph: tf.Graph, chains: Sequence[Tuple[Mapping[str, float], bool]], device: str,
                     memory_bytes: int, *, outputs: Optional[Sequence[tf.Tensor]] = None,
                     leave_free: Collection[str] = (), free_through_control: bool = True) -> SerializeReport:
    """:func:`serialize_step` for several chains in one graph: one per device of a pipeline, each
    chained and its ops Grappler rewrites held at their place, no edge between two chains.

    The chains are made one after the other, each in a topological order of the graph as the
    chains before it left it, so every edge points forward in one order and none closes a cycle.
    Grappler's pipeline runs offline once for all (every op on one virtual device of
    ``device``'s type), and the check that it still runs the same kernels covers every gate.

    Args:
        graph: The step's graph, being traced, rewritten already.
        chains: ``(rank, onednn_fusions)`` per chain: op name -> rank (lower runs first; ops of one
            device only), and whether oneDNN may fuse that device's kernels (:func:`impose_order`).
        device: A device of the type every chain's runs on (Grappler's patterns differ by type).
        memory_bytes: The memory the runtime tells Grappler the device has.
        outputs: The tensors the step returns, when known.
        leave_free: Ops neither chained nor held, besides those Grappler rewrites (a pipeline's
            optimizer update, whose fold a gate or edge would stop). Keep them out of the ranks.
        free_through_control: As :func:`impose_order` takes it.

    Returns:
        What was chained and gated, over all chains.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        ...     with tf.device("/CPU:0"):
        ...         y, z = tf.square(x, name="y"), tf.exp(x, name="z")
        ...     with tf.device("/CPU:1"):
        ...         u, v = tf.sqrt(x, name="u"), tf.abs(x, name="v")
        >>> serialize_chains(g, [({"y": 1, "z": 0}, False), ({"u": 0, "v": 1}, False)], "/device:CPU:0", 2**28)
        SerializeReport(edges=2, gates=0, gates_undone=())
    """
    graph_def, optimized, in_graph = _offline_default_pipeline(graph, device, memory_bytes, outputs)
    free = frozenset(name for name in _changed_nodes(graph_def, optimized, folded_shapes_unchanged=True)
                     if name in in_graph) | frozenset(leave_free)
    # What the runtime prunes never runs: an exit reading it would keep it alive (a pipeline's
    # ranks name every op, the model input's gradient among them).
    pruned = pruned_by_the_runtime(graph, graph.get_operations(), outputs)
    chains = [({name: r for name, r in rank.items() if name not in pruned}, fusions) for rank, fusions in chains]
    edges = sum(impose_order(graph, rank, leave_free=free, free_through_control=free_through_control,
                             onednn_fusions=fusions) for rank, fusions in chains)
    kernels = _fused_kernels(graph_def, optimized, in_graph)
    gates: List[SerialGate] = []
    for rank, fusions in chains:
        gates += gate_free_ops(graph, rank, kernels, free, onednn_fusions=fusions,
                               free_through_control=free_through_control)
    undone: List[str] = []
    for _ in range(_GATE_CHECKS):
        if not gates:
            break
        _, gated, _ = _offline_default_pipeline(graph, device, memory_bytes, outputs)
        changed = kernels_changed_by_gates(optimized, gated, in_graph)
        if not changed:
            break
        undone += [name for name in changed if name not in undone]
        # The gates on what changed: its own reads, those of the pattern it is the kernel of, and
        # those of the rewritten ops it reads (a regrouped product is read through its last op).
        touched = set(changed) | {name for kernel in kernels if kernel.name in changed for name in kernel.ops}
        frontier = [name for name in touched if name in in_graph]
        while frontier:
            for value in graph.get_operation_by_name(frontier.pop()).inputs:
                if value.op.name in free and value.op.name not in touched:
                    touched.add(value.op.name)
                    frontier.append(value.op.name)
        implicated = [gate for gate in gates if gate.reader in touched
                      or gate.kind == "exit" and gate.value.split(":")[0] in touched]
        if not implicated or _ == _GATE_CHECKS - 1:
            implicated = gates
        undo_gates(graph, implicated)
        gates = [gate for gate in gates if gate not in implicated]
    return SerializeReport(edges, len(gates), tuple(undone[:5]))


#: Offline Grappler runs that check the gates; after the last, any gate still in doubt is undone.
_GATE_CHECKS = 3
