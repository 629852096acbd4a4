"""Benchmark of the cost model against measured time on this CPU (issue "Trust"), in one run.

The planner ranks plans by the cost model's predicted step time. Its presets describe GPUs,
which this machine does not have; what can be checked here is the model's *shape*: once its
per-class scales are calibrated against measured op times (``CostModel.calibrate``), does the
simulator's predicted step time follow the measured one across models? Calibration is
leave-one-out: each model's prediction uses scales fitted on the other models' ops only, so no
model is predicted from its own measurements.

For each model (small inputs, batch 8, plain ``tf.function`` training step, Grappler's defaults):

* measured: median wall time of the step over ``STEPS`` runs after a warm-up, and each op's median
  time from TensorFlow's profiler over ``PROFILED`` steps;
* predicted: the simulator's step time (one compute stream, no swaps) with the cost model
  calibrated on the other models, and with the uncalibrated v100 preset (for scale only);
* the ratio predicted / measured, and the sum of measured op times / measured step (how much of
  the step the executor ran in parallel, which a one-stream simulation cannot see).

    .venv/bin/python benchmarks/cost_model.py   # table into docs/benchmarks/cost_model.md
"""

import json
import logging
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from publish import OUT, publish  # noqa: E402 - benchmarks/publish.py, beside this script

from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.simulate import simulate  # noqa: E402
from lms_tf.tf.diagnostics import measured_op_seconds  # noqa: E402
from lms_tf.tf.trace import build_ir  # noqa: E402
from lms_tf.tf.workloads import build_model, synthetic_batch, train_step  # noqa: E402

MODELS = [("ResNet50", 96), ("VGG16", 64), ("MobileNetV2", 96), ("DenseNet121", 64), ("TransformerEncoder", 64),
          ("StackedRNN", 50)]
BATCH, STEPS, PROFILED = 8, 10, 3
PRESET = "v100-16gb-pcie3"
log = logging.getLogger("benchmark")


def measure(name, size):
    keras.utils.set_random_seed(0)
    model = build_model(name, image_size=size, classes=10)
    x, y = synthetic_batch(model, BATCH)
    step = tf.function(train_step(model))
    ir = build_ir(step.get_concrete_function(x, y).graph)
    for _ in range(3):
        step(x, y).numpy()
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        step(x, y).numpy()
        times.append(time.perf_counter() - started)
    op_seconds = measured_op_seconds(lambda: step(x, y).numpy(), (op.name for op in ir.ops), steps=PROFILED)
    return {"name": f"{name} {size}", "ir": ir, "step_s": statistics.median(times), "op_seconds": op_seconds}


def main():
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    base = CostModel(get_device_spec(PRESET))
    runs = []
    for name, size in MODELS:
        log.info("%s %d: measuring", name, size)
        runs.append(measure(name, size))
    rows = ["| model | ops measured / in the step | measured step (ms) | sum of measured op times / step | "
            "predicted, calibrated on the others (ms) | predicted / measured | uncalibrated v100 (ms) |",
            "|---|---|---|---|---|---|---|"]
    results = []
    for held_out in runs:
        calibrated = base.calibrate_many((run["ir"], run["op_seconds"]) for run in runs if run is not held_out)
        predicted = simulate(held_out["ir"], cost=calibrated).step_time_s
        uncalibrated = simulate(held_out["ir"], cost=base).step_time_s
        summed = sum(held_out["op_seconds"].values())
        result = {"model": held_out["name"], "ops": len(held_out["ir"].ops), "measured_ops": len(held_out["op_seconds"]),
                  "step_s": held_out["step_s"], "summed_s": summed, "predicted_s": predicted,
                  "uncalibrated_s": uncalibrated}
        results.append(result)
        rows.append(f"| {result['model']} | {result['measured_ops']} / {result['ops']} | {1000 * result['step_s']:.0f} | "
                    f"{summed / result['step_s']:.2f} | {1000 * predicted:.0f} | {predicted / result['step_s']:.2f} | "
                    f"{1000 * uncalibrated:.1f} |")
    ratios = [r["predicted_s"] / r["step_s"] for r in results]
    summary = (f"Predicted / measured, leave-one-out: median {statistics.median(ratios):.2f}, "
               f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} models.")
    table = "\n".join(rows) + "\n\n" + summary
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cost_model.json").write_text(json.dumps(results, indent=1))
    publish("cost_model", table, page="cost_model")
    print(table)


if __name__ == "__main__":
    main()
