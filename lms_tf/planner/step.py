"""The step being planned, with what every part of the budget search reads about it.

Examples:
    >>> from lms_tf.core import Policies, make_ir
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (256,))])])
    >>> step = PlanningStep.build(ir, Policies(budget="50%"), device="/device:GPU:0",
    ...                           cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    >>> step.found.eligible, step.resident   # the batch x is on the device for the whole step
    ((), 1024)
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

from lms_tf.core.ir import GraphIR
from lms_tf.core.policy import Policies, machine_memory_bytes
from lms_tf.cost.model import CostModel
from lms_tf.planner.candidates import Candidates, collect_candidates
from lms_tf.planner.weights import plan_weights
from lms_tf.simulate import (Simulation, input_bytes, optimizer_slots, pool_history, resident_bytes, simulate,
                             variables_on_host)


@dataclasses.dataclass(frozen=True)
class PlanningStep:
    """A traced step, the policies and device it is planned for, and its plain simulation.

    Attributes:
        ir: The step's IR.
        policies: What the planner is asked to do.
        device: The managed accelerator.
        cost: The cost model of the device planned for.
        scope_aliases: Keras layer name -> its name scope in this trace (for names in policies).
        found: The forward tensors the backward pass reads, which may move, and the gates.
        eligible: ``found.eligible`` as a set.
        op_times: Predicted time of every op.
        baseline: The plain step's simulation.
        forward_seconds: When the backward pass starts in the plain step (its first gate).
        resident: Bytes on the device for the whole step besides its own tensors: the variables
            resident there and the step's inputs (:func:`~lms_tf.simulate.input_bytes`).
        pool_history: What the process allocated before its first step (the allocator's free chunks
            depend on it: Keras builds each kernel through two temporaries of its size).
        offloaded: With ``weights="auto"``, the handles of the weights planned on the host (the
            budget planner tries several); None otherwise.

    Examples:
        >>> PlanningStep.build.__doc__.splitlines()[0]
        'Simulates the plain step once and finds the candidates.'
    """

    ir: GraphIR
    policies: Policies
    device: str
    cost: CostModel
    scope_aliases: Mapping[str, str]
    found: Candidates
    eligible: FrozenSet[str]
    op_times: Mapping[str, float]
    baseline: Simulation
    forward_seconds: float
    resident: int
    pool_history: List[Tuple[str, str, int]]
    offloaded: Optional[FrozenSet[str]] = None

    @classmethod
    def example(cls) -> "PlanningStep":
        """The step of :func:`lms_tf.core.examples.chain_ir` planned for 75% of its peak on a GH200 (for examples).

        Examples:
            >>> sorted(PlanningStep.example().eligible)
            ['a:0', 'b:0', 'c:0', 'loss:0']
        """
        from lms_tf.core.examples import chain_ir
        from lms_tf.cost import get_device_spec

        return cls.build(chain_ir(), Policies(budget="75%"), device="/device:GPU:0",
                         cost=CostModel(get_device_spec("gh200-96gb-c2c")))

    def host_limit(self) -> Tuple[Optional[int], str]:
        """The host memory one process's planned step may hold (``host_budget``, else this
        machine's physical memory; None if unknown), and what set it (for an error).

        Examples:
            >>> step = PlanningStep.example()
            >>> step.host_limit()[1] in ("this machine's physical memory", "host_budget")
            True
        """
        if self.policies.host_budget:
            return self.policies.host_budget, "host_budget"
        return machine_memory_bytes(), "this machine's physical memory"

    def with_offloaded(self, offloaded: FrozenSet[str]) -> "PlanningStep":
        """The same step with ``weights="auto"``'s choice ``offloaded`` (the handles of the weights
        on the host): what is resident changes; the plain simulation and the candidates do not.

        Examples:
            >>> from lms_tf.core import Policies
            >>> from lms_tf.core.examples import weighted_chain_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> step = PlanningStep.build(weighted_chain_ir(), Policies(weights="auto", budget="50%"),
            ...                           device="/device:GPU:0", cost=CostModel(get_device_spec("v100-16gb-pcie3")))
            >>> step.resident, step.with_offloaded(frozenset({"w1:0"})).resident   # 2 weights + the batch, then 1 + the batch
            (557056, 294912)
        """
        on_host = self._on_host(self.ir, self.policies, offloaded)
        return dataclasses.replace(self, offloaded=offloaded, pool_history=pool_history(self.ir, on_host=on_host),
                                   resident=self._resident(self.ir, on_host))

    @property
    def on_host(self) -> FrozenSet[str]:
        """The handles of the variables in host memory for the whole step: the weights planned
        there and their optimizer's slots (with ``weights="auto"``, the slots whatever moves).

        Examples:
            >>> from lms_tf.core import Policies
            >>> from lms_tf.core.examples import weighted_chain_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> step = PlanningStep.build(weighted_chain_ir(), Policies(weights="host", budget="50%", host="/CPU:0"),
            ...                           device="/device:GPU:0", cost=CostModel(get_device_spec("v100-16gb-pcie3")))
            >>> sorted(step.on_host)
            ['w1:0', 'w2:0']
        """
        return self._on_host(self.ir, self.policies, self.offloaded)

    @staticmethod
    def _resident(ir: GraphIR, on_host: FrozenSet[str]) -> int:
        return resident_bytes(ir, on_host) + input_bytes(ir)

    @staticmethod
    def _on_host(ir: GraphIR, policies: Policies, offloaded: Optional[FrozenSet[str]]) -> FrozenSet[str]:
        # weights="host": the offloaded weights and the optimizer's slots are not resident;
        # weights="auto" keeps the slots on the host whatever it does with the weights.
        on_host = variables_on_host(ir, {w.variable for w in plan_weights(ir, policies, offloaded)})
        if policies.weights == "auto":
            on_host |= optimizer_slots(ir)
        return on_host

    @classmethod
    def build(cls, ir: GraphIR, policies: Policies, *, device: str, cost: CostModel,
              scope_aliases: Optional[Mapping[str, str]] = None,
              offloaded: Optional[FrozenSet[str]] = None) -> "PlanningStep":
        """Simulates the plain step once and finds the candidates.

        Examples:
            >>> from lms_tf.core import Policies, make_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> PlanningStep.build(make_ir([]), Policies(), device="/device:GPU:0",
            ...                    cost=CostModel(get_device_spec("v100-16gb-pcie3"))).forward_seconds
            0.0
        """
        aliases = dict(scope_aliases or {})
        on_host = cls._on_host(ir, policies, offloaded)
        found = collect_candidates(ir, policies, device=device, scope_aliases=aliases)
        op_times: Dict[str, float] = {op.name: cost.op_time(ir, op) for op in ir.ops}
        baseline = simulate(ir, None, cost=cost, top=None, op_times=op_times)
        backward_starts = [baseline.op_intervals[g.name][0] for g in found.gates if g.name in baseline.op_intervals]
        return cls(ir=ir, policies=policies, device=device, cost=cost, scope_aliases=aliases, found=found,
                   eligible=frozenset(found.eligible), op_times=op_times, baseline=baseline,
                   forward_seconds=min(backward_starts, default=baseline.compute_time_s),
                   resident=cls._resident(ir, on_host),
                   pool_history=pool_history(ir, on_host=on_host), offloaded=offloaded)
