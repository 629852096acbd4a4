"""Refining a plan the search found: swapped checkpoints recomputed instead, late swap-ins re-timed.

Examples:
    >>> RECOMPUTED_CHECKPOINTS_TRIED, RETIME_LEADS
    (8, (1.0, 0.5))
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, Tuple

from lms_tf.core.errors import PlanCycleError
from lms_tf.core.plan import Plan
from lms_tf.planner.bases import recompute_only
from lms_tf.planner.candidates import clonable
from lms_tf.planner.recompute import checkpoint_gates
from lms_tf.planner.timing import Tools
from lms_tf.simulate import Simulation

if TYPE_CHECKING:
    from lms_tf.planner.search import BudgetSearch

logger = logging.getLogger("lms_tf")

#: How many swapped checkpoints (largest first) the planner tries to recompute instead.
RECOMPUTED_CHECKPOINTS_TRIED = 8
#: Head starts tried when re-timing late swap-ins (fractions of the copy's time).
RETIME_LEADS = (1.0, 0.5)


def recomputed_checkpoints_label(count: int) -> str:
    """The label suffix saying how many swapped checkpoints a plan recomputes instead.

    Examples:
        >>> recomputed_checkpoints_label(2)
        ' (2 swapped checkpoints recomputed)'
    """
    return f" ({count} swapped checkpoint{'s' if count > 1 else ''} recomputed)" if count else ""


def recompute_checkpoints(search: "BudgetSearch", budget_bytes: int, plan: Plan, sim: Simulation, base: str,
                          tools: Tools, fitting: bool = True) -> Tuple[Plan, Simulation, int]:
    """A fitting plan made faster by recomputing swapped checkpoints instead (KARMA's joint
    choice, per tensor). A checkpoint the clones of a segment read comes back through a swap-in
    started by the segment's gate, so the clones wait for the whole copy; recomputing it from
    the checkpoint before it costs its region's compute instead. Largest first, each is kept
    recomputed, behind the first of its :func:`checkpoint_gates` with which the plan still
    fits and the step gets shorter (``fitting=False``, for a plan that does not fit: with which
    the peak gets lower). Returns the plan, its simulation and how many checkpoints it
    recomputes.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> from lms_tf.planner.search import BudgetSearch
        >>> from lms_tf.planner.timing import Tools
        >>> search = BudgetSearch(step)
        >>> plan, sim = search.add_swaps(9 * MiB, {})
        >>> recompute_checkpoints(search, 9 * MiB, plan, sim, "none", Tools())[2]   # no recompute base: nothing to do
        0
    """
    policy = search.base_policies.get(base)
    if policy is None:
        return plan, sim, 0
    read_by_clones = set()
    for d in plan.recomputed:
        for name in d.recompute_ops:
            read_by_clones.update(search.step.ir.op(name).inputs)
    ir = search.step.ir
    tries = sorted((d for d in plan.swapped if d.tensor in read_by_clones and
                    clonable(ir.op(ir.tensors[d.tensor].producer))), key=lambda d: -(d.nbytes or 0))
    base_decisions = list(plan.recomputed)
    dropped: Dict[str, str] = {}
    for decision in tries[:RECOMPUTED_CHECKPOINTS_TRIED]:
        for gate in checkpoint_gates(search.step.ir, search.step.found, decision.tensor, base_decisions):
            also = {**dropped, decision.tensor: gate}
            recomputed = recompute_only(search.step, *policy, also=also)
            swap = {d.tensor for d in plan.swapped} - set(also)
            candidate = search.build(search.choices_of(plan, recomputed, tools).replace(swap=frozenset(swap)))
            try:
                candidate_sim = search.check.simulate(candidate)
            except PlanCycleError:
                continue
            logger.debug("planner: recomputing checkpoint %s (gate %s) instead of swapping it: held %d bytes, "
                         "step %.4f s (was %.4f s)", decision.tensor, gate, candidate_sim.held_bytes,
                         candidate_sim.step_time_s, sim.step_time_s)
            if (candidate_sim.held_bytes <= budget_bytes and candidate_sim.step_time_s < sim.step_time_s
                    if fitting else candidate_sim.held_bytes < sim.held_bytes):
                plan, sim, dropped = candidate, candidate_sim, also
                search.check.time_to_beat = sim.step_time_s if fitting else None
                break
    return plan, sim, len(dropped)


def lower_the_lowest(search: "BudgetSearch", budget_bytes: int, plan: Plan, sim: Simulation, label: str, base: str,
                     tools: Tools) -> Tuple[Plan, Simulation, str]:
    """Nothing fits: the lowest plan found, with swapped checkpoints recomputed where that lowers
    its peak, and then more swap rounds from there. It may fit now; if not, the error names a
    smaller feasible budget.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> from lms_tf.planner.search import BudgetSearch
        >>> from lms_tf.planner.timing import Tools
        >>> search = BudgetSearch(step)
        >>> plan, sim = search.add_swaps(9 * MiB, {})
        >>> lower_the_lowest(search, 9 * MiB, plan, sim, "none", "none", Tools())[2]
        'none'
    """
    lowered, lowered_sim, recomputed = recompute_checkpoints(search, budget_bytes, plan, sim, base, tools,
                                                                  fitting=False)
    if not recomputed:
        return plan, sim, label
    label += recomputed_checkpoints_label(recomputed)
    swapped, swapped_sim = search.add_swaps(budget_bytes, {d.tensor: d for d in lowered.recomputed}, tools,
                                          start=(lowered, lowered_sim))
    if swapped_sim.held_bytes < lowered_sim.held_bytes:
        return swapped, swapped_sim, label + " + more swaps"
    return lowered, lowered_sim, label


def retime_swap_ins(search: "BudgetSearch", budget_bytes: int, plan: Plan, sim: Simulation, label: str,
                    tools: Tools) -> Tuple[Plan, Simulation, str]:
    """A fitting plan with late swap-ins, made faster: one swapped tensor at a time (largest
    first), its swap-ins get the whole head start the copy needs, or half of it, whichever
    is the first to keep the peak within budget and shorten the step.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> from lms_tf.planner.search import BudgetSearch
        >>> from lms_tf.planner.timing import Tools
        >>> search = BudgetSearch(step)
        >>> plan, sim = search.add_swaps(9 * MiB, {}, Tools(late_swap_ins=True))
        >>> retime_swap_ins(search, 16 * MiB, plan, sim, "late", Tools(late_swap_ins=True))[2]  # nothing to gain
        'late'
    """
    choices = search.choices_of(plan, {d.tensor: d for d in plan.recomputed}, tools)
    leads: Dict[str, float] = dict(choices.leads)
    retimed = 0
    for decision in sorted(plan.swapped, key=lambda d: -(d.nbytes or 0)):
        for lead in RETIME_LEADS:
            if leads.get(decision.tensor, 0.0) >= lead:
                break  # started this early already (the search may have started it later than this)
            candidate = search.build(choices.replace(leads={**leads, decision.tensor: lead}))
            try:
                candidate_sim = search.check.simulate(candidate)
            except PlanCycleError:
                continue
            if candidate_sim.held_bytes <= budget_bytes and candidate_sim.step_time_s < sim.step_time_s:
                plan, sim, leads = candidate, candidate_sim, {**leads, decision.tensor: lead}
                retimed += 1
                search.check.time_to_beat = sim.step_time_s
                break
    return plan, sim, label + (f" ({retimed} swap-ins re-timed)" if retimed else "")
