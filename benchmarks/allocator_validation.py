"""The simulator against TensorFlow's real CPU allocator, one op at a time (issue "Planner").

Each zoo model's plain step and recompute-only (``recompute="sqrt"``) step really run on this
CPU with one inter-op thread (ops one at a time, like kernels on one GPU stream; oneDNN on),
in several fresh processes (``tests/allocator_worker.py``: the BFC CPU allocator must be set
before TensorFlow starts), one step per process (a step measured after another reads a lower
peak: the allocator keeps the regions the first one grew). Each real peak is the median of 3
profiled steps. Two tables:

1. **Serialized** (``serialize=True``): the step's compute ops are chained in the simulator's
   own order, so the blind prediction (summed tensor bytes, and through the model of
   TensorFlow's allocator) predicts this very run. The processes must agree with each other,
   and the executed order must show no inversions.
2. **Free order**: TensorFlow's CPU executor picks the order, which changes from one process
   to the next. The real peak is shown as its range over the processes, beside the same blind
   prediction and the simulation replaying each process's real order (the memory rules alone).

    .venv/bin/python benchmarks/allocator_validation.py              # the zoo: tables into docs/benchmarks/planner.md
    .venv/bin/python benchmarks/allocator_validation.py --held-out   # models the rules were not read from
    ... --serialized-only   # measure the serialized steps again; keep the published free-order table

``--serialized-only`` is for a change to serialization alone, which a free-order step does not
run: the free-order table is carried over from the page, under a line that says from which run.
"""

import datetime
import json
import logging
import os
import sys

log = logging.getLogger("benchmark")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from publish import OUT, publish  # noqa: E402 - benchmarks/publish.py, beside this script

from tests.allocator_runs import run_allocator_worker  # noqa: E402

ZOO = ["ResNet50,224,32", "VGG16,224,16", "MobileNetV2,224,32", "UNet,256,8", "TransformerEncoder,512,16"]
#: Models the simulator's memory rules were not read from (the rules came from the zoo's traces).
HELD_OUT = ["DenseNet121,160,16", "EfficientNetB0,160,16", "ConvNeXtTiny,128,8", "StackedRNN,100,64"]
MiB = 2**20
PROCESSES = 5  # free order: its peak varies from process to process
SERIALIZED_PROCESSES = 2  # serialized: the same in every process, two show it


def measure(spec, order, step):
    """One fresh process measuring one step of one model, in one order."""
    return run_allocator_worker("--order", order, "--step", step, spec, timeout=3600)[0]


def serialized_table(runs):
    """One row per model and step, serialized steps: ``runs`` holds the worker's result of each process."""
    lines = ["| model | step | real MiB, per process | **blind: allocator model / real** | blind: sum / real | "
             "within 10% | chained ops seen running (of all), out of order | accumulated sums: predicted / real |",
             "|---|---|---|---|---|---|---|---|"]
    for rows in runs:
        for step in ("plain", "sqrt"):
            key = f"{step}_serialized"
            measured = [r for r in rows if key in r]
            first = measured[0]
            real = sorted(r[key]["real"] for r in measured)
            median = real[len(real) // 2]
            blind = first[key]["blind_allocator"]
            ratios = [blind / r for r in real]
            lines.append(f"| {first['model']} {first['size']}² b{first['batch']} | {step} | "
                         f"{', '.join(f'{r / MiB:.0f}' for r in real)} | **{blind / median:.2f}** | "
                         f"{first[key]['blind'] / median:.2f} | "
                         f"{'yes' if all(0.9 <= q <= 1.1 for q in ratios) else 'no'} | "
                         f"{first[key]['executed_ops']} of {first[key]['chained_ops']}, "
                         f"{max(r[key]['inversions'] for r in measured)} | {_sums(first[key])} |")
    return "\n".join(lines)


def _sums(measured):
    """The gradient sums Grappler accumulates into a temporary variable, as the simulator was
    told (predicted offline) and as the real allocator's trace shows them."""
    return f"{', '.join(measured['accumulated_predicted']) or '-'} / {', '.join(measured['accumulated_real']) or '-'}"


def table(runs):
    """One row per model and step, free order: ``runs`` holds the worker's result of each process."""
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


def run_model(spec, orders=(("serialized", SERIALIZED_PROCESSES), ("free", PROCESSES))):
    """Every process of one model (each order, both steps); saved so a long run can be resumed."""
    saved = OUT / "allocator_validation" / f"{spec.replace(',', '_')}{'' if len(orders) > 1 else '_' + orders[0][0]}.json"
    if saved.exists():
        return json.loads(saved.read_text())
    jobs = [(order, step, process) for order, processes in orders
            for process in range(processes) for step in ("plain", "sqrt")]
    rows = [{} for _ in range(PROCESSES)]
    for j, (order, step, process) in enumerate(jobs, 1):
        log.info("%s: %s %s step, process %d (%d/%d)", spec, order, step, process + 1, j, len(jobs))
        rows[process].update(measure(spec, order, step))
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(rows, indent=1))
    return rows


def _published_free_order(block):
    """The free-order table of ``block`` as the page has it now, and the run it came from."""
    with open(os.path.join(ROOT, "docs", "benchmarks", "planner.md"), encoding="utf-8") as handle:
        content = handle.read()
    section = content[content.index(f"<!-- benchmark:{block} begin -->"):content.index(f"<!-- benchmark:{block} end -->")]
    _, marker, rest = section.partition("Free order (TensorFlow's CPU executor picks)")
    header, _, free = rest.partition("\n")
    if not marker or "run of " not in header:
        raise SystemExit(f"--serialized-only: the page's {block} block has no free-order table that says which run "
                         f"it is from; run without --serialized-only.")
    return f"run of {header.split('run of ', 1)[1].rstrip(':')}:\n\n{free.strip()}"


def main():
    """Runs (or, for models already measured, reads back) the zoo, or with ``--held-out`` the held-out
    models, and writes their tables. ``--fresh`` forgets earlier measurements."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if "--fresh" in sys.argv:
        for path in (OUT / "allocator_validation").glob("*.json"):
            path.unlink()
    held_out = "--held-out" in sys.argv
    block = "allocator_held_out" if held_out else "allocator_validation"
    if "--serialized-only" in sys.argv:
        runs = [run_model(spec, orders=(("serialized", SERIALIZED_PROCESSES),)) for spec in (HELD_OUT if held_out else ZOO)]
        free = _published_free_order(block)
        text = ("Serialized (the simulator's order imposed):\n\n" + serialized_table(runs)
                + f"\n\nFree order (TensorFlow's CPU executor picks), carried over from the {free}")
    else:
        runs = [run_model(spec) for spec in (HELD_OUT if held_out else ZOO)]
        text = ("Serialized (the simulator's order imposed):\n\n" + serialized_table(runs)
                + f"\n\nFree order (TensorFlow's CPU executor picks), run of {datetime.date.today()}:\n\n"
                + table(runs))
    if held_out:  # each block named where it is published: tests/test_docs_links.py reads them off
        publish("allocator_held_out", text, page="planner")
    else:
        publish("allocator_validation", text, page="planner")
    with open(OUT / f"{block}.json", "w") as handle:
        json.dump(runs, handle, indent=1)
    print(text)


if __name__ == "__main__":
    main()
