"""A max pool's gradient run a slice of the batch at a time (``Plan.sliced``), as the simulator replays it.

The gradient reads the pool's input (swapped), its output and the output gradient, and writes the
input gradient: four batch-sized buffers at once, which no plan running it whole goes below.
Sliced, with the swapped input copied from the host a slice at a time, it holds one or two
slices of the input and the growing set of output slices, then the concatenation. Hand-built
steps with known answers; the rewrite of such a plan trains exactly as the plain step
(tests/test_frontends_sliced_ops.py).
"""

import dataclasses

import pytest

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import make_ir
from lms_tf.core.plan import Plan, SlicedOp
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.planner.search import SLICES_TRIED
from lms_tf.planner.slicing import slice_op
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import assemble
from lms_tf.simulate import simulate

MiB = 2**20
V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
BATCH = 16
ACT, POOLED, KERNEL = (BATCH, 128, 128, 64), (BATCH, 64, 64, 64), (3, 3, 64, 64)  # 64 MiB, 16 MiB


def _pool_ir():
    """``x -> conv -> relu (r) -> max pool (p) -> conv -> sum of squares``, and its gradient down to
    ``r``'s: the second convolution's input gradient (``dp``), the pool's gradient (``dr``), the
    ReLU's gradient and the first convolution's filter gradient."""
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", ACT)]),
        dict(name="w1", type="Const", outputs=[("w1:0", KERNEL)]),
        dict(name="w2", type="Const", outputs=[("w2:0", KERNEL)]),
        dict(name="sizes", type="Const", outputs=[("sizes:0", (4,), "int32")]),
        dict(name="c1", type="Conv2D", inputs=["x:0", "w1:0"], outputs=[("c1:0", ACT)]),
        dict(name="r", type="Relu", inputs=["c1:0"], outputs=[("r:0", ACT)]),
        dict(name="p", type="MaxPool", inputs=["r:0"], outputs=[("p:0", POOLED)]),
        dict(name="c2", type="Conv2D", inputs=["p:0", "w2:0"], outputs=[("c2:0", POOLED)]),
        dict(name="sq", type="Square", inputs=["c2:0"], outputs=[("sq:0", POOLED)]),
        dict(name="loss", type="Sum", inputs=["sq:0"], outputs=[("loss:0", (1,))]),
        dict(name="gsq", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gsq:0", POOLED)]),
        dict(name="gc2", type="Mul", phase="backward", inputs=["gsq:0", "c2:0"], outputs=[("gc2:0", POOLED)]),
        dict(name="dp", type="Conv2DBackpropInput", phase="backward", inputs=["sizes:0", "w2:0", "gc2:0"],
             outputs=[("dp:0", POOLED)]),
        dict(name="dw2", type="Conv2DBackpropFilter", phase="backward", inputs=["p:0", "sizes:0", "gc2:0"],
             outputs=[("dw2:0", KERNEL)]),
        dict(name="dr", type="MaxPoolGrad", phase="backward", inputs=["r:0", "p:0", "dp:0"], outputs=[("dr:0", ACT)]),
        dict(name="dc1", type="ReluGrad", phase="backward", inputs=["dr:0", "r:0"], outputs=[("dc1:0", ACT)]),
        dict(name="dw1", type="Conv2DBackpropFilter", phase="backward", inputs=["x:0", "sizes:0", "dc1:0"],
             outputs=[("dw1:0", KERNEL)]),
    ], function_inputs=["x"])


def _swapped_plan(ir):
    step = PlanningStep.build(ir, Policies(host="/CPU:1", budget=1 << 40, recompute=False), device="/device:GPU:0",
                              cost=V100)
    return assemble(step, {"r:0"}, {})


def _at(sim, name):
    return next(interval for op, interval in sim.op_intervals.items() if op == name)


@pytest.mark.parametrize("slices", [2, 4, 16])
def test_sliced_the_pool_gradient_holds_a_slice_of_its_input_and_gives_back_the_whole(slices):
    ir = _pool_ir()
    plan = _swapped_plan(ir)
    whole = simulate(ir, plan, cost=V100, top=None)
    assert whole.peak_op == "dr", whole.peak_op
    sliced = slice_op(plan, ir, "dr", slices)
    entry, = sliced.sliced
    assert entry.from_host == ("r:0",) and sliced.decisions != plan.decisions
    # r is still swapped in whole for the ReLU's gradient, no longer for the pool's.
    swap_ins = next(d for d in sliced.swapped if d.tensor == "r:0").swap_ins
    assert [s.consumers for s in swap_ins] == [("dc1",)]
    sim = simulate(ir, sliced, cost=V100, top=None)
    # The whole gradient holds r (64), p and dp (16 each) and dr (64); sliced: p and dp, at most two
    # slices of r and the slices of dr, then the concatenation of dr (64 + 64).
    assert whole.peak_bytes >= 160 * MiB
    assert sim.peak_bytes < whole.peak_bytes - 8 * MiB, (sim.peak_bytes / MiB, whole.peak_bytes / MiB)
    assert sim.peak_bytes >= 128 * MiB  # the concatenation reads every slice and writes the whole
    # The slices run in order, each after its copy; copy i leaves the host after slice i-2 ended.
    starts = [_at(sim, entry.slice_name(i)) for i in range(slices)]
    assert [s[0] for s in starts] == sorted(s[0] for s in starts)
    for i in range(slices):
        copy = _at(sim, entry.copy_name("r:0", i))
        assert copy[1] <= starts[i][0] + 1e-12, i
        if i >= 2:
            assert starts[i - 2][1] <= copy[0] + 1e-12, i
    assert _at(sim, "dr")[0] >= starts[-1][1] - 1e-12  # the concatenation after the last slice
    # Below what the gradient holds run whole: r, dr (64 MiB each), p and dp (16 each).
    assert sim.peak_bytes < 160 * MiB


def test_a_sliced_plan_prints_saves_and_loads():
    ir = _pool_ir()
    sliced = slice_op(_swapped_plan(ir), ir, "dr", 4, reason="below the whole op")
    assert Plan.from_json(sliced.to_json()) == sliced
    assert "1 op run a slice of the batch at a time (4 slices)" in sliced.one_line()
    assert "sliced: dr in 4 slices of the batch, 1 input(s) copied in a slice at a time" in sliced.summary()


def test_bad_slices_get_the_librarys_error_before_any_replay():
    ir = _pool_ir()
    plan = _swapped_plan(ir)
    with pytest.raises(LMSOptionError, match="only MaxPool3DGrad, MaxPoolGrad, MaxPoolGradV2"):
        slice_op(plan, ir, "dc1", 2)
    with pytest.raises(LMSOptionError, match="sliced already"):
        slice_op(slice_op(plan, ir, "dr", 2), ir, "dr", 4)
    kept = dataclasses.replace(plan, decisions=tuple(d.kept("test") for d in plan.decisions))
    with pytest.raises(LMSOptionError, match="slicing\\s+would hold no less"):
        slice_op(kept, ir, "dr", 2)
    sliced = slice_op(plan, ir, "dr", 2)
    for entry, match in [(dataclasses.replace(sliced.sliced[0], slices=BATCH + 1), "between 2 and its batch of 16"),
                         (dataclasses.replace(sliced.sliced[0], trigger="dc1"), "not an op of the step that runs"),
                         (dataclasses.replace(sliced.sliced[0], from_host=("dp:0",)), "the plan does not swap it"),
                         (SlicedOp("nothing", 2, (), "x"), "not in the step")]:
        with pytest.raises(LMSOptionError, match=match):
            simulate(ir, dataclasses.replace(sliced, sliced=(entry,)), cost=V100)


def test_the_budget_search_slices_the_op_at_the_peak_when_nothing_else_goes_below_it():
    ir = _pool_ir()
    policies = Policies(host="/CPU:1", budget=140 * MiB, recompute=False)
    plan = make_budget_plan(ir, policies, device="/device:GPU:0", cost=V100)
    entry, = plan.sliced
    assert entry.op == "dr" and "r:0" in entry.from_host and entry.slices in SLICES_TRIED
    assert plan.predictions.feasible and plan.predictions.planned_peak_bytes <= 140 * MiB
    assert simulate(ir, plan, cost=V100).peak_bytes == plan.predictions.planned_peak_bytes
    # Where running it whole fits, nothing is sliced.
    assert make_budget_plan(ir, policies.replace(budget=200 * MiB), device="/device:GPU:0", cost=V100).sliced == ()
