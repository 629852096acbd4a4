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

Example:
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

import bisect
import dataclasses
import gc
import logging
import time
from typing import Dict, List, Mapping, Optional, Set, Tuple

from lms_tf.core.errors import LMSOptionError, PlanCycleError, infeasible
from lms_tf.core.ir import GraphIR, Phase, layer_of
from lms_tf.core.op_kinds import ALIAS_TYPES
from lms_tf.core.plan import Decision, Ordering, Plan, Predictions, SwapIn, TensorDecision
from lms_tf.core.policy import Policies, resolve_budget
from lms_tf.cost.model import CostModel
from lms_tf.planner.default import (
    Candidates,
    articulation_count,
    checkpoint_gates,
    clonable,
    collect_candidates,
    make_plan,
)
from lms_tf.simulate.allocator import replay_allocations, tensorflow_gpu_allocator
from lms_tf.simulate.simulator import Simulation, pool_history, resident_buffers, simulate, simulate_tie_orders

logger = logging.getLogger("lms_tf")

#: Rounds of simulate-and-free before the planner gives up.
MAX_ROUNDS = 40
#: With synchronous swap-outs, how many copies out may still be pending when the forward pass
#: starts the producer of the next swapped tensor (some slack keeps the link and compute overlapped).
SWAP_OUT_LAG = 2
#: With synchronous swap-outs (a link-bound step), how many swap-ins may run ahead of the compute.
SWAP_IN_LAG = 2
#: How many of the largest backward temporaries alive at the peak are paired up when looking
#: for two branches to run one after the other.
ORDERING_CANDIDATES = 8
#: How many of those pairs (largest first) are tried per round.
ORDERING_PAIRS = 3
#: How many swapped checkpoints (largest first) the planner tries to recompute instead.
RECOMPUTED_CHECKPOINTS_TRIED = 8
#: Head starts tried when re-timing late swap-ins (fractions of the copy's time).
RETIME_LEADS = (1.0, 0.5)
#: When nothing fits, how many times the planner searches again aiming below the budget by the
#: lowest plan's excess: the greedy search stops where a plan first fits, so a lower aim can reach
#: plans a search at the budget itself never visits.
LOWER_AIMS = 2
#: Random tie orders (``simulate(..., tie_seed=)``: the hash-ordered successors of nodes with more
#: than 8 out-edges) in which a plan that fits in graph order must fit too (``_Planner.simulate``).
#: Whole chunks depend on the exact allocation order: when every tie is shuffled, one ResNet-50
#: 224² b32 plan at 25% on a V100 held 641-735 MiB over 13 orders with tensors at 641 in all.
TIE_ORDERS_CHECKED = 4


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB ({nbytes} bytes)"


@dataclasses.dataclass(frozen=True)
class _Tools:
    """What a planning pass may use beyond swaps on a recompute base.

    Attributes:
        late_swap_ins: Trigger each swap-in by the backward op just before its consumers instead
            of early enough to hide the copy (slower, but the swapped bytes return later).
        order: Make backward branches alive together at the peak run one after the other.
        throttle: Make the forward pass wait for the copies out; swap-ins run a fixed number of
            groups ahead of their consumers.
    """

    late_swap_ins: bool = False
    order: bool = False
    throttle: bool = False


