"""Real CPU-allocator peaks of plain and recompute-only training steps beside the simulator's.

For each model one step runs under TensorFlow's profiler inside ``measure_peak_memory``: the
real peak and the order TensorFlow executed the ops in come from the same step. Two orders:

- ``free`` (keys ``plain``, ``sqrt``): TensorFlow's CPU executor picks the order, which changes
  from process to process. The simulator replays that order (``replay``: checks the memory
  rules) and predicts on its own (``blind``: the GPU executor's ready order).
- ``serialized`` (keys ``plain_serialized``, ``sqrt_serialized``): the step is built with
  ``serialize=True``, so its compute ops run one at a time in the simulator's own order. The
  blind prediction is then a prediction of this very run; ``inversions`` counts chained ops
  that ran before the one chained ahead of them (0 when the order held). With ``--step plan``
  (key ``plan_serialized``) the step applies a saved plan (``--plan``, the JSON of
  ``Plan.to_json``) instead, with no swaps: the planner benchmark's recompute-only parts.

Prints one ``RESULT <json>`` line. Run it in its own process: TensorFlow must start with the
BFC CPU allocator.

    python tests/allocator_worker.py [--order free|serialized] [--step plain|sqrt|both] ResNet50,64,8 ...
    python tests/allocator_worker.py --order serialized --step plan --plan PLAN.json --classes 1000 \
        --device-spec h100-80gb-pcie5 ResNet50,224,32

A step measured after another in the same process reads a lower peak: the CPU allocator keeps
the regions the first one grew (MobileNetV2's serialized recompute step: 745 MiB after the
plain step, 782-820 alone in three processes, against 870 predicted).
"""

import argparse
import json
import os
import sys

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
from lms_tf.simulate import simulate, tensorflow_cpu_allocator  # noqa: E402
from lms_tf.simulate.allocator import replay_allocations  # noqa: E402
from lms_tf.simulate.pool import pool_history  # noqa: E402
from lms_tf.tf.diagnostics import (allocation_log, allocation_trace, cpu_kernel_library, executed_ops,  # noqa: E402
                                   grappler_accumulated_sums, live_at_allocator_peak, requested_peak)
from lms_tf.tf.rewrite.recompute import simulator_name  # noqa: E402
from lms_tf.tf.rewrite.serialize import serial_chain  # noqa: E402
from lms_tf.tf.trace import build_ir  # noqa: E402
from lms_tf.tf.workloads import build_model, synthetic_batch, train_step  # noqa: E402

COST = CostModel(get_device_spec("v100-16gb-pcie3"))
#: The CPU kernels' scratch memory (oneDNN's here, as the launcher turns it on).
KERNELS = cpu_kernel_library()


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


def accumulated_sums(ir, fn, x, y):
    """The sums Grappler accumulates into a temporary variable: predicted offline from the traced
    step (what the simulator uses), and seen in the real allocator's trace; and, of that traced
    run, the peak of its tensors (``real_requested``, :func:`requested_peak`), the peak of its allocator's chunks
    (``traced_allocator``) and what the allocator model makes of its very requests after the
    modelled pool history (``model_on_real_requests``: the model's rules checked apart from the
    simulator's prediction of the requests)."""
    predicted = grappler_accumulated_sums(fn.get_concrete_function(x, y))
    events = allocation_trace(lambda: fn(x, y).numpy())
    seen = {event.op[:-len("/tmp_var")] for event in events
            if event.kind == "alloc" and event.op.endswith("/tmp_var")}
    model_on_real = replay_allocations(allocation_log(events), tensorflow_cpu_allocator(),
                                       history=pool_history(ir, predicted))
    return predicted, {"accumulated_predicted": sorted(predicted), "accumulated_real": sorted(seen),
                       "real_requested": requested_peak(events),
                       "traced_allocator": live_at_allocator_peak(events)[0],
                       "model_on_real_requests": model_on_real}


