"""``lms-tf max-batch``: the largest batch that fits a device preset, without and with lms-tf.

The step is traced once with an unknown batch dimension; each batch size is sized from that trace,
simulated, and (with lms-tf) planned for ``budget="auto"``: doubling, then bisection.

Examples:
    >>> from lms_tf.cli import build_parser
    >>> build_parser().parse_args(["max-batch", "--model", "ResNet50", "--max", "64"]).max
    64
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Dict, Optional, Tuple

from lms_tf.cli import args as cli_args
from lms_tf.core.errors import InfeasibleBudgetError
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
                  device: str) -> Tuple[int, Optional[int]]:
    """Doubling then bisection over batch sizes; returns (largest fitting batch, its peak).

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> largest_batch(lambda mib: chain_ir(mib=mib), Policies(), CostModel(get_device_spec("v100-16gb-pcie3")), False,
        ...               64, device="/device:GPU:0")[0]   # every size up to the cap fits
        64
    """
    label = "with lms-tf" if with_lms else "plain"
    good, good_peak, bad = 0, None, None
    batch = 1
    while batch <= upper:
        ok, peak = fits(ir_for_batch, batch, policies, cost, with_lms, device=device)
        logger.info("max-batch %s: batch %d %s", label, batch, "fits" if ok else "does not fit")
        if not ok:
            bad = batch
            break
        good, good_peak = batch, peak
        batch *= 2
    if bad is None:
        return good, good_peak
    while bad - good > 1:
        middle = (good + bad) // 2
        ok, peak = fits(ir_for_batch, middle, policies, cost, with_lms, device=device)
        logger.info("max-batch %s: batch %d %s", label, middle, "fits" if ok else "does not fit")
        if ok:
            good, good_peak = middle, peak
        else:
            bad = middle
    return good, good_peak


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
    from lms_tf.tf.trace import build_ir

    device, host = devices()
    spec = get_device_spec(args.device)
    cost = CostModel(spec)
    _, _, graph, _, _ = trace_unbatched(args)
    cache: Dict[int, object] = {}

    def ir_for_batch(batch: int):
        if batch not in cache:
            cache.clear()
            cache[batch] = build_ir(graph, batch_size=batch)
        return cache[batch]

    policies = Policies(host=host, budget="auto", recompute="auto")
    plain, plain_peak = largest_batch(ir_for_batch, policies, cost, False, args.max, device=device)
    lms, lms_peak = largest_batch(ir_for_batch, policies, cost, True, args.max, device=device)
    result = {"model": args.model, "device": spec.name, "max_batch_plain": plain, "max_batch_lms": lms,
              "peak_bytes_plain": plain_peak, "peak_bytes_lms": lms_peak,
              "ratio": round(lms / plain, 2) if plain else None}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} on {spec.name}: largest batch {plain} plain, {lms} with lms-tf"
              + (f" ({lms / plain:.1f}x)" if plain else ""))
    return 0
