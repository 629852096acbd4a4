"""``lms-tf partition``: cuts a model into pipeline stages balanced by predicted peak memory (mCAP).

The step is traced once at one micro-batch (``--batch`` / ``--microbatches`` samples); each layer's
memory and time come from the trace and the device preset, no profiling run. Prints the stages
(or ``--json``: one object with ``stages``, ``ideal_peak_bytes``, ``max_stage_peak_bytes``,
``predicted_step_time_s``, ``feasible``) and draws per-stage memory against each device
(``--plot``). ``--rule parameters|uniform`` gives DeepSpeed's rules, judged by the same model;
``--compare`` prints all three rules side by side.

Examples:
    >>> from lms_tf.cli import build_parser
    >>> args = build_parser().parse_args(["partition", "--model", "resnet50", "--batch", "32", "--stages", "4",
    ...                                   "--microbatches", "8", "--device", "v100-16gb-pcie3,h100-80gb-pcie5"])
    >>> args.device, args.schedule, args.rule
    (['v100-16gb-pcie3', 'h100-80gb-pcie5'], '1f1b', 'memory')
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from typing import List

from lms_tf.cli import args as cli_args
from lms_tf.pipeline.partition import OBJECTIVES, RULES, SCHEDULES

logger = logging.getLogger("lms_tf")


def device_presets(text: str) -> List[str]:
    """``--device`` for partition: one preset for every stage, or a comma-separated preset per stage.

    Examples:
        >>> device_presets("v100-16gb-pcie3"), device_presets("V100-16GB-PCIE3,h100-80gb-pcie5")
        (['v100-16gb-pcie3'], ['v100-16gb-pcie3', 'h100-80gb-pcie5'])
    """
    presets = [cli_args.device_preset(part.strip()) for part in text.split(",") if part.strip()]
    if not presets or "auto" in presets:
        raise argparse.ArgumentTypeError(f"must name device presets (one, or one per stage, comma-separated); "
                                         f"received {text!r}")
    return presets


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``partition`` and its flags.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> build_parser().parse_args(["partition", "--model", "unet", "--batch", "8", "--stages", "2",
        ...                            "--microbatches", "4", "--schedule", "gpipe"]).schedule
        'gpipe'
    """
    part = subparsers.add_parser("partition", help="cut a model into pipeline stages balanced by peak memory")
    cli_args.add_model_arguments(part)
    part.add_argument("--stages", type=cli_args.positive_int, required=True, help="pipeline stages (K)")
    part.add_argument("--microbatches", type=cli_args.positive_int, required=True,
                      help="micro-batches per step (M); --batch must split into them")
    part.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    part.add_argument("--device", type=device_presets, default=["v100-16gb-pcie3"],
                      help="device preset of every stage, or one per stage comma-separated (mixed devices)")
    part.add_argument("--budget", type=cli_args.size, default=None, help="bytes (e.g. 12GiB) no stage may exceed")
    part.add_argument("--rule", choices=RULES, default="memory",
                      help="memory (least largest stage peak), or DeepSpeed's parameters / uniform")
    part.add_argument("--objective", choices=OBJECTIVES, default="memory",
                      help="memory, or time (the fastest cut whose stages fit)")
    part.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="whose slots are counted")
    cli_args.add_host_budget_argument(part)
    part.add_argument("--no-swap", action="store_true",
                      help="never swap activations to the host (by default a stage that does not fit swaps what is "
                           "over its device, when no cut fits without it)")
    part.add_argument("--recompute", action="store_true",
                      help="a stage that does not fit may keep only what it receives and run its forward pass again "
                           "in each backward task (where swapping also fits it, the faster of the two)")
    part.add_argument("--calibrate", action="store_true",
                      help="calibrate on this machine's GPU: op times from a profiled step, memory from two real "
                           "steps with one and two micro-batches in flight (mCAP's), raising every stage to cover "
                           "them; needs the GPU --device names")
    part.add_argument("--compare", action="store_true", help="also print the three rules side by side")
    part.add_argument("--plot", default=None, help="write per-stage memory against each device to this PNG file")
    part.add_argument("--json", action="store_true", help="print one JSON object")
    return part


