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

Command: ``.venv/bin/python benchmarks/max_params.py [--presets PRESET ...]`` (43-48 minutes for the four
presets on 2 cores on 2026-12-07: 4 tracing, 5-25 a preset; the table rewritten after each). Each preset's rows are kept, stamped with the
day and commit of their run, in ``docs/benchmarks/max_params.json``: a run of some presets keeps
the others' rows from earlier runs, and the table says which run each row is from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.publish import DOCS, publish  # noqa: E402
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


ROWS = DOCS / "max_params.json"
#: Rows whose "vs least time" took the plain step's compute, which counts the update a weights
#: plan runs on the host (before 2026-12-06): such a plan could read below its bound.
OLD_BOUND = "plain step compute"
BOUND = "device compute the plan leaves"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS),
                        help="the presets to run (default: all four); the others keep their rows from earlier runs")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(["max-params"])
    started = time.perf_counter()
    scaled = fit_decoder(args)
    log.info("traced and fitted in %.0f s", time.perf_counter() - started)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    rows = json.loads(ROWS.read_text()) if ROWS.exists() else []
    stamp = dict(run=datetime.date.today().isoformat(), commit=_commit(), bound=BOUND)
    # The target's preset first: a run cut short still answers the question.
    for preset in sorted(options.presets, key=lambda p: p != TARGET_PRESET):
        spec = get_device_spec(preset)
        began = time.perf_counter()
        found = largest_models(scaled.at, CostModel(spec), depth=args.depth, vocab=args.vocab,
                               max_width=args.max_width, device="/device:GPU:0", host="/device:CPU:1",
                               host_budget=spec.host_memory_bytes, jobs=default_jobs(), progress=False)
        log.info("%s: %s in %.0f s", preset, ", ".join(f"{way} {found[way]['params'] / 1e9:.2f}B" for way in WAYS),
                 time.perf_counter() - began)
        rows = [row for row in rows if row["preset"] != preset] + [
            dict(preset=preset, way=way, host_budget_bytes=spec.host_memory_bytes, **stamp,
                 **{k: v for k, v in found[way].items() if k != "plan"}) for way in WAYS]
        # Each preset takes minutes to tens of minutes: the rows and the table are written after each, so a run
        # cut short keeps what it found.
        ROWS.write_text(json.dumps(rows, indent=1) + "\n")
        text = table(args, rows)
        publish("max-params", text, page="weights")
        if preset == TARGET_PRESET:
            best = found["weights_and_activations"]
            ir, cost = scaled.at(best["width"]), CostModel(spec)
            plot_timeline(str(DOCS / "max_params_timeline.png"), simulate(ir, cost=cost),
                          simulate(ir, best["plan"], cost=cost), best["plan"].budget_bytes,
                          title=f"decoder {best['params'] / 1e9:.1f}B (width {best['width']}), "
                                f"weights + activations on {TARGET_PRESET}")
    log.info("%d preset(s) in %.0f s", len(options.presets), time.perf_counter() - started)
    print(text)


def _commit() -> str:
    """The short commit of the code that ran (with "+changes" when the tree differs from it)."""
    def git(*command):
        return subprocess.run(["git", *command], capture_output=True, text=True, cwd=DOCS).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--", "../../lms_tf") else "")


def table(args, rows) -> str:
    """The table of every preset's latest rows (their run named), those never run named, and the target's line.

    Example:
        >>> args = argparse.Namespace(depth=40, vocab=50257, batch=1, seq_len=1024)
        >>> row = dict(preset="v100-32gb-nvlink2", host_budget_bytes=512e9, width=1600, params=1.3e9,
        ...            run="2026-12-06", commit="abc1234", bound=BOUND)
        >>> print(table(args, [dict(row, way="plain"), dict(row, way="weights_and_activations", params=2.6e10,
        ...                    host_bytes=2**38, predicted_overhead=1.1, overhead_vs_link_lower_bound=1.05)]))
        ... # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
        The largest decoder ...
        | v100-32gb-nvlink2 (512 GB) | weights + activations planned | 1600 | 26.00B | 20.0x | 256.0 | 1.10x | 1.05x | 2026-12-06 (abc1234) |
        | v100-16gb-pcie3 | not run | | | | | | | |
        ...
        Target on v100-32gb-nvlink2: ... **20.0x** (met); ... **1.05x** (met).
    """
    rows = sorted(rows, key=lambda row: (PRESETS.index(row["preset"]), list(WAYS).index(row["way"])))
    plain = {row["preset"]: row["params"] for row in rows if row["way"] == "plain"}
    lines = [f"The largest decoder each way trains: {args.depth} blocks, 64-wide heads, tied embedding over "
             f"{args.vocab:,} tokens, {args.batch} x {args.seq_len} tokens, Adam in float32 (16 bytes a parameter "
             f"with its gradient and two moments). Width searched a head at a time; host memory held to the "
             f"preset's typical host.", "",
             "| device (host) | way | width | parameters | vs plain | host GiB | predicted time | vs least time | run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        overhead = f"{row['predicted_overhead']:.2f}x" if row.get("predicted_overhead") else "-"
        bound = f"{row['overhead_vs_link_lower_bound']:.2f}x" if row.get("overhead_vs_link_lower_bound") else "-"
        if bound != "-" and row.get("bound") == OLD_BOUND:
            bound += " (old bound)"
        lines.append(f"| {row['preset']} ({row['host_budget_bytes'] / 1e9:.0f} GB) | {NAMES[row['way']]} | "
                     f"{row['width']} | {row['params'] / 1e9:.2f}B | {row['params'] / plain[row['preset']]:.1f}x | "
                     f"{(row.get('host_bytes') or 0) / GiB:.1f} | {overhead} | {bound} | "
                     f"{row.get('run', '?')} ({row.get('commit', '?')}) |")
    for preset in PRESETS:
        if preset not in plain:
            lines.append(f"| {preset} | not run | | | | | | | |")
    if any(row.get("bound") == OLD_BOUND for row in rows):
        lines += ["", "(old bound): the least time then took the plain step's compute, which counts the update a "
                      "weights plan runs on the host, so a plan could read below it; rows run since take the "
                      "device compute the plan leaves."]
    target = {row["way"]: row for row in rows if row["preset"] == TARGET_PRESET}
    if not target:
        lines += ["", f"Target on {TARGET_PRESET}: not run yet."]
        return "\n".join(lines)
    ratio = target["weights_and_activations"]["params"] / target["plain"]["params"]
    bound = target["weights_and_activations"]["overhead_vs_link_lower_bound"]
    lines += ["", f"Target on {TARGET_PRESET}: weights + activations at least {TARGET_RATIO:.0f}x the plain "
                  f"figure: **{ratio:.1f}x** ({'met' if ratio >= TARGET_RATIO else 'not met'}); predicted time at "
                  f"most {TARGET_BOUND}x the least time: **{bound:.2f}x** "
                  f"({'met' if bound <= TARGET_BOUND else 'not met'})"
                  + (" against the old bound." if target["weights_and_activations"].get("bound") == OLD_BOUND else ".")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
