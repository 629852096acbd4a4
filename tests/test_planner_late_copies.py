"""Copies that hold their bytes at a peak they take no part in: a swap-in that arrived early, a copy
out still running.

A swap-in timed to hide its copy starts early enough for its readers, and can arrive while an op
before them allocates the most; the planner starts it later (``Choices.leads``,
:meth:`BudgetSearch.delay_a_swap_in`). A swapped tensor whose readers are done stays on the device
until its copy to the host ends, and the forward pass runs on beside it; the planner makes the op at
the peak wait for that copy (``swap_out_before``, :meth:`BudgetSearch.wait_for_a_copy_out`).
Hand-built steps with known answers. The rewrite of both (a swap-in's trigger, a forward op waiting
for a copy out) is the one every plan uses (tests/test_frontends_*.py).
"""

import pytest

from lms_tf.core.ir import make_ir
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner.fit_check import FitCheck
from lms_tf.planner.search import BudgetSearch
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import Choices, Tools, copies_out_at_peak, idle_swap_ins
from lms_tf.simulate import simulate
from lms_tf.simulate.allocator import chunk_peak_moment, replay_allocations, tensorflow_gpu_allocator

MiB = 2**20
V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
ACT, WIDE = (16, 128, 128, 64), (16, 256, 128, 64)   # 64 MiB and 128 MiB of float32
KERNEL = (7, 7, 64, 64)   # 7 ms a convolution on the V100 preset: a 64 MiB copy (6 ms) fits beside it


def _early_swap_in_ir():
    """``a = relu(x)`` is read by a long convolution (its copy out ends meanwhile) and again at the
    end of the backward pass, after a 128 MiB temporary (``t``) that is freed before that reader
    runs; the input gradient before ``t`` is long enough to hide ``a``'s copy back."""
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", ACT)]),
        dict(name="w", type="Const", outputs=[("w:0", KERNEL)]),
        dict(name="sizes", type="Const", outputs=[("sizes:0", (4,), "int32")]),
        dict(name="a", type="Relu", inputs=["x:0"], outputs=[("a:0", ACT)]),
        dict(name="c", type="Conv2D", inputs=["a:0", "w:0"], outputs=[("c:0", ACT)]),
        dict(name="loss", type="Sum", inputs=["c:0"], outputs=[("loss:0", (1,))]),
        dict(name="gr", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gr:0", ACT)]),
        dict(name="gc", type="Conv2DBackpropInput", phase="backward", inputs=["sizes:0", "w:0", "gr:0"],
             outputs=[("gc:0", ACT)]),
        dict(name="t", type="Tile", phase="backward", inputs=["gc:0"], outputs=[("t:0", WIDE)]),
        dict(name="s", type="Sum", phase="backward", inputs=["t:0"], outputs=[("s:0", (1,))]),
        dict(name="gs", type="Mul", phase="backward", inputs=["gc:0", "s:0"], outputs=[("gs:0", ACT)]),
        dict(name="ga", type="Mul", phase="backward", inputs=["gs:0", "a:0"], outputs=[("ga:0", ACT)]),
    ], function_inputs=["x"])


def _copy_out_ir():
    """``a = relu(x)`` is read by ``b`` and by the end of the backward pass; after ``b`` the forward
    pass makes a 128 MiB temporary while ``a``'s copy to the host (64 MiB over PCIe, 6 ms) is still
    running."""
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", ACT)]),
        dict(name="a", type="Relu", inputs=["x:0"], outputs=[("a:0", ACT)]),
        dict(name="b", type="Square", inputs=["a:0"], outputs=[("b:0", ACT)]),
        dict(name="t", type="Tile", inputs=["b:0"], outputs=[("t:0", WIDE)]),
        dict(name="loss", type="Sum", inputs=["t:0"], outputs=[("loss:0", (1,))]),
        dict(name="gr", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gr:0", ACT)]),
        dict(name="gb", type="Mul", phase="backward", inputs=["gr:0", "b:0"], outputs=[("gb:0", ACT)]),
        dict(name="g2", type="Mul", phase="backward", inputs=["gb:0", "gb:0"], outputs=[("g2:0", ACT)]),
        dict(name="ga", type="Mul", phase="backward", inputs=["g2:0", "a:0"], outputs=[("ga:0", ACT)]),
    ], function_inputs=["x"])


def _search(ir, budget):
    search = BudgetSearch(PlanningStep.build(ir, Policies(host="/CPU:1", budget=budget, recompute=False),
                                             device="/device:GPU:0", cost=V100))
    search.check.budget_bytes = budget
    return search


def _swapping_a(ir):
    """The search for 200 MiB, the choices that swap ``a`` alone, their plan and its replay."""
    search, choices = _search(ir, 200 * MiB), Choices(swap=frozenset({"a:0"}))
    plan = search.build(choices)
    return search, choices, plan, search.check.simulate(plan)


def test_a_swap_in_that_arrives_during_a_peak_before_its_readers_is_started_later():
    search, choices, early, sim = _swapping_a(_early_swap_in_ir())
    # Timed to hide its copy, the swap-in starts with the temporary and waits beside it.
    assert sim.peak_op in ("t", "s") and dict(sim.live_at_peak)["swap_in/a:0/0"] == 64 * MiB
    assert idle_swap_ins(search.step, sim, early) == [(64 * MiB, "a:0")]
    moved, late, late_sim = search.delay_a_swap_in(sim, choices)
    assert moved.leads == {"a:0": 0.5} or moved.leads == {"a:0": 0.0}
    # Structure: the copy is triggered after the temporary's op; executed order: it starts after
    # the temporary is gone and ends before its reader.
    trigger = late.swapped[0].swap_ins[0].trigger
    assert search.step.ir.op(trigger).index > search.step.ir.op("t").index
    spans = late_sim.op_intervals
    assert spans["swap_in/a:0/0"][0] >= spans["s"][1] and spans["swap_in/a:0/0"][1] <= spans["ga"][0]
    assert late_sim.peak_bytes <= sim.peak_bytes - 64 * MiB
    # The plan's choices are remembered for the refinements that build on it.
    assert search.choices_of(late, {}, Tools()).leads == moved.leads
    # Already as late as it can be: nothing to delay.
    assert search.delay_a_swap_in(late_sim, moved.replace(leads={"a:0": 0.0})) is None


def test_the_search_starts_an_early_swap_in_later_when_nothing_else_lowers_the_peak():
    budget = 200 * MiB
    search = _search(_early_swap_in_ir(), budget)
    start = search.build(Choices(swap=frozenset({"a:0"})))
    plan, sim = search.add_swaps(budget, {}, Tools(late_copies=True), start=(start, search.check.simulate(start)))
    assert sim.held_bytes <= budget
    assert search.step.ir.op(plan.swapped[0].swap_ins[0].trigger).index > search.step.ir.op("t").index
    # Only passes with late copies move copies so (in the first passes they led searches astray).
    _, without = search.add_swaps(budget, {}, Tools(), start=(start, search.check.simulate(start)))
    assert without.held_bytes > budget


def test_late_swap_ins_have_nothing_to_delay():
    search = _search(_early_swap_in_ir(), 200 * MiB)
    choices = Choices(swap=frozenset({"a:0"}), tools=Tools(late_swap_ins=True))
    plan = search.build(choices)
    assert search.delay_a_swap_in(search.check.simulate(plan), choices) is None


def test_a_forward_op_at_the_peak_waits_for_a_copy_out_that_holds_its_bytes():
    search, choices, plan, sim = _swapping_a(_copy_out_ir())
    # a's readers are done, but its copy out is not: it is on the device beside t.
    assert sim.peak_op in ("t", "loss") and dict(sim.live_at_peak)["a:0"] == 64 * MiB
    # The op at the peak (the loss, as it starts), and the first to start once b read a (t).
    ((nbytes, tensor, waiters),) = copies_out_at_peak(search.step, sim, plan)
    assert (nbytes, tensor) == (64 * MiB, "a:0") and waiters[-1] == "t"
    moved, waiting, waiting_sim = search.wait_for_a_copy_out(sim, choices)
    # Structure: the plan's decision names the op that waits; behaviour: it starts after the copy.
    assert moved.copy_out_waits == {"a:0": "t"} and waiting.swapped[0].swap_out_before == "t"
    assert "t waits for the copy out" in waiting.swapped[0].reason
    spans = waiting_sim.op_intervals
    assert spans["t"][0] >= spans["swap_out/a:0"][1]
    assert waiting_sim.peak_bytes <= sim.peak_bytes - 64 * MiB
    assert "a:0" not in dict(waiting_sim.live_at_peak)
    # It waits already: nothing more to gain.
    assert search.wait_for_a_copy_out(waiting_sim, moved) is None


