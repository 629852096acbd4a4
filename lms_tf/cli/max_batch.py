"""``lms-tf max-batch``: the largest batch that fits a device preset, without and with lms-tf.

The step is traced once with an unknown batch dimension. Each batch size is sized from that
trace (by arithmetic when every size is linear in the batch, :func:`sized_by_batch`), simulated
and, with lms-tf, planned for ``budget="auto"``. Until a batch does not fit, the search grows
the batch 4x a step (plain: to where a line through two peaks meets the budget), then goes
where the memory the tries report puts the boundary (the plain peak; with lms-tf, the smallest
feasible budget a batch that does not fit reports), trying each estimate and the batch
after it: it ends on a batch that fits whose next batch does not, both tried (the answer
bisection gives whenever memory grows with the batch, in about half the tries). The search with
lms-tf starts from the plain answer (what fits plain fits with lms-tf). ``--jobs`` plans the
batches the search may try next ahead of time in forked processes, on the same path to the same
answer. A progress bar on stderr shows each try (``#`` fits, ``-`` does not).

Examples:
    >>> from lms_tf.cli import build_parser
    >>> build_parser().parse_args(["max-batch", "--model", "ResNet50", "--max", "64"]).max
    64
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from lms_tf.cli import args as cli_args
from lms_tf.core.errors import HostBudgetError, InfeasibleBudgetError
from lms_tf.core.ir import BatchSizedIR
from lms_tf.core.policy import Policies, resolve_budget
from lms_tf.cost.model import CostModel
from lms_tf.planner import make_budget_plan
from lms_tf.simulate import input_bytes, resident_bytes, simulate

logger = logging.getLogger("lms_tf")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``max-batch`` and its flags.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> build_parser().parse_args(["max-batch", "--model", "resnet50"]).device
        'v100-16gb-pcie3'
    """
    maxb = subparsers.add_parser("max-batch", help="largest batch that fits a device without and with lms-tf")
    cli_args.add_model_arguments(maxb, batch=False)
    cli_args.add_device_argument(maxb)
    cli_args.add_weights_argument(maxb)
    cli_args.add_host_budget_argument(maxb)
    maxb.add_argument("--max", type=cli_args.positive_int, default=4096, help="largest batch to try")
    maxb.add_argument("--jobs", type=cli_args.positive_int, default=default_jobs(),
                      help="batch sizes planned at once, one process each (default: the usable CPUs, at most "
                           f"{MAX_DEFAULT_JOBS})")
    maxb.add_argument("--json", action="store_true", help="print one JSON object")
    return maxb


#: The default ``--jobs`` is the usable CPU count, capped here: each process holds its own
#: planner state (about 0.5 GB on ResNet-50 224²).
MAX_DEFAULT_JOBS = 4


