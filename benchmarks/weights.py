"""Benchmark: weights on the host (``weights="host"``) against activations planned alone, side by side.

For each model at a fixed batch and each device preset, the least device memory lms-tf trains the
step in is found by planning for budgets of one byte, a quarter and half of the plain peak (each
error carries the lowest budget that search reached, which depends on what it aimed at; the
least is kept), planning again just above that (2% up, more when no plan fits there) and adding
what stays resident (the variables on the device). Three ways:

* **plain**: the step as TensorFlow runs it: its simulated peak plus every variable it reads;
* **activations planned**: swap and recompute (``budget=``), weights and slots resident;
* **weights + activations planned**: the same with ``weights="host"``: the variables live on the
  host, each fetched per window of readers, the update on the host.

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


def least_budget(ir, policies: Policies, cost: CostModel, plain_peak: int) -> int:
    """The lowest budget the planner reaches for this step: the least its errors name for budgets
    of one byte, a quarter and half of the plain peak (the greedy search's lowest plan depends on
    what it aimed at), or the least of those budgets a plan fits."""
    reached = []
    for budget in (1, plain_peak // 4, plain_peak // 2):
        try:
            make_budget_plan(ir, policies.replace(budget=budget), device="/device:GPU:0", cost=cost)
            reached.append(budget)
        except InfeasibleBudgetError as err:
            reached.append(err.smallest_feasible_bytes)
    return min(reached)


def measure(ir, way: str, cost: CostModel) -> dict:
    weights = "host" if way == "weights" else "device"
    policies = Policies(host="/CPU:1", recompute="auto", budget="auto", weights=weights)
    on_host = {w.variable for w in plan_weights(ir, policies)}
    resident = resident_bytes(ir, on_host)
    plain = simulate(ir, cost=cost)
    if way == "plain":
        return dict(device_bytes=plain.peak_bytes + resident_bytes(ir), host_bytes=0, overhead=1.0)
    least = least_budget(ir, policies, cost, plain.peak_bytes)
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
    return dict(device_bytes=budget + resident, host_bytes=plan.offloaded_weight_bytes + plan.swapped_bytes,
                overhead=pred.overhead, offloaded=plan.offloaded_weight_bytes, fetches=plan.num_weight_fetches,
                least_reached=least, factor=factor)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    rows, floors = [], {}
    for model, size, batch in MODELS:
        args = build_parser().parse_args(["max-batch", "--model", model, "--input-shape", size])
        _, _, graph, _, _ = trace_unbatched(args)
        ir = build_ir(graph, batch_size=batch)
        floors[model] = whole_op_floor(ir, kernels="cudnn")
        for preset in PRESETS:
            cost = CostModel(get_device_spec(preset))
            for way in ("plain", "activations", "weights"):
                started = time.perf_counter()
                row = dict(model=model, batch=batch, preset=preset, way=way, **measure(ir, way, cost))
                log.info("%s b%d %s %s: %.2f GiB on the device (%.0f s)", model, batch, preset, way,
                         row["device_bytes"] / GiB, time.perf_counter() - started)
                rows.append(row)
    names = {"plain": "plain", "activations": "activations planned", "weights": "weights + activations planned"}
    lines = ["Least device memory each way trains the step in (the lowest budget a plan was found for, plus "
             "the variables left on the device; for plain, the simulated peak plus every variable), host memory "
             "the weights plan pins, and the predicted step time of that plan against the plain step's.", "",
             "| model, batch | device | way | device GiB | vs plain | host GiB | predicted time |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        plain = next(r for r in rows if r["model"] == row["model"] and r["preset"] == row["preset"]
                     and r["way"] == "plain")
        lines.append(f"| {row['model']} b{row['batch']} | {row['preset']} | {names[row['way']]} | "
                     f"{row['device_bytes'] / GiB:.2f} | {row['device_bytes'] / plain['device_bytes']:.2f} | "
                     f"{row['host_bytes'] / GiB:.2f} | {row['overhead']:.2f}x |")
    lines += ["", "The least device memory any plan reaches that runs each op whole: the op holding the most while "
              "it runs (its inputs, weights included, its outputs and cuDNN's workspace, by the simulator's rules), "
              "against the plain step (the same on every preset). A budget below it needs that op split.", "",
              "| model, batch | largest op | type | its working set GiB | vs plain | 25% of plain | "
              "weights + activations planned, least on v100-16gb-pcie3 |", "|---|---|---|---|---|---|---|"]
    for model, size, batch in MODELS:
        floor = floors[model]
        plain, least = (next(r for r in rows if r["model"] == model and r["preset"] == PRESETS[0] and r["way"] == way)
                        for way in ("plain", "weights"))
        lines.append(f"| {model} b{batch} | `{floor.op}` | {floor.op_type} | {floor.nbytes / GiB:.2f} | "
                     f"{floor.nbytes / plain['device_bytes']:.2f} | {plain['device_bytes'] / 4 / GiB:.2f} "
                     f"({'below' if plain['device_bytes'] / 4 < floor.nbytes else 'above'} it) | "
                     f"{least['device_bytes'] / GiB:.2f} ({least['device_bytes'] / floor.nbytes:.2f}x it) |")
    text = "\n".join(lines)
    publish("weights", text, page="weights")
    OUT.mkdir(exist_ok=True)
    with open(OUT / "weights.json", "w") as handle:
        json.dump(dict(rows=rows, whole_op_floors={m: dataclasses.asdict(f) for m, f in floors.items()}), handle,
                  indent=1)
    print(text)


if __name__ == "__main__":
    main()
