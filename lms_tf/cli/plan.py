"""``lms-tf plan``: plans a model's train step for a device and a budget; prints the table, the peaks, a plot.

The step is traced once at the batch asked for, simulated on the device preset and planned for the
budget; the plan can be saved (``--out``) and applied with ``plan=``. Grappler's virtual cluster
gives a second opinion on the plain and the rewritten step (``--no-oracle`` skips it).

Examples:
    >>> from lms_tf.cli import build_parser
    >>> args = build_parser().parse_args(["plan", "--model", "ResNet50", "--batch", "8", "--budget", "25%"])
    >>> args.device, args.budget
    ('v100-16gb-pcie3', 0.25)
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from lms_tf.cli import args as cli_args

logger = logging.getLogger("lms_tf")
MiB = 2**20


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``plan`` and its flags.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> build_parser().parse_args(["plan", "--model", "unet", "--batch", "2", "--step", "fit"]).step
        'fit'
    """
    plan = subparsers.add_parser("plan", help="plan a model's train step for a device and budget: table, peaks, plot")
    cli_args.add_model_arguments(plan)
    cli_args.add_device_argument(plan)
    plan.add_argument("--budget", type=cli_args.budget, default="auto",
                      help="bytes, 12GiB, 25%% of the plain peak, or auto (device memory - weights - margin)")
    plan.add_argument("--step", choices=("custom", "fit"), default="custom",
                      help="the train step to plan: custom (a GradientTape step, for lms_tf.function) or fit "
                           "(Keras's train_step, for LMSCallback)")
    plan.add_argument("--out", default=None, help="write the plan as JSON to this file (for plan= of LMSCallback / "
                      "lms_tf.function)")
    plan.add_argument("--plot", default=None, help="write the memory timeline to this PNG file")
    plan.add_argument("--no-swap", action="store_true", help="recompute only")
    plan.add_argument("--no-recompute", action="store_true", help="swap only")
    plan.add_argument("--no-oracle", action="store_true", help="skip Grappler's virtual-GPU second opinion")
    cli_args.add_weights_argument(plan)
    cli_args.add_host_budget_argument(plan)
    plan.add_argument("--hybrid", type=cli_args.positive_int, default=None, metavar="G",
                      help="plan one rank of G in hybrid parallelism: the Dense layers of at least "
                           "--min-param-bytes sharded across G ranks (lms_tf.parallel.hybridize), the rest replicated")
    plan.add_argument("--min-param-bytes", type=cli_args.size, default=16 * 2**20,
                      help="with --hybrid: the smallest Dense layer sharded (bytes or 16MiB; default 16MiB)")
    cli_args.add_output_arguments(plan, max_rows=40)
    return plan


