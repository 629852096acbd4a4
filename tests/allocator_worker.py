"""Real CPU-allocator peaks of plain and recompute-only training steps beside the simulator's.

For each model one step runs under TensorFlow's profiler inside ``measure_peak_memory``: the
real peak and the order TensorFlow executed the ops in come from the same step. The
simulator then replays that order (``replay``: checks the memory rules, since TF's CPU
executor order changes from process to process) and predicts on its own (``blind``: the
GPU executor's ready order). Prints one ``RESULT <json>`` line. Run it in its own process:
TensorFlow must start with the BFC CPU allocator.

    python tests/allocator_worker.py ResNet50,64,8 UNet,64,4 ...
"""

import json
import os
import sys
import time

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

# One inter-op thread: ops run one at a time (as kernels on a GPU stream), so the profiled start
# order is the order memory was used in.
tf.config.threading.set_inter_op_parallelism_threads(1)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.diagnostics import executed_ops  # noqa: E402
from lms_tf.graph import build_ir  # noqa: E402
from lms_tf.planner import simulate, tensorflow_cpu_allocator  # noqa: E402
from lms_tf.rewrite.recompute import simulator_name  # noqa: E402
from lms_tf.workloads import build_model, synthetic_batch, train_step  # noqa: E402

COST = CostModel(get_device_spec("v100-16gb-pcie3"))


def measured(fn, x, y, graph=None):
    """(real peak bytes, simulator op name -> start rank) of one profiled step."""
    fn(x, y).numpy()
    with lms_tf.measure_peak_memory("CPU:0", settle_seconds=0.3) as memory:
        events = executed_ops(lambda: fn(x, y).numpy())
    rank = {}
    for event in events:
        name = event.node
        if graph is not None:
            try:
                name = simulator_name(graph, name)
            except (KeyError, ValueError):  # runtime events that are not graph ops
                pass
        rank.setdefault(name, float(len(rank)))
    return memory.peak_bytes, rank


def compare(ir, plan, fn, x, y, runs=3):
    """The median of ``runs`` real peaks, and the simulator's: blind and replaying that run's
    order, each as summed tensor bytes and as TensorFlow's allocator counts them (whole chunks)."""
    graph = fn.get_concrete_function(x, y).graph
    real, rank = sorted((measured(fn, x, y, graph=graph) for _ in range(runs)), key=lambda run: run[0])[runs // 2]
    replay = simulate(ir, plan, cost=COST, priority=rank, allocator=tensorflow_cpu_allocator())
    blind = simulate(ir, plan, cost=COST, allocator=tensorflow_cpu_allocator())
    return {"real": real, "replay": replay.peak_bytes, "blind": blind.peak_bytes,
            "replay_allocator": replay.allocator_peak_bytes, "blind_allocator": blind.allocator_peak_bytes}


def main(specs):
    rows = []
    for spec in specs:
        name, size, batch = spec.split(",")
        keras.utils.set_random_seed(0)
        model = build_model(name, image_size=int(size), classes=100)
        x, y = synthetic_batch(model, int(batch))
        plain = tf.function(train_step(model))
        ir = build_ir(plain.get_concrete_function(x, y).graph)
        row = {"model": name, "size": int(size), "batch": int(batch), "plain": compare(ir, None, plain, x, y)}
        recompute = lms_tf.function(train_step(model), device="/CPU:0", swap=False, recompute="sqrt")
        recompute.get_concrete_function(x, y)
        row["sqrt"] = compare(recompute.plain_irs[-1], recompute.plan, recompute, x, y)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
