"""One Horovod rank of the hybrid-parallel tests; started by ``horovodrun --gloo -np G`` from
test_parallel_hybrid.py.

Usage: python hybrid_worker.py OUTDIR [vgg16|vgg16_adam|overlap|dp|hybrid|disagree|dies|uneven]

Every rank builds the same model (one seed), shards its large layers with
``lms_tf.parallel.hybridize`` and trains on its own rows of each global batch, 10 steps, four
ways: a custom loop (``lms_tf.function(horovod=True)``) and ``fit`` (``DistributedCallback``),
each without and with lms-tf swapping the step's activations. Rank 0 also trains the original
model in one process on the whole global batches (the reference). The models:

- a VGG-like model at CIFAR-10 shape, small enough for a CPU: convolutions and pooling, then two
  wide Dense layers (fc1 split by rows: it has more inputs than outputs; fc2 by columns) and a
  classifier. No BatchNormalization or Dropout: their per-rank statistics and masks make
  data-parallel training legitimately differ. It is also trained through ``fit`` with
  ``LMSCallback(budget=)`` planning the rank's step just above its smallest feasible budget.
- a text model (scenario names start with ``text_``): its embedding table split by columns, a
  second table (9 columns) by token id, its projection over the vocabulary at every position by
  columns.
- a subclassed model (scenario names start with ``subclassed_``) that uses ``ShardedDense`` in its
  definition; its whole weights gathered with ``whole_weights``.
- with ``vgg16``: Keras's VGG-16 at CIFAR-10 shape (fc1 and fc2 4096 wide, 33.6M parameters), the
  same four ways, with SGD; it writes OUTDIR/vgg16_rank<r>.json and .npz. With ``vgg16_adam``,
  VGG-16 with Adam, hybrid and purely data-parallel (custom loops): OUTDIR/vgg16_adam_rank<r>.*.

Each rank writes OUTDIR/rank<r>.json (losses, variable bytes) and OUTDIR/rank<r>.npz (the
unsharded weights: every rank gathers them, so each has the whole model).

With ``overlap``, each rank profiles one step and writes when each sharded layer's backward ops
ran (OUTDIR/overlap_rank<r>.json). With ``disagree``, rank 1 builds a different model and each rank writes what ``hybridize`` said;
with ``dies``, rank 1 raises while training and the job must end; with ``uneven``, rank 1 feeds a
smaller batch and each rank writes what its step said. With ``dp`` or ``hybrid``, each rank
instead measures its allocator's peak over one step of the VGG-like model (see :func:`memory`)
and writes OUTDIR/memory_<kind>_rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # per-rank allocator statistics
# Horovod's fusion packs whichever tensors are ready in a cycle into one buffer, so the ring's
# order of summation (and a weight's last bits) depends on timing: with it on, 2 of VGG-16's
# biases landed 2e-5 from one process in one run of four. Without fusion every collective is
# reduced on its own, and two runs give the same bits. Measuring memory needs it off too: the
# 64 MiB fusion buffer, allocated when a collective first needs it, would be counted in some
# runs and not others.
os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
if len(sys.argv) > 2 and sys.argv[2] in ("dp", "hybrid"):
    # oneDNN's per-op scratch buffers, as many as ops run at once, come from the same allocator.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
MEASURING = len(sys.argv) > 2 and sys.argv[2] in ("dp", "hybrid")
tf.config.threading.set_inter_op_parallelism_threads(1 if MEASURING else 2)
if MEASURING:  # measuring memory: one op at a time, so each step's peak is the same
    tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.horovod import horovod_tensorflow, is_sharded  # noqa: E402
from lms_tf.keras import DistributedCallback  # noqa: E402
from lms_tf.parallel import (ShardedDense, ShardedEmbedding, hybridize, save_unsharded, unshard,  # noqa: E402
                             whole_weights)

hvd = horovod_tensorflow()
RANK, SIZE = hvd.rank(), hvd.size()
LOCAL_BATCH, STEPS, WIDE = 4, 10, 512
OUTDIR = "."
TEXT_VOCAB, TEXT_LENGTH = 1024, 8
CPU_LMS = dict(device="/CPU:0", host="/CPU:1")
# The TFLMS rule, eager to swap (this model's activations are small): the rewrite acts on a step
# with the sharded layers' collectives in it.
LMS = dict(min_swap_bytes=0, swapout_threshold=2)
# The budget planner on a rank's step (told a V100's costs), at 1.05x its smallest feasible budget,
# at a batch whose activations outweigh the weights' gradients (at LOCAL_BATCH there is nothing to
# plan): compared with the same hybrid fit without lms-tf ("fit_big"), bit for bit.
BUDGET = dict(device_spec="v100-16gb-pcie3", recompute="auto")
BUDGET_BATCH = 32


def vgg_like(convs_per_block: int = 1) -> keras.Model:
    keras.utils.set_random_seed(11)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for filters in (16, 32):
        for _ in range(convs_per_block):
            h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(WIDE, activation="relu", name="fc1")(h)
    h = keras.layers.Dense(WIDE, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="predictions")(h))


def vgg16_cifar() -> keras.Model:
    """Keras's VGG-16 at CIFAR-10 shape: its 13 convolutions, then fc1 and fc2 4096 wide (33.6M
    parameters, 57% of them in the two Dense layers)."""
    keras.utils.set_random_seed(13)
    inputs = keras.Input((32, 32, 3))
    features = keras.applications.VGG16(include_top=False, weights=None, input_tensor=inputs)
    h = keras.layers.Flatten()(features.output)
    h = keras.layers.Dense(4096, activation="relu", name="fc1")(h)
    h = keras.layers.Dense(4096, activation="relu", name="fc2")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="predictions")(h))


class SubclassedNet(keras.Model):
    """A subclassed model, whose layers ``hybridize`` cannot replace from outside: its two wide
    layers are ``ShardedDense`` in its definition (fc1 by rows, fc2 by columns), or plain
    ``Dense`` in the reference. Built by a call on a symbolic input: Keras traces ``call``, so the
    sharded layers are built inside a trace."""

    def __init__(self, sharded: bool):
        super().__init__()
        keras.utils.set_random_seed(14)

        def wide(name, sharding):
            if sharded:
                return ShardedDense(WIDE, activation="relu", sharding=sharding, name=name)
            return keras.layers.Dense(WIDE, activation="relu", name=name)

        self.conv = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv")
        self.pool = keras.layers.MaxPooling2D()
        self.flatten = keras.layers.Flatten()
        self.fc1, self.fc2 = wide("fc1", "rows"), wide("fc2", "columns")
        self.classify = keras.layers.Dense(10, name="predictions")

    def call(self, x):
        return self.classify(self.fc2(self.fc1(self.flatten(self.pool(self.conv(x))))))


def subclassed(sharded: bool) -> keras.Model:
    model = SubclassedNet(sharded)
    model(keras.Input((32, 32, 3)))
    return model


def images(local: int = LOCAL_BATCH):
    rng = np.random.default_rng(3)
    n = local * SIZE * STEPS
    return rng.random((n, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, n)


#: What the numbers scenarios train: a model, its data (every global batch of the 10 steps, given
#: the rows per rank) and the size from which ``hybridize`` shards a layer.
VGG_LIKE = dict(build=vgg_like, data=images, min_param_bytes=1 << 20, optimizer=keras.optimizers.Adam)
#: VGG-16 trains with SGD (TensorFlow's default settings) for the 1e-5 comparison; with Adam, see
#: :func:`adam_limit`.
#: ``hybrid`` builds the sharded model itself (no ``hybridize``); ``whole_weights`` gathers it.
SUBCLASSED = dict(build=lambda: subclassed(False), hybrid=lambda: subclassed(True), data=images,
                  optimizer=keras.optimizers.Adam)
VGG16 = dict(build=vgg16_cifar, data=images, min_param_bytes=1 << 20, optimizer=keras.optimizers.SGD)
#: The budget plan's model: two convolutions a block, so its activations, not the MaxPoolGrad that
#: holds a block's input and output gradient at once (what one convolution a block peaks in), set
#: the peak that a plan can lower (20.6 MiB plain, 16.1 least in one process at 32 images).
BUDGETED = dict(VGG_LIKE, build=lambda: vgg_like(convs_per_block=2))
SUBJECT = VGG_LIKE


def data(local: int = LOCAL_BATCH):
    return SUBJECT["data"](local)


def build_hybrid():
    if "hybrid" in SUBJECT:
        return SUBJECT["hybrid"]()
    return hybridize(SUBJECT["build"](), min_param_bytes=SUBJECT["min_param_bytes"])


def sharded_layers(model) -> list:
    return [layer.name for layer in model.layers if isinstance(layer, (ShardedDense, ShardedEmbedding))]


def gathered(model) -> list:
    """The whole weights of the trained hybrid model: :func:`unshard`'s model, or (subclassed)
    :func:`whole_weights`."""
    return whole_weights(model) if "hybrid" in SUBJECT else [w.numpy() for w in unshard(model).weights]


def mine(x, y, local: int = LOCAL_BATCH):
    """This rank's rows of each global batch, in step order."""
    rows = np.concatenate([np.arange(k * local * SIZE + RANK * local, k * local * SIZE + (RANK + 1) * local)
                           for k in range(STEPS)])
    return x[rows], y[rows]


