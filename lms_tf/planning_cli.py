"""``lms-tf plan`` and ``lms-tf max-batch``: the planner from the command line.

Both trace a model's plain train step once (batch dimension left unknown), size it for
the batch asked for, simulate it on a device preset and plan it for a budget. ``plan``
also traces the rewritten step and asks Grappler's virtual cluster for a second opinion.

Example:
    >>> from lms_tf.cli import build_parser
    >>> args = build_parser().parse_args(["plan", "--model", "ResNet50", "--batch", "8", "--budget", "25%"])
    >>> args.device, args.budget
    ('v100-16gb-pcie3', '25%')
"""

from __future__ import annotations

import json
import logging
import time
from typing import Dict, Optional, Tuple

import tensorflow as tf

from lms_tf.core.errors import InfeasibleBudgetError, LMSOptionError
from lms_tf.core.policy import Policies, resolve_budget
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.options import LMSOptions
from lms_tf.planner import make_budget_plan
from lms_tf.simulate import resident_bytes, simulate
from lms_tf.tf.trace import build_ir, trace_step_ir

logger = logging.getLogger("lms_tf")
MiB = 2**20


def _image_size(text: Optional[str]) -> int:
    if text is None:
        return 224
    parts = text.lower().replace(",", "x").split("x")
    try:
        sizes = [int(p) for p in parts if p]
    except ValueError:
        sizes = []
    if not sizes or len(set(sizes[:2])) != 1:
        raise LMSOptionError(f"--input-shape must be HxW with H == W (e.g. 224x224) or a sequence length; "
                             f"received {text!r}.")
    return sizes[0]


def _devices() -> Tuple[str, str]:
    """The managed device and host: the GPU if present, else two logical CPUs standing in."""
    if tf.config.list_physical_devices("GPU"):
        return "/GPU:0", "/CPU:0"
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    except RuntimeError:
        pass  # already initialised (tests, a second call)
    return "/CPU:0", "/CPU:1"


def trace_unbatched(args):
    """Builds the model and traces its plain train step with an unknown batch dimension.

    Returns:
        ``(model, step, graph, x_spec, y_spec)``.
    """
    from lms_tf.tf.workloads import build_model, train_step

    size = _image_size(args.input_shape)
    logger.info("building %s (%s)", args.model, args.input_shape or "224x224")
    model = build_model(args.model, image_size=size, classes=args.classes)
    x_spec = tf.TensorSpec((None,) + tuple(model.input_shape[1:]),
                           "int32" if model.inputs[0].dtype in ("int32", "int64") else "float32")
    y_spec = tf.TensorSpec((None,) + tuple(model.output_shape[1:-1]), "int32")
    step = train_step(model)
    started = time.perf_counter()
    graph = tf.function(step).get_concrete_function(x_spec, y_spec).graph
    logger.info("traced the plain train step (%d ops) in %.1f s", len(graph.get_operations()),
                time.perf_counter() - started)
    return model, step, graph, x_spec, y_spec


def _options(args, device: str, host: str, budget) -> LMSOptions:
    return LMSOptions(device=device, host=host, budget=budget, device_spec=args.device,
                      swap=not getattr(args, "no_swap", False),
                      recompute=False if getattr(args, "no_recompute", False) else "auto")


