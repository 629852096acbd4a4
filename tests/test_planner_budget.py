"""Budget planner, cost model and simulator (issue "Planner").

Hand-built graphs with known answers, the simulator against TensorFlow's real CPU allocator,
planned steps training to the plain step's numbers, budget errors, and the CLI's JSON and PNG.
"""

import functools
import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import lms_tf
from lms_tf.core.errors import InfeasibleBudgetError, PlanCycleError
from lms_tf.core.ir import make_ir
from lms_tf.core.plan import Decision, Plan, SwapIn, TensorDecision
from lms_tf.core.policy import Policies, parse_budget
from lms_tf.cost import PRESETS, CostModel, get_device_spec, op_cost
from lms_tf.planner import make_budget_plan
from lms_tf.simulate import simulate, tensorflow_gpu_allocator
from lms_tf.tf.trace import build_ir
from tests import zoo
from tests.allocator_runs import run_allocator_worker
from tests.helpers import assert_same_numbers, custom_loop, fit_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
MiB = 2**20


def test_presets_cover_the_named_devices_with_sources():
    for name in ("v100-16gb-pcie3", "v100-32gb-nvlink2", "a100-40gb-pcie4", "a100-80gb-pcie4", "h100-80gb-pcie5",
                 "h200-141gb-pcie5", "gh200-96gb-c2c"):
        spec = PRESETS[name]
        assert spec.source and spec.memory_bytes > 15 * 2**30
    assert PRESETS["v100-32gb-nvlink2"].host_to_device_bytes_per_s == 75e9
    assert PRESETS["gh200-96gb-c2c"].device_to_host_bytes_per_s == 450e9


def test_conv_and_matmul_flops_are_exact():
    @tf.function
    def f(x, w, a, b):
        return tf.nn.conv2d(x, w, 1, "SAME"), tf.matmul(a, b, transpose_b=True)

    ir = build_ir(f.get_concrete_function(tf.TensorSpec((2, 8, 8, 3)), tf.TensorSpec((3, 3, 3, 16)),
                                          tf.TensorSpec((32, 64)), tf.TensorSpec((48, 64))).graph)
    conv = next(op for op in ir.ops if op.type == "Conv2D")
    matmul = next(op for op in ir.ops if op.type == "MatMul")
    assert op_cost(ir, conv).flops == 2 * (2 * 8 * 8 * 16) * 3 * 3 * 3
    assert op_cost(ir, matmul).flops == pytest.approx(2 * 32 * 48 * 64)
    # roofline: max(flops / 14 TFLOP/s, bytes / 900 GB/s) + launch overhead; this small one is memory-bound
    moved = (32 * 64 + 48 * 64 + 32 * 48) * 4
    assert V100.op_time(ir, matmul) == pytest.approx(max(2 * 32 * 48 * 64 / 14e12, moved / 900e9) + 5e-6)
    assert V100.transfer_time(12 * 10**9, "host_to_device") == pytest.approx(1.0)


def _chain_ir():
    """x -> a -> b -> c (forward, 4 MiB each) -> loss; backward reads a, b, c in reverse."""
    mib4, scalar = (MiB,), (1,)  # float32: 4 MiB and 4 bytes
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", mib4)]),
        dict(name="a", type="Exp", inputs=["x:0"], outputs=[("a:0", mib4)]),
        dict(name="b", type="Exp", inputs=["a:0"], outputs=[("b:0", mib4)]),
        dict(name="c", type="Exp", inputs=["b:0"], outputs=[("c:0", mib4)]),
        dict(name="loss", type="Sum", inputs=["c:0"], outputs=[("loss:0", scalar)]),
        dict(name="g3", type="Mul", phase="backward", inputs=["loss:0", "c:0"], outputs=[("g3:0", mib4)]),
        dict(name="g2", type="Mul", phase="backward", inputs=["g3:0", "b:0"], outputs=[("g2:0", mib4)]),
        dict(name="g1", type="Mul", phase="backward", inputs=["g2:0", "a:0"], outputs=[("g1:0", mib4)]),
    ], function_inputs=["x"])


def test_simulator_liveness_on_a_hand_built_chain():
    ir = _chain_ir()
    sim = simulate(ir, cost=V100)
    # a, b, c and the loss alive at the end of the forward pass; the Mul gradients write in place
    # into c's, then g3's buffer (nobody else reads them), so the backward pass adds nothing
    assert sim.peak_bytes == 3 * 4 * MiB + 4
    assert sim.peak_op == "loss"
    order = sorted(sim.op_intervals, key=lambda n: sim.op_intervals[n][0])
    assert order == ["x", "a", "b", "c", "loss", "g3", "g2", "g1"]


def test_simulator_swap_frees_the_tensor_between_copy_out_and_copy_in():
    ir = _chain_ir()
    swap_a = TensorDecision("a:0", "", (MiB,), 4 * MiB, Decision.SWAP, "swap", 6, (SwapIn("g2", ("g1",)),))
    plan = Plan((swap_a,), "/device:GPU:0", "/device:CPU:0", {}, {})
    import dataclasses
    fast_link = CostModel(dataclasses.replace(get_device_spec("gh200-96gb-c2c"), host_to_device_bytes_per_s=1e16,
                                              device_to_host_bytes_per_s=1e16))
    sim = simulate(ir, plan, cost=fast_link)
    assert sim.swap_out_bytes == sim.swap_in_bytes == 4 * MiB
    assert sim.peak_bytes == 2 * 4 * MiB + 4  # a is on the host from after b until g2 triggers its return
    slow = simulate(ir, plan, cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    assert slow.peak_bytes == 3 * 4 * MiB + 4  # over PCIe the copy out is still running when the loss is computed
    # the consumer waits for the copy back, so the step is longer than the plain one
    assert sim.step_time_s > simulate(ir, cost=fast_link).step_time_s


def test_simulator_recompute_clone_runs_after_its_gate():
    ir = _chain_ir()
    rc = TensorDecision("b:0", "", (MiB,), 4 * MiB, Decision.RECOMPUTE, "recompute", 4, (),
                        recompute_ops=("b",), gate="g3", consumers=("g2",))
    sim = simulate(ir, Plan((rc,), "d", "h", {}, {}), cost=V100)
    clone = sim.op_intervals["recompute/g3/b"]
    assert clone[0] >= sim.op_intervals["g3"][1] and clone[1] <= sim.op_intervals["g2"][0]
    # b's buffer is reused by c in the forward pass; the clone brings it back next to a and g3
    assert sim.peak_op == "recompute/g3/b" and "b:0" not in dict(sim.live_at_peak)


def _fan_out_ir(readers=8):
    """``a`` (4 MiB) read by ``readers`` sums and then ``q``, an elementwise op that can write
    into ``a``'s buffer once nobody else will read it."""
    mib4 = (MiB,)
    return make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", mib4)]),
                    dict(name="a", type="Exp", inputs=["x:0"], outputs=[("a:0", mib4)]),
                    *(dict(name=f"s{i}", type="Sum", inputs=["a:0"], outputs=[(f"s{i}:0", (1,))])
                      for i in range(readers)),
                    dict(name="q", type="Exp", inputs=["a:0"], outputs=[("q:0", mib4)])], function_inputs=["x"])


