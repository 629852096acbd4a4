"""A swapped tensor brought back twice, around the op at the peak.

A convolution's input is read again by two backward ops: the filter gradient, and the previous
layer's ``ReluGrad`` (through the input gradient). Between them runs the input gradient, the
layer's largest op. One swap-in for both readers holds the copy on the device through it; the
planner instead brings the copy back for the filter gradient, makes the input gradient wait for
it, and brings it back again when the input gradient ends. Hand-built steps with known answers;
the rewrite of such a plan trains exactly as the plain step (tests/test_frontends_swap_in_twice.py).
"""

from lms_tf.core.ir import make_ir
from lms_tf.core.plan import Ordering, SwapIn
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner.search import BudgetSearch
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import Tools, assemble, readers_around, split_swap_ins, timed_swap
from lms_tf.simulate import simulate

MiB = 2**20
V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
# 64 MiB activations; the second layer's 7x7 kernel computes long enough (7 ms on the V100 preset)
# for the first layer's output to be copied out meanwhile (6 ms over PCIe).
ACT, KERNEL, KERNEL2 = (16, 128, 128, 64), (3, 3, 64, 64), (7, 7, 64, 64)


def _conv_pair_ir():
    """``x -> conv(w1) -> relu -> conv(w2) -> relu -> sum(r2^2 + r2^3)`` and the convolutions'
    gradient, in the order TensorFlow builds it: the second layer's input gradient, then its filter
    gradient, then the first layer's ``ReluGrad`` (reading the input gradient and ``r1``) and
    filter gradient. The loss's temporaries make a forward peak that ``r1`` waits idle through, so
    a budget search swaps it."""
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", ACT)]),
        dict(name="rw1", type="Const", outputs=[("rw1:0", KERNEL)]),
        dict(name="rw2", type="Const", outputs=[("rw2:0", KERNEL2)]),
        dict(name="sizes", type="Const", outputs=[("sizes:0", (4,), "int32")]),
        dict(name="c1", type="Conv2D", inputs=["x:0", "rw1:0"], outputs=[("c1:0", ACT)]),
        dict(name="r1", type="Relu", inputs=["c1:0"], outputs=[("r1:0", ACT)]),
        dict(name="c2", type="Conv2D", inputs=["r1:0", "rw2:0"], outputs=[("c2:0", ACT)]),
        dict(name="r2", type="Relu", inputs=["c2:0"], outputs=[("r2:0", ACT)]),
        dict(name="sq", type="Square", inputs=["r2:0"], outputs=[("sq:0", ACT)]),
        dict(name="cube", type="Mul", inputs=["sq:0", "r2:0"], outputs=[("cube:0", ACT)]),
        dict(name="both", type="AddV2", inputs=["sq:0", "cube:0"], outputs=[("both:0", ACT)]),
        dict(name="loss", type="Sum", inputs=["both:0"], outputs=[("loss:0", (1,))]),
        dict(name="gr2", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gr2:0", ACT)]),
        dict(name="g2", type="ReluGrad", phase="backward", inputs=["gr2:0", "r2:0"], outputs=[("g2:0", ACT)]),
        dict(name="bi2", type="Conv2DBackpropInput", phase="backward", inputs=["sizes:0", "rw2:0", "g2:0"],
             outputs=[("bi2:0", ACT)]),
        dict(name="bf2", type="Conv2DBackpropFilter", phase="backward", inputs=["r1:0", "sizes:0", "g2:0"],
             outputs=[("bf2:0", KERNEL2)]),
        dict(name="g1", type="ReluGrad", phase="backward", inputs=["bi2:0", "r1:0"], outputs=[("g1:0", ACT)]),
        dict(name="bf1", type="Conv2DBackpropFilter", phase="backward", inputs=["x:0", "sizes:0", "g1:0"],
             outputs=[("bf1:0", KERNEL)]),
    ], function_inputs=["x"])


def _step(budget=1 << 40):
    return PlanningStep.build(_conv_pair_ir(), Policies(host="/CPU:1", budget=budget, recompute=False),
                              device="/device:GPU:0", cost=V100)


def test_the_readers_split_around_the_op_between_them():
    step = _step()
    first, then = readers_around(step, "r1:0", "bi2")
    assert [op.name for op in first] == ["bf2"] and [op.name for op in then] == ["g1"]
    assert readers_around(step, "r1:0", "bf2") is None   # it reads r1 itself
    assert readers_around(step, "r1:0", "g2") is None    # every reader waits for g2


def test_swapped_in_twice_the_copy_leaves_the_device_while_the_op_between_runs():
    step = _step()
    once = assemble(step, {"r1:0"}, {})
    twice = assemble(step, {"r1:0"}, {}, split={"r1:0": "bi2"})
    assert [s.consumers for s in once.swapped[0].swap_ins] == [("bf2", "g1")]
    decision = twice.swapped[0]
    assert [(s.consumers, s.trigger) for s in decision.swap_ins][1] == (("g1",), "bi2")
    assert decision.swap_ins[0].consumers == ("bf2",)
    assert twice.orderings == (Ordering(("bi2",), ("bf2",), twice.orderings[0].reason),)
    assert split_swap_ins(twice) == {"r1:0": "bi2"} and split_swap_ins(once) == {}
    # The plan can be built again from what it says (the search's refinements do).
    assert assemble(step, {"r1:0"}, {}, Tools(), twice.orderings, split=split_swap_ins(twice)) == twice
    sim_once, sim_twice = simulate(step.ir, once, cost=V100), simulate(step.ir, twice, cost=V100)
    # Once: bi2 runs first (it comes first), then bf2 with the copy, the input gradient it reads,
    # cuDNN's workspace and bi2's output, which waits for g1 (64 MiB each).
    live = dict(sim_once.live_at_peak)
    assert sim_once.peak_op == "bf2" and live["swap_in/r1:0/0"] == live["bi2:0"] == 64 * MiB
    # Twice: bf2 runs with the first copy, before bi2; the second copy comes back for g1 only.
    assert sim_twice.peak_bytes <= sim_once.peak_bytes - 60 * MiB
    assert "bi2:0" not in dict(sim_twice.live_at_peak) or not any(
        name.startswith("swap_in/r1:0") for name, _ in sim_twice.live_at_peak)
    # Executed order: bf2 before bi2, the second copy after bi2 and before g1; two copies back.
    spans = sim_twice.op_intervals
    assert spans["bf2"][1] <= spans["bi2"][0]
    assert spans["bi2"][1] <= spans["swap_in/r1:0/1"][0] and spans["swap_in/r1:0/1"][1] <= spans["g1"][0]
    assert sim_twice.swap_in_bytes == 2 * sim_once.swap_in_bytes


def test_the_budget_search_brings_a_swapped_tensor_back_twice_when_its_copy_is_at_the_peak():
    """The search's rounds, from a plan that swaps ``r1`` (as one would for a forward peak it waits
    idle through): the copy at the backward peak is brought back twice, and the plan fits."""
    budget = 200 * MiB
    search = BudgetSearch(_step(budget))
    search.check.budget_bytes = budget
    once = assemble(search.step, {"r1:0"}, {})
    start = search.check.simulate(once)
    assert start.held_bytes > budget
    plan, sim = search.add_swaps(budget, {}, Tools(), start=(once, start))
    assert sim.held_bytes <= budget
    assert split_swap_ins(plan) == {"r1:0": "bi2"}
    assert "swapped in again after bi2" in plan.swapped[0].reason
    assert any(o.waiters == ("bi2",) and o.after == ("bf2",) for o in plan.orderings)
