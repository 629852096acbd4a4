"""The budget planner times weight fetches against memory, not only against the link.

A fetch is triggered early enough to hide its copy behind compute. A large weight read late on a
device whose compute outruns its link is then fetched long before its layer, and the copy waits
idle on the device through whatever peak comes in between. Hand-built steps with known answers.
"""

import dataclasses

import pytest

from lms_tf.core.errors import InfeasibleBudgetError
from lms_tf.core.ir import make_ir
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.planner.fit_check import plan_key
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.weights import forward_gates, plan_weights, timed_fetches
from lms_tf.planner.timing import (Tools, assemble, delayed_fetches, gradients_on_device_at_peak, idle_fetches,
                                   timed_weights, waitable_gradient)
from lms_tf.simulate import simulate

MiB = 2**20
H100 = CostModel(get_device_spec("h100-80gb-pcie5"))
BATCH, UNITS, WIDE, OUT = 64, 1024, 262144, 8192


def _late_large_weight_ir():
    """``x @ w1 -> relu -> square -> (mean(neg(square)) + mean(square)) @ w2 -> sum``: ``square`` and
    ``neg`` are 64 MiB temporaries of the forward pass, alive together (``square`` is read again
    after ``neg``, so ``neg`` cannot take its buffer), ``w2`` a 32 MiB weight read last (forward, and
    by its input gradient)."""
    act, wide, weight1, weight2 = (BATCH, UNITS), (BATCH, WIDE), (UNITS, UNITS), (UNITS, OUT)
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", act)]),
        dict(name="w1", type="Placeholder", outputs=[("w1:0", (), "resource")]),
        dict(name="w2", type="Placeholder", outputs=[("w2:0", (), "resource")]),
        dict(name="rw1", type="ReadVariableOp", inputs=["w1:0"], outputs=[("rw1:0", weight1)]),
        dict(name="rw2", type="ReadVariableOp", inputs=["w2:0"], outputs=[("rw2:0", weight2)]),
        dict(name="m1", type="MatMul", inputs=["x:0", "rw1:0"], outputs=[("m1:0", act)]),
        dict(name="r1", type="Relu", inputs=["m1:0"], outputs=[("r1:0", act)]),
        dict(name="sq", type="Square", inputs=["r1:0"], outputs=[("sq:0", wide)]),
        dict(name="ng", type="Neg", inputs=["sq:0"], outputs=[("ng:0", wide)]),
        dict(name="mn", type="Mean", inputs=["ng:0"], outputs=[("mn:0", act)]),
        dict(name="ms", type="Mean", inputs=["sq:0"], outputs=[("ms:0", act)]),
        dict(name="c", type="AddV2", inputs=["mn:0", "ms:0"], outputs=[("c:0", act)]),
        dict(name="m2", type="MatMul", inputs=["c:0", "rw2:0"], outputs=[("m2:0", (BATCH, OUT))]),
        dict(name="loss", type="Sum", inputs=["m2:0"], outputs=[("loss:0", (1,))]),
        dict(name="gm2", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gm2:0", (BATCH, OUT))]),
        dict(name="gmn", type="MatMul", phase="backward", inputs=["gm2:0", "rw2:0"], outputs=[("gmn:0", act)]),
        dict(name="gw2", type="MatMul", phase="backward", inputs=["c:0", "gm2:0"], outputs=[("gw2:0", weight2)]),
        dict(name="gr1", type="Mul", phase="backward", inputs=["gmn:0", "r1:0"], outputs=[("gr1:0", act)]),
        dict(name="g1", type="ReluGrad", phase="backward", inputs=["gr1:0", "r1:0"], outputs=[("g1:0", act)]),
        dict(name="gw1", type="MatMul", phase="backward", inputs=["x:0", "g1:0"], outputs=[("gw1:0", weight1)]),
        dict(name="u2", type="ResourceApplyGradientDescent", phase="update", inputs=["w2:0", "gw2:0"], outputs=[]),
        dict(name="u1", type="ResourceApplyGradientDescent", phase="update", inputs=["w1:0", "gw1:0"], outputs=[]),
    ], function_inputs=["x"])


