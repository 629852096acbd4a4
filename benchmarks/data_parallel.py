"""Benchmark of data-parallel training with Horovod (issue "Horovod"), measured in one run.

Starts ``horovodrun --gloo`` with 1 and then 2 local processes. Each rank trains the same
conv net with ``model.fit``'s train function (fixed batch per rank, so 2 ranks process twice the
samples per step) in three configurations, built and warmed up first, then timed step by step in
turn (side by side, so the machine's noise falls on all alike):

* ``pipelined``: ``DistributedCallback`` (Horovod averaging, pipelined in 1 MiB buckets);
* ``one bucket``: ``DistributedCallback(bucket_bytes=None)``, one allreduce after the backward pass
  (the baseline of pipelining);
* ``pipelined+lms``: the first with ``LMSCallback(optimizer_on_host=True)`` (swap + host update;
  on logical CPU devices a swap moves no bytes, so this row times the rewrite's own ops only).

The 2 cores are shared fairly: each rank gets cores / ranks intra-op threads. Rank 0 of the
2-process run also records one step's timeline: TensorFlow's executed ops (profiler) and
Horovod's own allreduce intervals (Horovod timeline, on the same clock; 256 KiB buckets), drawn to
``docs/horovod_timeline.png``; a bucket whose allreduce ends before the last
backward op ends overlapped the backward pass.

    .venv/bin/python benchmarks/data_parallel.py   # tables into docs/benchmarks/data_parallel.md, docs/horovod_timeline.png
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from publish import publish  # benchmarks/publish.py, beside this script

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
DOCS_PLOT = REPO / "docs" / "horovod_timeline.png"
CORES = os.cpu_count() or 2
LOCAL_BATCH, IMAGE, STEPS, WARMUP = 16, 48, 12, 3
TIMELINE_BUCKET_BYTES = 256 * 1024  # smaller than the timed runs' 1 MiB, so the plot shows more buckets
log = logging.getLogger("benchmark")


# --- one rank ----------------------------------------------------------------------------------

def rank_main(ranks: int, outdir: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    threads = max(1, CORES // ranks)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import lms_tf
    from lms_tf.horovod import horovod_tensorflow
    from lms_tf.keras import DistributedCallback

    hvd = horovod_tensorflow()

    def build():
        keras.utils.set_random_seed(hvd.rank())
        inputs = keras.Input((IMAGE, IMAGE, 3))
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(inputs)
        for _ in range(6):
            y = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
            x = keras.layers.Add()([x, keras.layers.Conv2D(64, 3, padding="same")(y)])
        x = keras.layers.GlobalAveragePooling2D()(x)
        x = keras.layers.Dense(512, activation="relu")(x)
        model = keras.Model(inputs, keras.layers.Dense(10)(x))
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.RandomState(hvd.rank())
    images = rng.rand(LOCAL_BATCH, IMAGE, IMAGE, 3).astype("float32")
    labels = rng.randint(0, 10, LOCAL_BATCH).astype("int32")
    iterator = iter(tf.data.Dataset.from_tensor_slices((images, labels)).batch(LOCAL_BATCH).repeat())
    results = {"ranks": ranks, "threads": threads, "configs": {}}
    configs = {
        "pipelined": lambda: [DistributedCallback(bucket_bytes=2**20)],
        "one bucket": lambda: [DistributedCallback(bucket_bytes=None)],
        "pipelined+lms": lambda: [DistributedCallback(bucket_bytes=2**20),
                                  lms_tf.LMSCallback(device="/CPU:0", host="/CPU:1", optimizer_on_host=True,
                                                     batch_size=LOCAL_BATCH)],
    }
    # Every configuration is built and warmed up first, then their steps alternate, so a slow
    # moment of the machine falls on all of them alike.
    runs = {}
    for name, make_callbacks in configs.items():
        model, callbacks = build(), make_callbacks()
        for callback in callbacks:  # drive fit's callbacks by hand to time the train function alone
            callback.set_model(model)
            callback.on_train_begin()
        for _ in range(WARMUP):
            float(model.train_function(iterator)["loss"])
        runs[name] = (model, callbacks, [])
    for step in range(STEPS):
        for name, (model, _, times) in runs.items():
            hvd.allreduce(tf.constant(0.0), name=f"sync_{name}_{step}")  # start each step together
            started = time.perf_counter()
            float(model.train_function(iterator)["loss"])
            times.append(time.perf_counter() - started)
    for name, (model, callbacks, times) in runs.items():
        for callback in reversed(callbacks):
            callback.on_train_end()
        median = statistics.median(times)
        results["configs"][name] = {"step_s": median, "steps_per_s": 1 / median,
                                    "samples_per_s": ranks * LOCAL_BATCH / median}
    if ranks == 2:
        results["timeline"] = record_timeline(build, iterator, hvd, outdir)
    if hvd.rank() == 0:
        (outdir / f"ranks{ranks}.json").write_text(json.dumps(results, indent=1))


def record_timeline(build, iterator, hvd, outdir: Path) -> dict:
    """One step's executed ops (TF profiler) and allreduce intervals (Horovod timeline)."""
    from lms_tf.keras import DistributedCallback
    from lms_tf.keras.step_hooks import add_step_hook
    from lms_tf.tf.diagnostics import executed_ops
    from tests.helpers import graph_probe

    model = build()
    facts: dict = {}
    add_step_hook(model, graph_probe(facts))
    callback = DistributedCallback(bucket_bytes=TIMELINE_BUCKET_BYTES)
    callback.set_model(model)
    callback.on_train_begin()
    for _ in range(3):
        model.train_function(iterator)
    timeline_file = outdir / f"horovod_timeline_rank{hvd.rank()}.json"
    hvd.start_timeline(str(timeline_file), mark_cycles=False)
    events = executed_ops(lambda: model.train_function(iterator))
    time.sleep(0.5)  # Horovod's timeline writer is asynchronous
    hvd.stop_timeline()
    callback.on_train_end()
    if hvd.rank() != 0:  # Horovod's coordinator (rank 0) writes the timeline
        return {}
    allreduces = parse_horovod_timeline(timeline_file.read_text())
    names = {op.name for op in facts["graph"].get_operations() if op.type.startswith("HorovodGroupedAllreduce")}
    return {
        "ops": [{"node": e.node, "type": e.type, "start_ns": e.start_ps // 1000, "end_ns": e.end_ps // 1000}
                for e in events],
        "allreduces": [a for a in allreduces if a["group"].rsplit("/", 1)[-1] in names],
    }


def parse_horovod_timeline(text: str) -> list:
    """Per allreduce group: from its first tensor's first event to its last tensor's last event.

    Horovod stamps events in microseconds since its start and writes that start as wall-clock
    microseconds (``start_time_since_epoch_in_micros``), the profiler's clock, so both align.
    Grouped allreduces appear per tensor (``<group>_3of16``) and are merged back per group.
    """
    text = text.strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    records = json.loads(text)
    start_us = next(r["args"]["start_time_since_epoch_in_micros"] for r in records
                    if "start_time_since_epoch_in_micros" in r.get("args", {}))
    groups = {r["pid"]: re.sub(r"_\d+of\d+$", "", r["args"]["name"]) for r in records
              if r.get("ph") == "M" and r.get("name") == "process_name" and "name" in r.get("args", {})}
    spans: dict = {}
    for record in records:
        if record.get("ph") not in ("B", "E", "X") or record.get("pid") not in groups:
            continue
        begin = (start_us + int(record["ts"])) * 1000
        end = begin + int(record.get("dur", 0)) * 1000
        span = spans.setdefault(groups[record["pid"]], [begin, end])
        span[0], span[1] = min(span[0], begin), max(span[1], end)
    return sorted(({"group": g, "start_ns": b, "end_ns": e} for g, (b, e) in spans.items()),
                  key=lambda a: a["start_ns"])


# --- the benchmark -----------------------------------------------------------------------------

def run_ranks(ranks: int, outdir: Path) -> None:
    launcher = Path(sys.executable).with_name("horovodrun")
    # DYNAMIC lets rank 0 start Horovod's timeline for one step (set for both runs alike).
    env = dict(os.environ, PYTHONPATH=str(REPO), HOROVOD_TIMELINE="DYNAMIC")
    command = [str(launcher), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}",
               sys.executable, __file__, "--rank", str(ranks), str(outdir)]
    log.info("running %d process(es): %s", ranks, " ".join(command))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"horovodrun -np {ranks} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def plot_timeline(timeline: dict, path: Path) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = timeline["ops"]
    t0 = min(o["start_ns"] for o in ops)
    backward = [o for o in ops if "gradient_tape" in o["node"]]
    step_ns = max(o["end_ns"] for o in ops) - t0
    # Function-call and executor events span the whole step: they are not forward ops.
    forward = [o for o in ops if "gradient_tape" not in o["node"] and "adam" not in o["node"]
               and 0 < o["end_ns"] - o["start_ns"] < step_ns / 4]
    update = [o for o in ops if "adam" in o["node"]]
    last_backward = max(o["end_ns"] for o in backward)
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for row, (label, group, colour) in enumerate([("forward", forward, "#999999"), ("backward", backward, "#1f77b4"),
                                                  ("optimizer update", update, "#2ca02c")]):
        ax.broken_barh([((o["start_ns"] - t0) / 1e6, max((o["end_ns"] - o["start_ns"]) / 1e6, 0.05)) for o in group],
                       (row * 10, 8), facecolors=colour, label=label)
    allreduces = timeline["allreduces"]
    for i, a in enumerate(allreduces):
        ax.broken_barh([((a["start_ns"] - t0) / 1e6, (a["end_ns"] - a["start_ns"]) / 1e6)],
                       (30 + 2 * i, 1.6), facecolors="#d62728")
    ax.axvline((last_backward - t0) / 1e6, color="k", linestyle="--", linewidth=1, label="last backward op ends")
    ax.set_yticks([4, 14, 24, 30 + max(len(allreduces), 1)])
    ax.set_yticklabels(["forward", "backward", "update", f"allreduce buckets ({len(allreduces)})"])
    ax.set_xlabel("ms since the step's first op (rank 0 of 2, Gloo, one CPU core per rank)")
    ax.set_title("One data-parallel step: gradient buckets are averaged while the backward pass runs")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    overlapped = sum(a["end_ns"] < last_backward for a in allreduces)
    return {"buckets": len(allreduces), "ended_before_backward_end": overlapped,
            "started_before_backward_end": sum(a["start_ns"] < last_backward for a in allreduces)}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    OUT.mkdir(parents=True, exist_ok=True)
    if "--report-only" not in sys.argv:  # --report-only: redraw from the last run's files
        for ranks in (1, 2):
            run_ranks(ranks, OUT)
    one, two = (json.loads((OUT / f"ranks{r}.json").read_text()) for r in (1, 2))
    overlap = plot_timeline(two["timeline"], DOCS_PLOT)
    rows = ["| configuration | processes | threads/process | step time (ms) | samples/s | "
            "samples/s vs 1 process | step time vs one bucket |", "|---|---|---|---|---|---|---|"]
    for name in one["configs"]:
        base = one["configs"][name]["samples_per_s"]
        for result in (one, two):
            c = result["configs"][name]
            versus = c["step_s"] / result["configs"]["one bucket"]["step_s"]
            rows.append(f"| {name} | {result['ranks']} | {result['threads']} | {1000 * c['step_s']:.0f} | "
                        f"{c['samples_per_s']:.1f} | {c['samples_per_s'] / base:.2f}x | {versus:.2f}x |")
    table = "\n".join(rows)
    summary = (f"Timeline (2 processes, rank 0, 256 KiB buckets): {overlap['buckets']} allreduce buckets, "
               f"{overlap['started_before_backward_end']} started and {overlap['ended_before_backward_end']} "
               f"finished before the last backward op ended.")
    publish("data_parallel", table + "\n\n" + summary, page="data_parallel")
    (OUT / "horovod.json").write_text(json.dumps({"one": {k: v for k, v in one.items()},
                                                  "two": {k: v for k, v in two.items() if k != "timeline"},
                                                  "overlap": overlap}, indent=1))
    print(table)
    print()
    print(summary)
    print(f"timeline plot: {DOCS_PLOT}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
