"""Slicing an op along the batch: a plan's op run a slice at a time, its largest inputs copied in by the slice.

A plan runs every op whole unless it says otherwise, so no plan holds less than the op that
needs the most at once (:func:`~lms_tf.simulate.whole_op_floor`). A max pool's gradient reads
three batch-sized tensors and writes a fourth; run a slice of the batch at a time
(:class:`~lms_tf.core.plan.SlicedOp`), with its swapped inputs copied from the host a slice at a
time, it holds a slice of those instead of the whole.

Examples:
    >>> from lms_tf.planner.slicing import slice_op
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import AbstractSet, Sequence

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import GraphIR, OpInfo
from lms_tf.core.op_kinds import BATCH_SLICED_INPUTS
from lms_tf.core.plan import Decision, Plan, SlicedOp, TensorDecision


def slice_op(plan: Plan, ir: GraphIR, op: str, slices: int, reason: str = "", gates: Sequence[OpInfo] = ()) -> Plan:
    """``plan`` with ``op`` run ``slices`` slices of the batch at a time, each input of it that the
    plan swaps copied from the host a slice at a time instead of swapped in whole for it.

    The op leaves the swap-ins it read (a swap-in left with no reader is dropped); the first
    slices' copies start after the earliest trigger of those swap-ins. Every other swap-in that
    would arrive while the slices run (triggered before the op, read only after it), the op's
    inputs' among them, is triggered by the op instead: it starts when the slices are put
    together, or later, right before its readers (``gates``), and they may wait for the copy.

    Args:
        plan: A plan for ``ir``.
        ir: The step's IR.
        op: A backward op of a type in :data:`~lms_tf.core.op_kinds.BATCH_SLICED_INPUTS`.
        slices: Into how many parts to cut the batch (2 to the batch size).
        reason: Why, in words, for :meth:`Plan.summary`.
        gates: The backward ops that may trigger a swap-in, in run order
            (:attr:`~lms_tf.planner.candidates.Candidates.gates`): a swap-in held back is triggered
            by the last of them before its first reader (and not before the op); without them, by the op.

    Returns:
        The new plan (predictions as ``plan``'s: simulate it to know its peak).

    Raises:
        LMSOptionError: ``op`` cannot be sliced, is sliced already, or reads no input the plan swaps
            (a slice of a device tensor is a view of it: slicing would save nothing).

    Examples:
        >>> from lms_tf.core import make_ir
        >>> from lms_tf.core.plan import Decision, SwapIn, TensorDecision
        >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (8, 4, 4, 2))]),
        ...               dict(name="pool", type="MaxPool", inputs=["x:0"], outputs=[("pool:0", (8, 2, 2, 2))]),
        ...               dict(name="dy", type="Mul", inputs=["pool:0", "pool:0"], outputs=[("dy:0", (8, 2, 2, 2))],
        ...                    phase="backward"),
        ...               dict(name="grad", type="MaxPoolGrad", inputs=["x:0", "pool:0", "dy:0"],
        ...                    outputs=[("grad:0", (8, 4, 4, 2))], phase="backward")])
        >>> swap = TensorDecision("pool:0", "", (8, 2, 2, 2), 256, Decision.SWAP, "", 1, (SwapIn("dy", ("grad",)),))
        >>> sliced = slice_op(Plan((swap,), "/device:GPU:0", "/device:CPU:0", {}, {}), ir, "grad", 4)
        >>> sliced.sliced[0].from_host, sliced.sliced[0].trigger, sliced.decisions[0].swap_ins
        (('pool:0',), 'dy', ())
    """
    info = ir.op(op)
    if info.type not in BATCH_SLICED_INPUTS:
        raise LMSOptionError(f"cannot slice {op!r}: it is a {info.type}; only {', '.join(sorted(BATCH_SLICED_INPUTS))} "
                             f"compute each example apart so that slices give the whole op's values.")
    if any(s.op == op for s in plan.sliced):
        raise LMSOptionError(f"{op!r} is sliced already in this plan; edit its entry's 'slices' instead.")
    batch_inputs = {info.inputs[i] for i in BATCH_SLICED_INPUTS[info.type] if i < len(info.inputs)}
    decisions, from_host, triggers = [], [], []
    waiters = {w for o in plan.orderings for w in o.waiters}
    for d in plan.decisions:
        read = [s for s in d.swap_ins if op in s.consumers] if d.tensor in batch_inputs else []
        if d.decision is Decision.SWAP and not read and d.tensor not in batch_inputs:
            d = _held_back(ir, d, info, gates, waiters)
        if d.decision is Decision.SWAP and read:
            triggers.extend(s.trigger for s in read)
            swap_ins = tuple(dataclasses.replace(s, consumers=tuple(c for c in s.consumers if c != op))
                             for s in d.swap_ins)
            d = dataclasses.replace(d, swap_ins=tuple(s for s in swap_ins if s.consumers))
            d = _held_back(ir, d, info, gates, waiters)
            from_host.append(d.tensor)
        decisions.append(d)
    if not triggers:
        raise LMSOptionError(f"cannot slice {op!r}: the plan swaps in none of its inputs {sorted(batch_inputs)} for "
                             f"it, and a slice of a tensor on the device is a view of its whole buffer, so slicing "
                             f"would hold no less. Swap its largest input first.")
    trigger = min(triggers, key=lambda name: ir.op(name).index)
    entry = SlicedOp(op, slices, tuple(from_host), trigger, reason)
    return dataclasses.replace(plan, decisions=tuple(decisions), sliced=plan.sliced + (entry,))


def _waiting_for(ir: GraphIR, op: OpInfo) -> AbstractSet[str]:
    """The ops that wait for ``op`` through data edges (cached on the IR per op)."""
    def build() -> AbstractSet[str]:
        after, frontier = set(), [op.name]
        while frontier:
            for t in ir.op(frontier.pop()).outputs:
                for consumer in ir.tensors[t].consumers:
                    if consumer not in after:
                        after.add(consumer)
                        frontier.append(consumer)
        return frozenset(after)

    return ir.memo(f"_waiting_for/{op.name}", build)


def _held_back(ir: GraphIR, decision: TensorDecision, op: OpInfo, gates: Sequence[OpInfo],
               waiters: AbstractSet[str]) -> TensorDecision:
    """``decision`` with each swap-in that would arrive while ``op``'s slices run (triggered before
    ``op``, every reader after it) triggered later: the op is sliced because it holds the most, and
    a copy waiting beside its slices would hold as much again. It starts after the last of
    ``gates`` before its first reader (at ``op`` or after), or after ``op``."""
    # A trigger must run after the op's slices (so it waits for the op: it reads what the op made,
    # or something made from it), and an op an ordering holds back could wait for this copy's
    # readers: it may not trigger it.
    after = _waiting_for(ir, op)
    gates = [g for g in gates if g.name in after and g.name not in waiters]
    positions = [g.index for g in gates]
    swap_ins = []
    for s in decision.swap_ins:
        first = min(ir.op(c).index for c in s.consumers)
        if ir.op(s.trigger).index < op.index < first:
            before = bisect.bisect_left(positions, first) - 1
            trigger = gates[before].name if before >= 0 and positions[before] >= op.index else op.name
            s = dataclasses.replace(s, trigger=trigger)
        swap_ins.append(s)
    swap_ins = tuple(swap_ins)
    return decision if swap_ins == decision.swap_ins else dataclasses.replace(decision, swap_ins=swap_ins)
