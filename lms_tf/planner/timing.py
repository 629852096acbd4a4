"""Swap timing: when each swap-in starts, what a swap costs, and how a set of choices becomes a plan.

A swap's cost is the copy time the compute between producer and reader cannot hide, plus any
copy-out time past the end of the forward pass (a copy still running at the peak frees nothing).
When the link is the bottleneck, the forward pass waits for its copies out (TFLMS's synchronous
swap-out) and swap-ins start a fixed number of reader groups ahead.

Examples:
    >>> Tools().late_swap_ins, SWAP_OUT_LAG
    (False, 2)
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import AbstractSet, Dict, FrozenSet, List, Mapping, Optional, Set, Tuple

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import OpInfo, Phase, layer_of, same_device
from lms_tf.core.op_kinds import SWAP_IN_PREFIX, TO_HOST_PREFIX, is_hyperparameter, recompute_clone_name
from lms_tf.core.plan import Decision, Ordering, Plan, SwapIn, TensorDecision, WeightDecision
from lms_tf.planner.slicing import slice_op
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.weights import plan_weights, timed_fetches
from lms_tf.simulate import (Simulation, clone_readers, gradients_crossing_as, update_products_on_device,
                             without_unsound_clone_fetches)

logger = logging.getLogger("lms_tf")

#: With synchronous swap-outs, how many copies out may still be pending when the forward pass
#: starts the producer of the next swapped tensor (some slack keeps the link and compute overlapped).
SWAP_OUT_LAG = 2
#: With synchronous swap-outs (a link-bound step), how many swap-ins may run ahead of the compute.
SWAP_IN_LAG = 2
#: Head starts tried, in order, for a weight fetch that sits idle on the device at the simulated
#: peak (fractions of its copy's time; 0: triggered by the last gate before its window).
DELAYED_FETCH_LEADS = (0.5, 0.25, 0.0)


@dataclasses.dataclass(frozen=True)
class Tools:
    """What a planning pass may use beyond swaps on a recompute base.

    Attributes:
        late_swap_ins: Trigger each swap-in by the backward op just before its consumers instead
            of early enough to hide the copy (slower, but the swapped bytes return later).
        order: Make backward branches alive together at the peak run one after the other.
        throttle: Make the forward pass wait for the copies out; swap-ins run a fixed number of
            groups ahead of their consumers.
        slice_ops: Run the op at the peak a slice of the batch at a time where it may be
            (:func:`~lms_tf.planner.slicing.slice_op`), when nothing else lowers the peak.
        late_copies: When nothing else lowers the peak, make a forward op wait for a copy out that
            holds its bytes at it, and start an idle swap-in later (slower, and in the search's
            first passes they led it away from plans it found without them: the pass whose forward
            pass waits for its copies out and the last two).

    Examples:
        >>> Tools(order=True).order
        True
    """

    late_swap_ins: bool = False
    order: bool = False
    throttle: bool = False
    slice_ops: bool = False
    late_copies: bool = False


@dataclasses.dataclass(frozen=True)
class Choices:
    """What one plan of a step is made of: the search's moves each change one part and
    :meth:`build` makes the plan (:func:`assemble`).

    Attributes:
        swap: The tensors swapped.
        recomputed: The recompute base's decisions (tensor -> RECOMPUTE decision).
        tools: What the pass may use (:class:`Tools`).
        orderings: Backward ops made to wait for others.
        weights: The weight decisions to keep (None: timed anew by :func:`assemble`).
        split: Swapped tensors brought back twice -> the op they are swapped in again after.
        sliced: Ops run a slice of the batch at a time -> how many slices.
        leads: Swapped tensors whose swap-ins start this fraction of their copy time before their
            readers (0: right before them) instead of as the pass times them; one named here is
            never lagged behind the compute (``tools.throttle``).
        copy_out_waits: Swapped tensors -> the forward op that waits until the tensor's copy to
            the host has ended (``swap_out_before``), instead of the pass's choice.

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> choices = Choices(swap=frozenset({"a:0"}))
        >>> [d.tensor for d in choices.build(step).swapped], choices.replace(leads={"a:0": 0.0}).leads
        (['a:0'], {'a:0': 0.0})
    """

    swap: FrozenSet[str] = frozenset()
    recomputed: Mapping[str, TensorDecision] = dataclasses.field(default_factory=dict)
    tools: Tools = Tools()
    orderings: Tuple[Ordering, ...] = ()
    weights: Optional[Tuple[WeightDecision, ...]] = None
    split: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sliced: Mapping[str, int] = dataclasses.field(default_factory=dict)
    leads: Mapping[str, float] = dataclasses.field(default_factory=dict)
    copy_out_waits: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan, recomputed: Mapping[str, TensorDecision], tools: Tools) -> "Choices":
        """The choices ``plan`` was built from, as far as it shows them: its recompute base and tools
        are given, and its leads and waits for copies out taken for the pass's own.

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()
            >>> Choices.of(Choices(swap=frozenset({"a:0"})).build(step), {}, Tools()).swap
            frozenset({'a:0'})
        """
        return cls(frozenset(d.tensor for d in plan.swapped), recomputed, tools, plan.orderings, plan.weights,
                   split_swap_ins(plan), sliced_ops(plan))

    def replace(self, **changes) -> "Choices":
        """These choices with ``changes`` (field name -> new value).

        Examples:
            >>> Choices().replace(sliced={"pool_grad": 4}).sliced
            {'pool_grad': 4}
        """
        return dataclasses.replace(self, **changes)

    def build(self, step: PlanningStep) -> Plan:
        """The plan of these choices for ``step`` (:func:`assemble`).

        Examples:
            >>> from lms_tf.planner.step import PlanningStep
            >>> len(Choices().build(PlanningStep.example()).swapped)
            0
        """
        return assemble(step, set(self.swap), self.recomputed, self.tools, self.orderings, self.leads,
                        weights=self.weights, split=self.split, sliced=self.sliced,
                        copy_out_waits=self.copy_out_waits)


def timed_swap(step: PlanningStep, tensor: str, distance: int, lead: float = 1.0,
               around: Optional[str] = None) -> Optional[TensorDecision]:
    """A SWAP decision whose swap-ins start just early enough for the copy back to end
    before their consumers (by the baseline's predicted times; ``lead`` scales that head
    start, 0 = right before them); None if no backward op runs early enough to trigger one.
    With ``around`` (a backward op, see :func:`readers_around`), two swap-ins: one for the
    readers that need not wait for that op, timed as above, and one for the others, started
    when that op ends.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> decision = timed_swap(step, "a:0", distance=6)
        >>> decision.swap_ins, decision.reason
        ((SwapIn(trigger='g2', consumers=('g1',), after_gradients=()),), 'swap (copy hidden behind compute)')
    """
    ir, found = step.ir, step.found
    info = ir.tensors[tensor]
    copy_back = step.cost.transfer_time(info.nbytes or 0, "host_to_device")
    intervals = step.baseline.op_intervals
    groups: List[List] = []
    split = readers_around(step, tensor, around) if around is not None else None
    if split is not None:
        groups = [list(split[0])]
    else:
        for consumer in sorted(found.backward_of[tensor], key=lambda c: c.index):
            if groups and consumer.index - groups[-1][0].index <= step.policies.swapin_groupby:
                groups[-1].append(consumer)
            else:
                groups.append([consumer])
    swap_ins = []
    for group in groups:
        # The first swap-in of a split comes before the op the second waits for, which waits for
        # its readers: its trigger is counted back from whichever of them comes first.
        head = group[0] if split is None else min(group[0], ir.op(around), key=lambda op: op.index)
        position = found.gates_before(head.index) - 1
        if position < 0:
            return None
        deadline = intervals.get(head.name, (0.0, 0.0))[0] - lead * copy_back
        # Alias ops (Reshape, Identity) take no time of their own and have no interval: walk past them.
        while lead > 0 and position > 0 and \
                intervals.get(found.gates[position].name, (0.0, float("inf")))[1] > deadline:
            position -= 1
        swap_ins.append(SwapIn(found.gates[position].name, tuple(c.name for c in group)))
    reason = ("swap (copy hidden behind compute)" if swap_exposed(step, tensor) <= 0 else
              "swap (cheapest per byte freed)")
    if split is not None:
        swap_ins.append(SwapIn(around, tuple(c.name for c in split[1])))
        reason += f"; swapped in again after {around} (one copy for all its readers was on the device through it)"
    return TensorDecision(tensor, layer_of(info.producer), info.shape, info.nbytes, Decision.SWAP, reason,
                          distance, tuple(swap_ins))


def readers_around(step: PlanningStep, tensor: str, op: str) -> Optional[Tuple[Tuple[OpInfo, ...], Tuple[OpInfo, ...]]]:
    """The backward readers of ``tensor`` split around the backward op ``op`` (which does not read
    it): those that need not wait for ``op`` (no path from it), and those that do, each in run
    order; None unless both are there and ``op`` can trigger a swap-in. A swap-in shared by both
    holds the copy on the device while ``op`` runs; two swap-ins, with ``op`` waiting for the
    first readers, do not (a convolution's filter gradient and the previous layer's ``ReluGrad``
    both read the layer's input, and the input gradient, the layer's largest op, runs between them).

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> readers_around(step, "a:0", "g2") is None   # a's only backward reader waits for g2
        True
    """
    ir, found = step.ir, step.found
    gate_names = step.__dict__.get("_gate_names")  # one step: one set of gates
    if gate_names is None:
        gate_names = step.__dict__["_gate_names"] = frozenset(g.name for g in found.gates)
    readers = sorted(found.backward_of[tensor], key=lambda c: c.index)
    if not readers or op in {r.name for r in readers} or op not in gate_names:
        return None
    last = readers[-1].index
    after, frontier = {op}, [op]
    while frontier:  # the ops that wait for op, up to the last reader
        for t in ir.op(frontier.pop()).outputs:
            for consumer in ir.tensors[t].consumers:
                if consumer not in after and ir.op(consumer).index <= last:
                    after.add(consumer)
                    frontier.append(consumer)
    first = tuple(r for r in readers if r.name not in after)
    then = tuple(r for r in readers if r.name in after)
    return (first, then) if first and then else None


def ops_between_readers(step: PlanningStep, tensor: str) -> List[str]:
    """The backward ops a swapped copy of ``tensor`` could be brought back twice around
    (:func:`readers_around`), in run order: gates among its readers, or up to ``swapin_groupby``
    ops before the first (TensorFlow builds a convolution's input gradient before its filter
    gradient, and the filter gradient is the first reader of the layer's input).

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> ops_between_readers(step, "a:0")   # one reader: nothing between
        []
    """
    readers = sorted(step.found.backward_of[tensor], key=lambda c: c.index)
    if len(readers) < 2:
        return []
    low, high = readers[0].index - step.policies.swapin_groupby, readers[-1].index
    return [g.name for g in step.found.gates if low <= g.index <= high and readers_around(step, tensor, g.name)]


def split_swap_ins(plan: Plan) -> Dict[str, str]:
    """The swapped tensors of ``plan`` swapped in twice around an op (:func:`timed_swap` with
    ``around``), each with that op: what :func:`assemble` takes as ``split`` to build them again.

    Examples:
        >>> split_swap_ins(Plan((), "/device:GPU:0", "/device:CPU:0", {}, {}))
        {}
    """
    waits = {(o.waiters, o.after) for o in plan.orderings}
    return {d.tensor: d.swap_ins[1].trigger for d in plan.swapped
            if len(d.swap_ins) == 2 and ((d.swap_ins[1].trigger,), d.swap_ins[0].consumers) in waits}


def window(step: PlanningStep, tensor: str) -> float:
    """Baseline compute time between the tensor's producer and its first backward reader.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> window(step, "a:0") > window(step, "c:0")   # a is read last: the longest window
        True
    """
    intervals = step.baseline.op_intervals
    producer = intervals.get(step.ir.tensors[tensor].producer)
    first = min((intervals[c.name][0] for c in step.found.backward_of[tensor] if c.name in intervals),
                default=None)
    if producer is None or first is None:
        return 0.0
    return max(0.0, first - producer[1])


def swap_exposed(step: PlanningStep, tensor: str) -> float:
    """Copy time, out and back, that the compute between the producer and its first backward reader
    cannot hide (negative: it hides with time to spare).

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> swap_exposed(step, "a:0") < 0   # on NVLink-C2C both copies fit in a's window
        True
    """
    nbytes = step.ir.tensors[tensor].nbytes or 0
    copies = step.cost.transfer_time(nbytes, "device_to_host") + step.cost.transfer_time(nbytes, "host_to_device")
    return copies - window(step, tensor)


def swap_cost(step: PlanningStep, tensor: str, link_busy: float) -> float:
    """Predicted slowdown of swapping: the copies the compute cannot hide, plus any copy-out
    time past the forward pass (copies out must drain while it runs, or the bytes they free
    stay on the device through the peak at the start of the backward pass).

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> swap_cost(step, "a:0", link_busy=0.0)
        0.0
    """
    nbytes = step.ir.tensors[tensor].nbytes or 0
    one_way = step.cost.transfer_time(nbytes, "device_to_host")
    window = step.forward_seconds
    over = max(0.0, link_busy + one_way - window) - max(0.0, link_busy - window)
    return max(0.0, swap_exposed(step, tensor)) + over


def lagged_swap_ins(step: PlanningStep, swapped: List[TensorDecision]) -> Dict[str, TensorDecision]:
    """When the link is the bottleneck, swap-ins timed by the plain step's clock all start at
    the top of the backward pass and pile up on the device. Instead, the swap-in feeding the
    i-th consumer group is triggered just before the (i - :data:`SWAP_IN_LAG`)-th group's
    consumers run: at most that many copies back are ahead of the compute.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> lagged_swap_ins(step, [timed_swap(step, "a:0", 6)])   # one swap-in: nothing to hold back
        {}
    """
    found = step.found
    groups = sorted(((step.ir.op(s.consumers[0]).index, d.tensor, k)
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


def swap_out_waits(step: PlanningStep, swapped: List[TensorDecision]) -> Dict[str, TensorDecision]:
    """TFLMS's synchronous swap-out, with some slack: the producer of the swapped tensor
    :data:`SWAP_OUT_LAG` swaps later waits until this tensor's copy out has ended. The forward
    pass then runs at the link's pace, and at most that many copies are pending when it ends.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> swap_out_waits(step, [timed_swap(step, "a:0", 6)])   # one swap: no later producer waits for it
        {}
    """
    ir = step.ir
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


def assemble(step: PlanningStep, swap: Set[str], recomputed: Mapping[str, TensorDecision], tools: Tools = Tools(),
             orderings: Tuple[Ordering, ...] = (), leads: Optional[Mapping[str, float]] = None,
             weights: Optional[Tuple[WeightDecision, ...]] = None, split: Optional[Mapping[str, str]] = None,
             sliced: Optional[Mapping[str, int]] = None, copy_out_waits: Optional[Mapping[str, str]] = None) -> Plan:
    """The plan of these choices: ``swap`` swapped (timed by :func:`timed_swap`, with ``leads`` scaling
    their head starts), ``recomputed`` recomputed, the rest kept; with ``tools.throttle`` the forward
    pass waits for its copies out and swap-ins lag behind the compute (those given a lead excepted),
    and each weight fetch keeps the rule's
    trigger (``swapin_ahead`` gates before its window) instead of the earliest that hides its copy (a
    link-bound step fetches every weight at its start to save time, and holds them all). ``weights``,
    when given, are the weight decisions to keep (a plan's, some fetches delayed by
    :func:`delayed_fetches`) instead of those timings. ``split`` maps swapped tensors to the op
    they are swapped in again after (:func:`timed_swap` with ``around``); that op waits for the
    first swap-in's readers. ``sliced`` maps ops to the number of slices of the batch they run in
    (:func:`~lms_tf.planner.slicing.slice_op`; one that reads no swapped input then runs whole).
    ``copy_out_waits`` maps swapped tensors to the forward op that waits for their copy out.

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> [(d.tensor, d.decision.value) for d in assemble(step, {"a:0"}, {}).decisions]
        [('a:0', 'swap'), ('b:0', 'keep'), ('c:0', 'keep'), ('loss:0', 'keep')]
    """
    ir, found, policies = step.ir, step.found, step.policies
    decisions: Dict[str, TensorDecision] = dict(found.kept)
    for name in found.eligible:
        if name in recomputed:
            decisions[name] = recomputed[name]
            continue
        info = ir.tensors[name]
        lead = (leads or {}).get(name, 0.0 if tools.late_swap_ins else 1.0)
        decision = (timed_swap(step, name, found.distance[name], lead, (split or {}).get(name)) if name in swap
                    else None)
        decisions[name] = decision or TensorDecision(
            name, layer_of(info.producer), info.shape, info.nbytes, Decision.KEEP, "fits the budget",
            found.distance[name], ())
    if tools.throttle:
        swapped = [d for d in decisions.values() if d.decision is Decision.SWAP]
        decisions.update(swap_out_waits(step, swapped))
        lagged = lagged_swap_ins(step, [decisions[d.tensor] for d in swapped])
        for tensor in leads or {}:  # given its own lead for a reason (it arrived too early): not lagged
            lagged.pop(tensor, None)
        for tensor, decision in lagged.items():
            if len(decision.swap_ins) == 2 and tensor in (split or {}):  # the second copy starts after its op
                lagged[tensor] = dataclasses.replace(decision, swap_ins=(
                    decision.swap_ins[0], dataclasses.replace(decision.swap_ins[1], trigger=split[tensor])))
        decisions.update(lagged)
    for tensor, op in (copy_out_waits or {}).items():
        decision = decisions.get(tensor)
        if decision is not None and decision.decision is Decision.SWAP:
            decisions[tensor] = dataclasses.replace(
                decision, swap_out_before=op, reason=f"{decision.reason}; {op} waits for the copy out (the tensor "
                                                     f"held its bytes at the peak until the copy ended)")
    for tensor, op in (split or {}).items():
        decision = decisions.get(tensor)
        if decision is not None and len(decision.swap_ins) == 2:
            wait = Ordering((op,), decision.swap_ins[0].consumers,
                            f"{op} waits for the readers of {tensor}'s first swap-in (it is swapped in again after)")
            if all((o.waiters, o.after) != (wait.waiters, wait.after) for o in orderings):
                orderings = orderings + (wait,)
    plan = Plan(decisions=tuple(decisions[n] for n in found.order), device=step.device, host=policies.host,
                policies=policies.to_dict(), phase_counts=ir.phase_counts(), orderings=orderings,
                weights=(weights if weights is not None else
                         plan_weights(step.ir, policies, step.offloaded) if tools.throttle else timed_weights(step)))
    for op, slices in (sliced or {}).items():
        try:
            plan = slice_op(plan, ir, op, slices, reason="it holds more than the budget run whole", gates=found.gates)
        except LMSOptionError:
            continue  # none of its inputs is swapped in this plan: sliced, it would hold no less
    # Given weights may fetch for clones after an earlier clone that this recompute base has not.
    return without_unsound_clone_fetches(ir, plan)


def sliced_ops(plan: Plan) -> Dict[str, int]:
    """The ops ``plan`` runs a slice of the batch at a time, each with its number of slices: what
    :func:`assemble` takes as ``sliced`` to build them again.

    Examples:
        >>> sliced_ops(Plan((), "/device:GPU:0", "/device:CPU:0", {}, {}))
        {}
    """
    return {s.op: s.slices for s in plan.sliced}


def timed_weights(step: PlanningStep):
    """The step's weight fetches (``weights="host"``) timed by the plain step's simulation: each
    copy starts just early enough to end before its window (cached on the step).

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> timed_weights(PlanningStep.example())   # weights on the device: nothing to time
        ()
    """
    planned = plan_weights(step.ir, step.policies, step.offloaded)
    if not planned:
        return planned
    timed = step.__dict__.get("_timed_weights")  # one step: one IR, policies, cost and baseline
    if timed is None:
        timed = timed_fetches(step.ir, planned, step.baseline.op_intervals,
                              lambda nbytes: step.cost.transfer_time(nbytes, "host_to_device"))
        step.__dict__["_timed_weights"] = timed
    return timed


def idle_fetches(step: PlanningStep, sim: Simulation, weights: Tuple[WeightDecision, ...]
                 ) -> List[Tuple[int, WeightDecision]]:
    """The weights whose fetched copy is on the device at the simulated peak although none of its
    window's ops runs then and some are still to run, ``(bytes, weight)``, largest first. Each
    fetch is triggered early enough to hide its copy behind compute
    (:func:`~lms_tf.planner.weights.timed_fetches`): a large weight on a fast device arrives many
    ops before its layer, and while it waits it holds its bytes at a peak it takes no part in, as
    a swapped-out activation's early swap-in would. A window whose copy could not be made again in
    time after its previous one (the last layers' forward and backward reads) shares that copy,
    which waits on the device between them.

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # weights on the device: no fetch to delay
        >>> idle_fetches(step, step.baseline, ())
        []
    """
    live = dict(sim.live_at_peak)
    at = sim.peak_time_s
    idle = []
    for weight in weights:
        for i, fetch in enumerate(weight.fetches):
            nbytes = live.get(weight.fetch_name(i))
            ran = [sim.op_intervals[c] for c in fetch.consumers if c in sim.op_intervals]
            if nbytes and any(start > at for start, _ in ran) and not any(start <= at < end for start, end in ran):
                idle.append((nbytes, weight))
                break
    return sorted(idle, key=lambda pair: (-pair[0], pair[1].variable))


def idle_clone_fetches(step: PlanningStep, sim: Simulation, plan: Plan) -> List[Tuple[int, str, str]]:
    """The weights a recompute region fetches behind its gate whose copy is on the device at the
    simulated peak although none of the clones that read it runs then and some are still to run,
    ``(bytes, variable, gate)``, largest first. A region that recomputes several layers fetches all
    their weights from its one gate, back to back on the copy stream: the later layers' weights
    wait on the device while the first layer is recomputed (VGG16's classifier: ``fc2``'s 64 MiB
    kernel arrived while ``fc1``'s 392 MiB one was held for its clone).

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # nothing recomputed: no clone fetches
        >>> idle_clone_fetches(step, step.baseline, assemble(step, set(), {}))
        []
    """
    live = dict(sim.live_at_peak)
    at = sim.peak_time_s
    idle = []
    for gate in dict.fromkeys(d.gate for d in plan.recomputed):
        clones = plan.clones_behind(gate)
        for weight in plan.offloaded_weights:
            nbytes = live.get(weight.clone_fetch_name(gate))
            if not nbytes:
                continue
            ran = [sim.op_intervals[name] for name in (recompute_clone_name(gate, clones[i])
                                                       for i in clone_readers(step.ir, clones, weight))
                   if name in sim.op_intervals]
            if any(start > at for start, _ in ran) and not any(start <= at < end for start, end in ran):
                idle.append((nbytes, weight.variable, gate))
    return sorted(idle, key=lambda item: (-item[0], item[1], item[2]))


def clone_fetches_in_turn(step: PlanningStep, plan: Plan, variable: str, gate: str, gates: AbstractSet[str]
                          ) -> List[Tuple[WeightDecision, ...]]:
    """``plan``'s weights with ``variable``'s copy for the clones behind ``gate`` made after an
    earlier clone there instead of after the gate: one choice per clone before the first that reads
    it whose op may trigger a copy (``gates``: :func:`~lms_tf.planner.weights.forward_gates`'s
    names, whose readers Grappler fuses nothing into), the latest first.

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()
        >>> clone_fetches_in_turn(step, assemble(step, set(), {}), "w", "g", frozenset())
        []
    """
    weight = next((w for w in plan.offloaded_weights if w.variable == variable), None)
    if weight is None:
        return []
    clones = plan.clones_behind(gate)
    readers = clone_readers(step.ir, clones, weight)
    if not readers:
        return []
    first = readers[0]
    kept = tuple(pair for pair in weight.clone_fetches_after if pair[0] != gate)
    current = weight.clone_fetch_after(gate)
    tried = []
    for op in reversed(clones[:first]):
        if op not in gates or op == current:
            continue
        changed = dataclasses.replace(weight, clone_fetches_after=kept + ((gate, op),))
        tried.append(tuple(changed if w.variable == variable else w for w in plan.weights))
    return tried


def idle_swap_ins(step: PlanningStep, sim: Simulation, plan: Plan) -> List[Tuple[int, str]]:
    """The swapped tensors of ``plan`` whose swap-in copy is on the device at the simulated peak
    although none of its readers has started and some are still to run, ``(bytes, tensor)``,
    largest first: the copy arrived before the peak for readers after it, and holds its bytes at
    a peak it takes no part in (:func:`idle_fetches`, for activations).

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # nothing swapped: no copy to start later
        >>> idle_swap_ins(step, step.baseline, assemble(step, set(), {}))
        []
    """
    live = dict(sim.live_at_peak)
    at = sim.peak_time_s
    idle: Dict[str, int] = {}
    for d in plan.swapped:
        for k, swap_in in enumerate(d.swap_ins):
            nbytes = live.get(f"{SWAP_IN_PREFIX}{d.tensor}/{k}")
            ran = [sim.op_intervals[c] for c in swap_in.consumers if c in sim.op_intervals]
            if nbytes and any(start > at for start, _ in ran) and not any(start <= at for start, _ in ran):
                idle[d.tensor] = max(idle.get(d.tensor, 0), nbytes)
    return sorted(((nbytes, tensor) for tensor, nbytes in idle.items()), key=lambda pair: (-pair[0], pair[1]))


def copies_out_at_peak(step: PlanningStep, sim: Simulation, plan: Plan) -> List[Tuple[int, str, List[str]]]:
    """The swapped tensors of ``plan`` on the device at the simulated peak only because their
    copy to the host has not ended (their producer and every reader of the tensor itself have
    run), largest first, each ``(bytes, tensor, waiters)``: the forward ops that could wait for
    that copy to lower the peak, the op at the peak (or running then) and the first to start once
    the tensor's readers are done, in that order. The copy out runs beside the forward pass, and
    a large one still running when the next layers allocate holds its bytes beside theirs
    (VGG16: `block1_conv2`'s 196 MiB output while `block2` runs).

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # nothing swapped: no copy out
        >>> copies_out_at_peak(step, step.baseline, assemble(step, set(), {}))
        []
    """
    ir, intervals, at = step.ir, sim.op_intervals, sim.peak_time_s
    live = dict(sim.live_at_peak)
    forward = sorted((start, name) for name, (start, _) in intervals.items()
                     if ir.has_op(name) and ir.op(name).phase is Phase.FORWARD)
    found = []
    for d in plan.swapped:
        nbytes = live.get(d.tensor)
        producer = ir.tensors[d.tensor].producer
        if not nbytes or producer not in intervals:
            continue
        copied_in = {c for s in d.swap_ins for c in s.consumers}
        readers = [r for r in ir.tensors[d.tensor].consumers if r not in copied_in]
        ends = [intervals[r][1] for r in readers if r in intervals] + [intervals[producer][1]]
        if any(r not in intervals for r in readers) or max(ends) > at:
            continue  # a reader has still to run, or is running: not the copy alone
        done = max(ends)
        running = [sim.peak_op] + [name for start, name in forward if start <= at < intervals[name][1]]
        first = next((name for start, name in forward if start >= done), None)
        waiters = []
        for name in running + ([first] if first else []):
            if name in intervals and name not in waiters and ir.has_op(name) \
                    and ir.op(name).phase is Phase.FORWARD and ir.op(name).index > ir.op(producer).index:
                waiters.append(name)
        if waiters:
            found.append((nbytes, d.tensor, waiters))
    return sorted(found, key=lambda item: (-item[0], item[1]))


def delayed_fetches(step: PlanningStep, weights: Tuple[WeightDecision, ...], variable: str, lead: float
                    ) -> Tuple[WeightDecision, ...]:
    """``weights`` with ``variable``'s fetches triggered later: each ``lead`` of its copy time before its
    window (by the plain step's clock, as :func:`timed_weights` does with the whole copy time), so
    the window may wait for part of the copy and the device holds the copy for less of the step.
    The windows are the rule's (:func:`~lms_tf.planner.weights.plan_weights`), timed again: two
    that shared one copy get one each when the second's copy can start after the first ends.

    Examples:
        >>> from lms_tf.core.policy import Policies
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> step = PlanningStep.build(weighted_chain_ir(), Policies(weights="host", budget="50%", swapin_groupby=1),
        ...                           device="/device:GPU:0", cost=CostModel(get_device_spec("h100-80gb-pcie5")))
        >>> late = delayed_fetches(step, timed_weights(step), "w2:0", 0.0)
        >>> [f.trigger for f in late[1].fetches]   # the last gate before each window
        ['r1', 'loss']
    """
    rule = {w.variable: w for w in plan_weights(step.ir, step.policies, step.offloaded)}

    def later(weight: WeightDecision) -> WeightDecision:
        # From the rule's windows: the timing merged a window whose copy could not be made again in
        # time into the one before; later, each may have its own copy. A wait for gradients stays
        # with the window whose first reader it was made for.
        waits = {f.consumers[0]: f.after_gradients for f in weight.fetches if f.after_gradients}
        windows = rule.get(weight.variable, weight)
        windows = dataclasses.replace(windows, fetches=tuple(
            dataclasses.replace(f, after_gradients=waits.get(f.consumers[0], f.after_gradients))
            for f in windows.fetches))
        timed = timed_fetches(step.ir, (windows,), step.baseline.op_intervals,
                              lambda nbytes: step.cost.transfer_time(nbytes, "host_to_device"), lead)[0]
        return dataclasses.replace(timed, reason=f"weights='host': fetched {lead:g} of its copy time before each "
                                                 f"window (fetched in time to hide the copy, it sat idle at the peak)",
                                   clone_fetches_after=weight.clone_fetches_after)

    return tuple(later(w) if w.variable == variable else w for w in weights)


def waitable_gradient(ir, gradient: str, host: str) -> bool:
    """Whether a weight fetch may wait for ``gradient`` to reach ``host``: a backward op makes it,
    and the device computes from it alone (with hyperparameters) whatever of it the update reads
    on the host (through views: a bias's reshape, the optimizer's ``IdentityN``). A variable
    whose gradient has several contributions (a tied embedding's lookup and output projection) is
    updated from their sum, which crosses to the host only once the last contribution is
    complete: a wait for the first could wait for the window itself. The rewrite follows the same
    paths and hyperparameter rule (:func:`lms_tf.tf.rewrite.weights.gradient_on_host`,
    :func:`lms_tf.core.op_kinds.is_hyperparameter`).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> ir = weighted_chain_ir()
        >>> waitable_gradient(ir, "gw2:0", "/CPU:1"), waitable_gradient(ir, "x:0", "/CPU:1")
        (True, False)
    """
    info = ir.tensors.get(gradient)
    if info is None or ir.op(info.producer).phase is not Phase.BACKWARD:
        return False

    def producer(tensor: str):
        op = ir.op(ir.tensors[tensor].producer)
        return op.type, op.inputs

    frontier, seen = [gradient], set()
    while frontier:
        tensor = frontier.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        for name in ir.tensors[tensor].consumers:
            reader = ir.op(name)
            if same_device(reader.device, host) and not reader.is_alias:
                continue  # read on the host: it crosses as it is
            if reader.type == "IdentityN":  # output i forwards input i only
                frontier.extend(o for t, o in zip(reader.inputs, reader.outputs) if t == tensor)
            elif reader.is_alias:
                frontier.extend(reader.outputs)
            elif reader.phase is Phase.UPDATE:  # a product for the update, made on the device
                if not all(t in seen or is_hyperparameter(t, producer) for t in reader.inputs):
                    return False
                frontier.extend(reader.outputs)
    return True


def gradients_on_device_at_peak(step: PlanningStep, sim: Simulation) -> List[Tuple[int, str]]:
    """The weight gradients still on the device at the simulated peak because their copy to the
    host (the update runs there) has not ended, ``(bytes, gradient)``, largest first. The backward
    pass goes on while a large gradient is copied out, and what it allocates meanwhile adds to it.

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # the update on the device: nothing is copied out
        >>> gradients_on_device_at_peak(step, step.baseline)
        []
    """
    live = dict(sim.live_at_peak)
    found: Dict[str, int] = {}
    on_device = None
    for name, (_, end) in sim.op_intervals.items():
        if not name.startswith(TO_HOST_PREFIX):
            continue
        # What crosses is the gradient, or a product of it the device makes for the update.
        crossed = name[len(TO_HOST_PREFIX):]
        info = step.ir.tensors.get(crossed)
        if info is None or not live.get(crossed) or end <= sim.peak_time_s:
            continue
        produced = sim.op_intervals.get(info.producer)
        if produced is None or produced[1] > sim.peak_time_s:
            continue
        if on_device is None:
            on_device = update_products_on_device(step.ir)
        for gradient in gradients_crossing_as(step.ir, crossed, on_device):
            if waitable_gradient(step.ir, gradient, step.policies.host):
                found[gradient] = found.get(gradient, 0) + live[crossed]
    return sorted(((nbytes, gradient) for gradient, nbytes in found.items()), key=lambda pair: (-pair[0], pair[1]))


def fetches_after(step: PlanningStep, sim: Simulation, weights: Tuple[WeightDecision, ...], gradient: str
                  ) -> List[Tuple[str, int]]:
    """The weight fetches that could wait for ``gradient``'s copy to the host and so hold back the
    op at the simulated peak, ``(variable, window)``: the window the peak op reads first, then
    those that start after the gradient is complete and before the peak, the nearest first, then
    those that start after the peak (a fetch that waits arrives later, and may no longer be on the
    device at the peak), the nearest first.
    A window that started after its producer ended cannot be one the gradient depends on.

    Examples:
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # weights on the device: no fetch
        >>> fetches_after(step, step.baseline, (), "a:0")
        []
    """
    produced = sim.op_intervals.get(step.ir.tensors[gradient].producer)
    if produced is None:
        return []
    at_peak, before, after = [], [], []
    for weight in weights:
        for window, fetch in enumerate(weight.fetches):
            if gradient in fetch.after_gradients:
                continue
            starts = [sim.op_intervals[c][0] for c in fetch.consumers if c in sim.op_intervals]
            if not starts or min(starts) < produced[1]:
                continue
            if sim.peak_op in fetch.consumers:
                at_peak.append((weight.variable, window))
            elif min(starts) <= sim.peak_time_s:
                before.append((-min(starts), weight.variable, window))
            else:  # a fetch copied early that waits idle through the peak: waiting, it arrives later
                after.append((min(starts), weight.variable, window))
    return at_peak + [(variable, window) for _, variable, window in sorted(before) + sorted(after)]


def waiting_for_gradient(weights: Tuple[WeightDecision, ...], variable: str, window: int, gradient: str
                         ) -> Tuple[WeightDecision, ...]:
    """``weights`` with ``variable``'s fetch for ``window`` also waiting for ``gradient`` to reach the host.

    Examples:
        >>> from lms_tf.core.plan import Decision, SwapIn, WeightDecision
        >>> w = WeightDecision("w:0", ("r:0",), (2,), 8, Decision.SWAP, "", (SwapIn("", ("m",)), SwapIn("t", ("g",))))
        >>> waiting_for_gradient((w,), "w:0", 1, "gw:0")[0].fetches[1].after_gradients
        ('gw:0',)
    """
    def waiting(weight: WeightDecision) -> WeightDecision:
        fetches = list(weight.fetches)
        fetch = fetches[window]
        fetches[window] = dataclasses.replace(fetch, after_gradients=fetch.after_gradients + (gradient,))
        return dataclasses.replace(weight, fetches=tuple(fetches))

    return tuple(waiting(w) if w.variable == variable else w for w in weights)


def swap_round(step: PlanningStep, budget_bytes: int, sim: Simulation, swap: Set[str],
               recomputed: Mapping[str, TensorDecision], link_busy: float) -> Optional[Tuple[Set[str], float]]:
    """The swap set grown by the tensors idle at the peak, cheapest per byte first, until they
    cover the bytes over budget (and the link time they add); None if nothing is idle.

    A tensor is idle at the peak when it was produced before it and is first read by the backward
    pass after it: swapping anything else would not lower this peak.

    Examples:
        >>> swap_round.__name__
        'swap_round'

    Examples:
        >>> from lms_tf.core.examples import MiB
        >>> from lms_tf.planner.step import PlanningStep
        >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
        >>> sorted(swap_round(step, 9 * MiB, step.baseline, set(), {}, link_busy=0.0)[0])
        ['a:0']
    """
    excess = sim.held_bytes - budget_bytes
    idle = []
    for name, nbytes in sim.live_at_peak:
        if (name not in step.eligible or name in swap or name in recomputed or not nbytes
                or nbytes < step.policies.min_swap_bytes):
            continue
        producer = sim.op_intervals.get(step.ir.tensors[name].producer)
        readers = [sim.op_intervals[c.name][0] for c in step.found.backward_of[name]
                   if c.name in sim.op_intervals]
        if producer is None or not readers or not producer[1] <= sim.peak_time_s < min(readers):
            continue  # in use at the peak: moving it would not lower this peak
        idle.append((swap_cost(step, name, link_busy) / nbytes, name, nbytes))
    if not idle:
        logger.debug("planner round: peak %d at %s, nothing idle to swap", sim.peak_bytes, sim.peak_op)
        return None
    grown, freed = set(swap), 0
    for _, name, nbytes in sorted(idle):
        grown.add(name)
        link_busy += step.cost.transfer_time(nbytes, "device_to_host")
        freed += nbytes
        if freed >= 1.05 * excess:
            break
    return grown, link_busy