def test_tie_order_of_ops_made_ready_together_can_change_the_peak():
    """TensorFlow keeps up to 8 out-edges of a node in insertion order and more in a hash set of
    pointers, so the order in which the end of a node with 9 readers queues them changes from
    one process to the next. Here ``a`` (4 MiB) is read by eight sums and by ``q``, an
    elementwise op: run last, ``q`` writes into ``a``'s buffer in place; run earlier, it needs a
    buffer of its own. ``tie_seed`` draws that order; a node with 8 readers or fewer keeps
    graph order."""
    ir = _fan_out_ir()
    sums = [f"s{i}" for i in range(8)]
    assert simulate(ir, cost=V100).peak_bytes == 4 * MiB + 4  # graph order: q last, in place
    peaks = set()
    for seed in range(30):
        sim = simulate(ir, cost=V100, tie_seed=seed)
        order = sorted(sim.op_intervals, key=lambda n: sim.op_intervals[n][0])
        assert order[:2] == ["x", "a"] and sorted(order[2:]) == sorted(sums + ["q"])
        peaks.add((order[-1] == "q", sim.peak_bytes))
    assert peaks == {(True, 4 * MiB + 4), (False, 2 * 4 * MiB)}
    few_readers = _fan_out_ir(readers=1)
    assert {simulate(few_readers, cost=V100, tie_seed=seed).peak_bytes for seed in range(30)} == {4 * MiB + 4}


def test_planner_refuses_a_step_that_fits_only_in_graph_order():
    """The planner's fit check replays a step that fits in graph order in random tie orders too:
    the fan-out graph (9 readers) fits 4 MiB and one 256-byte chunk in graph order, but ``q``
    before the sums needs 8 MiB, so at that budget the check reports the larger figure, and
    describes the plan by the order it fails in (its peak, there, for the search's moves)."""
    from lms_tf.planner.fit_check import CHUNKS_COUNTED_ABOVE, TIE_ORDERS_CHECKED, FitCheck
    from lms_tf.planner.step import PlanningStep
    ir = _fan_out_ir()
    check = FitCheck(PlanningStep.build(ir, Policies(host="/CPU:1"), device="/device:CPU:0", cost=V100))
    plain = Plan((), "/device:CPU:0", "/device:CPU:1", {}, {})
    outcomes = {simulate(ir, cost=V100, tie_seed=seed).peak_bytes for seed in range(TIE_ORDERS_CHECKED)}
    assert 2 * 4 * MiB in outcomes  # the seeds it checks include an order that does not fit
    check.budget_bytes = 4 * MiB + 256  # graph order: a and one sum's 4 bytes (a 256-byte chunk)
    checked = check.simulate(plain)
    assert (checked.peak_bytes, checked.peak_op) == (2 * 4 * MiB, "q") and checked.held_bytes >= 2 * 4 * MiB
    assert simulate(ir, cost=V100).peak_bytes == 4 * MiB + 4   # graph order fits
    # Just above the budget in graph order: its chunks are counted (the 4 bytes take a 256-byte
    # chunk), its tie orders are not replayed (it does not fit already).
    check.budget_bytes = 4 * MiB
    assert check.simulate(plain).held_bytes == 4 * MiB + 256
    # Further above: its tensors are its measure, nothing is replayed.
    check.budget_bytes = int((4 * MiB + 4) / CHUNKS_COUNTED_ABOVE) - 1
    assert check.simulate(plain).held_bytes == 4 * MiB + 4


@pytest.mark.parametrize("text,expected", [("12GiB", 12 * 2**30), ("500MB", 500 * 10**6), ("25%", 0.25),
                                           (4096, 4096), ("auto", "auto")])
def test_budget_syntax(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["12 gigs", "0%", "150%", -5, "GiB", 0.5, True])
def test_malformed_budgets_are_refused(bad):
    with pytest.raises(lms_tf.LMSOptionError, match="budget must be"):
        lms_tf.LMSCallback(budget=bad)


def test_unknown_preset_is_refused_with_a_suggestion():
    with pytest.raises(lms_tf.LMSOptionError, match="Did you mean 'v100-16gb-pcie3'"):
        lms_tf.function(lambda x: x, device_spec="v100-16gb-pcie")


def _resnet_ir(batch=8):
    from lms_tf.tf.workloads import train_step
    model, _ = zoo.resnet_style()
    fn = tf.function(train_step(model))
    return build_ir(fn.get_concrete_function(tf.zeros((batch, 24, 24, 3)), tf.zeros((batch,), tf.int32)).graph)


def test_a_recompute_base_compute_floor_is_its_simulated_compute_time():
    """The planner skips recompute bases whose compute alone takes longer than the best plan
    found: that floor must be what the simulator computes for the base (one compute stream, so
    no plan on it can be faster), and below every plan built on it."""
    from lms_tf.planner.bases import compute_floor, recompute_bases
    from lms_tf.planner.fit_check import FitCheck
    from lms_tf.planner.step import PlanningStep
    from lms_tf.planner.timing import assemble

    ir = _resnet_ir()
    opts = Policies(host="/CPU:1", budget="40%", recompute="auto")
    step = PlanningStep.build(ir, opts, device="/device:CPU:0", cost=V100)
    bases, _ = recompute_bases(step)
    assert len(bases) >= 3
    for label, recomputed in bases:
        sim = FitCheck(step).simulate(assemble(step, set(), recomputed))
        assert compute_floor(step, recomputed) == pytest.approx(sim.compute_time_s, rel=1e-9), label
        assert sim.compute_time_s <= sim.step_time_s * (1 + 1e-12)
    plan = make_budget_plan(ir, opts, device="/device:CPU:0", cost=V100)
    assert min(compute_floor(step, r) for _, r in bases) <= plan.predictions.predicted_step_time_s * (1 + 1e-9)


def test_infeasible_budget_names_the_smallest_feasible_budget():
    ir = _resnet_ir()
    opts = Policies(host="/CPU:1", budget=1024, recompute="auto")
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget is about") as info:
        make_budget_plan(ir, opts, device="/device:CPU:0", cost=V100)
    assert 1024 < info.value.smallest_feasible_bytes < simulate(ir, cost=V100).peak_bytes
    # and that budget is indeed feasible: the plan named is held to its chunks, as a fitting plan is
    feasible = Policies(host="/CPU:1", budget=int(info.value.smallest_feasible_bytes * 1.002), recompute="auto")
    assert make_budget_plan(ir, feasible, device="/device:CPU:0", cost=V100).predictions.feasible


@pytest.mark.parametrize("preset", ["v100-16gb-pcie3", "gh200-96gb-c2c"])
def test_planned_peak_fits_and_the_plan_is_printable(preset):
    ir = _resnet_ir()
    opts = Policies(host="/CPU:1", budget="60%", recompute="auto")
    plan = make_budget_plan(ir, opts, device="/device:CPU:0", cost=CostModel(get_device_spec(preset)))
    assert plan.predictions.planned_peak_bytes <= plan.budget_bytes < plan.predictions.baseline_peak_bytes
    # ...also as TensorFlow's allocator would hold it (whole chunks), never less than the tensors
    assert plan.predictions.planned_peak_bytes <= plan.predictions.planned_allocator_peak_bytes <= plan.budget_bytes
    assert plan.swapped or plan.recomputed
    assert simulate(ir, plan, cost=CostModel(get_device_spec(preset))).peak_bytes == plan.predictions.planned_peak_bytes
    # A plan whose copies all hide behind compute (the GH200's link) takes the plain step's time: the
    # same op times, summed in another order of events, can differ in the last bit.
    assert plan.predictions.overhead >= 1.0 - 1e-12
    text = plan.summary()
    assert "budget" in text and "decision" in text
    data = json.loads(plan.to_json())
    predicted = data["predictions"]
    assert predicted["feasible"] and data["layers"] and predicted["planned_peak_bytes"] == plan.predictions.planned_peak_bytes
    assert predicted["planned_allocator_peak_bytes"] == plan.predictions.planned_allocator_peak_bytes
    # ...and in tie orders the planner did not check (its own are seeds 0-3)
    spec = get_device_spec(preset)
    for seed in range(100, 104):
        other = simulate(ir, plan, cost=CostModel(spec), tie_seed=seed,
                         allocator=tensorflow_gpu_allocator(spec.memory_bytes))
        assert other.peak_bytes <= other.allocator_peak_bytes <= plan.budget_bytes


