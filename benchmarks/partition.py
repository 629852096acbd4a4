"""Benchmark: pipeline partitioning by memory against DeepSpeed's rules, from each model's traced step.

For ResNet-152, a 48-block Transformer encoder and a U-Net (each traced once at one micro-batch,
never run), for K = 2, 4, 8 stages with 1F1B and 8 micro-batches, on 16 GB V100s and on a mixed
set of devices: the largest stage's predicted peak over the ideal (one copy of the whole step / K)
for the memory-balanced cut, DeepSpeed's ``parameters`` and ``uniform`` rules (all judged by the
same memory model), and the time the search took. Then the deepest Transformer encoder whose
stages fit 16 GB V100s, per rule (the blocks' profile repeated: checked against a traced deep
model), the search on 1,000 layers, and the profiling runs each approach needs.

Command: ``.venv/bin/python benchmarks/partition.py`` (a few minutes on 2 cores; writes
``benchmarks/out/partition.{md,json}`` and the tables and plot into ``docs/benchmarks/partition.md``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.publish import DOCS, OUT, publish  # noqa: E402
from lms_tf.cost import CostModel, get_device_spec  # noqa: E402
from lms_tf.pipeline import LayerProfile, PipelineProfile, evaluate, partition_layers, stage_peak  # noqa: E402

GiB = 2**30
RULES = ("memory", "parameters", "uniform")
MIXED = ["v100-16gb-pcie3", "v100-32gb-nvlink2", "a100-40gb-pcie4", "h100-80gb-pcie5"]
MICROBATCHES = 8
#: Host memory per stage process for what a swapping stage puts there. Not this machine's (the
#: library's default) and no particular server's: the tables report what the stages need.
HOST_BUDGET = "1TiB"


def models():
    """(label, model, micro-batch size, optimizer name) of the benchmark's three models."""
    from lms_tf.tf.workloads import build_model, transformer_encoder, unet

    return [("ResNet-152 224² (micro-batch 8)", build_model("ResNet152", image_size=224, classes=1000), 8),
            ("Transformer encoder, 48 blocks, seq 512, dim 1024 (micro-batch 2)",
             transformer_encoder(seq_len=512, vocab=32000, dim=1024, heads=16, blocks=48), 2),
            ("U-Net 256², depth 4 (micro-batch 4)", unet(image_size=256, classes=2, base_filters=32), 4)]


def adam():
    from lms_tf._compat import keras_module

    return keras_module().optimizers.Adam()


def repeat_blocks(profile: PipelineProfile, blocks: int, block_prefix: str = "block0_") -> PipelineProfile:
    """A profile with the layers of one block (``block0_*``) repeated ``blocks`` times between the
    layers before the first block and after the last, each copy with its own tensors and weights:
    the profile of the same model built ``blocks`` deep (memory and time are per layer)."""
    layers = list(profile.layers)
    first = [i for i, layer in enumerate(layers) if layer.name.startswith(block_prefix)]
    last_block = max(i for i, layer in enumerate(layers) if layer.name.startswith("block"))
    head, block, tail = layers[:first[0]], layers[first[0]:first[-1] + 1], layers[last_block + 1:]
    out = list(head)

    def renamed(layer: LayerProfile, copy: int, shift: int) -> LayerProfile:
        tag = lambda name: f"{name}#{copy}"
        return LayerProfile(
            layer.name.replace(block_prefix, f"block{copy}_"), params=tuple((tag(n), b) for n, b in layer.params),
            saved=tuple((tag(n), b) for n, b in layer.saved), work_bytes=layer.work_bytes,
            inputs=tuple((tag(n), b, i + shift) for n, b, i in layer.inputs), forward_s=layer.forward_s,
            backward_s=layer.backward_s, update_s=layer.update_s, pinned=tuple(tag(n) for n in layer.pinned))

    for copy in range(blocks):
        out.extend(renamed(layer, copy, len(out) - first[0]) for layer in block)
    out.extend(tail)
    return PipelineProfile(tuple(out), profile.slot_bytes_per_param_byte, profile.microbatch)