def test_the_search_makes_the_forward_pass_wait_for_the_copy_out_at_the_peak():
    budget = 200 * MiB
    search = _search(_copy_out_ir(), budget)
    start = search.build(Choices(swap=frozenset({"a:0"})))
    plan, sim = search.add_swaps(budget, {}, Tools(late_copies=True), start=(start, search.check.simulate(start)))
    assert sim.held_bytes <= budget and plan.swapped[0].swap_out_before == "t"


def test_chunk_peak_moment_names_when_whole_chunks_peak():
    """A 3 MiB buffer freed before a small one that stays leaves a 3 MiB hole; 2 MiB are then served
    from it whole (3 < 2 x 2): the chunks peak when a 1 MiB buffer joins them (4 MiB held for 3
    asked), not when the 3 MiB buffer was in use (3 MiB held)."""
    log = [("alloc", "big", 3 * MiB), ("alloc", "pin", 1024), ("free", "big", 0), ("alloc", "mid", 2 * MiB),
           ("alloc", "small", MiB), ("free", "mid", 0), ("free", "small", 0), ("free", "pin", 0)]
    model = tensorflow_gpu_allocator(1 << 30)
    held, key, live = chunk_peak_moment(log, model)
    assert held == replay_allocations(log, tensorflow_gpu_allocator(1 << 30))
    assert held == 4 * MiB + 1024 and key == "small"
    assert [k for k, _ in live] == ["mid", "small", "pin"] and dict(live)["mid"] == 2 * MiB


def test_a_plan_that_fails_in_chunks_is_described_at_its_chunks_peak():
    """The fit check describes a plan whose chunks exceed the budget at the moment they peak, so
    the search's moves aim there (the buffers then, by the bytes each asked for)."""
    search = _search(_copy_out_ir(), 200 * MiB)
    plan = search.build(Choices(swap=frozenset({"a:0"})))
    check = FitCheck(search.step)
    check.budget_bytes = simulate(search.step.ir, plan, cost=V100).peak_bytes  # the tensors just fit
    sim = check.simulate(plan)
    if sim.held_bytes <= check.budget_bytes:
        pytest.fail("the plan's whole chunks were expected to exceed its tensors' peak here")
    assert sim.peak_op in sim.op_intervals and sim.peak_time_s == sim.op_intervals[sim.peak_op][0]
    assert sum(nbytes for _, nbytes in sim.live_at_peak) <= sim.held_bytes


@pytest.mark.timeout(600)
def test_vgg16_with_its_weights_on_the_host_plans_at_a_quarter_of_its_plain_step():
    """The benchmark's VGG16 224² b16 (docs/benchmarks/weights.md), weights on the host and cuDNN's
    workspace capped at 32 MiB, on the NVLink V100 preset: planned for a quarter of the plain step
    (its simulated peak plus every variable, less what stays resident) it fits, as TensorFlow's
    allocator would hold it, in the tie orders the planner checked and in others it did not."""
    import dataclasses

    from lms_tf.cli import build_parser
    from lms_tf.cli.workload import trace_unbatched
    from lms_tf.planner import make_budget_plan
    from lms_tf.planner.weights import plan_weights
    from lms_tf.simulate import resident_bytes
    from lms_tf.tf.trace import build_ir

    _, _, graph, _, _ = trace_unbatched(build_parser().parse_args(["max-batch", "--model", "VGG16",
                                                                   "--input-shape", "224"]))
    ir = build_ir(graph, batch_size=16)
    spec = dataclasses.replace(get_device_spec("v100-32gb-nvlink2"), cudnn_workspace_limit_bytes=32 * MiB)
    cost = CostModel(spec)
    policies = Policies(host="/CPU:1", recompute="auto", weights="host")
    resident = resident_bytes(ir, {w.variable for w in plan_weights(ir, policies)})
    quarter = (simulate(ir, cost=cost).peak_bytes + resident_bytes(ir)) // 4 - resident
    plan = make_budget_plan(ir, policies.replace(budget=quarter), device="/device:GPU:0", cost=cost)
    assert plan.predictions.feasible and plan.predictions.planned_allocator_peak_bytes <= quarter
    assert plan.sliced and plan.offloaded_weights
    for seed in (None, 100, 101, 102, 103):
        replayed = simulate(ir, plan, cost=cost, tie_seed=seed, allocator=tensorflow_gpu_allocator(spec.memory_bytes))
        assert replayed.allocator_peak_bytes <= quarter, (seed, replayed.allocator_peak_bytes, quarter)


