"""``lms-tf explain``: the default (budget-less, TFLMS-rule) plan of a model's train step, and Grappler's
virtual-GPU peak of the plain and the rewritten step.

Examples:
    >>> from lms_tf.cli import build_parser
    >>> build_parser().parse_args(["explain", "--model", "ResNet50", "--batch", "8"]).batch
    8
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from lms_tf.cli import args as cli_args

logger = logging.getLogger("lms_tf")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``explain`` and its flags (the swap rule's options as ``LMSOptions`` names them).

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> build_parser().parse_args(["explain", "--model", "x", "--batch", "2", "--swapin-ahead", "3"]).swapin_ahead
        3
    """
    explain = subparsers.add_parser(
        "explain", help="trace a model's train step, print the swap plan and the virtual-GPU peak before/after")
    cli_args.add_model_arguments(explain)
    cli_args.add_device_argument(explain)
    for name in ("swapout-threshold", "swapin-ahead", "swapin-groupby"):
        explain.add_argument(f"--{name}", type=cli_args.positive_int, default=None)
    explain.add_argument("--min-swap-bytes", type=cli_args.size, default=None)
    explain.add_argument("--exclude", nargs="*", default=None, help="layer names or op-name patterns to keep")
    explain.add_argument("--recompute", default=None,
                         help="recompute policy: sqrt, cheap, or comma-separated layer names / op patterns")
    explain.add_argument("--no-swap", action="store_true", help="recompute only (needs --recompute)")
    cli_args.add_output_arguments(explain, max_rows=30)
    return explain


def run(args) -> int:
    """Runs ``lms-tf explain``: prints the plan and the virtual-GPU peaks, or one JSON object.

    Returns:
        0.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> run(build_parser().parse_args(["explain", "--model", "mobilenetv2", "--input-shape", "32x32", "--classes", "10",
        ...                                "--batch", "2", "--json"]))  # doctest: +ELLIPSIS
        {"model": "mobilenetv2", "batch": 2, ..., "swapped_tensors": ...}
        0
    """
    import tensorflow as tf

    import lms_tf
    from lms_tf.cli.workload import devices
    from lms_tf.cost import get_device_spec
    from lms_tf.options import LMSOptions
    from lms_tf.tf.diagnostics import virtual_gpu_peak
    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step

    device, host = devices()
    recompute = args.recompute if args.recompute in (None, "sqrt", "cheap") else args.recompute.split(",")
    options = {k: v for k, v in dict(
        device=device, host=host, swapout_threshold=args.swapout_threshold, swapin_ahead=args.swapin_ahead,
        swapin_groupby=args.swapin_groupby, min_swap_bytes=args.min_swap_bytes, exclude=args.exclude,
        recompute=recompute, swap=False if args.no_swap else None).items() if v is not None}
    gpu_memory = get_device_spec(args.device).memory_bytes
    LMSOptions.from_kwargs(options, api="lms-tf explain")  # every option checked before the model is built
    logger.info("[1/4] building %s (batch %d, %dx%d)", args.model, args.batch, args.input_shape, args.input_shape)
    model = build_model(args.model, image_size=args.input_shape, classes=args.classes)
    x, y = synthetic_batch(model, args.batch)
    logger.info("[2/4] tracing the plain train step")
    started = time.perf_counter()
    plain = tf.function(train_step(model)).get_concrete_function(x, y)
    trace_seconds = time.perf_counter() - started
    logger.info("[3/4] tracing the lms-tf train step")
    fn = lms_tf.function(train_step(model), **options)
    rewritten = fn.get_concrete_function(x, y)
    logger.info("[4/4] simulating both on Grappler's virtual GPU (%.1f GiB, %s)", gpu_memory / 2**30, args.device)
    before = virtual_gpu_peak(plain, host=host, gpu_memory_bytes=gpu_memory)
    after = virtual_gpu_peak(rewritten, host=host, gpu_memory_bytes=gpu_memory)
    plan = fn.plan
    result = {
        "model": args.model, "batch": args.batch, "input_shape": args.input_shape, "device_preset": args.device,
        "device": plan.device, "host": plan.host, "swapped_tensors": len(plan.swapped),
        "swap_ins": plan.num_swap_ins, "swapped_bytes": plan.swapped_bytes,
        "recomputed_tensors": len(plan.recomputed), "recomputed_bytes": plan.recomputed_bytes,
        "recompute_clones": plan.num_recompute_clones,
        "oracle_baseline_peak_bytes": before, "oracle_lms_peak_bytes": after,
        "oracle_ratio": round(after / before, 4) if before else None,
        "trace_seconds": round(trace_seconds, 3), "pass_seconds": round(fn.pass_seconds[-1], 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(plan.summary(max_rows=args.max_rows, wide=args.wide))
        print(f"\nGrappler virtual GPU peak: {before / 2**20:.1f} MiB plain -> {after / 2**20:.1f} MiB with lms-tf "
              f"({100 * after / before:.1f}%)")
        print(f"trace {trace_seconds:.1f} s; analyse + rewrite {fn.pass_seconds[-1]:.2f} s")
    return 0