def deepest(profile: PipelineProfile, rule: str, stages: int, device, upper: int = 4096,
            swap: bool = False, recompute: bool = False) -> int:
    """The most blocks whose partition (by ``rule``, stages swapping their waiting micro-batches
    when ``swap``, or running their forward pass again when ``recompute``, where they need to)
    fits ``device`` on every stage (bisection)."""
    fits = lambda n: n >= stages and partition_layers(repeat_blocks(profile, n), stages=stages,
                                                      microbatches=MICROBATCHES, devices=device, rule=rule,
                                                      swap=swap, host_budget=HOST_BUDGET,
                                                      recompute=recompute).feasible
    good, bad = 0, None
    n = max(stages, 8)
    while bad is None and n <= upper:
        if fits(n):
            good, n = n, n * 2
        else:
            bad = n
    bad = bad or upper + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from lms_tf.cli.partition import plot_stages
    from lms_tf.core.errors import InfeasibleBudgetError
    from lms_tf.core.policy import Policies
    from lms_tf.planner import make_budget_plan
    from lms_tf.simulate import resident_bytes, simulate
    from lms_tf.tf.pipeline import trace_profile
    from lms_tf.tf.trace import trace_step_ir
    from lms_tf.tf.workloads import train_step

    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    results = {"models": [], "depth": {}, "scale": {}}
    rows = ["| model | layers | K | devices | memory: largest / ideal | parameters | uniform | memory-balanced largest "
            "stage (GiB) | search time (s) |", "|---|---|---|---|---|---|---|---|---|"]
    check_rows = ["| model | weights (MiB) | one stage, M = 1: per-layer model (MiB) | simulator: plain step's peak + "
                  "resident variables (MiB) | ratio |", "|---|---|---|---|---|"]
    swap_rows = ["| model | per-layer model, swapping (MiB) | lms-tf's planner: least swap-only budget + resident "
                 "variables (MiB) | ratio | planning time (s) |", "|---|---|---|---|---|"]
    transformer_profile = None
    for label, model, micro in models():
        started = time.perf_counter()
        profile = trace_profile(model, microbatch=micro, cost=cost, optimizer=adam())
        trace_s = time.perf_counter() - started
        logging.info("%s: %d layers profiled in %.1f s", label, len(profile.layers), trace_s)
        if "Transformer" in label:
            transformer_profile = profile
        # The per-layer model against the simulator, on the whole step (no pipeline).
        from lms_tf.tf.workloads import synthetic_batch

        ir = trace_step_ir(train_step(model, adam()), *synthetic_batch(model, micro))
        plain = simulate(ir, cost=cost).peak_bytes + resident_bytes(ir)
        weights = sum(layer.param_bytes for layer in profile.layers)
        whole = stage_peak(profile, 0, len(profile.layers), 1)
        check_rows.append(f"| {label} | {weights / 2**20:.0f} | {whole / 2**20:.0f} | {plain / 2**20:.0f} "
                          f"| {whole / plain:.2f} |")
        results.setdefault("check", {})[label] = {"model_bytes": whole, "simulated_bytes": plain}
        # The least the per-layer model lets the whole step reach by swapping, against the least
        # budget lms-tf's own planner fits the same step into with swapping alone.
        least_model = stage_peak(profile, 0, len(profile.layers), 1, swap=True)
        t = time.perf_counter()
        try:
            make_budget_plan(ir, Policies(budget=1024, recompute=False), device="/device:GPU:0", cost=cost)
            least_planner = None
        except InfeasibleBudgetError as err:
            least_planner = err.smallest_feasible_bytes + resident_bytes(ir)
        planning_s = time.perf_counter() - t
        logging.info("%s: least peak by swapping: per-layer model %.0f MiB, planner %s (%.0f s)", label,
                     least_model / 2**20, least_planner and f"{least_planner / 2**20:.0f} MiB", planning_s)
        swap_rows.append(f"| {label} | {least_model / 2**20:.0f} | "
                         + (f"{least_planner / 2**20:.0f} | {least_model / least_planner:.2f}"
                            if least_planner else "the planner found no least (1 KiB fitted) | -")
                         + f" | {planning_s:.0f} |")
        results["check"][label] |= {"least_model_bytes": least_model, "least_planner_bytes": least_planner}
        for stages in (2, 4, 8):
            for devices_label, devices in (("V100 16 GB", "v100-16gb-pcie3"),
                                           ("mixed: " + ", ".join(d.split("-")[0] + "-" + d.split("-")[1]
                                                                  for d in MIXED), (MIXED * 2)[:stages])):
                found = {}
                for rule in RULES:
                    t = time.perf_counter()
                    found[rule] = partition_layers(profile, stages=stages, microbatches=MICROBATCHES, devices=devices,
                                                   rule=rule, model=label, swap=False)
                    if rule == "memory":
                        search_s = time.perf_counter() - t
                ratio = {r: found[r].max_stage_peak_bytes / found[r].ideal_peak_bytes for r in RULES}
                fill = {r: max(s.predicted_peak_bytes / s.capacity_bytes for s in found[r].stages) for r in RULES}
                cells = [f"{ratio[r]:.2f}" + ("" if devices == "v100-16gb-pcie3" else f" ({fill[r]:.0%} full)")
                         for r in RULES]
                rows.append(f"| {label} | {len(profile.layers)} | {stages} | {devices_label} | **{cells[0]}** | "
                            f"{cells[1]} | {cells[2]} | {found['memory'].max_stage_peak_bytes / GiB:.2f} | "
                            f"{search_s:.3f} |")
                results["models"].append({"model": label, "stages": stages, "devices": devices_label,
                                          "ratio": ratio, "fullest": fill, "search_s": search_s,
                                          "max_stage_peak_bytes": {r: found[r].max_stage_peak_bytes for r in RULES}})
                if stages == 4 and devices == "v100-16gb-pcie3":
                    plot_stages(str(DOCS / f"partition_{label.split()[0].lower()}.png"),
                                [found[r] for r in RULES], title=f"{label}: 4 stages, 1F1B, 8 micro-batches")

    # The deepest Transformer whose stages fit 16 GB V100s, per rule (the block's profile repeated).
    traced_48 = partition_layers(transformer_profile, stages=4, microbatches=MICROBATCHES, devices="v100-16gb-pcie3")
    repeated_48 = partition_layers(repeat_blocks(transformer_profile, 48), stages=4, microbatches=MICROBATCHES,
                                   devices="v100-16gb-pcie3")
    # Where the per-layer model's least peak reads below lms-tf planner's least on whole steps (as
    # low as `worst` of it), the swapping depths again with every device taken as only that share
    # of its memory. Where it reads above on every model, the cut is already conservative: the
    # share is 1 and the column repeats the swapping depths.
    read_low = [c["least_model_bytes"] / c["least_planner_bytes"] for c in results["check"].values()
                if c["least_planner_bytes"]]
    worst = min([1.0, *read_low])
    v100 = get_device_spec("v100-16gb-pcie3")
    shrunk = dataclasses.replace(v100, memory_bytes=int(v100.memory_bytes * worst))
    depth_rows = ["| K | memory: blocks | parameters: blocks | uniform: blocks | memory / uniform | memory / parameters "
                  "| memory + swap: blocks | uniform + swap: blocks | memory + swap / uniform | its step time / the same "
                  f"cut's without swapping | its largest stage's host memory (GiB) | memory + swap, devices at "
                  f"{worst:.0%}: blocks (/ uniform) | memory + recompute: blocks (/ uniform) | memory + swap or "
                  "recompute: blocks (/ uniform) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stages in (2, 4, 8):
        depth = {rule: deepest(transformer_profile, rule, stages, "v100-16gb-pcie3") for rule in RULES}
        for rule in ("memory", "uniform"):
            depth[rule + "+swap"] = deepest(transformer_profile, rule, stages, "v100-16gb-pcie3", swap=True)
        depth["memory+swap@worst"] = deepest(transformer_profile, "memory", stages, shrunk, swap=True)
        depth["memory+recompute"] = deepest(transformer_profile, "memory", stages, "v100-16gb-pcie3", recompute=True)
        depth["memory+both"] = deepest(transformer_profile, "memory", stages, "v100-16gb-pcie3", swap=True,
                                       recompute=True)
        # What swapping costs: the deepest swapping cut's predicted step against the same cut's
        # with nothing swapped (which would not fit; its time without the copies).
        deep_profile = repeat_blocks(transformer_profile, depth["memory+swap"])
        deep = partition_layers(deep_profile, stages=stages, microbatches=MICROBATCHES, devices="v100-16gb-pcie3",
                                host_budget=HOST_BUDGET)
        cuts = [hi for _, hi in deep.bounds]
        unswapped = evaluate(deep_profile, cuts, microbatches=MICROBATCHES, devices="v100-16gb-pcie3", swap=False)
        times = {True: deep.predicted_step_time_s, False: unswapped.predicted_step_time_s}
        results["depth"][stages] = depth | {"host_bytes_per_stage": [s.host_bytes for s in deep.stages],
                                            "step_s": times}
        depth_rows.append(f"| {stages} | {depth['memory']} | {depth['parameters']} | {depth['uniform']} | "
                          f"**{depth['memory'] / depth['uniform']:.2f}x** | "
                          f"{depth['memory'] / depth['parameters']:.2f}x | {depth['memory+swap']} | "
                          f"{depth['uniform+swap']} | **{depth['memory+swap'] / depth['uniform']:.2f}x** | "
                          f"{times[True] / times[False]:.2f} | {max(s.host_bytes for s in deep.stages) / GiB:.0f} | "
                          f"{depth['memory+swap@worst']} ({depth['memory+swap@worst'] / depth['uniform']:.2f}x) | "
                          f"{depth['memory+recompute']} ({depth['memory+recompute'] / depth['uniform']:.2f}x) | "
                          f"{depth['memory+both']} (**{depth['memory+both'] / depth['uniform']:.2f}x**) |")
        logging.info("deepest at K=%d: %s", stages, results["depth"][stages])

    # The search on 1,000 layers (the Transformer's block repeated to 1,000 layers).
    per_block = sum(1 for layer in transformer_profile.layers if layer.name.startswith("block0_"))
    big = repeat_blocks(transformer_profile, (1000 - (len(transformer_profile.layers) - 48 * per_block)) // per_block)
    scale_rows = ["| layers | K | search time (s) | with recompute allowed (s) | profiling runs: lms-tf | "
                  "profiling runs: mCAP (one per layer) |", "|---|---|---|---|---|---|"]
    for stages in (2, 4, 8, 16):
        t = time.perf_counter()
        partition_layers(big, stages=stages, microbatches=MICROBATCHES, devices="v100-16gb-pcie3")
        elapsed = time.perf_counter() - t
        t = time.perf_counter()
        # no cut fits these 1,000 layers on V100s as they are: the exact recompute search runs
        partition_layers(big, stages=stages, microbatches=MICROBATCHES, devices="v100-16gb-pcie3", swap=False,
                         recompute=True)
        recomputing = time.perf_counter() - t
        results["scale"][stages] = {"search_s": elapsed, "recompute_search_s": recomputing}
        scale_rows.append(f"| {len(big.layers)} | {stages} | {elapsed:.2f} | {recomputing:.2f} | "
                          f"0 (one trace, never run) | {len(big.layers)} |")

    text = "\n".join([
        f"Largest stage's predicted peak over the ideal (one copy of the whole step / K): 1F1B, {MICROBATCHES} "
        "micro-batches, Adam. On mixed devices, the fullest stage's share of its device in brackets (the memory "
        "rule balances how full each device is). Every rule's cut is judged by the same per-layer memory model.", "",
        *rows, "",
        "The per-layer memory model on the whole step (one stage, one micro-batch: weights, their gradients and "
        "Adam's slots, everything kept, the largest working set) against lms-tf's simulator replaying the plain step "
        "op by op (its peak of the step's tensors, gradients included, plus the resident weights and slots, which it "
        "keeps outside that peak). The simulator was checked against the real CPU allocator on other models "
        "([planner benchmark](planner.md)); these two are both predictions:", "", *check_rows, "",
        f"Deepest Transformer encoder (seq 512, dim 1024, 16 heads, micro-batch 2, Adam) whose every stage fits a "
        f"16 GB V100, 1F1B, {MICROBATCHES} micro-batches, per rule. Deeper models are the traced block's profile "
        f"repeated; on the traced 48-block model the repeated profile's 4-stage cut peaks at "
        f"{repeated_48.max_stage_peak_bytes / GiB:.3f} GiB against {traced_48.max_stage_peak_bytes / GiB:.3f} GiB "
        "traced. With swap, a stage that does not fit swaps just the activations over its device (at least 2 layers' "
        "kept activations stay), counted in the cut; the last column is the deepest swapping cut's predicted step "
        f"time over the same cut's without the copies. Host memory is capped at {HOST_BUDGET} per stage process, "
        "not at a particular server's: the host memory column says what the first stage needs. "
        + _share_reading(worst, read_low)
        + "With recompute, a stage that does not fit may instead keep only what it receives per "
        "micro-batch in flight and run its forward pass again (one more forward pass of time); with both, each "
        "such stage takes whichever fits in less time.", "", *depth_rows, "",
        "What swapping lets the whole step reach (one stage, one micro-batch) by the per-layer model (weights, "
        "gradients and slots, the largest working set, 2 layers' kept activations) against lms-tf's own budget "
        "planner on the same traced step, swapping only (the least budget it fits, from the error a 1 KiB budget "
        "raises, plus the resident variables):", "", *swap_rows, "",
        "The search on 1,000 layers (bisection on the limit, an exact sweep per try; with recompute allowed, when "
        "no cut fits as it is, the same bisection with each stage at its lowest of keeping, swapping and "
        "recomputing), and the profiling runs each approach needs:", "", *scale_rows])
    OUT.mkdir(exist_ok=True)
    (OUT / "partition.md").write_text(text + "\n", encoding="utf-8")
    (OUT / "partition.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    publish("partition", text, page="partition")


def _share_reading(worst: float, read_low: list[float]) -> str:
    """What the table's "devices at a share" column means, from how the per-layer model read."""
    if worst < 1:
        return (f"The per-layer model's least peak reads as low as {worst:.2f}x lms-tf's planner's (next table), "
                "so the column at that share takes every device as only that share of its memory. ")
    if not read_low:
        return "The planner found no least to check the per-layer model against: the column at 100% repeats it. "
    return (f"The per-layer model's least peak reads {min(read_low):.2f}x to {max(read_low):.2f}x lms-tf's planner's "
            "(next table), never below it, so its cuts are already conservative: the column at 100% repeats the "
            "swapping depths. ")


if __name__ == "__main__":
    main()
