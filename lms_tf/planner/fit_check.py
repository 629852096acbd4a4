"""The fit check: a plan fits when its tensors, and TensorFlow's allocator's whole chunks, fit the budget.

Examples:
    >>> TIE_ORDERS_CHECKED
    4
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Dict, Hashable, Iterator, Optional, Tuple

from lms_tf.core.errors import PlanCycleError
from lms_tf.core.plan import Plan
from lms_tf.planner.step import PlanningStep
from lms_tf.simulate import Simulation, simulate, simulate_tie_orders
from lms_tf.simulate.allocator import chunk_peak_moment, replay_allocations, tensorflow_gpu_allocator

logger = logging.getLogger("lms_tf")

#: Random tie orders (``simulate(..., tie_seed=)``: the hash-ordered successors of nodes with more
#: than 8 out-edges) in which a plan that fits in graph order must fit too (:meth:`FitCheck.simulate`).
#: Whole chunks depend on the exact allocation order: when every tie is shuffled, one ResNet-50
#: 224² b32 plan at 25% on a V100 held 641-735 MiB over 13 orders with tensors at 641 in all.
TIE_ORDERS_CHECKED = 4
#: Up to how far above the budget (a factor) a plan's tensors may be for its graph order's whole
#: chunks to be counted too (:meth:`FitCheck.simulate`); above it, its tensors are its measure.
CHUNKS_COUNTED_ABOVE = 1.05
#: How many replayed plans (with their allocation logs) one fit check remembers: a search meets
#: the same plan again (each recompute base's first plan in every pass and at every lower aim,
#: the same greedy rounds), about half of its checks on ResNet-50.
REMEMBERED_REPLAYS = 256


def plan_key(plan: Plan) -> Hashable:
    """What a replay of ``plan`` depends on, as a dictionary key: its decisions, orderings, weight
    fetches and sliced ops (the device, host and policies are the same for every plan of one step).

    Examples:
        >>> from lms_tf.core.plan import Plan
        >>> plan_key(Plan((), "/device:GPU:0", "/device:CPU:0", {}, {})) == ((), (), (), ())
        True
    """
    return plan.decisions, plan.orderings, plan.weights, plan.sliced


class FitCheck:
    """Replays plans of one step, held to a budget as TensorFlow's allocator would hold them.

    Attributes:
        budget_bytes: The budget plans are held to (None: tensors only, no allocator replay).
        time_to_beat: Step time of the fastest fitting plan so far (slower plans skip the tie orders).
        simulations: How many plans were checked.
        cycles: How many of them could not run (:class:`~lms_tf.core.errors.PlanCycleError`: an
            ordering that conflicts with a gate); they are never replayed, nor remembered.

    Examples:
        >>> FitCheck.__init__.__doc__ is None
        True
    """

    def __init__(self, step: PlanningStep):
        self.step = step
        self.budget_bytes: Optional[int] = None
        self.time_to_beat: Optional[float] = None
        self.simulations = 1  # the plain step's
        self.replays = 1
        self.cycles = 0
        # A replay is a pure function of the plan (the step, cost and op times are fixed), so a
        # plan met again is answered from memory; what depends on the budget (the chunk count's
        # region, the tie orders' early stop) is recomputed from the remembered parts.
        self._replayed: "collections.OrderedDict[Tuple[Hashable, bool, Optional[int]], Simulation]" = collections.OrderedDict()
        self._chunks: Dict[Tuple[Hashable, Optional[int], int], int] = {}

    def simulate(self, plan: Plan) -> Simulation:
        """Replays the step with ``plan``. When its tensors fit the budget, their allocations are
        also replayed through the model of TensorFlow's GPU allocator (one region): whole chunks
        can need more than the tensors, and the plan must fit as the allocator holds it. Which
        chunks get reused depends on the order of ops that become ready together, which the
        executor does not keep from one process to the next for nodes with many readers, so a
        plan that fits in graph order is replayed in :data:`TIE_ORDERS_CHECKED` random tie
        orders too and held to the largest.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> from lms_tf.planner.timing import assemble
            >>> check = FitCheck(step)
            >>> check.budget_bytes = 16 * MiB
            >>> check.simulate(assemble(step, {"a:0"}, {})).peak_bytes // MiB
            12
        """
        self.simulations += 1
        key = plan_key(plan)
        try:
            sim = self._replay(key, plan, log_allocations=self.budget_bytes is not None)
        except PlanCycleError:
            self.cycles += 1
            raise
        if self.budget_bytes is not None and sim.peak_bytes <= self.budget_bytes * CHUNKS_COUNTED_ABOVE:
            # Near the budget too: the search compares plans by what they hold, and one whose
            # tensors just fit (its chunks counted) must not lose to one just above (counted in
            # tensors) that its chunks would hold as much or more.
            held, worst = self._held_in_chunks(key, None, sim), sim
            # A plan no faster than one already found will not be chosen: its graph order is enough.
            could_win = self.time_to_beat is None or sim.step_time_s < self.time_to_beat
            if could_win and held <= self.budget_bytes:
                for seed, other in self._tie_orders(key, plan):
                    held = max(held, other.peak_bytes, self._held_in_chunks(key, seed, other))
                    if held > self.budget_bytes:
                        worst = other
                        break
            # A plan that does not fit is described by the order it fails in, at the moment it
            # fails (its chunks' peak, when they hold more than its tensors): the search's moves
            # aim at that order's peak and what is on the device then.
            if held > self.budget_bytes and held > worst.peak_bytes:
                worst = self._at_chunk_peak(worst)
            sim = dataclasses.replace(worst, allocator_peak_bytes=held, allocations=())
            if held > self.budget_bytes:
                logger.debug("planner: the tensors need %d bytes and TensorFlow's allocator would hold %d bytes "
                             "in whole chunks (in graph order or another tie order)", sim.peak_bytes, held)
        return sim

    def in_chunks(self, plan: Plan, budget_bytes: Optional[int] = None) -> Simulation:
        """``plan`` replayed with its whole chunks counted whatever its tensors' peak (the fit
        check counts them only near the budget), as if searched for ``budget_bytes`` (default: the
        budget searched for, or the plan's tensors' peak if that is more), in graph order and in
        the checked tie orders while its chunks stay within that budget (a budget far above the
        plan: in every checked tie order). The budget is left as it was.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> from lms_tf.planner.timing import assemble
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> check = FitCheck(step)
            >>> check.budget_bytes = 1 * MiB   # far below the plan's tensors
            >>> sim = check.in_chunks(assemble(step, set(), {}))
            >>> sim.allocator_peak_bytes >= sim.peak_bytes, check.budget_bytes == 1 * MiB
            (True, True)
        """
        saved = self.budget_bytes, self.time_to_beat
        try:
            if budget_bytes is None:
                peak = self._replay(plan_key(plan), plan, log_allocations=True).peak_bytes
                budget_bytes = max(saved[0] or 0, peak)
            self.budget_bytes, self.time_to_beat = budget_bytes, None
            return self.simulate(plan)
        finally:
            self.budget_bytes, self.time_to_beat = saved

    def _replay(self, key: Hashable, plan: Plan, *, log_allocations: bool) -> Simulation:
        """The step replayed with ``plan`` in graph order, from memory when it was already."""
        memo_key = (key, log_allocations, None)
        sim = self._replayed.get(memo_key)
        if sim is not None:
            self._replayed.move_to_end(memo_key)
            return sim
        return self._remember(memo_key, simulate(self.step.ir, plan, cost=self.step.cost, top=None,
                                                 op_times=self.step.op_times, log_allocations=log_allocations))

    def _tie_orders(self, key: Hashable, plan: Plan) -> Iterator[Tuple[int, Simulation]]:
        """The plan replayed in each checked tie order, as needed: from memory, else from one
        lowering of the step for the first seed not remembered and the ones after it."""
        fresh: Optional[Iterator[Tuple[int, Simulation]]] = None
        for seed in range(TIE_ORDERS_CHECKED):
            sim = self._replayed.get((key, True, seed))
            if sim is None:
                if fresh is None:
                    seeds = range(seed, TIE_ORDERS_CHECKED)
                    fresh = zip(seeds, simulate_tie_orders(self.step.ir, plan, seeds, cost=self.step.cost,
                                                           op_times=self.step.op_times))
                for replayed_seed, sim in fresh:  # a seed still remembered is replayed again, not used
                    if replayed_seed == seed:
                        break
                self._remember((key, True, seed), sim)
            yield seed, sim

    def _remember(self, memo_key: Tuple[Hashable, bool, Optional[int]], sim: Simulation) -> Simulation:
        self.replays += 1
        self._replayed[memo_key] = sim
        if len(self._replayed) > REMEMBERED_REPLAYS:
            self._replayed.popitem(last=False)
        return sim

    def _held_in_chunks(self, key: Hashable, seed: Optional[int], sim: Simulation) -> int:
        region = self._region()
        memo_key = (key, seed, region)
        if memo_key not in self._chunks:
            self._chunks[memo_key] = self.held_in_chunks(sim)
        return self._chunks[memo_key]

    def _at_chunk_peak(self, sim: Simulation) -> Simulation:
        """``sim`` described at the moment its whole chunks peak (its peak op and time, and the
        buffers on the device then, by the bytes each asked for) instead of its tensors' peak."""
        _, key, live = chunk_peak_moment(sim.allocations, tensorflow_gpu_allocator(self._region()),
                                         history=self.step.pool_history)
        op = _op_allocating(key, sim.op_intervals) if key is not None else None
        if op is None:
            return sim
        return dataclasses.replace(sim, peak_op=op, peak_time_s=sim.op_intervals[op][0], live_at_peak=live)

    def _region(self) -> int:
        return max(self.step.cost.device.memory_bytes, self.step.resident + 4 * self.budget_bytes)

    def held_in_chunks(self, sim: Simulation) -> int:
        """The simulated step's peak as TensorFlow's GPU allocator would hold it (whole chunks).

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> check = FitCheck(step)
            >>> check.budget_bytes = 16 * MiB
            >>> from lms_tf.planner.timing import assemble
            >>> sim = check.simulate(assemble(step, set(), {}))
            >>> sim.held_bytes >= sim.peak_bytes
            True
        """
        return replay_allocations(sim.allocations, tensorflow_gpu_allocator(self._region()),
                                  history=self.step.pool_history)


