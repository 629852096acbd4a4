"""Applies a whole Plan: preconditions, the swap, recompute, slice, weight and ordering steps, postconditions.

Examples:
    >>> from lms_tf.tf.rewrite import apply_plan
"""

from __future__ import annotations

import collections
from typing import Dict, Sequence

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import RewriteError
from lms_tf.core.ir import GraphIR, Phase
from lms_tf.core.plan import Plan
from lms_tf.tf.rewrite.common import LMS_ATTR, SCOPE, RewriteReport, check_postconditions, is_rewritten
from lms_tf.tf.rewrite.order import insert_orderings
from lms_tf.tf.rewrite.recompute import insert_recomputes
from lms_tf.tf.rewrite.slices import insert_slices
from lms_tf.tf.rewrite.swap import insert_swaps
from lms_tf.tf.rewrite.weights import insert_weight_fetches


def apply_plan(graph: tf.Graph, ir: GraphIR, plan: Plan) -> RewriteReport:
    """Inserts the swaps, recompute clones and weight fetches ``plan`` asks for, in place.

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
            (a cycle, an ungated swap-in or clone, a changed forward op, a backward op
            still reading a swapped or recomputed tensor).

    Examples:
        >>> from lms_tf.tf.trace import build_ir
        >>> from lms_tf.options import LMSOptions
        >>> from lms_tf.planner import make_plan
        >>> from lms_tf.tf.rewrite import count_lms_ops
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
        ...     apply_plan(graph, ir, make_plan(ir, opts, device="/device:CPU:0"))
        ...     return loss
        >>> graph = tf.function(step).get_concrete_function(tf.ones((256, 64))).graph
        >>> count_lms_ops(graph)   # the last activation is read by the first gradient op: kept
        {'swap_out': 3, 'swap_gate': 6, 'swap_in': 3, 'device_read': 3, 'marker': 1}
    """
    return apply_plans(graph, ir, [plan])


def apply_plans(graph: tf.Graph, ir: GraphIR, plans: Sequence[Plan]) -> RewriteReport:
    """Applies several plans over disjoint tensors of one traced graph in one rewrite, each with
    its own device and host: a pipeline's stages, each swapping to its own process's host.

    A graph is rewritten once (it is marked), so the plans go in together.

    Args:
        graph: The graph ``ir`` and ``plans`` were made from.
        ir: Its IR.
        plans: The plans, over disjoint tensors.

    Returns:
        What was inserted, all plans together.

    Raises:
        RewriteError: As :func:`apply_plan`.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        >>> from lms_tf.tf.trace import build_ir
        >>> apply_plans(g, build_ir(g), []).inserted
        {'marker': 1}
    """
    if is_rewritten(graph):
        raise RewriteError(
            f"graph {getattr(graph, 'name', '')!r} was already rewritten by lms-tf (it has the "
            f"{SCOPE}rewritten marker); a step is rewritten once. Trace the original function again instead.")
    for plan in plans:
        waiting = [d.tensor for d in plan.swapped if any(s.after_gradients for s in d.swap_ins)]
        if waiting:
            raise RewriteError(f"a plan's swap-ins of {waiting[:3]} have after_gradients, which only a weight fetch "
                               f"may have (it waits for weight gradients to reach the host); remove them.")
    forward_inputs_before = {
        op.name: tuple(t.name for t in graph.get_operation_by_name(op.name).inputs)
        for op in ir.ops if op.phase is Phase.FORWARD}
    update_ops = frozenset(op.name for op in ir.ops if op.phase is Phase.UPDATE)
    inserted: Dict[str, int] = collections.Counter()
    with graph.as_default(), graph.name_scope(SCOPE), graph.control_dependencies(None):
        rerouted = 0
        for plan in plans:
            swap_outs, swaps_rerouted = insert_swaps(graph, plan, inserted, first=inserted["swap_out"])
            rerouted += swaps_rerouted + insert_recomputes(graph, plan, swap_outs, inserted)
            rerouted += insert_weight_fetches(graph, plan, inserted, update_ops)
            insert_orderings(graph, plan, inserted)
            # Last: a sliced op's readers and waits, whichever step made them, move to its slices.
            rerouted += insert_slices(graph, plan, swap_outs, inserted)
        marker = tf.raw_ops.NoOp(name="rewritten")
        _compat.set_string_attr(marker, LMS_ATTR, "marker")
        inserted["marker"] += 1
    for plan in plans:
        check_postconditions(graph, plan, forward_inputs_before)
    return RewriteReport(inserted=dict(inserted), rerouted_inputs=rerouted)
