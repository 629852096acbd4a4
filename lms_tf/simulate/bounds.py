"""Bounds no plan can beat: on a planned step's time for the bytes it moves, on the time of any
plan that fits a budget, and on the device memory of any plan that runs each op whole.

Examples:
    >>> from lms_tf.simulate.bounds import link_lower_bound, whole_op_floor
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from lms_tf.core.ir import GraphIR
from lms_tf.core.op_kinds import (
    CONTROL_FLOW_OP_TYPES,
    FORWARDING_TYPES,
    RESIDENT_TYPES,
    VARIABLE_UPDATE_PREFIXES,
    is_collective,
)
from lms_tf.cost.model import CostModel
from lms_tf.simulate.lower import check_kernel_library, kernel_scratch_bytes


def link_lower_bound(planned, cost: CostModel) -> float:
    """Least possible step time for what the plan does: the device compute it leaves on the
    device (recompute included; an optimizer update it runs on the host is not there), the host's
    own work (that update), or the busier link direction, whichever is longest. Each of the
    four runs on a stream of its own, one op or copy at a time, so the plan's simulated step can
    never take less.

    It is not the plain step's compute: a plan that moves the update to the host takes that
    work off the device, and the plain step's compute time would then read above the plan's
    own time (0.99x on ``lms-tf max-params``'s largest 32 GB V100 plan, before 2026-12-06).

    Args:
        planned: The planned step's :class:`~lms_tf.simulate.Simulation` (or anything with its
            ``compute_time_s``, ``host_compute_time_s``, ``swap_out_bytes`` and ``swap_in_bytes``).
        cost: The device's cost model (link bandwidths).

    Examples:
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> class P: compute_time_s, swap_out_bytes, swap_in_bytes, host_compute_time_s = 0.5, 12 * 10**9, 6 * 10**9, 0.0
        >>> link_lower_bound(P, CostModel(get_device_spec("v100-16gb-pcie3")))   # 12 GB out over 12 GB/s
        1.0
    """
    return max(planned.compute_time_s, planned.host_compute_time_s,
               cost.transfer_time(planned.swap_out_bytes, "device_to_host"),
               cost.transfer_time(planned.swap_in_bytes, "host_to_device"))


def fit_lower_bound(compute_s: float, deficit_bytes: int, movable, cost: CostModel):
    """Least step time of any plan that brings the plain step's peak down by ``deficit_bytes``,
    and the link traffic at that optimum (plan-independent, unlike :func:`link_lower_bound`).

    At the plain step's peak, at least ``deficit_bytes`` of the live movable tensors must be
    gone. Each byte is either swapped (it crosses the link out and back in) or recomputed (its
    producer runs again). Relaxed to fractions of tensors, with each tensor's recompute costing
    its producer's time alone (a real plan may have to recompute a chain), the least time is
    ``min over s of max(compute + recompute(deficit - s), s / link)``: the cheapest bytes per
    second are recomputed first, and the link takes the rest. No plan beats it, whatever it moves.

    Args:
        compute_s: The plain step's compute time.
        deficit_bytes: Plain peak minus the budget (0 or less: nothing has to move).
        movable: ``(bytes, recompute seconds)`` of each movable tensor live at the plain peak.
        cost: The device's cost model (link bandwidths).

    Returns:
        ``(seconds, swap bytes at the optimum)``, or None when the movable bytes live at the plain
        peak are fewer than the deficit: a plan that fits then also changes the order of the ops
        (the planner's orderings, swap-outs the forward pass waits for), which this bound does
        not model, so it gives no bound.

    Examples:
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> cost = CostModel(get_device_spec("v100-16gb-pcie3"))
        >>> seconds, traffic = fit_lower_bound(1.0, 12 * 10**9, [(12 * 10**9, 10.0)], cost)
        >>> round(seconds, 2), round(traffic / 1e9, 1)   # recomputing would take 10 s: swap it all
        (1.0, 12.0)
        >>> seconds, traffic = fit_lower_bound(0.1, 6 * 10**9, [(6 * 10**9, 0.001)], cost)
        >>> round(seconds, 4), round(traffic / 1e9, 1)  # link-bound: recompute most, swap what the compute hides
        (0.1008, 1.2)
    """
    if deficit_bytes <= 0:
        return compute_s, 0
    if sum(nbytes for nbytes, _ in movable) < deficit_bytes:
        return None
    rates = sorted((seconds / nbytes, nbytes) for nbytes, seconds in movable if nbytes > 0)

    def recompute_s(nbytes: float) -> float:
        total = 0.0
        for rate, size in rates:
            take = min(size, nbytes)
            total += rate * take
            nbytes -= take
            if nbytes <= 0:
                break
        return total

    def link_s(nbytes: float) -> float:
        return max(cost.transfer_time(int(nbytes), "device_to_host"), cost.transfer_time(int(nbytes), "host_to_device"))

    def time_at(swap: float) -> float:
        return max(compute_s + recompute_s(deficit_bytes - swap), link_s(swap))

    low, high = 0.0, float(deficit_bytes)  # recompute falls and the link rises with the swapped bytes
    for _ in range(60):
        middle = (low + high) / 2
        if compute_s + recompute_s(deficit_bytes - middle) > link_s(middle):
            low = middle
        else:
            high = middle
    crossing = high
    best = min(time_at(s) for s in (0.0, low, crossing, float(deficit_bytes)))
    # The least traffic that reaches that time: below the crossing the time is the compute plus the
    # recompute of what is not swapped, which falls as more is swapped.
    low, high = 0.0, crossing
    if compute_s + recompute_s(deficit_bytes) <= best * (1 + 1e-9):
        return best, 0
    for _ in range(60):
        middle = (low + high) / 2
        if compute_s + recompute_s(deficit_bytes - middle) <= best * (1 + 1e-9):
            high = middle
        else:
            low = middle
    return best, int(high)


@dataclasses.dataclass(frozen=True)
class WholeOpFloor:
    """The op that holds the most device memory while it runs, and how much.

    Attributes:
        op: Its name.
        op_type: Its type, e.g. ``"Conv2DBackpropInput"``.
        nbytes: Its inputs (weights included), its outputs and its kernel's scratch.

    Examples:
        >>> WholeOpFloor("conv/Conv2DBackpropInput", "Conv2DBackpropInput", 3 * 2**20).nbytes
        3145728
    """

    op: str
    op_type: str
    nbytes: int


def whole_op_floor(ir: GraphIR, kernels: str = "cudnn", cudnn_workspace_limit: Optional[int] = None
                   ) -> Optional[WholeOpFloor]:
    """The least device memory any plan needs that runs every op of ``ir`` whole: while an op runs,
    its inputs, its outputs and its kernel's scratch are all on the device, whatever was swapped
    or recomputed before. No budget below it can be met without splitting that op (micro-batches,
    a sharded layer), which may change how its sums are rounded.

    Counted under the simulator's rules: an elementwise kernel of
    :data:`~lms_tf.core.op_kinds.FORWARDING_TYPES` may write into an input of its output's size
    (counted once); ops that run no kernel of their own (aliases, resident reads, functional
    control flow whose bodies are ops of their own, variable updates, collectives) are not
    candidates.

    Args:
        ir: The step's IR.
        kernels: The kernel library whose scratch to count (:data:`~lms_tf.simulate.lower.KERNEL_LIBRARIES`).
        cudnn_workspace_limit: A cap on cuDNN's workspace, in bytes
            (:attr:`~lms_tf.cost.DeviceSpec.cudnn_workspace_limit_bytes`); None: no cap.

    Returns:
        The :class:`WholeOpFloor`, or None for a step with no candidate op.

    Examples:
        >>> from lms_tf.core import make_ir
        >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (1024,))]),
        ...               dict(name="w", type="Placeholder", outputs=[("w:0", (1024, 256))]),
        ...               dict(name="y", type="MatMul", inputs=["x:0", "w:0"], outputs=[("y:0", (256,))]),
        ...               dict(name="r", type="Relu", inputs=["y:0"], outputs=[("r:0", (256,))])])
        >>> whole_op_floor(ir)   # 4 KiB + 1 MiB in, 1 KiB out; the Relu writes into its input
        WholeOpFloor(op='y', op_type='MatMul', nbytes=1053696)
    """
    check_kernel_library(kernels)
    best = None
    for op in ir.ops:
        if (op.is_alias or op.type in RESIDENT_TYPES or op.type in CONTROL_FLOW_OP_TYPES
                or op.type.startswith(VARIABLE_UPDATE_PREFIXES) or is_collective(op.type)):
            continue
        reads = [ir.tensors[t].nbytes or 0 for t in dict.fromkeys(op.inputs)]
        writes = [ir.tensors[t].nbytes or 0 for t in op.outputs]
        if op.type in FORWARDING_TYPES:
            unused = list(reads)
            for i, size in enumerate(writes):
                if size and size in unused:
                    unused.remove(size)
                    writes[i] = 0
        nbytes = sum(reads) + sum(writes) + kernel_scratch_bytes(ir, op, kernels, cudnn_workspace_limit)
        if best is None or nbytes > best.nbytes:
            best = WholeOpFloor(op.name, op.type, nbytes)
    return best
