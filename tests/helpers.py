"""Shared helpers: train a model with and without lms-tf and compare every number."""

import keras
import numpy as np
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from tests.zoo import BATCH

#: Options every test uses so that swaps cross a real device boundary on a CPU-only machine: two
#: logical CPUs (tests/conftest.py) stand in for the accelerator and the host.
CPU_LMS = dict(device="/CPU:0", host="/CPU:1")


class LossRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def numbers_epochs(x) -> int:
    """Epochs of ``fit(x, batch_size=BATCH)`` that run at least :data:`NUMBERS_STEPS` steps."""
    samples = len(x[0]) if isinstance(x, (tuple, list)) else len(x)
    return -(-NUMBERS_STEPS // -(-samples // BATCH))


def fit_steps(builder, callbacks=(), steps_per_execution=1, **compile_kwargs):
    """Builds a zoo model and fits it for at least :data:`NUMBERS_STEPS` steps (whole epochs over its
    data, unshuffled); returns (losses, weights, model)."""
    model, (x, y) = builder(**compile_kwargs) if compile_kwargs else builder()
    if steps_per_execution != 1:
        model.compile(optimizer=model.optimizer, loss=model.loss, steps_per_execution=steps_per_execution)
    recorder = LossRecorder()
    model.fit(x, y, batch_size=BATCH, epochs=numbers_epochs(x), shuffle=False, verbose=0,
              callbacks=[recorder, *callbacks])
    return recorder.losses, [np.array(w) for w in model.get_weights()], model


def keras_train_step(model, optimizer=None):
    """A hand-written step for a zoo model (logits out): tape, gradients, ``optimizer`` (default: the model's)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        (optimizer or model.optimizer).apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                                           model.trainable_variables))
        return loss
    return step


def assert_same_numbers(plain, rewritten, rtol=0.0):
    (losses_a, weights_a), (losses_b, weights_b) = plain[:2], rewritten[:2]
    assert len(losses_a) == len(losses_b) >= 1
    assert len(weights_a) == len(weights_b) >= 1
    if rtol == 0.0:
        assert losses_a == losses_b, (losses_a, losses_b)
        for i, (a, b) in enumerate(zip(weights_a, weights_b)):
            assert np.array_equal(a, b), f"weight {i} differs by up to {np.max(np.abs(a - b))}"
    else:
        np.testing.assert_allclose(losses_a, losses_b, rtol=rtol)
        for a, b in zip(weights_a, weights_b):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7)


#: Training steps of the numbers tests: a last-bit difference grows over steps, so a few would hide it.
NUMBERS_STEPS = 10


def custom_loop(builder, decorate, steps=NUMBERS_STEPS, use_tf_gradients=False, optimizer=None, prepare=None):
    """Trains a zoo model with a hand-written step; returns (losses, weights, step_function).

    Batch i is rows [i * BATCH, (i + 1) * BATCH) of the builder's data, cycling over it.
    ``prepare(model, optimizer)`` runs before the first step (e.g. ``lms_tf.place_weights``)."""
    model, (x, y) = builder()
    optimizer = optimizer or keras.optimizers.SGD(0.05, momentum=0.9)
    if prepare is not None:
        prepare(model, optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(xb, yb):
        if use_tf_gradients:
            loss = loss_fn(yb, model(xb, training=True))
            grads = tf.gradients(loss, [v.value for v in model.trainable_variables])
        else:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    fn = decorate(step)
    losses = []
    batches = len(y) // BATCH
    for i in range(steps):
        sl = slice((i % batches) * BATCH, (i % batches + 1) * BATCH)
        xb = tuple(tf.constant(a[sl]) for a in x) if isinstance(x, tuple) else tf.constant(x[sl])
        losses.append(float(fn(xb, tf.constant(y[sl]))))
    return losses, [np.array(w) for w in model.get_weights()], fn


def first_batch(builder):
    """The first batch :func:`custom_loop` trains on with ``builder``'s data, as tensors (the zoo's
    data is seeded: building again gives the same)."""
    _, (x, y) = builder()
    return tf.constant(x[:BATCH]), tf.constant(y[:BATCH])


def lms_function(**options):
    return lambda step: lms_tf.function(step, **options)


def graph_probe(facts: dict):
    """A step hook that keeps the traced graph (counted after fit, once every hook has rewritten it)."""
    def hook(step):
        def train_step(data):
            facts["graph"] = _compat.current_graph()
            return step(data)
        return train_step
    return hook


def count_ops(graph) -> dict:
    ops = graph.get_operations()
    allreduces = [op for op in ops if op.type.startswith("HorovodGroupedAllreduce")]
    return dict(allreduce_ops=len(allreduces), lms_ops=sum(_compat.string_attr(op, "_lms") is not None for op in ops),
                allreduce_devices=sorted({op.device for op in allreduces}))


def first_consumers(op) -> list:
    """Names of the ops that first consume ``op``'s outputs, looking through Identity ops.

    IdentityN (Keras passes all gradients through one) forwards input i to output i only.
    """
    found, frontier = [], list(op.outputs)
    while frontier:
        tensor = frontier.pop()
        for consumer in tensor.consumers():
            if consumer.type == "Identity":
                frontier.append(consumer.outputs[0])
            elif consumer.type == "IdentityN":
                frontier.extend(consumer.outputs[i] for i, t in enumerate(consumer.inputs) if t is tensor)
            else:
                found.append(consumer.name)
    return found


def device_readers(swap_in) -> list:
    """The ops that read a swap-in: the consumers of its device read (``device_read``, the
    Identity on the device that the rewrite puts between a host copy and its readers)."""
    reads = swap_in.outputs[0].consumers()
    assert all(_compat.string_attr(r, "_lms") == "device_read" for r in reads), [r.name for r in reads]
    return [c for r in reads for c in r.outputs[0].consumers()]


def behind_device_read(op):
    """The host copy a device read reads (``op`` itself when it is not a device read)."""
    return op.inputs[0].op if _compat.string_attr(op, "_lms") == "device_read" else op



def ancestors(op) -> set:
    """The ops ``op`` waits for, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen
