"""Benchmark of the budget planner (issue "Planner"), every column measured in one run.

For the zoo (ResNet-50, VGG-16, MobileNetV2, a U-Net, a Transformer encoder) at a fixed
batch, on the presets v100-16gb-pcie3 and h100-80gb-pcie5:

* peak of the plain step: the real CPU allocator (this machine, the step really runs), the
  lms-tf simulator, and Grappler's virtual-GPU oracle;
* the simulator against the real CPU allocator, for the plain step and a recompute-only
  (``recompute="sqrt"``) step: summed tensor bytes, and the same allocations replayed through
  the model of TensorFlow's BFC allocator (whole chunks, as ``get_memory_info`` counts them);
* lms-tf at a budget of 25% of the plain step's simulated peak: simulated and oracle peaks
  (where 25% is infeasible, the plan at the smallest feasible budget the planner names);
* the oracle again, told the variable shapes, on serialized steps (``serialize=True``: the
  compute ops chained in the simulator's order), plain and planned;
* Grappler's own memory optimizer (SWAPPING_HEURISTICS, RECOMPUTATION_HEURISTICS), run
  offline (three runs each, without and with the variable shapes) and judged by the same
  oracle, its swap copies counted in host memory;
* lms-tf's predicted overhead against the link lower bound;
* each plan replayed with random orders of the ops made ready together (how much
  its peak depends on the executor's tie order, which varies between processes);

plus the largest ResNet-50 224x224 batch without and with lms-tf on v100-16gb-pcie3, the time
to plan the ResNet-152 step, and a memory-timeline PNG.

    .venv/bin/python benchmarks/planner.py      # tables into docs/benchmarks/planner.md, docs/planner_timeline.png
    .venv/bin/python benchmarks/planner.py --rows-from-last-run   # the zoo rows as the last run measured them
"""

import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the CPU allocator reports peaks only as BFC

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from publish import OUT, publish  # noqa: E402 - benchmarks/publish.py, beside this script

import lms_tf  # noqa: E402
from lms_tf.cli.max_batch import largest_batch, sized_by_batch  # noqa: E402
from lms_tf.cli.plots import plot_timeline  # noqa: E402
from lms_tf.core.errors import InfeasibleBudgetError  # noqa: E402
from lms_tf.core.plan import Decision  # noqa: E402
from lms_tf.core.policy import Policies  # noqa: E402
from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.planner import make_budget_plan  # noqa: E402
from lms_tf.simulate import (  # noqa: E402
    kernel_scratch_bytes,
    simulate,
    tensorflow_cpu_allocator,
    tensorflow_gpu_allocator,
)
from lms_tf.simulate.replay import EDGE_SET_INLINE  # noqa: E402
from lms_tf.tf.diagnostics import (  # noqa: E402
    cpu_kernel_library,
    grappler_accumulated_sums,
    grappler_baseline_report,
    virtual_gpu_peak,
    virtual_gpu_peak_report,
)
from lms_tf.tf.trace import build_ir  # noqa: E402
from lms_tf.tf.workloads import build_model, synthetic_batch, train_step  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.allocator_runs import run_allocator_worker  # noqa: E402 - fresh processes, as the allocator validation

log = logging.getLogger("benchmark")
MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = [("ResNet50", 224, 32), ("VGG16", 224, 16), ("MobileNetV2", 224, 32), ("UNet", 256, 8),
       ("TransformerEncoder", 512, 16)]
PRESETS = ("v100-16gb-pcie3", "h100-80gb-pcie5")
BUDGET = "25%"
#: The model whose plain and planned memory timelines the README shows (swaps and recompute both).
TIMELINE_MODEL = "ResNet50"
#: Random tie orders replayed for every plan (``simulate(..., tie_seed=)``: the ops made
#: ready by a node with more than 8 out-edges, which TensorFlow queues in an order that differs
#: between processes). Seeds from 100 up: the planner itself checks seeds 0-3.
TIE_SEEDS = 8
#: The ResNet-152 planning time is the median of this many plans: one timing on a shared
#: 2-core machine moves by +-25% from run to run.
PLANNING_REPEATS = 5
#: Budgets tried for the ResNet-152 planning time, the first whose plan swaps is timed.
R152_BUDGETS = ("25%", "35%", "50%", "70%")
#: Runs of each of Grappler's heuristics per model: its swap pass picks different tensors from
#: run to run (the table gives the median and the range).
GRAPPLER_RUNS = 3
GRAPPLER_MODES = ("SWAPPING_HEURISTICS", "RECOMPUTATION_HEURISTICS")