def comparison_table(partitions) -> str:
    """The rules side by side: largest stage, its ratio to the ideal, step time, fits.

    Examples:
        >>> from lms_tf.pipeline import PipelineProfile, partition_layers
        >>> profile = PipelineProfile.chain([400, 100, 100, 100], [1, 1, 1, 300])
        >>> print(comparison_table([partition_layers(profile, stages=2, microbatches=2, rule=r) for r in
        ...                         ("memory", "parameters", "uniform")]))
        rule        largest stage  / ideal  predicted step  fits
        memory      1004 B         1.54x    0.0180 s        yes
        parameters  1.2 KiB        1.85x    0.0270 s        yes
        uniform     1004 B         1.54x    0.0180 s        yes
    """
    from lms_tf.core.policy import format_bytes

    rows = [f"{'rule':<12}{'largest stage':<15}{'/ ideal':<9}{'predicted step':<16}fits"]
    for p in partitions:
        ratio = f"{p.max_stage_peak_bytes / p.ideal_peak_bytes:.2f}x"
        step = f"{p.predicted_step_time_s:.4f} s"
        rows.append(f"{p.rule:<12}{format_bytes(p.max_stage_peak_bytes):<15}{ratio:<9}{step:<16}"
                    + ("yes" if p.feasible else "no"))
    return "\n".join(rows)


