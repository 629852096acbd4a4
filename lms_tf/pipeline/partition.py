"""Pipeline partitioning by memory (mCAP / CAPSlog): contiguous stages that minimise the largest stage's peak.

A stage is a contiguous run of layers (in the profile's forward order) on one device. Its peak,
per the schedule:

    peak = weights * (2 + slots per weight byte)      weights, their accumulated gradients, slots
         + in_flight * kept activations               one copy per micro-batch in flight
         + the largest transient working set          one op at a time

With 1F1B, stage ``k`` of ``K`` (from 0) has ``min(K - k, M)`` micro-batches in flight (the first
stage runs ``K`` forwards before its first backward); with GPipe every stage holds all ``M``.
Weights shared by two layers and tensors kept by two layers of one stage count once; a skip
connection kept by a later layer's backward is counted in that layer's stage.

Every term only grows when a stage takes one more layer, and only shrinks when it gives one up at
either end, so "can the layers be cut into ``K`` stages each under its limit" is decided exactly by
a sweep over where each stage may end (:func:`_cut`), and the least limit is found by bisection on
it. Limits are a fraction ``tau`` of each stage's device memory, so mixed devices are balanced by
how full they are. Rules other than ``"memory"`` (DeepSpeed's ``"parameters"`` and ``"uniform"``)
cut by their own measure, and every partition is then judged by the same memory model.

When no cut fits every stage on its device (or under the budget), a stage that does not fit swaps
activations to the host, as lms-tf does on one device (``swap=True``, the default): at least
``weights * (2 + slots) + working set + SWAP_RESIDENT * the largest layer's kept activations``
stay on the device (the layer whose backward pass runs, and the next one being copied in), with
the kept tensors lms-tf's planner may not move (``LayerProfile.pinned``) for every micro-batch in
flight, and the stage swaps just the bytes over its limit. Those bytes are spread over the
micro-batches it holds; each micro-batch's share goes out and comes back over the device's link,
beside the compute, so the stage's time per micro-batch is at least that copy's. The cut is first
searched without swapping; only if none fits is it searched again by the least peaks, and only the
stages that do not fit as they are swap.

The predicted step time (1F1B and GPipe alike) is ``(M + K - 1)`` times the slowest stage's time
per micro-batch (forward, backward and receiving its inputs and sending their gradients back over
the device's link), plus the slowest stage's optimizer update: the bubble is the ``K - 1`` extra
slots.

Examples:
    >>> from lms_tf.pipeline.profile import PipelineProfile
    >>> profile = PipelineProfile.chain([400, 100, 100, 100, 100, 100])
    >>> p = partition_layers(profile, stages=2, microbatches=4)
    >>> [len(s.layers) for s in p.stages], p.max_stage_peak_bytes
    ([1, 5], 800)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from lms_tf.core.errors import LMSOptionError, host_budget_error, infeasible
from lms_tf.core.policy import describe, format_bytes, machine_memory_bytes, parse_bytes, parse_host_budget
from lms_tf.cost.devices import DeviceSpec, get_device_spec
from lms_tf.pipeline.profile import PipelineProfile

SCHEDULES = ("1f1b", "gpipe")
RULES = ("memory", "parameters", "uniform")
OBJECTIVES = ("memory", "time")
#: Bisection stops when the least limit is known to this relative precision (or exactly, when
#: the bracket closes first).
PRECISION = 1e-6
#: Layers' kept activations a swapping stage holds on its device at least: the layer whose
#: backward pass runs, and the next one being copied in (or the last forward's being copied out).
SWAP_RESIDENT = 2
#: Relative precision of the step time among the cuts with the least largest peak: the cost
#: model's own error is far larger, and each halving of it costs one more sweep.
TIME_PRECISION = 1e-4


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` (from 0) holds at once.

    Examples:
        >>> [in_flight("1f1b", k, 4, 8) for k in range(4)], in_flight("gpipe", 0, 4, 8)
        ([4, 3, 2, 1], 8)
    """
    return min(stages - stage, microbatches) if schedule == "1f1b" else microbatches