def make_step(model, optimizer, decorate):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return decorate(step)


def variable_bytes(model) -> dict:
    sharded = sum(np.array(v).nbytes for v in model.trainable_variables if is_sharded(v))
    return dict(weight_bytes=sum(np.array(v).nbytes for v in model.trainable_variables), sharded_weight_bytes=sharded,
                slot_bytes=sum(np.array(v).nbytes for v in model.optimizer.variables
                               if "momentum" in v.path or "velocity" in v.path) if model.optimizer else 0)


def custom(results, weights, name, options, hybrid: bool = True):
    """A custom loop; with ``hybrid=False`` the original model, purely data-parallel."""
    x, y = mine(*data())
    model = build_hybrid() if hybrid else hybridize(SUBJECT["build"](), min_param_bytes=1 << 62)
    optimizer = SUBJECT["optimizer"]()
    optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer, lms_tf.function(horovod=True, **CPU_LMS, **options))
    losses = []
    for k in range(STEPS):
        batch = slice(k * LOCAL_BATCH, (k + 1) * LOCAL_BATCH)
        local = step(x[batch], y[batch])
        losses.append(float(hvd.allreduce(local, op=hvd.Average, name=f"{name}_loss_{k}")))
    model.optimizer = optimizer
    results[name] = dict(losses=losses, sharded_layers=sharded_layers(model),
                         shardings=[layer.sharding for layer in model.layers if layer.name in sharded_layers(model)],
                         swapped=len(step.plan.swapped) if step.plan else 0, **variable_bytes(model))
    weights[name] = gathered(model)
    if name == "custom" and SUBJECT is VGG_LIKE:
        results["saved"] = save_and_load(model, weights[name])


