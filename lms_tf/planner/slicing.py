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

import dataclasses

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import GraphIR
from lms_tf.core.op_kinds import BATCH_SLICED_INPUTS
from lms_tf.core.plan import Decision, Plan, SlicedOp


def slice_op(plan: Plan, ir: GraphIR, op: str, slices: int, reason: str = "") -> Plan:
    """``plan`` with ``op`` run ``slices`` slices of the batch at a time, each input of it that the
    plan swaps copied from the host a slice at a time instead of swapped in whole for it.

    The op leaves the swap-ins it read (a swap-in left with no reader is dropped, one left with
    readers after the op is triggered by the op, so that the whole copy does not arrive while the
    slices run); the first slices' copies start after the earliest trigger of those swap-ins.

    Args:
        plan: A plan for ``ir``.
        ir: The step's IR.
        op: A backward op of a type in :data:`~lms_tf.core.op_kinds.BATCH_SLICED_INPUTS`.
        slices: Into how many parts to cut the batch (2 to the batch size).
        reason: Why, in words, for :meth:`Plan.summary`.

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
    for d in plan.decisions:
        read = [s for s in d.swap_ins if op in s.consumers] if d.tensor in batch_inputs else []
        if d.decision is Decision.SWAP and read:
            triggers.extend(s.trigger for s in read)
            swap_ins = []
            for s in d.swap_ins:
                consumers = tuple(c for c in s.consumers if c != op)
                if not consumers:
                    continue
                if s in read and all(ir.op(c).index > info.index for c in consumers):
                    # Its other readers come after the op: copied back whole while the slices ran,
                    # it would sit beside them. It is copied back when the op's slices are put together.
                    s = dataclasses.replace(s, trigger=op)
                swap_ins.append(dataclasses.replace(s, consumers=consumers))
            d = dataclasses.replace(d, swap_ins=tuple(swap_ins))
            from_host.append(d.tensor)
        decisions.append(d)
    if not triggers:
        raise LMSOptionError(f"cannot slice {op!r}: the plan swaps in none of its inputs {sorted(batch_inputs)} for "
                             f"it, and a slice of a tensor on the device is a view of its whole buffer, so slicing "
                             f"would hold no less. Swap its largest input first.")
    trigger = min(triggers, key=lambda name: ir.op(name).index)
    entry = SlicedOp(op, slices, tuple(from_host), trigger, reason)
    return dataclasses.replace(plan, decisions=tuple(decisions), sliced=plan.sliced + (entry,))
