"""Benchmark: how long ``lms-tf max-batch`` takes on ResNet-50 224² (v100-16gb-pcie3), side by side.

The search (with lms-tf from the plain answer) run five ways in one process, one after the other:

* **before**: doubling then bisection, each batch sized by TensorFlow's shape inference, every
  plan the planner meets replayed again, one batch at a time (lms-tf as of two releases ago);
* **bisection, sized + remembered**: sizes by arithmetic from three sizings (``BatchSizedIR``),
  the planner's fit check answering a plan it met before from memory, 1 and N jobs (``--jobs``:
  the batches the search may need next planned ahead of time in N forked processes);
* **guided** (the command's search): the same, steered by the memory each try reports to an
  estimate of the boundary and the batch after it, 1 and N jobs.

Every row must give the same answers; the table gives the seconds, tries and rounds of each and
its speed-up over "before". Then the whole command, ``lms-tf max-batch --model resnet50``, is
timed in a process of its own (importing TensorFlow, building and tracing the model included):
the figure users wait for. Last, the plan at the answer is judged by Grappler in both orders
(``benchmarks/max_batch_judge.py``). On a CPU: the planner is pure Python, so the figures are CPU time of
planning, not of any GPU.

Command: ``.venv/bin/python benchmarks/max_batch.py [JOBS]`` (about 10 minutes on 2 cores; writes
``benchmarks/out/max_batch.json`` and the table into ``docs/benchmarks/planner.md``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.publish import OUT, publish  # noqa: E402
from lms_tf.cli import build_parser  # noqa: E402
from lms_tf.cli.max_batch import default_jobs, fits, probes, largest_batch, sized_by_batch  # noqa: E402
from lms_tf.cli.workload import trace_unbatched  # noqa: E402
from lms_tf.core.policy import Policies  # noqa: E402
from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.planner import fit_check  # noqa: E402
from lms_tf.tf.trace import build_ir  # noqa: E402

log = logging.getLogger("benchmark")
DEVICE = "v100-16gb-pcie3"


def search(ir_for_batch, jobs: int, guided: bool) -> dict:
    """The plain then the lms-tf search, timed; answers, tries and rounds."""
    cost = CostModel(get_device_spec(DEVICE))
    policies = Policies(host="/CPU:1", budget="auto", recompute="auto")
    answers, tries, rounds = {}, 0, 0
    started = time.perf_counter()
    for with_lms in (False, True):
        with probes(jobs, functools.partial(fits, ir_for_batch, policies=policies, cost=cost, with_lms=with_lms,
                                            device="/device:GPU:0")) as probe_all:
            def counted(batches):
                nonlocal tries, rounds
                tries, rounds = tries + len(batches), rounds + 1
                return probe_all(batches)
            answers[with_lms] = largest_batch(ir_for_batch, policies, cost, with_lms, 4096, device="/device:GPU:0",
                                              known_good=answers[False] if with_lms else 0, probe_all=counted,
                                              jobs=jobs, guided=guided)[0]
    return {"plain": answers[False], "lms": answers[True], "seconds": time.perf_counter() - started,
            "tries": tries, "rounds": rounds}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else max(2, default_jobs())
    _, _, graph, _, _ = trace_unbatched(build_parser().parse_args(["max-batch", "--model", "resnet50"]))
    rows = []

    log.info("before: TensorFlow sizing per batch, no remembered replays, one batch at a time")
    cache = {}

    def built(batch):
        if batch not in cache:
            cache.clear()
            cache[batch] = build_ir(graph, batch_size=batch)
        return cache[batch]

    remembered, held = fit_check.REMEMBERED_REPLAYS, fit_check.FitCheck._held_in_chunks
    fit_check.REMEMBERED_REPLAYS = 0
    fit_check.FitCheck._held_in_chunks = lambda self, key, seed, sim: self.held_in_chunks(sim)
    try:
        rows.append({"way": "before: bisection, TensorFlow sizing per batch, every plan replayed, 1 job",
                     **search(built, 1, guided=False)})
    finally:
        fit_check.REMEMBERED_REPLAYS, fit_check.FitCheck._held_in_chunks = remembered, held
    started = time.perf_counter()
    sized, by_arithmetic = sized_by_batch(graph)
    sizing = time.perf_counter() - started
    assert by_arithmetic, "ResNet-50's sizes are linear in the batch"
    for guided in (False, True):
        for n in (1, jobs):
            way = "guided" if guided else "bisection"
            log.info("%s, sized by arithmetic, remembered replays, %d job(s)", way, n)
            row = search(sized, n, guided)
            row["seconds"] += sizing
            rows.append({"way": f"{way}, sized by arithmetic + remembered replays, {n} job{'s' if n > 1 else ''}",
                         **row})
    if len({(r["plain"], r["lms"]) for r in rows}) != 1:
        raise SystemExit(f"the ways gave different answers: {rows}")
    log.info("the whole command in a process of its own")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lms_tf.cli", "max-batch", "--model", "resnet50", "--device", DEVICE,
                           "--json"], capture_output=True, text=True, check=True)
    command_seconds = time.perf_counter() - started
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if (answer["max_batch_plain"], answer["max_batch_lms"]) != (rows[0]["plain"], rows[0]["lms"]):
        raise SystemExit(f"the command answered differently: {answer}")
    log.info("the plan at batch %d judged by Grappler's virtual V100", rows[0]["lms"])
    judge = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "max_batch_judge.py"),
                            str(rows[0]["lms"])], capture_output=True, text=True, check=True)
    judged = json.loads(next(line for line in judge.stdout.splitlines() if line.startswith("RESULT "))[7:])
    before = rows[0]["seconds"]
    lines = [f"`lms-tf max-batch --model resnet50` (224², `{DEVICE}`), the search run five ways one after the "
             f"other in one process on {os.cpu_count()} CPU cores (tracing excluded, the three sizings included): "
             f"every way answers **{rows[0]['plain']} plain, {rows[0]['lms']} with lms-tf**. The whole command "
             f"(default `--jobs {default_jobs()}`, importing TensorFlow, building and tracing ResNet-50 included), "
             f"in a process of its own after them: **{command_seconds:.0f} s**, the same answer.", "",
             "| way | seconds | batches tried | rounds | speed-up over before |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['seconds']:.0f} | {r['tries']} | {r['rounds']} | "
                     f"{before / r['seconds']:.2f}x |")
    gib = 2**30
    lines += ["", f"The plan at batch {rows[0]['lms']}, traced and rewritten by `lms_tf.function(budget=\"auto\")` and "
              f"judged by Grappler's virtual V100 told the variable shapes (`benchmarks/max_batch_judge.py`). Grappler's "
              f"step peak counts the batch ({judged[0]['inputs'] / gib:.2f} GiB), which the simulator leaves with the "
              f"variables, so both are held against the room the device leaves the step and its batch (16 GB less the "
              f"variables and the safety margin: {judged[0]['room'] / gib:.2f} GiB):", "",
              "| order | simulated step + batch (GiB) | Grappler step peak (GiB) | Grappler raw (GiB) | fits by Grappler |",
              "|---|---|---|---|---|"]
    for j in judged:
        order = "serialized (the simulator's)" if j["serialize"] else "TensorFlow's own (Grappler's scheduler)"
        lines.append(f"| {order} | {(j['simulated'] + j['inputs']) / gib:.2f} | {j['oracle_step_peak'] / gib:.2f} | "
                     f"{j['oracle_raw_peak'] / gib:.2f} | {'yes' if j['oracle_step_peak'] <= j['room'] else 'NO'} |")
    text = "\n".join(lines)
    publish("max_batch", text, page="planner")
    OUT.mkdir(exist_ok=True)
    with open(OUT / "max_batch.json", "w") as handle:
        json.dump({"ways": rows, "command_seconds": command_seconds, "judged": judged}, handle, indent=1)
    print(text)


if __name__ == "__main__":
    main()