@pytest.mark.timeout(600)
def test_a_plan_the_host_cannot_hold_is_not_chosen_while_another_fits_both():
    """ResNet-50 224² at batch 762 on a 16 GB V100 (lms-tf max-batch's answer): the fastest plan
    that fits the device swaps 51.7 GiB to the host; the planner chooses one that the host budget
    holds too (9.3 GiB, recomputing more), and names the host's limit only when no plan fits both."""
    from lms_tf.core.errors import HostBudgetError
    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step

    zoo.reseed(0)
    model = build_model("ResNet50", image_size=224, classes=1000)
    x, y = synthetic_batch(model, 762)
    ir = build_ir(tf.function(train_step(model)).get_concrete_function(x, y).graph)
    options = Policies(host="/CPU:1", budget="auto", recompute="auto", host_budget=20 * 2**30)
    plan = make_budget_plan(ir, options, device="/device:GPU:0", cost=V100)
    assert plan.predictions.feasible and plan.predictions.host_peak_bytes <= 20 * 2**30
    with pytest.raises(HostBudgetError, match="in host memory at its peak") as raised:
        make_budget_plan(ir, options.replace(host_budget=2**30), device="/device:GPU:0", cost=V100)
    assert raised.value.host_budget_bytes == 2**30 and raised.value.host_needed_bytes > 2**30


@pytest.mark.timeout(600)
def test_the_lowest_plan_is_refined_as_the_search_measured_it():
    """MobileNetV2 224² b32 on a 16 GB V100 does not fit 25% of its plain step. The search keeps
    the pass's plan that holds the least as the allocator would (its chunks counted), and then
    refines it with moves that compare plans by their tensors, far above the budget. Refined from
    its chunks' figure, a change was taken for a gain when the tensors' peak it led to was below
    that figure, and the refined plan replaced the lowest whatever its chunks: the least budget the
    error names rose from 630 to 707 MiB (the planner benchmark's 0.34 of the plain step read
    0.37). Refined from its tensors' figure and kept only if its chunks hold less, it is 630."""
    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step

    zoo.reseed(0)
    model = build_model("MobileNetV2", image_size=224, classes=1000)
    x, y = synthetic_batch(model, 32)
    ir = build_ir(tf.function(train_step(model)).get_concrete_function(x, y).graph)
    with pytest.raises(InfeasibleBudgetError) as raised:
        make_budget_plan(ir, Policies(host="/CPU:1", budget="25%", recompute="auto"), device="/device:CPU:0", cost=V100)
    assert raised.value.smallest_feasible_bytes <= 640 * 2**20, raised.value.smallest_feasible_bytes / 2**20


@pytest.mark.timeout(300)
def test_resnet50_plan_at_25_percent_counts_chunks_and_recomputes_a_swapped_checkpoint(caplog):
    """ResNet-50 224² b32 at 25% on a V100: some candidate plans' tensors fit the budget but
    TensorFlow's GPU allocator would hold more in whole chunks (a gradient in a larger freed
    chunk), so the planner refuses them. It tries recomputing the conv2-stage checkpoints the
    swap-and-recompute plan swapped (the clones of the next segment waited for their swap-ins)
    and keeps such a checkpoint recomputed, not swapped. The plan it returns fits as the
    allocator counts it after the process's history (Keras' initializer temporaries), in graph
    order and in tie orders the planner did not check, replayed by the simulator itself: the
    planner and the simulator hold a plan to the same pool."""
    import logging

    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step

    zoo.reseed(0)
    model = build_model("ResNet50", image_size=224, classes=1000)
    x, y = synthetic_batch(model, 32)
    ir = build_ir(tf.function(train_step(model)).get_concrete_function(x, y).graph)
    spec = get_device_spec("v100-16gb-pcie3")

    def options(budget):
        return Policies(host="/CPU:1", budget=budget, recompute="auto")

    with caplog.at_level(logging.DEBUG, logger="lms_tf"):
        plan = make_budget_plan(ir, options("25%"), device="/device:CPU:0", cost=V100)
    refused = [r.getMessage() for r in caplog.records if "TensorFlow's allocator would hold" in r.getMessage()]
    assert refused, "no candidate plan was refused for its allocator chunks"
    tried = [r.getMessage() for r in caplog.records if "instead of swapping it" in r.getMessage()]
    assert tried, "the planner did not try recomputing a swapped checkpoint"
    assert plan.predictions.feasible and plan.predictions.planned_peak_bytes < plan.predictions.planned_allocator_peak_bytes <= plan.budget_bytes
    deeper = [d for d in plan.recomputed if "checkpoint" in d.reason]
    assert deeper and all("/conv2_block" in d.tensor and "_out" in d.tensor for d in deeper), \
        [d.tensor for d in deeper]
    assert not {d.tensor for d in deeper} & {d.tensor for d in plan.swapped}
    for seed in (None, 100, 101, 102, 103):
        replayed = simulate(ir, plan, cost=CostModel(spec), tie_seed=seed,
                            allocator=tensorflow_gpu_allocator(spec.memory_bytes))
        assert replayed.allocator_peak_bytes <= plan.budget_bytes, (seed, replayed.allocator_peak_bytes)

    # When nothing fits, the lowest plan is lowered the same way (then swaps more): the first
    # pass's plan on a base of 17 segments (swap-ins timed to hide their copies) does not fit.
    from lms_tf.planner.refine import lower_the_lowest
    from lms_tf.planner.search import BudgetSearch
    from lms_tf.planner.step import PlanningStep
    from lms_tf.planner.timing import Tools

    search = BudgetSearch(PlanningStep.build(ir, options("25%"), device="/device:CPU:0", cost=CostModel(spec)))
    label, recomputed = next(b for b in search.bases if b[0] == "sqrt/17")
    search.check.budget_bytes = plan.budget_bytes
    lowest, lowest_sim = search.add_swaps(plan.budget_bytes, recomputed, Tools())
    assert lowest_sim.held_bytes > plan.budget_bytes
    lowered, lowered_sim, lowered_label = lower_the_lowest(search, plan.budget_bytes, lowest, lowest_sim,
                                                           label, label, Tools())
    assert lowered_sim.held_bytes < lowest_sim.held_bytes, (lowered_sim.held_bytes, lowest_sim.held_bytes)
    assert re.search(r"\d+ swapped checkpoints? recomputed", lowered_label), lowered_label
    assert any("checkpoint" in d.reason for d in lowered.recomputed)
    # On the H100 preset (faster compute, a faster link) the same trace plans at 25%.
    plan = make_budget_plan(ir, options("25%"), device="/device:CPU:0", cost=CostModel(get_device_spec("h100-80gb-pcie5")))
    assert plan.predictions.feasible and plan.predictions.planned_peak_bytes <= plan.predictions.planned_allocator_peak_bytes <= plan.budget_bytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("builder", [zoo.resnet_style])