def received_ahead(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose input stage ``stage`` holds beyond those in flight: with 1F1B, the
    stage before runs its next forward pass while this stage runs a backward pass, so the next
    micro-batch's input has arrived before this stage starts it (1). With GPipe every
    micro-batch is in flight anyway, and the first stage's input is the step's own (0).

    Examples:
        >>> [received_ahead("1f1b", k, 3, 4) for k in range(3)], received_ahead("gpipe", 1, 3, 4)
        ([0, 1, 1], 0)
    """
    flight = in_flight(schedule, stage, stages, microbatches)
    return 1 if schedule == "1f1b" and stage > 0 and flight < microbatches else 0


class _Compiled:
    """A profile's layers as flat lists with weights and kept tensors numbered (the search's inner
    loop counts references in lists, not dicts keyed by name)."""

    def __init__(self, profile: PipelineProfile):
        self.profile = profile
        self.slots = profile.slot_bytes_per_param_byte
        param_ids: Dict[str, int] = {}
        kept_ids: Dict[str, int] = {}
        self.params = [tuple((param_ids.setdefault(name, len(param_ids)), b) for name, b in layer.params)
                       for layer in profile.layers]
        # (a tensor a layer lists twice is kept once)
        self.kept = [tuple((kept_ids.setdefault(name, len(kept_ids)), b) for name, b in dict(layer.saved).items())
                     for layer in profile.layers]
        pinned = {name for layer in profile.layers for name in layer.pinned}
        self.pinned = [tuple((kept_ids[name], b) for name, b in dict(layer.saved).items() if name in pinned)
                       for layer in profile.layers]
        self.work = [layer.work_bytes for layer in profile.layers]
        read_ids: Dict[str, int] = {}
        self.inputs = [tuple((read_ids.setdefault(name, len(read_ids)), b, producer) for name, b, producer in layer.inputs)
                       for layer in profile.layers]
        self.n_read = len(read_ids)
        # per read tensor: its producer, and its number among the kept tensors (-1: kept by no
        # layer); per kept tensor, its number among the read ones. A recomputing stage counts a
        # tensor it both receives and keeps once (recompute_peak).
        self.read_producer = [0] * self.n_read
        for layer_inputs in self.inputs:
            for k, _, producer in layer_inputs:
                self.read_producer[k] = producer
        self.read_kept = [kept_ids.get(name, -1) for name in read_ids]
        self.kept_read = [-1] * len(kept_ids)
        for k, kept_id in enumerate(self.read_kept):
            if kept_id >= 0:
                self.kept_read[kept_id] = k
        made: List[Dict[int, int]] = [{} for _ in profile.layers]
        for layer_inputs in self.inputs:
            for k, nbytes, producer in layer_inputs:
                if 0 <= producer < len(made):
                    made[producer][k] = nbytes
        self.made = [tuple(m.items()) for m in made]   # per layer: the tensors it makes that a later layer reads
        self.layer_kept = [sum(dict(layer.saved).values()) for layer in profile.layers]
        self.work_max, self.kept_max = _RangeMax(self.work), _RangeMax(self.layer_kept)
        self.seconds = [layer.forward_s + layer.backward_s for layer in profile.layers]
        self.n_params, self.n_kept = len(param_ids), len(kept_ids)
        self.layers = profile.layers
        self._mirrored: Optional[_Compiled] = None

    def mirrored(self) -> "_Compiled":
        """The layers in reverse order, receiving nothing: for packing from the last stage
        (:func:`_cut`), where what a stage receives is not counted."""
        if self._mirrored is None:
            layers = tuple(dataclasses.replace(layer, inputs=()) for layer in reversed(self.layers))
            self._mirrored = _Compiled(dataclasses.replace(self.profile, layers=layers))
        return self._mirrored


def _compiled(profile) -> _Compiled:
    """``profile`` compiled, once: the search and the judging of its cuts share one."""
    return profile if isinstance(profile, _Compiled) else _Compiled(profile)


class _RangeMax:
    """The largest of ``values[lo:hi]`` for any ``lo < hi`` in constant time (a sparse table:
    the maxima of every run of length 2**j)."""

    def __init__(self, values: Sequence[int]):
        self.levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            below = self.levels[-1]
            self.levels.append([a if a > b else b for a, b in zip(below, below[width:])])
            width *= 2

    def __call__(self, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        j = (hi - lo).bit_length() - 1
        level = self.levels[j]
        a, b = level[lo], level[hi - (1 << j)]
        return a if a > b else b


class _Blocked:
    """What stopped a sweep of :func:`_cut` at limits ``tau * capacities``: the least
    ``measure / capacity`` of a stage that could not take one more layer because of its measure
    alone. Every ``tau`` below it makes the same decisions, so when the sweep found no cut, no
    cut has its fullest stage below it either (and it is a figure a stage really has).

    Examples:
        >>> blocked = _Blocked([100.0, 200.0])
        >>> blocked.note(0, 150); blocked.note(1, 250); blocked.least
        1.25
    """

    def __init__(self, capacities: Sequence[float]):
        self.capacities = capacities
        self.least = float("inf")

    def note(self, stage: int, measured: float) -> None:
        fraction = measured / self.capacities[stage]   # as _worst() computes it
        if fraction < self.least:
            self.least = fraction


class _Window:
    """The layers ``[lo, hi)`` as one stage: its weights, kept tensors, working set, compute
    time and what it receives, updated as layers join or leave at either end (shared weights,
    shared kept tensors and received tensors counted once by reference counts; the largest
    working set kept as layers join, and taken again from a range maximum when the layer holding
    it leaves). :meth:`grown` tells what the stage would be with layer ``hi`` added.

    Figures (:meth:`now`, :meth:`grown`) are a tuple: weights, kept activations, working set,
    seconds, the largest layer's kept bytes, bytes received per micro-batch, kept bytes the
    planner may not move, and kept bytes that are also received (what a recomputing stage holds
    once, :func:`recompute_peak`)."""

    def __init__(self, profile, at: int = 0):
        self.c = _compiled(profile)
        self.slots = self.c.slots
        self.lo = self.hi = at
        self.params = [0] * self.c.n_params
        self.kept = [0] * self.c.n_kept
        self.param_bytes = self.kept_bytes = 0
        self.pinned_bytes = 0   # of the kept bytes, those the planner may not move (LayerProfile.pinned)
        self.reads = [0] * self.c.n_read   # layers of the stage reading each tensor
        self.received_bytes = 0   # of those, the tensors made before the stage
        self.again_bytes = 0   # of the received bytes, those a layer of the stage also keeps
        self.work = self.largest = 0   # the largest working set, the largest layer's kept bytes
        self.seconds = 0.0

    @classmethod
    def over(cls, profile, lo: int, hi: int) -> "_Window":
        """The stage of layers ``[lo, hi)``."""
        window = cls(profile, lo)
        for _ in range(lo, hi):
            window.push()
        return window

    def now(self) -> Tuple[int, int, int, float, int, int, int, int]:
        """The stage's figures as it is (see the class docstring)."""
        return (self.param_bytes, self.kept_bytes, self.work, self.seconds, self.largest, self.received_bytes,
                self.pinned_bytes, self.again_bytes)

    def _received(self, read: int) -> bool:
        """Whether the stage receives read tensor ``read`` (a layer of it reads it, made before it)."""
        return self.reads[read] > 0 and self.c.read_producer[read] < self.lo

    def grown(self) -> Tuple[int, int, int, float, int, int, int, int]:
        """:meth:`now` with layer ``hi`` added."""
        c, i = self.c, self.hi
        params, counts = self.param_bytes, self.params
        for k, nbytes in c.params[i]:   # (loops, not sum(): this is the search's innermost call)
            if not counts[k]:
                params += nbytes
        kept, again, counts, kept_read = self.kept_bytes, self.again_bytes, self.kept, c.kept_read
        for k, nbytes in c.kept[i]:
            if not counts[k]:
                kept += nbytes
                if kept_read[k] >= 0 and self._received(kept_read[k]):
                    again += nbytes
        pinned = self.pinned_bytes
        for k, nbytes in c.pinned[i]:
            if not counts[k]:
                pinned += nbytes
        received, reads, lo, read_kept = self.received_bytes, self.reads, self.lo, c.read_kept
        for k, nbytes, producer in c.inputs[i]:
            if producer < lo and not reads[k]:
                received += nbytes
                kept_id = read_kept[k]
                # kept already, or by the layer joining (counted here, not above: not received yet there)
                if kept_id >= 0 and (counts[kept_id] or any(kept_id == j for j, _ in c.kept[i])):
                    again += nbytes
        work, largest = c.work[i], c.layer_kept[i]
        return (params, kept, self.work if self.work > work else work, self.seconds + c.seconds[i],
                self.largest if self.largest > largest else largest, received, pinned, again)

    # push, pop and pop_right are plain loops over flat tuples: the search calls them millions of
    # times on 1,000 layers.
    def push(self) -> None:
        """Layer ``hi`` joins at the right."""
        c, i = self.c, self.hi
        counts = self.params
        for k, nbytes in c.params[i]:
            if not counts[k]:
                self.param_bytes += nbytes
            counts[k] += 1
        counts = self.kept
        for k, nbytes in c.pinned[i]:   # (before the kept counts below: counted when first kept)
            if not counts[k]:
                self.pinned_bytes += nbytes
        kept_read = c.kept_read
        for k, nbytes in c.kept[i]:
            if not counts[k]:
                self.kept_bytes += nbytes
                if kept_read[k] >= 0 and self._received(kept_read[k]):
                    self.again_bytes += nbytes
            counts[k] += 1
        reads, lo, read_kept = self.reads, self.lo, c.read_kept
        for k, nbytes, producer in c.inputs[i]:
            if not reads[k] and producer < lo:
                self.received_bytes += nbytes
                if read_kept[k] >= 0 and counts[read_kept[k]]:
                    self.again_bytes += nbytes
            reads[k] += 1
        if c.work[i] > self.work:
            self.work = c.work[i]
        if c.layer_kept[i] > self.largest:
            self.largest = c.layer_kept[i]
        self.seconds += c.seconds[i]
        self.hi = i + 1

    def _remove(self, i: int) -> None:
        """Layer ``i``'s weights, kept tensors and time out of the counts (either end)."""
        c = self.c
        counts = self.params
        for k, nbytes in c.params[i]:
            counts[k] -= 1
            if not counts[k]:
                self.param_bytes -= nbytes
        counts, kept_read = self.kept, c.kept_read
        for k, nbytes in c.kept[i]:
            counts[k] -= 1
            if not counts[k]:
                self.kept_bytes -= nbytes
                if kept_read[k] >= 0 and self._received(kept_read[k]):   # (reads not yet taken off)
                    self.again_bytes -= nbytes
        for k, nbytes in c.pinned[i]:   # (after the kept counts above: counted while still kept)
            if not counts[k]:
                self.pinned_bytes -= nbytes
        self.seconds -= c.seconds[i]

    def pop_right(self) -> None:
        """Layer ``hi - 1`` leaves at the right."""
        c = self.c
        self.hi -= 1
        i, lo = self.hi, self.lo
        self._remove(i)
        self._unread(i)
        self.work, self.largest = c.work_max(lo, i), c.kept_max(lo, i)

    def _unread(self, i: int) -> None:
        """Layer ``i``'s reads out of the counts, after :meth:`_remove` (before ``lo`` moves)."""
        c, reads, lo, counts = self.c, self.reads, self.lo, self.kept
        for k, nbytes, producer in c.inputs[i]:
            reads[k] -= 1
            if not reads[k] and producer < lo:
                self.received_bytes -= nbytes
                if c.read_kept[k] >= 0 and counts[c.read_kept[k]]:
                    self.again_bytes -= nbytes

    def pop(self) -> None:
        """Layer ``lo`` leaves at the left: what it made for the stage now arrives from outside."""
        c = self.c
        i, reads = self.lo, self.reads
        self._remove(i)
        self._unread(i)
        counts = self.kept
        for k, nbytes in c.made[i]:
            if reads[k]:
                self.received_bytes += nbytes
                if c.read_kept[k] >= 0 and counts[c.read_kept[k]]:
                    self.again_bytes += nbytes
        self.lo = i + 1
        if c.work[i] == self.work:
            self.work = c.work_max(i + 1, self.hi)
        if c.layer_kept[i] == self.largest:
            self.largest = c.kept_max(i + 1, self.hi)

    def peak(self, flight: int, figures: Optional[Tuple[int, int, int, float, int, int, int, int]] = None,
             ahead: int = 0) -> int:
        """The stage's predicted peak with ``flight`` micro-batches in flight and the input of
        ``ahead`` more received (see :func:`received_ahead`); ``figures``: from :meth:`grown`
        instead of the stage as it is."""
        params, kept, work, _, _, received, _, _ = figures or self.now()
        return int(params * (2 + self.slots)) + flight * kept + ahead * received + work

    def least_peak(self, flight: int, figures: Optional[Tuple[int, int, int, float, int, int, int, int]] = None,
                   ahead: int = 0) -> int:
        """The least peak the stage reaches by swapping activations (:data:`SWAP_RESIDENT` layers'
        kept activations stay, and every micro-batch's pinned ones), or its peak when that is less."""
        params, kept, work, _, largest, received, pinned, _ = figures or self.now()
        return (int(params * (2 + self.slots)) + min(flight * kept, flight * pinned + SWAP_RESIDENT * largest)
                + ahead * received + work)

    def recompute_peak(self, flight: int, figures: Optional[Tuple[int, int, int, float, int, int, int, int]] = None,
                       ahead: int = 0) -> int:
        """The stage's peak when it keeps only what it receives and runs its forward pass again
        (see :func:`recompute_peak`): a tensor it both receives and keeps counted once."""
        params, kept, work, _, _, received, _, again = figures or self.now()
        return int(params * (2 + self.slots)) + (flight + ahead) * received + kept - again + work

    def lowest_peak(self, flight: int, figures: Optional[Tuple[int, int, int, float, int, int, int, int]] = None,
                    ahead: int = 0, swap: bool = False) -> int:
        """The lowest of the stage's peak keeping everything, recomputing and (with ``swap``) swapping."""
        figures = figures or self.now()
        lowest = min(self.peak(flight, figures, ahead), self.recompute_peak(flight, figures, ahead))
        return min(lowest, self.least_peak(flight, figures, ahead)) if swap else lowest


