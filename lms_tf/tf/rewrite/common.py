"""Pieces every rewrite step shares: the ``_lms`` marker, counts, and the postconditions.

Examples:
    >>> import tensorflow as tf
    >>> count_lms_ops(tf.Graph())
    {}
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import RewriteError
from lms_tf.core.plan import Plan

LMS_ATTR = "_lms"
_DO_NOT_REMOVE = "_grappler_do_not_remove"
SCOPE = "lms_tf/"


@dataclasses.dataclass(frozen=True)
class RewriteReport:
    """What the swap pass inserted.

    Attributes:
        inserted: ``_lms`` value -> number of ops inserted with it.
        rerouted_inputs: Number of backward-op inputs re-pointed to a swap-in.

    Examples:
        >>> RewriteReport({"swap_out": 2}, 3).inserted["swap_out"]
        2
    """

    inserted: Dict[str, int]
    rerouted_inputs: int


def count_lms_ops(graph_or_ops) -> Dict[str, int]:
    """Counts ops carrying the ``_lms`` attribute, by value.

    Args:
        graph_or_ops: A ``tf.Graph`` or an iterable of ``tf.Operation``/``NodeDef``.

    Examples:
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

    Examples:
        >>> is_rewritten(tf.Graph())
        False
    """
    return any(_compat.string_attr(op, LMS_ATTR) == "marker"
               for op in graph.get_operations() if op.name.startswith(SCOPE))


def sorting_as(op_name: str, role: str) -> str:
    """The name of an op lms-tf inserts in place of ``op_name`` (a device read, a recompute clone
    or its gated input): ``<op_name>-lms_<role>``. No character TensorFlow allows in a name sorts
    before ``-`` except ``-`` itself, so it sorts against every other node as ``op_name`` does,
    and Grappler, which orders the leaves it regroups by name, regroups as in the plain step.

    Examples:
        >>> sorting_as("dense/Gelu/mul_1", "recompute")
        'dense/Gelu/mul_1-lms_recompute'
    """
    return f"{op_name}-lms_{role}"


def mark(op: tf.Operation, kind: str, *, keep: bool = True) -> None:
    """Marks an op lms-tf inserted: its kind in ``_lms`` and, with ``keep``, kept from Grappler.

    ``keep`` puts the op in Grappler's preserve set (``_grappler_do_not_remove``), so the
    dependency optimizer cannot bypass a gate. Recompute clones are not kept: the remapper
    never fuses a preserved op, and a clone must fuse exactly as the op it copies does, or
    its results differ in the last bits from the forward pass's.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     op = tf.constant(1.0, name="a").op
        >>> mark(op, "swap_in"); _compat.string_attr(op, LMS_ATTR)
        'swap_in'
    """
    _compat.set_string_attr(op, LMS_ATTR, kind)
    if keep:
        _compat.set_bool_attr(op, _DO_NOT_REMOVE, True)


def repoint_consumers(graph: tf.Graph, consumers, original: str, replacement: tf.Tensor) -> int:
    """Makes every input of ``consumers`` that reads tensor ``original`` read ``replacement``.

    Returns:
        The number of inputs re-pointed.

    Examples:
        >>> import collections
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        ...     y, t = tf.square(x, name="y"), tf.negative(x, name="t")
        ...     z = tf.multiply(y, t, name="z")
        >>> repoint_consumers(g, ["z"], "y:0", t), [i.name for i in z.op.inputs]
        (1, ['t:0', 't:0'])
    """
    count = 0
    for consumer_name in consumers:
        consumer = graph.get_operation_by_name(consumer_name)
        for index, tensor in enumerate(list(consumer.inputs)):
            if tensor.name == original:
                _compat.update_input(consumer, index, replacement)
                count += 1
    return count


def check_acyclic(graph: tf.Graph) -> None:
    """Raises RewriteError if the rewritten graph has a cycle (data or control edges).

    Examples:
        >>> import collections
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        ...     y, t = tf.square(x, name="y"), tf.negative(x, name="t")
        ...     z = tf.multiply(y, t, name="z")
        >>> check_acyclic(g)
        >>> _compat.add_control_input(x.op, z.op)   # x now waits for z, which reads x
        >>> check_acyclic(g)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.RewriteError: postcondition failed: the rewritten graph has a cycle through [...
    """
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


def check_postconditions(graph: tf.Graph, plan: Plan, forward_inputs_before) -> None:
    """Raises RewriteError unless the rewritten graph is acyclic, gated, forward-unchanged (inputs; waits
    for copies out are control inputs) and every wait the plan asks for is in place.

    Examples:
        >>> import tensorflow as tf
        >>> from lms_tf.core.plan import Plan
        >>> check_postconditions(tf.Graph(), Plan((), "/device:GPU:0", "/device:CPU:0", {}, {}), {})
    """
    check_acyclic(graph)
    # A forward op may read a weight fetch instead of the read of a variable on the host; nothing else changes.
    fetched = {read for weight in plan.offloaded_weights for read in weight.reads}
    for op_name, inputs in forward_inputs_before.items():
        now = graph.get_operation_by_name(op_name).inputs
        if any(t.name != before and not (before in fetched and _compat.string_attr(t.op, LMS_ATTR) == "weight_fetch")
               for t, before in zip(now, inputs)) or len(now) != len(inputs):
            raise RewriteError(f"postcondition failed: forward op {op_name!r} inputs changed from {inputs} to "
                               f"{tuple(t.name for t in now)}.")
    for op in graph.get_operations():
        kind = _compat.string_attr(op, LMS_ATTR)
        if kind == "swap_in" and not any(_compat.string_attr(c, LMS_ATTR) == "swap_gate" for c in op.control_inputs):
            raise RewriteError(f"postcondition failed: swap-in {op.name!r} has no gate.")
        if kind == "slice_in" and not any(_compat.string_attr(c, LMS_ATTR) == "swap_gate" for c in op.control_inputs):
            raise RewriteError(f"postcondition failed: the copy of a slice {op.name!r} has no gate.")
        if kind == "recompute" and not any(_compat.string_attr(t.op, LMS_ATTR) in (
                "recompute", "recompute_gate", "swap_in", "device_read", "weight_fetch") for t in op.inputs):
            raise RewriteError(f"postcondition failed: recompute clone {op.name!r} is not gated.")
    for decision in plan.swapped:
        if decision.swap_out_before is not None and not any(
                _compat.string_attr(c, LMS_ATTR) == "swap_out_done"
                for c in graph.get_operation_by_name(decision.swap_out_before).control_inputs):
            raise RewriteError(f"postcondition failed: forward op {decision.swap_out_before!r} does not wait for "
                               f"the copy out of {decision.tensor!r}.")
    for ordering in plan.orderings:
        for waiter in ordering.waiters:
            barriers = [c for c in graph.get_operation_by_name(waiter).control_inputs
                        if _compat.string_attr(c, LMS_ATTR) == "order"]
            if not any({a.name for a in b.control_inputs} >= set(ordering.after) for b in barriers):
                raise RewriteError(f"postcondition failed: backward op {waiter!r} does not wait for "
                                   f"{list(ordering.after)[:3]}... as the plan's ordering asks.")
    for weight in plan.offloaded_weights:
        for fetch in weight.fetches:
            for consumer_name in fetch.consumers:
                read = next((t.name for t in graph.get_operation_by_name(consumer_name).inputs if t.name in weight.reads),
                            None)
                if read is not None:
                    raise RewriteError(f"postcondition failed: device op {consumer_name!r} still reads {read!r} of a "
                                       f"variable on the host instead of its fetch.")
                fetches = [t.op for t in graph.get_operation_by_name(consumer_name).inputs
                           if _compat.string_attr(t.op, LMS_ATTR) == "weight_fetch"]
                if fetch.after_gradients and not any(
                        _compat.string_attr(c, LMS_ATTR) == "gradient_on_host" for f in fetches for c in f.control_inputs):
                    raise RewriteError(f"postcondition failed: the fetch {consumer_name!r} reads does not wait for "
                                       f"{list(fetch.after_gradients)[:3]} to reach the host, as the plan asks.")
    for sliced in plan.sliced:
        if not _compat.is_dead_end(graph.get_operation_by_name(sliced.op)):
            raise RewriteError(f"postcondition failed: sliced op {sliced.op!r} is still read or waited for; it would "
                               f"run whole beside its slices.")
    for decision in plan.swapped + plan.recomputed:
        consumers = [c for s in decision.swap_ins for c in s.consumers] + list(decision.consumers)
        for consumer_name in consumers:
            if any(t.name == decision.tensor for t in graph.get_operation_by_name(consumer_name).inputs):
                raise RewriteError(
                    f"postcondition failed: backward op {consumer_name!r} still reads {decision.tensor!r}.")