def test_planned_steps_train_to_the_plain_numbers(builder, cpu_lms):
    plain = custom_loop(builder, tf.function)
    planned = custom_loop(builder, lambda f: lms_tf.function(f, budget="75%", device_spec="v100-16gb-pcie3",
                                                                **cpu_lms))
    assert planned[2].plan.budget_bytes is not None and planned[2].plan.predictions.feasible
    assert planned[2].plan.swapped or planned[2].plan.recomputed
    assert_same_numbers(plain, planned)


@pytest.mark.timeout(300)
def test_budget_plan_inserts_exactly_the_planned_ops(cpu_lms):
    """Structure: the rewritten step holds one swap-out per swapped tensor, at least the planned
    swap-ins (swapped checkpoints read by clones get their own), one clone per (op, gate) of the
    plan, and every clone waits for its gate."""
    from lms_tf import _compat
    from lms_tf.tf.rewrite.common import LMS_ATTR, count_lms_ops
    from lms_tf.tf.rewrite.recompute import CLONE_GATE_ATTR
    from lms_tf.tf.workloads import train_step

    model, (x, y) = zoo.resnet_style()
    fn = lms_tf.function(train_step(model), budget="75%", device_spec="v100-16gb-pcie3", **cpu_lms)
    graph = fn.get_concrete_function(tf.constant(x[:8]), tf.constant(y[:8])).graph
    plan = fn.plan
    assert plan.predictions.feasible and (plan.swapped or plan.recomputed)
    counts = count_lms_ops(graph)
    assert counts.get("swap_out", 0) == len(plan.swapped)
    assert counts.get("swap_in", 0) >= plan.num_swap_ins
    assert counts.get("recompute", 0) == plan.num_recompute_clones
    for op in graph.get_operations():
        if _compat.string_attr(op, LMS_ATTR) == "recompute":
            gate = _compat.string_attr(op, CLONE_GATE_ATTR)
            ancestors, stack = set(), list(op.inputs) + list(op.control_inputs)
            while stack:
                item = stack.pop()
                node = item if isinstance(item, tf.Operation) else item.op
                if node.name not in ancestors:
                    ancestors.add(node.name)
                    stack.extend(list(node.inputs) + list(node.control_inputs))
            assert gate in ancestors, f"clone {op.name} can run before its gate {gate}"


@pytest.mark.timeout(600)
def test_simulator_memory_rules_against_the_real_allocator():
    """Real CPU-allocator peak of a step vs the simulator replaying the order TF executed in that
    same profiled step (tests/allocator_worker.py; one inter-op thread). TF's CPU order changes
    from process to process, so the order is taken from the run and the memory rules are what
    is checked. Within one process every run executes the same order, yet the real peak of that
    one order moves from run to run: ResNet-50 (64², batch 4) spans up to 1.24x between its
    lowest and highest of five runs, the Transformer up to 1.05x. So the replay is held to the
    runs of its own order: at most 1.10x the highest (the memory rules count no buffer TF does not
    hold) and at least 0.75x the lowest (a few MiB the simulator does not model weigh at this size;
    in some processes' orders the replay reads 46.5 MiB against a real 55-59). Compared with the
    median run alone, one order whose runs read 48.9 MiB and more gave 1.106 on a fresh clone.
    Measured over three processes each on TF 2.20 and 2.21: the replay is 0.75-0.94 of the
    highest run, 0.89-1.10 of the lowest. Through the allocator model (whole chunks, after the
    modelled pool history) the replay is at least the tensors' sum and at most 1.20x the highest
    run (measured 0.80-1.00). The recompute plan must lower the real peak (its highest run below
    the plain step's lowest: measured 0.69-0.86) and the simulated one. The worker
    runs TF's default CPU kernels with oneDNN (TF's Eigen kernels, TF_ENABLE_ONEDNN_OPTS=0, hold
    im2col buffers the workspace rule does not model: 0.70 on ResNet-50)."""
    rows = run_allocator_worker("ResNet50,64,4", "TransformerEncoder,64,4", timeout=580)
    assert [r["model"] for r in rows] == ["ResNet50", "TransformerEncoder"]
    for row in rows:
        plain = row["plain"]
        assert plain["real_min"] <= plain["real"] <= plain["real_max"], row
        assert plain["replay"] <= 1.10 * plain["real_max"], (row["model"], plain["replay"] / plain["real_max"], row)
        assert plain["replay"] >= 0.75 * plain["real_min"], (row["model"], plain["replay"] / plain["real_min"], row)
        # whole chunks >= tensors
        assert plain["replay"] <= plain["replay_allocator"] <= 1.20 * plain["real_max"], (row["model"], row)
        assert row["sqrt"]["real_max"] < row["plain"]["real_min"], row
        assert row["sqrt"]["replay"] < row["plain"]["replay"] and row["sqrt"]["blind"] < row["plain"]["blind"], row
        for step in ("plain", "sqrt"):
            assert row[step]["accumulated_predicted"] == row[step]["accumulated_real"], (row["model"], step, row)


@pytest.mark.timeout(600)
def test_simulator_predicts_the_real_peak_of_resnet50_at_full_size():
    """Blind prediction (the simulator's own order, allocations through the allocator model after
    the pool's history) against the real CPU allocator, ResNet-50 224² batch 32, one inter-op
    thread, oneDNN on, each step alone in a fresh process. The steps are serialized
    (``serialize=True``): the compute ops run one at a time in the simulator's order, so the
    prediction is of this very run, and the test checks that TensorFlow kept that order and
    accumulated the gradient sum the offline Grappler run named.

    Three figures, each checked apart:

    - the tensors: the simulator's peak against the real run's requested bytes at its peak
      (measured 0.9998-0.9999, plain and recompute);
    - the allocator model's rules: the model fed the real run's own requests (its trace, after
      the modelled pool history) against that run's chunks at their peak (measured 1.000 on both
      steps: 1111.2 against 1111.2 MiB on the recompute step);
    - the two together, the blind prediction of the allocator's peak: plain 1.00; recompute
      ("sqrt") 1062 MiB predicted against 1105, 1111 or 1136 MiB real by process (0.935-0.96,
      CI read 0.935 on 2026-12-03). The tensors agree and the rules agree, so the gap is where
      the BFC allocator puts a 98 MiB recomputed activation: in a 193 MiB free chunk it does not
      split (under twice the request), or in a 122 MiB one. Which free chunk is there then
      depends on the order of the step's small allocations and frees, which moves from process
      to process and which the simulator does not replay allocation by allocation (1727 requests
      in its log, 1497 in the real trace). Hence 0.90 below, the measured spread with room, and
      1.05 above: the model never read high here. The plain step keeps 0.95 (always 1.00).

    In TensorFlow's free CPU order the peak moves far more from process to process
    (benchmarks/allocator_validation.py)."""
    for step in ("plain", "sqrt"):
        (row,) = run_allocator_worker("--order", "serialized", "--step", step, "ResNet50,224,32", timeout=280)
        measured = row[f"{step}_serialized"]
        assert measured["inversions"] == 0 and measured["executed_ops"] > 0.8 * measured["chained_ops"], measured
        assert measured["accumulated_predicted"] == measured["accumulated_real"] != [], measured
        tensors = measured["blind"] / measured["real_requested"]
        assert 0.99 <= tensors <= 1.01, (step, "tensors", tensors, measured)
        rules = measured["model_on_real_requests"] / measured["traced_allocator"]
        assert 0.99 <= rules <= 1.01, (step, "allocator rules", rules, measured)
        ratio = measured["blind_allocator"] / measured["real"]
        assert (0.95 if step == "plain" else 0.90) <= ratio <= 1.05, (step, ratio, measured)
        assert measured["blind_allocator"] >= measured["blind"]