def run_plan(args) -> int:
    """``lms-tf plan``: prints the plan table and the peaks (simulator and oracle), or one JSON object."""
    from lms_tf.tf.diagnostics import virtual_gpu_peak

    device, host = _devices()
    spec = get_device_spec(args.device)
    cost = CostModel(spec)
    from lms_tf.tf.workloads import build_model, fit_step, synthetic_batch, train_step

    model = build_model(args.model, image_size=_image_size(args.input_shape), classes=args.classes)
    # --step fit: Keras's own train step, as model.fit traces it (a plan for LMSCallback(plan=));
    # --step custom: a GradientTape step (a plan for lms_tf.function(plan=)).
    step = fit_step(model) if args.step == "fit" else train_step(model)
    batch = synthetic_batch(model, args.batch)
    step_args = (batch,) if args.step == "fit" else batch
    logger.info("[1/4] tracing the plain %s train step at batch %d", args.step, args.batch)
    if args.step == "fit":  # the IR where LMSCallback builds it: right after Keras's train_step
        ir = trace_step_ir(model.train_step, batch, wrap=lambda inner: fit_step(model, inner=inner))
    else:
        ir = trace_step_ir(step, *batch)
    options = _options(args, device, host, args.budget)
    logger.info("[2/4] simulating and planning on %s", spec.name)
    started = time.perf_counter()
    baseline = simulate(ir, cost=cost)
    plan, error = None, None
    try:
        plan = make_budget_plan(ir, options.policies, device=options.device, cost=cost)
    except InfeasibleBudgetError as err:
        error = err
    plan_seconds = time.perf_counter() - started
    planned = simulate(ir, plan, cost=cost) if plan is not None else None

    oracle_plain = oracle_planned = None
    if not args.no_oracle:
        import lms_tf

        logger.info("[3/4] Grappler's virtual GPU: plain step")
        oracle_plain = virtual_gpu_peak(tf.function(step).get_concrete_function(*step_args), host=host,
                                        gpu_memory_bytes=spec.memory_bytes)
        if plan is not None:
            logger.info("[4/4] Grappler's virtual GPU: planned step (traced and rewritten)")
            # The same plan, applied: the oracle judges what was planned, without planning again.
            fn = lms_tf.function(step, device=options.device, host=options.host, plan=plan, device_spec=spec)
            oracle_planned = virtual_gpu_peak(fn.get_concrete_function(*step_args), host=host,
                                              gpu_memory_bytes=spec.memory_bytes)

    swapped = plan.swapped_bytes if plan else 0
    result = {
        "model": args.model, "step": args.step, "batch": args.batch, "device": spec.name, "budget": args.budget,
        "budget_bytes": plan.budget_bytes if plan else error.budget_bytes,
        "baseline_peak_bytes": baseline.peak_bytes,
        "planned_peak_bytes": planned.peak_bytes if planned else None,
        "planned_allocator_peak_bytes": plan.predictions.planned_allocator_peak_bytes if plan else None,
        "oracle_baseline_peak_bytes": oracle_plain, "oracle_planned_peak_bytes": oracle_planned,
        "resident_bytes": resident_bytes(ir),
        "swapped_bytes": swapped, "recomputed_bytes": plan.recomputed_bytes if plan else 0,
        "num_swapped": len(plan.swapped) if plan else 0, "num_recomputed": len(plan.recomputed) if plan else 0,
        "baseline_step_time_s": baseline.step_time_s,
        "predicted_step_time_s": planned.step_time_s if planned else None,
        "predicted_overhead": (planned.step_time_s / baseline.step_time_s) if planned else None,
        "link_lower_bound_s": link_lower_bound(baseline.compute_time_s, planned, cost) if planned else None,
        "feasible": plan is not None,
        "smallest_feasible_budget_bytes": error.smallest_feasible_bytes if error else None,
        "plan_seconds": round(plan_seconds, 3),
    }
    if plan is not None and args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(plan.to_json(indent=1))
        result["plan_file"] = args.out
    if args.plot:
        plot_timeline(args.plot, baseline, planned, result["budget_bytes"],
                      title=f"{args.model} batch {args.batch} on {spec.name}")
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result))
    else:
        if plan is not None:
            print(plan.summary(max_rows=args.max_rows))
        else:
            print(f"infeasible: {error}")
        print(f"\nsimulated peak: {baseline.peak_bytes / MiB:.1f} MiB plain -> "
              f"{(planned.peak_bytes / MiB) if planned else float('nan'):.1f} MiB planned, "
              f"{(plan.predictions.planned_allocator_peak_bytes / MiB) if plan else float('nan'):.1f} MiB in the GPU allocator's chunks "
              f"(budget {result['budget_bytes'] / MiB:.1f} MiB, resident variables {result['resident_bytes'] / MiB:.1f} MiB)")
        if oracle_plain is not None:
            print(f"Grappler virtual GPU: {oracle_plain / MiB:.1f} MiB plain -> "
                  f"{(oracle_planned or 0) / MiB:.1f} MiB planned")
        if planned is not None:
            print(f"predicted step: {baseline.step_time_s * 1e3:.1f} ms -> {planned.step_time_s * 1e3:.1f} ms "
                  f"({result['predicted_overhead']:.2f}x); planning took {plan_seconds:.2f} s")
        if args.plot:
            print(f"timeline written to {args.plot}")
        if result.get("plan_file"):
            print(f"plan written to {args.out} (apply it with LMSCallback(plan=...) or lms_tf.function(plan=...))")
    return 0 if plan is not None else 3


