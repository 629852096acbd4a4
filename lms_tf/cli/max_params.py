"""``lms-tf max-params``: the largest decoder-only Transformer that trains on a device preset, four ways.

The family is :func:`~lms_tf.tf.workloads.decoder_lm` (tied embedding, ``--depth`` pre-norm
blocks of causal attention with 64-wide heads and a ``4 x width`` MLP), trained with Adam at
``--batch`` sequences of ``--seq-len`` tokens. Its depth is fixed; its width is searched, in
steps of one head. The Adam step is traced at four small widths only (two to five heads): every
size in it is a polynomial in the width (dimensions lines, bytes at most quadratics), so
:class:`~lms_tf.core.ir.ScaledIR` gives the step at any width by arithmetic, checked against
the fourth trace. Each width tried is simulated (and planned) for the device, four ways:

* ``plain``: every variable resident, the plain step's peak on top (held, like every plan, as
  TensorFlow's allocator holds it: in whole chunks);
* ``optimizer_on_host``: Adam's moments and step count in host memory (``optimizer_on_host=True``),
  the weights and the plain step's peak on the device;
* ``activations_planned``: swap and recompute planned for ``budget="auto"``, every variable
  resident;
* ``weights_and_activations``: the same with ``weights="host"``: the variables live on the host,
  each fetched per window of readers, the gradients copied out, the update run on the host. The
  host memory it needs must fit ``--host-budget`` (default: the host of the preset's class, not
  this machine's).

The search over the width is :func:`~lms_tf.cli.max_batch.largest_batch`'s guided search (it
ends on a width that fits whose next width does not, both tried).

Examples:
    >>> from lms_tf.cli import build_parser
    >>> build_parser().parse_args(["max-params", "--device", "v100-32gb-nvlink2"]).depth
    40
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from typing import Callable, Dict, Optional

from lms_tf.cli import args as cli_args
from lms_tf.cli.max_batch import Probe, ProgressBar, default_jobs, largest_batch, probes
from lms_tf.core.errors import HostBudgetError, InfeasibleBudgetError, LMSError
from lms_tf.core.ir import GraphIR, ScaledIR
from lms_tf.core.policy import Policies, format_bytes, machine_memory_bytes, safety_margin_bytes
from lms_tf.cost.model import CostModel
from lms_tf.planner import check_plain_step, make_budget_plan
from lms_tf.simulate import (input_bytes, link_lower_bound, optimizer_slots, resident_buffers, resident_bytes, simulate,
                             variables_on_host)

logger = logging.getLogger("lms_tf")

#: The model families ``--family`` names.
FAMILIES = ("decoder",)

#: The ways a model is trained, in the order the command reports them.
WAYS = ("plain", "optimizer_on_host", "activations_planned", "weights_and_activations")

#: Width of one attention head: the width grows a head at a time.
HEAD_SIZE = 64

#: Widths the step is traced at (two to five heads): three fix each size's quadratic, the fourth
#: checks it. One head is left out: a single head traces to a different graph.
SAMPLE_WIDTHS = (128, 192, 256, 320)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``max-params`` and its flags.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> args = build_parser().parse_args(["max-params", "--device", "h100-80gb-pcie5", "--seq-len", "2048"])
        >>> args.family, args.seq_len, args.batch
        ('decoder', 2048, 1)
    """
    maxp = subparsers.add_parser("max-params", help="largest decoder-only Transformer that trains on a device, "
                                                    "plain and with lms-tf")
    maxp.add_argument("--family", choices=FAMILIES, default="decoder",
                      help="model family scaled in width (decoder: GPT-style, tied embedding, 64-wide heads)")
    cli_args.add_device_argument(maxp)
    maxp.add_argument("--depth", type=cli_args.positive_int, default=40, help="blocks (default 40, as GPT-3 13B)")
    maxp.add_argument("--seq-len", type=cli_args.positive_int, default=1024, help="tokens per sequence (default 1024)")
    maxp.add_argument("--batch", type=cli_args.positive_int, default=1, help="sequences per step (default 1)")
    maxp.add_argument("--vocab", type=cli_args.positive_int, default=50257, help="vocabulary (default 50257, GPT-2's)")
    maxp.add_argument("--host-budget", type=cli_args.size, default=None,
                      help="host memory one process's planned step may hold (weights and slots on the host, "
                           "swapped tensors, gradients copied out); default: the host of the device preset's class")
    maxp.add_argument("--max-width", type=max_width, default=65536,
                      help="largest width to try (default 65536)")
    maxp.add_argument("--jobs", type=cli_args.positive_int, default=default_jobs(),
                      help="widths planned at once, one process each (default: the usable CPUs, at most 4)")
    maxp.add_argument("--json", action="store_true", help="print one JSON object")
    return maxp