@pytest.mark.timeout(300)
def test_cli_plan_json_and_png(tmp_path):
    png = tmp_path / "timeline.png"
    out = subprocess.run([sys.executable, "-m", "lms_tf.cli", "plan", "--model", "UNet", "--input-shape", "32x32",
                          "--batch", "4", "--budget", "85%", "--device", "h100-80gb-pcie5", "--json",
                          "--plot", str(png)], capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("baseline_peak_bytes", "planned_peak_bytes", "oracle_baseline_peak_bytes",
                "oracle_planned_peak_bytes", "budget_bytes", "swapped_bytes", "recomputed_bytes",
                "predicted_step_time_s", "predicted_overhead", "feasible"):
        assert key in result, key
    assert result["feasible"] and result["planned_peak_bytes"] <= result["budget_bytes"]
    assert result["oracle_planned_peak_bytes"] < result["oracle_baseline_peak_bytes"]
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    assert "[2/4]" in out.stderr  # progress


@pytest.mark.timeout(300)
def test_cli_max_batch_json_and_infeasible_exit_code():
    out = subprocess.run([sys.executable, "-m", "lms_tf.cli", "max-batch", "--model", "ResNet50", "--input-shape",
                          "32x32", "--classes", "10", "--device", "v100-16gb-pcie3", "--max", "4", "--json"],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["max_batch_plain"] == result["max_batch_lms"] == 4  # a 32x32 batch of 4 fits 16 GB easily
    bad = subprocess.run([sys.executable, "-m", "lms_tf.cli", "plan", "--model", "UNet", "--input-shape", "32x32",
                          "--batch", "2", "--budget", "1KiB", "--no-oracle", "--json"],
                         capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert bad.returncode == 3
    result = json.loads(bad.stdout.strip().splitlines()[-1])
    assert result["feasible"] is False and result["smallest_feasible_budget_bytes"] > 1024


FIT_FAMILIES = ["sequential_cnn", "resnet_style", "shared_multi_input_residual", "inception_style"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FIT_FAMILIES)
def test_callback_budget_through_fit(name, cpu_lms):
    """``LMSCallback(budget="80%")`` (90% for the inception net) in ``model.fit``: the plan fits its budget in the simulator,
    moves something, and the fit trains to the plain fit's numbers (Sequential CNN, two inputs
    through shared layers with a skip, residual blocks, parallel branches). The zoo's text, LSTM and
    subclassed models are too small for 80%: TensorFlow's allocator rounds their tensors to chunks that
    alone exceed it (the planner says so with the smallest feasible budget)."""
    plain = fit_steps(zoo.FIT_ZOO[name])
    # The inception net's floor is 0.89 of its plain peak: its concatenation and pool outputs stay,
    # in whole allocator chunks (the planner's error names them at 80%).
    fraction = 0.9 if name == "inception_style" else 0.8
    callback = lms_tf.LMSCallback(budget=f"{fraction:.0%}", device_spec="v100-16gb-pcie3", **cpu_lms)
    planned = fit_steps(zoo.FIT_ZOO[name], callbacks=[callback])
    plan = callback.plan
    assert plan.budget_bytes == int(fraction * plan.predictions.baseline_peak_bytes)
    assert plan.predictions.feasible and plan.predictions.planned_allocator_peak_bytes <= plan.budget_bytes
    assert plan.swapped or plan.recomputed
    assert_same_numbers(plain, planned)


@pytest.mark.timeout(300)
def test_recompute_auto_plans_for_the_devices_memory(cpu_lms):
    """``recompute="auto"`` alone means ``budget="auto"``: the device preset's memory less the
    step's resident variables, its inputs and the safety margin (10%, at least 512 MiB). On the V100 preset the
    zoo's residual net fits that, so nothing moves. On a device made 70% of its plain peak larger than
    the variables and the margin, the same options plan to fit that 70%, and still give the plain
    numbers."""
    import dataclasses

    from lms_tf.core.policy import SAFETY_MARGIN_FRACTION, SAFETY_MARGIN_MIN_BYTES

    plain = fit_steps(zoo.resnet_style)
    callback = lms_tf.LMSCallback(recompute="auto", device_spec="v100-16gb-pcie3", **cpu_lms)
    planned = fit_steps(zoo.resnet_style, callbacks=[callback])
    assert callback.options.budget == "auto" and callback.options.recompute == "auto"
    v100 = get_device_spec("v100-16gb-pcie3")
    margin = max(SAFETY_MARGIN_MIN_BYTES, int(SAFETY_MARGIN_FRACTION * v100.memory_bytes))
    resident = v100.memory_bytes - margin - callback.plan.budget_bytes
    weights = sum(w.numpy().nbytes for w in planned[2].weights)
    assert weights <= resident <= 4 * weights  # the variables (weights, momentum slots, counters) and the batch
    assert not callback.plan.swapped and not callback.plan.recomputed
    assert_same_numbers(plain, planned)

    baseline = callback.plan.predictions.baseline_peak_bytes
    small = dataclasses.replace(v100, name="small", memory_bytes=SAFETY_MARGIN_MIN_BYTES + resident + int(0.7 * baseline))
    callback = lms_tf.LMSCallback(recompute="auto", device_spec=small, **cpu_lms)
    tight = fit_steps(zoo.resnet_style, callbacks=[callback])
    assert callback.plan.budget_bytes == int(0.7 * baseline)
    assert callback.plan.predictions.feasible and callback.plan.predictions.planned_allocator_peak_bytes <= int(0.7 * baseline)
    assert callback.plan.swapped or callback.plan.recomputed
    assert_same_numbers(plain, tight)


def test_budget_auto_leaves_room_for_the_steps_inputs():
    """The step's batch is on the device for the whole step, like the variables, and not in the
    simulator's peak: ``budget="auto"`` takes it out of the device's memory too. (Found on the
    largest ResNet-50 batch: Grappler's virtual V100, running the plan at batch 786 in the
    simulator's order, held 14.55 GiB against the 14.11 the plan was made for; 0.44 GiB of that
    was the batch.) The largest plain batch leaves the same room."""
    import dataclasses

    from lms_tf.cli.max_batch import fits
    from lms_tf.core import make_ir
    from lms_tf.core.examples import chain_ir
    from lms_tf.core.policy import SAFETY_MARGIN_MIN_BYTES
    from lms_tf.simulate import input_bytes

    # chain_ir's backward products form one tree Grappler regroups, so no op of it may gate a
    # recompute (Candidates.recompute_gates): the same chain of ReLU gradients instead.
    ir = chain_ir(mib=64)
    ir = make_ir([dict(name=op.name, type={"Mul": "ReluGrad", "Exp": "Relu"}.get(op.type, op.type),
                       phase=op.phase.value, inputs=list(op.inputs),
                       outputs=[(t, ir.tensors[t].shape) for t in op.outputs]) for op in ir.ops],
                 function_inputs=["x"])
    assert input_bytes(ir) == 64 * 2**20  # x; a, b, c are the step's own
    peak = simulate(ir, cost=V100).peak_bytes
    small = CostModel(dataclasses.replace(V100.device, name="small",
                                          memory_bytes=SAFETY_MARGIN_MIN_BYTES + 64 * 2**20 + peak))
    plan = make_budget_plan(ir, Policies(host="/CPU:1", budget="auto", recompute="auto"), device="/device:GPU:0",
                            cost=small)
    assert plan.budget_bytes == peak
    # 1 MiB less: the batch no longer fits beside the plain step, and the plain probe says so too.
    smaller = CostModel(dataclasses.replace(small.device, memory_bytes=small.device.memory_bytes - 2**20))
    assert make_budget_plan(ir, Policies(host="/CPU:1", budget="auto", recompute="auto"), device="/device:GPU:0",
                            cost=smaller).budget_bytes == peak - 2**20
    assert fits(lambda batch: ir, 1, Policies(host="/CPU:1"), small, False, device="/device:GPU:0").fits
    assert not fits(lambda batch: ir, 1, Policies(host="/CPU:1"), smaller, False, device="/device:GPU:0").fits


def _unbatched_step_graph(model, x):
    """The model's train step (a mean-square loss on its output) traced with an unknown batch."""
    optimizer = tf.keras.optimizers.SGD(0.01)

    def step(inputs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(inputs, training=True), tf.float32)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    specs = tf.nest.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), x)
    return tf.function(step).get_concrete_function(specs).graph


SIZED_FAMILIES = ["sequential_cnn", "resnet_style", "inception_style", "subclassed", "text_embedding", "lstm",
                  "shared_multi_input_residual"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SIZED_FAMILIES)
def test_batch_sized_ir_equals_tensorflows_sizing(name):
    """max-batch sizes the step for each batch by arithmetic from three sizings (every size is
    linear in the batch): at batch sizes it was not fitted on, far outside them too, the IR equals
    the one TensorFlow's shape inference builds (Sequential, residual, branches, subclassed,
    embeddings, an LSTM's loop, two inputs through shared layers)."""
    from lms_tf.cli.max_batch import SAMPLE_BATCHES, sized_by_batch
    from lms_tf.core.ir import BatchSizedIR

    model, (x, _) = zoo.FIT_ZOO[name]()
    graph = _unbatched_step_graph(model, x)
    assert BatchSizedIR.fit({b: build_ir(graph, batch_size=b) for b in SAMPLE_BATCHES}) is not None
    ir_at, by_arithmetic = sized_by_batch(graph)
    assert by_arithmetic
    for batch in (1, 5, 97, 1000):
        assert ir_at(batch) == build_ir(graph, batch_size=batch), batch


def test_batch_sizing_falls_back_to_tensorflow_when_a_size_is_not_linear(caplog):
    """A step whose tensor is batch x batch (a Gram matrix of the samples) is not linear in the
    batch: the fit says so, and max-batch sizes each batch with TensorFlow instead, saying why."""
    from lms_tf.cli.max_batch import sized_by_batch

    gram = tf.function(lambda x: tf.reduce_sum(tf.matmul(x, x, transpose_b=True)))
    graph = gram.get_concrete_function(tf.TensorSpec((None, 4))).graph
    with caplog.at_level("INFO", logger="lms_tf"):
        ir_at, by_arithmetic = sized_by_batch(graph)
    assert "not linear in the batch" in caplog.text and not by_arithmetic
    assert ir_at(50).tensors["MatMul:0"].shape == (50, 50)
    assert ir_at(50) == build_ir(graph, batch_size=50)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["resnet_style", "inception_style"])