def stage_peak(profile: PipelineProfile, lo: int, hi: int, flight: int, swap: bool = False, ahead: int = 0) -> int:
    """The predicted peak of layers ``[lo, hi)`` as one stage with ``flight`` micro-batches in
    flight and the input of ``ahead`` more received (:func:`received_ahead`); with ``swap``, the
    least it reaches by swapping activations to the host.

    Examples:
        >>> from lms_tf.pipeline.profile import PipelineProfile
        >>> stage_peak(PipelineProfile.chain([100, 200], [10, 20]), 0, 2, 3)   # 2*30 + 3*300
        960
        >>> stage_peak(PipelineProfile.chain([100, 200], [10, 20]), 0, 2, 3, swap=True)   # 2*30 + 2*200
        460
    """
    window = _Window.over(profile, lo, hi)
    return window.least_peak(flight, ahead=ahead) if swap else window.peak(flight, ahead=ahead)


def recompute_peak(profile: PipelineProfile, lo: int, hi: int, flight: int, window: Optional["_Window"] = None,
                   ahead: int = 0) -> int:
    """The predicted peak of layers ``[lo, hi)`` as one stage that keeps only what it receives
    for each of its ``flight`` micro-batches and runs its forward pass again at the start of each
    backward task (GPipe's re-materialization, ``PipelineStep(recompute=)``): its weights,
    gradients and slots, the received tensors of every micro-batch in flight (and of ``ahead``
    more, :func:`received_ahead`), one micro-batch's
    kept activations (those of the backward pass running; a received tensor it keeps counted
    once) and the largest working set.

    Examples:
        >>> from lms_tf.pipeline.profile import PipelineProfile
        >>> chain = PipelineProfile.chain([100, 200, 300], [10, 20, 30])
        >>> stage_peak(chain, 1, 3, 4), recompute_peak(chain, 1, 3, 4)   # 2*50 + 4*500; 2*50 + 4*200 + 300
        (2100, 1200)
    """
    return (window or _Window.over(profile, lo, hi)).recompute_peak(flight, ahead=ahead)


def _received(profile: PipelineProfile, lo: int, hi: int) -> Dict[str, int]:
    """The tensors layers ``[lo, hi)`` read from earlier layers, by name: what the stage receives
    per micro-batch (a skip connection crossing the cut included)."""
    return {t: b for layer in profile.layers[lo:hi] for t, b, producer in layer.inputs if producer < lo}


def _measure(rule: str, swap: bool = False, recompute: bool = False):
    """What a rule balances, from a stage's figures (see :meth:`_Window.now`) and its flight;
    with ``recompute``, the memory rule takes each stage at the lowest way it has
    (:meth:`_Window.lowest_peak`)."""
    if rule == "parameters":
        return lambda window, figures, flight, ahead: figures[0]
    if rule == "time":
        return lambda window, figures, flight, ahead: figures[3]
    if recompute:
        return lambda window, figures, flight, ahead: window.lowest_peak(flight, figures, ahead, swap)
    if swap:
        return lambda window, figures, flight, ahead: window.least_peak(flight, figures, ahead)
    return lambda window, figures, flight, ahead: window.peak(flight, figures, ahead)


def _fitting(limits: Sequence[float], flights: Sequence[int], measure, memory_limits: Optional[Sequence[float]],
             swap: bool, kept_limits: Optional[Sequence[float]], blocked: Optional["_Blocked"]):
    """The test :func:`_cut` applies to stage ``k`` with figures ``figures`` (see
    :meth:`_Window.grown`) and ``ahead`` micro-batches' input received ahead: its measure within
    ``limits[k]``, its peak within ``memory_limits[k]``, its peak keeping everything within
    ``kept_limits[k]``. A stage stopped by its measure alone is noted in ``blocked``."""
    def fits(window: _Window, figures, k: int, ahead: int) -> bool:
        flight = flights[k]
        measured = measure(window, figures, flight, ahead)
        over = measured > limits[k]
        if over and blocked is None:
            return False
        peak = window.least_peak if swap else window.peak
        if (memory_limits is not None and peak(flight, figures, ahead) > memory_limits[k]) or (
                kept_limits is not None and window.peak(flight, figures, ahead) > kept_limits[k]):
            return False
        if over:
            blocked.note(k, measured)
            return False
        return True
    return fits


def _packed(profile: _Compiled, stages: int, fits, aheads: Sequence[int]) -> Optional[List[int]]:
    """Greedy packing: each stage, from where the one before ended, takes layers while ``fits``
    (with the micro-batches received ahead ``aheads``), leaving one layer for each later stage.
    The stage ends, or None when the last stage cannot take the rest. One pass over the layers."""
    n, lo, cuts = len(profile.layers), 0, []
    for k in range(stages):
        last_end = n - (stages - 1 - k)
        window = _Window(profile, lo)
        while window.hi < last_end and fits(window, window.grown(), k, aheads[k]):
            window.push()
        if window.hi == lo:
            return None
        cuts.append(window.hi)
        lo = window.hi
    return cuts if cuts[-1] == n else None


def _packed_from_the_end(profile: _Compiled, stages: int, fits) -> Optional[List[int]]:
    """:func:`_packed` from the last stage back (on the mirrored layers), with nothing received
    ahead counted: the stage ends, or None."""
    mirrored = _packed(profile.mirrored(), stages, lambda window, figures, r, ahead: fits(
        window, figures, stages - 1 - r, 0), [0] * stages)
    if mirrored is None:
        return None
    n = len(profile.layers)
    return [n - mirrored[stages - 2 - k] for k in range(stages - 1)] + [n]


