"""The weight step: a variable on the host is copied to the device once per window of its readers.

For a variable the plan puts on the host (:class:`~lms_tf.core.plan.WeightDecision`), each window
gets a host ``Identity`` of the variable's read, gated like a swap-in by the window's trigger, and
the window's device ops read it instead of the read::

    variable (host) -> ReadVariableOp (host) -> fetch (Identity, host) -> window's device ops
    trigger -> Shape (trigger's device) -> gate (Identity, host) -^ (control edge, host -> host)

TensorFlow copies the fetch's output to the device when it runs (the receiving side allocates it
then) and frees that copy after the window's last reader. A window nothing on the device runs
before (the first layer's forward read) has no trigger: its fetch runs at the start of the step.
Recompute clones that read a variable on the host get a fetch of their own, behind their gate
(:mod:`~lms_tf.tf.rewrite.recompute`).

Examples:
    >>> from lms_tf.tf.rewrite.weights import insert_weight_fetches
"""

from __future__ import annotations

from typing import Dict

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.plan import Plan
from lms_tf.tf.rewrite.common import mark, repoint_consumers
from lms_tf.tf.rewrite.swap import gated_swap_in


def offloaded_reads(graph: tf.Graph, plan: Plan) -> Dict[str, tf.Tensor]:
    """Each read of a variable the plan puts on the host -> the host tensor its fetches copy.

    Examples:
        >>> offloaded_reads(tf.Graph(), Plan((), "/device:CPU:0", "/device:CPU:1", {}, {}))
        {}
    """
    sources = {}
    for weight in plan.offloaded_weights:
        source = host_source(graph, weight.reads[0], plan.host)
        sources.update((read, source) for read in weight.reads)
    return sources


def host_source(graph: tf.Graph, read: str, host: str) -> tf.Tensor:
    """The host tensor a fetch of ``read`` copies: the variable's read itself, or for a view of it
    (a layer that reshapes its kernel: :func:`~lms_tf.planner.weights.weight_view`) the same view
    made on the host, once per graph. The view on the device is left without readers.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     with tf.device("/CPU:1"):
        ...         v = tf.Variable(tf.ones((2, 3)), name="w")
        ...     view = tf.reshape(v.read_value(), (3, 2), name="view")
        ...     made = host_source(g, "view:0", "/CPU:1")
        ...     again = host_source(g, "view:0", "/CPU:1")
        >>> made.op.type, made.device.endswith("CPU:1"), made.shape.as_list(), again is made or again.name == made.name
        ('Reshape', True, [3, 2], True)
    """
    tensor = graph.get_tensor_by_name(read)
    if tensor.op.type == "ReadVariableOp":
        return tensor
    # Named after the view, so a second fetch (a window, a recompute clone) finds the first's.
    base = "weight_view_" + tensor.op.name.replace("/", "_")
    scope = graph.get_name_scope()
    full = f"{scope}/{base}" if scope else base
    if graph.unique_name(base, mark_as_used=False) != full:
        return graph.get_operation_by_name(full).outputs[tensor.value_index]
    inner = host_source(graph, tensor.op.inputs[0].name, host)
    clone = _compat.clone_op(graph, tensor.op, [inner, *tensor.op.inputs[1:]], name=base, device=host)
    mark(clone, "weight_view", keep=False)
    return clone.outputs[tensor.value_index]


def insert_weight_fetches(graph: tf.Graph, plan: Plan, inserted: Dict[str, int]) -> int:
    """Inserts one fetch per window of each variable on the host and re-points the window's ops.

    Must run inside ``graph.as_default()`` under the lms-tf name scope.

    Returns:
        The number of re-pointed inputs.

    Examples:
        >>> import collections
        >>> from lms_tf.core.plan import Decision, SwapIn, WeightDecision
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     with tf.device("/CPU:1"):
        ...         v = tf.Variable(tf.ones((2, 2)), name="w")
        ...     x = tf.ones((2, 2), name="x")
        ...     y = tf.matmul(x, v.read_value(), name="y")
        ...     z = tf.matmul(tf.nn.relu(y, name="r"), v.read_value(), name="z")
        >>> reads = tuple(t.name for t in (y.op.inputs[1], z.op.inputs[1]))
        >>> weight = WeightDecision("w:0", reads, (2, 2), 16, Decision.SWAP, "host",
        ...                         (SwapIn("", ("y",)), SwapIn("r", ("z",))))
        >>> plan = Plan((), "/device:CPU:0", "/device:CPU:1", {}, {}, weights=(weight,))
        >>> with g.as_default():
        ...     rerouted = insert_weight_fetches(g, plan, collections.Counter())
        >>> rerouted, y.op.inputs[1].name, z.op.inputs[1].name
        (2, 'weight_fetch_0_0:0', 'weight_fetch_0_1:0')
    """
    rerouted = 0
    for i, weight in enumerate(plan.offloaded_weights):
        source = host_source(graph, weight.reads[0], plan.host)
        for j, fetch in enumerate(weight.fetches):
            name = f"weight_fetch_{i}_{j}"
            if fetch.trigger:
                copy = gated_swap_in(graph, source, graph.get_operation_by_name(fetch.trigger), plan.host, name,
                                     kind="weight_fetch")
                inserted["swap_gate"] += 2
            else:
                with graph.colocate_with(None, ignore_existing=True), graph.device(plan.host):
                    copy = tf.identity(source, name=name)
                mark(copy.op, "weight_fetch")
            inserted["weight_fetch"] += 1
            for read in weight.reads:
                rerouted += repoint_consumers(graph, fetch.consumers, read, copy)
    return rerouted
