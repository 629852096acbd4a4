"""Data-parallel model.fit with Horovod and lms-tf: each rank trains on its shard of the data.

Launch one process per GPU (or, on a machine without GPUs, two CPU ranks):

    bash scripts/launch.sh -np 2 -- python examples/horovod_fit.py

Every rank builds the same model from a different seed: DistributedCallback broadcasts
rank 0's weights when training begins, averages the gradients in every step (in buckets,
while the backward pass still runs) and averages the epoch logs, so every rank ends with
the same weights. LMSCallback rewrites the same traced step to swap activations to the
host and keep the optimizer's slots there (optimizer_on_host).
"""

import argparse
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from lms_tf.horovod import horovod_tensorflow, pin_gpu
from lms_tf.keras import DistributedCallback

logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
hvd = horovod_tensorflow()
if pin_gpu() is None:
    # No GPU: two logical CPUs play accelerator (/CPU:0) and host (/CPU:1).
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    LMS_OPTIONS = {"device": "/CPU:0", "host": "/CPU:1"}
else:
    LMS_OPTIONS = {}

import keras  # noqa: E402

import lms_tf  # noqa: E402


def build_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    for _ in range(2):
        y = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = keras.layers.Add()([x, keras.layers.Conv2D(32, 3, padding="same")(y)])
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    # The usual Horovod convention: scale the learning rate with the number of ranks.
    model.compile(keras.optimizers.Adam(1e-3 * hvd.size()),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    x, y = rng.rand(256, 32, 32, 3).astype("float32"), rng.randint(0, 10, 256)
    shard = slice(hvd.rank(), None, hvd.size())  # this rank's samples
    model = build_model(seed=hvd.rank())
    lms = lms_tf.LMSCallback(**LMS_OPTIONS, optimizer_on_host=True)
    history = model.fit(x[shard], y[shard], batch_size=args.batch_size, epochs=args.epochs,
                        verbose=2 if hvd.rank() == 0 else 0,
                        callbacks=[DistributedCallback(), lms])
    checksum = float(sum(np.sum(w) for w in model.get_weights()))
    print(f"rank {hvd.rank()}/{hvd.size()}: final loss {history.history['loss'][-1]:.4f} (averaged over ranks), "
          f"weights checksum {checksum:.6f}, plan: {lms.plan.one_line()}", flush=True)


if __name__ == "__main__":
    main()
