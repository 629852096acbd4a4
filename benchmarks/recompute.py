"""Benchmark of the recompute pass (issue "Recompute pass"), all columns measured in one run.

Real CPU-allocator peak of one training step (median of 3 steps) and median step time
(after warm-up, timed in blocks alternating with the plain step), each
relative to the plain step, for: lms-tf recompute="sqrt", lms-tf recompute="cheap",
keras.RematScope(mode="activations"), keras.RematScope(mode="full") and tf.recompute_grad
around each residual block, on a 32-block residual conv net (32x32, batch 16), on
ResNet-50 (keras.applications, 96x96, batch 8; batch 32 for context) and on a stacked recurrent
model (the built-in StackedRNN workload, 100 steps, batch 64).

    .venv/bin/python benchmarks/recompute.py        # tables into docs/benchmarks/recompute.md; raw figures in benchmarks/out/
"""

import json
import logging
import os
import re
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the CPU allocator reports peaks only as BFC

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from publish import OUT, publish  # noqa: E402 - benchmarks/publish.py, beside this script

import lms_tf  # noqa: E402
from lms_tf.tf.workloads import build_model  # noqa: E402

log = logging.getLogger("benchmark")
STEPS = 10
MiB = 2**20


class ResidualNet(keras.Model):
    """Blocks of conv-BN-relu-conv-BN + skip; optionally each block under tf.recompute_grad."""

    def __init__(self, blocks=32, channels=32, classes=10, recompute_grad=False):
        super().__init__()
        self.stem = keras.layers.Conv2D(channels, 3, padding="same")
        self.blocks = [[keras.layers.Conv2D(channels, 3, padding="same"), keras.layers.BatchNormalization(),
                        keras.layers.Conv2D(channels, 3, padding="same"), keras.layers.BatchNormalization()]
                       for _ in range(blocks)]
        self.head = keras.layers.Dense(classes)
        self.recompute_grad = recompute_grad

    def _block(self, layers, x, training):
        conv1, bn1, conv2, bn2 = layers
        y = tf.nn.relu(bn1(conv1(x), training=training))
        return tf.nn.relu(x + bn2(conv2(y), training=training))

    def call(self, x, training=False):
        x = self.stem(x)
        for layers in self.blocks:
            if self.recompute_grad:
                x = tf.recompute_grad(lambda t, layers=layers: self._block(layers, t, training))(x)
            else:
                x = self._block(layers, x, training)
        return self.head(tf.reduce_mean(x, axis=[1, 2]))


def residual_net(recompute_grad=False):
    keras.utils.set_random_seed(0)
    model = ResidualNet(recompute_grad=recompute_grad)
    model.build((None, 32, 32, 3))
    return model


def resnet50():
    keras.utils.set_random_seed(0)
    return build_model("ResNet50", image_size=96, classes=100)


def stacked_rnn():
    keras.utils.set_random_seed(0)
    return build_model("StackedRNN", image_size=100, classes=10)


BUILDERS = {"residual32": residual_net, "resnet50": resnet50, "resnet50_b32": resnet50, "stacked_rnn": stacked_rnn}


def train_step(model, from_logits):
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return step


def prepared(build, decorate, batch, from_logits):
    """A traced, warmed-up step function for one column."""
    fn = decorate(train_step(build(), from_logits))
    for _ in range(2):
        fn(*batch).numpy()
    return fn


def peak_of(fn, batch):
    peaks = []
    for _ in range(3):  # TF's inter-op scheduling moves the peak from run to run: take the median
        with lms_tf.measure_peak_memory("CPU:0", settle_seconds=0.3) as memory:
            fn(*batch).numpy()
        peaks.append(memory.peak_bytes)
    return statistics.median(peaks)


