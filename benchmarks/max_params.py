"""Benchmark: the largest decoder-only Transformer each way trains, on four device presets, side by side.

What ``lms-tf max-params`` answers, for one decoder family (40 blocks, 64-wide heads, tied
embedding over GPT-2's 50,257 tokens, one sequence of 1,024 tokens, Adam in float32) on
``v100-16gb-pcie3``, ``v100-32gb-nvlink2``, ``h100-80gb-pcie5`` and ``gh200-96gb-c2c``. The step is
traced once, at four small widths, and sized at every other width by arithmetic
(:class:`lms_tf.core.ir.ScaledIR`); each width is simulated and planned for each device:

* **plain**: every variable resident;
* **optimizer on host**: Adam's slots in host memory;
* **activations planned**: swap and recompute for ``budget="auto"``, every variable resident;
* **weights + activations planned**: ``weights="host"`` as well, the host memory held to the
  preset's typical host (:mod:`lms_tf.cost.devices`).

For the largest model each way: width, parameters, parameters against plain, the host memory
it needs, and for the planned ways the predicted step time against the plain step's with
unlimited memory and against the least time any plan moving the same bytes could take (the
busier of compute, either link direction and the host's update). Everything is the simulator's:
this machine has no GPU. A timeline of the largest plan on ``v100-32gb-nvlink2`` is drawn to
``docs/benchmarks/max_params_timeline.png``.

Command: ``.venv/bin/python benchmarks/max_params.py`` (about 35 minutes a preset on 2 cores, the table rewritten after each; writes
``benchmarks/out/max_params.json`` and the table into ``docs/benchmarks/weights.md``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.publish import DOCS, OUT, publish  # noqa: E402
from lms_tf.cli import build_parser  # noqa: E402
from lms_tf.cli.max_batch import default_jobs  # noqa: E402
from lms_tf.cli.max_params import WAYS, fit_decoder, largest_models  # noqa: E402
from lms_tf.cli.plots import plot_timeline  # noqa: E402
from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.simulate import simulate  # noqa: E402

log = logging.getLogger("benchmark")
PRESETS = ("v100-16gb-pcie3", "v100-32gb-nvlink2", "h100-80gb-pcie5", "gh200-96gb-c2c")
TARGET_PRESET, TARGET_RATIO, TARGET_BOUND = "v100-32gb-nvlink2", 10.0, 1.5
NAMES = {"plain": "plain", "optimizer_on_host": "optimizer on host", "activations_planned": "activations planned",
         "weights_and_activations": "weights + activations planned"}
GiB = 2**30


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(["max-params"])
    started = time.perf_counter()
    scaled = fit_decoder(args)
    log.info("traced and fitted in %.0f s", time.perf_counter() - started)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    rows, found_by_preset = [], {}
    # The target's preset first: a run cut short still answers the question.
    for preset in sorted(PRESETS, key=lambda p: p != TARGET_PRESET):
        spec = get_device_spec(preset)
        began = time.perf_counter()
        found = largest_models(scaled.at, CostModel(spec), depth=args.depth, vocab=args.vocab,
                               max_width=args.max_width, device="/device:GPU:0", host="/device:CPU:1",
                               host_budget=spec.host_memory_bytes, jobs=default_jobs(), progress=False)
        found_by_preset[preset] = found
        log.info("%s: %s in %.0f s", preset, ", ".join(f"{way} {found[way]['params'] / 1e9:.2f}B" for way in WAYS),
                 time.perf_counter() - began)
        for way in WAYS:
            row = {k: v for k, v in found[way].items() if k != "plan"}
            rows.append(dict(preset=preset, way=way, host_budget_bytes=spec.host_memory_bytes, **row))
        # Each preset takes about half an hour: the table so far is written after each, so a run
        # cut short leaves what it found, the presets it did not reach named as such.
        text = table(args, rows, found_by_preset)
        publish("max-params", text, page="weights")
        OUT.mkdir(exist_ok=True)
        with open(OUT / "max_params.json", "w") as handle:
            json.dump(rows, handle, indent=1)
        if preset == TARGET_PRESET:
            best = found["weights_and_activations"]
            ir, cost = scaled.at(best["width"]), CostModel(spec)
            plot_timeline(str(DOCS / "max_params_timeline.png"), simulate(ir, cost=cost),
                          simulate(ir, best["plan"], cost=cost), best["plan"].budget_bytes,
                          title=f"decoder {best['params'] / 1e9:.1f}B (width {best['width']}), "
                                f"weights + activations on {TARGET_PRESET}")
    log.info("all presets in %.0f s", time.perf_counter() - started)
    print(text)


def table(args, rows, found_by_preset) -> str:
    """The table of the presets found so far, those not yet reached named, and the target's line."""
    rows = sorted(rows, key=lambda row: PRESETS.index(row["preset"]))  # the table in the presets' order
    lines = [f"The largest decoder each way trains: {args.depth} blocks, 64-wide heads, tied embedding over "
             f"{args.vocab:,} tokens, {args.batch} x {args.seq_len} tokens, Adam in float32 (16 bytes a parameter "
             f"with its gradient and two moments). Width searched a head at a time; host memory held to the "
             f"preset's typical host.", "",
             "| device (host) | way | width | parameters | vs plain | host GiB | predicted time | vs least time |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        plain = found_by_preset[row["preset"]]["plain"]["params"]
        overhead = f"{row['predicted_overhead']:.2f}x" if row.get("predicted_overhead") else "-"
        bound = f"{row['overhead_vs_link_lower_bound']:.2f}x" if row.get("overhead_vs_link_lower_bound") else "-"
        lines.append(f"| {row['preset']} ({row['host_budget_bytes'] / 1e9:.0f} GB) | {NAMES[row['way']]} | "
                     f"{row['width']} | {row['params'] / 1e9:.2f}B | {row['params'] / plain:.1f}x | "
                     f"{(row.get('host_bytes') or 0) / GiB:.1f} | {overhead} | {bound} |")
    pending = [preset for preset in PRESETS if preset not in found_by_preset]
    for preset in pending:
        lines.append(f"| {preset} | not reached | the run was still on another preset when this table was "
                     f"written | | | | | |")
    if TARGET_PRESET not in found_by_preset:
        lines += ["", f"Target on {TARGET_PRESET}: not reached in this run."]
        return "\n".join(lines)
    target = found_by_preset[TARGET_PRESET]
    ratio = target["weights_and_activations"]["params"] / target["plain"]["params"]
    bound = target["weights_and_activations"]["overhead_vs_link_lower_bound"]
    lines += ["", f"Target on {TARGET_PRESET}: weights + activations at least {TARGET_RATIO:.0f}x the plain "
                  f"figure: **{ratio:.1f}x** ({'met' if ratio >= TARGET_RATIO else 'not met'}); predicted time at "
                  f"most {TARGET_BOUND}x the least time: **{bound:.2f}x** "
                  f"({'met' if bound <= TARGET_BOUND else 'not met'})."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