def test_remembered_replays_do_not_change_the_plan(name, monkeypatch):
    """The fit check answers a plan it met before from memory (half of the checks on ResNet-50).
    A replay is a pure function of the plan, so planning with and without that memory gives the
    same plan, to every decision and prediction; and the memory is used."""
    from lms_tf.planner import fit_check
    from lms_tf.planner.search import BudgetSearch
    from lms_tf.planner.step import PlanningStep

    model, (x, _) = zoo.FIT_ZOO[name]()
    ir = build_ir(_unbatched_step_graph(model, x), batch_size=64)
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    policies = Policies(host="/CPU:1", budget="45%", recompute="auto")

    def planned():
        step = PlanningStep.build(ir, policies, device="/device:GPU:0", cost=cost)
        search = BudgetSearch(step)
        plan, sim, label, _ = search.fit(int(0.45 * step.baseline.peak_bytes))
        return (plan.to_dict(), sim.peak_bytes, sim.held_bytes, sim.step_time_s, label), search.check

    remembered, check = planned()
    assert check.replays < check.simulations
    monkeypatch.setattr(fit_check, "REMEMBERED_REPLAYS", 0)
    monkeypatch.setattr(fit_check.FitCheck, "_held_in_chunks", lambda self, key, seed, sim: self.held_in_chunks(sim))
    fresh, check = planned()
    # Every check replayed (and its tie orders), but for the plans whose orderings conflict with a
    # gate (they cannot run, so nothing is replayed for them).
    assert check.replays >= check.simulations - check.cycles
    assert fresh == remembered


# A budget at which each search tries every kind of rewrite its comparison must cover (the fetches'
# waits for gradients only where the backward pass outruns the copies out).
@pytest.mark.parametrize("name, weights, fraction", [
    ("resnet_style", "device", 0.45), ("inception_style", "device", 0.45),
    ("shared_multi_input_residual", "device", 0.45), ("text_embedding", "device", 0.45),
    ("resnet_style", "host", 0.5), ("text_embedding", "host", 0.45)])
def test_lowering_from_the_plain_template_equals_lowering_from_scratch(name, weights, fraction, monkeypatch):
    """Lowering takes the ops a plan leaves alone from a per-IR template of the plain step (reads,
    writes, waits), and with weights on the host the update's ops from a template of the update
    there (the gradients each copies in, the host buffers it reads and writes). Every plan a
    budget search replays (swaps, recompute clones, orderings, waits for copies out, late
    swap-ins, weight fetches and their waits for gradients) lowers to the very events a lowering
    that rebuilds every op from the IR gives, and replays to the same peak, time and allocations."""
    from lms_tf.planner import fit_check
    from lms_tf.planner.search import BudgetSearch
    from lms_tf.planner.step import PlanningStep
    from lms_tf.simulate.lower import lower
    from lms_tf.simulate.replay import replay

    model, (x, _) = zoo.FIT_ZOO[name]()
    ir = build_ir(_unbatched_step_graph(model, x), batch_size=64)
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    step = PlanningStep.build(ir, Policies(host="/CPU:1", budget=fraction, recompute="auto", weights=weights),
                              device="/device:GPU:0", cost=cost)
    plans = []

    def recording(ir_, plan, **kwargs):
        plans.append(plan)
        return simulate(ir_, plan, **kwargs)

    monkeypatch.setattr(fit_check, "simulate", recording)
    BudgetSearch(step).fit(int(fraction * step.baseline.peak_bytes))
    monkeypatch.undo()
    kinds = {"swap": any(p.swapped for p in plans), "recompute": any(p.recomputed for p in plans),
             "ordering": any(p.orderings for p in plans)}
    if weights == "host":
        kinds = {"swap": kinds["swap"], "fetch": all(p.offloaded_weights for p in plans),
                 "wait for a gradient": any(f.after_gradients for p in plans for w in p.offloaded_weights
                                            for f in w.fetches)}
    assert all(kinds.values()), kinds  # the comparison covers every kind of rewrite

    def fields(lowered):
        return [(e.name, e.stream, e.duration, list(e.reads), list(e.writes), list(e.deps), e.forwarding, e.updates,
                 e.order, e.trigger, e.workspace, list(e.host_reads), list(e.host_writes)) for e in lowered.ops]

    for plan in [None] + plans:
        template = lower(ir, plan, cost, step.op_times)
        scratch = lower(ir, plan, cost, step.op_times, reuse_plain=False)
        assert fields(template) == fields(scratch)
        outcomes = []
        for built in (template, scratch):
            try:
                sim = replay(built, top=None, priority=None, log_allocations=True, allocator=None, tie_seed=None)
                outcomes.append((sim.peak_bytes, sim.step_time_s, sim.allocations))
            except PlanCycleError as err:  # an ordering the search tried and dropped
                outcomes.append(str(err))
        assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("jobs", [2, 3, 5])