def _op_allocating(key: str, op_intervals) -> Optional[str]:
    """The op (or simulated copy) that allocated buffer ``key``: a copy's buffer is named after it,
    an op's output after the op (``op:0``), a workspace or copy-on-write buffer after the op."""
    for candidate in (key, key.split("/", 1)[-1] if key.startswith(("workspace/", "copy_on_write/")) else None,
                      key.rsplit(":", 1)[0] if ":" in key else None):
        if candidate is not None and candidate in op_intervals:
            return candidate
    return None


def check_plain_step(ir, budget_bytes: int, policies, *, device: str, cost) -> Simulation:
    """The plain step (nothing moved) replayed as the planner holds its plans to ``budget_bytes``:
    ``held_bytes`` of the result is what must fit (whole chunks of TensorFlow's allocator, in
    graph order and the checked tie orders, when its tensors fit; else its tensors' peak). A
    plain step and a planned one are then judged by the same rule.

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import MiB, chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> sim = check_plain_step(chain_ir(), 64 * MiB, Policies(), device="/device:GPU:0",
        ...                        cost=CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> sim.held_bytes >= sim.peak_bytes == 12 * MiB + 4
        True
    """
    from lms_tf.planner.timing import assemble  # timing builds on this module

    step = PlanningStep.build(ir, policies, device=device, cost=cost)
    check = FitCheck(step)
    check.budget_bytes = budget_bytes
    return check.simulate(assemble(step, set(), {}))
