"""The ``lms-tf`` command line.

Example:
    >>> from lms_tf.cli import build_parser
    >>> build_parser().parse_args(["explain", "--model", "ResNet50", "--batch-size", "8"]).batch_size
    8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

logger = logging.getLogger("lms_tf")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lms-tf``.

    Example:
        >>> build_parser().prog
        'lms-tf'
    """
    parser = argparse.ArgumentParser(prog="lms-tf", description="Large Model Support for TensorFlow / Keras 3.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print lms-tf, TensorFlow and Keras versions")
    explain = sub.add_parser(
        "explain", help="trace a model's train step, print the swap plan and the virtual-GPU peak before/after")
    explain.add_argument("--model", default="ResNet50", help="keras.applications name, .keras file or module:factory")
    explain.add_argument("--batch-size", type=int, default=32)
    explain.add_argument("--image-size", type=int, default=224)
    explain.add_argument("--classes", type=int, default=1000)
    explain.add_argument("--device", default=None,
                         help="managed accelerator (default: first GPU; without a GPU the CPU is split in two "
                              "logical devices, /CPU:0 as accelerator and /CPU:1 as host)")
    explain.add_argument("--host", default=None)
    explain.add_argument("--gpu-memory", default="16GiB", help="memory of the virtual GPU of the oracle")
    for name, kind in (("swapout-threshold", int), ("swapin-ahead", int), ("swapin-groupby", int),
                       ("min-swap-bytes", int)):
        explain.add_argument(f"--{name}", type=kind, default=None)
    explain.add_argument("--exclude", nargs="*", default=None)
    explain.add_argument("--recompute", default=None,
                         help="recompute policy: sqrt, cheap, or comma-separated layer names / op patterns")
    explain.add_argument("--no-swap", action="store_true", help="recompute only (needs --recompute)")
    explain.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    explain.add_argument("--max-rows", type=int, default=30)

    from lms_tf.cost.devices import PRESETS

    plan = sub.add_parser("plan", help="plan a model's train step for a device and budget: table, peaks, plot")
    maxb = sub.add_parser("max-batch", help="largest batch that fits a device without and with lms-tf")
    for p in (plan, maxb):
        p.add_argument("--model", required=True, help="keras.applications name, UNet, TransformerEncoder, "
                                                       ".keras file or module:factory")
        p.add_argument("--input-shape", default=None,
                       help="HxW (or sequence length) of keras.applications / built-in models, e.g. 224x224")
        p.add_argument("--classes", type=int, default=1000)
        p.add_argument("--device", default="v100-16gb-pcie3", help=f"device preset ({', '.join(PRESETS)}) or auto")
        p.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--batch", type=int, required=True)
    plan.add_argument("--budget", default="auto", help="bytes, 12GiB, 25%% of the plain peak, or auto")
    plan.add_argument("--plot", default=None, help="write the memory timeline to this PNG file")
    plan.add_argument("--step", choices=("custom", "fit"), default="custom",
                      help="the train step to plan: custom (a GradientTape step, for lms_tf.function) or fit "
                           "(Keras's train_step, for LMSCallback)")
    plan.add_argument("--out", default=None, help="write the plan as JSON to this file (for plan= of LMSCallback / "
                      "lms_tf.function)")
    plan.add_argument("--no-swap", action="store_true", help="recompute only")
    plan.add_argument("--no-recompute", action="store_true", help="swap only")
    plan.add_argument("--no-oracle", action="store_true", help="skip Grappler's virtual-GPU second opinion")
    plan.add_argument("--max-rows", type=int, default=40)
    maxb.add_argument("--max", type=int, default=4096, help="largest batch to try")
    return parser


def _parse_bytes(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _setup_devices(args) -> tuple:
    """Splits the CPU in two logical devices when there is no GPU and no device was named."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if args.device is None and not gpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
        logger.info("no GPU: emulating accelerator /CPU:0 and host /CPU:1 with two logical CPUs")
        return "/CPU:0", args.host or "/CPU:1"
    return args.device, args.host or "/CPU:0"


def _explain(args) -> int:
    import tensorflow as tf

    import lms_tf
    from lms_tf.tf.diagnostics import virtual_gpu_peak
    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step

    device, host = _setup_devices(args)
    options = {k: v for k, v in dict(
        device=device, host=host, swapout_threshold=args.swapout_threshold, swapin_ahead=args.swapin_ahead,
        swapin_groupby=args.swapin_groupby, min_swap_bytes=args.min_swap_bytes, exclude=args.exclude,
        recompute=(args.recompute if args.recompute in (None, "sqrt", "cheap") else args.recompute.split(",")),
        swap=False if args.no_swap else None).items()
        if v is not None}
    gpu_memory = _parse_bytes(args.gpu_memory)
    logger.info("[1/4] building %s (batch %d, %dx%d)", args.model, args.batch_size, args.image_size, args.image_size)
    model = build_model(args.model, image_size=args.image_size, classes=args.classes)
    x, y = synthetic_batch(model, args.batch_size)
    logger.info("[2/4] tracing the plain train step")
    started = time.perf_counter()
    plain = tf.function(train_step(model)).get_concrete_function(x, y)
    trace_seconds = time.perf_counter() - started
    logger.info("[3/4] tracing the lms-tf train step")
    fn = lms_tf.function(train_step(model), **options)
    rewritten = fn.get_concrete_function(x, y)
    logger.info("[4/4] simulating both on Grappler's virtual GPU (%.1f GiB)", gpu_memory / 2**30)
    before = virtual_gpu_peak(plain, host=host, gpu_memory_bytes=gpu_memory)
    after = virtual_gpu_peak(rewritten, host=host, gpu_memory_bytes=gpu_memory)
    plan = fn.plan
    result = {
        "model": args.model, "batch_size": args.batch_size, "image_size": args.image_size,
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
        print(plan.summary(max_rows=args.max_rows))
        print(f"\nGrappler virtual GPU peak: {before / 2**20:.1f} MiB plain -> {after / 2**20:.1f} MiB with lms-tf "
              f"({100 * after / before:.1f}%)")
        print(f"trace {trace_seconds:.1f} s; analyse + rewrite {fn.pass_seconds[-1]:.2f} s")
    return 0


def main(argv=None) -> int:
    """Entry point of the ``lms-tf`` console script.

    Example:
        >>> main(["version"])  # doctest: +ELLIPSIS
        lms-tf ...
        0
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command == "version":
        import tensorflow as tf

        import lms_tf
        from lms_tf import _compat

        keras = _compat.keras_module()
        print(f"lms-tf {lms_tf.__version__}, TensorFlow {tf.__version__}, Keras {keras.__version__}")
        return 0
    from lms_tf.core.errors import LMSError

    try:
        if args.command == "plan":
            from lms_tf.planning_cli import run_plan

            return run_plan(args)
        if args.command == "max-batch":
            from lms_tf.planning_cli import run_max_batch

            return run_max_batch(args)
        return _explain(args)
    except LMSError as err:
        print(f"lms-tf: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
