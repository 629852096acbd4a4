"""The budget planner: KEEP / SWAP / RECOMPUTE per tensor so the simulated peak fits a budget.

KARMA's idea, driven by the simulator. Recompute bases are tried cheapest first: nothing,
``"cheap"`` ops, then Chen et al.'s segments (``"sqrt"``) with several segment counts (the two
with the lowest recompute-only peaks), each segment recomputed once behind one gate. On top of
each base, greedy rounds swap what sits idle in device memory at the simulated peak (produced
before it, first read by the backward pass after it), cheapest per byte first, until the bytes
over budget are covered; the step is replayed and the rounds repeat until the peak fits or the
link is saturated. The fitting plan with the least predicted step time wins. A swap's cost is
the copy time the compute between producer and consumer cannot hide, plus copy-out time past
the end of the forward pass (a copy still running at the peak frees nothing).

When no swap lowers the peak any more and two backward branches' temporaries meet at it (a
residual block's shortcut and main path, run interleaved by TensorFlow's first-ready executor),
one branch is made to wait for the other (:class:`~lms_tf.core.plan.Ordering`). When nothing
fits while the forward pass runs ahead of its copies out (the link is the bottleneck: the
largest batches), the bases are tried again with the forward pass waiting for the copies out
(TFLMS's synchronous swap-out) and swap-ins started a fixed number of groups ahead of their
consumers instead of by the plain step's clock.

User overrides win: ``exclude`` keeps, a ``recompute`` list of names recomputes exactly those,
``swap=False`` / ``recompute=False`` forbid one kind. If even moving every movable tensor
does not fit, :class:`InfeasibleBudgetError` names the smallest budget that does.

Examples:
    >>> import tensorflow as tf
    >>> from lms_tf.tf.trace import build_ir
    >>> from lms_tf.core.policy import Policies
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> w = tf.Variable(tf.ones((1024, 1024)))
    >>> @tf.function
    ... def step(x):
    ...     with tf.GradientTape() as tape:
    ...         h = x
    ...         for _ in range(8):
    ...             h = tf.nn.relu(h @ w)
    ...         loss = tf.reduce_sum(h)
    ...     w.assign_sub(tape.gradient(loss, w))
    ...     return loss
    >>> ir = build_ir(step.get_concrete_function(tf.TensorSpec((4096, 1024))).graph)
    >>> policies = Policies(host="/CPU:1", budget="60%")
    >>> plan = make_budget_plan(ir, policies, device="/device:CPU:0", cost=CostModel(get_device_spec("gh200-96gb-c2c")))
    >>> p = plan.predictions
    >>> p.feasible, p.planned_peak_bytes <= plan.budget_bytes < p.baseline_peak_bytes
    (True, True)
    >>> len(plan.swapped) > 0
    True
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Dict, List, Mapping, Optional, Tuple

from lms_tf.core.errors import LMSOptionError, host_budget_error, infeasible
from lms_tf.core.ir import GraphIR
from lms_tf.core.plan import Decision, Plan, Predictions, WeightDecision
from lms_tf.core.policy import Policies, format_bytes, resolve_budget
from lms_tf.core.op_kinds import WORKSPACE_TYPES
from lms_tf.cost.devices import WORKSPACE_LIMIT_VARIABLE
from lms_tf.cost.model import CostModel
from lms_tf.planner.candidates import UNSIZED_LOOP_REASON
from lms_tf.planner.search import BudgetSearch
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.weights import weight_candidates
from lms_tf.simulate import host_resident, resident_buffers
from lms_tf.simulate.bounds import fit_lower_bound, whole_op_floor

logger = logging.getLogger("lms_tf")

#: ``weights="auto"``: how many sets of variables the planner tries after its first choice, each
#: with one chosen variable kept on the device (each try is a budget search).
KEEP_BACK_TRIES = 8
#: ``weights="auto"``'s order only: what a copy costs besides its bytes (a DMA's setup and a
#: kernel launch, microseconds on a PCIe GPU), so that a bias, a few KiB a copy, is moved after the
#: kernels. The simulator times copies by their bytes alone.
RANKING_COPY_LATENCY_S = 10e-6


def _bytes_text(nbytes: int) -> str:
    return f"{format_bytes(nbytes)} ({nbytes} bytes)"


def _what_stays(plan: Plan, top: int = 3) -> str:
    """The largest activations the lowest plan still keeps and why, and the loops whose values
    could not be sized (their memory is missing from every figure)."""
    resident = ("variable read", "derived from variables or constants only", "function input")
    kept = sorted((d for d in plan.decisions if d.decision is Decision.KEEP and d.nbytes and d.reason not in resident),
                  key=lambda d: -d.nbytes)
    unsized = sorted({d.tensor.rsplit(":", 1)[0] for d in plan.decisions if d.reason.startswith(UNSIZED_LOOP_REASON)})
    text = ""
    if unsized:
        text += (f" Loops {', '.join(map(repr, unsized))} keep per-iteration values whose size is not static (a "
                 f"trip count or element shape known only at run time): they are not counted above and may set the "
                 f"real floor; give the loop a static maximum_iterations or fixed shapes.")
    if kept:
        text += " The largest activations that stay: " + "; ".join(
            f"{d.tensor!r} {format_bytes(d.nbytes)} ({d.reason})" for d in kept[:top]) + "."
    return text


def _largest_op(ir: GraphIR, cost: CostModel) -> str:
    """The op that needs the most device memory at once: no plan that runs it whole goes below it
    (the planner slices only the ops of :data:`~lms_tf.core.op_kinds.BATCH_SLICED_INPUTS`)."""
    limit = cost.device.cudnn_workspace_limit_bytes
    largest = whole_op_floor(ir, cudnn_workspace_limit=limit)
    if largest is None:
        return ""
    text = (f" The op that needs the most at once, {largest.op!r} ({largest.op_type}), holds "
            f"{format_bytes(largest.nbytes)} while it runs (its inputs, weights included, its outputs and "
            f"scratch): no plan that runs it whole holds less on the device.")
    if largest.op_type in WORKSPACE_TYPES and limit is None:
        text += (f" Its scratch is cuDNN's workspace, counted as its largest operand; TensorFlow caps it with "
                 f"{WORKSPACE_LIMIT_VARIABLE} (MiB, set before its first convolution), which the planner then counts.")
    return text


def make_budget_plan(ir: GraphIR, policies: Policies, *, device: str, cost: CostModel,
                     scope_aliases: Optional[Mapping[str, str]] = None) -> Plan:
    """Plans the step so its simulated peak fits ``policies.budget`` at the least predicted slowdown.

    Args:
        ir: The step's IR.
        policies: Validated policies with a ``budget``.
        device: Full name of the managed accelerator.
        scope_aliases: Keras layer name -> its name scope in this trace.
        cost: The cost model of the device planned for.

    Returns:
        The plan, with the simulated peaks, predicted times and ``feasible=True``.

    Raises:
        InfeasibleBudgetError: Nothing fits; the message names the smallest feasible budget.
        LMSOptionError: Bad ``exclude``/``recompute`` names.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> plan = make_budget_plan(GraphIR((), {}, frozenset(), {}), Policies(budget="1GiB"), device="/device:GPU:0",
        ...                         cost=CostModel(get_device_spec("a100-40gb-pcie4")))
        >>> plan.predictions.feasible
        True
    """
    # The simulations create millions of short-lived, acyclic objects; the cyclic garbage
    # collector, triggered by that allocation count, re-walks the IR's large object graph each
    # time (ResNet-152: about 40% of planning time). Reference counting frees them all.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _make_budget_plan(ir, policies, device=device, scope_aliases=scope_aliases, cost=cost)
    finally:
        if collecting:
            gc.enable()


def _make_budget_plan(ir: GraphIR, policies: Policies, *, device: str, scope_aliases: Optional[Mapping[str, str]],
                      cost: CostModel) -> Plan:
    if policies.budget is None:
        raise LMSOptionError("make_budget_plan needs policies with a budget (bytes, a fraction or 'auto'); received "
                             "budget=None. Use make_plan for the TFLMS rule without a budget.")
    started = time.perf_counter()
    spec = cost.device
    step = PlanningStep.build(ir, policies, device=device, cost=cost, scope_aliases=scope_aliases)
    _check_host_holds_the_variables(step)
    baseline = step.baseline
    total_bytes = None
    if policies.weights == "auto":
        # The budget is the device's memory for the whole step, the variables that stay included:
        # only then does moving one to the host make room.
        total_bytes = resolve_budget(policies.budget, baseline_peak_bytes=baseline.peak_bytes + step.resident,
                                     memory_bytes=spec.memory_bytes, device_name=spec.name, resident=0)
        step, search, (plan, sim, label, floor) = _choose_weights_on_host(step, total_bytes)
        budget_bytes = total_bytes - step.resident
        floor = floor if floor is None else floor + step.resident
    else:
        budget_bytes = resolve_budget(policies.budget, baseline_peak_bytes=baseline.peak_bytes,
                                      memory_bytes=spec.memory_bytes, device_name=spec.name, resident=step.resident)
        search = BudgetSearch(step)
        plan, sim, label, floor = search.fit(budget_bytes)
    if sim.held_bytes > budget_bytes:
        resident = step.resident if total_bytes is not None else 0  # weights='auto': the floor counts them
        counted = "in TensorFlow's allocator's whole chunks" if floor - resident > sim.peak_bytes else "simulated"
        kinds = " and ".join(k for k, on in (("swapping", policies.swap), ("recomputing", policies.recompute)) if on)
        hint = ("" if policies.swap and policies.recompute else
                f", or allow {'recompute' if not policies.recompute else 'swap'} too")
        asked = budget_bytes if total_bytes is None else total_bytes
        counting = "" if total_bytes is None else " with every variable on the host (weights='auto' counts them)"
        raise infeasible(
            f"budget {_bytes_text(asked)} is infeasible on {spec.name}: the plain step peaks at "
            f"{_bytes_text(baseline.peak_bytes)} (simulated) and {kinds or 'moving'} every movable tensor{counting} "
            f"still needs {_bytes_text(floor)} ({counted}). The smallest feasible budget is about "
            f"{_bytes_text(floor)}; pass budget >= that, "
            f"a smaller batch{hint}.{_what_stays(plan)}{_largest_op(step.ir, cost)}",
            asked, floor)
    _check_host_memory(step, plan, sim.host_peak_bytes)
    logger.info("lms-tf planner: %s peak %.1f -> %.1f MiB (budget %.1f MiB; recompute %s; %d simulations) "
                "in %.2f s", spec.name, baseline.peak_bytes / 2**20, sim.peak_bytes / 2**20, budget_bytes / 2**20,
                label, search.check.simulations, time.perf_counter() - started)
    return dataclasses.replace(plan, budget_bytes=budget_bytes if total_bytes is None else total_bytes,
                               device_spec=spec.name, predictions=Predictions(
        baseline_peak_bytes=baseline.peak_bytes, planned_peak_bytes=sim.peak_bytes,
        planned_allocator_peak_bytes=sim.allocator_peak_bytes, baseline_step_time_s=baseline.step_time_s,
        predicted_step_time_s=sim.step_time_s, feasible=True, bytes_to_host=sim.swap_out_bytes,
        bytes_to_device=sim.swap_in_bytes, host_peak_bytes=sim.host_peak_bytes,
        **_least_time_to_fit(step, budget_bytes)))


def offload_order(step: PlanningStep) -> List[WeightDecision]:
    """``weights="auto"``: the variables in the order the planner puts them on the host, the least
    link time per byte freed first. A weight on the host frees its bytes of device memory for the
    whole step and costs a copy per window of its readers, each copy a fixed latency plus its
    bytes over the link: large weights read in few windows come first, a bias (latency for a few
    bytes) or a weight shared by many layers last. Among equal costs per byte the larger first:
    one move frees more. (The latency is :data:`RANKING_COPY_LATENCY_S`, for this order only.)

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> step = PlanningStep.build(weighted_chain_ir(), Policies(weights="auto", budget="50%", swapin_groupby=1),
        ...                           device="/device:GPU:0", cost=CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> [(w.variable, len(w.fetches)) for w in offload_order(step)]   # w1: the forward read only
        [('w1:0', 1), ('w2:0', 2)]
    """
    def seconds_per_byte(weight: WeightDecision) -> float:
        return _copy_seconds(step, weight) / max(1, weight.nbytes or 0)

    return sorted(weight_candidates(step.ir, step.policies),
                  key=lambda w: (seconds_per_byte(w), -(w.nbytes or 0), w.variable))


def _copy_seconds(step: PlanningStep, weight: WeightDecision) -> float:
    """What ``weight``'s copies cost a step on the host, for ranking: one per window, each
    :data:`RANKING_COPY_LATENCY_S` plus its bytes over the link."""
    copy = RANKING_COPY_LATENCY_S + step.cost.transfer_time(weight.nbytes or 0, "host_to_device")
    return len(weight.fetches) * copy


def _choose_weights_on_host(step: PlanningStep, total_bytes: int):
    """``weights="auto"``: the variables on the host with which the step fits ``total_bytes`` of
    device memory (the variables that stay counted) at the least predicted time. First the fewest
    in :func:`offload_order` (fitting grows with the count, so the least is found by bisection),
    then twice as many and all (moving more may free enough to swap or recompute less), then, from
    the fastest of those, chosen variables kept on the device while the step still fits and is no
    slower (:func:`_kept_back`): the order is a guess, and a weight whose windows cover the peak
    frees nothing there but costs its copies. The simulator judges every set.
    Each set tried is one budget search for what the resident variables leave. Returns the chosen
    step, its search and its result; when nothing fits, those with every variable on the host
    (whose floor the error names)."""
    order = offload_order(step)
    tried: Dict[frozenset, tuple] = {}

    def attempt(variables: frozenset):
        if variables not in tried:
            chosen = step.with_offloaded(variables)
            search = BudgetSearch(chosen)
            result = search.fit(max(0, total_bytes - chosen.resident))
            tried[variables] = (chosen, search, result)
            needed = chosen.resident + result[1].held_bytes
            logger.info("lms-tf planner, weights='auto': %d of %d variables on the host (%.1f MiB): the step needs "
                        "%.1f MiB of the device (%.1f MiB of it resident variables), budget %.1f MiB: %s, "
                        "predicted %.4f s", len(variables), len(order),
                        sum(w.nbytes or 0 for w in order if w.variable in variables) / 2**20,
                        needed / 2**20, chosen.resident / 2**20, total_bytes / 2**20,
                        "fits" if needed <= total_bytes else "does not fit", result[1].step_time_s)
        return tried[variables]

    def fits(variables: frozenset) -> bool:
        chosen, _, result = attempt(variables)
        return chosen.resident + result[1].held_bytes <= total_bytes

    def first(count: int) -> frozenset:
        return frozenset(w.variable for w in order[:count])

    def seconds(variables: frozenset) -> float:
        return tried[variables][2][1].step_time_s

    if fits(first(0)) or not order:
        best = first(0)
    elif not fits(first(len(order))):
        best = first(len(order))  # nothing fits: the error names this floor
    else:
        low, high = 0, len(order)  # low does not fit, high fits
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(first(middle)) else (middle, high)
        for count in sorted({min(len(order), 2 * high), len(order)}):
            fits(first(count))
        best = min((v for v in tried if fits(v)), key=lambda v: (seconds(v), len(v), sorted(v)))
        best = _kept_back(sorted(order, key=lambda w: -_copy_seconds(step, w)), best, fits, seconds)
    chosen, search, (plan, sim, label, floor) = attempt(best)
    kept = [dataclasses.replace(w, decision=Decision.KEEP, fetches=(),
                                reason="weights='auto': stays on the device (the budget fits without moving it)")
            for w in order if w.variable not in best]
    return chosen, search, (dataclasses.replace(plan, weights=plan.weights + tuple(kept)), sim, label, floor)


def _kept_back(costliest_first: List[WeightDecision], best: frozenset, fits, seconds) -> frozenset:
    """``best`` with chosen variables kept on the device, one at a time, those whose copies cost
    the most first, while the step still fits and is no slower (``fits``, ``seconds``: of a set of
    variables on the host), starting over after each one kept; at most :data:`KEEP_BACK_TRIES`
    sets not tried before. Without hitting that limit, keeping any one more back no longer fits
    or is slower."""
    searched = set()
    while True:
        for weight in [w for w in costliest_first if w.variable in best]:
            fewer = best - {weight.variable}
            if fewer not in searched and len(searched) == KEEP_BACK_TRIES:
                return best
            searched.add(fewer)
            if fits(fewer) and seconds(fewer) <= seconds(best):
                best = fewer
                break
        else:
            return best


def _check_host_holds_the_variables(step: PlanningStep) -> None:
    """Raises :class:`HostBudgetError` before the search when the variables the host holds for the
    whole step (weights on the host and their optimizer slots; the slots alone with
    ``weights="auto"``) are already more than ``host_budget`` allows: no plan can need less, and
    the search takes minutes on a large model (a 40-block decoder many times too wide took over
    20 minutes to reach the same error)."""
    limit, what = step.host_limit()
    held = sum(nbytes for handle, nbytes in resident_buffers(step.ir) if handle in step.on_host)
    if limit is None or held <= limit:
        return
    raise host_budget_error(
        f"weights={step.policies.weights!r} keeps {_bytes_text(held)} of weights and optimizer slots in host memory "
        f"for the whole step, before any tensor is swapped or gradient copied out: more than {what}: "
        f"{_bytes_text(limit)}. {_LARGER_HOST_BUDGET}, or weights='device' for some variables.", limit, held)


#: What both host memory errors advise first.
_LARGER_HOST_BUDGET = "Pass a larger host_budget (per process: with several processes on one machine, each its share)"


def _check_host_memory(step: PlanningStep, plan: Plan, needed: int) -> None:
    """Raises :class:`HostBudgetError` when the planned step holds more on the host than
    ``host_budget`` (default: the machine's physical memory) allows."""
    limit, what = step.host_limit()
    if limit is None or needed <= limit:
        return
    held = sum(nbytes for _, nbytes in host_resident(step.ir, {w.variable for w in plan.offloaded_weights}))
    raise host_budget_error(
        f"the plan fits the device but holds {_bytes_text(needed)} in host memory at its peak "
        f"({_bytes_text(held)} of weights and optimizer slots on the host, the rest swapped tensors, gradients "
        f"copied out and the update's temporaries), more than {what}: {_bytes_text(limit)}. {_LARGER_HOST_BUDGET}, "
        f"weights='device' for some variables, or a larger budget= so fewer tensors are swapped.", limit, needed)


def _least_time_to_fit(step: PlanningStep, budget_bytes: int) -> dict:
    """The plan-independent bound: the movable tensors live at the plain peak, each swappable over
    the link or recomputable at its producer's time (not recomputable if recompute is off)."""
    recompute = bool(step.policies.recompute)
    movable = [(nbytes, step.op_times[step.ir.tensors[name].producer] if recompute else float("inf"))
               for name, nbytes in step.baseline.live_at_peak if name in step.eligible]
    bound = fit_lower_bound(step.baseline.compute_time_s, step.baseline.peak_bytes - budget_bytes, movable, step.cost)
    if bound is None:
        return {}
    return {"least_step_time_s": bound[0], "least_traffic_bytes": bound[1]}
