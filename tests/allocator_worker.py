"""Measures the real CPU-allocator peak of plain and recompute-only steps and prints them as JSON,
beside the simulator's figures. Run in its own process: TensorFlow must start with one inter-op
thread (ops run one at a time, as kernels on a GPU stream) and the BFC CPU allocator.

    python tests/allocator_worker.py ResNet50,64,8 UNet,64,4 ...
"""

import json
import os
import statistics
import sys
import time

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.graph import build_ir  # noqa: E402
from lms_tf.planner import simulate  # noqa: E402
from lms_tf.workloads import build_model, synthetic_batch, train_step  # noqa: E402


def real_peak(fn, x, y, repeats=3):
    fn(x, y).numpy()
    peaks = []
    for _ in range(repeats):
        time.sleep(0.3)  # let the previous step's last frees land before the peak is reset
        with lms_tf.measure_peak_memory("CPU:0") as memory:
            fn(x, y).numpy()
        peaks.append(memory.peak_bytes)
    return statistics.median(peaks)


def main(specs):
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    rows = []
    for spec in specs:
        name, size, batch = spec.split(",")
        keras.utils.set_random_seed(0)
        model = build_model(name, image_size=int(size), classes=100)
        x, y = synthetic_batch(model, int(batch))
        plain = tf.function(train_step(model))
        ir = build_ir(plain.get_concrete_function(x, y).graph)
        row = {"model": name, "size": int(size), "batch": int(batch),
               "real_plain": real_peak(plain, x, y),
               "sim_plain": simulate(ir, cost=cost, executor="cpu").peak_bytes}
        recompute = lms_tf.function(train_step(model), device="/CPU:0", swap=False, recompute="sqrt")
        recompute.get_concrete_function(x, y)
        # The plan refers to the recompute trace's own graph: simulate it on that trace's plain IR.
        rows.append(row)
        row["real_sqrt"] = real_peak(recompute, x, y)
        row["sim_sqrt"] = simulate(recompute_ir(recompute, x, y), recompute.plan, cost=cost, executor="cpu").peak_bytes
    print("RESULT " + json.dumps(rows))


def recompute_ir(fn, x, y):
    """The IR of the plain step the recompute plan was made for (the trace before rewriting)."""
    return fn.plain_irs[-1]


if __name__ == "__main__":
    main(sys.argv[1:])
