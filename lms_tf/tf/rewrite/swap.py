"""The swap step: swap-out after the producer, gated swap-in before the backward consumers.

For a tensor ``t`` the plan marks SWAP, on the host device::

    producer -> t -> swap_out (Identity, host) -> swap_in (Identity, host) -> read (Identity, device) -> backward consumers
    trigger -> Shape (trigger's device) -> gate (Identity, host) -^ (control edge, host -> host)

When the plan makes the forward pass wait for the copy out (``swap_out_before``, TFLMS's
synchronous swap-out), the signal travels back the same way::

    swap_out -> Shape (host) -> signal (Identity, waiter's device) -^ waiter (a later forward op)

The gate reaches the host as a data edge: a control edge that crosses devices can
hang TensorFlow's executor (docs/design.md), so the only control edge is host -> host.
The read is on the device and sorts by name as ``t``'s producer does, so Grappler regroups the
consumers' arithmetic as in the plain step (:func:`device_read`).
Every inserted op carries ``_lms`` (``swap_out``, ``swap_in``, ``device_read``, ``swap_gate``,
``swap_out_done``, ``marker``) and ``_grappler_do_not_remove`` (Grappler would delete the identities).

Examples:
    >>> from lms_tf.tf.rewrite.swap import insert_swaps
"""

from __future__ import annotations

from typing import Dict, Tuple, Union

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import RewriteError
from lms_tf.core.plan import Plan
from lms_tf.tf.rewrite.common import mark, repoint_consumers, sorting_as


def _gate_source(trigger: tf.Operation) -> tf.Tensor:
    for out in trigger.outputs:
        if out.dtype not in (tf.resource, tf.variant, tf.string):
            return out
    raise RewriteError(f"trigger op {trigger.name!r} ({trigger.type}) has no output a gate can read; "
                       f"the planner must only choose ops with a numeric output.")


def _signal(graph: tf.Graph, source: tf.Tensor, receiver: Union[str, tf.Operation], name: str,
            kind: str) -> tf.Operation:
    """An op on ``receiver``'s side (a device, or next to an op) that runs only after ``source``
    exists: ``Shape(source)`` next to the source, received by an ``Identity``. A data edge, because a
    control edge that crosses devices can hang TensorFlow's executor (docs/design.md)."""
    with graph.colocate_with(source.op):
        # raw Shape op: tf.shape() would fold a static shape into a constant at trace time.
        shape = tf.raw_ops.Shape(input=source, name=f"{name}_shape")
    if isinstance(receiver, tf.Operation):
        with graph.colocate_with(receiver):
            signal = tf.identity(shape, name=name)
    else:
        with graph.colocate_with(None, ignore_existing=True), graph.device(receiver):
            signal = tf.identity(shape, name=name)
    mark(shape.op, kind)
    mark(signal.op, kind)
    return signal.op


def gated_swap_in(graph: tf.Graph, swap_out: tf.Tensor, trigger: tf.Operation, host: str, name: str,
                  kind: str = "swap_in") -> tf.Tensor:
    """A host Identity of ``swap_out`` that cannot run before ``trigger``, marked ``kind``
    (``"swap_in"``, or ``"weight_fetch"`` when it copies a variable on the host).

    The gate reaches the host as a data edge: ``Shape(trigger output)`` on the trigger's
    device, received by a host ``Identity``, which is the swap-in's (host -> host) control input.

    Examples:
        >>> import collections
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        ...     y, t = tf.square(x, name="y"), tf.negative(x, name="t")
        ...     z = tf.multiply(y, t, name="z")
        >>> with g.as_default():
        ...     swap_out = tf.identity(y, name="swap_out")
        ...     swap_in = gated_swap_in(g, swap_out, t.op, "/device:CPU:1", "swap_in")
        >>> swap_in.name, [op.name for op in swap_in.op.control_inputs]
        ('swap_in:0', ['swap_in_gate'])
    """
    gate = _signal(graph, _gate_source(trigger), host, f"{name}_gate", "swap_gate")
    with graph.colocate_with(None, ignore_existing=True), graph.device(host), graph.control_dependencies([gate]):
        swap_in = tf.identity(swap_out, name=name)
    mark(swap_in.op, kind)
    return swap_in