def _looser_later(flights: Sequence[int], *limit_lists: Optional[Sequence[float]]) -> bool:
    """Whether every stage's test is at least as loose as the stage before's, for any layers: no
    more micro-batches in flight, and no lower limit (1F1B on equal devices, or on devices that
    grow along the pipeline)."""
    pairs = list(zip(range(len(flights) - 1), range(1, len(flights))))
    return all(flights[a] >= flights[b] for a, b in pairs) and all(
        limits is None or all(limits[a] <= limits[b] for a, b in pairs) for limits in limit_lists)


def _cut(profile, limits: Sequence[float], flights: Sequence[int], measure,
         memory_limits: Optional[Sequence[float]] = None, swap: bool = False,
         kept_limits: Optional[Sequence[float]] = None, aheads: Optional[Sequence[int]] = None,
         blocked: Optional["_Blocked"] = None, receiving: bool = False) -> Optional[List[int]]:
    """Stage ends (exclusive) cutting the layers into ``len(limits)`` non-empty stages with stage
    ``k``'s measure at most ``limits[k]`` (and its peak at most ``memory_limits[k]``, and its peak
    keeping everything at most ``kept_limits[k]``: what a swapping stage puts on the host is what
    that peak has over its device), or None. ``blocked`` notes each stage that could not take one
    more layer because of its measure alone (see :class:`_Blocked`).

    Exact. Greedy passes (one pass over the layers each) settle most limits first: packing that
    reaches the end is a cut. A stage's figures do not grow as layers leave it, except what it
    receives ahead (:func:`received_ahead`: without its first layer, that layer's output arrives
    from outside). So when each stage's test is at least as loose as the one before's
    (:func:`_looser_later`), packing from the last stage back with nothing received ahead counted
    (a looser test) decides whether any cut exists under that test: each stage reaching back as
    far as it can leaves the earlier, tighter stages the least, and a layer left to a stage fitted
    a tighter one alone. When that fails there is no cut, and ``blocked`` holds figures at most the
    real ones (every lower limit fails alike); when it succeeds and its stages pass the full test,
    it is a cut. The rest is swept (:func:`_swept`): the positions where stage ``k`` can end form
    a set computed from the set where stage ``k - 1`` can end. From a start ``s``, a stage can end
    anywhere in ``(s, e(s)]`` (a stage that fits still fits without its last layer). Mostly ``e``
    does not decrease as ``s`` grows, so one sweep with a window sliding right finds every
    ``e(s)``; where what the stage receives ahead grew as its first layer left, the window gives
    back layers at the right until it fits.

    With ``receiving`` (a measure that counts what a stage receives for every micro-batch in
    flight: a recomputing stage, :meth:`_Window.lowest_peak`) the packing from the end does not
    apply: it counts nothing received. The sweep still does: a window that no longer fits once its
    first layer left (it receives that layer's outputs) cannot take a layer more, and every end
    up to its own was reached from an earlier start already.
    """
    stages = len(limits)
    profile = _compiled(profile)
    aheads = aheads or [0] * stages
    fits = _fitting(limits, flights, measure, memory_limits, swap, kept_limits, blocked)
    if not receiving and _looser_later(flights, limits, memory_limits, kept_limits):
        cuts = _packed_from_the_end(profile, stages, fits)
        if cuts is None or not any(aheads):
            return cuts
        if all(fits(window, window.now(), k, aheads[k]) for k, window in enumerate(
                _Window.over(profile, lo, hi) for lo, hi in zip([0] + cuts[:-1], cuts))):
            return cuts
    return _packed(profile, stages, fits, aheads) or _swept(profile, stages, fits, aheads)


def _swept(profile: _Compiled, stages: int, fits, aheads: Sequence[int]) -> Optional[List[int]]:
    """:func:`_cut`'s sweep over every position each stage can start at: the stage ends, or None."""
    n = len(profile.layers)
    starts = [0]
    came_from: List[Dict[int, int]] = []
    for k in range(stages):
        last_end = n - (stages - 1 - k)  # leave one layer for each later stage
        ends: Dict[int, int] = {}
        window = _Window(profile, starts[0])
        covered = starts[0]
        ahead = aheads[k]
        for s in starts:
            if window.hi <= s:
                window = _Window(profile, s)
            received = window.received_bytes
            while window.lo < s:
                window.pop()
            # The window fitted; without its first layers only what it receives can have grown.
            while ahead and window.received_bytes > received and window.hi > s and not fits(window, window.now(), k,
                                                                                               ahead):
                window.pop_right()
            while window.hi < last_end:
                if not fits(window, window.grown(), k, ahead):
                    break
                window.push()
            for end in range(max(covered, s) + 1, window.hi + 1):
                ends[end] = s
            covered = max(covered, window.hi)
        if not ends:
            return None
        came_from.append(ends)
        starts = sorted(ends)
    if n not in came_from[-1]:
        return None
    cuts, end = [], n
    for k in range(stages - 1, -1, -1):
        cuts.append(end)
        end = came_from[k][end]
    return cuts[::-1]


