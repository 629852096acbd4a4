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

A fetch the plan makes wait for weight gradients (``after_gradients``) also waits, host -> host,
for a host ``Identity`` that received each of them; the host update reads that identity::

    gradient (device) -> gradient_on_host (Identity, host) -> the update's host ops
                                   \-> (control edge, host -> host) fetch -> window's device ops

Examples:
    >>> from lms_tf.tf.rewrite.weights import insert_weight_fetches
"""

from __future__ import annotations

from typing import AbstractSet, Dict, List

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import RewriteError
from lms_tf.core.ir import same_device
from lms_tf.core.op_kinds import ALIAS_TYPES, is_hyperparameter
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


def gradient_on_host(graph: tf.Graph, gradient: str, host: str, update_ops: AbstractSet[str],
                     received: Dict[str, tf.Operation], inserted: Dict[str, int]) -> List[tf.Operation]:
    """Host ``Identity`` ops that have each received what of weight gradient ``gradient`` the
    optimizer update reads on the host: the gradient itself (or a view of it), or the products of
    it that the device computes for the update (``update_ops``: SGD's learning rate times the gradient, Adam's
    gradient squared, :func:`~lms_tf.tf.optimizer_offload.keep_gradient_products_on_device`). The
    host readers read the identity instead, so each is copied once, and an op that waits for the
    identities (host -> host control edges) starts only once those bytes are on the host. Made once
    per tensor (``received``).

    Raises:
        RewriteError: Nothing on the host reads ``gradient`` or a product of it.

    Examples:
        >>> import collections
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     grad = tf.ones((2, 2), name="grad")
        ...     with tf.device("/CPU:1"):
        ...         update = tf.negative(grad, name="update")
        ...     [op.name for op in gradient_on_host(g, "grad:0", "/CPU:1", set(), {}, collections.Counter())]
        ['gradient_on_host_grad']
        >>> update.op.inputs[0].name
        'gradient_on_host_grad:0'
    """
    crossing, frontier, seen = [], [graph.get_tensor_by_name(gradient)], set()
    while frontier:
        tensor = frontier.pop()
        if tensor.name in seen:
            continue
        seen.add(tensor.name)
        readers = tensor.consumers()
        if any(_reads_on_host(reader, tensor, host) for reader in readers):
            crossing.append(tensor)
        for reader in readers:
            if same_device(reader.device, host):
                continue
            if reader.type == "IdentityN":  # output i forwards input i only
                frontier.extend(reader.outputs[i] for i, t in enumerate(reader.inputs) if t.name == tensor.name)
            elif reader.type in ALIAS_TYPES or (reader.name in update_ops and _from_gradient_alone(reader, seen)):
                frontier.extend(reader.outputs)  # a view (a bias's reshape), or a product for the update
    if not crossing:
        raise RewriteError(f"the plan makes a weight fetch wait for gradient {gradient!r} to reach the host "
                           f"({host}), but nothing on the host reads it or a product of it (after_gradients names "
                           f"the weight gradients the optimizer update reads on the host: with weights on the "
                           f"host, every weight gradient). Remove it from the fetch's after_gradients.")
    identities = []
    for tensor in crossing:
        if tensor.name not in received:
            readers = [reader for reader in tensor.consumers() if _reads_on_host(reader, tensor, host)]
            base = "gradient_on_host_" + tensor.name.replace("/", "_").replace(":0", "").replace(":", "_")
            with graph.colocate_with(None, ignore_existing=True), graph.device(host):
                copy = tf.identity(tensor, name=base)
            mark(copy.op, "gradient_on_host")
            inserted["gradient_on_host"] += 1
            for reader in readers:
                for index, t in enumerate(reader.inputs):
                    if t.name == tensor.name:
                        _compat.update_input(reader, index, copy)
            received[tensor.name] = copy.op
        identities.append(received[tensor.name])
    return identities


def _from_gradient_alone(op: tf.Operation, derived) -> bool:
    """Whether ``op`` computes from the gradient (tensors named in ``derived``) and hyperparameters
    alone (:func:`~lms_tf.core.op_kinds.is_hyperparameter`, the planner's rule too)."""
    return all(t.name in derived or is_hyperparameter(t, lambda t: (t.op.type, list(t.op.inputs))) for t in op.inputs)


def _reads_on_host(reader: tf.Operation, tensor: tf.Tensor, host: str) -> bool:
    """Whether ``reader`` is on the host and uses ``tensor``. The optimizer wraps every gradient in
    one ``IdentityN`` on the host; where the device computes a product of the gradient for the
    update (SGD's), nothing reads that output, TensorFlow prunes it and the gradient never
    crosses. A wait on it would make it cross, and a device tensor read on another device is one
    Grappler no longer regroups across (the plain step's rounding, kept by computing the products
    on the device, would change)."""
    if not same_device(reader.device, host):
        return False
    if reader.type != "IdentityN":
        return True
    return any(reader.outputs[i].consumers() for i, t in enumerate(reader.inputs) if t.name == tensor.name)


def insert_weight_fetches(graph: tf.Graph, plan: Plan, inserted: Dict[str, int],
                          update_ops: AbstractSet[str] = frozenset()) -> int:
    """Inserts one fetch per window of each variable on the host and re-points the window's ops.
    A fetch with ``after_gradients`` also waits until those weight gradients are on the host
    (:func:`gradient_on_host`; ``update_ops``: the step's optimizer update ops).

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
    received: Dict[str, tf.Operation] = {}
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
            for gradient in fetch.after_gradients:
                for on_host in gradient_on_host(graph, gradient, plan.host, update_ops, received, inserted):
                    _compat.add_control_input(copy.op, on_host)
            for read in weight.reads:
                rerouted += repoint_consumers(graph, fetch.consumers, read, copy)
    return rerouted