def plot_stages(path: str, partitions, title: str = "") -> None:
    """Per-stage predicted peak as bars (one group per rule) against each stage's device memory.

    Examples:
        >>> import os, tempfile
        >>> from lms_tf.pipeline import PipelineProfile, partition_layers
        >>> p = partition_layers(PipelineProfile.chain([2**30] * 4), stages=2, microbatches=2, devices="v100-16gb-pcie3")
        >>> out = os.path.join(tempfile.mkdtemp(), "stages.png"); plot_stages(out, [p]); os.path.getsize(out) > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = len(partitions[0].stages)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * stages + 3), 4))
    width = 0.8 / len(partitions)
    for i, p in enumerate(partitions):
        xs = [k + (i - (len(partitions) - 1) / 2) * width for k in range(stages)]
        bars = ax.bar(xs, [s.predicted_peak_bytes / 2**30 for s in p.stages], width,
                      label=f"{p.rule} (largest {p.max_stage_peak_bytes / 2**30:.2f} GiB)"
                            + ("; its layer counts below" if i == 0 and len(partitions) > 1 else ""))
        for bar, stage in zip(bars, p.stages):
            if stage.host_bytes:   # hatched: the stage swaps activations to the host
                bar.set_hatch("//")
            elif stage.recompute:  # dotted: it runs its forward pass again
                bar.set_hatch("..")
    capacities = [s.capacity_bytes for s in partitions[0].stages]
    tallest = max(s.predicted_peak_bytes for p in partitions for s in p.stages)
    if any(capacities):
        if tallest >= 0.25 * min(c for c in capacities if c):
            for k, cap in enumerate(capacities):
                ax.hlines(cap / 2**30, k - 0.45, k + 0.45, colors="black", linestyles="dashed",
                          label="device memory" if k == 0 else None)
        else:  # drawn to scale, the bars would vanish under the device's memory
            ax.text(0.99, 0.97, "device memory off the scale: " + ", ".join(
                sorted({f"{c / 2**30:.1f} GiB" for c in capacities if c})), transform=ax.transAxes, ha="right",
                va="top", fontsize=8)
    ax.axhline(partitions[0].ideal_peak_bytes / 2**30, color="grey", linestyle=":", label="ideal (whole step / K)")
    ax.set_xticks(range(stages))
    ax.set_xticklabels([f"stage {s.index}\n{s.device or ''}\n{len(s.layers)} layer{'s' if len(s.layers) > 1 else ''}" for s in partitions[0].stages],
                       fontsize=8)
    ax.set_ylabel("predicted peak (GiB)")
    ax.set_title(title or f"{stages} stages, {partitions[0].schedule}, {partitions[0].microbatches} micro-batches",
                 fontsize=9, wrap=True)
    handles, labels = ax.get_legend_handles_labels()
    # A rule's legend entry would copy its first bar's hatching: draw it plain, and say once
    # what hatching means.
    from matplotlib.container import BarContainer
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=h.patches[0].get_facecolor()) if isinstance(h, BarContainer) and h.patches else h
               for h in handles]
    if any(s.host_bytes for p in partitions for s in p.stages):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
        labels.append("hatched: swaps activations to the host")
    if any(s.recompute for p in partitions for s in p.stages):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch=".."))
        labels.append("dotted: runs its forward pass again")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    """Runs ``lms-tf partition``.

    Returns:
        0 when every stage fits its device (and the budget), 3 when not.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> run(build_parser().parse_args(["partition", "--model", "unet", "--input-shape", "32x32", "--batch", "8",
        ...                                "--stages", "2", "--microbatches", "4", "--json"]))  # doctest: +ELLIPSIS
        {"model": "unet", ..., "feasible": true, "calibration": null}
        0
    """
    from lms_tf.core.errors import HostBudgetError, InfeasibleBudgetError
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.pipeline import check_arguments, partition_layers
    from lms_tf.tf.pipeline import check_calibration, profile_for_partition, trace_step
    from lms_tf.tf.workloads import build_model

    devices = args.device[0] if len(args.device) == 1 else args.device
    check_arguments(stages=args.stages, microbatches=args.microbatches, schedule=args.schedule, rule=args.rule,
                    objective=args.objective, devices=devices, budget=args.budget, swap=not args.no_swap,
                    host_budget=args.host_budget)
    if args.batch % args.microbatches:
        raise SystemExit(f"lms-tf partition: error: --batch {args.batch} does not split into {args.microbatches} "
                         f"equal micro-batches; use a --batch divisible by --microbatches")
    model = build_model(args.model, image_size=args.input_shape, classes=args.classes)
    calibration_device = check_calibration(model, devices) if args.calibrate else None
    optimizer = None
    if args.optimizer == "adam":
        from lms_tf._compat import keras_module

        optimizer = keras_module().optimizers.Adam()
    traced = trace_step(model, microbatch=args.batch // args.microbatches, optimizer=optimizer)
    cost = CostModel(get_device_spec(args.device[0]))
    profile, calibration = profile_for_partition(model, traced, cost, calibrate_on=calibration_device,
                                                 optimizer=optimizer)
    common = dict(stages=args.stages, microbatches=args.microbatches, schedule=args.schedule, devices=devices,
                  objective=args.objective, model=args.model, swap=not args.no_swap, host_budget=args.host_budget,
                  recompute=args.recompute)
    try:
        chosen = partition_layers(profile, budget=args.budget, rule=args.rule, **common)
        if calibration is not None:
            chosen = dataclasses.replace(chosen, calibration=calibration)
    except InfeasibleBudgetError as err:
        if args.json:
            print(json.dumps({"model": args.model, "feasible": False, "budget_bytes": err.budget_bytes,
                              "smallest_feasible_bytes": err.smallest_feasible_bytes}
                             | ({"host_budget_bytes": err.host_budget_bytes, "host_needed_bytes": err.host_needed_bytes}
                                if isinstance(err, HostBudgetError) else {})))
        else:
            print(f"infeasible: {err}")
        return 3
    others = [partition_layers(profile, rule=rule, **common) for rule in RULES if rule != args.rule] \
        if args.compare or args.plot else []
    result = chosen.to_dict()
    if others:
        result["compare"] = {p.rule: {"max_stage_peak_bytes": p.max_stage_peak_bytes,
                                      "predicted_step_time_s": p.predicted_step_time_s, "feasible": p.feasible}
                             for p in others}
    if args.plot:
        plot_stages(args.plot, [chosen] + others, title=f"{args.model} batch {args.batch}: {args.stages} stages, "
                                                       f"{args.schedule}, {args.microbatches} micro-batches")
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result))
    else:
        print(chosen.summary())
        if args.compare:
            print()
            print(comparison_table([chosen] + others))
        if args.plot:
            print(f"per-stage memory written to {args.plot}")
    return 0 if chosen.feasible else 3