class _Planner:
    def __init__(self, ir: GraphIR, policies: Policies, device: str, cost: CostModel,
                 scope_aliases: Mapping[str, str]):
        self.ir, self.policies, self.device, self.cost = ir, policies, device, cost
        self.scope_aliases = scope_aliases
        self.found: Candidates = collect_candidates(ir, policies, device=device, scope_aliases=scope_aliases)
        self.eligible = set(self.found.eligible)
        self.op_times = {op.name: cost.op_time(ir, op) for op in ir.ops}
        self.baseline = simulate(ir, None, cost=cost, top=None, op_times=self.op_times)
        backward_starts = [self.baseline.op_intervals[g.name][0] for g in self.found.gates
                           if g.name in self.baseline.op_intervals]
        self.forward_seconds = min(backward_starts, default=self.baseline.compute_time_s)
        self.simulations = 1
        self.budget_bytes: Optional[int] = None  # set by plan(): replays fitting plans through the allocator model
        self.time_to_beat: Optional[float] = None  # step time of the fastest fitting plan so far
        self.resident = sum(nbytes for _, nbytes in resident_buffers(ir))
        # The free chunks a step finds depend on what the process allocated before it: Keras
        # builds each kernel through two temporaries of its size, on the GPU as on the CPU.
        self.pool_history = pool_history(ir)
        self.base_policies: Dict[str, Tuple[str, Optional[int]]] = {}  # base label -> (policy, segments)
        self._successors: Optional[Dict[str, List[str]]] = None
        self._paths: Dict[str, List[str]] = {}

    def recompute_bases(self) -> List[Tuple[str, Dict[str, TensorDecision]]]:
        """Recompute-only starting points, cheapest first: none, "cheap", "sqrt" with several
        segment counts (segments share one gate each, so every op is recomputed at most once),
        or exactly the layers the user named."""
        policy = self.policies.recompute
        if not policy:
            return [("none", {})]
        if isinstance(policy, tuple):
            return [("named", self._recompute_only(policy))]
        bases = [("none", {})] if policy == "auto" else []
        if policy in ("auto", "cheap"):
            bases.append(("cheap", self._recompute_only("cheap")))
            self.base_policies["cheap"] = ("cheap", None)
        if policy in ("auto", "sqrt"):
            n = articulation_count(self.ir)
            # More segments than sqrt(n) keep more checkpoints but shorter recomputed segments; on
            # the zoo the lowest peaks came from 1.5-2.5x sqrt(n) (a CNN's early segments are large).
            counts = sorted({max(1, round(n ** 0.5 * f)) for f in (1.5, 2.5)})
            for segments in counts if policy == "auto" else [None]:
                label = f"sqrt/{segments or 'default'}"
                bases.append((label, self._recompute_only("sqrt", segments)))
                self.base_policies[label] = ("sqrt", segments)
        return bases

    def _recompute_only(self, policy, segments: Optional[int] = None,
                        also: Optional[Mapping[str, str]] = None) -> Dict[str, TensorDecision]:
        policies = dataclasses.replace(self.policies, swap=False, recompute=policy, budget=None)
        plan = make_plan(self.ir, policies, device=self.device, scope_aliases=self.scope_aliases,
                         sqrt_segments=segments, candidates=self.found, also_recompute=also)
        return {d.tensor: d for d in plan.recomputed}

    def assemble(self, swap: Set[str], recomputed: Mapping[str, TensorDecision], tools: _Tools = _Tools(),
                 orderings: Tuple[Ordering, ...] = (), leads: Optional[Mapping[str, float]] = None) -> Plan:
        ir, found, policies = self.ir, self.found, self.policies
        decisions: Dict[str, TensorDecision] = dict(found.kept)
        for name in found.eligible:
            if name in recomputed:
                decisions[name] = recomputed[name]
                continue
            info = ir.tensors[name]
            lead = (leads or {}).get(name, 0.0 if tools.late_swap_ins else 1.0)
            decision = self.timed_swap(name, found.distance[name], lead) if name in swap else None
            decisions[name] = decision or TensorDecision(
                name, layer_of(info.producer), info.shape, info.nbytes, Decision.KEEP, "fits the budget",
                found.distance[name], ())
        if tools.throttle:
            swapped = [d for d in decisions.values() if d.decision is Decision.SWAP]
            decisions.update(self.swap_out_waits(swapped))
            decisions.update(self.lagged_swap_ins([decisions[d.tensor] for d in swapped]))
        return Plan(decisions=tuple(decisions[n] for n in found.order), device=self.device, host=policies.host,
                    policies=policies.to_dict(), phase_counts=ir.phase_counts(), orderings=orderings)

    def swap_out_waits(self, swapped: List[TensorDecision]) -> Dict[str, TensorDecision]:
        """TFLMS's synchronous swap-out, with some slack: the producer of the swapped tensor
        :data:`SWAP_OUT_LAG` swaps later waits until this tensor's copy out has ended. The forward
        pass then runs at the link's pace, and at most that many copies are pending when it ends."""
        ir = self.ir
        swapped = sorted(swapped, key=lambda d: ir.op(ir.tensors[d.tensor].producer).index)
        producers = [ir.op(ir.tensors[d.tensor].producer).index for d in swapped]
        waits = {}
        for i, d in enumerate(swapped):
            later = bisect.bisect_right(producers, producers[i])  # a later op, never the producer itself
            j = max(i + SWAP_OUT_LAG, later)
            if j < len(swapped):
                waits[d.tensor] = dataclasses.replace(
                    d, swap_out_before=ir.tensors[swapped[j].tensor].producer,
                    reason=d.reason + "; the forward pass waits for the copy out")
        return waits

    def simulate(self, plan: Plan) -> Simulation:
        """Replays the step with ``plan``. When its tensors fit the budget, their allocations are
        also replayed through the model of TensorFlow's GPU allocator (one region): whole chunks
        can need more than the tensors, and the plan must fit as the allocator holds it. Which
        chunks get reused depends on the order of ops that become ready together, which the
        executor does not keep from one process to the next for nodes with many readers, so a
        plan that fits in graph order is replayed in :data:`TIE_ORDERS_CHECKED` random tie
        orders too and held to the largest."""
        self.simulations += 1
        sim = simulate(self.ir, plan, cost=self.cost, top=None, op_times=self.op_times,
                       log_allocations=self.budget_bytes is not None)
        if self.budget_bytes is not None and sim.peak_bytes <= self.budget_bytes:
            held = self.held_in_chunks(sim)
            # A plan no faster than one already found will not be chosen: its graph order is enough.
            could_win = self.time_to_beat is None or sim.step_time_s < self.time_to_beat
            if could_win and held <= self.budget_bytes:
                for other in simulate_tie_orders(self.ir, plan, range(TIE_ORDERS_CHECKED), cost=self.cost,
                                                 op_times=self.op_times):
                    held = max(held, other.peak_bytes, self.held_in_chunks(other))
                    if held > self.budget_bytes:
                        break
            sim = dataclasses.replace(sim, allocator_peak_bytes=held, allocations=())
            if held > self.budget_bytes:
                logger.debug("planner: the tensors fit (%d bytes) but TensorFlow's allocator would hold %d bytes "
                             "in whole chunks (in graph order or another tie order)", sim.peak_bytes, held)
        return sim

    def held_in_chunks(self, sim: Simulation) -> int:
        """The simulated step's peak as TensorFlow's GPU allocator would hold it (whole chunks)."""
        region = max(self.cost.device.memory_bytes, self.resident + 4 * self.budget_bytes)
        return replay_allocations(sim.allocations, tensorflow_gpu_allocator(region), history=self.pool_history)

    def timed_swap(self, tensor: str, distance: int, lead: float = 1.0) -> Optional[TensorDecision]:
        """A SWAP decision whose swap-ins start just early enough for the copy back to end
        before their consumers (by the baseline's predicted times; ``lead`` scales that head
        start, 0 = right before them); None if no backward op runs early enough to trigger one."""
        ir, found = self.ir, self.found
        info = ir.tensors[tensor]
        copy_back = self.cost.transfer_time(info.nbytes or 0, "host_to_device")
        intervals = self.baseline.op_intervals
        groups: List[List] = []
        for consumer in sorted(found.backward_of[tensor], key=lambda c: c.index):
            if groups and consumer.index - groups[-1][0].index <= self.policies.swapin_groupby:
                groups[-1].append(consumer)
            else:
                groups.append([consumer])
        swap_ins = []
        for group in groups:
            position = found.gates_before(group[0].index) - 1
            if position < 0:
                return None
            deadline = intervals.get(group[0].name, (0.0, 0.0))[0] - lead * copy_back
            # Alias ops (Reshape, Identity) take no time of their own and have no interval: walk past them.
            while lead > 0 and position > 0 and \
                    intervals.get(found.gates[position].name, (0.0, float("inf")))[1] > deadline:
                position -= 1
            swap_ins.append(SwapIn(found.gates[position].name, tuple(c.name for c in group)))
        reason = ("swap (copy hidden behind compute)" if self.swap_exposed(tensor) <= 0 else
                  "swap (cheapest per byte freed)")
        return TensorDecision(tensor, layer_of(info.producer), info.shape, info.nbytes, Decision.SWAP, reason,
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
        """Predicted slowdown of swapping: the copies the compute cannot hide, plus any copy-out
        time past the forward pass (copies out must drain while it runs, or the bytes they free
        stay on the device through the peak at the start of the backward pass)."""
        nbytes = self.ir.tensors[tensor].nbytes or 0
        one_way = self.cost.transfer_time(nbytes, "device_to_host")
        window = self.forward_seconds
        over = max(0.0, link_busy + one_way - window) - max(0.0, link_busy - window)
        return max(0.0, self.swap_exposed(tensor)) + over

    def lagged_swap_ins(self, swapped: List[TensorDecision]) -> Dict[str, TensorDecision]:
        """When the link is the bottleneck, swap-ins timed by the plain step's clock all start at
        the top of the backward pass and pile up on the device. Instead, the swap-in feeding the
        i-th consumer group is triggered just before the (i - :data:`SWAP_IN_LAG`)-th group's
        consumers run: at most that many copies back are ahead of the compute."""
        found = self.found
        groups = sorted(((self.ir.op(s.consumers[0]).index, d.tensor, k)
                         for d in swapped for k, s in enumerate(d.swap_ins)))
        triggers: Dict[Tuple[str, int], str] = {}
        for i, (first, tensor, k) in enumerate(groups):
            if i < SWAP_IN_LAG:
                continue
            position = found.gates_before(groups[i - SWAP_IN_LAG][0]) - 1
            if position >= 0:
                triggers[(tensor, k)] = found.gates[position].name
        lagged = {}
        for d in swapped:
            swap_ins = tuple(dataclasses.replace(s, trigger=triggers.get((d.tensor, k), s.trigger))
                             for k, s in enumerate(d.swap_ins))
            if swap_ins != d.swap_ins:
                lagged[d.tensor] = dataclasses.replace(d, swap_ins=swap_ins)
        return lagged

    def _backward_graph(self) -> Tuple[Dict[str, List[str]], Dict[str, List[str]]]:
        """Successors (data and control) of every op, and each backward op's name path without
        gradient scopes; built on first use (only plans that need orderings pay for it)."""
        if self._successors is None:
            ir = self.ir
            self._successors = {op.name: [] for op in ir.ops}
            for op in ir.ops:
                for t in op.inputs:
                    self._successors[ir.tensors[t].producer].append(op.name)
                for c in op.control_inputs:
                    self._successors[c].append(op.name)
            self._paths = {op.name: layer_of(op.name).split("/") for op in ir.ops if op.phase is Phase.BACKWARD}
        return self._successors, self._paths

    def _reaches(self, sources: List[str], targets: Set[str]) -> bool:
        """Whether a path of data or control edges leads from one of ``sources`` to a target."""
        successors, _ = self._backward_graph()
        stack, seen = list(sources), set(sources)
        while stack:
            name = stack.pop()
            if name in targets:
                return True
            for nxt in successors[name]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def branch_pairs(self, sim: Simulation) -> List[Tuple[Tuple[str, ...], Tuple[str, ...]]]:
        """Pairs of backward branches (name scopes) whose temporaries are alive together at the peak,
        largest first. A branch is the scope where the two producers' name paths part."""
        ir = self.ir
        _, paths = self._backward_graph()
        live = [(nbytes, ir.tensors[name].producer) for name, nbytes in sim.live_at_peak
                if name in ir.tensors and ir.tensors[name].producer in paths and nbytes]
        live.sort(reverse=True)
        pairs, seen = [], set()
        for i, (_, a) in enumerate(live[:ORDERING_CANDIDATES]):
            for _, b in live[i + 1:ORDERING_CANDIDATES]:
                pa, pb = paths[a], paths[b]
                common = next((k for k, (x, y) in enumerate(zip(pa, pb)) if x != y), None)
                if common is None:
                    continue  # one scope inside the other: not two branches
                key = (tuple(pa[:common + 1]), tuple(pb[:common + 1]))
                if key not in seen and key[::-1] not in seen:
                    seen.add(key)
                    pairs.append(key)
        return pairs

    def ordering(self, first: Tuple[str, ...], then: Tuple[str, ...]) -> Optional[Ordering]:
        """``then``'s first backward ops wait for ``first``'s last ones, if that makes no cycle."""
        ir = self.ir
        successors, paths = self._backward_graph()
        in_first = {n for n, p in paths.items() if tuple(p[:len(first)]) == first}
        in_then = {n for n, p in paths.items() if tuple(p[:len(then)]) == then}
        if not in_first or not in_then:
            return None
        exits = sorted((n for n in in_first if not successors[n] or any(s not in in_first for s in successors[n])),
                       key=lambda n: ir.op(n).index)
        # The branch starts where a gradient enters it: ops reading a backward tensor made outside
        # it. (Its shape and constant ops may run early; holding them back would keep the forward
        # tensors they read alive.)
        waiters = sorted((n for n in in_then if ir.op(n).type not in ALIAS_TYPES and any(
            ir.tensors[t].producer in paths and ir.tensors[t].producer not in in_then for t in ir.op(n).inputs)),
            key=lambda n: ir.op(n).index)
        if not waiters or not exits or self._reaches(waiters, set(exits)):
            return None
        devices = {ir.op(n).device for n in waiters + exits}
        if len(devices) > 1:
            return None  # a control edge across devices can hang TensorFlow's executor (docs/design.md)
        return Ordering(tuple(waiters), tuple(exits),
                        f"backward of {'/'.join(then)} waits for {'/'.join(first)}: their temporaries "
                        f"were alive together at the simulated peak")

    def order_branches(self, sim: Simulation, swap: Set[str], recomputed: Mapping[str, TensorDecision],
                       tools: _Tools, orderings: Tuple[Ordering, ...]) -> Optional[Tuple[Plan, Simulation]]:
        """Lowers the peak by running two backward branches alive at it one after the other
        (either order, whichever simulates lower); None if no ordering lowers it."""
        best = None
        for a, b in self.branch_pairs(sim)[:ORDERING_PAIRS]:
            for first, then in ((a, b), (b, a)):
                ordering = self.ordering(first, then)
                if ordering is None:
                    continue
                plan = self.assemble(swap, recomputed, tools, orderings + (ordering,))
                try:
                    candidate = self.simulate(plan)
                except PlanCycleError:
                    continue  # the order conflicts with a recompute gate or a swap-in trigger
                if candidate.peak_bytes < (best or (None, sim))[1].peak_bytes:
                    best = (plan, candidate)
            if best is not None:
                return best
        return None

    def add_swaps(self, budget_bytes: int, recomputed: Mapping[str, TensorDecision],
                  tools: _Tools = _Tools(), start: Optional[Tuple[Plan, Simulation]] = None
                  ) -> Tuple[Plan, Simulation]:
        """Greedy rounds on top of a recompute base: swap the kept tensors idle at the simulated
        peak, cheapest per byte first, until the bytes over budget are covered; replay; repeat.
        With ``tools.order``, when no swap lowers the peak, run two backward branches alive at it
        one after the other (:meth:`order_branches`) and go on (see :class:`_Tools`). ``start``
        (a plan on this base and its simulation) continues from that plan's swaps and orderings."""
        if start is None:
            swap: Set[str] = set()
            orderings: Tuple[Ordering, ...] = ()
            plan = self.assemble(swap, recomputed, tools)
            sim = self.simulate(plan)
        else:
            (plan, sim), swap, orderings = start, {d.tensor for d in start[0].swapped}, start[0].orderings
        link_busy = sum(self.cost.transfer_time(self.ir.tensors[t].nbytes or 0, "device_to_host") for t in swap)
        for _ in range(MAX_ROUNDS):
            if sim.held_bytes <= budget_bytes:
                break
            swapped = self.swap_round(budget_bytes, sim, swap, recomputed, link_busy) if self.policies.swap else None
            if swapped is not None:
                candidate = self.assemble(swapped[0], recomputed, tools, orderings)
                candidate_sim = self.simulate(candidate)
                logger.debug("planner round: peak %d -> %d swapping %d tensors", sim.peak_bytes,
                             candidate_sim.peak_bytes, len(swapped[0]))
                # When the link is saturated, more swaps only slow the step down.
                if candidate_sim.held_bytes < sim.held_bytes or candidate_sim.step_time_s <= sim.step_time_s:
                    swap, link_busy = swapped
                    plan, sim = candidate, candidate_sim
                    continue
            ordered = self.order_branches(sim, swap, recomputed, tools, orderings) if tools.order else None
            if ordered is None:
                break
            logger.debug("planner round: peak %d -> %d ordering backward branches", sim.peak_bytes,
                         ordered[1].peak_bytes)
            plan, sim = ordered
            orderings = plan.orderings
        return plan, sim

    def swap_round(self, budget_bytes: int, sim: Simulation, swap: Set[str],
                   recomputed: Mapping[str, TensorDecision], link_busy: float) -> Optional[Tuple[Set[str], float]]:
        """The swap set grown by the tensors idle at the peak, cheapest per byte first, until they
        cover the bytes over budget (and the link time they add); None if nothing is idle."""
        excess = sim.held_bytes - budget_bytes
        idle = []
        for name, nbytes in sim.live_at_peak:
            if (name not in self.eligible or name in swap or name in recomputed or not nbytes
                    or nbytes < self.policies.min_swap_bytes):
                continue
            producer = sim.op_intervals.get(self.ir.tensors[name].producer)
            readers = [sim.op_intervals[c.name][0] for c in self.found.backward_of[name]
                       if c.name in sim.op_intervals]
            if producer is None or not readers or not producer[1] <= sim.peak_time_s < min(readers):
                continue  # in use at the peak: moving it would not lower this peak
            idle.append((self.swap_cost(name, link_busy) / nbytes, name, nbytes))
        if not idle:
            logger.debug("planner round: peak %d at %s, nothing idle to swap", sim.peak_bytes, sim.peak_op)
            return None
        grown, freed = set(swap), 0
        for _, name, nbytes in sorted(idle):
            grown.add(name)
            link_busy += self.cost.transfer_time(nbytes, "device_to_host")
            freed += nbytes
            if freed >= 1.05 * excess:
                break
        return grown, link_busy

    def compute_floor(self, recomputed: Mapping[str, TensorDecision]) -> float:
        """Least step time of any plan on this recompute base: the plain step's compute plus its
        clones' (one compute stream; swaps and orderings only add waits)."""
        clones = {(name, d.gate) for d in recomputed.values() for name in d.recompute_ops}
        return self.baseline.compute_time_s + sum(self.op_times[name] for name, _ in clones)

    def recompute_checkpoints(self, budget_bytes: int, plan: Plan, sim: Simulation, base: str,
                              tools: _Tools, fitting: bool = True) -> Tuple[Plan, Simulation, int]:
        """A fitting plan made faster by recomputing swapped checkpoints instead (KARMA's joint
        choice, per tensor). A checkpoint the clones of a segment read comes back through a swap-in
        started by the segment's gate, so the clones wait for the whole copy; recomputing it from
        the checkpoint before it costs its region's compute instead. Largest first, each is kept
        recomputed, behind the first of its :func:`checkpoint_gates` with which the plan still
        fits and the step gets shorter (``fitting=False``, for a plan that does not fit: with which
        the peak gets lower). Returns the plan, its simulation and how many checkpoints it
        recomputes."""
        policy = self.base_policies.get(base)
        if policy is None:
            return plan, sim, 0
        read_by_clones = set()
        for d in plan.recomputed:
            for name in d.recompute_ops:
                read_by_clones.update(self.ir.op(name).inputs)
        tries = sorted((d for d in plan.swapped if d.tensor in read_by_clones and
                        clonable(self.ir.op(self.ir.tensors[d.tensor].producer))), key=lambda d: -(d.nbytes or 0))
        base_decisions = list(plan.recomputed)
        dropped: Dict[str, str] = {}
        for decision in tries[:RECOMPUTED_CHECKPOINTS_TRIED]:
            for gate in checkpoint_gates(self.ir, self.found, decision.tensor, base_decisions):
                also = {**dropped, decision.tensor: gate}
                recomputed = self._recompute_only(*policy, also=also)
                swap = {d.tensor for d in plan.swapped} - set(also)
                candidate = self.assemble(swap, recomputed, tools, plan.orderings)
                try:
                    candidate_sim = self.simulate(candidate)
                except PlanCycleError:
                    continue
                logger.debug("planner: recomputing checkpoint %s (gate %s) instead of swapping it: held %d bytes, "
                             "step %.4f s (was %.4f s)", decision.tensor, gate, candidate_sim.held_bytes,
                             candidate_sim.step_time_s, sim.step_time_s)
                if (candidate_sim.held_bytes <= budget_bytes and candidate_sim.step_time_s < sim.step_time_s
                        if fitting else candidate_sim.held_bytes < sim.held_bytes):
                    plan, sim, dropped = candidate, candidate_sim, also
                    self.time_to_beat = sim.step_time_s if fitting else None
                    break
        return plan, sim, len(dropped)

    def lower_the_lowest(self, budget_bytes: int, plan: Plan, sim: Simulation, label: str, base: str,
                         tools: _Tools) -> Tuple[Plan, Simulation, str]:
        """Nothing fits: the lowest plan found, with swapped checkpoints recomputed where that lowers
        its peak, and then more swap rounds from there. It may fit now; if not, the error names a
        smaller feasible budget."""
        lowered, lowered_sim, recomputed = self.recompute_checkpoints(budget_bytes, plan, sim, base, tools,
                                                                      fitting=False)
        if not recomputed:
            return plan, sim, label
        label += _recomputed_checkpoints(recomputed)
        swapped, swapped_sim = self.add_swaps(budget_bytes, {d.tensor: d for d in lowered.recomputed}, tools,
                                              start=(lowered, lowered_sim))
        if swapped_sim.held_bytes < lowered_sim.held_bytes:
            return swapped, swapped_sim, label + " + more swaps"
        return lowered, lowered_sim, label

    def retime_swap_ins(self, budget_bytes: int, plan: Plan, sim: Simulation, label: str,
                        tools: _Tools) -> Tuple[Plan, Simulation, str]:
        """A fitting plan with late swap-ins, made faster: one swapped tensor at a time (largest
        first), its swap-ins get the whole head start the copy needs, or half of it, whichever
        is the first to keep the peak within budget and shorten the step."""
        swap = {d.tensor for d in plan.swapped}
        recomputed = {d.tensor: d for d in plan.recomputed}
        leads: Dict[str, float] = {}
        for decision in sorted(plan.swapped, key=lambda d: -(d.nbytes or 0)):
            for lead in RETIME_LEADS:
                candidate = self.assemble(swap, recomputed, tools, plan.orderings, {**leads, decision.tensor: lead})
                try:
                    candidate_sim = self.simulate(candidate)
                except PlanCycleError:
                    continue
                if candidate_sim.held_bytes <= budget_bytes and candidate_sim.step_time_s < sim.step_time_s:
                    plan, sim, leads = candidate, candidate_sim, {**leads, decision.tensor: lead}
                    self.time_to_beat = sim.step_time_s
                    break
        return plan, sim, label + (f" ({len(leads)} swap-ins re-timed)" if leads else "")

    def plan(self, budget_bytes: int) -> Tuple[Plan, Simulation, str]:
        """The fastest plan that fits, trying recompute bases in order; else the lowest peak found."""
        self.budget_bytes, self.time_to_beat = budget_bytes, None
        best: Optional[Tuple[Plan, Simulation, str]] = None
        lowest: Optional[Tuple[Plan, Simulation, str]] = None
        every_base = bases = self.recompute_bases()
        # Swapping alone frees at most what the link can copy out during the forward pass
        # (unless the forward pass waits for the copies).
        link_capacity = self.forward_seconds * self.cost.device.device_to_host_bytes_per_s
        if len(bases) > 1 and self.baseline.peak_bytes - budget_bytes > link_capacity:
            bases = [b for b in bases if b[0] != "none"]
        # Cheapest tools first; the others only when nothing fits without them (each pass
        # simulates the step again many times).
        passes = [(bases, _Tools(), ""), (bases, _Tools(late_swap_ins=True), " + late swap-ins"),
                  (bases, _Tools(late_swap_ins=True, order=True), " + late swap-ins + orderings")]
        if self.policies.swap:
            passes.append((every_base, _Tools(order=True, throttle=True), " + orderings + waits for copies out"))
        floors = {label: self.compute_floor(recomputed) for label, recomputed in every_base}
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
                    self.time_to_beat = sim.step_time_s
                if best is not None and label in ("none", "cheap"):
                    break  # no recompute (or only cheap ops) fits: nothing faster to find
            if best is not None:
                plan, sim, recomputed = self.recompute_checkpoints(budget_bytes, best[0], best[1], *best_from)
                best = (plan, sim, best[2] + _recomputed_checkpoints(recomputed))
                if tools.late_swap_ins:
                    best = self.retime_swap_ins(budget_bytes, *best, tools)
                break
        if best is None and lowest is not None:
            lowest = self.lower_the_lowest(budget_bytes, *lowest, *lowest_from)
            if lowest[1].held_bytes <= budget_bytes:
                best = lowest
        plan, sim, label = best or lowest
        return plan, sim, label

    def fit(self, budget_bytes: int) -> Tuple[Plan, Simulation, str, Optional[int]]:
        """:meth:`plan` for ``budget_bytes``; when nothing fits, up to :data:`LOWER_AIMS` more
        searches aiming below it by the lowest plan's excess. Returns the plan, its simulation,
        its label and, when it does not fit, the least budget of the lowest plan found (its chunks
        counted in graph order and the checked tie orders, whatever its tensors' peak: a plan
        whose tensors exceeded the budget was never replayed through the allocator model)."""
        plan, sim, label = self.plan(budget_bytes)
        floor, aim = None, budget_bytes
        for attempt in range(LOWER_AIMS + 1):
            if sim.held_bytes <= aim:  # fits what it was planned for, chunks counted
                break
            self.budget_bytes, self.time_to_beat = 2 * sim.peak_bytes, None  # any budget its tensors fit
            sim = self.simulate(plan)
            floor = sim.held_bytes if floor is None else min(floor, sim.held_bytes)
            excess = sim.held_bytes - budget_bytes
            if excess <= 0 or attempt == LOWER_AIMS or aim <= excess:
                break
            aim -= excess
            logger.info("lms-tf planner: nothing fits %.1f MiB (lowest plan %.1f MiB); searching again aiming at "
                        "%.1f MiB", budget_bytes / 2**20, sim.held_bytes / 2**20, aim / 2**20)
            plan, sim, label = self.plan(aim)
        return plan, sim, label, floor


def _recomputed_checkpoints(count: int) -> str:
    return f" ({count} swapped checkpoint{'s' if count > 1 else ''} recomputed)" if count else ""


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

    Example:
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
    planner = _Planner(ir, policies, device, cost, scope_aliases or {})
    baseline = planner.baseline
    budget_bytes = resolve_budget(policies.budget, baseline_peak_bytes=baseline.peak_bytes,
                                  memory_bytes=spec.memory_bytes, device_name=spec.name, resident=planner.resident)
    plan, sim, label, floor = planner.fit(budget_bytes)
    if sim.held_bytes > budget_bytes:
        counted = "in TensorFlow's allocator's whole chunks" if floor > sim.peak_bytes else "simulated"
        kinds = " and ".join(k for k, on in (("swapping", policies.swap), ("recomputing", policies.recompute)) if on)
        hint = ("" if policies.swap and policies.recompute else
                f", or allow {'recompute' if not policies.recompute else 'swap'} too")
        raise infeasible(
            f"budget {_gib(budget_bytes)} is infeasible on {spec.name}: the plain step peaks at "
            f"{_gib(baseline.peak_bytes)} (simulated) and {kinds or 'moving'} every movable tensor still needs "
            f"{_gib(floor)} ({counted}). The smallest feasible budget is about {_gib(floor)}; pass budget >= that, "
            f"a smaller batch{hint}.",
            budget_bytes, floor)
    logger.info("lms-tf planner: %s peak %.1f -> %.1f MiB (budget %.1f MiB; recompute %s; %d simulations) "
                "in %.2f s", spec.name, baseline.peak_bytes / 2**20, sim.peak_bytes / 2**20, budget_bytes / 2**20,
                label, planner.simulations, time.perf_counter() - started)
    return dataclasses.replace(plan, budget_bytes=budget_bytes, device_spec=spec.name, predictions=Predictions(
        baseline_peak_bytes=baseline.peak_bytes, planned_peak_bytes=sim.peak_bytes,
        planned_allocator_peak_bytes=sim.allocator_peak_bytes, baseline_step_time_s=baseline.step_time_s,
        predicted_step_time_s=sim.step_time_s, feasible=True))
