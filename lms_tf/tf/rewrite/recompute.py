"""The recompute step: clone cheap forward subgraphs into the backward pass.

For a tensor ``t`` the plan marks RECOMPUTE with clone region ``ops`` and gate ``g``
(the backward op just before ``t``'s first backward consumer)::

    checkpoint -> Identity -> clone(op_1) -> ... -> clone(producer of t) -> backward consumers of t
             g -^ (a clone with no cloned input reads one input through a kept Identity that
                  waits for g, so the region cannot start early; the clone itself has no control
                  input, which would stop Grappler's remapper fusing it as it fuses the original)

The original forward ops still run for the forward pass; ``t`` is freed after its last
forward consumer instead of living until the backward pass. A checkpoint the clones read
that is itself swapped is read through a fresh swap-in gated by ``g`` (swap, then
recompute the rest, as KARMA does). An op shared by several regions with the same gate
is cloned once. Clones carry ``_lms="recompute"``. A clone that reads a variable on the host
reads a copy fetched behind the gate, once per gate, or, where the plan says so
(``clone_fetches_after``), gated by an earlier clone, so the regions' weights arrive in turn.

Examples:
    >>> from lms_tf.tf.rewrite.recompute import insert_recomputes
"""

from __future__ import annotations

from typing import Dict, Tuple

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.op_kinds import WHILE_OP_TYPES, recompute_clone_name
from lms_tf.core.plan import Plan
from lms_tf.tf.rewrite.common import mark, repoint_consumers, sorting_as
from lms_tf.tf.rewrite.slices import SLICE_INDEX_ATTR, SLICE_OF_ATTR
from lms_tf.tf.rewrite.swap import device_read, gated_swap_in
from lms_tf.tf.rewrite.weights import offloaded_reads

CLONE_OF_ATTR = "_lms_clone_of"
CLONE_GATE_ATTR = "_lms_gate"


def simulator_name(graph: tf.Graph, op_name: str) -> str:
    """The simulator's name for an op of a rewritten graph: ``recompute/<gate>/<op>`` for a clone,
    ``slice/<op>/<i>`` for slice ``i`` of a sliced op and ``<op>`` for the concatenation of its slices
    (the sliced op itself, which does not run, is then named as the concatenation: callers mapping
    names to ops should let the later op win).

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     _ = tf.constant(1.0, name="one")
        >>> simulator_name(g, "one")
        'one'
    """
    op = graph.get_operation_by_name(op_name)
    source = _compat.string_attr(op, CLONE_OF_ATTR)
    if source:
        return recompute_clone_name(_compat.string_attr(op, CLONE_GATE_ATTR), source)
    sliced = _compat.string_attr(op, SLICE_OF_ATTR)
    if sliced:  # a slice of a sliced op, or the concatenation the simulator calls by the op's name
        return f"slice/{sliced}/{op.get_attr(SLICE_INDEX_ATTR)}" if op.type == op.graph.get_operation_by_name(
            sliced).type else sliced
    return op_name


