"""Benchmark: pipeline stages held to a budget by lms-tf's budget planner, swap-only and with recompute.

Each model is cut into two GPipe stages (4 micro-batches) on this machine's logical CPUs and its
pipelined step traced once without a budget (each stage's replayed peak: ``PipelineStep``'s
``predicted_peaks`` count, weights and slots included) and then with every stage held to 85% and
to 70% of that, side by side in one run: ``budget=`` with swapping only, and with
``recompute="auto"``. For each stage: whether the budget is met, the replayed peak over the plain
stage's, what the plan swaps and recomputes, the planner's predicted stage time over the plain
stage's on the device preset (``v100-16gb-pcie3``: each copy timed against its PCIe 3 link), and
the planning time. Nothing here runs on a GPU: the peaks are lms-tf's simulator's, and on logical
CPUs a swap moves no bytes, so no real memory is claimed (each stage's real peak in its own process
is measured in ``benchmarks/pipeline_memory.py``).

Command: ``.venv/bin/python benchmarks/pipeline_budget.py [--from-json]`` (about 20 minutes on 2
cores; writes ``benchmarks/out/pipeline_budget.json`` and the table into
``docs/benchmarks/partition.md``; ``--from-json`` writes the table again from the last results).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 3)

from benchmarks.publish import OUT, publish  # noqa: E402

logger = logging.getLogger("lms_tf.benchmarks")
PRESET = "v100-16gb-pcie3"
FRACTIONS = (0.85, 0.70)
MICROBATCHES = 4
DEVICES = ["/CPU:0", "/CPU:1"]


def models():
    """(label, model, batch of inputs, labels) of the benchmark's models."""
    import numpy as np

    from lms_tf.tf.workloads import build_model

    rng = np.random.RandomState(0)
    encoder = encoder_blocks(seq_len=256, vocab=8000, dim=512, heads=8, blocks=8)
    tokens = rng.randint(0, 8000, (8, 256)).astype("int32")
    resnet = build_model("ResNet50", image_size=96, classes=10)
    images = rng.rand(16, 96, 96, 3).astype("float32")
    return [("Transformer encoder, 8 blocks, seq 256, dim 512, batch 8", encoder, tokens,
             rng.randint(0, encoder.output_shape[-1], (8,)).astype("int32")),
            ("ResNet-50 96², batch 16", resnet, images, rng.randint(0, 10, (16,)).astype("int32"))]


