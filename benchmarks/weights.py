"""Benchmark: weights on the host (``weights="host"``) against activations planned alone, side by side.

For each model at a fixed batch and each device preset, the least device memory lms-tf trains the
step in is found by planning for budgets of one byte, a quarter and half of the plain peak (each
error carries the lowest budget that search reached, which depends on what it aimed at; the
least is kept), planning again just above that (2% up, more when no plan fits there) and adding
what stays resident (the variables on the device). Three ways:

* **plain**: the step as TensorFlow runs it: its simulated peak plus every variable it reads;
* **activations planned**: swap and recompute (``budget=``), weights and slots resident;
* **weights + activations planned**: the same with ``weights="host"``: the variables live on the
  host, each fetched per window of readers, the update on the host;
* **the same, cuDNN workspace capped**: with ``TF_CUDNN_WORKSPACE_LIMIT_IN_MB`` at
  :data:`WORKSPACE_CAP_MIB` (the device spec's ``cudnn_workspace_limit_bytes``), which the
  simulator then counts instead of a convolution's largest operand.

The planner may slice a max pool's gradient along the batch in any of them (``Plan.sliced``);
the table says how many ops each way's plan slices.

Each row also gives the host memory the weights plan pins (the variables it holds plus the
activations it swaps) and the predicted step time of a plan at that least budget against the
plain step's. Everything here is the simulator's (no GPU on this machine), on the step traced
once per model.

Command: ``.venv/bin/python benchmarks/weights.py`` (a few minutes on 2 cores; writes
``benchmarks/out/weights.json`` and the table into ``docs/benchmarks/weights.md``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.publish import OUT, publish  # noqa: E402
from lms_tf.cli import build_parser  # noqa: E402
from lms_tf.cli.workload import trace_unbatched  # noqa: E402
from lms_tf.core.errors import InfeasibleBudgetError  # noqa: E402
from lms_tf.core.policy import Policies  # noqa: E402
from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.planner import make_budget_plan  # noqa: E402
from lms_tf.planner.weights import plan_weights  # noqa: E402
from lms_tf.simulate import resident_bytes, simulate, whole_op_floor  # noqa: E402
from lms_tf.tf.trace import build_ir  # noqa: E402

log = logging.getLogger("benchmark")
PRESETS = ("v100-16gb-pcie3", "v100-32gb-nvlink2", "h100-80gb-pcie5", "gh200-96gb-c2c")
#: (model, input size or sequence length, batch).
MODELS = (("VGG16", "224", 16), ("ResNet50", "224", 32), ("TransformerEncoder", "128", 32))
GiB = 2**30
#: The cap on cuDNN's convolution workspace of the fourth way, in MiB.
WORKSPACE_CAP_MIB = 32


def least_budget(ir, policies: Policies, cost: CostModel, plain_peak: int, quarter: int) -> int:
    """The lowest budget the planner reaches for this step: the least its errors name for budgets
    of one byte, a quarter and half of the plain peak, and ``quarter`` (a quarter of the plain step
    with its variables, less what stays resident) (the greedy search's lowest plan depends on what
    it aimed at), or the least of those budgets a plan fits."""
    reached = []
    for budget in (1, plain_peak // 4, plain_peak // 2, quarter):
        try:
            make_budget_plan(ir, policies.replace(budget=budget), device="/device:GPU:0", cost=cost)
            reached.append(budget)
        except InfeasibleBudgetError as err:
            reached.append(err.smallest_feasible_bytes)
    return min(reached)


def measure(ir, way: str, cost: CostModel) -> dict:
    weights = "host" if way in ("weights", "capped") else "device"
    if way == "capped":
        cost = CostModel(dataclasses.replace(cost.device, cudnn_workspace_limit_bytes=WORKSPACE_CAP_MIB << 20))
    policies = Policies(host="/CPU:1", recompute="auto", budget="auto", weights=weights)
    on_host = {w.variable for w in plan_weights(ir, policies)}
    resident = resident_bytes(ir, on_host)
    plain = simulate(ir, cost=cost)
    if way == "plain":
        return dict(device_bytes=plain.peak_bytes + resident_bytes(ir), host_bytes=0, overhead=1.0, sliced=0,
                    tensors_bytes=plain.peak_bytes + resident_bytes(ir), quarter=dict(fits=False, least=None))
    quarter = (plain.peak_bytes + resident_bytes(ir)) // 4 - resident
    # With the variables resident, they alone may hold more than a quarter of the plain step.
    at_quarter = at_budget(ir, policies.replace(budget=quarter), cost) if quarter > 0 else dict(fits=False, least=None)
    least = least_budget(ir, policies, cost, plain.peak_bytes, max(quarter, 1))
    # The planner's lowest figure is not monotone in the budget asked for: plan a little above it,
    # then higher, and report the budget a plan was found for.
    for factor in (1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0):
        budget = int(least * factor) + 1
        try:
            plan = make_budget_plan(ir, policies.replace(budget=budget), device="/device:GPU:0", cost=cost)
            break
        except InfeasibleBudgetError:
            continue
    else:
        raise SystemExit(f"no plan found up to twice the lowest budget {least} ({way}, {cost.device.name})")
    pred = plan.predictions
    return dict(device_bytes=budget + resident, budget_bytes=budget,
                host_bytes=plan.offloaded_weight_bytes + plan.swapped_bytes,
                overhead=pred.overhead, offloaded=plan.offloaded_weight_bytes, fetches=plan.num_weight_fetches,
                least_reached=least, factor=factor, sliced=len(plan.sliced),
                tensors_bytes=pred.planned_peak_bytes + resident, quarter=at_quarter)


def at_budget(ir, policies: Policies, cost: CostModel) -> dict:
    """Whether a plan fits ``policies.budget``; if not, the least budget the planner's error names."""
    try:
        plan = make_budget_plan(ir, policies, device="/device:GPU:0", cost=cost)
    except InfeasibleBudgetError as err:
        return dict(fits=False, least=err.smallest_feasible_bytes)
    pred = plan.predictions
    return dict(fits=True, tensors=pred.planned_peak_bytes, chunks=pred.planned_allocator_peak_bytes,
                overhead=pred.overhead, sliced=len(plan.sliced))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    rows, floors, capped_floors = [], {}, {}
    for model, size, batch in MODELS:
        args = build_parser().parse_args(["max-batch", "--model", model, "--input-shape", size])
        _, _, graph, _, _ = trace_unbatched(args)
        ir = build_ir(graph, batch_size=batch)
        floors[model] = whole_op_floor(ir, kernels="cudnn")
        capped_floors[model] = whole_op_floor(ir, kernels="cudnn", cudnn_workspace_limit=WORKSPACE_CAP_MIB << 20)
        for preset in PRESETS:
            cost = CostModel(get_device_spec(preset))
            for way in ("plain", "activations", "weights", "capped"):
                started = time.perf_counter()
                row = dict(model=model, batch=batch, preset=preset, way=way, **measure(ir, way, cost))
                log.info("%s b%d %s %s: %.2f GiB on the device (%.0f s)", model, batch, preset, way,
                         row["device_bytes"] / GiB, time.perf_counter() - started)
                rows.append(row)
    names = {"plain": "plain", "activations": "activations planned", "weights": "weights + activations planned",
             "capped": f"the same, cuDNN workspace at most {WORKSPACE_CAP_MIB} MiB"}
    lines = ["Least device memory each way trains the step in (the lowest budget a plan was found for, plus "
             "the variables left on the device; for plain, the simulated peak plus every variable; the tensors "
             "of the plan at that budget, before TensorFlow's allocator rounds them into whole chunks, in "
             "brackets), host memory the weights plan pins, ops the plan runs a slice of the batch at a time, "
             "and the predicted step time of that plan against the plain step's.", "",
             "| model, batch | device | way | device GiB | vs plain | host GiB | sliced ops | predicted time |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        plain = next(r for r in rows if r["model"] == row["model"] and r["preset"] == row["preset"]
                     and r["way"] == "plain")
        lines.append(f"| {row['model']} b{row['batch']} | {row['preset']} | {names[row['way']]} | "
                     f"{row['device_bytes'] / GiB:.3f} ({row['tensors_bytes'] / GiB:.3f}) | "
                     f"{row['device_bytes'] / plain['device_bytes']:.3f} | "
                     f"{row['host_bytes'] / GiB:.2f} | {row['sliced']} | {row['overhead']:.2f}x |")
    lines += ["", "The least device memory any plan reaches that runs each op whole: the op holding the most while "
              "it runs (its inputs, weights included, its outputs and cuDNN's workspace, by the simulator's rules), "
              f"against the plain step (the same on every preset); then the same with the workspace at most "
              f"{WORKSPACE_CAP_MIB} MiB; and the least any way above reached on any preset. A budget below the "
              "floor needs that op run a slice at a time (the planner slices max-pool gradients).", "",
              "| model, batch | largest op | its working set GiB (vs plain) | workspace capped: largest op | "
              "its working set GiB (vs plain) | 25% of plain GiB | least reached GiB (vs plain), way, device |",
              "|---|---|---|---|---|---|---|"]
    for model, size, batch in MODELS:
        floor, capped = floors[model], capped_floors[model]
        plain = next(r for r in rows if r["model"] == model and r["way"] == "plain")["device_bytes"]
        least = min((r for r in rows if r["model"] == model and r["way"] != "plain"), key=lambda r: r["device_bytes"])
        lines.append(f"| {model} b{batch} | `{floor.op}` ({floor.op_type}) | {floor.nbytes / GiB:.3f} "
                     f"({floor.nbytes / plain:.3f}) | `{capped.op}` ({capped.op_type}) | {capped.nbytes / GiB:.3f} "
                     f"({capped.nbytes / plain:.3f}) | {plain / 4 / GiB:.3f} | {least['device_bytes'] / GiB:.3f} "
                     f"({least['device_bytes'] / plain:.3f}), {names[least['way']]}, {least['preset']} |")
    lines += ["", "Planned for exactly 25% of the plain step with its variables (the budget the planner is given: that "
              "less what stays resident): whether a plan fits, its tensors and TensorFlow's allocator's whole chunks "
              "(each with the resident variables, against the plain step) and predicted time; if none fits, the least "
              "budget the planner's error names.", "",
              "| model, batch | device | way | 25% of plain GiB | fits | device GiB: tensors, chunks (vs plain) | "
              "sliced ops | predicted time |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["way"] == "plain":
            continue
        plain = next(r for r in rows if r["model"] == row["model"] and r["preset"] == row["preset"]
                     and r["way"] == "plain")["device_bytes"]
        q, resident = row["quarter"], row["device_bytes"] - row["budget_bytes"]
        if q["fits"]:
            figures = (f"{(q['tensors'] + resident) / GiB:.3f}, {(q['chunks'] + resident) / GiB:.3f} "
                       f"({(q['chunks'] + resident) / plain:.3f})")
            tail = f"{q['sliced']} | {q['overhead']:.2f}x"
        elif q["least"] is None:
            figures = f"the variables it keeps resident alone hold {resident / GiB:.3f}"
            tail = "- | -"
        else:
            figures = f"least {(q['least'] + resident) / GiB:.3f} ({(q['least'] + resident) / plain:.3f})"
            tail = "- | -"
        lines.append(f"| {row['model']} b{row['batch']} | {row['preset']} | {names[row['way']]} | {plain / 4 / GiB:.3f} | "
                     f"{'yes' if q['fits'] else 'no'} | {figures} | {tail} |")
    text = "\n".join(lines)
    publish("weights", text, page="weights")
    OUT.mkdir(exist_ok=True)
    with open(OUT / "weights.json", "w") as handle:
        json.dump(dict(rows=rows, whole_op_floors={m: dataclasses.asdict(f) for m, f in floors.items()},
                       capped_whole_op_floors={m: dataclasses.asdict(f) for m, f in capped_floors.items()},
                       workspace_cap_mib=WORKSPACE_CAP_MIB), handle, indent=1)
    print(text)


if __name__ == "__main__":
    main()