def compare(ir, plan, fn, x, y, runs=5):
    """The median of ``runs`` real peaks, and the simulator's: blind and replaying that run's
    order, each as summed tensor bytes and as TensorFlow's allocator counts them (whole chunks).

    Within one process TensorFlow executes the same order every run, yet the real peak of that
    one order moves from run to run (ResNet-50 at 64², batch 4: 51.8-57.8 MiB over six runs of
    an identical order), so ``real_min`` and ``real_max`` span the runs that executed the
    median run's order, and ``orders`` counts the distinct orders seen."""
    graph = fn.get_concrete_function(x, y).graph
    runs_measured = sorted((measured(fn, x, y, graph=graph) for _ in range(runs)), key=lambda run: run[0])
    real, rank = runs_measured[runs // 2]
    order = sorted(rank, key=rank.__getitem__)
    orders = {tuple(sorted(r, key=r.__getitem__)) for _, r in runs_measured}
    same_order = [peak for peak, r in runs_measured if sorted(r, key=r.__getitem__) == order]
    accumulated, sums = accumulated_sums(ir, fn, x, y)
    kw = dict(cost=COST, kernels=KERNELS, accumulated_sums=accumulated)
    replay = simulate(ir, plan, priority=rank, allocator=tensorflow_cpu_allocator(), **kw)
    blind = simulate(ir, plan, allocator=tensorflow_cpu_allocator(), **kw)
    return {"real": real, "real_min": min(same_order), "real_max": max(same_order), "orders": len(orders),
            "replay": replay.peak_bytes, "blind": blind.peak_bytes,
            "replay_allocator": replay.allocator_peak_bytes, "blind_allocator": blind.allocator_peak_bytes, **sums}


def serialized(model, x, y, **options):
    """The step built with ``serialize=True`` (and ``options``: a recompute policy or a plan): its
    real peak beside the blind prediction."""
    fn = lms_tf.function(train_step(model), device="/CPU:0", swap=False, serialize=True,
                         device_spec=COST.device.name, **options)
    graph = fn.get_concrete_function(x, y).graph
    real, rank = sorted((measured(fn, x, y, graph=graph) for _ in range(3)), key=lambda run: run[0])[1]
    accumulated, sums = accumulated_sums(fn.plain_irs[-1], fn, x, y)
    blind = simulate(fn.plain_irs[-1], fn.plan, cost=COST, allocator=tensorflow_cpu_allocator(), kernels=KERNELS,
                     accumulated_sums=accumulated)
    chained = {simulator_name(graph, op.name): position for position, op in enumerate(serial_chain(graph))}
    executed = [chained[name] for name in sorted(set(chained) & set(rank), key=rank.__getitem__)]
    return {"real": real, "blind": blind.peak_bytes, "blind_allocator": blind.allocator_peak_bytes, **sums,
            "chained_ops": len(chained), "executed_ops": len(executed),
            "inversions": sum(a > b for a, b in zip(executed, executed[1:]))}


def main(specs, order="free", steps=("plain", "sqrt"), plan=None, classes=100):
    rows = []
    for spec in specs:
        name, size, batch = spec.split(",")
        keras.utils.set_random_seed(0)
        model = build_model(name, image_size=int(size), classes=classes)
        x, y = synthetic_batch(model, int(batch))
        row = {"model": name, "size": int(size), "batch": int(batch)}
        if order == "free" and "plain" in steps:
            plain = tf.function(train_step(model))
            ir = build_ir(plain.get_concrete_function(x, y).graph)
            row["plain"] = compare(ir, None, plain, x, y)
        if order == "free" and "sqrt" in steps:
            recompute = lms_tf.function(train_step(model), device="/CPU:0", swap=False, recompute="sqrt")
            recompute.get_concrete_function(x, y)
            row["sqrt"] = compare(recompute.plain_irs[-1], recompute.plan, recompute, x, y)
        if order == "serialized" and "plain" in steps:
            row["plain_serialized"] = serialized(model, x, y)
        if order == "serialized" and "sqrt" in steps:
            row["sqrt_serialized"] = serialized(model, x, y, recompute="sqrt")
        if order == "serialized" and "plan" in steps:
            row["plan_serialized"] = serialized(model, x, y, plan=plan)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", choices=("free", "serialized"), default="free")
    parser.add_argument("--step", choices=("plain", "sqrt", "both", "plan"), default="both",
                        help="one step per process keeps the other's allocator history out of its peak")
    parser.add_argument("--plan", help="with --step plan: the plan's JSON file (Plan.to_json)")
    parser.add_argument("--classes", type=int, default=100, help="the model's output classes")
    parser.add_argument("--device-spec", default=COST.device.name, help="the device preset the steps are planned for")
    parser.add_argument("specs", nargs="+", metavar="MODEL,SIZE,BATCH")
    args = parser.parse_args()
    if (args.step == "plan") != (args.plan is not None) or (args.step == "plan" and args.order != "serialized"):
        parser.error("--plan goes with --step plan and --order serialized")
    COST = CostModel(get_device_spec(args.device_spec))
    plan = None
    if args.plan:
        with open(args.plan) as file:
            plan = lms_tf.Plan.from_json(file.read())
    main(args.specs, order=args.order, steps=("plain", "sqrt") if args.step == "both" else (args.step,), plan=plan,
         classes=args.classes)