def save_and_load(model, whole) -> dict:
    """Saves the trained hybrid model unsharded, loads it on every rank as Keras would, and splits
    it again: the loaded model is the ordinary one with the whole weights, and the split copy holds
    what this rank trained."""
    path = os.path.join(OUTDIR, "saved.keras")
    save_unsharded(model, path)
    loaded = keras.models.load_model(path)
    again = hybridize(loaded, min_param_bytes=1 << 20)
    return dict(kinds=sorted({type(layer).__name__ for layer in loaded.layers if layer.weights}),
                loaded_equal=all(np.array_equal(a, b.numpy()) for a, b in zip(whole, loaded.weights)),
                resplit_equal=all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(model.weights, again.weights)))


def fit(results, weights, name, lms_options, local: int = LOCAL_BATCH):
    x, y = mine(*data(local), local)
    model = build_hybrid()
    model.compile(optimizer=SUBJECT["optimizer"](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [DistributedCallback()]
    if lms_options is not None:
        callbacks.insert(0, lms_tf.LMSCallback(**CPU_LMS, **lms_options))
    history = model.fit(x, y, batch_size=local, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    results[name] = dict(loss=history.history["loss"][-1], sharded_layers=sharded_layers(model),
                         **variable_bytes(model))
    if lms_options is not None:
        plan = callbacks[0].plan
        results[name].update(plan_swapped=len(plan.swapped) if plan else 0,
                             plan_recomputed=len(plan.recomputed) if plan else 0,
                             budget=lms_options.get("budget"),
                             planned_peak=plan.predictions.planned_allocator_peak_bytes if plan and plan.predictions else None)
    weights[name] = gathered(model)


def tightest_budget() -> int:
    """1.05 x the smallest budget the planner finds for this rank's fit step (sharded layers and
    their collectives in it), read off the error a 1 KiB budget raises while the step is traced:
    on every rank alike, before any of the step's collectives runs."""
    x, y = mine(*data(BUDGET_BATCH), BUDGET_BATCH)
    model = build_hybrid()
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [lms_tf.LMSCallback(**CPU_LMS, **dict(BUDGET, budget=1024)), DistributedCallback()]
    try:
        model.fit(x[:BUDGET_BATCH], y[:BUDGET_BATCH], batch_size=BUDGET_BATCH, verbose=0, callbacks=callbacks)
    except lms_tf.InfeasibleBudgetError as error:
        return int(error.smallest_feasible_bytes * 1.05)
    finally:
        for callback in callbacks[::-1]:
            callback.on_train_end()
    raise AssertionError("a 1 KiB budget was planned: the step no longer needs memory?")


def text_model() -> keras.Model:
    """Tokens -> Embedding -> Dense -> a projection over the vocabulary at every position: the
    sharded layers read (batch, positions, features) rows."""
    keras.utils.set_random_seed(12)
    tokens = keras.Input((TEXT_LENGTH,), dtype="int32")
    h = keras.layers.Concatenate()([keras.layers.Embedding(TEXT_VOCAB, 32, name="embedding")(tokens),
                                    # 9 columns do not split across 2 or 4 ranks: split by token id
                                    keras.layers.Embedding(2 * TEXT_VOCAB, 9, name="tags")(tokens)])
    h = keras.layers.Dense(64, activation="relu", name="hidden")(h)
    return keras.Model(tokens, keras.layers.Dense(TEXT_VOCAB, name="projection")(h))


def text_data(local: int = LOCAL_BATCH):
    rng = np.random.default_rng(4)
    n = local * SIZE * STEPS
    return rng.integers(0, TEXT_VOCAB, (n, TEXT_LENGTH)).astype("int32"), rng.integers(0, TEXT_VOCAB, (n, TEXT_LENGTH))


TEXT = dict(build=text_model, data=text_data, min_param_bytes=64 << 10, optimizer=keras.optimizers.Adam)


def reference(results, weights, name: str = "reference", local: int = LOCAL_BATCH):
    """One process, the original model, the whole global batch per step."""
    x, y = data(local)
    model = SUBJECT["build"]()
    optimizer = SUBJECT["optimizer"]()
    step = make_step(model, optimizer, tf.function)
    global_batch = local * SIZE
    losses = [float(step(x[k * global_batch:(k + 1) * global_batch], y[k * global_batch:(k + 1) * global_batch]))
              for k in range(STEPS)]
    results[name] = dict(losses=losses)
    weights[name] = [w.numpy() for w in model.weights]


def memory(outdir: str, kind: str) -> None:
    """One process per rank, one model: ``dp`` (the original model, data-parallel) or ``hybrid``.
    Each rank's allocator (its own process) counts what this rank holds: the peak of the fourth
    step above what was in use when it started (gradients, activations, the collectives' buffers),
    and that start above what was in use before the model was built."""
    x, y = mine(*data())
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model = vgg_like() if kind == "dp" else hybridize(vgg_like(), min_param_bytes=1 << 20)
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer, lms_tf.function(horovod=True, **CPU_LMS, swap=False, recompute=False))
    for k in range(3):
        step(x[k * LOCAL_BATCH:(k + 1) * LOCAL_BATCH], y[k * LOCAL_BATCH:(k + 1) * LOCAL_BATCH]).numpy()
    with lms_tf.measure_peak_memory("CPU:0", settle_seconds=0.3) as measured:
        step(x[3 * LOCAL_BATCH:4 * LOCAL_BATCH], y[3 * LOCAL_BATCH:4 * LOCAL_BATCH]).numpy()
    model.optimizer = optimizer
    # What else a process keeps between steps (Horovod's and the runtime's buffers) varies from
    # run to run by tens of MiB with 4 ranks on 2 cores; the step's own peak above its start does not.
    facts = dict(peak_bytes=measured.peak_total_bytes - before, step_peak_bytes=measured.peak_bytes,
                 start_bytes=measured.start_bytes - before, **variable_bytes(model))
    with open(os.path.join(outdir, f"memory_{kind}_rank{RANK}.json"), "w") as handle:
        json.dump(facts, handle)


def overlap(outdir: str) -> None:
    """One profiled step of the VGG-like hybrid model. For each sharded layer: when its input
    gradient's partial product ran, when its kernel gradient's product ran, and when the first
    op that needs the collective completing the input gradient (anything downstream of it)
    started: the collective was in flight between the first and the last."""
    from lms_tf._compat.profiler import profile_executed_ops

    x, y = mine(*data())
    model = build_hybrid()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = make_step(model, optimizer, lms_tf.function(horovod=True, **CPU_LMS, swap=False, recompute=False))
    for k in range(2):
        step(x[k * LOCAL_BATCH:(k + 1) * LOCAL_BATCH], y[k * LOCAL_BATCH:(k + 1) * LOCAL_BATCH]).numpy()
    events = profile_executed_ops(lambda: step(x[:LOCAL_BATCH], y[:LOCAL_BATCH]).numpy())
    spans = {}
    for node, _, start, end in events:
        spans.setdefault(node, []).append((start, end))
    graph = step.get_concrete_function(x[:LOCAL_BATCH], y[:LOCAL_BATCH]).graph
    facts = {}
    for layer in model.hybrid_plan.sharded_layers:
        collective = next(op for op in graph.get_operations()
                          if op.type.startswith("Horovod") and op.name.endswith(f"lms_tf_sharded_{layer}_dx"))
        part = collective.inputs[0].op
        kernel = next(op for op in graph.get_operations() if part in op.control_inputs and op.type == "MatMul")
        part_ran, kernel_ran = spans[part.name][0], spans[kernel.name][0]
        # The ops that read the collective's result, or the first profiled op on each path from
        # it (shape ops run inline, unprofiled). An op of the same name in another function body
        # may also have run: only runs after the partial product count (nothing downstream of
        # the collective can start before it), which can only make the first reader earlier.
        readers, todo, seen = [], [collective], set()
        while todo:
            for reader in [c for t in todo.pop().outputs for c in t.consumers()]:
                if reader.name in seen:
                    continue
                seen.add(reader.name)
                later = [span for span in spans.get(reader.name, []) if span[0] >= part_ran[1]]
                if later:
                    readers.append((*min(later), reader.name))
                else:
                    todo.append(reader)
        facts[layer] = dict(part=part_ran, kernel=kernel_ran, first_reader=min(readers),
                            names=[part.name, kernel.name, collective.name])
    with open(os.path.join(outdir, f"overlap_rank{RANK}.json"), "w") as handle:
        json.dump(facts, handle, indent=1)


def disagree(outdir: str) -> None:
    """Rank 1 builds a wider fc2 than the others: hybridize must say so on every rank."""
    global WIDE
    if RANK == 1:
        WIDE = 2 * WIDE
    try:
        hybridize(vgg_like(), min_param_bytes=1 << 20)
        outcome = "no error"
    except lms_tf.LMSOptionError as error:
        outcome = str(error)
    with open(os.path.join(outdir, f"disagree_rank{RANK}.txt"), "w") as handle:
        handle.write(outcome)


def dies() -> None:
    """Rank 1 fails in its third training batch; the others must stop, not wait for it."""
    x, y = mine(*data())
    model = hybridize(vgg_like(), min_param_bytes=1 << 20)
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Fail(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if RANK == 1 and batch == 2:
                raise RuntimeError("rank 1 failed on purpose in batch 2")

    model.fit(x, y, batch_size=LOCAL_BATCH, epochs=100, verbose=0, callbacks=[DistributedCallback(), Fail()])


def uneven(outdir: str) -> None:
    """Rank 1 feeds one row fewer than the others (an uneven last batch): every rank's step must
    stop with the library's message, not compute with another rank's rows or wait."""
    x, y = mine(*data())
    model = hybridize(vgg_like(), min_param_bytes=1 << 20)
    optimizer = keras.optimizers.Adam()
    step = make_step(model, optimizer, lms_tf.function(horovod=True, **CPU_LMS, swap=False, recompute=False))
    rows = LOCAL_BATCH - (1 if RANK == 1 else 0)
    try:
        step(x[:rows], y[:rows]).numpy()
        outcome = "no error"
    except tf.errors.InvalidArgumentError as error:
        outcome = error.message
    with open(os.path.join(outdir, f"uneven_rank{RANK}.txt"), "w") as handle:
        handle.write(outcome)


def main() -> None:
    global OUTDIR
    outdir = OUTDIR = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    mode = sys.argv[2] if len(sys.argv) > 2 else "numbers"
    if mode in ("dp", "hybrid"):
        return memory(outdir, mode)
    if mode in ("disagree", "uneven"):
        return (disagree if mode == "disagree" else uneven)(outdir)
    if mode == "dies":
        return dies()
    if mode == "overlap":
        return overlap(outdir)
    results: dict = {"rank": RANK, "size": SIZE}
    weights: dict = {}
    if mode == "vgg16":
        numbers(results, weights, VGG16)
        return save(outdir, "vgg16_", results, weights)
    if mode == "vgg16_adam":
        adam_limit(results, weights)
        return save(outdir, "vgg16_adam_", results, weights)
    numbers(results, weights, TEXT, "text_")
    numbers(results, weights, SUBCLASSED, "subclassed_")
    numbers(results, weights, VGG_LIKE)
    global SUBJECT
    SUBJECT = BUDGETED
    fit(results, weights, "fit_big", None, local=BUDGET_BATCH)
    fit(results, weights, "fit_budget", dict(BUDGET, budget=tightest_budget()), local=BUDGET_BATCH)
    for layer in hybridize(vgg_like(), min_param_bytes=1 << 20).layers:
        if isinstance(layer, ShardedDense):
            results[f"{layer.name}_kernel_shape"] = list(layer.kernel.shape)
            results[f"{layer.name}_sharding"] = layer.sharding
    save(outdir, "", results, weights)


def numbers(results, weights, subject: dict, prefix: str = "") -> None:
    """``subject``'s model, hybrid, 10 steps four ways (custom loop and fit, each without and with
    lms-tf), and on rank 0 one process on the global batches. (So rank 0 has built one model
    more than the others when the next subject starts: the collectives' names must not depend
    on that. They once did, through the model's auto-named scope, and the ranks hung.)"""
    global SUBJECT
    SUBJECT = subject
    custom(results, weights, f"{prefix}custom", {})
    custom(results, weights, f"{prefix}custom_lms", LMS)
    fit(results, weights, f"{prefix}fit", None)
    fit(results, weights, f"{prefix}fit_lms", LMS)
    if RANK == 0:
        reference(results, weights, f"{prefix}reference")


def adam_limit(results, weights) -> None:
    """VGG-16 with Adam, hybrid and purely data-parallel (custom loops), and one process: how far
    data parallelism itself lands from one process when Adam divides each step by the root of the
    second moment (a gradient near zero whose last bits the ranks' order of summation changes then
    moves its weight by up to the learning rate)."""
    global SUBJECT
    SUBJECT = dict(VGG16, optimizer=keras.optimizers.Adam)
    custom(results, weights, "adam_custom", {})
    custom(results, weights, "adam_dp_custom", {}, hybrid=False)
    if RANK == 0:
        reference(results, weights, "adam_reference")


def save(outdir: str, prefix: str, results: dict, weights: dict) -> None:
    np.savez(os.path.join(outdir, f"{prefix}rank{RANK}.npz"),
             **{f"{key}/{i}": w for key, ws in weights.items() for i, w in enumerate(ws)})
    with open(os.path.join(outdir, f"{prefix}rank{RANK}.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
