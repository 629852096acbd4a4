"""A custom training loop whose step is rewritten by ``@lms_tf.function``.

``lms_tf.function`` is a drop-in for ``tf.function``: same call semantics, retracing and
``get_concrete_function``; every trace gets the swap pass, and ``step.plan`` says what
was swapped. Without a GPU the CPU is split into accelerator /CPU:0 and host /CPU:1.

    python examples/custom_loop.py
"""

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
if tf.config.list_physical_devices("GPU"):
    LMS_OPTIONS = {}
else:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    LMS_OPTIONS = {"device": "/CPU:0", "host": "/CPU:1"}

import keras  # noqa: E402

import lms_tf  # noqa: E402

model = keras.Sequential([keras.Input((64, 64, 3))] + [
    keras.layers.Conv2D(32, 3, padding="same", activation="relu") for _ in range(6)] + [
    keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@lms_tf.function(swapin_ahead=4, **LMS_OPTIONS)
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


def main():
    rng = np.random.RandomState(0)
    dataset = tf.data.Dataset.from_tensor_slices(
        (rng.rand(256, 64, 64, 3).astype("float32"), rng.randint(0, 10, 256))).batch(32, drop_remainder=True)
    for epoch in range(2):
        losses = [float(train_step(x, y)) for x, y in dataset]
        print(f"epoch {epoch}: mean loss {np.mean(losses):.4f}")
    print(lms_tf.explain(train_step))


if __name__ == "__main__":
    main()