def _recompute_cut(profile: PipelineProfile, capacities: Sequence[float], flights: Sequence[int], swap: bool,
                   bound: float, aheads: Optional[Sequence[int]] = None,
                   start: Optional[List[int]] = None) -> Tuple[float, Optional[List[int]]]:
    """The cut into ``len(capacities)`` stages whose fullest stage, each at the lowest of keeping,
    swapping (with ``swap``) and recomputing, is least full: (that fraction, stage ends), or
    ``(bound, None)`` when no cut is below ``bound``. ``start``: a cut to start the bisection's
    bracket from (its fullest stage at most ``bound``).

    The bisection of :func:`_least_limit` with each stage measured at its lowest way
    (:meth:`_Window.lowest_peak`), to the same :data:`PRECISION`. Every way's peak only grows
    as the stage takes one more layer at its end, which is all the sweep of :func:`_cut` needs to
    find a cut under a limit whenever one exists; what a recomputing stage receives can grow as it
    starts later, which rules out only the packing from the last stage back (``receiving``). A
    sweep is one pass over the layers per stage, where a dynamic programme over (stage, start,
    end) grows every stage from every start.
    """
    compiled = _compiled(profile)
    stages = len(capacities)
    aheads = aheads or [0] * stages
    measure = _measure("memory", swap, recompute=True)
    # Every way holds at least a stage's weights, its kept tensors the planner may not move
    # (a recomputing stage holds one micro-batch's kept tensors) and its working set: the
    # swapping floor bounds them all.
    cuts = _least_limit(compiled, capacities, flights, measure, aheads=aheads, start=start,
                        lo=_memory_floor(compiled, capacities, True), receiving=True)
    found = _worst(compiled, cuts, capacities, flights, measure, aheads) if cuts else float("inf")
    return (found, cuts) if found <= bound else (bound, None)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage of a :class:`Partition`.

    Attributes:
        index: Position in the pipeline, from 0.
        layers: The layers it runs, in order.
        device: The device preset it is planned for (None: no device given).
        capacity_bytes: That device's memory (None: no device given).
        predicted_peak_bytes: Its predicted peak (weights, gradients, slots, activations in flight,
            the inputs it holds ahead, working set).
        param_bytes: Its weights.
        activation_bytes: What it keeps per micro-batch.
        in_flight: Micro-batches it holds at once.
        seconds_per_microbatch: Forward + backward compute, plus receiving its inputs and sending
            their gradients back.
        received_bytes: Activations it receives per micro-batch (skip connections included).
        host_bytes: Activations it swaps to the host to fit (0: it does not swap): what they take
            in host memory at the stage's peak.
        swapped_bytes_per_microbatch: Each micro-batch's share of them, copied out and back.
        recompute: Whether it keeps only what it receives and runs its forward pass again in each
            backward task to fit (``PipelineStep(recompute=True)`` runs it so).
        received_ahead: Micro-batches whose input it holds beyond those in flight (1F1B: the
            next one's, sent while it runs a backward pass; see :func:`received_ahead`).

    Examples:
        >>> Stage(0, ("a",), None, None, 10, 0, 10, 1, 0.1, 0).fits
        True
    """

    index: int
    layers: Tuple[str, ...]
    device: Optional[str]
    capacity_bytes: Optional[int]
    predicted_peak_bytes: int
    param_bytes: int
    activation_bytes: int
    in_flight: int
    seconds_per_microbatch: float
    received_bytes: int
    host_bytes: int = 0
    swapped_bytes_per_microbatch: int = 0
    recompute: bool = False
    received_ahead: int = 0

    @property
    def in_flight_text(self) -> str:
        """Micro-batches in flight as a table shows them: ``"1 (+1 in)"`` when the next one's input
        is held too.

        Examples:
            >>> Stage(1, ("a",), None, None, 10, 0, 10, 1, 0.1, 0, received_ahead=1).in_flight_text
            '1 (+1 in)'
        """
        return f"{self.in_flight} (+{self.received_ahead} in)" if self.received_ahead else str(self.in_flight)

    @property
    def fits(self) -> bool:
        """Whether the predicted peak fits the device (True when no device was given).

        Examples:
            >>> Stage(0, ("a",), "v100", 8, 10, 0, 10, 1, 0.1, 0).fits
            False
        """
        return self.capacity_bytes is None or self.predicted_peak_bytes <= self.capacity_bytes


@dataclasses.dataclass(frozen=True)
class Partition:
    """Where a model is cut into pipeline stages, and what each stage is predicted to hold.

    A printable, saveable value: ``print(p)`` or ``p.summary()`` for a table, :meth:`to_dict` /
    :meth:`to_json` for the fields the CLI's ``--json`` prints.
    ``calibration``, from ``lms_tf.partition(calibrate=True)``, is the real allocator's figures
    every stage was counted with (:class:`~lms_tf.pipeline.calibration.Calibration`).

    Examples:
        >>> from lms_tf.pipeline.profile import PipelineProfile
        >>> p = partition_layers(PipelineProfile.chain([100] * 4), stages=2, microbatches=2)
        >>> p.to_dict()["max_stage_peak_bytes"], p.feasible   # [layer0] 2 x 100 | [layer1..3] 300 + 100 ahead
        (400, True)
    """

    stages: Tuple[Stage, ...]
    schedule: str
    microbatches: int
    rule: str
    objective: str
    ideal_peak_bytes: int
    predicted_step_time_s: float
    budget_bytes: Optional[int] = None
    model: str = ""
    swap: bool = True
    host_budget_bytes: Optional[int] = None
    recompute: bool = False
    calibration: Optional[Any] = None   # a lms_tf.pipeline.calibration.Calibration (that module imports this one)

    @property
    def bounds(self) -> List[Tuple[int, int]]:
        """Each stage's layers as a range ``(lo, hi)`` of the profile's layer order (``hi`` exclusive).

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> partition_layers(PipelineProfile.chain([100] * 4), stages=2, microbatches=2).bounds
            [(0, 2), (2, 4)]
        """
        ends = list(itertools.accumulate(len(s.layers) for s in self.stages))
        return list(zip([0] + ends[:-1], ends))

    @property
    def max_stage_peak_bytes(self) -> int:
        """The largest stage's predicted peak.

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> partition_layers(PipelineProfile.chain([100] * 2), stages=2, microbatches=1).max_stage_peak_bytes
            100
        """
        return max(s.predicted_peak_bytes for s in self.stages)

    @property
    def feasible(self) -> bool:
        """Every stage fits its device and the budget.

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> partition_layers(PipelineProfile.chain([100] * 2), stages=2, microbatches=1).feasible
            True
        """
        return self._fits_devices() and all(self.host_budget_bytes is None or s.host_bytes <= self.host_budget_bytes
                                            for s in self.stages)

    def _fits_devices(self) -> bool:
        return all(s.fits and (self.budget_bytes is None or s.predicted_peak_bytes <= self.budget_bytes)
                   for s in self.stages)

    def to_dict(self) -> Dict[str, Any]:
        """The partition as plain data (what ``lms-tf partition --json`` prints).

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> d = partition_layers(PipelineProfile.chain([100] * 2), stages=2, microbatches=1).to_dict()
            >>> sorted(d["stages"][0])[:5]
            ['activation_bytes', 'capacity_bytes', 'device', 'host_bytes', 'in_flight']
        """
        return {"model": self.model, "schedule": self.schedule, "microbatches": self.microbatches, "rule": self.rule,
                "objective": self.objective, "stages": [dataclasses.asdict(s) | {"layers": list(s.layers)}
                                                        for s in self.stages],
                "ideal_peak_bytes": self.ideal_peak_bytes, "max_stage_peak_bytes": self.max_stage_peak_bytes,
                "predicted_step_time_s": self.predicted_step_time_s, "budget_bytes": self.budget_bytes,
                "swap": self.swap, "recompute": self.recompute, "host_bytes": sum(s.host_bytes for s in self.stages),
                "host_budget_bytes": self.host_budget_bytes, "feasible": self.feasible,
                "calibration": self.calibration.to_dict() if self.calibration is not None else None}

    def to_json(self, **kwargs) -> str:
        """:meth:`to_dict` as JSON text.

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> '"feasible": true' in partition_layers(PipelineProfile.chain([1] * 2), stages=2, microbatches=1).to_json()
            True
        """
        return json.dumps(self.to_dict(), **kwargs)

    def summary(self, width: int = 48) -> str:
        """A table: one row per stage (layers, device, predicted peak against its memory, time).

        Examples:
            >>> from lms_tf.pipeline.profile import PipelineProfile
            >>> print(partition_layers(PipelineProfile.chain([2**20] * 4), stages=2, microbatches=2).summary())
            ... # doctest: +NORMALIZE_WHITESPACE
            lms-tf partition: 2 stages, 1f1b, 2 micro-batches, rule memory, objective memory: fits
            largest stage 4.0 MiB, 2.00x the ideal 2.0 MiB (one copy of the whole step / 2); predicted step 0.018 s
            stage  layers                                            device  peak       of device  in flight  s/micro-batch
            0      layer0 .. layer1 (2)                              -       4.0 MiB    -          2          0.0060
            1      layer2 .. layer3 (2)                              -       3.0 MiB    -          1 (+1 in)  0.0060
        """
        ratio = self.max_stage_peak_bytes / self.ideal_peak_bytes if self.ideal_peak_bytes else float("nan")
        over_host = [s.index for s in self.stages
                     if self.host_budget_bytes is not None and s.host_bytes > self.host_budget_bytes]
        if self.feasible:
            verdict = "fits"
        elif over_host and self._fits_devices():
            verdict = (f"does NOT fit: stage {', '.join(map(str, over_host))} would swap more than the host budget "
                       f"{format_bytes(self.host_budget_bytes)}")
        else:
            verdict = "does NOT fit " + (
                f"the budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else "its devices")
        head = (f"lms-tf partition{' of ' + self.model if self.model else ''}: {len(self.stages)} stages, "
                f"{self.schedule}, {self.microbatches} micro-batches, rule {self.rule}, objective {self.objective}: "
                f"{verdict}\nlargest stage {format_bytes(self.max_stage_peak_bytes)}, {ratio:.2f}x the ideal "
                f"{format_bytes(self.ideal_peak_bytes)} (one copy of the whole step / {len(self.stages)}); "
                f"predicted step {self.predicted_step_time_s:.4g} s"
                + (f"\n{self.calibration.describe()}" if self.calibration is not None else ""))
        dev = max([len("device")] + [len(s.device or "-") for s in self.stages]) + 2
        swapping = any(s.host_bytes for s in self.stages)
        recomputing = any(s.recompute for s in self.stages)
        rows = [f"{'stage':<7}{'layers':<{width + 2}}{'device':<{dev}}{'peak':<11}{'of device':<11}{'in flight':<11}"
                + ("swapped to host  " if swapping else "") + ("recomputes  " if recomputing else "")
                + "s/micro-batch"]
        for s in self.stages:
            names = f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})" if len(s.layers) > 1 else s.layers[0]
            if len(names) > width:
                names = names[: width // 2 - 1] + "…" + names[-(width - width // 2):]
            share = f"{s.predicted_peak_bytes / s.capacity_bytes:.0%}" if s.capacity_bytes else "-"
            rows.append(f"{s.index:<7}{names:<{width + 2}}{s.device or '-':<{dev}}{format_bytes(s.predicted_peak_bytes):<11}"
                        f"{share:<11}{s.in_flight_text:<11}"
                        + (f"{format_bytes(s.host_bytes) if s.host_bytes else '-':<17}" if swapping else "")
                        + (f"{'yes' if s.recompute else '-':<12}" if recomputing else "")
                        + f"{s.seconds_per_microbatch:.4f}")
        return "\n".join([head] + rows)

    def __str__(self) -> str:
        return self.summary()


def _fullest(partition: Partition) -> float:
    """The largest stage's peak over its limit (its device, the budget), or its bytes with neither."""
    return max(s.predicted_peak_bytes / min([c for c in (s.capacity_bytes, partition.budget_bytes) if c] or [1])
               for s in partition.stages)


def _devices(devices, stages: int) -> List[Optional[DeviceSpec]]:
    if devices is None:
        return [None] * stages
    if isinstance(devices, (str, DeviceSpec)):
        devices = [devices] * stages
    devices = list(devices)
    if len(devices) != stages:
        raise LMSOptionError(f"devices: one preset per stage is needed ({stages} stages); received {len(devices)} "
                             f"({', '.join(map(str, devices))}). Pass one preset for all stages or a list of {stages}.")
    return [d if isinstance(d, DeviceSpec) else get_device_spec(d) for d in devices]


def check_arguments(*, stages, microbatches, schedule="1f1b", rule="memory", objective="memory", devices=None,
                    budget=None, layers: Optional[int] = None, swap=True, host_budget=None) -> Optional[int]:
    """Checks partitioning arguments before any slow work; returns the budget in bytes (None: no budget).

    Raises:
        LMSOptionError: What is wrong, what was received and what would do.

    Examples:
        >>> check_arguments(stages=2, microbatches=4, budget="1KiB")
        1024
        >>> check_arguments(stages=3, microbatches=4, layers=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: stages=3 is more than the model's 2 layers: ...
    """
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise LMSOptionError(f"stages must be a positive int; received {describe(stages)}.")
    if layers is not None and stages > layers:
        raise LMSOptionError(f"stages={stages} is more than the model's {layers} layers: each stage needs at least one "
                             f"layer. Use stages <= {layers}.")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise LMSOptionError(f"microbatches must be a positive int; received {describe(microbatches)}.")
    for name, value, allowed in (("schedule", schedule, SCHEDULES), ("rule", rule, RULES),
                                 ("objective", objective, OBJECTIVES)):
        if value not in allowed:
            raise LMSOptionError(f"{name} must be one of {', '.join(map(repr, allowed))}; received {describe(value)}.")
    if not isinstance(swap, bool):
        raise LMSOptionError(f"swap must be True (a stage that does not fit may swap activations to the host) or "
                             f"False; received {describe(swap)}.")
    parse_host_budget(host_budget)
    _devices(devices, stages)
    if budget is None:
        return None
    budget_bytes = parse_bytes(budget)
    if budget_bytes is None:
        raise LMSOptionError(f"budget must be a positive byte count such as 12884901888 or '12GiB'; received "
                             f"{describe(budget)}.")
    return budget_bytes


def _uniform_cuts(n: int, stages: int) -> List[int]:
    """DeepSpeed's ``uniform``: as equal layer counts as possible."""
    return [round((k + 1) * n / stages) for k in range(stages)]


def _worst(profile, cuts: Sequence[int], capacities: Sequence[float], flights: Sequence[int],
           measure, aheads: Optional[Sequence[int]] = None) -> float:
    """The largest ``measure / capacity`` over the stages ending at ``cuts``."""
    worst, lo = 0.0, 0
    aheads = aheads or [0] * len(cuts)
    for k, hi in enumerate(cuts):
        window = _Window.over(profile, lo, hi)
        worst = max(worst, measure(window, window.now(), flights[k], aheads[k]) / capacities[k])
        lo = hi
    return worst


def _memory_floor(profile: _Compiled, capacities: Sequence[float], swap: bool) -> float:
    """A lower bound on the fullest stage's ``peak / capacity`` of any cut (``least_peak`` with
    ``swap``). Every weight is in at least one stage, and so is every kept tensor (with ``swap``,
    only those the planner may not move stay), the largest working set is in one, and the fullest
    stage is at least as full as all of them together on all the devices. Lowered by a byte a
    stage, for the rounding of each stage's weights to whole bytes.

    Examples:
        >>> from lms_tf.pipeline.profile import PipelineProfile
        >>> chain = _compiled(PipelineProfile.chain([100, 200], [10, 20]))   # (2*30 + 300 - 2) / 2000
        >>> [round(_memory_floor(chain, [1000.0, 1000.0], swap=swap), 6) for swap in (False, True)]
        [0.179, 0.029]
    """
    whole = _Window.over(profile, 0, len(profile.layers))
    held = whole.param_bytes * (2 + whole.slots) + (whole.pinned_bytes if swap else whole.kept_bytes) + whole.work
    return max(0.0, (held - len(capacities)) / sum(capacities) * (1 - 1e-9))


def _least_limit(profile: PipelineProfile, capacities: Sequence[float], flights: Sequence[int], measure,
                 memory_limits: Optional[Sequence[float]] = None,
                 swap: bool = False, kept_limits: Optional[Sequence[float]] = None,
                 aheads: Optional[Sequence[int]] = None, start: Optional[List[int]] = None, lo: float = 0.0,
                 precision: float = PRECISION, receiving: bool = False) -> Optional[List[int]]:
    """The cut with the least ``tau`` such that stage ``k``'s measure is at most ``tau * capacities[k]``
    (bisection on ``tau``; each cut found lowers the bracket to its own worst stage, and each try
    that finds none raises it to the least stage figure that stopped it, so the bracket closes on
    figures stages really have). None when the memory limits (or the kept limits, see
    :func:`_cut`) refuse every cut. ``start``: a cut known to meet the limits, to start the
    bracket from; ``lo``: a known lower bound on ``tau``."""
    n, stages = len(profile.layers), len(capacities)
    profile = _compiled(profile)
    aheads = aheads or [0] * stages
    best = start
    if best is None:
        # The uniform cut's fullest stage bounds the least limit, and is usually within a factor of
        # two of it (a sweep at that limit is cheap: its stages are short). Raised by a hair:
        # measure / capacity * capacity may round one ulp below measure.
        uniform = _worst(profile, _uniform_cuts(n, stages), capacities, flights, measure, aheads) * (1 + 1e-9)
        best = _cut(profile, [uniform * c for c in capacities], flights, measure, memory_limits, swap, kept_limits,
                    aheads, receiving=receiving)
    if best is None:
        # The uniform cut breaks the memory or kept limits: every stage is part of the whole model,
        # so the whole model's measure bounds every cut. (What a stage receives is at most every
        # tensor a layer reads from another.)
        whole = _Window.over(profile, 0, n)
        figures = list(whole.now())
        figures[5] = sum({k: b for layer in profile.inputs for k, b, _ in layer}.values())
        figures = tuple(figures)
        hi = max(measure(whole, figures, flights[k], aheads[k]) / capacities[k] for k in range(stages)) * (1 + 1e-9)
        best = _cut(profile, [hi * c for c in capacities], flights, measure, memory_limits, swap, kept_limits, aheads,
                    receiving=receiving)
        if best is None:
            return None
    hi = _worst(profile, best, capacities, flights, measure, aheads)
    # Both ends of the bracket are figures some stage has (``lo`` after the first try that finds
    # no cut): when they meet, the cut found is optimal. The search stops earlier, at a relative
    # ``precision`` of the largest stage (a KiB on a GiB: exact below a MiB).
    while hi > lo and hi - lo > precision * hi:
        mid = (lo + hi) / 2
        blocked = _Blocked(capacities)
        cuts = _cut(profile, [mid * c for c in capacities], flights, measure, memory_limits, swap, kept_limits, aheads,
                    blocked, receiving)
        if cuts is None:
            lo = max(mid, blocked.least)
        else:
            best, hi = cuts, _worst(profile, cuts, capacities, flights, measure, aheads)
    return best


def evaluate(profile: PipelineProfile, cuts: Sequence[int], *, microbatches: int, schedule: str = "1f1b",
             devices=None, rule: str = "memory", objective: str = "memory", budget: Optional[int] = None,
             model: str = "", swap: bool = True, host_budget: Optional[int] = None,
             recompute: bool = False) -> Partition:
    """The :class:`Partition` of the stages ending at ``cuts`` (exclusive layer indices), judged by the memory model.

    With ``swap``, a stage over its device or the budget swaps the activations over it to the
    host, as far as :func:`stage_peak` with ``swap=True`` allows. With ``recompute``, such a
    stage may instead keep only what it receives and run its forward pass again
    (:func:`recompute_peak`); of the ways that fit, the one with the least time per
    micro-batch is taken (else the one reaching lowest).

    Examples:
        >>> from lms_tf.pipeline.profile import PipelineProfile
        >>> evaluate(PipelineProfile.chain([100] * 4), [1, 4], microbatches=4).max_stage_peak_bytes   # 1 + 1 ahead
        400
        >>> p = evaluate(PipelineProfile.chain([100] * 4), [1, 4], microbatches=8, schedule="gpipe", budget=700)
        >>> [(s.predicted_peak_bytes, s.host_bytes, s.swapped_bytes_per_microbatch) for s in p.stages]  # 800, 2400
        [(700, 100, 12), (700, 1700, 212)]
    """
    profile = _compiled(profile)
    layers = profile.layers
    stages = len(cuts)
    specs = _devices(devices, stages)
    out: List[Stage] = []
    lo = 0
    slowest_update = 0.0
    for k, hi in enumerate(cuts):
        flight = in_flight(schedule, k, stages, microbatches)
        ahead = received_ahead(schedule, k, stages, microbatches)
        window = _Window.over(profile, lo, hi)
        received = _received(profile, lo, hi)
        spec = specs[k]
        link = spec.host_to_device_bytes_per_s if spec else None
        seconds = window.seconds + (2 * sum(received.values()) / link if link else 0.0)
        slowest_update = max(slowest_update, sum(layer.update_s for layer in layers[lo:hi]))
        limits = [c for c in (spec.memory_bytes if spec else None, budget) if c is not None]
        capacity = min(limits) if limits else None
        kept_peak = window.peak(flight, ahead=ahead)
        # The ways the stage may run: (peak, seconds per micro-batch, host bytes, recomputes).
        ways = [(kept_peak, seconds, 0, False)]
        if capacity is not None and kept_peak > capacity:
            if swap:
                peak = max(window.least_peak(flight, ahead=ahead), int(capacity))   # swap just what is over
                copy = ((kept_peak - peak) // flight / min(spec.host_to_device_bytes_per_s,
                                                            spec.device_to_host_bytes_per_s)) if spec else 0.0
                # each micro-batch's share out and back, on the copy engines beside the compute
                ways.append((peak, max(seconds, copy), kept_peak - peak, False))
            if recompute:
                ways.append((recompute_peak(profile, lo, hi, flight, window, ahead),
                             seconds + sum(layer.forward_s for layer in layers[lo:hi]), 0, True))
        chosen = ways[0]
        if len(ways) > 1:
            fitting = [w for w in ways if w[0] <= capacity]
            chosen = min(fitting, key=lambda w: (w[1], w[0])) if fitting else min(ways, key=lambda w: w[0])
        peak, seconds, host, recomputes = chosen
        out.append(Stage(k, tuple(layer.name for layer in layers[lo:hi]), spec.name if spec else None,
                         spec.memory_bytes if spec else None, peak, window.param_bytes,
                         window.kept_bytes, flight, seconds, sum(received.values()), host, host // flight,
                         recomputes, ahead))
        lo = hi
    ideal = _Window.over(profile, 0, len(layers)).peak(1) // stages
    step = (microbatches + stages - 1) * max(s.seconds_per_microbatch for s in out) + slowest_update
    return Partition(tuple(out), schedule, microbatches, rule, objective, ideal, step, budget, model, swap,
                     host_budget, recompute)


