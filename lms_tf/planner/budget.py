"""The budget planner: KEEP / SWAP / RECOMPUTE per tensor so the simulated peak fits a budget.

KARMA's rule, driven by the simulator: replay the step, look at the peak, and free the
tensors that sit idle in device memory there (produced before the peak, first read by the
backward pass after it), cheapest first, until the bytes over budget are covered; replay
again, until the peak fits. A tensor's cost is its predicted slowdown:

* swap: the copy out and back that the compute between producer and consumer cannot
  hide, plus its share of the link when the link is already busier than the compute;
* recompute: the predicted time of the forward ops cloned to produce it again, back to the
  nearest tensors the backward pass keeps anyway, credited only with the bytes it frees.

User overrides win: ``exclude`` keeps, a ``recompute`` list of names recomputes,
``swap=False`` / ``recompute=False`` forbid one kind. If even moving every movable tensor
does not fit, :class:`InfeasibleBudgetError` names the smallest budget that does.

Example:
    >>> import tensorflow as tf
    >>> from lms_tf.graph import build_ir
    >>> from lms_tf.options import LMSOptions
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
    >>> opts = LMSOptions(device="/CPU:0", host="/CPU:1", budget="60%", device_spec="gh200-96gb-c2c")
    >>> plan = make_budget_plan(ir, opts, device="/device:CPU:0")
    >>> plan.feasible, plan.planned_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    (True, True)
    >>> len(plan.swapped) > 0
    True
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import Dict, List, Mapping, Optional, Set, Tuple

from lms_tf.cost.devices import DeviceSpec, get_device_spec
from lms_tf.cost.model import CostModel
from lms_tf.errors import LMSOptionError
from lms_tf.graph.ir import GraphIR, layer_of
from lms_tf.options import LMSOptions
from lms_tf.planner.default import (CHEAP_OP_TYPES, Candidates, _clone_region, _exclusion_matcher, clonable,
                                    collect_candidates)
from lms_tf.planner.plan import Decision, Plan, SwapIn, TensorDecision
from lms_tf.planner.simulator import Simulation, resident_bytes, simulate

logger = logging.getLogger("lms_tf")

#: ``budget="auto"`` leaves this fraction of device memory free (CUDA context, cuDNN
#: workspaces, allocator fragmentation), and at least :data:`SAFETY_MARGIN_MIN_BYTES`.
SAFETY_MARGIN_FRACTION = 0.10
SAFETY_MARGIN_MIN_BYTES = 512 * 2**20
#: Rounds of simulate-and-free before the planner gives up.
MAX_ROUNDS = 40


class InfeasibleBudgetError(LMSOptionError):
    """No plan fits the budget; the message names the smallest budget that fits.

    Attributes:
        budget_bytes: The budget asked for.
        smallest_feasible_bytes: The simulated peak with every movable tensor moved.

    Example:
        >>> err = _infeasible("too small", 10, 20)
        >>> err.smallest_feasible_bytes
        20
    """

    # No __init__ of its own: AutoGraph re-raises only exceptions with Exception's __init__ as
    # themselves (lms_tf.errors); the figures are attributes set by :func:`_infeasible`.
    budget_bytes: int = 0
    smallest_feasible_bytes: int = 0


def _infeasible(message: str, budget_bytes: int, smallest_feasible_bytes: int) -> InfeasibleBudgetError:
    err = InfeasibleBudgetError(message)
    err.budget_bytes, err.smallest_feasible_bytes = budget_bytes, smallest_feasible_bytes
    return err


def resolve_budget(budget, *, baseline_peak_bytes: int, device: DeviceSpec, resident: int) -> int:
    """Turns a validated budget (see :func:`lms_tf.options.parse_budget`) into bytes.

    Args:
        budget: Bytes, a fraction of the plain peak, or ``"auto"``.
        baseline_peak_bytes: Simulated peak of the plain step.
        device: The device (for ``"auto"``).
        resident: Bytes of variables resident on the device (weights, optimizer slots).

    Raises:
        InfeasibleBudgetError: ``"auto"`` and the variables alone do not fit the device.

    Example:
        >>> from lms_tf.cost import get_device_spec
        >>> resolve_budget(0.25, baseline_peak_bytes=400, device=get_device_spec("v100-16gb-pcie3"), resident=0)
        100
    """
    if isinstance(budget, float):
        return int(budget * baseline_peak_bytes)
    if budget == "auto":
        margin = max(SAFETY_MARGIN_MIN_BYTES, int(SAFETY_MARGIN_FRACTION * device.memory_bytes))
        available = device.memory_bytes - resident - margin
        if available <= 0:
            raise _infeasible(
                f"budget='auto': the step's variables ({resident / 2**30:.2f} GiB) plus the safety margin "
                f"({margin / 2**30:.2f} GiB) do not fit {device.name} ({device.memory_bytes / 2**30:.2f} GiB). Use a "
                f"larger device, optimizer_on_host=True, or a smaller model.", 0, resident + margin)
        return available
    return int(budget)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB ({nbytes} bytes)"


class _Planner:
    def __init__(self, ir: GraphIR, options: LMSOptions, device: str, cost: CostModel,
                 scope_aliases: Mapping[str, str]):
        self.ir, self.options, self.device, self.cost = ir, options, device, cost
        self.found: Candidates = collect_candidates(ir, options, device=device, scope_aliases=scope_aliases)
        self.eligible = set(self.found.eligible)
        self.forced: Set[str] = set()
        self.named_through = None
        if isinstance(options.recompute, tuple):
            matcher = _exclusion_matcher(ir, options.recompute, scope_aliases)
            self.forced = {t for t in self.found.eligible
                           if matcher(ir.tensors[t].producer) and clonable(ir.op(ir.tensors[t].producer))}
            self.named_through = matcher
        self.baseline = simulate(ir, None, cost=cost, top=None)
        self.op_time = {op.name: cost.op_time(ir, op) for op in ir.ops}
        backward_starts = [self.baseline.op_intervals[g.name][0] for g in self.found.gates
                           if g.name in self.baseline.op_intervals]
        self.forward_seconds = min(backward_starts, default=self.baseline.compute_time_s)

    def _through(self, op) -> bool:
        # Any pure forward op: a region then stops only at tensors the backward pass keeps anyway
        # (so recomputing a convolution's output clones the convolution from its kept input).
        return True

    def gate_before(self, tensor: str) -> Optional[str]:
        first = min(c.index for c in self.found.backward_of[tensor])
        before = bisect.bisect_left(self.found.gate_positions, first)
        return self.found.gates[before - 1].name if before else None

    def assemble(self, swap: Set[str], recompute: Set[str]) -> Plan:
        ir, found, options = self.ir, self.found, self.options
        decisions: Dict[str, TensorDecision] = dict(found.kept)
        for name in found.eligible:
            op, tensor = ir.op(ir.tensors[name].producer), ir.tensors[name]
            distance = found.distance[name]
            consumers = tuple(c.name for c in sorted(found.backward_of[name], key=lambda c: c.index))
            if name in recompute and self.gate_before(name):
                why = "recompute (named)" if name in self.forced else "recompute (cheapest per byte freed)"
                decisions[name] = TensorDecision(
                    name, layer_of(op.name), tensor.shape, tensor.nbytes, Decision.RECOMPUTE, why, distance, (),
                    recompute_ops=_clone_region(ir, name, recompute, self._through), gate=self.gate_before(name),
                    consumers=consumers)
                continue
            if name in swap:
                decision = self.timed_swap(name, distance)
                if decision is not None:
                    decisions[name] = TensorDecision(
                        name, decision.layer, decision.shape, decision.nbytes, Decision.SWAP,
                        "swap (copy hidden behind compute)" if self.swap_exposed(name) <= 0 else
                        "swap (cheapest per byte freed)", distance, decision.swap_ins)
                    continue
            decisions[name] = TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes, Decision.KEEP,
                                             "fits the budget", distance, ())
        return Plan(decisions=tuple(decisions[n] for n in found.order), device=self.device, host=options.host,
                    options=options.to_dict(), phase_counts=ir.phase_counts())

    def timed_swap(self, tensor: str, distance: int) -> Optional[TensorDecision]:
        """A SWAP decision whose swap-ins start just early enough for the copy back to end
        before their consumers (by the baseline's predicted times), or None if no backward op
        runs early enough to trigger one."""
        ir, found = self.ir, self.found
        info = ir.tensors[tensor]
        copy_back = self.cost.transfer_time(info.nbytes or 0, "host_to_device")
        intervals = self.baseline.op_intervals
        groups: List[List] = []
        for consumer in sorted(found.backward_of[tensor], key=lambda c: c.index):
            if groups and consumer.index - groups[-1][0].index <= self.options.swapin_groupby:
                groups[-1].append(consumer)
            else:
                groups.append([consumer])
        swap_ins = []
        for group in groups:
            position = bisect.bisect_left(found.gate_positions, group[0].index) - 1
            if position < 0:
                return None
            deadline = intervals.get(group[0].name, (0.0, 0.0))[0] - copy_back
            while position > 0 and intervals.get(found.gates[position].name, (0.0, 0.0))[1] > deadline:
                position -= 1
            swap_ins.append(SwapIn(found.gates[position].name, tuple(c.name for c in group)))
        return TensorDecision(tensor, layer_of(info.producer), info.shape, info.nbytes, Decision.SWAP, "swap",
                              distance, tuple(swap_ins))

    def window(self, tensor: str) -> float:
        """Baseline compute time between the tensor's producer and its first backward reader."""
        intervals = self.baseline.op_intervals
        producer = intervals.get(self.ir.tensors[tensor].producer)
        first = min((intervals[c.name][0] for c in self.found.backward_of[tensor] if c.name in intervals),
                    default=None)
        if producer is None or first is None:
            return 0.0
        return max(0.0, first - producer[1])

    def swap_exposed(self, tensor: str) -> float:
        nbytes = self.ir.tensors[tensor].nbytes or 0
        copies = self.cost.transfer_time(nbytes, "device_to_host") + self.cost.transfer_time(nbytes, "host_to_device")
        return copies - self.window(tensor)

    def swap_cost(self, tensor: str, link_busy: float) -> float:
        nbytes = self.ir.tensors[tensor].nbytes or 0
        one_way = max(self.cost.transfer_time(nbytes, "device_to_host"),
                      self.cost.transfer_time(nbytes, "host_to_device"))
        # Copies out must drain while the forward pass still runs, or the bytes they free stay
        # on the device through the peak at the start of the backward pass.
        window = self.forward_seconds
        over = max(0.0, link_busy + one_way - window) - max(0.0, link_busy - window)
        if over > 0:
            return float("inf") if self.options.recompute else max(0.0, self.swap_exposed(tensor)) + over
        return max(0.0, self.swap_exposed(tensor)) + over

    def recompute_cost(self, tensor: str, recompute: Set[str]) -> Tuple[float, int]:
        """Seconds of the clones, and the bytes recomputing really frees: the tensor, minus
        the checkpoints it newly keeps alive (inputs the backward pass would not read otherwise)."""
        ir = self.ir
        region = _clone_region(ir, tensor, recompute | {tensor}, self._through)
        inside = set(region)
        new_checkpoints = set()
        for name in region:
            for t in ir.op(name).inputs:
                info = ir.tensors[t]
                if (info.producer not in inside and info.producer in ir.data_dependent
                        and (t not in self.found.backward_of or t in recompute)
                        and info.producer not in ir.function_inputs):
                    new_checkpoints.add(t)
        freed = (ir.tensors[tensor].nbytes or 0) - sum(ir.tensors[t].nbytes or 0 for t in new_checkpoints)
        return sum(self.op_time[name] for name in region), freed

    def plan(self, budget_bytes: int) -> Tuple[Plan, Simulation]:
        options = self.options
        swap: Set[str] = set()
        recompute: Set[str] = set(self.forced)
        link_busy = 0.0
        plan = self.assemble(swap, recompute)
        sim = simulate(self.ir, plan, cost=self.cost, top=None)
        for _ in range(MAX_ROUNDS):
            if sim.peak_bytes <= budget_bytes:
                break
            excess = sim.peak_bytes - budget_bytes
            at_peak = sim.peak_time_s
            idle = []
            for name, nbytes in sim.live_at_peak:
                if name not in self.eligible or name in swap or name in recompute or not nbytes:
                    continue
                producer = sim.op_intervals.get(self.ir.tensors[name].producer)
                readers = [sim.op_intervals[c.name][0] for c in self.found.backward_of[name]
                           if c.name in sim.op_intervals]
                if producer is None or not readers or not producer[1] <= at_peak < min(readers):
                    continue  # in use at the peak: moving it would not lower this peak
                choices = []
                if options.swap and nbytes >= options.min_swap_bytes:
                    choices.append((self.swap_cost(name, link_busy), "swap"))
                if options.recompute and clonable(self.ir.op(self.ir.tensors[name].producer)):
                    seconds, freed = self.recompute_cost(name, recompute)
                    if freed > 0:
                        choices.append((seconds * nbytes / freed, "recompute"))
                if choices:
                    seconds, kind = min(choices)
                    idle.append((seconds / nbytes, name, kind, nbytes))
            if not idle:
                break
            freed = 0
            for _, name, kind, nbytes in sorted(idle):
                if kind == "swap":
                    swap.add(name)
                    link_busy += self.cost.transfer_time(nbytes, "device_to_host")
                else:
                    recompute.add(name)
                freed += nbytes
                if freed >= 1.05 * excess:
                    break
            plan = self.assemble(swap, recompute)
            sim = simulate(self.ir, plan, cost=self.cost, top=None)
        return plan, sim

    def most_aggressive(self) -> Tuple[Plan, Simulation]:
        """The plan with every movable tensor moved, and its simulation: each tensor, in production
        order, takes the cheaper of swap (while the link can drain it during the forward pass)
        and recompute."""
        swap, recompute = set(), set(self.forced)
        link_busy = 0.0
        for name in self.found.eligible:  # production order: early tensors have the longest windows
            if name in recompute:
                continue
            nbytes = self.ir.tensors[name].nbytes or 0
            can_swap = self.options.swap and nbytes >= self.options.min_swap_bytes
            seconds, freed = self.recompute_cost(name, recompute)
            can_recompute = (self.options.recompute and freed > 0
                             and clonable(self.ir.op(self.ir.tensors[name].producer)))
            recompute_per_byte = seconds / freed if can_recompute else float("inf")
            swap_per_byte = self.swap_cost(name, link_busy) / nbytes if can_swap and nbytes else float("inf")
            if can_swap and swap_per_byte <= recompute_per_byte:
                swap.add(name)
                link_busy += self.cost.transfer_time(nbytes, "device_to_host")
            elif can_recompute:
                recompute.add(name)
        plan = self.assemble(swap, recompute)
        return plan, simulate(self.ir, plan, cost=self.cost, top=None)


def make_budget_plan(ir: GraphIR, options: LMSOptions, *, device: str,
                     scope_aliases: Optional[Mapping[str, str]] = None,
                     cost: Optional[CostModel] = None) -> Plan:
    """Plans the step so its simulated peak fits ``options.budget`` at the least predicted slowdown.

    Args:
        ir: The step's IR.
        options: Validated options with a ``budget``.
        device: Full name of the managed accelerator.
        scope_aliases: Keras layer name -> its name scope in this trace.
        cost: The cost model (default: from ``options.device_spec``).

    Returns:
        The plan, with the simulated peaks, predicted times and ``feasible=True``.

    Raises:
        InfeasibleBudgetError: Nothing fits; the message names the smallest feasible budget.
        LMSOptionError: Bad ``exclude``/``recompute`` names or device preset.

    Example:
        >>> from lms_tf.graph.ir import GraphIR
        >>> opts = LMSOptions(budget="1GiB", device_spec="a100-40gb-pcie4")
        >>> make_budget_plan(GraphIR((), {}, frozenset(), {}), opts, device="/device:GPU:0").feasible
        True
    """
    started = time.perf_counter()
    spec = get_device_spec(options.device_spec or "auto")
    cost = cost or CostModel(spec)
    planner = _Planner(ir, options, device, cost, scope_aliases or {})
    baseline = planner.baseline
    budget_bytes = resolve_budget(options.budget, baseline_peak_bytes=baseline.peak_bytes, device=spec,
                                  resident=resident_bytes(ir))
    plan, sim = planner.plan(budget_bytes)
    if sim.peak_bytes > budget_bytes:
        # The greedy rounds stalled (nothing idle at the peak): moving everything may still fit.
        plan, sim = min((plan, sim), planner.most_aggressive(), key=lambda ps: ps[1].peak_bytes)
    if sim.peak_bytes > budget_bytes:
        floor = sim.peak_bytes
        kinds = " and ".join(k for k, on in (("swapping", options.swap), ("recomputing", options.recompute)) if on)
        hint = ("" if options.swap and options.recompute else
                f", or allow {'recompute' if not options.recompute else 'swap'} too")
        raise _infeasible(
            f"budget {_gib(budget_bytes)} is infeasible on {spec.name}: the plain step peaks at "
            f"{_gib(baseline.peak_bytes)} (simulated) and {kinds or 'moving'} every movable tensor still needs "
            f"{_gib(floor)}. The smallest feasible budget is about {_gib(floor)}; pass budget >= that, "
            f"a smaller batch{hint}.",
            budget_bytes, floor)
    logger.info("lms-tf planner: %s peak %.1f -> %.1f MiB (budget %.1f MiB) in %.2f s", spec.name,
                baseline.peak_bytes / 2**20, sim.peak_bytes / 2**20, budget_bytes / 2**20,
                time.perf_counter() - started)
    return dataclasses.replace(
        plan, budget_bytes=budget_bytes, baseline_peak_bytes=baseline.peak_bytes, planned_peak_bytes=sim.peak_bytes,
        baseline_step_time_s=baseline.step_time_s, predicted_step_time_s=sim.step_time_s, device_spec=spec.name,
        feasible=True)