def _step(budget):
    return PlanningStep.build(_late_large_weight_ir(), Policies(host="/CPU:1", weights="host", budget=budget,
                                                               swapin_groupby=1),
                              device="/device:GPU:0", cost=H100)


def _w2(weights):
    return next(w for w in weights if w.variable == "w2:0")


def test_a_weight_fetched_to_hide_its_copy_waits_idle_through_the_forward_peak():
    """Timed to hide its copy, ``w2``'s forward fetch starts with the step (no op runs long enough
    before ``m2`` to hide a 32 MiB copy over PCIe on an H100): it is on the device, unread, at the
    forward peak, where both temporaries are alive."""
    step = _step(budget=1)
    weights = timed_weights(step)
    assert _w2(weights).fetches[0].trigger == ""
    sim = simulate(step.ir, assemble(step, set(), {}), cost=H100, top=None)
    live = dict(sim.live_at_peak)
    assert sim.peak_op in ("ng", "mn", "ms") and live["sq:0"] == live["ng:0"] == BATCH * WIDE * 4
    assert [(n, w.variable) for n, w in idle_fetches(step, sim, weights)] == [(UNITS * OUT * 4, "w2:0")]


def test_a_delayed_fetch_is_triggered_by_the_last_gate_before_its_window_and_lowers_the_peak():
    step = _step(budget=1)
    weights = timed_weights(step)
    late = delayed_fetches(step, weights, "w2:0", 0.0)
    assert [f.trigger for f in _w2(late).fetches][0] == "c"
    assert "sat idle at the peak" in _w2(late).reason
    assert late[[w.variable for w in weights].index("w1:0")] == next(w for w in weights if w.variable == "w1:0")
    early = simulate(step.ir, assemble(step, set(), {}), cost=H100)
    delayed_plan = assemble(step, set(), {}, weights=late)
    delayed = simulate(step.ir, delayed_plan, cost=H100)
    assert delayed.peak_bytes <= early.peak_bytes - UNITS * OUT * 4 + MiB
    assert delayed.step_time_s > early.step_time_s   # m2 now waits for part of the copy
    # The plan's weights are what a replay depends on: the planner's replay cache must tell them apart.
    assert plan_key(delayed_plan) != plan_key(assemble(step, set(), {}))


