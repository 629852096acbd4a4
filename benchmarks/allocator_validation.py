"""The simulator against TensorFlow's real CPU allocator, one op at a time (issue "Planner").

Each zoo model's plain step and recompute-only (``recompute="sqrt"``) step really run on this
CPU with one inter-op thread (ops one at a time, like kernels on one GPU stream; oneDNN on),
in several fresh processes (``tests/allocator_worker.py``: the BFC CPU allocator must be set
before TensorFlow starts). TensorFlow's CPU executor does not run a step in the same order from
one process to the next, so the real peak is reported as its range over the processes (each
the median of 3 profiled steps). Beside it: the simulator's blind prediction (its own order),
as summed tensor bytes and through the model of TensorFlow's allocator, and the same
simulation replaying the order each process really ran (which checks the memory rules alone).

    .venv/bin/python benchmarks/allocator_validation.py     # writes benchmarks/out/allocator_validation.md
"""

import json
import logging
import os
import subprocess
import sys

log = logging.getLogger("benchmark")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = ["ResNet50,224,32", "VGG16,224,16", "MobileNetV2,224,32", "UNet,256,8", "TransformerEncoder,512,16"]
MiB = 2**20
PROCESSES = 3


def measure(spec):
    env = {k: v for k, v in os.environ.items() if k != "TF_DETERMINISTIC_OPS"}
    env["TF_ENABLE_ONEDNN_OPTS"] = "1"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "allocator_worker.py"), spec],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)  # noqa: E741
    if line is None:
        raise RuntimeError(f"{spec}: the worker failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])[0]


def table(runs):
    """One row per model and step: ``runs`` holds the worker's result of each process."""
    lines = ["| model | step | real MiB: min-median-max over processes | max/min | blind: sum / median | "
             "**blind: allocator model / median** | blind within 10% of the real range | "
             "replayed order / real, per process |",
             "|---|---|---|---|---|---|---|---|"]
    for rows in runs:
        first = rows[0]
        for step in ("plain", "sqrt"):
            real = sorted(r[step]["real"] for r in rows)
            median = real[len(real) // 2]
            blind = first[step]["blind_allocator"]  # the same in every process: the graph is the same
            inside = 0.9 * real[0] <= blind <= 1.1 * real[-1]
            replay = ", ".join(f"{r[step]['replay_allocator'] / r[step]['real']:.2f}" for r in rows)
            lines.append(f"| {first['model']} {first['size']}² b{first['batch']} | {step} | "
                         f"{real[0] / MiB:.0f}-{median / MiB:.0f}-{real[-1] / MiB:.0f} | {real[-1] / real[0]:.2f} | "
                         f"{first[step]['blind'] / median:.2f} | **{blind / median:.2f}** | "
                         f"{'yes' if inside else 'no'} | {replay} |")
    return "\n".join(lines)


def main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    runs = []
    for i, spec in enumerate(ZOO, 1):
        rows = []
        for process in range(1, PROCESSES + 1):
            log.info("[%d/%d] %s, process %d of %d", i, len(ZOO), spec, process, PROCESSES)
            rows.append(measure(spec))
        runs.append(rows)
    text = table(runs)
    out = os.path.join(ROOT, "benchmarks", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "allocator_validation.md"), "w") as handle:
        handle.write(text + "\n")
    with open(os.path.join(out, "allocator_validation.json"), "w") as handle:
        json.dump(runs, handle, indent=1)
    print(text)


if __name__ == "__main__":
    main()
