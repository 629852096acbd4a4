"""The budget search: KEEP / SWAP / RECOMPUTE per tensor so the simulated step fits a budget, fastest first.

Recompute bases are tried cheapest first (:mod:`~lms_tf.planner.bases`). On top of each, greedy
rounds swap what sits idle in device memory at the simulated peak (produced before it, first read
after it), cheapest per byte first (:mod:`~lms_tf.planner.timing`), until the bytes over budget
are covered; the step is replayed (:mod:`~lms_tf.planner.fit_check`) and the rounds repeat until
it fits or the link is saturated. When no swap lowers the peak, two backward branches alive at it
are made to run one after the other (:mod:`~lms_tf.planner.ordering`); when that does not either,
a swapped tensor whose copy is on the device at the peak is brought back twice, around an op
between its readers (:meth:`BudgetSearch.swap_in_twice`); and when the op at the peak is one
that computes each example apart (a max pool's gradient), it is run a slice of the batch at a
time (:meth:`BudgetSearch.slice_the_peak_op`). The fitting plan with the least predicted step
time wins, and is then refined (:mod:`~lms_tf.planner.refine`).

Examples:
    >>> MAX_ROUNDS, LOWER_AIMS, GRADIENT_WAITS_TRIED, SWAPPED_IN_TWICE_TRIED, OPS_AROUND_TRIED, SLICES_TRIED
    (40, 2, 3, 3, 2, (2, 4, 8, 16))
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, Mapping, Optional, Set, Tuple

from lms_tf.core.errors import PlanCycleError
from lms_tf.core.op_kinds import BATCH_SLICED_INPUTS, SWAP_IN_PREFIX
from lms_tf.core.plan import Ordering, Plan, TensorDecision, WeightDecision
from lms_tf.planner.bases import compute_floor, recompute_bases
from lms_tf.planner.fit_check import FitCheck
from lms_tf.planner.ordering import ORDERING_PAIRS, BranchOrdering
from lms_tf.planner.refine import lower_the_lowest, recompute_checkpoints, recomputed_checkpoints_label, retime_swap_ins
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import (DELAYED_FETCH_LEADS, Tools, assemble, delayed_fetches, fetches_after,
                                   gradients_on_device_at_peak, idle_fetches, ops_between_readers, sliced_ops,
                                   split_swap_ins, swap_round, waiting_for_gradient)
from lms_tf.simulate import Simulation

logger = logging.getLogger("lms_tf")

#: Rounds of simulate-and-free before the planner gives up.
MAX_ROUNDS = 40
#: When nothing fits, how many times the planner searches again aiming below the budget by the
#: lowest plan's excess: the greedy search stops where a plan first fits, so a lower aim can reach
#: plans a search at the budget itself never visits.
LOWER_AIMS = 2
#: How many weight fetches after a gradient still being copied out at the peak the planner tries
#: making wait for that copy, in turn (the one the peak op reads first, then the nearest before it).
GRADIENT_WAITS_TRIED = 3
#: How many swapped tensors whose copy waits through the op at the peak the planner tries
#: swapping in twice around it, in turn (the largest first).
SWAPPED_IN_TWICE_TRIED = 3
#: For each, how many of the ops between its readers it tries being swapped in twice around.
OPS_AROUND_TRIED = 2
#: Into how many slices of the batch the planner tries cutting an op it slices (at most the batch).
SLICES_TRIED = (2, 4, 8, 16)


class BudgetSearch:
    """Searches the plans of one step for the fastest that fits a budget.

    Examples:
        >>> from lms_tf.core import Policies, make_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> step = PlanningStep.build(make_ir([]), Policies(budget=1024), device="/device:GPU:0",
        ...                           cost=CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> BudgetSearch(step).plan(1024)[2]
        'none'
    """

    def __init__(self, step: PlanningStep):
        self.step = step
        self.check = FitCheck(step)
        self.branches = BranchOrdering(step.ir)
        self.bases, self.base_policies = recompute_bases(step)
        self._op_names = frozenset(op.name for op in step.ir.ops)
        self._sliceable = any(op.type in BATCH_SLICED_INPUTS for op in step.ir.ops)  # the slicing passes

    def add_swaps(self, budget_bytes: int, recomputed: Mapping[str, TensorDecision],
                  tools: Tools = Tools(), start: Optional[Tuple[Plan, Simulation]] = None
                  ) -> Tuple[Plan, Simulation]:
        """Greedy rounds on top of a recompute base: swap the kept tensors idle at the simulated
        peak, cheapest per byte first, until the bytes over budget are covered; replay; repeat.
        With ``tools.order``, when no swap lowers the peak, run two backward branches alive at it
        one after the other (:meth:`order_branches`) and go on (see :class:`Tools`). ``start``
        (a plan on this base and its simulation) continues from that plan's swaps and orderings.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> plan, sim = BudgetSearch(step).add_swaps(9 * MiB, {})
            >>> [d.tensor for d in plan.swapped]
            ['a:0']
        """
        if start is None:
            swap: Set[str] = set()
            orderings: Tuple[Ordering, ...] = ()
            plan = assemble(self.step, swap, recomputed, tools)
            sim = self.check.simulate(plan)
        else:
            (plan, sim), swap, orderings = start, {d.tensor for d in start[0].swapped}, start[0].orderings
        weights, split, sliced = plan.weights, split_swap_ins(plan), sliced_ops(plan)
        ir, cost = self.step.ir, self.step.cost
        link_busy = sum(cost.transfer_time(ir.tensors[t].nbytes or 0, "device_to_host") for t in swap)
        for _ in range(MAX_ROUNDS):
            if sim.held_bytes <= budget_bytes:
                break
            delayed = (self.delay_a_fetch(sim, swap, recomputed, tools, orderings, weights, split, sliced)
                       or self.wait_for_a_gradient(sim, swap, recomputed, tools, orderings, weights, split, sliced))
            if delayed is not None:
                logger.debug("planner round: peak %d -> %d fetching a weight later (or after a gradient)", sim.peak_bytes,
                             delayed[1].peak_bytes)
                plan, sim = delayed
                weights = plan.weights
                continue
            swapped = (swap_round(self.step, budget_bytes, sim, swap, recomputed, link_busy)
                       if self.step.policies.swap else None)
            if swapped is not None:
                candidate = assemble(self.step, swapped[0], recomputed, tools, orderings, weights=weights, split=split,
                                     sliced=sliced)
                candidate_sim = self.check.simulate(candidate)
                logger.debug("planner round: peak %d -> %d swapping %d tensors", sim.peak_bytes,
                             candidate_sim.peak_bytes, len(swapped[0]))
                # When the link is saturated, more swaps only slow the step down.
                if candidate_sim.held_bytes < sim.held_bytes or candidate_sim.step_time_s <= sim.step_time_s:
                    swap, link_busy = swapped
                    plan, sim = candidate, candidate_sim
                    continue
            ordered = (self.order_branches(sim, swap, recomputed, tools, orderings, weights, split, sliced)
                       if tools.order else None)
            if ordered is None:
                # The last resort (an extra copy, and a search that went this far before it
                # existed is left as it was): a copy at the peak brought back twice.
                twice = self.swap_in_twice(sim, swap, recomputed, tools, orderings, weights, split, sliced)
                if twice is None:
                    # Below what the op at the peak holds run whole: that op a slice at a time.
                    twice = (self.slice_the_peak_op(sim, swap, recomputed, tools, orderings, weights, split, sliced)
                             if tools.slice_ops else None)
                    if twice is None:
                        break
                    logger.debug("planner round: peak %d -> %d slicing %s", sim.peak_bytes, twice[1].peak_bytes,
                                 sim.peak_op)
                else:
                    logger.debug("planner round: peak %d -> %d swapping a tensor in twice", sim.peak_bytes,
                                 twice[1].peak_bytes)
                plan, sim = twice
                swap = {d.tensor for d in plan.swapped}
                orderings, split, sliced = plan.orderings, split_swap_ins(plan), sliced_ops(plan)
                continue
            logger.debug("planner round: peak %d -> %d ordering backward branches", sim.peak_bytes,
                         ordered[1].peak_bytes)
            plan, sim = ordered
            orderings = plan.orderings
        return plan, sim

    def delay_a_fetch(self, sim: Simulation, swap: Set[str], recomputed: Mapping[str, TensorDecision],
                      tools: Tools, orderings: Tuple[Ordering, ...], weights: Tuple[WeightDecision, ...],
                      split: Optional[Mapping[str, str]] = None, sliced: Optional[Mapping[str, int]] = None
                      ) -> Optional[Tuple[Plan, Simulation]]:
        """Lowers the peak by fetching later the largest weight that waits idle on the device at
        it (:func:`~lms_tf.planner.timing.idle_fetches`), with the first of
        :data:`~lms_tf.planner.timing.DELAYED_FETCH_LEADS` that lowers it: its window may then wait
        for part of the copy. None if no such weight, or no delay lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # weights on the device: no fetch to delay
            >>> BudgetSearch(step).delay_a_fetch(step.baseline, set(), {}, Tools(), (), ()) is None
            True
        """
        tried = (delayed_fetches(self.step, weights, weight.variable, lead)
                 for _, weight in idle_fetches(self.step, sim, weights) for lead in DELAYED_FETCH_LEADS)
        return self._first_lower(sim, swap, recomputed, tools, orderings, (w for w in tried if w != weights), split,
                                 sliced)

    def wait_for_a_gradient(self, sim: Simulation, swap: Set[str], recomputed: Mapping[str, TensorDecision],
                            tools: Tools, orderings: Tuple[Ordering, ...], weights: Tuple[WeightDecision, ...],
                            split: Optional[Mapping[str, str]] = None, sliced: Optional[Mapping[str, int]] = None
                      ) -> Optional[Tuple[Plan, Simulation]]:
        """Lowers the peak by holding the backward pass back until the largest weight gradient still
        being copied to the host at it has arrived (and left the device): a weight fetch after the
        gradient (:func:`~lms_tf.planner.timing.fetches_after`, at most :data:`GRADIENT_WAITS_TRIED`)
        waits for that copy, and its window with it. None if no such gradient, or no wait lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # the update on the device: nothing to wait for
            >>> BudgetSearch(step).wait_for_a_gradient(step.baseline, set(), {}, Tools(), (), ()) is None
            True
        """
        tried = (waiting_for_gradient(weights, variable, window, gradient)
                 for _, gradient in gradients_on_device_at_peak(self.step, sim)[:1]
                 for variable, window in fetches_after(self.step, sim, weights, gradient)[:GRADIENT_WAITS_TRIED])
        return self._first_lower(sim, swap, recomputed, tools, orderings, tried, split, sliced)

    def swap_in_twice(self, sim: Simulation, swap: Set[str], recomputed: Mapping[str, TensorDecision],
                      tools: Tools, orderings: Tuple[Ordering, ...], weights: Tuple[WeightDecision, ...],
                      split: Optional[Mapping[str, str]] = None, sliced: Optional[Mapping[str, int]] = None
                      ) -> Optional[Tuple[Plan, Simulation]]:
        """Lowers the peak when a swapped tensor's copy is on the device at it, brought back for
        readers on both sides of an op: the readers that need not wait for that op get a swap-in of
        their own and run before it, the others a second swap-in started when it ends
        (:func:`~lms_tf.planner.timing.readers_around`). The ops between the readers that run
        nearest the peak are tried (:func:`~lms_tf.planner.timing.ops_between_readers`, at most
        :data:`OPS_AROUND_TRIED`), the copy at the peak largest first (at most
        :data:`SWAPPED_IN_TWICE_TRIED` of them); the lowest wins. It costs one more copy.
        None if no such copy, or no split lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # nothing swapped: no copy to split
            >>> BudgetSearch(step).swap_in_twice(step.baseline, set(), {}, Tools(), (), ()) is None
            True
        """
        split = dict(split or {})
        copies: Dict[str, int] = {}  # swapped tensor -> bytes of its copy on the device at the peak
        for key, nbytes in sim.live_at_peak:
            if key.startswith(SWAP_IN_PREFIX):
                tensor = key[len(SWAP_IN_PREFIX):].rsplit("/", 1)[0]
                if tensor in swap and tensor not in split:
                    copies[tensor] = max(copies.get(tensor, 0), nbytes)
        best = None
        for _, tensor in sorted((-nbytes, tensor) for tensor, nbytes in copies.items())[:SWAPPED_IN_TWICE_TRIED]:
            between = ops_between_readers(self.step, tensor)
            # The ops that run nearest the peak first (a tensor read early and late in a block's
            # backward pass has many ops between its readers; each try is a replay).
            between.sort(key=lambda op: abs(sim.op_intervals.get(op, (float("inf"),))[0] - sim.peak_time_s))
            for op in between[:OPS_AROUND_TRIED]:
                plan = assemble(self.step, swap, recomputed, tools, orderings, weights=weights,
                                split={**split, tensor: op}, sliced=sliced)
                try:
                    candidate = self.check.simulate(plan)
                except PlanCycleError:
                    continue  # the wait against a gate or another ordering
                if candidate.held_bytes < (best or (None, sim))[1].held_bytes:
                    best = (plan, candidate)
            if best is not None:
                return best
        return None

    def slice_the_peak_op(self, sim: Simulation, swap: Set[str], recomputed: Mapping[str, TensorDecision],
                          tools: Tools, orderings: Tuple[Ordering, ...], weights: Tuple[WeightDecision, ...],
                          split: Optional[Mapping[str, str]] = None, sliced: Optional[Mapping[str, int]] = None
                          ) -> Optional[Tuple[Plan, Simulation]]:
        """Lowers the peak when the op at it (or one running when it is reached) is one a slice of the
        batch at a time computes exactly (:data:`~lms_tf.core.op_kinds.BATCH_SLICED_INPUTS`, a max
        pool's gradient): its batch-sized
        inputs swapped, and it run in :data:`SLICES_TRIED` slices (or twice as many as it already
        is), its swapped inputs copied in a slice at a time (:func:`~lms_tf.planner.slicing.slice_op`).
        The count that holds least wins, the fewer slices on a tie. It costs a launch per slice,
        a concatenation, and the swapped input's copy for the op's other readers, which now starts
        when the slices are put together. None if the op at the peak is not such an op, or no
        count lowers the peak.

        Used by :meth:`add_swaps` with ``tools.slice_ops``: the search's last passes, run only when
        nothing fits without it.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # a chain of matmuls: nothing to slice
            >>> BudgetSearch(step).slice_the_peak_op(step.baseline, set(), {}, Tools(), (), ()) is None
            True
        """
        ir, sliced = self.step.ir, dict(sliced or {})
        # The op at the peak, or one running when it was reached (the peak may be a copy that
        # starts while the op runs).
        at = sim.peak_time_s
        running = [sim.peak_op] + sorted(name for name, (start, end) in sim.op_intervals.items() if start <= at < end)
        names = [name[len("slice/"):].rsplit("/", 1)[0] if name.startswith("slice/") else name for name in running]
        op = next((name for name in names if name in self._op_names and ir.op(name).type in BATCH_SLICED_INPUTS), None)
        if op is None:
            return None
        info = ir.op(op)
        batch = (ir.tensors[info.outputs[0]].shape or (None,))[0] if info.outputs else None
        if not batch or batch < 2:
            return None
        inputs = {info.inputs[i] for i in BATCH_SLICED_INPUTS[info.type] if i < len(info.inputs)}
        swap = set(swap) | (inputs & set(self.step.found.eligible))
        counts = [k for k in SLICES_TRIED if k <= batch] if op not in sliced else [min(2 * sliced[op], batch)]
        best = None
        for k in counts:
            if sliced.get(op) == k:
                continue
            plan = assemble(self.step, swap, recomputed, tools, orderings, weights=weights, split=split,
                            sliced={**sliced, op: k})
            if not any(s.op == op for s in plan.sliced):
                return None  # none of its inputs can be swapped
            try:
                candidate = self.check.simulate(plan)
            except PlanCycleError:
                continue
            if candidate.held_bytes < (best or (None, sim))[1].held_bytes:
                best = (plan, candidate)
        return best

    def _first_lower(self, sim: Simulation, swap: Set[str], recomputed: Mapping[str, TensorDecision], tools: Tools,
                     orderings: Tuple[Ordering, ...], tried: Iterable[Tuple[WeightDecision, ...]],
                     split: Optional[Mapping[str, str]] = None, sliced: Optional[Mapping[str, int]] = None
                     ) -> Optional[Tuple[Plan, Simulation]]:
        """The first of the weight decisions ``tried`` with which the plan holds less than ``sim``, and its replay."""
        for weights in tried:
            plan = assemble(self.step, swap, recomputed, tools, orderings, weights=weights, split=split, sliced=sliced)
            try:
                candidate = self.check.simulate(plan)
            except PlanCycleError:
                continue  # a wait against a gate or an ordering
            if candidate.held_bytes < sim.held_bytes:
                return plan, candidate
        return None

    def order_branches(self, sim: Simulation, swap: Set[str], recomputed: Mapping[str, TensorDecision],
                       tools: Tools, orderings: Tuple[Ordering, ...],
                       weights: Optional[Tuple[WeightDecision, ...]] = None,
                       split: Optional[Mapping[str, str]] = None, sliced: Optional[Mapping[str, int]] = None
                      ) -> Optional[Tuple[Plan, Simulation]]:
        """Lowers the peak by running two backward branches alive at it one after the other
        (either order, whichever simulates lower); None if no ordering lowers it.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> from lms_tf.planner.timing import Tools
            >>> BudgetSearch(step).order_branches(step.baseline, set(), {}, Tools(order=True), ()) is None
            True
        """
        best = None
        for a, b in self.branches.branch_pairs(sim)[:ORDERING_PAIRS]:
            for first, then in ((a, b), (b, a)):
                ordering = self.branches.ordering(first, then)
                if ordering is None:
                    continue
                plan = assemble(self.step, swap, recomputed, tools, orderings + (ordering,), weights=weights,
                                split=split, sliced=sliced)
                try:
                    candidate = self.check.simulate(plan)
                except PlanCycleError:
                    continue  # the order conflicts with a recompute gate or a swap-in trigger
                if candidate.peak_bytes < (best or (None, sim))[1].peak_bytes:
                    best = (plan, candidate)
            if best is not None:
                return best
        return None

    def plan(self, budget_bytes: int) -> Tuple[Plan, Simulation, str]:
        """The fastest plan that fits, trying recompute bases in order; else the lowest peak found.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> plan, sim, label = BudgetSearch(step).plan(12 * MiB + 4)
            >>> label, sim.held_bytes <= 12 * MiB + 4
            ('none', True)
        """
        self.check.budget_bytes, self.check.time_to_beat = budget_bytes, None
        best: Optional[Tuple[Plan, Simulation, str]] = None
        lowest: Optional[Tuple[Plan, Simulation, str]] = None
        every_base = bases = self.bases
        # Swapping alone frees at most what the link can copy out during the forward pass
        # (unless the forward pass waits for the copies).
        link_capacity = self.step.forward_seconds * self.step.cost.device.device_to_host_bytes_per_s
        if len(bases) > 1 and self.step.baseline.peak_bytes - budget_bytes > link_capacity:
            bases = [b for b in bases if b[0] != "none"]
        # Cheapest tools first; the others only when nothing fits without them (each pass
        # simulates the step again many times).
        passes = [(bases, Tools(), ""), (bases, Tools(late_swap_ins=True), " + late swap-ins"),
                  (bases, Tools(late_swap_ins=True, order=True), " + late swap-ins + orderings")]
        if self.step.policies.swap:
            passes.append((every_base, Tools(order=True, throttle=True), " + orderings + waits for copies out"))
        if self.step.policies.swap and self._sliceable:
            # Last, where nothing else fits: ops run a slice of the batch at a time (a launch per
            # slice, and copies its readers may wait for). Only when nothing fits without them, so a
            # plan that fits without slicing is found as before.
            passes += [(bases, Tools(late_swap_ins=True, order=True, slice_ops=True),
                        " + late swap-ins + orderings + sliced ops"),
                       (every_base, Tools(order=True, throttle=True, slice_ops=True),
                        " + orderings + waits for copies out + sliced ops")]
        floors = {label: compute_floor(self.step, recomputed) for label, recomputed in every_base}
        for candidates, tools, suffix in passes:
            for label, recomputed in sorted(candidates, key=lambda base: floors[base[0]]):
                if best is not None and floors[label] * (1 - 1e-9) >= best[1].step_time_s:
                    break  # this base, and every one after it, computes longer than the best plan takes
                plan, sim = self.add_swaps(budget_bytes, recomputed, tools)
                logger.debug("lms-tf planner: %s%s holds %.1f MiB", label, suffix, sim.held_bytes / 2**20)
                if lowest is None or sim.held_bytes < lowest[1].held_bytes:
                    lowest = (plan, sim, label + suffix)
                    lowest_from = (label, tools)
                if sim.held_bytes <= budget_bytes and (best is None or sim.step_time_s < best[1].step_time_s):
                    best = (plan, sim, label + suffix)
                    best_from = (label, tools)
                    self.check.time_to_beat = sim.step_time_s
                if best is not None and label in ("none", "cheap"):
                    break  # no recompute (or only cheap ops) fits: nothing faster to find
            if best is not None:
                plan, sim, recomputed = recompute_checkpoints(self, budget_bytes, best[0], best[1], *best_from)
                best = (plan, sim, best[2] + recomputed_checkpoints_label(recomputed))
                if tools.late_swap_ins:
                    best = retime_swap_ins(self, budget_bytes, *best, tools)
                break
        if best is None and lowest is not None:
            lowest = lower_the_lowest(self, budget_bytes, *lowest, *lowest_from)
            if lowest[1].held_bytes <= budget_bytes:
                best = lowest
        plan, sim, label = best or lowest
        return plan, sim, label

    def _in_chunks(self, plan: Plan, sim: Simulation) -> Simulation:
        """``plan`` replayed for any budget its tensors fit, so its allocator chunks are counted too
        (a plan whose tensors exceeded the budget searched for was never replayed through them)."""
        self.check.budget_bytes, self.check.time_to_beat = 2 * sim.peak_bytes, None
        return self.check.simulate(plan)

    def fit(self, budget_bytes: int) -> Tuple[Plan, Simulation, str, Optional[int]]:
        """:meth:`plan` for ``budget_bytes``; when nothing fits, up to :data:`LOWER_AIMS` more
        searches aiming below it by the lowest plan's excess. Returns the plan, its simulation,
        its label and, when it does not fit, the least budget of the lowest plan found (its chunks
        counted in graph order and the checked tie orders, whatever its tensors' peak: a plan
        whose tensors exceeded the budget was never replayed through the allocator model).

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> plan, sim, label, floor = BudgetSearch(step).fit(12 * MiB + 4)
            >>> floor is None   # it fits: there is no smaller floor to name
            True
        """
        plan, sim, label = self.plan(budget_bytes)
        floor, aim = None, budget_bytes
        for attempt in range(LOWER_AIMS + 1):
            if sim.held_bytes <= aim:  # fits what it was planned for, chunks counted
                break
            sim = self._in_chunks(plan, sim)
            floor = sim.held_bytes if floor is None else min(floor, sim.held_bytes)
            excess = sim.held_bytes - budget_bytes
            if excess <= 0 or attempt == LOWER_AIMS or aim <= excess:
                break
            aim -= excess
            logger.info("lms-tf planner: nothing fits %.1f MiB (lowest plan %.1f MiB); searching again aiming at "
                        "%.1f MiB", budget_bytes / 2**20, sim.held_bytes / 2**20, aim / 2**20)
            plan, sim, label = self.plan(aim)
        if floor is not None and aim > 1:
            # Nothing fits: the search aimed at nothing, whose lowest plan a budget nothing meets
            # names as the smallest feasible budget. The greedy rounds stop where a plan first
            # covers the excess, so a search at a budget can miss a plan the one aimed lower finds;
            # without this, asking for the budget that error named could fail again.
            lowest, lowest_sim, lowest_label = self.plan(1)
            lowest_sim = self._in_chunks(lowest, lowest_sim)
            if lowest_sim.held_bytes < sim.held_bytes:
                plan, sim, label = lowest, lowest_sim, lowest_label
            if sim.held_bytes <= budget_bytes:
                return plan, sim, label, None
            floor = min(floor, sim.held_bytes)
        return plan, sim, label, floor