def test_the_budget_planner_delays_the_fetch_when_nothing_else_fits():
    """Nothing here can be swapped or recomputed (the temporaries have no backward reader): a
    budget under the early fetch's peak fits only with ``w2`` fetched later, and the planner finds it;
    a budget under the temporaries themselves names a floor at least that high."""
    step = _step(budget=1)
    early = simulate(step.ir, assemble(step, set(), {}), cost=H100).peak_bytes
    temporaries = 2 * BATCH * WIDE * 4
    budget = early - UNITS * OUT * 4 // 2
    plan = make_budget_plan(step.ir, step.policies.replace(budget=budget), device="/device:GPU:0", cost=H100)
    assert plan.predictions.feasible and plan.predictions.planned_peak_bytes <= budget
    assert _w2(plan.weights).fetches[0].trigger != ""
    assert not plan.swapped and not plan.recomputed
    with pytest.raises(InfeasibleBudgetError) as raised:
        make_budget_plan(step.ir, step.policies.replace(budget=temporaries // 2), device="/device:GPU:0", cost=H100)
    assert temporaries <= raised.value.smallest_feasible_bytes < early


def test_a_plan_that_fits_keeps_every_fetch_in_time_to_hide_its_copy():
    step = _step(budget=1)
    early = simulate(step.ir, assemble(step, set(), {}), cost=H100).peak_bytes
    plan = make_budget_plan(step.ir, step.policies.replace(budget=early + MiB), device="/device:GPU:0", cost=H100)
    assert [dataclasses.replace(w, reason="") for w in plan.weights] == \
        [dataclasses.replace(w, reason="") for w in timed_weights(step)]


def _gradient_then_wide_backward_op_ir():
    """Two layers; the backward pass makes ``w2``'s 64 MiB gradient ``gw2`` first, then ``wide``, a
    64 MiB temporary made from a 16 MiB fetched weight ``w3`` (read by nothing else), while ``gw2``
    is still being copied to the host for the update (over PCIe, 4x longer than ``w3``'s fetch).
    Nothing here can be swapped or recomputed."""
    B, U, OUT, WIDE = 64, 64, 262144, 262144
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", (B, U))]),
        dict(name="w2", type="Placeholder", outputs=[("w2:0", (), "resource")]),
        dict(name="w3", type="Placeholder", outputs=[("w3:0", (), "resource")]),
        dict(name="rw2", type="ReadVariableOp", inputs=["w2:0"], outputs=[("rw2:0", (U, OUT))]),
        dict(name="rw3", type="ReadVariableOp", inputs=["w3:0"], outputs=[("rw3:0", (16, WIDE))]),
        dict(name="r1", type="Relu", inputs=["x:0"], outputs=[("r1:0", (B, U))]),
        dict(name="m2", type="MatMul", inputs=["r1:0", "rw2:0"], outputs=[("m2:0", (B, OUT))]),
        dict(name="loss", type="Sum", inputs=["m2:0"], outputs=[("loss:0", (1,))]),
        dict(name="g2", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("g2:0", (B, OUT))]),
        dict(name="gw2", type="MatMul", phase="backward", inputs=["r1:0", "g2:0"], outputs=[("gw2:0", (U, OUT))]),
        dict(name="gx2", type="Sum", phase="backward", inputs=["g2:0"], outputs=[("gx2:0", (B, 16))]),
        dict(name="wide", type="MatMul", phase="backward", inputs=["gx2:0", "rw3:0"], outputs=[("wide:0", (B, WIDE))]),
        dict(name="gs", type="Sum", phase="backward", inputs=["wide:0"], outputs=[("gs:0", (B, U))]),
        dict(name="g1", type="ReluGrad", phase="backward", inputs=["gs:0", "r1:0"], outputs=[("g1:0", (B, U))]),
        dict(name="u2", type="ResourceApplyGradientDescent", phase="update", inputs=["w2:0", "gw2:0"], outputs=[]),
        dict(name="u3", type="ResourceApplyGradientDescent", phase="update", inputs=["w3:0", "g1:0"], outputs=[]),
    ], function_inputs=["x"])


def test_the_budget_planner_makes_a_fetch_wait_for_a_gradient_still_being_copied_out_at_the_peak(monkeypatch):
    """Fetched to hide its copy, ``w3`` waits idle on the device beside ``g2`` and ``gw2`` (144 MiB);
    fetched later alone, it arrives while ``gw2``'s copy out still runs, and ``wide`` then holds
    144 MiB with them. A budget of 136 MiB fits only when ``w3``'s fetch waits for ``gw2`` to reach
    the host; the planner finds that wait, and the simulated step keeps it: ``wide`` starts after
    the copy. Without the wait round the same budget is infeasible."""
    ir = _gradient_then_wide_backward_op_ir()
    policies = Policies(host="/CPU:1", weights="host", budget=136 * MiB, swapin_groupby=1)
    step = PlanningStep.build(ir, policies, device="/device:GPU:0", cost=H100)
    plain = simulate(ir, assemble(step, set(), {}), cost=H100, top=None)
    assert plain.peak_bytes > 136 * MiB and [g for _, g in gradients_on_device_at_peak(step, plain)] == ["gw2:0"]
    plan = make_budget_plan(ir, policies, device="/device:GPU:0", cost=H100)
    assert plan.predictions.planned_peak_bytes <= 136 * MiB and plan.num_gradient_waits == 1
    (waiting,) = [(w.variable, f) for w in plan.offloaded_weights for f in w.fetches if f.after_gradients]
    assert waiting[0] == "w3:0" and waiting[1].after_gradients == ("gw2:0",)
    replay = simulate(ir, plan, cost=H100)
    assert replay.op_intervals["wide"][0] >= replay.op_intervals["to_host/gw2:0"][1]
    assert not waitable_gradient(ir, "x:0", "/CPU:1") and waitable_gradient(ir, "gw2:0", "/CPU:1")
    from lms_tf.planner.search import BudgetSearch
    monkeypatch.setattr(BudgetSearch, "wait_for_a_gradient", lambda self, *args: None)
    with pytest.raises(InfeasibleBudgetError):
        make_budget_plan(ir, policies, device="/device:GPU:0", cost=H100)


