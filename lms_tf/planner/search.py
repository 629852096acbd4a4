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
time (:meth:`BudgetSearch.slice_the_peak_op`); last, copies that hold their bytes at a peak they
take no part in are made to: a forward op waits for a copy out (:meth:`BudgetSearch.wait_for_a_copy_out`),
an idle swap-in starts later (:meth:`BudgetSearch.delay_a_swap_in`). Each move changes one part
of a plan's :class:`~lms_tf.planner.timing.Choices`. The fitting plan with the least predicted step
time wins, and is then refined (:mod:`~lms_tf.planner.refine`).

Examples:
    >>> MAX_ROUNDS, LOWER_AIMS, GRADIENT_WAITS_TRIED, SWAPPED_IN_TWICE_TRIED, OPS_AROUND_TRIED, SLICES_TRIED
    (40, 2, 3, 3, 2, (2, 4, 8, 16))
    >>> DELAYED_SWAP_INS_TRIED, DELAYED_SWAP_IN_LEADS, COPIES_OUT_WAITED_FOR
    (3, (0.5, 0.0), 3)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Hashable, Iterable, Mapping, Optional, Tuple

from lms_tf.core.errors import PlanCycleError
from lms_tf.core.op_kinds import BATCH_SLICED_INPUTS, SWAP_IN_PREFIX
from lms_tf.core.plan import Plan, TensorDecision
from lms_tf.planner.bases import compute_floor, recompute_bases
from lms_tf.planner.fit_check import FitCheck, plan_key
from lms_tf.planner.ordering import ORDERING_PAIRS, BranchOrdering
from lms_tf.planner.refine import lower_the_lowest, recompute_checkpoints, recomputed_checkpoints_label, retime_swap_ins
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import (DELAYED_FETCH_LEADS, Choices, Tools, clone_fetches_in_turn, copies_out_at_peak,
                                   delayed_fetches, fetches_after, gradients_on_device_at_peak, idle_clone_fetches,
                                   idle_fetches, idle_swap_ins, ops_between_readers, swap_round, waiting_for_gradient)