def max_width(text: str) -> int:
    """``--max-width``: an int of at least the narrowest width traced.

    Examples:
        >>> max_width("64")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be at least 128 (two heads of 64: the narrowest width traced); received '64'
    """
    value = cli_args.positive_int(text)
    if value < SAMPLE_WIDTHS[0]:
        raise argparse.ArgumentTypeError(f"must be at least {SAMPLE_WIDTHS[0]} (two heads of {HEAD_SIZE}: the narrowest "
                                         f"width traced); received {text!r}")
    return value


def width_of(step: int) -> int:
    """The width of the search's ``step`` (1 is two heads, the narrowest traced).

    Examples:
        >>> width_of(1), width_of(79)
        (128, 5120)
    """
    return HEAD_SIZE * (step + 1)


def way_probe(ir_at: Callable[[int], GraphIR], way: str, cost: CostModel, *, device: str, host: str,
              host_budget: int) -> Callable[[int], Probe]:
    """Search step -> whether the decoder of that width trains ``way`` on the device (a :class:`Probe`).

    For the two ways planned by nothing but where the variables live, the need is the whole
    device memory the step takes (peak, resident variables, the safety margin) against the
    device's memory; for the planned ways it is the planner's smallest feasible budget (or, when
    the host is what runs out, the host memory against ``host_budget``). The probe's
    ``need_bytes`` and ``budget_bytes`` are those figures' square roots (what the search steers by).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> probe = way_probe(lambda width: weighted_chain_ir(), "plain", CostModel(get_device_spec("v100-16gb-pcie3")),
        ...                   device="/device:GPU:0", host="/device:CPU:0", host_budget=2**30)
        >>> probe(1).fits
        True
    """
    # The search steers by where a line through the memory two tries need meets the budget; a
    # decoder's memory grows as the square of its width (the weights), so the probe reports its
    # square root, nearly a line in the width.
    if way not in WAYS:
        raise LMSError(f"way_probe: way must be one of {', '.join(WAYS)}; received {way!r}")
    memory = cost.device.memory_bytes

    def probe(step: int) -> Probe:
        ir = ir_at(width_of(step))
        baseline = simulate(ir, cost=cost)
        if way in ("plain", "optimizer_on_host"):
            slots = optimizer_slots(ir) if way == "optimizer_on_host" else frozenset()
            host_need = host_bytes_with_slots_on_host(ir, slots)
            if host_need > host_budget:
                return Probe(False, baseline.peak_bytes, math.isqrt(host_need), math.isqrt(host_budget))
            # Held as the planner holds its plans (TensorFlow's allocator's whole chunks), so the
            # plain ways and the planned ones are judged by the same rule.
            resident, margin = resident_bytes(ir, slots) + input_bytes(ir), safety_margin_bytes(memory)
            budget = memory - resident - margin
            held = baseline.peak_bytes if budget <= 0 else check_plain_step(
                ir, budget, Policies(host=host), device=device, cost=cost).held_bytes
            need = held + resident + margin
            return Probe(need <= memory, baseline.peak_bytes, math.isqrt(need), math.isqrt(memory))
        policies = Policies(host=host, budget="auto", recompute="auto", host_budget=host_budget,
                            weights="host" if way == "weights_and_activations" else "device")
        try:
            plan = make_budget_plan(ir, policies, device=device, cost=cost)
        except HostBudgetError as err:
            return Probe(False, baseline.peak_bytes, math.isqrt(err.host_needed_bytes), math.isqrt(err.host_budget_bytes))
        except InfeasibleBudgetError as err:
            return Probe(False, baseline.peak_bytes, _root(err.smallest_feasible_bytes), _root(err.budget_bytes))
        return Probe(True, plan.predictions.planned_peak_bytes, None, plan.budget_bytes)

    return probe


