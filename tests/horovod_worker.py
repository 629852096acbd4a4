"""One Horovod rank of the data-parallel tests; started by ``horovodrun --gloo -np 2`` from test_frontends_horovod.py.

Usage: python horovod_worker.py SCENARIO OUTDIR

Scenarios:
    all: every scenario below in one job (one TF start-up per rank); each rank writes
        OUTDIR/rank<r>.npz (weights) and OUTDIR/rank<r>.json (logs, graph facts, timings);
        rank 0 also writes the single-process references it computes on the two ranks'
        batches concatenated. LMS_TF_SCENARIOS=a,b limits the job to some of them:
        fit_lms_first, fit_dist_first (LMSCallback with optimizer_on_host), custom
        (lms_tf.function(horovod=True)), custom_buckets (the same with bucket_bytes=1024),
        pipelined (executed-op order of PROFILED_STEPS steps, each profiled alone, with one
        bucket per gradient), one_bucket (the same with a single allreduce), pipelined_lms
        (pipelined, with LMSCallback planning the step for a budget, serialized).
    raise: rank 1 raises in its third training batch; rank 0 keeps training. The job must stop.

Each rank initialises its model from a different seed, so equal weights prove the broadcast.
The models have no BatchNormalization or Dropout: their per-rank statistics and masks make
data-parallel training legitimately differ from one process on the concatenated batch.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.threading.set_inter_op_parallelism_threads(2)

import keras  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.horovod import horovod_tensorflow  # noqa: E402
from lms_tf.keras import DistributedCallback  # noqa: E402
from lms_tf.keras.step_hooks import add_step_hook  # noqa: E402
from lms_tf.tf.diagnostics import executed_ops  # noqa: E402
from tests.helpers import count_ops, first_consumers, graph_probe  # noqa: E402

hvd = horovod_tensorflow()
RANK, SIZE = hvd.rank(), hvd.size()
CPU_LMS = dict(device="/CPU:0", host="/CPU:1", min_swap_bytes=0)
LOCAL_BATCH, STEPS = 4, 3
# Measured under a busy neighbour process: about one profiled step in three sees no bucket in
# time, so ten steps make "at least one" fail about once in 60,000 jobs per rank and test.
PROFILED_STEPS = 10
# The budget planner on top of sqrt(n) recompute, just above the smallest budget this step can be
# planned for (so it swaps as well), serialized. The smallest differs between TensorFlow / Keras
# pairs (their traced steps differ): it is asked for first.
TIGHTEST = "tightest"
LMS_BUDGET = dict(CPU_LMS, budget=TIGHTEST, recompute="sqrt", device_spec="v100-16gb-pcie3", serialize=True,
                  batch_size=32 // SIZE)
#: How far above the smallest feasible budget the tightest plan aims.
TIGHTEST_MARGIN = 1.005


def progress(message: str) -> None:
    """One line per stage on stderr, so a hung job shows where it stopped."""
    print(f"[rank {RANK}] {message}", file=sys.stderr, flush=True)


def conv_model(seed: int) -> keras.Model:
    """A Functional model with a branch and a skip connection."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv_a")(inputs)
    branch = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv_b")(x)
    x = keras.layers.Add(name="skip")([x, branch])
    x = keras.layers.Conv2D(8, 3, strides=2, activation="relu", name="conv_c")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(5, name="head")(x)
    return keras.Model(inputs, outputs, name="hvd_net")


def global_data(samples: int):
    rng = np.random.RandomState(123)
    return (rng.rand(samples, 12, 12, 3).astype("float32"),
            rng.randint(0, 5, size=(samples,)).astype("int32"))