def real_peak(fn, x, y):
    """Median real CPU-allocator peak of 3 steps (after a warm-up step)."""
    fn(x, y).numpy()
    peaks = []
    for _ in range(3):
        with lms_tf.measure_peak_memory("CPU:0", settle_seconds=0.3) as memory:
            fn(x, y).numpy()
        peaks.append(memory.peak_bytes)
    return statistics.median(peaks)


def plan_at_smallest_feasible(ir, preset, cost, floor):
    """The plan at the smallest feasible budget the planner named, 0.2% above it (it is "about":
    planning for another budget explores other candidates, whose chunks differ by KiB)."""
    for _ in range(3):
        options = Policies(host="/CPU:1", budget=int(floor * 1.002), recompute="auto")
        try:
            return make_budget_plan(ir, options, device="/device:CPU:0", cost=cost)
        except InfeasibleBudgetError as err:
            floor = err.smallest_feasible_bytes
    raise RuntimeError(f"no plan near the smallest feasible budget the planner named ({floor} bytes)")


def grappler_baselines(concrete):
    """Grappler's own memory optimizer on the plain step, told a device of 25% of the plain step's
    oracle peak (lms-tf is given 25% of its simulated one), judged by the same oracle. Without and
    with the variable shapes (``variable_shapes=``), :data:`GRAPPLER_RUNS` runs of each heuristic."""
    results = {}
    for judge, shaped in (("default", False), ("shaped", True)):
        plain = virtual_gpu_peak(concrete, variable_shapes=shaped)
        for mode in GRAPPLER_MODES:
            reports = [grappler_baseline_report(concrete, mode, target_bytes=max(int(0.25 * plain), 1),
                                                variable_shapes=shaped) for _ in range(GRAPPLER_RUNS)]
            results[f"{judge}_{mode}"] = {"plain": plain, "peaks": [r.peak_bytes for r in reports],
                                          "swapped": [len(r.swapped) for r in reports],
                                          "recomputed": [len(r.recomputed) for r in reports]}
    return results


def _workspace_at_peak(ir, simulation):
    """The cuDNN workspace the simulator's rule gives the op running at the simulated peak (0 when a
    copy or a clone, which hold none, runs there). No CPU can check that rule; a peak without it
    is at least the peak less this and at most the peak (each moment only loses workspace)."""
    if simulation.peak_op not in {op.name for op in ir.ops}:
        return 0
    return kernel_scratch_bytes(ir, ir.op(simulation.peak_op), "cudnn")