#: Plans the weights benchmark's VGG16 case over PCIe, in the benchmark's environment.
_PCIE_SCRIPT = """
import dataclasses, json, sys
sys.path.insert(0, {root!r})
from lms_tf.cli import build_parser
from lms_tf.cli.workload import trace_unbatched
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.planner.weights import plan_weights
from lms_tf.simulate import resident_bytes, simulate, tensorflow_gpu_allocator
from lms_tf.tf.trace import build_ir

_, _, graph, _, _ = trace_unbatched(build_parser().parse_args(["max-batch", "--model", "VGG16", "--input-shape", "224"]))
ir = build_ir(graph, batch_size=16)
spec = dataclasses.replace(get_device_spec("v100-16gb-pcie3"), cudnn_workspace_limit_bytes=32 << 20)
cost = CostModel(spec)
policies = Policies(host="/CPU:1", recompute="auto", weights="host")
resident = resident_bytes(ir, {{w.variable for w in plan_weights(ir, policies)}})
quarter = (simulate(ir, cost=cost).peak_bytes + resident_bytes(ir)) // 4 - resident
plan = make_budget_plan(ir, policies.replace(budget=quarter), device="/device:GPU:0", cost=cost)
replays = [simulate(ir, plan, cost=cost, tie_seed=seed, allocator=tensorflow_gpu_allocator(spec.memory_bytes))
           .allocator_peak_bytes for seed in (None, 100, 101, 102, 103)]
print(json.dumps(dict(quarter=quarter, chunks=plan.predictions.planned_allocator_peak_bytes, replays=replays,
                      in_turn=[[w.variable, gate, op] for w in plan.offloaded_weights
                               for gate, op in w.clone_fetches_after])))
"""


@pytest.mark.timeout(600)
def test_vgg16_over_pcie_fetches_the_recomputed_classifiers_weights_in_turn():
    """The weights benchmark's VGG16 224² b16 at a quarter of its plain step on the 16 GB PCIe V100
    (weights on the host, cuDNN's workspace capped at 32 MiB), traced as the benchmark traces it
    (a subprocess without the suite's ``TF_DETERMINISTIC_OPS``, whose deterministic cross-entropy
    changes the loss's ops and with them this plan). The plan recomputes the classifier at the
    backward pass's start; its clones' kernels (``fc1``'s 392 MiB, ``fc2``'s 64 MiB) were fetched
    from the region's one gate, back to back, so ``fc2``'s arrived while ``fc1``'s was held for its
    clone, and the least figure was 486.5 MiB against a 476.5 MiB quarter. Now ``fc2``'s kernel is
    fetched after ``fc1``'s clone (``clone_fetches_after``), and the plan fits, as TensorFlow's
    allocator would hold it, in the tie orders the planner checked and in others."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_DETERMINISTIC_OPS", "TF_ENABLE_ONEDNN_OPTS")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    out = subprocess.run([sys.executable, "-c", _PCIE_SCRIPT.format(root=root)], capture_output=True, text=True,
                         timeout=580, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["chunks"] <= result["quarter"], result
    assert all(peak <= result["quarter"] for peak in result["replays"]), result
    fc2_after = [op for variable, _, op in result["in_turn"] if variable.startswith("vgg16_1/fc2_1/")]
    assert fc2_after == ["vgg16_1/fc1_1/Relu"], result["in_turn"]