from lms_tf.planner.weights import forward_gates
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
#: How many swap-ins whose copy waits idle on the device at the peak the planner tries starting
#: later, in turn (the largest first).
DELAYED_SWAP_INS_TRIED = 3
#: Head starts tried, in order, for such a swap-in (fractions of its copy's time; 0: triggered by
#: the last gate before its readers).
DELAYED_SWAP_IN_LEADS = (0.5, 0.0)
#: How many copies out that alone keep their tensor on the device at the peak the planner tries
#: making a forward op wait for, in turn (the largest first).
COPIES_OUT_WAITED_FOR = 3
#: How many earlier clones the planner tries making a recompute region's idle weight fetch wait for
#: (the latest before its readers first).
CLONE_FETCH_TRIGGERS_TRIED = 2
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
        self.branches = BranchOrdering(step.ir, step.device)
        self.bases, self.base_policies = recompute_bases(step)
        self._sliceable = any(op.type in BATCH_SLICED_INPUTS for op in step.ir.ops)  # the slicing passes
        # The choices a plan was built from that it does not show (swap-in leads, waits for
        # copies out chosen by a move), so a later move or refinement builds on them.
        self._unshown: Dict[Hashable, Choices] = {}
        self._host_limit_bytes = step.host_limit()[0]
        self._forward_gates: Optional[frozenset] = None  # ops a clone of which may trigger a copy, once needed

    def choices_of(self, plan: Plan, recomputed: Mapping[str, TensorDecision], tools: Tools) -> Choices:
        """The choices ``plan`` was built from (by :meth:`build`, or else as far as it shows them), on
        the recompute base ``recomputed`` with ``tools``.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> search = BudgetSearch(PlanningStep.example())   # core.examples.chain_ir, 75% on a GH200
            >>> plan, _ = search.add_swaps(9 * MiB, {})
            >>> sorted(search.choices_of(plan, {}, Tools()).swap), search.choices_of(plan, {}, Tools()).leads
            (['a:0'], {})
        """
        built = self._unshown.get(plan_key(plan))
        if built is not None:
            return built.replace(recomputed=recomputed, tools=tools)
        return Choices.of(plan, recomputed, tools)

    def build(self, choices: Choices) -> Plan:
        """The plan of ``choices`` for this step (:meth:`Choices.build`), remembered for
        :meth:`choices_of` when it has choices a plan does not show.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> search = BudgetSearch(PlanningStep.example())
            >>> plan = search.build(Choices(swap=frozenset({"a:0"}), leads={"a:0": 0.0}))
            >>> search.choices_of(plan, {}, Tools()).leads
            {'a:0': 0.0}
        """
        plan = choices.build(self.step)
        if choices.leads or choices.copy_out_waits:
            # As the plan has them: a tensor chosen but left kept (no gate early enough) is not swapped.
            self._unshown[plan_key(plan)] = choices.replace(swap=frozenset(d.tensor for d in plan.swapped))
        return plan

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
            choices = Choices(recomputed=recomputed, tools=tools)
            plan = self.build(choices)
            sim = self.check.simulate(plan)
            choices = choices.replace(weights=plan.weights)
        else:
            plan, sim = start
            choices = self.choices_of(plan, recomputed, tools)
        ir, cost = self.step.ir, self.step.cost
        link_busy = sum(cost.transfer_time(ir.tensors[t].nbytes or 0, "device_to_host") for t in choices.swap)
        for _ in range(MAX_ROUNDS):
            if sim.held_bytes <= budget_bytes:
                break
            moved = self.delay_a_fetch(sim, choices) or self.wait_for_a_gradient(sim, choices)
            if moved is not None:
                logger.debug("planner round: peak %d -> %d fetching a weight later (or after a gradient)", sim.peak_bytes,
                             moved[2].peak_bytes)
                choices, plan, sim = moved
                continue
            swapped = (swap_round(self.step, budget_bytes, sim, set(choices.swap), recomputed, link_busy)
                       if self.step.policies.swap else None)
            if swapped is not None:
                candidate_choices = choices.replace(swap=frozenset(swapped[0]))
                candidate = self.build(candidate_choices)
                candidate_sim = self.check.simulate(candidate)
                logger.debug("planner round: peak %d -> %d swapping %d tensors", sim.peak_bytes,
                             candidate_sim.peak_bytes, len(swapped[0]))
                # When the link is saturated, more swaps only slow the step down.
                if candidate_sim.held_bytes < sim.held_bytes or candidate_sim.step_time_s <= sim.step_time_s:
                    choices, plan, sim, link_busy = candidate_choices, candidate, candidate_sim, swapped[1]
                    continue
            # Then, in turn: running two backward branches one after the other; a copy at the peak
            # brought back twice; the op at the peak run a slice of the batch at a time (below what
            # it holds run whole); a forward op waiting for a copy out; a swap-in that arrived too
            # early started later. (Each came after the ones before it: a search that went that
            # far without it is left as it was.)
            for move, what in ((self.fetch_for_clones_in_turn, "fetching a recompute region's weights in turn"),
                               (self.order_branches if tools.order else None, "ordering backward branches"),
                               (self.swap_in_twice, "swapping a tensor in twice"),
                               (self.slice_the_peak_op if tools.slice_ops else None, "slicing an op"),
                               (self.wait_for_a_copy_out if tools.late_copies else None,
                                "making a forward op wait for a copy out"),
                               (self.delay_a_swap_in if tools.late_copies else None, "swapping a tensor in later")):
                moved = move(sim, choices) if move is not None else None
                if moved is not None:
                    logger.debug("planner round: peak %d -> %d %s", sim.peak_bytes, moved[2].peak_bytes, what)
                    choices, plan, sim = moved
                    # The orderings as the plan has them (a split adds a wait of its own); after a
                    # split or a slice, the tensors it swaps (its inputs are swapped to be sliced).
                    choices = choices.replace(orderings=plan.orderings)
                    if move in (self.swap_in_twice, self.slice_the_peak_op):
                        choices = choices.replace(swap=frozenset(d.tensor for d in plan.swapped))
                    break
            else:
                break
        return plan, sim

    def delay_a_fetch(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """Lowers the peak by fetching later the largest weight that waits idle on the device at
        it (:func:`~lms_tf.planner.timing.idle_fetches`), with the first of
        :data:`~lms_tf.planner.timing.DELAYED_FETCH_LEADS` that lowers it: its window may then wait
        for part of the copy. None if no such weight, or no delay lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # weights on the device: no fetch to delay
            >>> BudgetSearch(step).delay_a_fetch(step.baseline, Choices(weights=())) is None
            True
        """
        weights = choices.weights or ()
        tried = (delayed_fetches(self.step, weights, weight.variable, lead)
                 for _, weight in idle_fetches(self.step, sim, weights) for lead in DELAYED_FETCH_LEADS)
        return self._first_lower(sim, (choices.replace(weights=w) for w in tried if w != weights))

    def fetch_for_clones_in_turn(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """Lowers the peak by fetching a weight a recompute region reads after an earlier clone of
        that region instead of after its gate: the largest such weight idle on the device at the
        peak (:func:`~lms_tf.planner.timing.idle_clone_fetches`), after the latest clone before its
        readers that may trigger a copy, or the one before it (:data:`CLONE_FETCH_TRIGGERS_TRIED`).
        None if no such weight, or no such wait lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # nothing recomputed: no clone fetches
            >>> search = BudgetSearch(step)
            >>> search.fetch_for_clones_in_turn(step.baseline, Choices(weights=())) is None
            True
        """
        if self._forward_gates is None:
            self._forward_gates = frozenset(op.name for op in forward_gates(self.step.ir))
        plan = self.build(choices)
        tried = (choices.replace(weights=weights)
                 for _, variable, gate in idle_clone_fetches(self.step, sim, plan)[:1]
                 for weights in clone_fetches_in_turn(self.step, plan, variable, gate,
                                                      self._forward_gates)[:CLONE_FETCH_TRIGGERS_TRIED])
        return self._first_lower(sim, tried)

    def wait_for_a_gradient(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """Lowers the peak by holding the backward pass back until the largest weight gradient still
        being copied to the host at it has arrived (and left the device): a weight fetch after the
        gradient (:func:`~lms_tf.planner.timing.fetches_after`, at most :data:`GRADIENT_WAITS_TRIED`)
        waits for that copy, and its window with it. None if no such gradient, or no wait lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # the update on the device: nothing to wait for
            >>> BudgetSearch(step).wait_for_a_gradient(step.baseline, Choices(weights=())) is None
            True
        """
        weights = choices.weights or ()
        tried = (choices.replace(weights=waiting_for_gradient(weights, variable, window, gradient))
                 for _, gradient in gradients_on_device_at_peak(self.step, sim)[:1]
                 for variable, window in fetches_after(self.step, sim, weights, gradient)[:GRADIENT_WAITS_TRIED])
        return self._first_lower(sim, tried)

    def delay_a_swap_in(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """Lowers the peak by starting later the swap-ins whose copies wait idle on the device at it
        (:func:`~lms_tf.planner.timing.idle_swap_ins`: none of their readers has started, some are
        still to run): all of them, then each alone (the largest first, at most
        :data:`DELAYED_SWAP_INS_TRIED`), their swap-ins started :data:`DELAYED_SWAP_IN_LEADS` of the
        copy's time before their readers instead, which may then wait for part of the copy. A
        swap-in timed to hide its copy, or lagged a fixed number of reader groups ahead of the
        compute, can arrive during a peak it takes no part in (VGG16: the last block's activations
        beside `fc1`'s weight gradient). The copies arriving later can leave a weight fetch waiting
        idle at the new peak: when a delay alone does not lower the peak, that fetch is delayed too
        (:meth:`delay_a_fetch`). None if no such copy, or nothing lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # nothing swapped: no copy to delay
            >>> BudgetSearch(step).delay_a_swap_in(step.baseline, Choices()) is None
            True
        """
        idle = [tensor for _, tensor in idle_swap_ins(self.step, sim, choices.build(self.step))]
        groups = [idle] + [[tensor] for tensor in idle[:DELAYED_SWAP_INS_TRIED]] if len(idle) > 1 else [idle]
        default = 0.0 if choices.tools.late_swap_ins else 1.0
        for lead in DELAYED_SWAP_IN_LEADS if idle else ():
            for group in groups:
                later = {tensor: lead for tensor in group if choices.leads.get(tensor, default) > lead}
                replayed = self._replayed(choices.replace(leads={**choices.leads, **later})) if later else None
                if replayed is None:
                    continue
                if replayed[2].held_bytes < sim.held_bytes:
                    return replayed
                fetched_later = self.delay_a_fetch(replayed[2], replayed[0])
                if fetched_later is not None and fetched_later[2].held_bytes < sim.held_bytes:
                    return fetched_later
        return None

    def wait_for_a_copy_out(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """Lowers the peak by making a forward op wait until a swapped tensor's copy to the host has
        ended, when that copy alone keeps the tensor on the device at the peak
        (:func:`~lms_tf.planner.timing.copies_out_at_peak`, the largest first, at most
        :data:`COPIES_OUT_WAITED_FOR` of them): the op at the peak, or the first to start once the
        tensor's readers are done (the lower wins). TFLMS's synchronous swap-out, for the copy that
        matters: the forward pass pauses for it instead of running ahead beside it. None if no such
        copy, or no wait lowers the peak.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # nothing swapped: no copy out to wait for
            >>> BudgetSearch(step).wait_for_a_copy_out(step.baseline, Choices()) is None
            True
        """
        copies = copies_out_at_peak(self.step, sim, choices.build(self.step))[:COPIES_OUT_WAITED_FOR]
        for _, tensor, waiters in copies:
            best = self._lowest(sim, (choices.replace(copy_out_waits={**choices.copy_out_waits, tensor: op})
                                      for op in waiters if choices.copy_out_waits.get(tensor) != op))
            if best is not None:
                return best
        return None

    def swap_in_twice(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
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
            >>> BudgetSearch(step).swap_in_twice(step.baseline, Choices()) is None
            True
        """
        copies: Dict[str, int] = {}  # swapped tensor -> bytes of its copy on the device at the peak
        for key, nbytes in sim.live_at_peak:
            if key.startswith(SWAP_IN_PREFIX):
                tensor = key[len(SWAP_IN_PREFIX):].rsplit("/", 1)[0]
                if tensor in choices.swap and tensor not in choices.split:
                    copies[tensor] = max(copies.get(tensor, 0), nbytes)
        for _, tensor in sorted((-nbytes, tensor) for tensor, nbytes in copies.items())[:SWAPPED_IN_TWICE_TRIED]:
            between = ops_between_readers(self.step, tensor)
            # The ops that run nearest the peak first (a tensor read early and late in a block's
            # backward pass has many ops between its readers; each try is a replay).
            between.sort(key=lambda op: abs(sim.op_intervals.get(op, (float("inf"),))[0] - sim.peak_time_s))
            best = self._lowest(sim, (choices.replace(split={**choices.split, tensor: op})
                                      for op in between[:OPS_AROUND_TRIED]))
            if best is not None:
                return best
        return None

    def slice_the_peak_op(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
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
            >>> BudgetSearch(step).slice_the_peak_op(step.baseline, Choices()) is None
            True
        """
        ir, sliced = self.step.ir, choices.sliced
        # The op at the peak, or one running when it was reached (the peak may be a copy that
        # starts while the op runs).
        at = sim.peak_time_s
        running = [sim.peak_op] + sorted(name for name, (start, end) in sim.op_intervals.items() if start <= at < end)
        names = [name[len("slice/"):].rsplit("/", 1)[0] if name.startswith("slice/") else name for name in running]
        op = next((name for name in names if ir.has_op(name) and ir.op(name).type in BATCH_SLICED_INPUTS), None)
        if op is None:
            return None
        info = ir.op(op)
        batch = (ir.tensors[info.outputs[0]].shape or (None,))[0] if info.outputs else None
        if not batch or batch < 2:
            return None
        inputs = {info.inputs[i] for i in BATCH_SLICED_INPUTS[info.type] if i < len(info.inputs)}
        swap = choices.swap | (inputs & set(self.step.found.eligible))
        counts = [k for k in SLICES_TRIED if k <= batch] if op not in sliced else [min(2 * sliced[op], batch)]
        tried = [choices.replace(swap=swap, sliced={**sliced, op: k}) for k in counts if sliced.get(op) != k]
        if tried and not any(s.op == op for s in tried[0].build(self.step).sliced):
            return None  # none of its inputs can be swapped
        return self._lowest(sim, tried)

    def _replayed(self, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """``choices``, their plan and its replay; None if the plan cannot run (an ordering or wait
        against a gate: :class:`~lms_tf.core.errors.PlanCycleError`)."""
        plan = self.build(choices)
        try:
            return choices, plan, self.check.simulate(plan)
        except PlanCycleError:
            return None

    def _first_lower(self, sim: Simulation, tried: Iterable[Choices]) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """The first of the choices ``tried`` whose plan holds less than ``sim``, with its plan and replay."""
        for choices in tried:
            replayed = self._replayed(choices)
            if replayed is not None and replayed[2].held_bytes < sim.held_bytes:
                return replayed
        return None

    def _lowest(self, sim: Simulation, tried: Iterable[Choices], measure: str = "held_bytes"
                ) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """Of the choices ``tried``, the one whose plan holds the least (``measure`` of its replay)
        if less than ``sim``, the first on a tie, with its plan and replay."""
        best = None
        for choices in tried:
            replayed = self._replayed(choices)
            if replayed is not None and getattr(replayed[2], measure) < getattr((best or (0, 0, sim))[2], measure):
                best = replayed
        return best

    def order_branches(self, sim: Simulation, choices: Choices) -> Optional[Tuple[Choices, Plan, Simulation]]:
        """Lowers the peak by running two backward branches alive at it one after the other
        (either order, whichever simulates lower); None if no ordering lowers it.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> BudgetSearch(step).order_branches(step.baseline, Choices(tools=Tools(order=True))) is None
            True
        """
        for a, b in self.branches.branch_pairs(sim)[:ORDERING_PAIRS]:
            orderings = (self.branches.ordering(first, then) for first, then in ((a, b), (b, a)))
            best = self._lowest(sim, (choices.replace(orderings=choices.orderings + (o,))
                                      for o in orderings if o is not None), measure="peak_bytes")
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
        passes = [(bases, Tools(), "", None), (bases, Tools(late_swap_ins=True), " + late swap-ins", None),
                  (bases, Tools(late_swap_ins=True, order=True), " + late swap-ins + orderings", None)]
        if self.step.policies.swap:
            # The forward pass waits for its copies out and swap-ins lag behind the compute; with
            # late copies, a forward op waits for the copy out at the peak, an idle swap-in starts later.
            throttled = Tools(order=True, throttle=True, late_copies=True)
            passes.append((every_base, throttled, " + orderings + waits for copies out", None))
            # Last, where nothing else fits: ops run a slice of the batch at a time (a launch per
            # slice, and copies its readers may wait for), where the step has such an op, and the
            # moves for copies that hold their bytes at a peak they take no part in. Only when
            # nothing fits without them, so a plan that fits without them is found as before. Each
            # runs from scratch and on from where the pass it extends ended (the greedy rounds
            # slice the first time the op is at the peak, which can lead elsewhere).
            sliced = " + sliced ops" if self._sliceable else ""
            passes += [(bases, Tools(late_swap_ins=True, order=True, slice_ops=self._sliceable, late_copies=True),
                        f" + late swap-ins + orderings{sliced} + late copies", passes[2][1]),
                       (every_base, dataclasses.replace(throttled, slice_ops=self._sliceable, late_copies=True),
                        f" + orderings + waits for copies out{sliced} + late copies", throttled)]
        floors = {label: compute_floor(self.step, recomputed) for label, recomputed in every_base}
        host_bound: Optional[Tuple[Plan, Simulation, str]] = None
        ended: Dict[Tuple[str, Tools], Tuple[Plan, Simulation]] = {}  # (base, tools) -> where its rounds ended
        for candidates, tools, suffix, extends in passes:
            for label, recomputed in sorted(candidates, key=lambda base: floors[base[0]]):
                if best is not None and floors[label] * (1 - 1e-9) >= best[1].step_time_s:
                    break  # this base, and every one after it, computes longer than the best plan takes
                plan, sim = self.add_swaps(budget_bytes, recomputed, tools)
                earlier = ended.get((label, extends))
                if earlier is not None:
                    further = self.add_swaps(budget_bytes, recomputed, tools, start=earlier)
                    if _better(further[1], sim, budget_bytes):
                        plan, sim = further
                ended[(label, tools)] = (plan, sim)
                searched = sim
                if sim.held_bytes > budget_bytes and sim.allocator_peak_bytes is None:
                    # Far above the budget its tensors were its measure; the lowest plan is judged as
                    # the allocator holds it (fewer tensors can hold more chunks).
                    sim = self.check.in_chunks(plan)
                logger.debug("lms-tf planner: %s%s holds %.1f MiB", label, suffix, sim.held_bytes / 2**20)
                if lowest is None or sim.held_bytes < lowest[1].held_bytes:
                    lowest = (plan, sim, label + suffix)
                    lowest_from, lowest_searched = (label, tools), searched
                if sim.held_bytes <= budget_bytes and not self._host_holds(sim):
                    # It fits the device, but the host cannot hold what it swaps: kept only for the
                    # error, should no plan fit both.
                    if host_bound is None or sim.step_time_s < host_bound[1].step_time_s:
                        host_bound = (plan, sim, label + suffix)
                elif sim.held_bytes <= budget_bytes and (best is None or sim.step_time_s < best[1].step_time_s):
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
        if best is None and host_bound is not None:
            return host_bound  # fits the device only: the planner's caller names the host's limit
        if best is None and lowest is not None:
            # Refined as the search measured it (its tensors, far above the budget: its moves compare
            # plans so), then judged again in chunks against the lowest as it was.
            refined, refined_sim, refined_label = lower_the_lowest(self, budget_bytes, lowest[0], lowest_searched,
                                                                   lowest[2], *lowest_from)
            if refined is not lowest[0]:
                if refined_sim.held_bytes > budget_bytes and refined_sim.allocator_peak_bytes is None:
                    refined_sim = self.check.in_chunks(refined)
                if refined_sim.held_bytes < lowest[1].held_bytes:
                    lowest = (refined, refined_sim, refined_label)
            if lowest[1].held_bytes <= budget_bytes:
                best = lowest
        plan, sim, label = best or lowest
        return plan, sim, label

    def _host_holds(self, sim: Simulation) -> bool:
        """Whether the host can hold what a plan keeps there at its peak (``host_budget``, else the
        machine's memory): a plan that fits the device but not the host is not one to choose."""
        return self._host_limit_bytes is None or sim.host_peak_bytes <= self._host_limit_bytes

    def _in_every_order(self, plan: Plan, sim: Simulation) -> Simulation:
        """``plan`` with its chunks counted in graph order and every checked tie order: as if
        searched for twice its tensors' peak, which no order's chunks reach (the least budget an
        error names must hold in each)."""
        return self.check.in_chunks(plan, budget_bytes=2 * sim.peak_bytes)

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
            sim = self._in_every_order(plan, sim)
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
            lowest_sim = self._in_every_order(lowest, lowest_sim)
            if lowest_sim.held_bytes < sim.held_bytes:
                plan, sim, label = lowest, lowest_sim, lowest_label
            if sim.held_bytes <= budget_bytes:
                return plan, sim, label, None
            floor = min(floor, sim.held_bytes)
        return plan, sim, label, floor


def _better(sim: Simulation, than: Simulation, budget_bytes: int) -> bool:
    """Whether a plan replayed as ``sim`` beats one replayed as ``than`` for ``budget_bytes``: it
    fits and is faster (or the other does not fit), or neither fits and it holds less."""
    fits, other_fits = sim.held_bytes <= budget_bytes, than.held_bytes <= budget_bytes
    if fits or other_fits:
        return fits and (not other_fits or sim.step_time_s < than.step_time_s)
    return sim.held_bytes < than.held_bytes