def partition_layers(profile: PipelineProfile, *, stages: int, microbatches: int, schedule: str = "1f1b",
                     devices: Union[None, str, DeviceSpec, Sequence[Union[str, DeviceSpec]]] = None,
                     budget: Union[None, int, str] = None, rule: str = "memory", objective: str = "memory",
                     model: str = "", swap: bool = True, host_budget: Union[None, int, str] = None,
                     recompute: bool = False) -> Partition:
    """Cuts the profiled layers into ``stages`` contiguous pipeline stages.

    Args:
        profile: The layers, from :func:`~lms_tf.pipeline.profile.profile_layers` (traced at one
            micro-batch) or :meth:`PipelineProfile.chain`.
        stages: How many stages (``K``).
        microbatches: Micro-batches per step (``M``).
        schedule: ``"1f1b"`` (stage ``k`` holds ``min(K - k, M)`` micro-batches) or ``"gpipe"`` (all ``M``).
        devices: A device preset for every stage, or one per stage (mixed devices are balanced by
            how full each is); None balances bytes alone.
        budget: Bytes (or text such as ``"12GiB"``) no stage may exceed, on top of its device.
        rule: ``"memory"`` (least largest stage peak, the default), ``"parameters"`` (DeepSpeed:
            balance weight bytes) or ``"uniform"`` (DeepSpeed: equal layer counts).
        objective: With ``rule="memory"``: ``"memory"`` (least largest stage peak, then, of the
            cuts that reach it, the least slowest stage compute, to :data:`TIME_PRECISION`), or
            ``"time"`` (least slowest stage compute among the cuts where every stage fits its
            device and the budget).
        model: The model's name, for the summary.
        swap: Whether a stage that does not fit its device or the budget may swap activations to
            the host (just the bytes over; at least ``SWAP_RESIDENT`` layers' kept activations
            stay). Only when no cut fits without it.
        host_budget: Host memory one stage's process may take for what it swaps (bytes or text
            such as ``"64GiB"``); None: this machine's physical memory. When stages swap, the cut
            is searched so that each swapping stage's host bytes fit it; when no cut does, the
            best cut regardless is returned and reported as not fitting (``HostBudgetError``
            when ``host_budget`` was given).
        recompute: Whether a stage that does not fit may instead keep only what it receives and
            run its forward pass again in each backward task (:func:`recompute_peak`; one more
            forward pass of time per micro-batch). Of the ways that fit a stage, the one with the
            least time is taken. When no cut fits without, the cut is searched exactly for the
            least full fullest stage, each stage at the lowest of keeping, swapping (with
            ``swap``) and recomputing: a cut where every stage fits one way is found whenever
            one exists.

    Returns:
        The :class:`Partition`; ``feasible`` says whether every stage fits.

    Raises:
        LMSOptionError: More stages than layers, or a bad argument.
        InfeasibleBudgetError: ``budget`` was given and no cut meets it; the message names the
            smallest largest-stage peak any cut reaches.
        HostBudgetError: ``host_budget`` was given and a swapping stage needs more; the message
            names both figures.

    Examples:
        >>> from lms_tf.pipeline.profile import PipelineProfile
        >>> p = partition_layers(PipelineProfile.chain([100] * 8, [50] * 8), stages=4, microbatches=8)
        >>> [len(s.layers) for s in p.stages]   # 1F1B: the first stage holds 4 micro-batches
        [1, 2, 2, 3]
        >>> p = partition_layers(PipelineProfile.chain([100] * 8), stages=2, microbatches=8, schedule="gpipe",
        ...                      budget=900)   # 4 layers x 8 micro-batches: 3200 B; at least 2 layers' 200 B
        >>> [(s.predicted_peak_bytes, s.host_bytes) for s in p.stages], p.feasible
        ([(900, 2300), (900, 2300)], True)
    """
    budget_bytes = check_arguments(stages=stages, microbatches=microbatches, schedule=schedule, rule=rule,
                                   objective=objective, devices=devices, budget=budget, layers=len(profile.layers),
                                   swap=swap, host_budget=host_budget)
    specs = _devices(devices, stages)
    profile = _compiled(profile)
    flights = [in_flight(schedule, k, stages, microbatches) for k in range(stages)]
    aheads = [received_ahead(schedule, k, stages, microbatches) for k in range(stages)]
    capacities = [float(s.memory_bytes) if s else 1.0 for s in specs]
    if budget_bytes is not None:
        capacities = [min(c, budget_bytes) if s else float(budget_bytes) for c, s in zip(capacities, specs)]
    host_limit = parse_host_budget(host_budget)
    host_room = host_limit if host_limit is not None else machine_memory_bytes()
    kwargs = dict(microbatches=microbatches, schedule=schedule, devices=devices, rule=rule, objective=objective,
                  budget=budget_bytes, model=model, swap=swap, host_budget=host_room, recompute=recompute)
    limited = devices is not None or budget_bytes is not None
    # A swapping stage puts what its peak keeping everything has over its limit on the host: cut
    # so that this fits the host budget too (a bound on that peak, which only grows with the stage).
    kept_limits = [c + host_room for c in capacities] if limited else None

    def search(swapping: bool, measure=None) -> List[int]:
        if rule == "uniform":
            return _uniform_cuts(len(profile.layers), stages)
        if rule == "parameters":
            return _least_limit(profile, [1.0] * stages, flights, _measure("parameters"))
        if objective == "time":
            limits = capacities if limited else None
            cuts = _least_limit(profile, [1.0] * stages, flights, _measure("time"), limits,
                                swap=swapping, kept_limits=kept_limits if swapping else None, aheads=aheads)
            if cuts is not None:
                return cuts
            # nothing fits: say how close the memory-balanced cut gets
        searched_for_host = swapping and measure is None and kept_limits is not None
        measure = measure or _measure("memory", swapping)
        floor = _memory_floor(profile, capacities, swapping)
        if searched_for_host:
            # the cuts whose swapping stages fit the host, if one fits the devices too; else the
            # least peaks regardless (reported as needing more host memory)
            cuts = _least_limit(profile, capacities, flights, measure, kept_limits=kept_limits, aheads=aheads,
                                lo=floor)
            if cuts is not None and _worst(profile, cuts, capacities, flights, measure, aheads) <= 1.0:
                return then_fastest(cuts, measure, swapping, kept_limits)
        return then_fastest(_least_limit(profile, capacities, flights, measure, aheads=aheads, lo=floor), measure,
                            swapping)

    def then_fastest(cuts: List[int], measure, swapping: bool, kept=None) -> List[int]:
        """Of the cuts whose fullest stage is no fuller than ``cuts``', the one with the least
        predicted step time: many cuts often share the least largest peak (it is one stage's), and
        the others' stages can be balanced by time under it."""
        fullest = _worst(profile, cuts, capacities, flights, measure, aheads)
        # (Raised by a hair for the rounding of fullest * capacity; the exact check follows.)
        limits = [fullest * c * (1 + 1e-12) for c in capacities]
        # The slowest stage is no faster than the slowest layer, nor than an equal share of all.
        seconds = profile.seconds
        faster = _least_limit(profile, [1.0] * stages, flights, _measure("time"), limits,
                              swap=swapping, kept_limits=kept, aheads=aheads, start=cuts,
                              lo=max(max(seconds), sum(seconds) / stages), precision=TIME_PRECISION)
        if faster is None or _worst(profile, faster, capacities, flights, measure, aheads) > fullest:
            return cuts
        return min((cuts, faster), key=lambda c: evaluate(profile, c, **kwargs).predicted_step_time_s)

    result = evaluate(profile, search(False), **kwargs)
    if swap and rule == "memory" and not result._fits_devices():
        # Swapping costs time, so it is the second resort: cut again by the least peaks, and let
        # evaluate() swap only the stages that do not fit as they are.
        result = evaluate(profile, search(True), **kwargs)
    if recompute and rule == "memory" and not result._fits_devices():
        # Stages that recompute: searched exactly for the least full fullest stage (each at the
        # lowest way it has), bounded by the cut already found; the faster way is then chosen
        # per stage, and of the two cuts the one fitting (then less full, then faster) is kept.
        found = [hi for _, hi in result.bounds]
        bound = _worst(profile, found, capacities, flights, _measure("memory", swap, recompute=True), aheads)
        _, cuts = _recompute_cut(profile, capacities, flights, swap, bound, aheads, start=found)
        if cuts is not None:
            tried = evaluate(profile, cuts, **kwargs)
            result = min((result, tried), key=lambda p: (not p._fits_devices(), _fullest(p), p.predicted_step_time_s))
    if budget_bytes is not None and rule == "memory" and not result._fits_devices():
        ones, measure = [1.0] * stages, _measure("memory", swap)
        least = int(_worst(profile, _least_limit(profile, ones, flights, measure, aheads=aheads), ones, flights, measure,
                           aheads))
        if recompute:   # the least any cut reaches when its stages may also recompute (bounded by the above)
            least = min(least, int(_recompute_cut(profile, ones, flights, swap, float(least), aheads)[0]))
        raise infeasible(
            f"no cut of the {len(profile.layers)} layers into {stages} stages ({schedule}, {microbatches} micro-batches) "
            f"keeps every stage under the budget {format_bytes(budget_bytes)} ({budget_bytes} bytes)"
            + (f" and its device ({', '.join(sorted({s.name for s in specs if s}))})" if devices is not None else "")
            + ": the smallest largest-stage peak any cut reaches"
            + "".join(f" {word} {way}" for word, way in zip(("with", "or"), [w for w, on in (("swapping", swap),
                      ("recomputing", recompute)) if on])) + " is "
            f"{format_bytes(least)} ({least} bytes). Pass budget >= that, more stages, or smaller micro-batches (more "
            f"of them for the same batch)" + ("" if recompute else ", or let stages recompute (recompute=True)")
            + ".", budget_bytes, least)
    needing = max(result.stages, key=lambda s: s.host_bytes)
    if host_limit is not None and needing.host_bytes > host_limit:
        raise host_budget_error(
            f"stage {needing.index} ({needing.layers[0]} .. {needing.layers[-1]}) fits its device and budget only by swapping "
            f"{format_bytes(needing.host_bytes)} of activations to the host, more than host_budget "
            f"{format_bytes(host_limit)} ({host_limit} bytes). Pass a larger host_budget (per stage process), more "
            f"stages, or smaller micro-batches.", host_limit, needing.host_bytes)
    return result