def model_rows(name, size, batch):
    keras.utils.set_random_seed(0)
    classes = 1000 if name != "UNet" else 2
    model = build_model(name, image_size=size, classes=classes)
    x, y = synthetic_batch(model, batch)
    step = train_step(model)
    plain = tf.function(step)
    concrete = plain.get_concrete_function(x, y)
    ir = build_ir(concrete.graph)
    log.info("%s %dx%d b%d: %d ops; measuring the real CPU peak", name, size, size, batch, len(ir.ops))
    real = real_peak(plain, x, y)
    validation_cost = CostModel(get_device_spec(PRESETS[0]))
    plain_sim = simulate(ir, cost=validation_cost, allocator=tensorflow_cpu_allocator(), kernels=cpu_kernel_library(),
                         accumulated_sums=grappler_accumulated_sums(concrete))
    log.info("  recompute-only step: real CPU peak and simulation")
    sqrt = lms_tf.function(step, device="/CPU:0", swap=False, recompute="sqrt")
    sqrt.get_concrete_function(x, y)
    sqrt_real = real_peak(sqrt, x, y)
    sqrt_sim = simulate(sqrt.plain_irs[-1], sqrt.plan, cost=validation_cost, allocator=tensorflow_cpu_allocator(),
                        kernels=cpu_kernel_library(),
                        accumulated_sums=grappler_accumulated_sums(sqrt.get_concrete_function(x, y)))
    validation = {"real_plain": real, "sum_plain": plain_sim.peak_bytes, "allocator_plain": plain_sim.allocator_peak_bytes,
                  "real_sqrt": sqrt_real, "sum_sqrt": sqrt_sim.peak_bytes, "allocator_sqrt": sqrt_sim.allocator_peak_bytes}
    # Grappler's memory optimizer acts only when the step does not fit its device: it is given a
    # device of the budget's size (the budget as Grappler measures it), so both aim at one target.
    log.info("  Grappler's own memory optimizer (%d runs per heuristic and judge)", GRAPPLER_RUNS)
    grappler = grappler_baselines(concrete)
    rows = []
    for preset in PRESETS:
        spec = get_device_spec(preset)
        cost = CostModel(spec)
        baseline = simulate(ir, cost=cost)
        log.info("  %s: oracle and Grappler's heuristics", preset)
        oracle_plain = virtual_gpu_peak(concrete, gpu_memory_bytes=spec.memory_bytes)
        options = Policies(host="/CPU:1", budget=BUDGET, recompute="auto")
        row = {"model": name, "size": size, "batch": batch, "device": preset, "real_plain": real,
               "validation": validation,
               "sim_plain": baseline.peak_bytes, "oracle_plain": oracle_plain,
               "grappler": grappler}
        log.info("  %s: oracle with variable shapes, serialized plain step", preset)
        serialized = lms_tf.function(step, device="/CPU:0", swap=False, serialize=True, device_spec=spec)
        report = virtual_gpu_peak_report(serialized.get_concrete_function(x, y), gpu_memory_bytes=spec.memory_bytes,
                                         variable_shapes=True)
        row["oracle_plain_shaped"] = report.peak_bytes
        row["oracle_plain_shaped_once"] = report.peak_bytes_counting_buffers_once
        try:
            started = time.perf_counter()
            plan = make_budget_plan(ir, options, device="/device:CPU:0", cost=cost)
            row.update(feasible=True, plan_seconds=time.perf_counter() - started)
        except InfeasibleBudgetError as err:
            # Planned instead at the smallest budget that fits ("about": 0.2% above it), so the
            # plan's overhead and the oracle's reading are still measured.
            row.update(feasible=False, smallest_feasible=err.smallest_feasible_bytes)
            plan = plan_at_smallest_feasible(ir, preset, cost, err.smallest_feasible_bytes)
        planned = simulate(ir, plan, cost=cost)
        log.info("  %s: tracing the planned step for the oracle", preset)
        fn = lms_tf.function(step, device="/CPU:0", host="/CPU:1", budget=plan.budget_bytes, device_spec=spec)
        row.update(workspace_plain=_workspace_at_peak(ir, baseline), workspace_lms=_workspace_at_peak(ir, planned))
        row.update(budget=plan.budget_bytes, sim_lms=planned.peak_bytes,
                   oracle_lms=virtual_gpu_peak(fn.get_concrete_function(x, y), gpu_memory_bytes=spec.memory_bytes),
                   overhead=planned.step_time_s / baseline.step_time_s,
                   lower_bound=(None if plan.predictions.least_step_time_s is None
                                else plan.predictions.least_step_time_s / baseline.step_time_s),
                   least_traffic=plan.predictions.least_traffic_bytes,
                   plan_traffic=plan.predictions.bytes_to_host,
                   swapped=plan.swapped_bytes, recomputed=plan.recomputed_bytes)
        log.info("  %s: oracle with variable shapes, serialized planned step", preset)
        serialized = lms_tf.function(step, device="/CPU:0", host="/CPU:1", budget=plan.budget_bytes,
                                     device_spec=spec, serialize=True)
        report = virtual_gpu_peak_report(serialized.get_concrete_function(x, y),
                                         gpu_memory_bytes=spec.memory_bytes, variable_shapes=True)
        row["oracle_lms_shaped"] = report.peak_bytes
        row["oracle_lms_shaped_once"] = report.peak_bytes_counting_buffers_once
        log.info("  %s: the plan's recompute-only part, serialized, on the real CPU allocator", preset)
        row.update(_recompute_part_on_the_real_allocator(name, size, batch, classes, plan, spec))
        ties = [simulate(ir, plan, cost=cost, tie_seed=seed, allocator=tensorflow_gpu_allocator(spec.memory_bytes))
                for seed in range(100, 100 + TIE_SEEDS)]
        row.update(tie_ops=sum(len(successors) > EDGE_SET_INLINE for successors in _successors(ir).values()),
                   tie_peaks=[t.peak_bytes for t in ties], tie_held=[t.held_bytes for t in ties],
                   tie_times=[t.step_time_s / baseline.step_time_s for t in ties])
        if preset == PRESETS[0] and name == TIMELINE_MODEL:
            plot_timeline(os.path.join(ROOT, "docs", "planner_timeline.png"), baseline, planned, plan.budget_bytes,
                          title=f"{name} {size}x{size} batch {batch} on {preset}, budget "
                                f"{BUDGET if row['feasible'] else mib(plan.budget_bytes) + ' MiB (smallest feasible)'}")
        rows.append(row)
        log.info("  %s: %s", preset, {k: v for k, v in row.items() if k not in ("model", "size", "batch")})
    return rows


