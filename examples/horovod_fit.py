"""Data-parallel model.fit with Horovod and lms-tf: each rank trains on its shard of the data.

Launch one process per GPU (or, on a machine without GPUs, two CPU ranks):

    bash scripts/launch.sh -np 2 -- python examples/horovod_fit.py

The same training in one process, on the global batches (what the ranks must end up with;
with SGD and in-order samples the weights agree to float rounding):

    bash scripts/launch.sh -np 2 -- python examples/horovod_fit.py --optimizer sgd --no-shuffle
    .venv/bin/python examples/horovod_fit.py --optimizer sgd --no-shuffle --as-ranks 2

Every rank builds the same model from a different seed: DistributedCallback broadcasts
rank 0's weights when training begins, averages the gradients in every step (in buckets,
while the backward pass still runs) and averages the epoch logs, so every rank ends with
the same weights. LMSCallback rewrites the same traced step to swap activations to the
host and keep the optimizer's slots there (optimizer_on_host).
"""

import argparse
import logging
import os
import socket

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


def build_model(seed: int, optimizer: str = "adam", ranks: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    for _ in range(2):
        y = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = keras.layers.Add()([x, keras.layers.Conv2D(32, 3, padding="same")(y)])
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    # The usual Horovod convention: scale the learning rate with the number of ranks.
    scale = ranks or hvd.size()
    opt = keras.optimizers.Adam(1e-3 * scale) if optimizer == "adam" else keras.optimizers.SGD(0.05 * scale)
    model.compile(opt,
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--no-shuffle", action="store_true", help="keep each rank's samples in order")
    parser.add_argument("--as-ranks", type=int, default=0, metavar="N",
                        help="in one process, train on the global batches N ranks would make (each step the "
                             "union of the N ranks' batches, the learning rate scaled by N): the reference a "
                             "data-parallel run must match")
    parser.add_argument("--weights-out", metavar="PATH", help="rank 0 saves the final weights here (.npz)")
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    x, y = rng.rand(256, 32, 32, 3).astype("float32"), rng.randint(0, 10, 256)
    ranks, batch = args.as_ranks or hvd.size(), args.batch_size
    if args.as_ranks:
        if hvd.size() != 1:
            parser.error("--as-ranks is the one-process reference: launch it without horovodrun")
        # Step i's global batch: every rank's i-th batch of its shard (rank r has samples r, r+N, ...).
        shards = [np.arange(256)[r::ranks] for r in range(ranks)]
        order = np.concatenate([np.concatenate([s[i:i + batch] for s in shards]) for i in range(0, len(shards[0]), batch)])
        x_mine, y_mine, batch = x[order], y[order], batch * ranks
    else:
        shard = slice(hvd.rank(), None, hvd.size())  # this rank's samples
        x_mine, y_mine = x[shard], y[shard]
    model = build_model(seed=hvd.rank(), optimizer=args.optimizer, ranks=ranks)
    lms = lms_tf.LMSCallback(**LMS_OPTIONS, optimizer_on_host=True)
    history = model.fit(x_mine, y_mine, batch_size=batch, epochs=args.epochs, shuffle=not args.no_shuffle,
                        verbose=2 if hvd.rank() == 0 else 0,
                        callbacks=[DistributedCallback(), lms])
    checksum = float(sum(np.sum(w) for w in model.get_weights()))
    if args.weights_out and hvd.rank() == 0:
        np.savez(args.weights_out, *model.get_weights())
    print(f"rank {hvd.rank()}/{hvd.size()} on {socket.gethostname()}: final loss {history.history['loss'][-1]:.4f} (averaged over ranks), "
          f"weights checksum {checksum:.6f}, plan: {lms.plan.one_line()}", flush=True)


if __name__ == "__main__":
    main()
