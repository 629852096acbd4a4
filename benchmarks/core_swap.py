"""Benchmark of the core swap pass (issue "Core"), measured side by side in one run.

1. ResNet-50 (keras.applications, weights=None, 224x224, batch 32): GPU peak on Grappler's
   virtual 16 GB V100-like GPU for the plain step and the default lms-tf plan, next to the
   real TensorFlow CPU-allocator peak of the plain step run on this machine.
2. CPU step time with lms-tf / without: ResNet-50 at 96x96, batch 8, median of 20 steps
   after warm-up, plain and lms-tf steps interleaved in blocks. This is the cost of the
   rewrite's own ops only, not of swapping: two logical CPU devices share one buffer, so a swap
   copies no bytes here; swap time is the simulator's to predict (docs/benchmarks/planner.md).
3. ResNet-152 train step: time lms-tf takes to analyse and rewrite it / time TF takes to trace it.

    .venv/bin/python benchmarks/core_swap.py            # tables into docs/benchmarks/swap.md; raw figures in benchmarks/out/
"""

import json
import logging
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The CPU allocator reports peak memory only when it is a BFC allocator.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])

import keras  # noqa: E402
from publish import OUT, publish  # noqa: E402 - benchmarks/publish.py, beside this script

import lms_tf  # noqa: E402
from lms_tf.tf.diagnostics import virtual_gpu_peak  # noqa: E402
from lms_tf.tf.workloads import build_model, synthetic_batch, train_step  # noqa: E402

LMS = dict(device="/CPU:0", host="/CPU:1")
GiB, MiB = 2**30, 2**20
log = logging.getLogger("benchmark")


def memory_peak(run):
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    run()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def oracle_resnet50():
    log.info("[1/3] ResNet-50 224x224 batch 32: tracing plain and lms-tf steps")
    keras.utils.set_random_seed(0)
    model = build_model("ResNet50", image_size=224, classes=1000)
    x, y = synthetic_batch(model, 32)
    plain = tf.function(train_step(model))
    lms = lms_tf.function(train_step(model), **LMS)
    plain_cf, lms_cf = plain.get_concrete_function(x, y), lms.get_concrete_function(x, y)
    log.info("[1/3] simulating on Grappler's virtual 16 GiB GPU")
    base = virtual_gpu_peak(plain_cf, host=LMS["host"])
    swapped = virtual_gpu_peak(lms_cf, host=LMS["host"])
    log.info("[1/3] running one real plain step for the CPU allocator peak")
    plain(x, y)  # creates optimizer slots; the measured step is the second one
    real = memory_peak(lambda: plain(x, y).numpy())
    plan = lms.plan
    return {"base": base, "lms": swapped, "real_plain": real, "swapped_tensors": len(plan.swapped),
            "swap_ins": plan.num_swap_ins, "swapped_bytes": plan.swapped_bytes}


def step_time_resnet50():
    log.info("[2/3] ResNet-50 96x96 batch 8: timing plain and lms-tf steps")
    keras.utils.set_random_seed(0)
    model_a = build_model("ResNet50", image_size=96, classes=100)
    keras.utils.set_random_seed(0)
    model_b = build_model("ResNet50", image_size=96, classes=100)
    x, y = synthetic_batch(model_a, 8)
    plain = tf.function(train_step(model_a))
    lms = lms_tf.function(train_step(model_b), **LMS)
    for _ in range(3):
        plain(x, y).numpy(), lms(x, y).numpy()
    times = {"plain": [], "lms": []}
    for block in range(4):  # interleaved blocks so drift hits both alike
        for name, fn in (("plain", plain), ("lms", lms)) if block % 2 == 0 else (("lms", lms), ("plain", plain)):
            for _ in range(5):
                started = time.perf_counter()
                fn(x, y).numpy()
                times[name].append(time.perf_counter() - started)
        log.info("[2/3] block %d/4 done", block + 1)
    return {name: statistics.median(values) for name, values in times.items()} | {"steps": len(times["lms"])}


def pass_time_resnet152():
    log.info("[3/3] ResNet-152: timing TF's trace and lms-tf's analysis + rewrite")
    keras.utils.set_random_seed(0)
    model = build_model("ResNet152", image_size=224, classes=1000)
    x, y = synthetic_batch(model, 32)
    started = time.perf_counter()
    tf.function(train_step(model)).get_concrete_function(x, y)
    trace = time.perf_counter() - started
    lms = lms_tf.function(train_step(model), **LMS)
    lms.get_concrete_function(x, y)
    return {"trace": trace, "pass": lms.pass_seconds[-1], "ops": sum(lms.plan.phase_counts.values())}


def main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    oracle = oracle_resnet50()
    timing = step_time_resnet50()
    rewrite = pass_time_resnet152()
    ratio_peak = oracle["lms"] / oracle["base"]
    ratio_time = timing["lms"] / timing["plain"]
    ratio_pass = rewrite["pass"] / rewrite["trace"]
    rows = [
        ("ResNet-50 224² b32: virtual-GPU peak (Grappler, 16 GiB V100-like)",
         f"{oracle['base'] / GiB:.2f} GiB", f"{oracle['lms'] / GiB:.2f} GiB", f"**{ratio_peak:.2f}**", "≤ 0.50"),
        ("ResNet-50 224² b32: real CPU-allocator peak of the plain step",
         f"{oracle['real_plain'] / GiB:.2f} GiB", "–", "–", "reference"),
        (f"ResNet-50 96² b8: CPU step time, median of {timing['steps']} (the inserted ops only: a swap "
         f"between logical CPUs copies no bytes, so this is not a swap time)",
         f"{timing['plain'] * 1000:.0f} ms", f"{timing['lms'] * 1000:.0f} ms", f"**{ratio_time:.2f}**", "–"),
        (f"ResNet-152: analyse + rewrite / TF trace ({rewrite['ops']} ops)",
         f"{rewrite['trace']:.2f} s", f"{rewrite['pass']:.2f} s", f"**{ratio_pass:.2f}**", "≤ 0.50"),
    ]
    lines = ["| measurement | plain | lms-tf | ratio | target |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    lines.append("")
    lines.append(f"lms-tf default plan on ResNet-50 224² b32: {oracle['swapped_tensors']} tensors swapped "
                 f"({oracle['swapped_bytes'] / GiB:.2f} GiB each way per step), {oracle['swap_ins']} swap-ins. "
                 f"Grappler reads low in absolute terms on this model (docs/design.md): compare the ratio.")
    table = "\n".join(lines)
    publish("core_swap", table, page="swap")
    OUT.mkdir(exist_ok=True)
    with open(OUT / "core_swap.json", "w") as handle:
        json.dump({"oracle": oracle, "timing": timing, "rewrite": rewrite, "tf": tf.__version__,
                   "keras": keras.__version__}, handle, indent=1)
    print(table)


if __name__ == "__main__":
    main()
