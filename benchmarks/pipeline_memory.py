"""Benchmark: each pipeline stage's real CPU allocator peak, one process per stage, against its prediction.

A 1024-wide, 7-layer MLP with Adam at batch 256 and a held-out 6-layer, 64-channel CNN at batch 64
(``wide_mlp`` and ``wide_cnn`` of ``tests/pipeline_cluster_worker.py``) are cut by ``lms_tf.partition`` and trained under ``lms-tf launch``: every stage its own process
(task 0 the training script, the others ``lms-tf stage-server``), every stage's weights and slots
on its own task (``place_stages``), ``TF_CPU_ALLOCATOR_USE_BFC=true`` so each process's allocator
keeps statistics. Task 0 measures its peak over one step (plus its stage's weights and slots,
resident before it); each stage server logs its peak when it stops. Each configuration runs
serialized (``PipelineStep(serialize=True)``: each stage's ops one at a time in the schedule's
order) and in TensorFlow's own order, several times each.

``--recompute`` measures instead what recompute in a stage saves: each case serialized, with every
stage keeping what it computes and again with every stage keeping only what it receives and
running its forward pass again (``PipelineStep(recompute=)``), side by side in one run: each
stage's real peak in both, their ratio, and the recomputing stage's real peak over the simulator's
replay of the built step and over the partition's per-layer figure (``recompute_peak``).

``--calibration`` measures mCAP's calibration (``lms_tf.partition(calibrate=True)``): for each
model in its own process, the two real runs it reads (the whole model as one stage, one and two
micro-batches in flight), then three held-out real runs (3, 4 and 6 in flight) against the
per-layer model (no run), mCAP's line through the two runs, and the calibrated model. The main run also
calibrates each model first, in its own process, and sets each stage's calibrated figure beside
its real peak.

Command: ``.venv/bin/python benchmarks/pipeline_memory.py [--recompute | --calibration]`` (about 15
minutes, 3 with ``--recompute``, 5 with ``--calibration``, on 2 cores; writes
``benchmarks/out/pipeline_memory[_recompute|_calibration].json`` and the table into
``docs/benchmarks/partition.md``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.publish import OUT, publish  # noqa: E402
from lms_tf.partitioning import DEFAULT_DEVICE  # noqa: E402

logger = logging.getLogger("lms_tf.benchmarks")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "pipeline_cluster_worker.py")
#: (model, schedule, stages, micro-batches): the wide MLP (weights dominate) the model was first
#: checked on, and a wide CNN (activations and convolution scratch dominate) held out.
CASES = [("wide_mlp", "1f1b", 2, 4), ("wide_mlp", "gpipe", 2, 4), ("wide_mlp", "1f1b", 3, 4), ("wide_mlp", "gpipe", 3, 4),
         ("wide_cnn", "1f1b", 2, 4), ("wide_cnn", "1f1b", 3, 4), ("wide_cnn", "gpipe", 3, 4)]
ORDERS = [("serialized", True), ("TensorFlow's", False)]
RUNS = 3
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_DETERMINISTIC_OPS="1", TF_ENABLE_ONEDNN_OPTS="0",
           TF_CPU_ALLOCATOR_USE_BFC="true")


#: Recompute: an activation-heavy CNN (where it should save most), 1F1B (where later stages hold
#: fewer micro-batches), and the weight-heavy MLP (where it should save least).
RECOMPUTE_CASES = [("wide_cnn", "gpipe", 2, 4), ("wide_cnn", "1f1b", 3, 4), ("wide_mlp", "gpipe", 2, 4)]


#: Models calibrated by ``--calibration``: the two the stage benchmark trains, and two held out
#: (``lms_tf.tf.workloads`` name:input size:micro-batch; plain SGD, as ``lms-tf partition`` traces).
CALIBRATION_MODELS = ["wide_mlp", "wide_cnn", "MobileNetV2:64:8", "TransformerEncoder:128:4"]


def calibrate(model: str, cases=()) -> dict:
    """mCAP's calibration of ``model`` in its own process (its own allocator), with the held-out
    whole-model runs and, for each ``(schedule, stages, microbatches)`` case, every stage's figure
    by the per-layer model and by the calibrated one."""
    spec = ";".join([model] + [f"{schedule},{stages},{microbatches}" for schedule, stages, microbatches in cases])
    done = subprocess.run([sys.executable, WORKER, "--calibration", spec], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


def calibration_main() -> None:
    """Each model's calibration and its held-out runs, one process per model."""
    results = [calibrate(model) for model in CALIBRATION_MODELS]
    rows = ["| model | layers | micro-batch | real at 1 / 2 in flight (MiB) | mCAP's slope / model's | activations x | "
            "+ per stage (MiB) | calibration runs (s) | in flight | real MiB | per-layer model / real | mCAP's line / "
            "real | calibrated / real |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    times = ["| model | measured step, one micro-batch (ms) | preset's op times / measured | calibrated op times / measured |",
             "|---|---|---|---|"]
    for result in results:
        t = result["step_times"]
        times.append(f"| {result['name']} | {1000 * t['wall_s']:.1f} | {t['preset_s'] / t['wall_s']:.3f} | "
                     f"{t['calibrated_s'] / t['wall_s']:.3f} |")
    for result in results:
        c = result["calibration"]
        one, two = (b / 2**20 for b in c["measured_peak_bytes"])
        slope = f"{c['mcap_scale']:.2f}" if c["resolves_activations"] else "unresolved"
        head = [result["name"], str(result["layers"]), str(result["microbatch"]), f"{one:.1f} / {two:.1f}", slope,
                f"{c['activation_scale']:.2f}", f"{c['fixed_offset_bytes'] / 2**20:.1f}", f"{result['seconds']:.0f}"]
        for i, run in enumerate(result["held_out"]):
            cells = (head if i == 0 else [""] * len(head)) + [
                str(run["in_flight"]), f"{run['real'] / 2**20:.1f}", f"{run['model'] / run['real']:.3f}",
                f"{run['mcap'] / run['real']:.3f}", f"{run['calibrated'] / run['real']:.3f}"]
            rows.append("| " + " | ".join(cells) + " |")
        logger.info("%s: over real, per-layer model %s; mCAP's line %s; calibrated %s", result["name"],
                    *(", ".join(f"{r[key] / r['real']:.3f}" for r in result["held_out"])
                      for key in ("model", "mcap", "calibrated")))
    ratios = {key: [r[key] / r["real"] for result in results for r in result["held_out"]]
              for key in ("model", "mcap", "calibrated")}
    spans = "; ".join(f"{label} {min(ratios[key]):.2f}-{max(ratios[key]):.2f}"
                      for key, label in (("model", "per-layer model"), ("mcap", "mCAP's line"),
                                         ("calibrated", "calibrated")))
    text = ("Each model in its own process on this CPU's allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`, Eigen kernels), "
            "trained as one serialized stage on zeros, weights and slots included. The calibration reads two real "
            "runs (one micro-batch in flight: 1F1B, two: GPipe, two micro-batches a step both times); the held-out "
            "rows are three more real runs (GPipe, that many micro-batches) none of the figures was read from. "
            "Per-layer model: the partition's figure with no run. mCAP's line: the line through the two runs "
            "alone. Calibrated: `calibrate=True`, the per-layer model raised to cover both runs (activations scaled "
            "where the runs' slope is above the model's, then the least bytes per stage that cover both; where one "
            "micro-batch's activations are under 5% of the peak the slope is unresolved and only bytes are added). "
            "`wide_mlp` and `wide_cnn` are the stage benchmark's models; MobileNetV2 (64², BatchNorm, depthwise "
            f"convolutions) and a Transformer encoder (sequence 128) are held out. Over all held-out runs: {spans}."
            "\n\n" + "\n".join(rows)
            + "\n\nOp times: the profile's step time (every layer's forward, backward and update) with the preset's "
            f"op times (`{DEFAULT_DEVICE}`) and with op times calibrated per op class on this CPU (`calibrated_cost`, "
            "a copy's step profiled), against the wall clock of a copy's plain step (median of 10), each model in "
            "the same process as its memory rows.\n\n" + "\n".join(times))
    OUT.mkdir(exist_ok=True)
    (OUT / "pipeline_memory_calibration.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    publish("pipeline_calibration", text, page="partition")


def run_once(model: str, schedule: str, stages: int, microbatches: int, serialize: bool,
             recompute: bool = False) -> dict:
    """One training under ``lms-tf launch``: predicted and real peak per stage."""
    spec = (f"{model},{schedule},{stages},{microbatches}" + (",serialize" if serialize else "")
            + (",recompute" if recompute else ""))
    done = subprocess.run([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", str(stages), "--",
                           sys.executable, WORKER, "-", "--memory", spec],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    real = {0: result["task0_peak"]}
    for m in re.finditer(r"pipeline stage (\d+): allocator peak (\d+) bytes", done.stderr):
        real[int(m.group(1))] = int(m.group(2))
    return {"predicted": result["predicted"], "simulated": result["simulated"],
            "simulated_tensors": result["simulated_tensors"], "real": [real[k] for k in range(stages)],
            "layers": result["layers"], "losses": result["losses"]}


def recompute_main() -> None:
    """Each recompute case serialized, without and with every stage recomputing, side by side."""
    results = []
    for model, schedule, stages, microbatches in RECOMPUTE_CASES:
        case = {"model": model, "schedule": schedule, "stages": stages, "microbatches": microbatches}
        for label, recompute in (("kept", False), ("recomputed", True)):
            case[label] = [run_once(model, schedule, stages, microbatches, True, recompute) for _ in range(RUNS)]
        same = all(run["losses"] == case["kept"][0]["losses"] for run in case["kept"] + case["recomputed"])
        case["losses_equal"] = same
        logger.info("%s %s K=%d: real peak with recompute / without %s; losses equal: %s", model, schedule, stages,
                    ", ".join(f"{_median(case, 'recomputed', k) / _median(case, 'kept', k):.2f}" for k in range(stages)),
                    same)
        results.append(case)
    rows = ["| model | schedule | K | stage | in flight | kept: real MiB | recomputed: real MiB | recomputed / kept | "
            "recomputed: real / simulated | real / per-layer model | losses equal |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        for k in range(case["stages"]):
            runs = case["recomputed"]
            by_sim = [run["real"][k] / run["simulated"][k] for run in runs]
            by_model = [run["real"][k] / run["predicted"][k] for run in runs]
            flight = case["microbatches"] if case["schedule"] == "gpipe" else min(case["stages"] - k, case["microbatches"])
            rows.append(f"| {case['model']} | {case['schedule']} | {case['stages']} | {k}{' (task 0)' if k == 0 else ''} | "
                        f"{flight} | {_median(case, 'kept', k) / 2**20:.1f} | {_median(case, 'recomputed', k) / 2**20:.1f} | "
                        f"**{_median(case, 'recomputed', k) / _median(case, 'kept', k):.2f}** | "
                        f"{min(by_sim):.3f}-{max(by_sim):.3f} | {min(by_model):.3f}-{max(by_model):.3f} | "
                        f"{'yes' if case['losses_equal'] else 'NO'} |")
    text = (f"Serialized, one process per stage, medians (and min-max of the ratios) of {RUNS} runs each, both "
            "columns measured in one run of the benchmark. Kept: every stage keeps what its backward pass reads "
            "for every micro-batch in flight; recomputed: every stage keeps only what it receives and runs its "
            "forward pass again in each backward task (`PipelineStep(recompute=...)`). The per-layer model is "
            "`recompute_peak`, the partition's figure for a recomputing stage; simulated is "
            "`PipelineStep.predicted_peaks` on the built, recomputing step. Losses equal: every run's losses "
            "bit-identical to the first kept run's.\n\n" + "\n".join(rows))
    OUT.mkdir(exist_ok=True)
    (OUT / "pipeline_memory_recompute.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    publish("pipeline_recompute", text, page="partition")


def _median(case: dict, label: str, k: int) -> float:
    real = sorted(run["real"][k] for run in case[label])
    return real[len(real) // 2]


def main() -> None:
    results = []
    calibrated = {}
    for model in dict.fromkeys(case[0] for case in CASES):
        found = calibrate(model, [(schedule, stages, microbatches) for name, schedule, stages, microbatches in CASES
                                  if name == model])
        calibrated.update({(model,) + tuple(c["case"].split(",")): c for c in found["stages"]})
    for model, schedule, stages, microbatches in CASES:
        case = {"model": model, "schedule": schedule, "stages": stages, "microbatches": microbatches}
        case["calibrated"] = calibrated[(model, schedule, str(stages), str(microbatches))]
        for order, serialize in ORDERS:
            case[order] = runs = [run_once(model, schedule, stages, microbatches, serialize) for _ in range(RUNS)]
            logger.info("%s %s K=%d, %s order: real / simulated %s", model, schedule, stages, order, "; ".join(
                ", ".join(f"{r / p:.3f}" for r, p in zip(run["real"], run["simulated"])) for run in runs))
        results.append(case)
    rows = ["| model | schedule | K | stage | layers | per-layer model MiB | calibrated MiB | simulated: tensors MiB | "
            "simulated MiB | serialized: real MiB | real / model | real / calibrated | real / simulated | "
            "TensorFlow's order: real MiB | real / model | real / calibrated | real / simulated |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        first = case[ORDERS[0][0]][0]
        for k in range(case["stages"]):
            predicted, simulated, layers = first["predicted"][k], first["simulated"][k], first["layers"][k]
            tensors = first["simulated_tensors"][k]
            # the calibrating process cut the same layers by the same profile
            assert case["calibrated"]["layers"] == first["layers"], (case["calibrated"]["layers"], first["layers"])
            calibrated_k = case["calibrated"]["calibrated"][k]
            cells = []
            for order, _ in ORDERS:
                runs = case[order]
                real = [run["real"][k] for run in runs]
                by_sim = [run["real"][k] / run["simulated"][k] for run in runs]
                cells += [f"{min(real) / 2**20:.1f}-{max(real) / 2**20:.1f}",
                          f"{min(real) / predicted:.3f}-{max(real) / predicted:.3f}",
                          f"{min(real) / calibrated_k:.3f}-{max(real) / calibrated_k:.3f}",
                          f"{min(by_sim):.3f}-{max(by_sim):.3f}"]
            rows.append(f"| {case['model']} | {case['schedule']} | {case['stages']} | {k}{' (task 0)' if k == 0 else ''} | "
                        f"{layers[0]}..{layers[-1]} | {predicted / 2**20:.1f} | {calibrated_k / 2**20:.1f} | "
                        f"{tensors / 2**20:.1f} | "
                        f"{simulated / 2**20:.1f} | "
                        + " | ".join(cells) + " |")
    spans = {}
    for model in dict.fromkeys(case["model"] for case in results):
        ratios = [run["real"][k] / run["simulated"][k] for case in results if case["model"] == model
                  for run in case[ORDERS[0][0]] for k in range(case["stages"])]
        spans[model] = f"{min(ratios):.3f}-{max(ratios):.3f}"
    text = ("`wide_mlp`: 7 x Dense 1024, Adam, batch 256; `wide_cnn` (held out): 6 x Conv2D 3x3, 64 channels, "
            "on 32x32 images, Adam, batch 64; 4 micro-batches, one process per stage on this 2-core CPU, "
            f"min-max of {RUNS} runs in each order. The per-layer model is the partition's figure "
            "(`predicted_peak_bytes`); simulated is `PipelineStep.predicted_peaks` on the built step (the "
            "serialized one in that column), replaying TensorFlow's CPU allocator (whole chunks, as "
            "`TF_CPU_ALLOCATOR_USE_BFC=true` counts); simulated: tensors is the same replay summing tensor bytes "
            "(`allocator=False`), what the per-layer model counts too; calibrated is the per-layer model after "
            "mCAP's calibration (`calibrate=True`: two real runs of the whole model as one stage, in its own "
            "process, before the stages run). Serialized, every stage's real peak over its "
            "simulated: "
            + ", ".join(f"{model} {span}" for model, span in spans.items()) + ".\n\n" + "\n".join(rows))
    OUT.mkdir(exist_ok=True)
    (OUT / "pipeline_memory.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    publish("pipeline_memory", text, page="partition")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "--recompute" in sys.argv[1:]:
        recompute_main()
    elif "--calibration" in sys.argv[1:]:
        calibration_main()
    else:
        main()
