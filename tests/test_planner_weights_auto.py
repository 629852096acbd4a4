"""``weights="auto"`` chooses which variables go to the host, not only how many.

The planner first moves the fewest variables in :func:`~lms_tf.planner.budget.offload_order`
with which the step fits, then keeps each chosen one back on the device while the step still
fits and is no slower. The order is a guess from link time per byte: a weight whose window covers
the peak frees nothing there (its copy is on the device when the peak comes) but costs its copy
every step. A hand-built step with a known answer.
"""

import pytest

from lms_tf.core.errors import InfeasibleBudgetError
from lms_tf.core.ir import make_ir
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.planner.budget import KEEP_BACK_TRIES, offload_order
from lms_tf.planner.search import BudgetSearch
from lms_tf.planner.step import PlanningStep

V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
BATCH, UNITS, WIDE = 64, 256, 16384
#: Weights only: with activations movable the planner could fit the budget another way.
POLICIES = dict(host="/CPU:1", weights="auto", swap=False, recompute=False)


def _wide_read_at_the_peak_ir():
    """``x @ w_small -> relu -> tile (4 MiB) @ w_big -> sum``: ``w_big`` (16 MiB, frozen) is read
    once, by the op at the peak, where the 4 MiB tile is live; ``w_small`` (256 KiB, trained) once,
    by the first op. Both are one window each: the same link time per byte, so the order puts the
    larger first (and so would the names)."""
    act, weight1, weight2 = (BATCH, UNITS), (UNITS, UNITS), (WIDE, UNITS)
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", act)]),
        dict(name="w_small", type="Placeholder", outputs=[("w_small:0", (), "resource")]),
        dict(name="w_big", type="Placeholder", outputs=[("w_big:0", (), "resource")]),
        dict(name="rw1", type="ReadVariableOp", inputs=["w_small:0"], outputs=[("rw1:0", weight1)]),
        dict(name="rw2", type="ReadVariableOp", inputs=["w_big:0"], outputs=[("rw2:0", weight2)]),
        dict(name="m1", type="MatMul", inputs=["x:0", "rw1:0"], outputs=[("m1:0", act)]),
        dict(name="r1", type="Relu", inputs=["m1:0"], outputs=[("r1:0", act)]),
        dict(name="t", type="Tile", inputs=["r1:0"], outputs=[("t:0", (BATCH, WIDE))]),
        dict(name="m2", type="MatMul", inputs=["t:0", "rw2:0"], outputs=[("m2:0", act)]),
        dict(name="loss", type="Sum", inputs=["m2:0"], outputs=[("loss:0", (1,))]),
        dict(name="gm2", type="Fill", phase="backward", inputs=["loss:0"], outputs=[("gm2:0", act)]),
        dict(name="g1", type="ReluGrad", phase="backward", inputs=["gm2:0", "r1:0"], outputs=[("g1:0", act)]),
        dict(name="gw1", type="MatMul", phase="backward", inputs=["x:0", "g1:0"], outputs=[("gw1:0", weight1)]),
        dict(name="u1", type="ResourceApplyGradientDescent", phase="update", inputs=["w_small:0", "gw1:0"], outputs=[]),
    ], function_inputs=["x"])


def _needs(step, variables):
    """Device bytes the step needs with ``variables`` on the host (resident variables + held), and its time."""
    chosen = step.with_offloaded(frozenset(variables))
    sim = BudgetSearch(chosen).fit(10**12)[1]
    return chosen.resident + sim.held_bytes, sim.step_time_s


def test_a_weight_whose_window_covers_the_peak_stays_on_the_device():
    ir = _wide_read_at_the_peak_ir()
    step = PlanningStep.build(ir, Policies(budget=10**12, **POLICIES), device="/device:GPU:0", cost=V100)
    assert [w.variable for w in offload_order(step)] == ["w_big:0", "w_small:0"]
    nothing, both, small, big = (_needs(step, v) for v in ((), ("w_small:0", "w_big:0"), ("w_small:0",),
                                                           ("w_big:0",)))
    assert big[0] == nothing[0]             # w_big's copy is on the device at the peak: it frees nothing there
    assert small[0] == both[0] < nothing[0]
    assert small[1] < both[1] / 5           # and w_big's 16 MiB copy is most of the step's time
    budget = (nothing[0] + small[0]) // 2   # fits with w_small on the host, not with w_big alone

    plan = make_budget_plan(ir, Policies(budget=budget, **POLICIES), device="/device:GPU:0", cost=V100)
    assert [w.variable for w in plan.offloaded_weights] == ["w_small:0"]   # the fewest in the order were both
    assert [(w.variable, w.decision.value) for w in plan.weights if not w.fetches] == [("w_big:0", "keep")]
    assert plan.predictions.predicted_step_time_s == pytest.approx(small[1])


def test_with_room_nothing_moves_and_below_the_floor_the_error_names_it():
    ir = _wide_read_at_the_peak_ir()
    step = PlanningStep.build(ir, Policies(budget=10**12, **POLICIES), device="/device:GPU:0", cost=V100)
    nothing, both = _needs(step, ())[0], _needs(step, ("w_small:0", "w_big:0"))[0]
    roomy = make_budget_plan(ir, Policies(budget=nothing, **POLICIES), device="/device:GPU:0", cost=V100)
    assert roomy.offloaded_weights == () and KEEP_BACK_TRIES >= 2
    with pytest.raises(InfeasibleBudgetError) as caught:
        make_budget_plan(ir, Policies(budget=both - 1, **POLICIES), device="/device:GPU:0", cost=V100)
    assert caught.value.smallest_feasible_bytes == both


def test_the_least_time_bound_takes_the_device_compute_the_plan_leaves_there():
    """With its weights on the host a plan runs the optimizer update on the host: the least-time
    bound counts that update on the host's stream, not in the device compute (it took the plain
    step's compute, update included, and a plan could read below its own bound: 0.99x)."""
    from lms_tf.simulate import link_lower_bound, simulate

    ir = _wide_read_at_the_peak_ir()
    plan = make_budget_plan(ir, Policies(budget=10**12, host="/CPU:1", weights="host", swap=False, recompute=False),
                            device="/device:GPU:0", cost=V100)
    plain, planned = simulate(ir, cost=V100), simulate(ir, plan, cost=V100)
    assert planned.host_compute_time_s > 0 and planned.compute_time_s < plain.compute_time_s  # the update moved
    bound = link_lower_bound(planned, V100)
    assert bound == max(planned.compute_time_s, planned.host_compute_time_s,
                        V100.transfer_time(planned.swap_out_bytes, "device_to_host"),
                        V100.transfer_time(planned.swap_in_bytes, "host_to_device"))
    assert bound <= planned.step_time_s