def default_jobs() -> int:
    """The usable CPUs, at most :data:`MAX_DEFAULT_JOBS`.

    Examples:
        >>> 1 <= default_jobs() <= MAX_DEFAULT_JOBS
        True
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(usable, MAX_DEFAULT_JOBS))


#: The probe the forked processes run (:func:`probes` sets it before forking: they inherit it).
_PROBE_CONTEXT: dict = {}


def _probe(batch: int) -> "Probe":
    return _PROBE_CONTEXT["probe"](batch)


class Probe(NamedTuple):
    """What trying one batch found.

    Attributes:
        fits: Whether the batch fits (plain, or planned with ``budget="auto"``).
        peak_bytes: The plain step's simulated peak, or the plan's when it fits with lms-tf.
        need_bytes: The least memory the batch needs as far as the try found out, the batch itself
            included: the plain peak; with lms-tf, the smallest feasible budget when it does not
            fit (None when it fits: the planner stops at the first plan under the budget).
        budget_bytes: The budget the batch was held to, with the room for the batch itself.

    Examples:
        >>> Probe(False, 300, 200, 150).fits
        False
    """

    fits: bool
    peak_bytes: int
    need_bytes: Optional[int] = None
    budget_bytes: Optional[int] = None


def fits(ir_for_batch, batch: int, policies: Policies, cost: CostModel, with_lms: bool, *,
         device: str) -> Probe:
    """Whether ``batch`` fits the device (plain, or planned with ``budget="auto"``), its peak and
    the memory it needs.

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> probe = fits(lambda mib: chain_ir(mib=mib), 8, Policies(), CostModel(get_device_spec("v100-16gb-pcie3")),
        ...              False, device="/device:GPU:0")   # three 8 MiB activations fit a 16 GB V100
        >>> probe.fits, probe.peak_bytes
        (True, 25165828)
    """
    ir = ir_for_batch(batch)
    baseline = simulate(ir, cost=cost)
    # The batch is held beside the step (budget="auto" leaves room for it): the need and the budget
    # both count it, so that the budget is the same at every batch and the need a line in it.
    batch_bytes = input_bytes(ir)
    if not with_lms:
        budget = resolve_budget("auto", baseline_peak_bytes=baseline.peak_bytes, memory_bytes=cost.device.memory_bytes,
                                device_name=cost.device.name, resident=resident_bytes(ir) + batch_bytes)
        return Probe(baseline.peak_bytes <= budget, baseline.peak_bytes, baseline.peak_bytes + batch_bytes,
                     budget + batch_bytes)
    try:
        plan = make_budget_plan(ir, policies.replace(budget="auto"), device=device, cost=cost)
    except HostBudgetError:
        # It fits the device but not the host: too large, with no device figure to steer by.
        return Probe(False, baseline.peak_bytes, None, resolve_budget(
            "auto", baseline_peak_bytes=baseline.peak_bytes, memory_bytes=cost.device.memory_bytes,
            device_name=cost.device.name, resident=resident_bytes(ir) + batch_bytes) + batch_bytes)
    except InfeasibleBudgetError as err:
        return Probe(False, baseline.peak_bytes, err.smallest_feasible_bytes + batch_bytes,
                     err.budget_bytes + batch_bytes)
    return Probe(True, plan.predictions.planned_peak_bytes, None, plan.budget_bytes + batch_bytes)


def largest_batch(ir_for_batch, policies: Policies, cost, with_lms: bool, upper: int, *,
                  device: str, known_good: int = 0, progress=None, probe_all=None,
                  jobs: int = 1, guided: bool = True) -> Tuple[int, Optional[int]]:
    """The largest batch that fits; returns it and its peak.

    ``guided`` (the default): the batch grows :data:`GUIDED_GROWTH` times a step until one does
    not fit (a plain search jumps to where a line through two fitting peaks meets the budget);
    then each next batch is where the memory the tries report puts the boundary
    (:func:`boundary_estimate`) and, when it fits, the one after it: two tries that fit and do
    not, one apart, end the search. Every few estimates that do not end it, one bisection step.
    Without ``guided``: doubling, then bisection.

    The answer is always a batch that fits with the one after it tried and not fitting. With
    ``jobs`` > 1 each round also tries, ahead of time, the batches the search would try next
    whichever way the earlier ones come out, as far as that does not depend on the memory they
    report (nearest first, the branch that repeats the latest verdict before the other),
    ``jobs`` at a time (``probe_all`` runs them, e.g. in processes): the search takes the same
    path to the same answer as one batch at a time, in fewer rounds.

    Args:
        ir_for_batch: Batch size -> the step's IR at that size (traced once, sized per batch).
        policies: Planning policies (each batch is planned for ``budget="auto"``).
        cost: The device's cost model.
        with_lms: Plan with lms-tf (else the plain step must fit).
        upper: The largest batch to try.
        device: The managed device's full name.
        known_good: A batch known to fit, where the doubling starts (with lms-tf: the plain
            answer, since a step that fits plain fits with lms-tf).
        progress: Called with ``(batch, fits)`` after each batch tried.
        probe_all: Batch sizes -> their :class:`Probe`, in order (default: :func:`fits` on each,
            one after the other).
        jobs: How many batches each round tries.
        guided: Steer by the memory each try reports (else bisect).

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> largest_batch(lambda mib: chain_ir(mib=mib), Policies(), CostModel(get_device_spec("v100-16gb-pcie3")), False,
        ...               64, device="/device:GPU:0")[0]   # every size up to the cap fits
        64
    """
    if probe_all is None:
        def probe_all(batches):
            return [fits(ir_for_batch, batch, policies, cost, with_lms, device=device) for batch in batches]
    search = _BatchSearch(upper, guided, fits_report_needs=not with_lms)
    known: Dict[int, Probe] = {}
    state = search.start(known_good)
    last = True  # the latest verdict on the path (the start is a batch that fits)
    while True:
        step = search.next_batch(state, known)
        if step is None:
            break
        batch, kind = step
        if batch not in known:
            tries = search.ahead(state, known, jobs, last)
            for tried, outcome in zip(tries, probe_all(tries)):
                known[tried] = Probe(*outcome)
                if progress is not None:
                    progress(tried, known[tried].fits)
        last = known[batch].fits
        state = search.advance(state, batch, kind, last)
    good = state.good
    if good and good not in known:  # the known batch was never planned: plan it for its peak
        known[good] = Probe(*probe_all([good])[0])
    return good, known[good].peak_bytes if good else None


def boundary_estimate(bad: int, at_bad: Probe, other: Optional[Tuple[int, Probe]] = None) -> Optional[int]:
    """The largest batch the memory needed at ``bad`` (usually a batch that does not fit; two
    plain batches that fit also draw a line) and at one ``other`` batch says fits, by a line
    through both; without ``other`` (or its need), through
    ``bad``'s need and zero memory at batch 0 (with lms-tf only a batch that does not fit
    reports its need, and the budget already leaves out the weights). Memory grows with the
    batch, and a part that does not grow makes the line through zero put the boundary high, so
    those estimates come down to it from above. None without ``bad``'s need.

    Examples:
        >>> boundary_estimate(200, Probe(False, 2100, 2100, 1500), (100, Probe(True, 1100, 1100, 1500)))
        140
        >>> boundary_estimate(200, Probe(False, 0, 3000, 1500))   # lms-tf: half of 200
        100
    """
    if at_bad.need_bytes is None or at_bad.budget_bytes is None or at_bad.need_bytes <= 0:
        return None
    budget = at_bad.budget_bytes
    if other is not None and other[1].need_bytes is not None and other[0] != bad:
        batch, need = other[0], other[1].need_bytes
        slope = (at_bad.need_bytes - need) / (bad - batch)
        if slope > 0:
            return batch + int((budget - need) // slope)
    return int(bad * budget // at_bad.need_bytes)


class _SearchState(NamedTuple):
    good: int
    bad: Optional[int]
    doubling: int
    confirm: Optional[int] = None  # the batch after an estimate that fit
    failed_estimates: Tuple[int, ...] = ()  # estimates that did not fit, since the last bisection step
    previous_good: int = 0  # the batch that fit before ``good``
    failed: Tuple[int, ...] = ()  # every batch on the path that did not fit
    misses: int = 0  # estimates since the last bisection step that did not end the search


#: Before any batch fails, the guided search multiplies the batch by this much each step: a batch
#: far too large costs little to plan (the planner gives up early) and its smallest feasible
#: budget puts the boundary about as well as a near one.
GUIDED_GROWTH = 4

#: After this many estimates that did not end the search, one bisection step (the bracket at
#: least halves however the memory curves).
ESTIMATES_PER_BISECTION = 3


class _BatchSearch:
    """The search as a state machine, so the batches it would try next can be listed ahead of
    their outcomes: ``next_batch`` gives a batch and how it was chosen (``"double"``,
    ``"estimate"``, ``"confirm"``, ``"bisect"``), ``advance`` takes the verdict."""

    def __init__(self, upper: int, guided: bool = True, fits_report_needs: bool = False):
        self.upper, self.guided, self.fits_report_needs = upper, guided, fits_report_needs
        self.growth = GUIDED_GROWTH if guided else 2

    def start(self, known_good: int) -> _SearchState:
        return _SearchState(known_good, None, self.growth * known_good if known_good else 1)

    def next_batch(self, state: _SearchState, known, speculated=frozenset()):
        """The next batch and its kind; None when the search is over; :data:`_UNKNOWN` when it
        depends on the memory reported by a try not made yet (``speculated``)."""
        good, bad = state.good, state.bad
        if bad is None:
            if good >= self.upper:
                return None
            if state.confirm is not None:
                return min(state.confirm, self.upper), "confirm"
            if self.guided and self.fits_report_needs and state.previous_good in known and good in known:
                if speculated & {good, state.previous_good}:
                    return _UNKNOWN
                # Two batches that fit and their peaks: a line through them to the budget.
                estimate = boundary_estimate(good, known[good], (state.previous_good, known[state.previous_good]))
                if estimate is not None and estimate > good:
                    return min(estimate, self.upper), "estimate"
            return min(state.doubling, self.upper), "double"
        if bad - good <= 1:
            return None
        if state.confirm is not None and good < state.confirm < bad:
            return state.confirm, "confirm"
        if self.guided and state.misses < ESTIMATES_PER_BISECTION:
            if any(batch >= good for batch in speculated):
                return _UNKNOWN  # a line below would go through a verdict or a need not known yet
            estimate = self._estimate(state, known)
            if estimate is not None:
                return estimate, "estimate"
        return (good + bad) // 2, "bisect"

    @staticmethod
    def _estimate(state: _SearchState, known) -> Optional[int]:
        """Where the memory reported so far puts the boundary, strictly between ``good`` and
        ``bad``, or None. The line goes through ``bad``'s need and: the need of the batch that
        fits when it reports one (the plain peak); else the estimate before ``bad`` when both
        did not fit (the two nearest the boundary, on the same side of any bend in the memory
        curve); else zero at batch 0, and when that lands on a batch known to fit (the curve has
        a negative part: estimates from zero come up short), the next larger batch that did not fit."""
        good, bad = state.good, state.bad

        def need(batch):
            return (batch, known[batch]) if batch in known and known[batch].need_bytes is not None else None

        def within(estimate):
            return estimate if estimate is not None and good < estimate < bad else None

        failed = state.failed_estimates
        second = need(good) or (need(failed[-2]) if len(failed) > 1 and failed[-1] == bad else None)
        if second is not None:
            return within(boundary_estimate(bad, known[bad], second))
        estimate = within(boundary_estimate(bad, known[bad]))
        if estimate is None:
            larger = min((b for b in state.failed if b > bad and need(b)), default=None)
            if larger is not None:
                estimate = within(boundary_estimate(bad, known[bad], need(larger)))
        return estimate

    def advance(self, state: _SearchState, batch: int, kind: str, ok: bool) -> _SearchState:
        good, bad = (batch, state.bad) if ok else (state.good, batch)
        state = state._replace(previous_good=state.good) if ok else state._replace(failed=state.failed + (batch,))
        if kind == "double":
            return state._replace(good=good, bad=bad,
                                  doubling=self.growth * state.doubling if ok else state.doubling)
        if kind == "estimate":
            return state._replace(good=good, bad=bad, confirm=batch + 1 if ok else None, misses=state.misses + 1,
                                  failed_estimates=state.failed_estimates + (() if ok else (batch,)))
        if kind == "bisect":
            return state._replace(good=good, bad=bad, confirm=None, misses=0, failed_estimates=())
        return state._replace(good=good, bad=bad, confirm=None)  # confirm

    def ahead(self, state: _SearchState, known, jobs: int, last: bool = True) -> List[int]:
        """Up to ``jobs`` batches not tried yet that the search may try next, nearest first; of
        the two ways a batch may come out, the one like the latest verdict on its path first
        (verdicts come in runs: doubling while batches fit, then often several that do not). A
        branch whose next batch depends on memory not reported yet stops there."""
        tries: List[int] = []
        frontier = [(state, last, frozenset())]
        while frontier and len(tries) < jobs:
            here, latest, speculated = frontier.pop(0)
            step = self.next_batch(here, known, speculated)
            if step is None or step is _UNKNOWN:
                continue
            batch, kind = step
            if batch in known and batch not in speculated:
                frontier.append((self.advance(here, batch, kind, known[batch].fits), known[batch].fits, speculated))
                continue
            if batch not in tries:
                tries.append(batch)
            frontier += [(self.advance(here, batch, kind, ok), ok, speculated | {batch}) for ok in (latest, not latest)]
        return tries


#: :meth:`_BatchSearch.next_batch` when the next batch depends on a try not made yet.
_UNKNOWN = ("unknown", "")


class ProgressBar:
    """A one-line progress bar on stderr for the batch search: the bracket so far and each try.

    Examples:
        >>> import io
        >>> out = io.StringIO()
        >>> bar = ProgressBar("with lms-tf", stream=out)
        >>> bar(64, True); bar(128, False); bar.close()
        >>> out.getvalue().splitlines()[-1]
        'max-batch with lms-tf [#-] 2 tries: fits 64, not 128'
    """

    def __init__(self, label: str, stream=None, command: str = "max-batch", show: Callable[[int], str] = str):
        self.label, self.stream, self.command, self.show = label, stream or sys.stderr, command, show
        self.marks, self.good, self.bad = "", None, None

    def __call__(self, batch: int, ok: bool) -> None:
        self.marks += "#" if ok else "-"
        if ok:
            self.good = batch if self.good is None else max(self.good, batch)
        else:
            self.bad = batch if self.bad is None else min(self.bad, batch)
        logger.debug("%s %s: %s %s", self.command, self.label, self.show(batch), "fits" if ok else "does not fit")
        self.stream.write("\r" + self._line())
        self.stream.flush()

    def _line(self) -> str:
        if not self.marks:
            return f"{self.command} {self.label}: nothing to try (the answer so far is the largest allowed)"
        bracket = ", ".join(part for part in (f"fits {self.show(self.good)}" if self.good is not None else "",
                                              f"not {self.show(self.bad)}" if self.bad is not None else "") if part)
        return f"{self.command} {self.label} [{self.marks}] {len(self.marks)} tries: {bracket}"

    def close(self) -> None:
        self.stream.write("\r" + self._line() + "\n")
        self.stream.flush()


#: The batch sizes the step is sized at with TensorFlow's shape inference: the first two fix each
#: size's line in the batch, the third checks it.
SAMPLE_BATCHES = (8, 16, 24)


def sized_by_batch(graph) -> Tuple[Callable[[int], object], bool]:
    """Batch size -> the traced step's IR at that size: by arithmetic from three sizings when
    every size is linear in the batch (:class:`~lms_tf.core.ir.BatchSizedIR`), else by sizing
    each batch with TensorFlow (about a second each on ResNet-50); and whether it was by
    arithmetic (then it runs without TensorFlow, in forked processes too).

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> ir_for_batch, by_arithmetic = sized_by_batch(f.get_concrete_function(tf.TensorSpec((None, 8))).graph)
        >>> ir_for_batch(1000).tensors["Relu:0"].nbytes, by_arithmetic
        (32000, True)
    """
    from lms_tf.tf.trace import build_ir

    sized = BatchSizedIR.fit({batch: build_ir(graph, batch_size=batch) for batch in SAMPLE_BATCHES})
    if sized is not None:
        return sized.at, True
    logger.info("max-batch: some tensor sizes are not linear in the batch; sizing the step with TensorFlow for each "
                "batch tried (slower)")
    cache: Dict[int, object] = {}

    def ir_for_batch(batch: int):
        if batch not in cache:
            cache.clear()
            cache[batch] = build_ir(graph, batch_size=batch)
        return cache[batch]

    return ir_for_batch, False


@contextlib.contextmanager
def probes(jobs: int, probe: Callable[[int], Probe]):
    """Yields a function from sizes to their :class:`Probe` (``probe`` on each), run one after
    the other or in ``jobs`` forked processes, which inherit ``probe`` and what it holds (nothing
    is pickled but sizes and answers). ``probe`` must not call TensorFlow when ``jobs`` > 1.

    Examples:
        >>> with probes(1, lambda n: Probe(n < 3, n)) as probe_all:
        ...     [p.fits for p in probe_all([2, 3])]
        [True, False]
    """
    _PROBE_CONTEXT["probe"] = probe
    try:
        if jobs == 1:
            yield lambda batches: [_probe(batch) for batch in batches]
        else:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                yield lambda batches: list(pool.map(_probe, batches))
    finally:
        _PROBE_CONTEXT.clear()


def run(args) -> int:
    """Runs ``lms-tf max-batch``: the largest batch without and with lms-tf on a device preset.

    Returns:
        0.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> run(build_parser().parse_args(["max-batch", "--model", "resnet50", "--input-shape", "32x32", "--classes", "10",
        ...                                "--max", "2", "--json"]))  # doctest: +ELLIPSIS
        {"model": "resnet50", "device": "v100-16gb-pcie3", "weights": "device", "max_batch_plain": 2, "max_batch_lms": 2, ...}
        0
    """
    from lms_tf.cli.workload import devices, trace_unbatched
    from lms_tf.cost import CostModel, get_device_spec

    device, host = devices()
    spec = get_device_spec(args.device)
    cost = CostModel(spec)
    _, _, graph, _, _ = trace_unbatched(args)
    ir_for_batch, by_arithmetic = sized_by_batch(graph)
    policies = Policies(host=host, budget="auto", recompute="auto", weights=args.weights,
                        host_budget=args.host_budget)
    # Probes run in forked processes, which must not call TensorFlow: only when the sizes come
    # by arithmetic (BatchSizedIR), not from TensorFlow's shape inference.
    jobs = args.jobs if by_arithmetic and "fork" in multiprocessing.get_all_start_methods() else 1
    if jobs < args.jobs:
        logger.info("max-batch: planning one batch at a time (--jobs %d needs sizes by arithmetic and fork())",
                    args.jobs)
    answers = {}
    level = logger.level
    if not logger.isEnabledFor(logging.DEBUG):  # the bar replaces the planner's line per batch
        logger.setLevel(logging.WARNING)
    try:
        for with_lms in (False, True):
            bar = ProgressBar("with lms-tf" if with_lms else "plain")
            probe = functools.partial(fits, ir_for_batch, policies=policies, cost=cost, with_lms=with_lms,
                                      device=device)
            with probes(jobs, probe) as probe_all:
                answers[with_lms] = largest_batch(ir_for_batch, policies, cost, with_lms, args.max, device=device,
                                                  known_good=answers[False][0] if with_lms else 0, progress=bar,
                                                  probe_all=probe_all, jobs=jobs)
            bar.close()
    finally:
        logger.setLevel(level)
    (plain, plain_peak), (lms, lms_peak) = answers[False], answers[True]
    result = {"model": args.model, "device": spec.name, "weights": args.weights,
              "max_batch_plain": plain, "max_batch_lms": lms,
              "peak_bytes_plain": plain_peak, "peak_bytes_lms": lms_peak,
              "ratio": round(lms / plain, 2) if plain else None}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} on {spec.name}: largest batch {plain} plain, {lms} with lms-tf"
              + (f" ({lms / plain:.1f}x)" if plain else ""))
    return 0