def _masked_chain_ir():
    """``x @ w1 -> relu -> select(mask, ., 0) @ w2 -> sum``, where ``mask`` is a causal mask made
    from constants alone (``ones -> MatrixBandPart -> LogicalAnd``), as Keras's attention makes it:
    forward ops with forward inputs, but on no path from the step's data."""
    act, weight = (BATCH, UNITS), (UNITS, UNITS)
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", act)]),
        dict(name="w1", type="Placeholder", outputs=[("w1:0", (), "resource")]),
        dict(name="w2", type="Placeholder", outputs=[("w2:0", (), "resource")]),
        dict(name="ones", type="Const", outputs=[("ones:0", act, "bool")]),
        dict(name="band", type="MatrixBandPart", inputs=["ones:0"], outputs=[("band:0", act, "bool")]),
        dict(name="mask", type="LogicalAnd", inputs=["band:0", "band:0"], outputs=[("mask:0", act, "bool")]),
        dict(name="rw1", type="ReadVariableOp", inputs=["w1:0"], outputs=[("rw1:0", weight)]),
        dict(name="rw2", type="ReadVariableOp", inputs=["w2:0"], outputs=[("rw2:0", weight)]),
        dict(name="m1", type="MatMul", inputs=["x:0", "rw1:0"], outputs=[("m1:0", act)]),
        dict(name="r1", type="Relu", inputs=["m1:0"], outputs=[("r1:0", act)]),
        dict(name="s1", type="SelectV2", inputs=["mask:0", "r1:0", "r1:0"], outputs=[("s1:0", act)]),
        dict(name="m2", type="MatMul", inputs=["s1:0", "rw2:0"], outputs=[("m2:0", act)]),
        dict(name="loss", type="Sum", inputs=["m2:0"], outputs=[("loss:0", (1,))]),
        dict(name="gm2", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gm2:0", act)]),
        dict(name="gs1", type="MatMul", phase="backward", inputs=["gm2:0", "rw2:0"], outputs=[("gs1:0", act)]),
        dict(name="gw2", type="MatMul", phase="backward", inputs=["s1:0", "gm2:0"], outputs=[("gw2:0", weight)]),
        dict(name="g1", type="ReluGrad", phase="backward", inputs=["gs1:0", "r1:0"], outputs=[("g1:0", act)]),
        dict(name="gw1", type="MatMul", phase="backward", inputs=["x:0", "g1:0"], outputs=[("gw1:0", weight)]),
        dict(name="u2", type="ResourceApplyGradientDescent", phase="update", inputs=["w2:0", "gw2:0"], outputs=[]),
        dict(name="u1", type="ResourceApplyGradientDescent", phase="update", inputs=["w1:0", "gw1:0"], outputs=[]),
    ], function_inputs=["x"])