def test_batches_tried_ahead_take_the_one_at_a_time_path(jobs):
    """Bisection (``guided=False``): trying batches ahead (``jobs``) never changes the answer, even where the verdict is not
    monotone in the batch (here 100-110 fit while 92-99 do not): every batch the one-at-a-time
    search tries is tried, the answer is its answer, in fewer rounds."""
    from lms_tf.cli.max_batch import largest_batch

    def verdict(batch):
        return batch <= 91 or 100 <= batch <= 110 or 300 <= batch <= 310

    def probe_all(batches, rounds):
        rounds.append(batches)
        return [(verdict(b), 1000 * b) for b in batches]

    for known_good, upper in ((0, 4096), (40, 4096), (0, 300), (0, 97)):
        one, many = [], []
        expected = largest_batch(None, None, None, True, upper, device="", known_good=known_good,
                                 probe_all=lambda b: probe_all(b, one), guided=False)
        got = largest_batch(None, None, None, True, upper, device="", known_good=known_good,
                            probe_all=lambda b: probe_all(b, many), jobs=jobs, guided=False)
        assert got == expected and got[1] == 1000 * got[0]
        assert {b for r in one for b in r} <= {b for r in many for b in r}
        assert max(map(len, many)) <= jobs and len(many) < len(one)


def _need_curves():
    """Memory a batch needs, as the max-batch search meets it: the plain peak (a constant part and
    a slope), and lms-tf's smallest feasible budget, proportional to the batch with a steeper
    slope just below the boundary (ResNet-50 224 on a V100: 19.27 MB a sample from batch 801
    up, 20.07 MB below, so a line through a far batch overshoots), and one whose constant part
    is negative (the line through zero then undershoots)."""
    budget = 15_000
    return budget, {
        "plain, weights + slope": lambda b: 900 + 80 * b,
        "lms, two regimes": lambda b: 19.27 * b if b >= 801 else 20.07 * b,
        "lms, large constant": lambda b: 9_000 + 7 * b,
        "lms, negative constant": lambda b: -3_000 + 25 * b,
    }


@pytest.mark.parametrize("curve", ["plain, weights + slope", "lms, two regimes", "lms, large constant",
                                   "lms, negative constant"])
@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_guided_search_finds_the_bisection_answer_in_fewer_tries(curve, jobs):
    """Steered by the memory each try reports, the search ends on the batch bisection ends on
    (memory growing with the batch: one boundary), in fewer tries and rounds, whatever the
    number of jobs; the answer fits and the batch after it was tried and does not."""
    from lms_tf.cli.max_batch import Probe, largest_batch

    budget, curves = _need_curves()
    need = curves[curve]
    plain = curve.startswith("plain")

    def probe(b):
        ok = need(b) <= budget
        return Probe(ok, int(need(b)), int(need(b)) if plain or not ok else None, budget)

    exact = max(b for b in range(1, 5000) if need(b) <= budget)
    answers, tried, rounds = {}, {}, {}
    for guided in (False, True):
        tried[guided], rounds[guided] = [], []

        def probe_all(batches, guided=guided):
            rounds[guided].append(batches)
            tried[guided].extend(batches)
            return [probe(b) for b in batches]

        answers[guided] = largest_batch(None, None, None, not plain, 4096, device="", known_good=0 if plain else 100,
                                        probe_all=probe_all, jobs=jobs if guided else 1, guided=guided)
    assert answers[True] == answers[False] == (exact, int(need(exact)))
    assert exact + 1 in tried[True] and max(map(len, rounds[True])) <= jobs
    one_at_a_time = []
    assert largest_batch(None, None, None, not plain, 4096, device="", known_good=0 if plain else 100,
                         probe_all=lambda bs: [one_at_a_time.append(b) or probe(b) for b in bs]) == answers[True]
    assert set(one_at_a_time) <= set(tried[True])  # the batches tried ahead are on its path or extra
    assert len(set(tried[True])) < len(tried[False]) and len(rounds[True]) < len(rounds[False])


def test_guided_search_on_a_verdict_that_is_not_monotone_ends_on_a_boundary():
    """Where batches that do not fit have larger ones that do, the answer is still a batch that
    fits whose next batch was tried and does not, the same with 1 and 2 jobs."""
    from lms_tf.cli.max_batch import Probe, largest_batch

    def verdict(batch):
        return batch <= 91 or 100 <= batch <= 110 or 300 <= batch <= 310

    def probe_all(batches):
        return [Probe(verdict(b), b, None if verdict(b) else 150 * b, 10_000) for b in batches]

    for known_good, upper in ((0, 4096), (40, 4096), (0, 300), (0, 97)):
        one = largest_batch(None, None, None, True, upper, device="", known_good=known_good, probe_all=probe_all)
        two = largest_batch(None, None, None, True, upper, device="", known_good=known_good, probe_all=probe_all,
                            jobs=2)
        assert one == two and verdict(one[0]) and (one[0] == upper or not verdict(one[0] + 1))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_name", ["UNet", "TransformerEncoder"])