def shard(x, y):
    """This rank's part of each global batch: rows [k*G + r*B, k*G + (r+1)*B) of global batch k."""
    global_batch = LOCAL_BATCH * SIZE
    rows = [k * global_batch + RANK * LOCAL_BATCH + i for k in range(len(x) // global_batch)
            for i in range(LOCAL_BATCH)]
    return x[rows], y[rows]


def compile_(model):
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"])
    return model


def fit_scenario(name: str, lms_first: bool, results: dict, weights: dict, lms_options=None) -> None:
    x, y = global_data(LOCAL_BATCH * SIZE * STEPS)
    model = compile_(conv_model(seed=100 + RANK))
    initial = [w.numpy() for w in model.weights]  # on rank 0: what DistributedCallback broadcasts
    lms = lms_tf.LMSCallback(**{**CPU_LMS, "recompute": "cheap", "optimizer_on_host": name == "fit_dist_first",
                                **(lms_options or {})})
    dist = DistributedCallback(bucket_bytes=1024)
    facts: dict = {}
    add_step_hook(model, graph_probe(facts))
    xs, ys = shard(x, y)
    history = model.fit(xs, ys, batch_size=LOCAL_BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[lms, dist] if lms_first else [dist, lms])
    weights[f"{name}/dist"] = [w.numpy() for w in model.weights]
    results[name] = dict(history=history.history, local_logs=[{k: float(v) for k, v in logs.items()}
                                                                for logs in dist.local_logs],
                         broadcast=dist.broadcast_count, plan_swapped=len(lms.plan.swapped),
                         offloaded=len(lms.plan.offloaded_weights), **count_ops(facts["graph"]))
    if RANK == 0:
        reference = compile_(conv_model(seed=100))
        reference.set_weights(initial)
        reference.fit(x, y, batch_size=LOCAL_BATCH * SIZE, epochs=2, shuffle=False, verbose=0)
        weights[f"{name}/reference"] = [w.numpy() for w in reference.weights]


def custom_loop_scenario(results: dict, weights: dict, key: str = "custom", lms_options=None) -> None:
    x, y = global_data(LOCAL_BATCH * SIZE * STEPS)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make_step(model, optimizer, decorator):
        @decorator
        def step(images, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(images, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return step

    model = conv_model(seed=200 + RANK)
    initial = [w.numpy() for w in model.weights]
    optimizer = keras.optimizers.Adam(1e-2)
    options = lms_options or {}
    if options.get("weights") == "host":
        lms_tf.place_weights(model, optimizer, host=CPU_LMS["host"])
    step = make_step(model, optimizer, lms_tf.function(horovod=True, **CPU_LMS, **options))
    xs, ys = shard(x, y)
    losses = [float(step(xs[k * LOCAL_BATCH:(k + 1) * LOCAL_BATCH], ys[k * LOCAL_BATCH:(k + 1) * LOCAL_BATCH]))
              for k in range(STEPS)]
    weights[f"{key}/dist"] = [w.numpy() for w in model.weights]
    graph = step.get_concrete_function(xs[:LOCAL_BATCH], ys[:LOCAL_BATCH]).graph
    results[key] = dict(losses=losses, plan_swapped=len(step.plan.swapped), offloaded=len(step.plan.offloaded_weights),
                             **count_ops(graph))
    if RANK == 0:
        reference = conv_model(seed=200)
        reference.set_weights(initial)
        plain = make_step(reference, keras.optimizers.Adam(1e-2), tf.function)
        global_batch = LOCAL_BATCH * SIZE
        for k in range(STEPS):
            plain(x[k * global_batch:(k + 1) * global_batch], y[k * global_batch:(k + 1) * global_batch])
        weights[f"{key}/reference"] = [w.numpy() for w in reference.weights]


def deep_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((32, 32, 3))]
                            + [keras.layers.Conv2D(32, 3, padding="same", activation="relu", name=f"conv{i}")
                               for i in range(8)]
                            + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, name="head")],
                            name="deep")


def deep_data(rows: slice):
    """Rows of one global batch of 32 (rank r of 2 trains on rows 16r..16r+15)."""
    images = np.random.RandomState(5).rand(32, 32, 32, 3).astype("float32")
    labels = np.arange(32, dtype="int32") % 10
    return iter(tf.data.Dataset.from_tensor_slices((images[rows], labels[rows])).batch(32).repeat())


