"""The simulator against TensorFlow's real CPU allocator, one op at a time (issue "Planner").

Each zoo model's plain step and recompute-only (``recompute="sqrt"``) step really run on this
CPU with one inter-op thread (ops one at a time, like kernels on one GPU stream; oneDNN on),
in a fresh process (``tests/allocator_worker.py``: the BFC CPU allocator must be set before
TensorFlow starts). The real peak (median of 3 profiled steps) is set beside the simulator's
blind prediction (its own order), as summed tensor bytes and through the model of TensorFlow's
allocator, and beside the same simulation replaying the order TensorFlow really ran.

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


def measure(spec):
    env = {k: v for k, v in os.environ.items() if k != "TF_DETERMINISTIC_OPS"}
    env["TF_ENABLE_ONEDNN_OPTS"] = "1"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "allocator_worker.py"), spec],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)  # noqa: E741
    if line is None:
        raise RuntimeError(f"{spec}: the worker failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])[0]


def table(rows):
    lines = ["| model | step | real MiB | blind: sum | blind: allocator model | replayed order: allocator model |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for step in ("plain", "sqrt"):
            d = r[step]
            lines.append(f"| {r['model']} {r['size']}² b{r['batch']} | {step} | {d['real'] / MiB:.0f} | "
                         f"{d['blind'] / d['real']:.2f} | **{d['blind_allocator'] / d['real']:.2f}** | "
                         f"{d['replay_allocator'] / d['real']:.2f} |")
    return "\n".join(lines)


def main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    rows = []
    for i, spec in enumerate(ZOO, 1):
        log.info("[%d/%d] %s", i, len(ZOO), spec)
        rows.append(measure(spec))
    text = table(rows)
    out = os.path.join(ROOT, "benchmarks", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "allocator_validation.md"), "w") as handle:
        handle.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