def exhaustive_partition(profile: PipelineProfile, *, stages: int, microbatches: int, schedule: str = "1f1b",
                         devices=None) -> Tuple[float, List[int]]:
    """The least largest-stage peak (over device memory, when devices are given) of every cut, by
    trying them all: the reference the search is checked against on small models.

    Examples:
        >>> from lms_tf.pipeline.profile import PipelineProfile
        >>> exhaustive_partition(PipelineProfile.chain([400, 100, 100, 100, 100, 100]), stages=2, microbatches=4)
        (800.0, [1, 6])
    """
    n = len(profile.layers)
    specs = _devices(devices, stages)
    best: Tuple[float, List[int]] = (float("inf"), [])
    for inner in itertools.combinations(range(1, n), stages - 1):
        cuts = list(inner) + [n]
        worst, lo = 0.0, 0
        for k, hi in enumerate(cuts):
            peak = stage_peak(profile, lo, hi, in_flight(schedule, k, stages, microbatches),
                              ahead=received_ahead(schedule, k, stages, microbatches))
            worst = max(worst, peak / specs[k].memory_bytes if specs[k] else float(peak))
            lo = hi
        if worst < best[0]:
            best = (worst, cuts)
    return best


__all__ = ["OBJECTIVES", "RULES", "SCHEDULES", "Partition", "Stage", "check_arguments", "evaluate", "exhaustive_partition", "in_flight",
           "partition_layers", "received_ahead", "recompute_peak", "stage_peak"]