def _successors(ir):
    readers = {op.name: set() for op in ir.ops}
    for op in ir.ops:
        for name in op.inputs:
            if name in ir.tensors:
                readers[ir.tensors[name].producer].add(op.name)
        for name in op.control_inputs:
            readers.setdefault(name, set()).add(op.name)
    return readers


def _recompute_part_on_the_real_allocator(name, size, batch, classes, plan, spec):
    """The plan with its swaps dropped (a swap moves no bytes between logical CPU devices), applied
    with ``plan=`` and ``serialize=True`` in a fresh process with one inter-op thread, as the
    allocator validation runs its steps (``tests/allocator_worker.py --step plan``): its real
    CPU-allocator peak against the simulator's. In this process, after the other steps, the
    allocator keeps the regions they grew, and two inter-op threads run held ops beside chained ones."""
    recompute_only = dataclasses.replace(plan, decisions=tuple(
        d if d.decision is Decision.RECOMPUTE else dataclasses.replace(d, decision=Decision.KEEP, swap_ins=(),
                                                                        reason="kept: swaps dropped for the CPU run")
        for d in plan.decisions))
    if not recompute_only.recomputed:
        return {"real_recompute_part": None}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        file.write(recompute_only.to_json())
    try:
        row = run_allocator_worker("--order", "serialized", "--step", "plan", "--plan", file.name,
                                   "--classes", str(classes), "--device-spec", spec.name,
                                   f"{name},{size},{batch}", timeout=3600)[0]["plan_serialized"]
    finally:
        os.unlink(file.name)
    return {"real_recompute_part": row["real"], "sim_recompute_part": row["blind_allocator"],
            "recomputed_in_part": len(recompute_only.recomputed), "inversions_recompute_part": row["inversions"]}


def max_batch_row():
    log.info("largest ResNet-50 224x224 batch on v100-16gb-pcie3")
    keras.utils.set_random_seed(0)
    model = build_model("ResNet50", image_size=224, classes=1000)
    graph = tf.function(train_step(model)).get_concrete_function(
        tf.TensorSpec((None, 224, 224, 3)), tf.TensorSpec((None,), tf.int32)).graph
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    ir_for_batch, _ = sized_by_batch(graph)
    options = Policies(host="/CPU:1", budget="auto", recompute="auto")
    started = time.perf_counter()
    plain, plain_peak = largest_batch(ir_for_batch, options, cost, False, 4096, device="/device:CPU:0")
    lms, lms_peak = largest_batch(ir_for_batch, options, cost, True, 4096, device="/device:CPU:0", known_good=plain)
    seconds = time.perf_counter() - started
    # Grappler's judgement of the plan at the answer is the max-batch benchmark's
    # (benchmarks/max_batch.py, both orders, against the room the device leaves the step and its batch).
    return {"plain": plain, "lms": lms, "plain_peak": plain_peak, "lms_peak": lms_peak, "seconds": seconds}


def resnet152_planning_seconds(repeats=PLANNING_REPEATS):
    """Seconds to plan the ResNet-152 step at the first of :data:`R152_BUDGETS` where the plan swaps,
    each of ``repeats`` plans (one IR), its op count, the budget and what the plan moves. An
    infeasible budget is never timed."""
    keras.utils.set_random_seed(0)
    model = build_model("ResNet152", image_size=224, classes=1000)
    x, y = synthetic_batch(model, 32)
    ir = build_ir(tf.function(train_step(model)).get_concrete_function(x, y).graph)
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    for budget in R152_BUDGETS:
        options = Policies(host="/CPU:1", budget=budget, recompute="auto")
        try:
            plan = make_budget_plan(ir, options, device="/device:CPU:0", cost=cost)
        except InfeasibleBudgetError:
            continue
        if plan.swapped:
            break
    else:
        raise RuntimeError(f"no budget of {R152_BUDGETS} gave a feasible ResNet-152 plan that swaps")
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        make_budget_plan(ir, options, device="/device:CPU:0", cost=cost)
        seconds.append(time.perf_counter() - started)
    return seconds, len(ir.ops), budget, len(plan.swapped), len(plan.recomputed)


