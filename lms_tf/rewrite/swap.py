"""The swap pass: swap-out after the producer, gated swap-in before the backward consumers.

For a tensor ``t`` the plan marks SWAP, on the host device::

    producer -> t -> swap_out (Identity, host) -> swap_in (Identity, host) -> backward consumers
    trigger -> Shape (trigger's device) -> gate (Identity, host) -^ (control edge, host -> host)

The gate reaches the host as a data edge: a control edge that crosses devices can
hang TensorFlow's executor (DESIGN.md), so the only control edge is host -> host.
Every inserted op carries ``_lms`` (``swap_out``, ``swap_in``, ``swap_gate``,
``marker``) and ``_grappler_do_not_remove`` (Grappler would delete the identities).

Example:
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> is_rewritten(g)
    False
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Tuple

import tensorflow as tf

from lms_tf import _compat
from lms_tf.errors import RewriteError
from lms_tf.graph.ir import GraphIR, Phase
from lms_tf.planner.plan import Plan

LMS_ATTR = "_lms"
_DO_NOT_REMOVE = "_grappler_do_not_remove"
_SCOPE = "lms_tf/"


@dataclasses.dataclass(frozen=True)
class RewriteReport:
    """What the swap pass inserted.

    Attributes:
        inserted: ``_lms`` value -> number of ops inserted with it.
        rerouted_inputs: Number of backward-op inputs re-pointed to a swap-in.

    Example:
        >>> RewriteReport({"swap_out": 2}, 3).inserted["swap_out"]
        2
    """

    inserted: Dict[str, int]
    rerouted_inputs: int


def count_lms_ops(graph_or_ops) -> Dict[str, int]:
    """Counts ops carrying the ``_lms`` attribute, by value.

    Args:
        graph_or_ops: A ``tf.Graph`` or an iterable of ``tf.Operation``/``NodeDef``.

    Example:
        >>> count_lms_ops(tf.Graph())
        {}
    """
    ops = graph_or_ops.get_operations() if isinstance(graph_or_ops, tf.Graph) else graph_or_ops
    counts: Dict[str, int] = collections.Counter()
    for op in ops:
        if isinstance(op, tf.Operation):
            value = _compat.string_attr(op, LMS_ATTR)
        else:  # NodeDef
            value = op.attr[LMS_ATTR].s.decode() if LMS_ATTR in op.attr else None
        if value:
            counts[value] += 1
    return dict(counts)


def is_rewritten(graph: tf.Graph) -> bool:
    """Whether lms-tf already rewrote ``graph`` (it carries the lms-tf marker op).

    Example:
        >>> is_rewritten(tf.Graph())
        False
    """
    return any(_compat.string_attr(op, LMS_ATTR) == "marker"
               for op in graph.get_operations() if op.name.startswith(_SCOPE))


def _mark(op: tf.Operation, kind: str) -> None:
    _compat.set_string_attr(op, LMS_ATTR, kind)
    _compat.set_bool_attr(op, _DO_NOT_REMOVE, True)


def _gate_source(trigger: tf.Operation) -> tf.Tensor:
    for out in trigger.outputs:
        if out.dtype not in (tf.resource, tf.variant, tf.string):
            return out
    raise RewriteError(f"trigger op {trigger.name!r} ({trigger.type}) has no output a gate can read; "
                       f"the planner must only choose ops with a numeric output.")


def _check_acyclic(graph: tf.Graph) -> None:
    ops = graph.get_operations()
    indegree = {op.name: 0 for op in ops}
    succs: Dict[str, List[str]] = {op.name: [] for op in ops}
    for op in ops:
        for pred in {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}:
            succs[pred].append(op.name)
            indegree[op.name] += 1
    ready = [n for n, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for s in succs[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    if seen != len(ops):
        stuck = [n for n, d in indegree.items() if d > 0][:5]
        raise RewriteError(f"postcondition failed: the rewritten graph has a cycle through {stuck}.")


def apply_swap_plan(graph: tf.Graph, ir: GraphIR, plan: Plan) -> RewriteReport:
    """Inserts the swap-outs and gated swap-ins that ``plan`` asks for, in place.

    Must be called while ``graph`` is still being traced (inside the ``tf.function``
    body, after the gradients and the update were built).

    Args:
        graph: The graph ``ir`` and ``plan`` were made from.
        ir: Its IR.
        plan: The plan to apply.

    Returns:
        What was inserted.

    Raises:
        RewriteError: The graph was already rewritten, or a postcondition failed
            (a cycle, an ungated swap-in, a changed forward op, a consumer still reading
            the original tensor).

    Example:
        >>> from lms_tf.graph import build_ir
        >>> from lms_tf.options import LMSOptions
        >>> from lms_tf.planner import plan_swaps
        >>> w = tf.Variable(tf.ones((64, 64)))
        >>> def step(x):
        ...     with tf.GradientTape() as tape:
        ...         h = x
        ...         for _ in range(4):
        ...             h = tf.nn.relu(h @ w)
        ...         loss = tf.reduce_sum(h)
        ...     w.assign_sub(tape.gradient(loss, w))
        ...     graph = tf.compat.v1.get_default_graph()
        ...     ir = build_ir(graph)
        ...     opts = LMSOptions(device="/CPU:0", host="/CPU:1", min_swap_bytes=1, swapout_threshold=4)
        ...     apply_swap_plan(graph, ir, plan_swaps(ir, opts, device="/device:CPU:0"))
        ...     return loss
        >>> graph = tf.function(step).get_concrete_function(tf.ones((256, 64))).graph
        >>> count_lms_ops(graph)
        {'swap_out': 4, 'swap_gate': 8, 'swap_in': 4, 'marker': 1}
    """
    if is_rewritten(graph):
        raise RewriteError(
            f"graph {getattr(graph, 'name', '')!r} was already rewritten by lms-tf (it has the "
            f"{_SCOPE}rewritten marker); a step is rewritten once. Trace the original function again instead.")
    forward_inputs_before = {
        op.name: tuple(t.name for t in graph.get_operation_by_name(op.name).inputs)
        for op in ir.ops if op.phase is Phase.FORWARD}

    inserted: Dict[str, int] = collections.Counter()
    rerouted = 0
    swap_ins: List[Tuple[tf.Operation, str]] = []
    with graph.as_default(), graph.name_scope(_SCOPE), graph.control_dependencies(None):
        for i, decision in enumerate(plan.swapped):
            original = graph.get_tensor_by_name(decision.tensor)
            with graph.colocate_with(None, ignore_existing=True), graph.device(plan.host):
                swap_out = tf.identity(original, name=f"swap_out_{i}")
            _mark(swap_out.op, "swap_out")
            inserted["swap_out"] += 1
            for j, swap in enumerate(decision.swap_ins):
                trigger = graph.get_operation_by_name(swap.trigger)
                with graph.colocate_with(trigger):
                    # raw Shape op: tf.shape() would fold a static shape into a constant at trace time.
                    shape = tf.raw_ops.Shape(input=_gate_source(trigger), name=f"swap_in_gate_shape_{i}_{j}")
                with graph.colocate_with(None, ignore_existing=True), graph.device(plan.host):
                    gate = tf.identity(shape, name=f"swap_in_gate_{i}_{j}")
                    with graph.control_dependencies([gate.op]):
                        swap_in = tf.identity(swap_out, name=f"swap_in_{i}_{j}")
                _mark(shape.op, "swap_gate")
                _mark(gate.op, "swap_gate")
                _mark(swap_in.op, "swap_in")
                inserted["swap_gate"] += 2
                inserted["swap_in"] += 1
                swap_ins.append((swap_in.op, decision.tensor))
                for consumer_name in swap.consumers:
                    consumer = graph.get_operation_by_name(consumer_name)
                    for k, tensor in enumerate(list(consumer.inputs)):
                        if tensor.name == decision.tensor:
                            _compat.update_input(consumer, k, swap_in)
                            rerouted += 1
        marker = tf.raw_ops.NoOp(name="rewritten")
        _compat.set_string_attr(marker, LMS_ATTR, "marker")
        inserted["marker"] += 1

    _check_postconditions(graph, plan, forward_inputs_before, swap_ins)
    return RewriteReport(inserted=dict(inserted), rerouted_inputs=rerouted)


def _check_postconditions(graph: tf.Graph, plan: Plan, forward_inputs_before, swap_ins) -> None:
    _check_acyclic(graph)
    for op_name, inputs in forward_inputs_before.items():
        now = tuple(t.name for t in graph.get_operation_by_name(op_name).inputs)
        if now != inputs:
            raise RewriteError(f"postcondition failed: forward op {op_name!r} inputs changed from {inputs} to {now}.")
    for swap_in, _ in swap_ins:
        gates = [c for c in swap_in.control_inputs if _compat.string_attr(c, LMS_ATTR) == "swap_gate"]
        if not gates:
            raise RewriteError(f"postcondition failed: swap-in {swap_in.name!r} has no gate.")
    for decision in plan.swapped:
        for swap in decision.swap_ins:
            for consumer_name in swap.consumers:
                if any(t.name == decision.tensor for t in graph.get_operation_by_name(consumer_name).inputs):
                    raise RewriteError(
                        f"postcondition failed: backward op {consumer_name!r} still reads {decision.tensor!r}.")