def _root(nbytes: Optional[int]) -> Optional[int]:
    return math.isqrt(nbytes) if nbytes else None


def host_bytes_with_slots_on_host(ir: GraphIR, slots) -> int:
    """Host memory of a step whose optimizer ``slots`` live on the host: the slots, and a
    gradient per weight at most (each gradient is copied out for the update there).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> host_bytes_with_slots_on_host(weighted_chain_ir(), frozenset())
        0
    """
    if not slots:
        return 0
    variables = dict(resident_buffers(ir))
    return sum(variables[h] for h in slots) + sum(n for h, n in variables.items() if h not in slots)


def fit_decoder(args) -> ScaledIR:
    """Traces the decoder's step at :data:`SAMPLE_WIDTHS` and fits it as a :class:`ScaledIR`.

    Raises:
        LMSError: The sizes are not polynomials of the width (the family's step changed shape).
    """
    from lms_tf.cli.workload import trace_decoder_widths

    samples = trace_decoder_widths(SAMPLE_WIDTHS, depth=args.depth, seq_len=args.seq_len, batch=args.batch,
                                   vocab=args.vocab, head_size=HEAD_SIZE)
    scaled = ScaledIR.fit(samples)
    if scaled is None:
        raise LMSError(f"max-params: the decoder's train step at widths {', '.join(map(str, SAMPLE_WIDTHS))} does not "
                       f"scale as polynomials of the width (its ops or sizes differ in form), so wider steps cannot "
                       f"be sized by arithmetic. This is a bug in lms-tf: please report it with the command line.")
    return scaled


def largest_models(ir_at: Callable[[int], GraphIR], cost: CostModel, *, depth: int, vocab: int, max_width: int,
                   device: str, host: str, host_budget: int, jobs: int = 1, progress: bool = True) -> Dict[str, dict]:
    """The widest decoder each way trains on the device, and what that takes.

    Returns:
        Way -> ``{"width", "params", "device_peak_bytes", "host_bytes", "tries"}`` (``width`` 0 and
        ``params`` 0 when even two heads do not fit), and for the planned ways the largest plan's
        ``predicted_overhead``, ``predicted_step_time_s``, ``baseline_step_time_s`` and
        ``link_lower_bound_s``.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> found = largest_models(lambda width: weighted_chain_ir(), CostModel(get_device_spec("v100-16gb-pcie3")),
        ...                        depth=1, vocab=10, max_width=256, device="/device:GPU:0", host="/device:CPU:0",
        ...                        host_budget=2**30, progress=False)
        >>> found["plain"]["width"]    # a step that does not grow fits at every width up to the cap
        256
    """
    from lms_tf.tf.workloads import decoder_lm_params

    upper = max_width // HEAD_SIZE - 1
    found: Dict[str, dict] = {}
    for way in WAYS:
        bar = ProgressBar(way.replace("_", " "), command="max-params", show=lambda step: f"width {width_of(step)}")
        tries = []

        def progress_(step, ok, bar=bar, tries=tries):
            tries.append(step)
            if progress:
                bar(step, ok)

        # What fits plain fits with the slots on the host (the same test, fewer bytes). The planned
        # ways search from nothing known: the planner also counts the allocator's whole chunks, and
        # weights on the host need the host's memory, so plain's answer need not fit them.
        known_good = found["plain"]["step"] if way == "optimizer_on_host" else 0
        probe = way_probe(ir_at, way, cost, device=device, host=host, host_budget=host_budget)
        with probes(jobs, probe) as probe_all:
            step, peak = largest_batch(None, None, cost, way not in ("plain", "optimizer_on_host"), upper,
                                       device=device, known_good=known_good, progress=progress_,
                                       probe_all=probe_all, jobs=jobs)
        if progress:
            bar.close()
        width = width_of(step) if step else 0
        found[way] = {"step": step, "width": width, "params": decoder_lm_params(width, depth, vocab) if step else 0,
                      "device_peak_bytes": peak, "tries": len(tries)}
        if step:
            found[way].update(_at_answer(ir_at(width), way, cost, device=device, host=host, host_budget=host_budget))
    return found