def mib(v):
    return "–" if v is None else f"{v / MiB:.0f}"


def _bound(row):
    """The least-time columns, or why there is no bound (the plan fits only by reordering ops)."""
    if row["lower_bound"] is None:
        return "none: moving tensors alone cannot fit; the plan also reorders ops | –"
    return f"{row['lower_bound']:.2f}x | {row['overhead'] / row['lower_bound']:.2f}"


def _at_budget(row):
    """Marks a row whose plan was made at the smallest feasible budget, the asked one being infeasible."""
    if row["feasible"]:
        return ""
    return f"{BUDGET} infeasible; at the smallest feasible, {mib(row['budget'])} ({row['budget'] / row['sim_plain']:.2f}): "


def validation_table(rows):
    lines = ["Simulator against the real CPU allocator (median of 3 real steps; the simulator predicts the order, "
             "it is not given the real one). \"sum\": bytes of the live tensors; \"allocator\": the same "
             "allocations through the model of TensorFlow's BFC allocator.", "",
             "| model | plain: real | sum (ratio) | allocator (ratio) | recompute sqrt: real | sum (ratio) | "
             "allocator (ratio) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["device"] != PRESETS[0]:
            continue
        v = r["validation"]
        cells = []
        for kind in ("plain", "sqrt"):
            real = v[f"real_{kind}"]
            cells.append(f"{mib(real)} | {mib(v[f'sum_{kind}'])} ({v[f'sum_{kind}'] / real:.2f}) | "
                         f"{mib(v[f'allocator_{kind}'])} (**{v[f'allocator_{kind}'] / real:.2f}**)")
        lines.append(f"| {r['model']} {r['size']}² b{r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows, batch_row, r152):
    lines = [validation_table(rows), "",
        f"Budget: {BUDGET} of the plain step's simulated peak. Peaks in MiB; ratios against the plain step "
        f"by the same judge.", "",
        "| model | device | real CPU plain | sim plain | sim/real | oracle plain | lms-tf sim (ratio) | lms-tf oracle "
        "(ratio) | oracle ratio − sim ratio | Grappler swap (ratio) | Grappler recompute (ratio) | predicted overhead | "
        "least time of any plan | overhead / least | plan's copies out (MiB) | least plan's copies out (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"{r['model']} {r['size']}² b{r['batch']}"
        head = (f"| {name} | {r['device']} | {mib(r['real_plain'])} | {mib(r['sim_plain'])} | "
                f"{r['sim_plain'] / r['real_plain']:.2f} | {mib(r['oracle_plain'])} | ")
        grappler = ""
        for mode in GRAPPLER_MODES:
            base = r["grappler"][f"default_{mode}"]
            peak = statistics.median(base["peaks"])
            grappler += f"{mib(peak)} ({peak / base['plain']:.2f}) | "
        sim_ratio, oracle_ratio = r["sim_lms"] / r["sim_plain"], r["oracle_lms"] / r["oracle_plain"]
        lines.append(head + _at_budget(r) + f"{mib(r['sim_lms'])} ({sim_ratio:.2f}) | {mib(r['oracle_lms'])} "
                     f"({oracle_ratio:.2f}) | {oracle_ratio - sim_ratio:+.2f} | " + grappler +
                     f"{r['overhead']:.2f}x | {_bound(r)} | {mib(r['plan_traffic'])} | {mib(r['least_traffic'])} |")
    lines += ["", "\"least time of any plan\": no plan that fits the budget can be faster, whatever it moves "
                  "(`lms_tf.simulate.bounds.fit_lower_bound`: at the plain step's peak, the bytes over the budget "
                  "are swapped over the link or recomputed at their producer's time, as fractions of tensors, "
                  "the cheapest first), relative to the plain step. It does not depend on the chosen plan's own "
                  "copies (the last two columns: what the plan copies out, and what the least-time relaxation does)."]
    lines += ["", "The GPU convolution rule (cuDNN's workspace, taken as each convolution's largest operand) cannot be "
                  "checked on this CPU-only machine. Its share of each simulated peak: the workspace of the op "
                  "running at the peak (a peak without the rule lies between the peak less this and the peak; MiB):",
              "", "| model | device | sim plain | workspace at its peak (share) | lms-tf sim | workspace at its peak "
                  "(share) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} {r['size']}² b{r['batch']} | {r['device']} | {mib(r['sim_plain'])} | "
                     f"{mib(r['workspace_plain'])} ({r['workspace_plain'] / r['sim_plain']:.2f}) | {mib(r['sim_lms'])} | "
                     f"{mib(r['workspace_lms'])} ({r['workspace_lms'] / r['sim_lms']:.2f}) |")
    lines += ["", "Each plan's recompute-only part (its swaps dropped: between logical CPU devices a swap moves "
                  "no bytes), applied with `plan=` and `serialize=True` and run on this CPU in a fresh process "
                  "with one inter-op thread (`tests/allocator_worker.py --step plan`, as the allocator validation "
                  "runs its steps): the real allocator's peak (median of 3 steps) against the simulator's allocator "
                  "model of the same plan (MiB), and the chained ops TensorFlow ran out of the chain's order:", "",
              "| model | device | clones' tensors | real CPU peak | simulated (ratio) | out of order |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("real_recompute_part") is None:
            lines.append(f"| {r['model']} {r['size']}² b{r['batch']} | {r['device']} | 0 | the plan recomputes "
                         f"nothing | – | – |")
            continue
        lines.append(f"| {r['model']} {r['size']}² b{r['batch']} | {r['device']} | {r['recomputed_in_part']} | "
                     f"{mib(r['real_recompute_part'])} | {mib(r['sim_recompute_part'])} "
                     f"({r['sim_recompute_part'] / r['real_recompute_part']:.2f}) | {r['inversions_recompute_part']} |")
    lines += ["", "Grappler's oracle told the variable shapes (`virtual_gpu_peak(..., variable_shapes=True)`), "
                  "on serialized steps (`serialize=True`: the compute ops chained in the simulator's order). "
                  "Peaks in MiB. The last three columns count each buffer once where Grappler gives one buffer two "
                  "names at its peak: an input/output pair TensorFlow's elementwise kernels share in place, and "
                  "an alias (the serialization's kept `Identity` gates and exits, reshapes) and its source "
                  "(`virtual_gpu_peak_report(...).peak_bytes_counting_buffers_once`):", "",
              "| model | device | sim plain | oracle plain (÷ sim) | lms-tf sim (ratio) | lms-tf oracle (ratio) | "
              "oracle ratio − sim ratio | buffers once: oracle plain | lms-tf oracle (ratio) | "
              "oracle ratio − sim ratio |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['model']} {r['size']}² b{r['batch']} | {r['device']} | {mib(r['sim_plain'])} | "
                f"{mib(r['oracle_plain_shaped'])} ({r['oracle_plain_shaped'] / r['sim_plain']:.2f}) | ")
        sim_ratio = r["sim_lms"] / r["sim_plain"]
        oracle_ratio = r["oracle_lms_shaped"] / r["oracle_plain_shaped"]
        once_ratio = r["oracle_lms_shaped_once"] / r["oracle_plain_shaped_once"]
        lines.append(head + _at_budget(r) + f"{mib(r['sim_lms'])} ({sim_ratio:.2f}) | {mib(r['oracle_lms_shaped'])} "
                            f"({oracle_ratio:.2f}) | {oracle_ratio - sim_ratio:+.3f} | "
                            f"{mib(r['oracle_plain_shaped_once'])} | {mib(r['oracle_lms_shaped_once'])} "
                            f"({once_ratio:.2f}) | {once_ratio - sim_ratio:+.3f} |")
    lines += ["", f"Grappler's own memory optimizer on the plain step, {GRAPPLER_RUNS} runs of each heuristic, told "
                  f"a device of {BUDGET} of the plain step's oracle peak and judged by the same oracle, with its swap "
                  f"ops on the host (their copies live there). Peaks in MiB, ratios against the plain step by that "
                  f"judge:", "",
              "| model | judge | oracle plain | Grappler swap: median (ratio) | min-max | tensors swapped | "
              "Grappler recompute: median (ratio) | ops recomputed |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["device"] != PRESETS[0]:
            continue
        for judge, label in (("default", "default"), ("shaped", "given the variable shapes")):
            swap = r["grappler"][f"{judge}_SWAPPING_HEURISTICS"]
            recompute = r["grappler"][f"{judge}_RECOMPUTATION_HEURISTICS"]
            plain = swap["plain"]
            swap_peak, recompute_peak = statistics.median(swap["peaks"]), statistics.median(recompute["peaks"])
            lines.append(f"| {r['model']} {r['size']}² b{r['batch']} | {label} | {mib(plain)} | "
                         f"{mib(swap_peak)} ({swap_peak / plain:.2f}) | {mib(min(swap['peaks']))}-"
                         f"{mib(max(swap['peaks']))} | {min(swap['swapped'])}-{max(swap['swapped'])} | "
                         f"{mib(recompute_peak)} ({recompute_peak / plain:.2f}) | "
                         f"{min(recompute['recomputed'])}-{max(recompute['recomputed'])} |")
    lines += ["", f"The plans replayed with {TIE_SEEDS} random orders of the ops made ready together "
                  f"that the planner did not check (MiB). TensorFlow queues the successors of an op in an order "
                  f"that varies between processes only when the op has more than {EDGE_SET_INLINE} of them; "
                  f"\"such ops\" counts them (with none, every tie order is the same and min = max says "
                  f"nothing):", "",
              "| model | device | such ops | budget | planned peak | peak over tie orders: min-max | chunks (GPU "
              "allocator model) over tie orders: max | all within budget | predicted overhead over tie orders |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        within = max(r["tie_held"]) <= r["budget"]
        lines.append(f"| {r['model']} {r['size']}² b{r['batch']} | {r['device']} | {r['tie_ops']} | "
                     f"{_at_budget(r)}{mib(r['budget'])} | "
                     f"{mib(r['sim_lms'])} | {mib(min(r['tie_peaks']))}-{mib(max(r['tie_peaks']))} | "
                     f"{mib(max(r['tie_held']))} | {'yes' if within else 'no'} | "
                     f"{min(r['tie_times']):.2f}-{max(r['tie_times']):.2f}x |")
    lines += ["", f"Largest ResNet-50 224² batch on v100-16gb-pcie3 (simulated, budget \"auto\"): "
                  f"**{batch_row['plain']} plain, {batch_row['lms']} with lms-tf "
                  f"({batch_row['lms'] / max(batch_row['plain'], 1):.1f}x)** (search took {batch_row['seconds']:.0f} s). "
                  f"The plan at that batch judged by Grappler: the max-batch table below.",
              f"Planning the ResNet-152 224² b32 step ({r152[1]} ops) at {r152[2]} on v100-16gb-pcie3 (the first of "
              f"{', '.join(R152_BUDGETS)} whose plan swaps: {r152[3]} tensors swapped, {r152[4]} recomputed): "
              f"**{statistics.median(r152[0]):.1f} s** (median of {len(r152[0])} plans; "
              f"{min(r152[0]):.1f}-{max(r152[0]):.1f} s)."]
    return "\n".join(lines)


def main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    only = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    unknown = [arg for arg in sys.argv[1:] if arg.startswith("--") and arg != "--rows-from-last-run"]
    if unknown:
        sys.exit(f"planner.py: unknown option {unknown[0]}; the only one is --rows-from-last-run")
    saved = OUT / "planner_rows.json"
    if "--rows-from-last-run" in sys.argv:
        # The zoo rows of an earlier run of this code (about 35 minutes), kept when a later part failed.
        rows = json.loads(saved.read_text())
    else:
        rows = []
        for name, size, batch in ZOO:
            if not only or name in only:
                rows.extend(model_rows(name, size, batch))
        OUT.mkdir(exist_ok=True)
        saved.write_text(json.dumps(rows, indent=1))
    batch_row = max_batch_row()
    r152 = resnet152_planning_seconds()
    text = table(rows, batch_row, r152)
    publish("planner", text, page="planner")
    OUT.mkdir(exist_ok=True)
    with open(OUT / "planner.json", "w") as handle:
        json.dump({"rows": rows, "max_batch": batch_row, "resnet152_plan_seconds": r152[0]}, handle, indent=1)
    print(text)


if __name__ == "__main__":
    main()