def device_read(graph: tf.Graph, copy: tf.Tensor, device: str, sort_as: str) -> tf.Tensor:
    """The device's own ``Identity`` of a host copy: what the device's consumers read instead of
    the host copy itself. It moves no bytes (an Identity forwards its input's buffer); the copy to
    the device is the edge into it, as before.

    Without it the rewritten step rounds differently from the plain one. Grappler regroups trees
    of ``Mul``/``Add`` ops in the backward pass (constant folding's ``ConstantPushDown``, the
    arithmetic optimizer's tree rewrites), but constant folding leaves a tree alone when a leaf
    is on another device, and the arithmetic optimizer orders the leaves it regroups by node
    name. A backward ``Mul`` that read a host copy of MultiHeadAttention's softmax was grouped
    with another factor than in the plain step, and the query and key gradients differed after
    one step. So the read is on the consumers' device, and named ``<sort_as>-lms_read``, which
    sorts against every other node name exactly as ``sort_as`` (the original producer) does: no
    character TensorFlow allows in a name sorts before ``-`` except ``-`` itself.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default(), g.name_scope("lms_tf"):
        ...     y = tf.square(tf.constant(1.0), name="layer/y")
        ...     copy = tf.identity(y, name="swap_in_0_0")
        ...     read = device_read(g, copy, "/device:CPU:0", y.op.name)
        >>> read.name, read.device, read.op.inputs[0].name
        ('lms_tf/layer/y-lms_read:0', '/device:CPU:0', 'lms_tf/swap_in_0_0:0')
    """
    with graph.colocate_with(None, ignore_existing=True), graph.device(device), graph.name_scope(None):
        read = tf.identity(copy, name=sorting_as(sort_as, "read"))
    mark(read.op, "device_read")
    return read


def wait_for_swap_out(graph: tf.Graph, swap_out: tf.Tensor, waiter: tf.Operation, name: str) -> None:
    """Makes forward op ``waiter`` start only after the copy ``swap_out`` has reached the host.

    Examples:
        >>> import collections
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        ...     y, t = tf.square(x, name="y"), tf.negative(x, name="t")
        ...     z = tf.multiply(y, t, name="z")
        >>> with g.as_default():
        ...     swap_out = tf.identity(y, name="swap_out")
        ...     wait_for_swap_out(g, swap_out, z.op, "z_waits")
        >>> [op.name for op in z.op.control_inputs]
        ['z_waits']
    """
    _compat.add_control_input(waiter, _signal(graph, swap_out, waiter, name, "swap_out_done"))


def insert_swaps(graph: tf.Graph, plan: Plan, inserted: Dict[str, int], first: int = 0
                 ) -> Tuple[Dict[str, tf.Tensor], int]:
    """Inserts the plan's swap-outs and gated swap-ins, re-pointing backward consumers.

    Must run inside ``graph.as_default()`` under the lms-tf name scope. Swap ``i`` of the plan is
    named ``swap_out_<first + i>`` (its swap-ins ``swap_in_<first + i>_<j>``): several plans
    inserted into one graph number their swaps on.

    Returns:
        Swapped tensor name -> its swap-out (host) tensor, and the number of re-pointed inputs.

    Examples:
        >>> import collections
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        ...     y, t = tf.square(x, name="y"), tf.negative(x, name="t")
        ...     z = tf.multiply(y, t, name="z")
        >>> from lms_tf.core.plan import Decision, Plan, SwapIn, TensorDecision
        >>> swap = TensorDecision("y:0", "", (), 4, Decision.SWAP, "swap", 2, (SwapIn("t", ("z",)),))
        >>> with g.as_default():
        ...     swap_outs, rerouted = insert_swaps(g, Plan((swap,), "/device:CPU:0", "/device:CPU:1", {}, {}),
        ...                                        collections.Counter())
        >>> z_reads = z.op.inputs[0]   # the device's read of the gated copy
        >>> rerouted, z_reads.name, z_reads.op.inputs[0].name, swap_outs["y:0"].name
        (1, 'y-lms_read:0', 'swap_in_0_0:0', 'swap_out_0:0')
    """
    rerouted = 0
    swap_outs: Dict[str, tf.Tensor] = {}
    for i, decision in enumerate(plan.swapped, start=first):
        original = graph.get_tensor_by_name(decision.tensor)
        with graph.colocate_with(None, ignore_existing=True), graph.device(plan.host):
            swap_out = tf.identity(original, name=f"swap_out_{i}")
        mark(swap_out.op, "swap_out")
        inserted["swap_out"] += 1
        swap_outs[decision.tensor] = swap_out
        if decision.swap_out_before is not None:
            wait_for_swap_out(graph, swap_out, graph.get_operation_by_name(decision.swap_out_before),
                              f"swap_out_{i}_done")
            inserted["swap_out_done"] += 2
        for j, swap in enumerate(decision.swap_ins):
            trigger = graph.get_operation_by_name(swap.trigger)
            swap_in = gated_swap_in(graph, swap_out, trigger, plan.host, f"swap_in_{i}_{j}")
            inserted["swap_gate"] += 2
            inserted["swap_in"] += 1
            read = device_read(graph, swap_in, plan.device, original.op.name)
            inserted["device_read"] += 1
            rerouted += repoint_consumers(graph, swap.consumers, decision.tensor, read)
    return swap_outs, rerouted
