"""``lms-tf max-batch``: the largest batch that fits a device preset, without and with lms-tf.

The step is traced once with an unknown batch dimension; each batch size is sized from that trace,
simulated, and (with lms-tf) planned for ``budget="auto"``: doubling, then bisection. The search
with lms-tf starts from the plain answer (what fits plain fits with lms-tf). A progress bar on
stderr shows each try (``#`` fits, ``-`` does not).

Examples:
    >>> from lms_tf.cli import build_parser
    >>> build_parser().parse_args(["max-batch", "--model", "ResNet50", "--max", "64"]).max
    64
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Callable, Dict, Optional, Tuple

from lms_tf.cli import args as cli_args
from lms_tf.core.errors import InfeasibleBudgetError
from lms_tf.core.ir import BatchSizedIR
from lms_tf.core.policy import Policies, resolve_budget
from lms_tf.cost.model import CostModel
from lms_tf.planner import make_budget_plan
from lms_tf.simulate import resident_bytes, simulate

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
    maxb.add_argument("--max", type=cli_args.positive_int, default=4096, help="largest batch to try")
    maxb.add_argument("--json", action="store_true", help="print one JSON object")
    return maxb


def fits(ir_for_batch, batch: int, policies: Policies, cost: CostModel, with_lms: bool, *,
         device: str) -> Tuple[bool, int]:
    """Whether ``batch`` fits the device (plain, or planned with ``budget="auto"``), and its peak.

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> fits(lambda mib: chain_ir(mib=mib), 8, Policies(), CostModel(get_device_spec("v100-16gb-pcie3")), False,
        ...      device="/device:GPU:0")   # three 8 MiB activations fit a 16 GB V100
        (True, 25165828)
    """
    ir = ir_for_batch(batch)
    baseline = simulate(ir, cost=cost)
    budget = resolve_budget("auto", baseline_peak_bytes=baseline.peak_bytes, memory_bytes=cost.device.memory_bytes,
                            device_name=cost.device.name, resident=resident_bytes(ir))
    if not with_lms:
        return baseline.peak_bytes <= budget, baseline.peak_bytes
    try:
        plan = make_budget_plan(ir, policies.replace(budget="auto"), device=device, cost=cost)
    except InfeasibleBudgetError:
        return False, baseline.peak_bytes
    return True, plan.predictions.planned_peak_bytes


def largest_batch(ir_for_batch, policies: Policies, cost, with_lms: bool, upper: int, *,
                  device: str, known_good: int = 0, progress=None) -> Tuple[int, Optional[int]]:
    """Doubling then bisection over batch sizes; returns (largest fitting batch, its peak).

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

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> largest_batch(lambda mib: chain_ir(mib=mib), Policies(), CostModel(get_device_spec("v100-16gb-pcie3")), False,
        ...               64, device="/device:GPU:0")[0]   # every size up to the cap fits
        64
    """
    good, good_peak, bad = known_good, None, None

    def attempt(batch: int) -> bool:
        nonlocal good, good_peak, bad
        ok, peak = fits(ir_for_batch, batch, policies, cost, with_lms, device=device)
        if progress is not None:
            progress(batch, ok)
        if ok:
            good, good_peak = batch, peak
        else:
            bad = batch
        return ok

    batch = 2 * known_good if known_good else 1
    while good < upper and attempt(min(batch, upper)):
        batch *= 2
    while bad is not None and bad - good > 1:
        attempt((good + bad) // 2)
    if good_peak is None and good:  # the known batch was never planned: plan it for its peak
        good_peak = fits(ir_for_batch, good, policies, cost, with_lms, device=device)[1]
    return good, good_peak


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

    def __init__(self, label: str, stream=None):
        self.label, self.stream = label, stream or sys.stderr
        self.marks, self.good, self.bad = "", None, None

    def __call__(self, batch: int, ok: bool) -> None:
        self.marks += "#" if ok else "-"
        if ok:
            self.good = batch if self.good is None else max(self.good, batch)
        else:
            self.bad = batch if self.bad is None else min(self.bad, batch)
        logger.debug("max-batch %s: batch %d %s", self.label, batch, "fits" if ok else "does not fit")
        self.stream.write("\r" + self._line())
        self.stream.flush()

    def _line(self) -> str:
        if not self.marks:
            return f"max-batch {self.label}: nothing to try (the answer so far is the largest allowed, --max)"
        bracket = ", ".join(part for part in (f"fits {self.good}" if self.good is not None else "",
                                              f"not {self.bad}" if self.bad is not None else "") if part)
        return f"max-batch {self.label} [{self.marks}] {len(self.marks)} tries: {bracket}"

    def close(self) -> None:
        self.stream.write("\r" + self._line() + "\n")
        self.stream.flush()


#: The batch sizes the step is sized at with TensorFlow's shape inference: the first two fix each
#: size's line in the batch, the third checks it.
SAMPLE_BATCHES = (8, 16, 24)


def sized_by_batch(graph) -> Callable[[int], object]:
    """Batch size -> the traced step's IR at that size: by arithmetic from three sizings when
    every size is linear in the batch (:class:`~lms_tf.core.ir.BatchSizedIR`), else by sizing
    each batch with TensorFlow (about a second each on ResNet-50).

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> sized_by_batch(f.get_concrete_function(tf.TensorSpec((None, 8))).graph)(1000).tensors["Relu:0"].nbytes
        32000
    """
    from lms_tf.tf.trace import build_ir

    sized = BatchSizedIR.fit({batch: build_ir(graph, batch_size=batch) for batch in SAMPLE_BATCHES})
    if sized is not None:
        return sized.at
    logger.info("max-batch: some tensor sizes are not linear in the batch; sizing the step with TensorFlow for each "
                "batch tried (slower)")
    cache: Dict[int, object] = {}

    def ir_for_batch(batch: int):
        if batch not in cache:
            cache.clear()
            cache[batch] = build_ir(graph, batch_size=batch)
        return cache[batch]

    return ir_for_batch


def run(args) -> int:
    """Runs ``lms-tf max-batch``: the largest batch without and with lms-tf on a device preset.

    Returns:
        0.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> run(build_parser().parse_args(["max-batch", "--model", "resnet50", "--input-shape", "32x32", "--classes", "10",
        ...                                "--max", "2", "--json"]))  # doctest: +ELLIPSIS
        {"model": "resnet50", "device": "v100-16gb-pcie3", "max_batch_plain": 2, "max_batch_lms": 2, ...}
        0
    """
    from lms_tf.cli.workload import devices, trace_unbatched
    from lms_tf.cost import CostModel, get_device_spec

    device, host = devices()
    spec = get_device_spec(args.device)
    cost = CostModel(spec)
    _, _, graph, _, _ = trace_unbatched(args)
    ir_for_batch = sized_by_batch(graph)
    policies = Policies(host=host, budget="auto", recompute="auto")
    answers = {}
    level = logger.level
    if not logger.isEnabledFor(logging.DEBUG):  # the bar replaces the planner's line per batch
        logger.setLevel(logging.WARNING)
    try:
        for with_lms in (False, True):
            bar = ProgressBar("with lms-tf" if with_lms else "plain")
            answers[with_lms] = largest_batch(ir_for_batch, policies, cost, with_lms, args.max, device=device,
                                              known_good=answers[False][0] if with_lms else 0, progress=bar)
            bar.close()
    finally:
        logger.setLevel(level)
    (plain, plain_peak), (lms, lms_peak) = answers[False], answers[True]
    result = {"model": args.model, "device": spec.name, "max_batch_plain": plain, "max_batch_lms": lms,
              "peak_bytes_plain": plain_peak, "peak_bytes_lms": lms_peak,
              "ratio": round(lms / plain, 2) if plain else None}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} on {spec.name}: largest batch {plain} plain, {lms} with lms-tf"
              + (f" ({lms / plain:.1f}x)" if plain else ""))
    return 0
