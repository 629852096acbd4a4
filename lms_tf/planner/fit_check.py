"""The fit check: a plan fits when its tensors, and TensorFlow's allocator's whole chunks, fit the budget.

Examples:
    >>> TIE_ORDERS_CHECKED
    4
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from lms_tf.core.plan import Plan
from lms_tf.planner.step import PlanningStep
from lms_tf.simulate import Simulation, simulate, simulate_tie_orders
from lms_tf.simulate.allocator import replay_allocations, tensorflow_gpu_allocator

logger = logging.getLogger("lms_tf")

#: Random tie orders (``simulate(..., tie_seed=)``: the hash-ordered successors of nodes with more
#: than 8 out-edges) in which a plan that fits in graph order must fit too (:meth:`FitCheck.simulate`).
#: Whole chunks depend on the exact allocation order: when every tie is shuffled, one ResNet-50
#: 224² b32 plan at 25% on a V100 held 641-735 MiB over 13 orders with tensors at 641 in all.
TIE_ORDERS_CHECKED = 4


class FitCheck:
    """Replays plans of one step, held to a budget as TensorFlow's allocator would hold them.

    Attributes:
        budget_bytes: The budget plans are held to (None: tensors only, no allocator replay).
        time_to_beat: Step time of the fastest fitting plan so far (slower plans skip the tie orders).
        simulations: How many replays were made.

    Examples:
        >>> FitCheck.__init__.__doc__ is None
        True
    """

    def __init__(self, step: PlanningStep):
        self.step = step
        self.budget_bytes: Optional[int] = None
        self.time_to_beat: Optional[float] = None
        self.simulations = 1  # the plain step's

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
        sim = simulate(self.step.ir, plan, cost=self.step.cost, top=None, op_times=self.step.op_times,
                       log_allocations=self.budget_bytes is not None)
        if self.budget_bytes is not None and sim.peak_bytes <= self.budget_bytes:
            held = self.held_in_chunks(sim)
            # A plan no faster than one already found will not be chosen: its graph order is enough.
            could_win = self.time_to_beat is None or sim.step_time_s < self.time_to_beat
            if could_win and held <= self.budget_bytes:
                for other in simulate_tie_orders(self.step.ir, plan, range(TIE_ORDERS_CHECKED), cost=self.step.cost,
                                                 op_times=self.step.op_times):
                    held = max(held, other.peak_bytes, self.held_in_chunks(other))
                    if held > self.budget_bytes:
                        break
            sim = dataclasses.replace(sim, allocator_peak_bytes=held, allocations=())
            if held > self.budget_bytes:
                logger.debug("planner: the tensors fit (%d bytes) but TensorFlow's allocator would hold %d bytes "
                             "in whole chunks (in graph order or another tie order)", sim.peak_bytes, held)
        return sim

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
        region = max(self.step.cost.device.memory_bytes, self.step.resident + 4 * self.budget_bytes)
        return replay_allocations(sim.allocations, tensorflow_gpu_allocator(region), history=self.step.pool_history)