def interleaved_times(fn, plain, batch):
    """Median step times of a column and of the plain step, timed in alternating blocks."""
    times = {"fn": [], "plain": []}
    for block in range(4):
        order = (("fn", fn), ("plain", plain)) if block % 2 == 0 else (("plain", plain), ("fn", fn))
        for key, step in order:
            for _ in range(STEPS // 2):
                started = time.perf_counter()
                step(*batch).numpy()
                times[key].append(time.perf_counter() - started)
    return statistics.median(times["fn"]), statistics.median(times["plain"])


def columns(model_name):
    lms = lambda policy: (lambda f: lms_tf.function(f, recompute=policy, swap=False, device="/CPU:0"))  # noqa: E731
    build = BUILDERS[model_name]

    def under_remat(mode):
        def built():
            with keras.RematScope(mode=mode):
                return build()
        return built

    cols = [("plain", build, tf.function), ('lms-tf "sqrt"', build, lms("sqrt")),
            ('lms-tf "cheap"', build, lms("cheap")),
            ('RematScope("activations")', under_remat("activations"), tf.function),
            ('RematScope("full")', under_remat("full"), tf.function)]
    if model_name == "residual32":
        cols.append(("tf.recompute_grad per block", lambda: residual_net(recompute_grad=True), tf.function))
    return cols


def main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    rng = np.random.RandomState(0)
    workloads = {
        "residual32": ((tf.constant(rng.rand(16, 32, 32, 3).astype("float32")),
                        tf.constant(rng.randint(0, 10, 16))), True, "32-block residual net, 32x32, batch 16"),
        "resnet50": ((tf.constant(rng.rand(8, 96, 96, 3).astype("float32")),
                      tf.constant(rng.randint(0, 100, 8))), False, "ResNet-50, 96x96, batch 8"),
        "resnet50_b32": ((tf.constant(rng.rand(32, 96, 96, 3).astype("float32")),
                          tf.constant(rng.randint(0, 100, 32))), False,
                         "ResNet-50, 96x96, batch 32 (context, not a target)"),
        "stacked_rnn": ((tf.constant(rng.randint(0, 1000, (64, 100)).astype("int32")),
                         tf.constant(rng.randint(0, 10, 64))), False,
                        "StackedRNN (embedding, bidirectional GRU, LSTM, GRU; 100 steps), batch 64: "
                        "lms-tf recomputes whole loops"),
    }
    results = {}
    for model_name, (batch, from_logits, title) in workloads.items():
        plain = None
        for label, build, decorate in columns(model_name):
            log.info("%s: %s", title, label)
            try:
                fn = prepared(build, decorate, batch, from_logits)
                if plain is None:
                    plain = fn
                seconds, plain_seconds = interleaved_times(fn, plain, batch)
                results[(model_name, label)] = {"peak": peak_of(fn, batch), "time": seconds,
                                                "time_ratio": seconds / plain_seconds}
            except Exception as err:  # a competitor that fails on a model is reported, not hidden
                log.warning("%s / %s failed: %s", title, label, err)
                lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
                lines = [line for line in lines if line and not line.startswith(
                    ("File ", "raise ", "in user code", "•", "Arguments received", "Exception encountered"))]
                reason = next((line for line in lines if "custom_gradient" in line), lines[-1] if lines else "")
                results[(model_name, label)] = {"error": f"{type(err).__name__}: {reason}"}
    lines = []
    for model_name, (_, _, title) in workloads.items():
        base = results[(model_name, "plain")]
        lines += [f"**{title}** (plain: {base['peak'] / MiB:.0f} MiB peak, {base['time'] * 1000:.0f} ms/step)", "",
                  "| column | peak MiB | peak / plain | step ms | time / plain |", "|---|---|---|---|---|"]
        for label, _, _ in columns(model_name):
            r = results[(model_name, label)]
            if "error" in r:
                lines.append(f"| {label} | failed: {r['error']} | | | |")
                continue
            lines.append(f"| {label} | {r['peak'] / MiB:.0f} | **{r['peak'] / base['peak']:.2f}** | "
                         f"{r['time'] * 1000:.0f} | **{r['time_ratio']:.2f}** |")
        lines.append("")
    table = "\n".join(lines)
    publish("recompute", table, page="recompute")
    OUT.mkdir(exist_ok=True)
    with open(OUT / "recompute.json", "w") as handle:
        json.dump({f"{m}/{c}": r for (m, c), r in results.items()}, handle, indent=1)
    print(table)


if __name__ == "__main__":
    main()