def run(args) -> int:
    """Runs ``lms-tf plan``: prints the plan table and the peaks (simulator and oracle), or one JSON object.

    Returns:
        0 when the plan fits, 3 when the budget is infeasible.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> args = build_parser().parse_args(["plan", "--model", "unet", "--input-shape", "32x32", "--batch", "2",
        ...                                   "--budget", "1KiB", "--no-oracle", "--json"])
        >>> run(args)  # doctest: +ELLIPSIS
        {"model": "unet", "step": "custom", "batch": 2, ..., "feasible": false, ...}
        3
    """
    import tensorflow as tf

    from lms_tf.cli.plots import plot_timeline
    from lms_tf.cli.workload import devices
    from lms_tf.core.errors import InfeasibleBudgetError
    from lms_tf.core.policy import Policies
    from lms_tf.core.policy import format_bytes as human_bytes
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.planner import make_budget_plan
    from lms_tf.simulate import link_lower_bound, resident_bytes, simulate, variables_on_host
    from lms_tf.tf.diagnostics import virtual_gpu_peak
    from lms_tf.tf.trace import trace_step_ir

    device, host = devices()
    spec = get_device_spec(args.device)
    cost = CostModel(spec)
    from lms_tf.tf.workloads import build_model, compile_for_fit, fit_step, synthetic_batch, train_step

    model = build_model(args.model, image_size=args.input_shape, classes=args.classes)
    hybrid = None
    if args.hybrid:
        from lms_tf.parallel import hybridize

        # One rank's step: the sharded layers hold 1/G of their columns, the collectives are
        # stood in for by local ops of the same shapes.
        model = hybridize(model, min_param_bytes=args.min_param_bytes, group_size=args.hybrid, planning=True)
        hybrid = model.hybrid_plan
        logger.info("hybrid parallelism, one rank of %d:\n%s", args.hybrid, hybrid.summary())
    # --step fit: Keras's own train step, as model.fit traces it (a plan for LMSCallback(plan=));
    # --step custom: a GradientTape step (a plan for lms_tf.function(plan=)).
    if args.step == "fit":
        compile_for_fit(model)  # once: the traced step and the oracle's share the optimizer
    step = fit_step(model) if args.step == "fit" else train_step(model)
    batch = synthetic_batch(model, args.batch)
    step_args = (batch,) if args.step == "fit" else batch
    logger.info("[1/4] tracing the plain %s train step at batch %d", args.step, args.batch)
    if args.step == "fit":  # the IR where LMSCallback builds it: right after Keras's train_step
        ir = trace_step_ir(model.train_step, batch, wrap=lambda inner: fit_step(model, inner=inner))
    else:
        ir = trace_step_ir(step, *batch)
    policies = Policies(host=host, budget=args.budget, swap=not args.no_swap,
                        recompute=False if args.no_recompute else "auto", weights=args.weights,
                        host_budget=args.host_budget)
    logger.info("[2/4] simulating and planning on %s", spec.name)
    started = time.perf_counter()
    baseline = simulate(ir, cost=cost)
    plan, error = None, None
    try:
        plan = make_budget_plan(ir, policies, device=device, cost=cost)
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
            # The fetches copy variables that live on the host ('auto' moves its choice while tracing).
            if plan.offloaded_weights and args.weights == "host":
                lms_tf.place_weights(model, getattr(model, "optimizer", None), host=host)
                step = fit_step(model) if args.step == "fit" else train_step(model)  # a fresh optimizer
            fn = lms_tf.function(step, device=device, host=host, plan=plan, device_spec=spec,
                                 weights="auto" if args.weights == "auto" and plan.offloaded_weights else "device")
            oracle_planned = virtual_gpu_peak(fn.get_concrete_function(*step_args), host=host,
                                              gpu_memory_bytes=spec.memory_bytes)

    swapped = plan.swapped_bytes if plan else 0
    result = {
        "model": args.model, "step": args.step, "batch": args.batch, "device": spec.name, "budget": args.budget,
        "hybrid": args.hybrid, "sharded_layers": list(hybrid.sharded_layers) if hybrid else [],
        "budget_bytes": plan.budget_bytes if plan else error.budget_bytes,
        "baseline_peak_bytes": baseline.peak_bytes,
        "planned_peak_bytes": planned.peak_bytes if planned else None,
        "planned_allocator_peak_bytes": plan.predictions.planned_allocator_peak_bytes if plan else None,
        "oracle_baseline_peak_bytes": oracle_plain, "oracle_planned_peak_bytes": oracle_planned,
        "resident_bytes": resident_bytes(ir, variables_on_host(ir, [w.variable for w in plan.offloaded_weights])
                                         if plan else ()),
        "weights": args.weights, "offloaded_weight_bytes": plan.offloaded_weight_bytes if plan else 0,
        "host_peak_bytes": plan.predictions.host_peak_bytes if plan else None,
        "swapped_bytes": swapped, "recomputed_bytes": plan.recomputed_bytes if plan else 0,
        "num_swapped": len(plan.swapped) if plan else 0, "num_recomputed": len(plan.recomputed) if plan else 0,
        "baseline_step_time_s": baseline.step_time_s,
        "predicted_step_time_s": planned.step_time_s if planned else None,
        "predicted_overhead": (planned.step_time_s / baseline.step_time_s) if planned else None,
        "link_lower_bound_s": link_lower_bound(planned, cost) if planned else None,
        "least_step_time_s": plan.predictions.least_step_time_s if plan else None,
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
                      title=f"{args.model} batch {args.batch} on {spec.name}",
                      smallest_feasible_bytes=error.smallest_feasible_bytes if error else None)
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result))
    else:
        budget_text = f"budget {human_bytes(result['budget_bytes'])}, resident variables " \
                      f"{human_bytes(result['resident_bytes'])}"
        if plan is not None:
            print(plan.summary(max_rows=args.max_rows, wide=args.wide))
            print(f"\nsimulated peak: {human_bytes(baseline.peak_bytes)} plain -> {human_bytes(planned.peak_bytes)} "
                  f"planned, {human_bytes(plan.predictions.planned_allocator_peak_bytes)} in the GPU allocator's "
                  f"chunks ({budget_text})")
        else:
            print(f"infeasible: {error}")
            print(f"\nsimulated peak: {human_bytes(baseline.peak_bytes)} plain; no plan fits ({budget_text})")
        if oracle_plain is not None:
            planned_text = f" -> {human_bytes(oracle_planned)} planned" if oracle_planned is not None else ""
            print(f"Grappler virtual GPU: {human_bytes(oracle_plain)} plain{planned_text}")
        if planned is not None:
            print(f"predicted step: {baseline.step_time_s * 1e3:.1f} ms -> {planned.step_time_s * 1e3:.1f} ms "
                  f"({result['predicted_overhead']:.2f}x); planning took {plan_seconds:.2f} s")
        if args.plot:
            print(f"timeline written to {args.plot}")
        if result.get("plan_file"):
            print(f"plan written to {args.out} (apply it with LMSCallback(plan=...) or lms_tf.function(plan=...))")
    return 0 if plan is not None else 3