def test_max_batch_guided_equals_bisection_on_real_models(model_name):
    """On two built-in workloads, on a device holding about 40 samples of each, the guided search
    (the CLI's) answers what bisection answers, plain and with lms-tf, in fewer tries (ResNet-50
    224 on a V100: ``test_cli_max_batch_resnet50_answer``)."""
    import dataclasses

    from lms_tf.cli.max_batch import largest_batch, sized_by_batch
    from lms_tf.core.policy import SAFETY_MARGIN_MIN_BYTES
    from lms_tf.simulate import resident_bytes
    from lms_tf.tf.workloads import build_model, step_specs, train_step

    model = build_model(model_name, image_size=64, classes=10)
    graph = tf.function(train_step(model)).get_concrete_function(*step_specs(model, None)).graph
    ir_for_batch, by_arithmetic = sized_by_batch(graph)
    assert by_arithmetic
    per_sample = (simulate(ir_for_batch(64), cost=V100).peak_bytes - simulate(ir_for_batch(32), cost=V100).peak_bytes) // 32
    memory = SAFETY_MARGIN_MIN_BYTES + resident_bytes(ir_for_batch(1)) + 40 * per_sample
    cost = CostModel(dataclasses.replace(V100.device, name="small", memory_bytes=memory))
    policies = Policies(host="/CPU:1", budget="auto", recompute="auto")
    answers, tries = {}, {}
    for guided in (False, True):
        plain_tries, lms_tries = [], []
        plain = largest_batch(ir_for_batch, policies, cost, False, 4096, device="/device:CPU:0", guided=guided,
                              progress=lambda b, ok: plain_tries.append(b))
        lms = largest_batch(ir_for_batch, policies, cost, True, 4096, device="/device:CPU:0", guided=guided,
                            known_good=plain[0], progress=lambda b, ok: lms_tries.append(b))
        answers[guided], tries[guided] = (plain, lms), (len(plain_tries), len(lms_tries))
    assert answers[True] == answers[False]
    (plain, _), (lms, _) = answers[True]
    assert 20 < plain < 64 and lms > plain
    # Plain peaks are lines in the batch: a few tries. The planner's floor is not always one (on this
    # U-Net it is 2.3 MB a sample near batch 82 and 5.5 between 83 and 88), so with lms-tf the guided
    # search can take a try or two more than bisection; it is the total that must be smaller.
    assert tries[True][0] < tries[False][0] and sum(tries[True]) < sum(tries[False])
    assert tries[True][1] <= tries[False][1] + 2


@pytest.mark.timeout(600)
def test_cli_max_batch_resnet50_answer():
    """The README's command on ResNet-50 224 (``v100-16gb-pcie3``): 177 plain, 762 with lms-tf
    (``docs/benchmarks/planner.md``). It was 754 until the search at a budget an error had named
    could miss the plan that error was named for, then 178 and 786 until the device's memory left
    room for the batch itself (0.43 GiB at 762), which Grappler's virtual V100 counts: it holds
    the serialized plan at 762 within that room."""
    out = subprocess.run([sys.executable, "-m", "lms_tf.cli", "max-batch", "--model", "resnet50", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=560)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["max_batch_plain"], result["max_batch_lms"]) == (177, 762)
    assert "fits 762, not 763" in out.stderr


@pytest.mark.timeout(300)
def test_largest_batch_bisects_and_lms_fits_a_larger_one():
    """The max-batch search on a device whose free memory holds about 40 samples of the zoo's residual
    net: the doubling overshoots and the bisection finds the boundary, checked independently (the
    answer fits, one more does not), and lms-tf's answer is larger than the plain one."""
    import dataclasses

    from lms_tf.cli.max_batch import fits, largest_batch
    from lms_tf.core.policy import SAFETY_MARGIN_MIN_BYTES
    from lms_tf.simulate import resident_bytes
    from lms_tf.tf.workloads import train_step

    model, (x, _) = zoo.resnet_style()
    graph = tf.function(train_step(model)).get_concrete_function(
        tf.TensorSpec((None, *x.shape[1:])), tf.TensorSpec((None,), tf.int32)).graph
    irs = {}

    def ir_for_batch(batch):
        if batch not in irs:
            irs[batch] = build_ir(graph, batch_size=batch)
        return irs[batch]

    v100 = CostModel(get_device_spec("v100-16gb-pcie3"))
    per_sample = (simulate(ir_for_batch(64), cost=v100).peak_bytes - simulate(ir_for_batch(32), cost=v100).peak_bytes) // 32
    memory = SAFETY_MARGIN_MIN_BYTES + resident_bytes(ir_for_batch(1)) + 40 * per_sample
    cost = CostModel(dataclasses.replace(v100.device, name="small", memory_bytes=memory))
    policies = Policies(host="/CPU:1", budget="auto", recompute="auto")
    answers = {}
    paths = {False: [], True: []}
    for with_lms in (False, True):
        best, _ = largest_batch(ir_for_batch, policies, cost, with_lms, 4096, device="/device:CPU:0",
                                progress=lambda batch, ok: paths[with_lms].append(batch))
        assert fits(ir_for_batch, best, policies, cost, with_lms, device="/device:CPU:0")[0]
        assert not fits(ir_for_batch, best + 1, policies, cost, with_lms, device="/device:CPU:0")[0]
        answers[with_lms] = best
    assert 20 < answers[False] < 64 and answers[False] & (answers[False] - 1)  # not a power of two: bisected
    assert answers[True] > answers[False]
    # The CLI starts the lms-tf search from the plain answer (it fits with lms-tf too), with fewer
    # tries. Its path differs, and the planner's verdict is not monotone in the batch here (84-88
    # and 94-103 fit, 89-93 do not, with or without swapping in twice): it ends on a boundary,
    # maybe another one.
    tried = []
    best, _ = largest_batch(ir_for_batch, policies, cost, True, 4096, device="/device:CPU:0",
                            known_good=answers[False], progress=lambda batch, ok: tried.append(batch))
    assert min(tried) > answers[False] and best > answers[False]
    assert fits(ir_for_batch, best, policies, cost, True, device="/device:CPU:0")[0]
    assert not fits(ir_for_batch, best + 1, policies, cost, True, device="/device:CPU:0")[0]
    # Two batches per round (the next, and the one after it if that fits), planned in two forked
    # processes (sizes by arithmetic: the forks never call TensorFlow), take the same path to the
    # same answers in fewer rounds.
    from lms_tf.cli.max_batch import SAMPLE_BATCHES, fits, probes
    from lms_tf.core.ir import BatchSizedIR

    sized = BatchSizedIR.fit({b: ir_for_batch(b) for b in SAMPLE_BATCHES})
    for with_lms in (False, True):
        rounds = []
        with probes(2, functools.partial(fits, sized.at, policies=policies, cost=cost, with_lms=with_lms,
                                         device="/device:CPU:0")) as probe_all:
            def counted(batches):
                rounds.append(batches)
                return probe_all(batches)
            best, _ = largest_batch(sized.at, policies, cost, with_lms, 4096, device="/device:CPU:0",
                                    probe_all=counted, jobs=2)
        assert best == answers[with_lms]
        assert max(map(len, rounds)) == 2 and len(rounds) < len(paths[with_lms])


@pytest.mark.timeout(300)
def test_the_smallest_feasible_budget_an_error_names_fits_when_asked_for():
    """VGG16 at 64² with its weights on the host, planned for an H100: the greedy search at the
    budget the error had named stopped above it (asked 207.6 MB, it named 208.9 MB), since it
    swaps only what covers the excess; the search aimed at nothing, which named the figure, is now
    its last resort."""
    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step

    zoo.reseed(0)
    model = build_model("VGG16", image_size=64, classes=100)
    x, y = synthetic_batch(model, 16)
    ir = build_ir(tf.function(train_step(model)).get_concrete_function(x, y).graph)
    h100 = CostModel(get_device_spec("h100-80gb-pcie5"))
    for weights in ("host", "device"):
        policies = Policies(host="/CPU:1", budget=1, recompute="auto", weights=weights)
        with pytest.raises(InfeasibleBudgetError) as info:
            make_budget_plan(ir, policies, device="/device:GPU:0", cost=h100)
        named = info.value.smallest_feasible_bytes
        plan = make_budget_plan(ir, policies.replace(budget=named), device="/device:GPU:0", cost=h100)
        assert plan.predictions.feasible and plan.predictions.planned_allocator_peak_bytes <= named, weights