def encoder_blocks(seq_len, vocab, dim, heads, blocks, classes=10):
    """A Transformer encoder classifier whose residual sums are ``Add`` layers (a pipeline stage runs
    the model's layers; ``x + y`` on Keras tensors makes an operation that is not one)."""
    import keras
    from keras import layers

    inputs = keras.Input((seq_len,), dtype="int32")
    x = layers.Embedding(vocab, dim, name="embedding")(inputs)
    for block in range(blocks):
        attention = layers.MultiHeadAttention(heads, dim // heads, name=f"block{block}_attention")(x, x)
        x = layers.LayerNormalization(name=f"block{block}_norm1")(layers.Add(name=f"block{block}_add1")([x, attention]))
        hidden = layers.Dense(4 * dim, activation="gelu", name=f"block{block}_mlp1")(x)
        out = layers.Dense(dim, name=f"block{block}_mlp2")(hidden)
        x = layers.LayerNormalization(name=f"block{block}_norm2")(layers.Add(name=f"block{block}_add2")([x, out]))
    outputs = layers.Dense(classes, activation="softmax", name="head")(layers.GlobalAveragePooling1D(name="pool")(x))
    model = keras.Model(inputs, outputs, name="encoder_blocks")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def stage_plans(model, x, y, budget, recompute) -> dict:
    """The pipelined step of ``model`` traced with ``budget``: each stage's plan and the planning time."""
    import lms_tf
    from lms_tf.tf.pipeline_step import PipelineStep

    cut = lms_tf.partition(model, stages=2, microbatches=MICROBATCHES, batch_size=len(x), schedule="gpipe")
    step = PipelineStep(model, cut, devices=DEVICES, swap=[0, 1], host="/CPU:2", min_swap_bytes=0, budget=budget,
                        recompute=recompute, device_spec=PRESET)
    started = time.perf_counter()
    try:
        step.get_concrete_function(tf.constant(x), tf.constant(y))
    except lms_tf.InfeasibleBudgetError as err:
        return {"error": str(err).split(": lms-tf's")[0], "least": err.smallest_feasible_bytes,
                "seconds": time.perf_counter() - started}
    return {"plans": step.plans, "seconds": time.perf_counter() - started}


def main() -> None:
    results = []
    for label, model, x, y in models():
        logger.info("%s: plain stages", label)
        plain = stage_plans(model, x, y, "1TiB", False)["plans"]
        peaks = [plan.predictions.baseline_peak_bytes for plan in plain]
        case = {"model": label, "plain_peaks": peaks, "rows": []}
        for fraction in FRACTIONS:
            budgets = [int(peak * fraction) for peak in peaks]
            for mode, recompute in (("swap", False), ("swap + recompute", "auto")):
                logger.info("%s: %.0f%% budget, %s", label, 100 * fraction, mode)
                outcome = stage_plans(model, x, y, budgets, recompute)
                row = {"fraction": fraction, "mode": mode, "seconds": outcome["seconds"], "stages": []}
                if "error" in outcome:
                    row["error"], row["least"] = outcome["error"], outcome["least"]
                else:
                    for k, plan in enumerate(outcome["plans"]):
                        p = plan.predictions
                        row["stages"].append({
                            "budget": budgets[k], "planned": p.planned_peak_bytes, "plain": peaks[k],
                            "swapped": plan.swapped_bytes, "recomputed": plan.recomputed_bytes,
                            "n_swapped": len(plan.swapped), "n_recomputed": len(plan.recomputed),
                            "time_ratio": (p.predicted_step_time_s / p.baseline_step_time_s
                                           if p.predicted_step_time_s and p.baseline_step_time_s else None)})
                case["rows"].append(row)
        results.append(case)
    OUT.mkdir(exist_ok=True)
    (OUT / "pipeline_budget.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    publish("pipeline_budget", render(results), page="partition")


def render(results: list) -> str:
    """The table of :func:`main`'s results."""
    import re

    lines = [f"Two GPipe stages, {MICROBATCHES} micro-batches, planned for `{PRESET}`; peaks are lms-tf's replay "
             "of each built stage (weights and slots included). Time is the budget planner's predicted stage "
             "time over the plain stage's (copies timed against the link; 1.00 where nothing is exposed). A "
             "budget no plan meets names the first stage that misses it and the least that stage reaches.", "",
             "| model | budget (of each stage's plain peak) | planner | stage | planned / plain peak | swapped | "
             "recomputed | predicted time / plain | planning s (both stages) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        for row in case["rows"]:
            head = f"| {case['model']} | {row['fraction']:.0%} | {row['mode']} |"
            if "error" in row:
                k = int(re.search(r"stage (\d+) does not fit", row["error"]).group(1))
                plain = case["plain_peaks"][k]
                lines.append(f"{head} {k} | does not fit: least {row['least'] / plain:.2f} "
                             f"({row['least'] / 2**20:.1f} of {plain / 2**20:.1f} MiB) | | | | {row['seconds']:.1f} |")
                continue
            for k, stage in enumerate(row["stages"]):
                ratio = "1.00" if stage["time_ratio"] is None else f"{stage['time_ratio']:.2f}"
                lines.append(f"{head} {k} | {stage['planned'] / stage['plain']:.2f} "
                             f"({stage['planned'] / 2**20:.1f} of {stage['plain'] / 2**20:.1f} MiB) | "
                             f"{stage['swapped'] / 2**20:.1f} MiB ({stage['n_swapped']}) | "
                             f"{stage['recomputed'] / 2**20:.1f} MiB ({stage['n_recomputed']}) | {ratio} | "
                             f"{row['seconds']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "--from-json" in sys.argv[1:]:  # the table again from the last run's results
        publish("pipeline_budget", render(json.loads((OUT / "pipeline_budget.json").read_text(encoding="utf-8"))),
                page="partition")
    else:
        main()