def _at_answer(ir: GraphIR, way: str, cost: CostModel, *, device: str, host: str, host_budget: int) -> dict:
    """The host memory and, for the planned ways, the plan's predicted time at the answer."""
    if way in ("plain", "optimizer_on_host"):
        slots = optimizer_slots(ir) if way == "optimizer_on_host" else frozenset()
        return {"host_bytes": host_bytes_with_slots_on_host(ir, slots),
                "resident_bytes": resident_bytes(ir, slots)}
    policies = Policies(host=host, budget="auto", recompute="auto", host_budget=host_budget,
                        weights="host" if way == "weights_and_activations" else "device")
    plan = make_budget_plan(ir, policies, device=device, cost=cost)
    baseline, planned = simulate(ir, cost=cost), simulate(ir, plan, cost=cost)
    bound = link_lower_bound(planned, cost)
    return {"host_bytes": plan.predictions.host_peak_bytes, "plan": plan,
            "resident_bytes": resident_bytes(ir, variables_on_host(ir, [w.variable for w in plan.offloaded_weights])),
            "baseline_step_time_s": baseline.step_time_s, "predicted_step_time_s": planned.step_time_s,
            "predicted_overhead": planned.step_time_s / baseline.step_time_s, "link_lower_bound_s": bound,
            "overhead_vs_link_lower_bound": planned.step_time_s / bound,
            "bytes_to_device": planned.swap_in_bytes, "bytes_to_host": planned.swap_out_bytes,
            "host_compute_time_s": planned.host_compute_time_s}


def run(args) -> int:
    """Runs ``lms-tf max-params``: the largest decoder four ways on a device preset.

    Returns:
        0.
    """
    from lms_tf.cli.workload import devices
    from lms_tf.cost import get_device_spec

    spec = get_device_spec(args.device)
    host_budget = args.host_budget or spec.host_memory_bytes or machine_memory_bytes()
    device, host = devices()
    started = time.perf_counter()
    scaled = fit_decoder(args)
    level = logger.level
    if not logger.isEnabledFor(logging.DEBUG):  # the bars replace the planner's line per width
        logger.setLevel(logging.WARNING)
    try:
        found = largest_models(scaled.at, CostModel(spec), depth=args.depth, vocab=args.vocab,
                               max_width=args.max_width, device=device, host=host, host_budget=host_budget,
                               jobs=args.jobs)
    finally:
        logger.setLevel(level)
    plain, best = found["plain"]["params"], found["weights_and_activations"]
    result = {"family": args.family, "device": spec.name, "depth": args.depth, "seq_len": args.seq_len,
              "batch": args.batch, "vocab": args.vocab, "host_budget_bytes": host_budget, "optimizer": "adam",
              **{f"params_{way}": found[way]["params"] for way in WAYS},
              **{f"width_{way}": found[way]["width"] for way in WAYS},
              **{f"host_bytes_{way}": found[way].get("host_bytes") for way in WAYS},
              "ratio": round(best["params"] / plain, 2) if plain else None,
              "predicted_overhead": best.get("predicted_overhead"),
              "predicted_step_time_s": best.get("predicted_step_time_s"),
              "link_lower_bound_s": best.get("link_lower_bound_s"),
              "overhead_vs_link_lower_bound": best.get("overhead_vs_link_lower_bound"),
              "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"decoder, {args.depth} blocks, {args.batch} x {args.seq_len} tokens, Adam, on {spec.name} "
          f"(host budget {format_bytes(host_budget)}):")
    print(f"  {'way':<26} {'width':>6} {'parameters':>11} {'vs plain':>9} {'host memory':>12}")
    for way in WAYS:
        row = found[way]
        ratio = f"{row['params'] / plain:.1f}x" if plain else "-"
        print(f"  {way.replace('_', ' '):<26} {row['width']:>6} {row['params'] / 1e9:>10.2f}B {ratio:>9} "
              f"{format_bytes(row.get('host_bytes') or 0):>12}")
    if best.get("predicted_overhead") is not None:
        print(f"the largest (weights and activations planned): predicted step {best['predicted_step_time_s']:.2f} s, "
              f"{best['predicted_overhead']:.2f}x the plain step's with unlimited memory, "
              f"{best['overhead_vs_link_lower_bound']:.2f}x the least any plan moving its bytes could take")
    return 0
