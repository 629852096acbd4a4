"""Run by tests/test_frontends_legacy_keras.py with TF_USE_LEGACY_KERAS=1: LMSCallback on tf-keras (Keras 2)."""

import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])

import tf_keras as keras  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.keras import DistributedCallback  # noqa: E402
from lms_tf.tf.variables import variable_bytes_by_device  # noqa: E402


def build():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((24, 24, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="c0")(inputs)
    y = keras.layers.Conv2D(16, 3, padding="same", name="c1")(x)
    y = keras.layers.BatchNormalization(name="bn")(y)
    x = keras.layers.Activation("relu")(keras.layers.Add()([x, y]))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="c2")(x)
    outputs = keras.layers.Dense(5)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


rng = np.random.RandomState(0)
x, y = rng.rand(24, 24, 24, 3).astype("float32"), rng.randint(0, 5, 24)
results = {}
configs = (
    ("plain", []),
    ("lms", [lms_tf.LMSCallback(device="/CPU:0", host="/CPU:1", swapout_threshold=4, min_swap_bytes=1024)]),
    # One Horovod rank (its average is the gradient itself) + the optimizer on the host.
    ("dist", [lms_tf.LMSCallback(device="/CPU:0", host="/CPU:1", swapout_threshold=4, min_swap_bytes=1024,
                                 optimizer_on_host=True), DistributedCallback(bucket_bytes=1)]),
)
for name, callbacks in configs:
    model = build()
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    results[name] = {"loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()]}
    if name == "lms":
        results["swapped"] = len(callbacks[0].plan.swapped)
        results["keras_module"] = type(model).__module__
    if name == "dist":
        slots = [v for v in model.optimizer.variables if "iteration" not in v.name and "learning_rate" not in v.name]
        results["slot_devices"] = sorted(variable_bytes_by_device(slots))
        results["updates_intercepted"] = callbacks[1].updates_intercepted[0]
json.dump(results, sys.stdout)
