"""The plan without a budget: TFLMS's swap rule plus a recompute policy.

Swap: a forward tensor is swapped when the backward pass reads it, its first backward
consumer runs at least ``swapout_threshold`` ops after its producer, it is at least
``min_swap_bytes`` big, and it is eligible (:mod:`lms_tf.planner.candidates`). Its swap-in is
triggered ``swapin_ahead`` gates before its first backward reader; readers within
``swapin_groupby`` ops share one swap-in.

Recompute (:mod:`lms_tf.planner.recompute`): a recomputed tensor overrides a swap; the
checkpoints its clones start from may be swapped (KARMA). Stateful ops (variable reads, random
ops with hidden state) are never cloned; stateless random ops are, with their seed tensor from
the forward pass, so they give the same values.

Examples:
    >>> import tensorflow as tf
    >>> from lms_tf.tf.trace import build_ir
    >>> from lms_tf.core.policy import Policies
    >>> w = tf.Variable(tf.ones((64, 64)))
    >>> @tf.function
    ... def step(x):
    ...     with tf.GradientTape() as tape:
    ...         h = x
    ...         for _ in range(4):
    ...             h = tf.nn.relu(h @ w)
    ...         loss = tf.reduce_sum(h)
    ...     w.assign_sub(tape.gradient(loss, w))
    ...     return loss
    >>> ir = build_ir(step.get_concrete_function(tf.ones((256, 64))).graph)
    >>> opts = Policies(host="/CPU:1", swapout_threshold=4, swapin_ahead=1, min_swap_bytes=1)
    >>> plan = make_plan(ir, opts, device="/device:CPU:0")
    >>> [d.tensor for d in plan.swapped]   # the last one is read by the very first gradient op
    ['Relu:0', 'Relu_1:0', 'Relu_2:0']
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence

from lms_tf.core.ir import GraphIR, OpInfo, layer_of
from lms_tf.core.plan import Decision, Plan, SwapIn, TensorDecision
from lms_tf.core.policy import Policies
from lms_tf.planner.candidates import Candidates, clonable, collect_candidates
from lms_tf.planner.weights import plan_weights
from lms_tf.planner.recompute import RegionFinder, check_also_recompute, recompute_targets


def _swap_decision(ir: GraphIR, op: OpInfo, tensor, backward, distance, policies: Policies,
                   gates: Sequence[OpInfo], gate_positions: Sequence[int]) -> TensorDecision:
    name = tensor.name

    def keep(reason: str) -> TensorDecision:
        return TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes, Decision.KEEP, reason,
                              distance, ())

    if distance < policies.swapout_threshold:
        return keep(f"needed again after {distance} ops (< swapout_threshold={policies.swapout_threshold})")
    if tensor.nbytes < policies.min_swap_bytes:
        return keep(f"smaller than min_swap_bytes ({tensor.nbytes} < {policies.min_swap_bytes})")
    groups: List[List[OpInfo]] = []
    for consumer in sorted(backward, key=lambda c: c.index):
        if groups and consumer.index - groups[-1][0].index <= policies.swapin_groupby:
            groups[-1].append(consumer)
        else:
            groups.append([consumer])
    swap_ins = []
    for group in groups:
        before = bisect.bisect_left(gate_positions, group[0].index)
        if before == 0:
            return keep("no backward op runs before its first backward consumer to trigger a swap-in")
        trigger = gates[max(0, before - policies.swapin_ahead)]
        swap_ins.append(SwapIn(trigger.name, tuple(c.name for c in group)))
    return TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes, Decision.SWAP,
                          f"swap (read again {distance} ops later, over the threshold)", distance, tuple(swap_ins))


def make_plan(ir: GraphIR, policies: Policies, *, device: str,
              scope_aliases: Optional[Mapping[str, str]] = None, sqrt_segments: Optional[int] = None,
              candidates: Optional["Candidates"] = None, also_recompute: Optional[Mapping[str, str]] = None) -> Plan:
    """Makes the default plan for a traced step: swaps (TFLMS rule) and the recompute policy.

    Args:
        ir: The step's IR.
        policies: Validated policies.
        device: Full name of the managed accelerator.
        scope_aliases: Keras layer name -> its name scope in this trace, for ``exclude``.
        sqrt_segments: With ``recompute="sqrt"``, the number of segments (default: about the
            square root of the number of articulation tensors). The budget planner tries several.
        candidates: The step's :func:`collect_candidates` for these policies, if already known.
        also_recompute: Checkpoints of the recompute policy to recompute too, from the checkpoints
            before them (recursive recompute: more compute, fewer bytes kept or swapped), each
            mapped to its gate (one of :func:`checkpoint_gates`). The budget planner picks these.

    Returns:
        The plan, with one decision per forward tensor that a backward op reads.

    Raises:
        LMSOptionError: An ``exclude`` entry matches nothing in the step, or an ``also_recompute``
            entry is not a movable tensor made by a clonable op, or its gate does not run before
            the tensor's backward readers.
        GraphAnalysisError: A tensor that would be swapped has an unresolvable size.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> make_plan(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0").decisions
        ()
    """
    aliases = scope_aliases or {}
    found = candidates or collect_candidates(ir, policies, device=device, scope_aliases=aliases)
    gates, gate_positions, backward_of, eligible = (found.gates, found.gate_positions, found.backward_of,
                                                    found.eligible)
    order = found.order
    decisions: Dict[str, TensorDecision] = dict(found.kept)
    for name in eligible:
        op, tensor = ir.op(ir.tensors[name].producer), ir.tensors[name]
        distance = found.distance[name]
        if policies.swap:
            decisions[name] = _swap_decision(ir, op, tensor, backward_of[name], distance, policies, gates,
                                             gate_positions)
        else:
            decisions[name] = TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes,
                                             Decision.KEEP, "swap=False", distance, ())

    if policies.recompute:
        segment_of, through = recompute_targets(ir, eligible, policies, aliases, sqrt_segments)
        # A tensor read before any gate can run (label handling at the very start of the backward
        # pass) cannot be recomputed; it must not drag its segment's shared gate before every gate.
        segment_of = {name: seg for name, seg in segment_of.items()
                      if found.recompute_gates_before(min(c.index for c in backward_of[name])) > 0}
        deeper = {t: gate for t, gate in (also_recompute or {}).items() if t not in segment_of}
        check_also_recompute(ir, found, deeper)
        targets = set(segment_of) | set(deeper)
        regions = RegionFinder(ir, targets, through)
        first_use: Dict[int, int] = {}
        for name, seg in segment_of.items():
            first = min(c.index for c in backward_of[name])
            first_use[seg] = min(first, first_use.get(seg, first))
        for name in eligible:
            if name in deeper:
                old = decisions[name]
                decisions[name] = TensorDecision(
                    name, old.layer, old.shape, old.nbytes, Decision.RECOMPUTE,
                    "recompute (a checkpoint, from the checkpoints before it)", old.distance, (),
                    recompute_ops=regions.region(name), gate=deeper[name],
                    consumers=tuple(c.name for c in sorted(backward_of[name], key=lambda c: c.index)))
                continue
            if name not in targets:
                producer = ir.op(ir.tensors[name].producer)
                if not clonable(producer) and decisions[name].decision is Decision.KEEP:
                    decisions[name] = dataclasses.replace(
                        decisions[name], reason="stateful op: never recomputed" if producer.stateful else
                        f"{producer.type}: never recomputed (oneDNN pairs its gradient with its workspace)")
                continue
            before = found.recompute_gates_before(first_use[segment_of[name]])
            if before == 0:
                continue
            old = decisions[name]
            why = f"recompute ({policies.recompute})" if isinstance(policies.recompute, str) else "recompute (named)"
            decisions[name] = TensorDecision(
                name, old.layer, old.shape, old.nbytes, Decision.RECOMPUTE, why, old.distance, (),
                recompute_ops=regions.region(name), gate=found.recompute_gates[before - 1].name,
                consumers=tuple(c.name for c in sorted(backward_of[name], key=lambda c: c.index)))

    return Plan(decisions=tuple(decisions[n] for n in order), device=device, host=policies.host,
                policies=policies.to_dict(), phase_counts=ir.phase_counts(),
                weights=plan_weights(ir, policies))