def compile_deep(model):
    """SGD: Adam divides each update by the gradient's running magnitude, which turns the last-bit
    difference between averaging two half-batch means and one global mean into visible weight
    differences where a gradient is near zero (1e-3 after 7 steps of this net)."""
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def pipelined_scenario(results: dict, weights: dict, bucket_bytes, key: str, lms_options=None) -> None:
    """Executed-op order of single steps of a deeper net, with the given gradient buckets; with
    ``lms_options`` the step is also planned by lms-tf (its callback hooked in before Horovod's)."""
    if lms_options is not None and lms_options.get("budget") == TIGHTEST:
        lms_options = dict(lms_options, budget=_tightest_budget(bucket_bytes, lms_options))
        progress(f"{key}: the tightest budget is {lms_options['budget']} bytes")
    model = compile_deep(deep_model())
    initial = [w.numpy() for w in model.weights]
    local = 32 // SIZE
    iterator = deep_data(slice(RANK * local, (RANK + 1) * local))
    # Drive the callbacks by hand to profile single steps of fit's own train function.
    callbacks = [DistributedCallback(bucket_bytes=bucket_bytes)]
    if lms_options is not None:
        callbacks.insert(0, lms_tf.LMSCallback(**lms_options))
    facts: dict = {}
    add_step_hook(model, graph_probe(facts))
    _begin_training(model, callbacks)
    for _ in range(2):  # trace, then warm up
        model.train_function(iterator)
    # Overlap is a race between two processes on two cores: one profiled step can miss it when
    # the other rank lags by a whole backward pass, so several steps are profiled separately, and
    # each starts from a barrier. Without it, the ranks' profiler start-ups and stops (and a
    # neighbouring test worker taking a core from one rank) add up to a lag longer than this
    # small model's backward pass, and no bucket of any step arrives in time.
    steps = [executed_ops(lambda: (_barrier(), model.train_function(iterator))) for _ in range(PROFILED_STEPS)]
    for callback in callbacks[::-1]:
        callback.on_train_end()
    graph = facts["graph"]
    allreduce_ops = [op for op in graph.get_operations() if op.type.startswith("HorovodGroupedAllreduce")]
    per_step = [_overlap(events, allreduce_ops) for events in steps]
    results[key] = dict(allreduce_ops=len(allreduce_ops), steps=per_step, **_chain_facts(graph, allreduce_ops),
                        allreduce_devices=[op.device for op in allreduce_ops])
    if lms_options is not None:
        plan = callbacks[0].plan
        results[key].update(plan_swapped=len(plan.swapped), plan_recomputed=len(plan.recomputed),
                            lms_ops=count_ops(graph)["lms_ops"])
    weights[f"{key}/dist"] = [w.numpy() for w in model.weights]
    if RANK == 0:  # one process, the same steps on the global batch
        reference = compile_deep(deep_model())
        reference.set_weights(initial)
        reference.make_train_function()
        global_batches = deep_data(slice(0, 32))
        for _ in range(2 + PROFILED_STEPS):
            reference.train_function(global_batches)
        weights[f"{key}/reference"] = [w.numpy() for w in reference.weights]


def _barrier() -> None:
    """Return once every rank has reached this point (an eager allreduce of one number)."""
    hvd.allreduce(tf.constant(0.0), name="profiled_step_barrier").numpy()


def _begin_training(model, callbacks) -> None:
    """What ``fit`` does with its callbacks before the first step (the steps are driven by hand)."""
    for callback in callbacks:
        callback.set_model(model)
        callback.on_train_begin()