def link_lower_bound(compute_s: float, planned, cost: CostModel) -> float:
    """Least possible step time for the bytes the plan moves: the compute (recompute included)
    or the busier link direction, whichever is longer.

    Example:
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> class P: compute_time_s, swap_out_bytes, swap_in_bytes = 0.5, 12 * 10**9, 6 * 10**9
        >>> link_lower_bound(0.4, P, CostModel(get_device_spec("v100-16gb-pcie3")))
        1.0
    """
    return max(planned.compute_time_s, compute_s,
               cost.transfer_time(planned.swap_out_bytes, "device_to_host"),
               cost.transfer_time(planned.swap_in_bytes, "host_to_device"))


def plot_timeline(path: str, baseline, planned, budget_bytes: int, title: str = "") -> None:
    """Writes a PNG: device memory over the step, plain and planned, the budget, and swap traffic.

    Example:
        >>> import os, tempfile
        >>> from lms_tf.simulate import Simulation
        >>> sim = Simulation(10, "a", (), 1.0, 1.0, 0, 0, ((0.0, 5, 0, 0), (1.0, 10, 0, 0)))
        >>> out = os.path.join(tempfile.mkdtemp(), "t.png")
        >>> plot_timeline(out, sim, sim, 8)
        >>> open(out, "rb").read(4) == b"\\x89PNG"
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, traffic) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1]})
    scale = 1e3
    t, used = zip(*[(e[0] * scale, e[1] / MiB) for e in baseline.timeline]) if baseline.timeline else ((), ())
    memory.step(t, used, where="post", label=f"plain (peak {baseline.peak_bytes / MiB:.0f} MiB)", color="tab:red")
    if planned is not None and planned.timeline:
        t2, used2, out2, in2 = zip(*[(e[0] * scale, e[1] / MiB, e[2] / MiB, e[3] / MiB) for e in planned.timeline])
        memory.step(t2, used2, where="post", label=f"lms-tf plan (peak {planned.peak_bytes / MiB:.0f} MiB)",
                    color="tab:blue")
        traffic.step(t2, out2, where="post", label="device -> host in flight", color="tab:orange")
        traffic.step(t2, in2, where="post", label="host -> device in flight", color="tab:green")
    memory.axhline(budget_bytes / MiB, color="black", linestyle="--", label=f"budget {budget_bytes / MiB:.0f} MiB")
    memory.set_ylabel("device memory (MiB)")
    memory.set_title(title)
    memory.legend(loc="upper left")
    traffic.set_ylabel("swap traffic (MiB)")
    traffic.set_xlabel("simulated time (ms)")
    if planned is not None and planned.timeline:
        traffic.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fits(ir_for_batch, batch: int, policies: Policies, cost: CostModel, with_lms: bool, *,
         device: str) -> Tuple[bool, int]:
    """Whether ``batch`` fits the device (plain, or planned with ``budget="auto"``), and its peak."""
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
    """Doubling then bisection over batch sizes; returns (largest fitting batch, its peak)."""
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


def run_max_batch(args) -> int:
    """``lms-tf max-batch``: largest batch without and with lms-tf on a device preset."""
    device, host = _devices()
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