def test_an_op_made_from_constants_alone_never_triggers_a_fetch():
    """TensorFlow runs a causal mask's ops when the step starts (Grappler folds them into a
    constant), wherever a replay puts them: a fetch they triggered would arrive blocks before its
    layer. Seen on a decoder with its weights on the host: the last blocks' MLP kernels, triggered
    by their attention's ``LogicalAnd``, sat on the device from the step's start (the simulator's
    forward peak 29.7 MiB; 22.4 MiB with the gates on the data path)."""
    ir = _masked_chain_ir()
    assert [op.name for op in forward_gates(ir)] == ["r1", "s1", "m2", "loss"]
    # A replay that ran the mask late, when the copy must start (1.5 before m2): the mask is the
    # last op that ends early enough, but only a gate on the data path may trigger the fetch (r1).
    planned = plan_weights(ir, Policies(weights="host", swapin_groupby=1))
    clock = {"x": 0, "rw1": 0, "rw2": 0, "m1": 1, "r1": 2, "ones": 1, "band": 2, "mask": 3, "s1": 5, "m2": 6,
             "loss": 7, "gm2": 8, "gs1": 9, "gw2": 10, "g1": 11, "gw1": 12, "u2": 13, "u1": 14}
    intervals = {name: (float(t), t + 1.0) for name, t in clock.items()}
    w2 = next(w for w in timed_fetches(ir, planned, intervals, copy_time=lambda nbytes: 1.5) if w.variable == "w2:0")
    assert w2.fetches[0].trigger == "r1"


def test_variables_the_host_cannot_hold_are_refused_before_the_search(monkeypatch):
    """No plan holds less on the host than the variables it keeps there for the whole step (with
    ``weights="host"`` the weights and their optimizer's slots): a host budget below them is the
    library's error naming both figures, raised before the budget search runs. A budget the
    variables fit is judged after the search, by the plan's host peak (here the two 256 KiB
    weights and their gradients copied out)."""
    from lms_tf.core.errors import HostBudgetError
    from lms_tf.core.examples import weighted_chain_ir
    from lms_tf.planner.search import BudgetSearch

    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    searched = []
    original = BudgetSearch.fit
    monkeypatch.setattr(BudgetSearch, "fit", lambda self, *a, **k: searched.append(1) or original(self, *a, **k))
    weights = 2 * 256 * 1024
    below = Policies(host="/CPU:1", budget="auto", weights="host", host_budget=weights - 1)
    with pytest.raises(HostBudgetError, match=r"weights='host' keeps 512\.0 KiB \(524288 bytes\) of weights and "
                                              r"optimizer slots in host memory for the whole step.*more than "
                                              r"host_budget: 512\.0 KiB \(524287 bytes\)") as err:
        make_budget_plan(weighted_chain_ir(), below, device="/device:GPU:0", cost=cost)
    assert (err.value.host_needed_bytes, err.value.host_budget_bytes) == (weights, weights - 1)
    assert not searched
    at = Policies(host="/CPU:1", budget="auto", weights="host", host_budget=weights)
    with pytest.raises(HostBudgetError, match=r"the plan fits the device but holds 1\.0 MiB") as err:
        make_budget_plan(weighted_chain_ir(), at, device="/device:GPU:0", cost=cost)
    assert err.value.host_needed_bytes == 2 * weights and searched


