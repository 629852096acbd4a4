"""Train a Keras 3 CNN with lms-tf's swap pass through model.fit.

On a GPU machine this is just ``callbacks=[lms_tf.LMSCallback()]``. Without a GPU the
example splits the CPU into two logical devices, so the swaps still cross a real device
boundary (/CPU:0 plays the accelerator, /CPU:1 the host). Runs in well under a minute.

    python examples/keras_fit.py
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


def build_model():
    inputs = keras.Input((64, 64, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    for block in range(3):
        y = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        y = keras.layers.BatchNormalization()(keras.layers.Conv2D(32, 3, padding="same")(y))
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, y]))
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def main():
    rng = np.random.RandomState(0)
    x = rng.rand(256, 64, 64, 3).astype("float32")
    y = rng.randint(0, 10, 256)
    model = build_model()
    callback = lms_tf.LMSCallback(**LMS_OPTIONS)
    model.fit(x, y, batch_size=32, epochs=2, verbose=2, callbacks=[callback])
    print(lms_tf.explain(callback))
    print("evaluate (untouched by lms-tf):", model.evaluate(x, y, batch_size=32, verbose=0))


if __name__ == "__main__":
    main()