def _tightest_budget(bucket_bytes, lms_options) -> int:
    """:data:`TIGHTEST_MARGIN` times the smallest budget the planner finds for this step, read off
    the error a 1 KiB budget raises while the step is traced (on every rank alike, before any of
    the step's collectives runs)."""
    model = compile_deep(deep_model())
    callbacks = [lms_tf.LMSCallback(**dict(lms_options, budget=1024)), DistributedCallback(bucket_bytes=bucket_bytes)]
    _begin_training(model, callbacks)
    try:
        model.train_function(deep_data(slice(RANK * (32 // SIZE), (RANK + 1) * (32 // SIZE))))
    except lms_tf.InfeasibleBudgetError as err:
        return int(err.smallest_feasible_bytes * TIGHTEST_MARGIN)
    finally:
        for callback in callbacks[::-1]:
            callback.on_train_end()
    raise AssertionError("a 1 KiB budget was planned: the step no longer needs memory?")


def _chain_facts(graph, allreduce_ops) -> dict:
    """What serialize=True chained, and whether any allreduce (or what waits on it) is in the chain."""
    from lms_tf.tf.rewrite.serialize import serial_chain

    chain = serial_chain(graph)
    downstream, frontier = set(), list(allreduce_ops)
    while frontier:
        op = frontier.pop()
        if op.name in downstream:
            continue
        downstream.add(op.name)
        frontier.extend(c for t in op.outputs for c in t.consumers())
        frontier.extend(op._control_outputs)
    return dict(chained_ops=len(chain), chained_collective_or_after=sum(op.name in downstream for op in chain))


def _overlap(events, allreduce_ops) -> dict:
    """How many buckets' consumers started before the last backward op of one step ended.

    The profiler records no event for Horovod's asynchronous kernels, so each bucket's
    allreduce is observed through its consumers (the optimizer update): a consumer that
    started before the backward pass ended proves the bucket was averaged during backward.
    """
    backward = [e for e in events if "gradient_tape" in e.node]
    last_backward_end = max(e.end_ps for e in backward)
    consumer_starts = []
    for op in allreduce_ops:
        starts = [e.start_ps for name in first_consumers(op) for e in events
                  if e.node == name or e.node.endswith("/" + name)]
        consumer_starts.append(min(starts) if starts else None)
    return dict(backward_ops=len(backward), last_backward_end=last_backward_end,
                first_backward_start=min(e.start_ps for e in backward), consumer_starts=consumer_starts,
                buckets_consumed_before_backward_end=sum(t is not None and t < last_backward_end
                                                         for t in consumer_starts))


def main() -> None:
    scenario, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    if scenario == "raise":
        model = compile_(conv_model(seed=1))
        x, y = shard(*global_data(LOCAL_BATCH * SIZE * 50))

        class Fail(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if RANK == 1 and batch == 2:
                    raise RuntimeError("rank 1 failed on purpose in batch 2")

        model.fit(x, y, batch_size=LOCAL_BATCH, epochs=50, verbose=0,
                  callbacks=[DistributedCallback(), Fail()])
        return
    results: dict = {"rank": RANK, "size": SIZE}
    weights: dict = {}
    wanted = set(os.environ.get("LMS_TF_SCENARIOS", "fit_lms_first,fit_dist_first,custom,custom_buckets,pipelined,"
                                "one_bucket,pipelined_lms,fit_weights_host,custom_weights_host,fit_average_host,"
                                "custom_average_host,pipelined_average_host").split(","))
    for name, run in [("fit_lms_first", lambda: fit_scenario("fit_lms_first", True, results, weights)),
                      ("fit_dist_first", lambda: fit_scenario("fit_dist_first", False, results, weights)),
                      ("fit_weights_host", lambda: fit_scenario("fit_weights_host", True, results, weights,
                                                                {"weights": "host"})),
                      ("custom_weights_host", lambda: custom_loop_scenario(results, weights, "custom_weights_host",
                                                                           {"weights": "host"})),
                      ("fit_average_host", lambda: fit_scenario("fit_average_host", False, results, weights,
                                                                {"optimizer_on_host": True, "average_on": "host"})),
                      ("custom_average_host", lambda: custom_loop_scenario(
                          results, weights, "custom_average_host", {"optimizer_on_host": True, "average_on": "host"})),
                      ("custom", lambda: custom_loop_scenario(results, weights)),
                      ("custom_buckets", lambda: custom_loop_scenario(results, weights, "custom_buckets",
                                                                      {"bucket_bytes": 1024})),
                      ("pipelined", lambda: pipelined_scenario(results, weights, 1, "pipelined")),
                      ("one_bucket", lambda: pipelined_scenario(results, weights, None, "one_bucket")),
                      ("pipelined_lms", lambda: pipelined_scenario(results, weights, 1, "pipelined_lms", LMS_BUDGET)),
                      ("pipelined_average_host", lambda: pipelined_scenario(
                          results, weights, 1, "pipelined_average_host",
                          dict(CPU_LMS, optimizer_on_host=True, average_on="host", batch_size=32 // SIZE)))]:
        if name not in wanted:
            continue
        progress(f"{name} ...")
        run()
        progress(f"{name} done")
    np.savez(os.path.join(outdir, f"rank{RANK}.npz"),
             **{f"{key}/{i}": w for key, ws in weights.items() for i, w in enumerate(ws)})
    with open(os.path.join(outdir, f"rank{RANK}.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