def _conv_pair_ir():
    """Two convolutions, ``x -> conv(w1) -> relu -> conv(w2) -> relu -> sum``, with the gradient
    TensorFlow builds for a convolution: one ``ShapeN`` of the layer's input and kernel (indexed with
    the backward pass, ready as soon as the forward layer's input exists), the input gradient
    reading the kernel, the filter gradient reading the input."""
    act, kernel = (8, 64, 64, 32), (3, 3, 32, 32)
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", act)]),
        dict(name="w1", type="Placeholder", outputs=[("w1:0", (), "resource")]),
        dict(name="w2", type="Placeholder", outputs=[("w2:0", (), "resource")]),
        dict(name="rw1", type="ReadVariableOp", inputs=["w1:0"], outputs=[("rw1:0", kernel)]),
        dict(name="rw2", type="ReadVariableOp", inputs=["w2:0"], outputs=[("rw2:0", kernel)]),
        dict(name="c1", type="Conv2D", inputs=["x:0", "rw1:0"], outputs=[("c1:0", act)]),
        dict(name="r1", type="Relu", inputs=["c1:0"], outputs=[("r1:0", act)]),
        dict(name="c2", type="Conv2D", inputs=["r1:0", "rw2:0"], outputs=[("c2:0", act)]),
        dict(name="r2", type="Relu", inputs=["c2:0"], outputs=[("r2:0", act)]),
        dict(name="loss", type="Sum", inputs=["r2:0"], outputs=[("loss:0", (1,))]),
        dict(name="gr2", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gr2:0", act)]),
        dict(name="g2", type="ReluGrad", phase="backward", inputs=["gr2:0", "r2:0"], outputs=[("g2:0", act)]),
        dict(name="sn2", type="ShapeN", phase="backward", inputs=["r1:0", "rw2:0"],
             outputs=[("sn2:0", (4,), "int32"), ("sn2:1", (4,), "int32")]),
        dict(name="bi2", type="Conv2DBackpropInput", phase="backward", inputs=["sn2:0", "rw2:0", "g2:0"],
             outputs=[("bi2:0", act)]),
        dict(name="bf2", type="Conv2DBackpropFilter", phase="backward", inputs=["r1:0", "sn2:1", "g2:0"],
             outputs=[("bf2:0", kernel)]),
        dict(name="g1", type="ReluGrad", phase="backward", inputs=["bi2:0", "r1:0"], outputs=[("g1:0", act)]),
        dict(name="sn1", type="ShapeN", phase="backward", inputs=["x:0", "rw1:0"],
             outputs=[("sn1:0", (4,), "int32"), ("sn1:1", (4,), "int32")]),
        dict(name="bf1", type="Conv2DBackpropFilter", phase="backward", inputs=["x:0", "sn1:1", "g1:0"],
             outputs=[("bf1:0", kernel)]),
        dict(name="u2", type="ResourceApplyGradientDescent", phase="update", inputs=["w2:0", "bf2:0"], outputs=[]),
        dict(name="u1", type="ResourceApplyGradientDescent", phase="update", inputs=["w1:0", "bf1:0"], outputs=[]),
    ], function_inputs=["x"])


def test_a_convolution_gradients_shape_reader_takes_the_forward_fetch_and_frees_the_layer_input():
    """A kernel's ``ShapeN`` belongs to the forward window: in the backward window it read the
    backward fetch, so it ran only when that copy arrived, and held the layer's input (swapped out
    or not) on the device until then. Seen on VGG16 with its weights on the host: each
    ``block1`` activation (196 MiB) stayed on the device through the whole backward pass."""
    ir = _conv_pair_ir()
    planned = {w.variable: w for w in plan_weights(ir, Policies(weights="host", swapin_groupby=1))}
    assert [f.consumers for f in planned["w2:0"].fetches] == [("c2", "sn2"), ("bi2",)]
    # The first layer has no input gradient: its kernel is fetched once, for the forward layer
    # and its shape reader (it took a fetch of its own, for the ShapeN alone, before).
    assert [f.consumers for f in planned["w1:0"].fetches] == [("c1", "sn1")]
    # Replayed, the shape reader runs in the forward pass, right after the layer's input exists,
    # and the swapped input leaves the device when its copy out ends, long before the backward pass.
    step = PlanningStep.build(ir, Policies(host="/CPU:1", weights="host", budget=1 << 40, swapin_groupby=1),
                              device="/device:GPU:0", cost=H100)
    plan = assemble(step, {"r1:0"}, {}, Tools(throttle=True))
    assert [f.consumers for f in _by_variable(plan.weights)["w2:0"].fetches] == [("c2", "sn2"), ("bi2",)]
    sim = simulate(ir, plan, cost=H100)
    assert sim.op_intervals["sn2"][1] <= sim.op_intervals["loss"][0]
    assert sim.op_intervals["sn2"][0] >= sim.op_intervals["r1"][1]


def _by_variable(weights):
    return {w.variable: w for w in weights}