def insert_recomputes(graph: tf.Graph, plan: Plan, swap_outs: Dict[str, tf.Tensor],
                      inserted: Dict[str, int]) -> int:
    """Clones the plan's recompute regions and re-points backward consumers to the clones.

    Must run inside ``graph.as_default()`` under the lms-tf name scope, after the swap step.

    Args:
        graph: The graph being rewritten.
        plan: The plan.
        swap_outs: Swapped tensor name -> its swap-out tensor (from the swap step).
        inserted: Counter of inserted ops by ``_lms`` kind, updated in place.

    Returns:
        The number of backward-op inputs re-pointed to a clone.

    Examples:
        >>> import collections
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        ...     y, t = tf.square(x, name="y"), tf.negative(x, name="t")
        ...     z = tf.multiply(y, t, name="z")
        >>> from lms_tf.core.plan import Decision, Plan, TensorDecision
        >>> again = TensorDecision("y:0", "", (), 4, Decision.RECOMPUTE, "recompute", 2, (), recompute_ops=("y",),
        ...                        gate="t", consumers=("z",))
        >>> with g.as_default():
        ...     rerouted = insert_recomputes(g, Plan((again,), "/device:CPU:0", "/device:CPU:1", {}, {}), {},
        ...                                  collections.Counter())
        >>> rerouted, [i.name for i in z.op.inputs]
        (1, ['y-lms_recompute:0', 't:0'])
    """
    clones: Dict[Tuple[str, str], tf.Operation] = {}
    swap_ins: Dict[Tuple[str, str], tf.Tensor] = {}
    weight_reads = offloaded_reads(graph, plan)  # a clone fetches a weight on the host behind its gate
    fetched_after = {read: weight for weight in plan.offloaded_weights for read in weight.reads}
    rerouted = 0
    for i, decision in enumerate(plan.recomputed):
        gate = graph.get_operation_by_name(decision.gate)
        for op_name in decision.recompute_ops:
            if (op_name, decision.gate) in clones:
                continue
            original = graph.get_operation_by_name(op_name)
            inputs, from_clone = [], False
            for tensor in original.inputs:
                source = clones.get((tensor.op.name, decision.gate))
                if source is not None:
                    inputs.append(source.outputs[tensor.value_index])
                    from_clone = True
                elif tensor.name in swap_outs:
                    key = (tensor.name, decision.gate)
                    if key not in swap_ins:
                        copy = gated_swap_in(graph, swap_outs[tensor.name], gate, plan.host,
                                             f"recompute_swap_in_{len(swap_ins)}")
                        swap_ins[key] = device_read(graph, copy, plan.device, tensor.op.name)
                        inserted["swap_gate"] += 2
                        inserted["swap_in"] += 1
                        inserted["device_read"] += 1
                    inputs.append(swap_ins[key])
                    from_clone = True
                elif tensor.name in weight_reads:
                    key = (weight_reads[tensor.name].name, decision.gate)
                    if key not in swap_ins:
                        # Behind the gate, or in turn after an earlier clone (clone_fetches_after;
                        # the plan was checked: that clone exists by now).
                        after = fetched_after[tensor.name].clone_fetch_after(decision.gate)
                        trigger = gate if after is None else clones[(after, decision.gate)]
                        swap_ins[key] = gated_swap_in(graph, weight_reads[tensor.name], trigger, plan.host,
                                                      f"recompute_weight_fetch_{len(swap_ins)}", kind="weight_fetch")
                        inserted["swap_gate"] += 2
                        inserted["weight_fetch"] += 1
                    inputs.append(swap_ins[key])
                else:
                    inputs.append(tensor)
            if not from_clone:
                inputs[0] = _gated_input(graph, inputs[0], gate, original.device, inserted)
            if original.type in WHILE_OP_TYPES:
                inputs = _loop_handles_from_outputs(original, inputs)
            with graph.name_scope(None):  # sorts by name as the original does (device_read's docstring)
                clone = _compat.clone_op(graph, original, inputs, name=sorting_as(op_name, "recompute"))
            mark(clone, "recompute", keep=False)
            # Which op this clones and behind which gate: the simulator names the clone
            # "recompute/<gate>/<op>", and diagnostics map executed clones back with these.
            _compat.set_string_attr(clone, CLONE_OF_ATTR, op_name)
            _compat.set_string_attr(clone, CLONE_GATE_ATTR, decision.gate)
            inserted["recompute"] += 1
            clones[(op_name, decision.gate)] = clone
        producer = graph.get_tensor_by_name(decision.tensor)
        replacement = clones[(producer.op.name, decision.gate)].outputs[producer.value_index]
        rerouted += repoint_consumers(graph, decision.consumers, decision.tensor, replacement)
    return rerouted


def _gated_input(graph: tf.Graph, tensor: tf.Tensor, gate: tf.Operation, device: str,
                 inserted: Dict[str, int]) -> tf.Tensor:
    """``tensor`` through an Identity that cannot run before ``gate``: a region's first clone reads it.

    The gate is a control edge into this (kept) Identity, not into the clone: Grappler's remapper
    does not fuse an op that has a control input (MatMul + BiasAdd + Relu, Conv2D + BiasAdd...),
    and an unfused clone would compute in a different order than the fused original.
    """
    with graph.colocate_with(None, ignore_existing=True), graph.device(device), \
            graph.control_dependencies([gate]), graph.name_scope(None):
        gated = tf.identity(tensor, name=sorting_as(tensor.op.name, "recompute_gate"))
    mark(gated.op, "recompute_gate")
    inserted["recompute_gate"] += 1
    return gated


def _loop_handles_from_outputs(loop: tf.Operation, inputs):
    """A loop clone's variable handles, taken from the loop's own outputs (loop variable i leaves as
    output i, and a handle passes through unchanged).

    tf.function's automatic control dependencies order every op that reads a variable handle after
    the latest op written before it that writes it: read from the captured handle, the clone would
    wait for the optimizer's writes, which wait for the gradient the clone feeds (a cycle). Nothing
    writes through the loop's outputs. The planner recomputes a loop only when nothing writes its
    variables before its gradient has run, so the values read are the forward loop's.
    """
    return [loop.outputs[i] if t.dtype == tf.resource else t for i, t in enumerate(inputs)]
