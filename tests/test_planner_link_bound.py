"""Plans for steps the link cannot keep up with (issue "Planner", largest batch).

Two planner tools beyond KEEP/SWAP/RECOMPUTE, proven three ways:

* the forward pass waits for copies out (``TensorDecision.swap_out_before``, TFLMS's
  synchronous swap-out), so swapped bytes leave before the backward pass starts;
* a backward branch waits for another (``Plan.orderings``), so two branches' temporaries are
  not alive together.

Hand-built graphs give the simulator's exact answers; a real Keras model with parallel
branches trains to the plain step's numbers with both, holds the inserted ops the plan names,
and TensorFlow really executes the ops in the order the plan asks for.
"""

import collections
import dataclasses

import pytest
import tensorflow as tf

import lms_tf
from lms_tf.core.errors import PlanCycleError
from lms_tf.core.ir import Phase, make_ir
from lms_tf.core.plan import Decision, Ordering, Plan, Predictions, SwapIn, TensorDecision
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.planner.fit_check import FitCheck
from lms_tf.planner.ordering import BranchOrdering
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import Tools, assemble
from lms_tf.simulate import simulate
from tests import zoo
from tests.helpers import assert_same_numbers, custom_loop
from tests.test_planner_budget import _chain_ir

MiB = 2**20
PCIE3 = CostModel(get_device_spec("v100-16gb-pcie3"))


def _branches_ir():
    """One gradient g (4 MiB) feeds two independent backward branches A and B; each computes
    u = Exp(g), v = Sin(g), w = u * v (4 MiB each); the join adds wA, wB and g."""
    mib4 = (MiB,)
    ops = [dict(name="x", type="Placeholder", outputs=[("x:0", mib4)]),
           dict(name="gradient_tape/g", type="Exp", phase="backward", inputs=["x:0"],
                outputs=[("gradient_tape/g:0", mib4)])]
    for branch in "AB":
        scope = f"gradient_tape/{branch}"
        for kind, op_type in (("u", "Exp"), ("v", "Sin")):
            ops.append(dict(name=f"{scope}/{kind}", type=op_type, phase="backward", inputs=["gradient_tape/g:0"],
                            outputs=[(f"{scope}/{kind}:0", mib4)]))
        ops.append(dict(name=f"{scope}/w", type="Mul", phase="backward", inputs=[f"{scope}/u:0", f"{scope}/v:0"],
                        outputs=[(f"{scope}/w:0", mib4)]))
    ops.append(dict(name="gradient_tape/join", type="AddN", phase="backward",
                    inputs=["gradient_tape/A/w:0", "gradient_tape/B/w:0", "gradient_tape/g:0"],
                    outputs=[("gradient_tape/join:0", mib4)]))
    return make_ir(ops, function_inputs=["x"])


def test_simulator_branches_run_interleaved_unless_ordered():
    ir = _branches_ir()
    plain = simulate(ir, cost=PCIE3)
    # first ready, first run: both branches' u and v are computed before either w, with g alive
    assert plain.peak_bytes == 5 * 4 * MiB
    ordering = Ordering(("gradient_tape/B/u", "gradient_tape/B/v"), ("gradient_tape/A/w",), "test")
    ordered = simulate(ir, Plan((), "d", "h", {}, {}, orderings=(ordering,)), cost=PCIE3)
    # A finishes first (w written into u's buffer); then g, wA, uB, vB
    assert ordered.peak_bytes == 4 * 4 * MiB
    assert ordered.op_intervals["gradient_tape/B/u"][0] >= ordered.op_intervals["gradient_tape/A/w"][1]


def test_planner_orders_branches_when_nothing_can_be_swapped():
    ir = _branches_ir()
    policies = Policies(host="/CPU:1", budget=17 * MiB, recompute=False)
    plan = make_budget_plan(ir, policies, device="/device:CPU:0", cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    assert plan.predictions.feasible and plan.predictions.planned_peak_bytes == 16 * MiB and len(plan.orderings) == 1
    (ordering,) = plan.orderings
    first, then = ("A", "B") if "gradient_tape/A/w" in ordering.after else ("B", "A")
    assert set(ordering.waiters) == {f"gradient_tape/{then}/u", f"gradient_tape/{then}/v"}
    assert f"gradient_tape/{first}/w" in ordering.after
    assert "order:" in plan.summary() and plan.to_dict()["orderings"][0]["waiters"]


def _bias_and_filter_gradient_ir(device):
    """A convolution's filter gradient and its bias's gradient, both reading the incoming gradient
    dy, in two backward scopes (``convolution``, ``BiasAdd``): the pair oneDNN fuses on a CPU."""
    act, dy_shape = (8, 16, 16, 32), (8, 16, 16, 64)
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", act)]),
        dict(name="gradient_tape/dy", type="Exp", phase="backward", inputs=["x:0"], outputs=[("gradient_tape/dy:0", dy_shape)],
             device=device),
        dict(name="gradient_tape/conv/BiasAdd/BiasAddGrad", type="BiasAddGrad", phase="backward",
             inputs=["gradient_tape/dy:0"], outputs=[("gradient_tape/conv/BiasAdd/BiasAddGrad:0", (64,))], device=device),
        dict(name="gradient_tape/conv/convolution/Conv2DBackpropFilter", type="Conv2DBackpropFilter", phase="backward",
             inputs=["x:0", "gradient_tape/dy:0"],
             outputs=[("gradient_tape/conv/convolution/Conv2DBackpropFilter:0", (3, 3, 32, 64))], device=device)],
        function_inputs=["x"])


@pytest.mark.parametrize("device", ["/device:CPU:0", "/device:GPU:0", ""])
def test_a_bias_gradient_and_the_kernel_onednn_fuses_it_into_are_not_ordered_on_a_cpu(device):
    """On a CPU oneDNN runs a bias gradient and the filter gradient (or MatMul) reading the same
    gradient as one kernel; an ordering between them runs them apart, and the bias gradient,
    summed by another kernel, rounds differently (tests/test_tf_onednn.py). The planner orders
    them only on a GPU (an op without a device runs on the step's)."""
    step_device = device or "/device:CPU:0"
    branches = BranchOrdering(_bias_and_filter_gradient_ir(device), step_device)
    ordering = branches.ordering(("conv", "BiasAdd"), ("conv", "convolution"))
    reverse = branches.ordering(("conv", "convolution"), ("conv", "BiasAdd"))
    if "GPU" in step_device:
        assert ordering is not None and ordering.after == ("gradient_tape/conv/BiasAdd/BiasAddGrad",)
        assert reverse is not None
    else:
        assert ordering is None and reverse is None


def test_a_cyclic_ordering_is_refused_by_the_simulator():
    ir = _branches_ir()
    cycle = Ordering(("gradient_tape/g",), ("gradient_tape/join",), "test")
    with pytest.raises(PlanCycleError, match="wait for each other"):
        simulate(ir, Plan((), "d", "h", {}, {}, orderings=(cycle,)), cost=PCIE3)


def test_simulator_forward_pass_waits_for_the_copy_out():
    ir = _chain_ir()
    swap_a = TensorDecision("a:0", "", (MiB,), 4 * MiB, Decision.SWAP, "swap", 6, (SwapIn("g2", ("g1",)),))
    free_running = simulate(ir, Plan((swap_a,), "d", "h", {}, {}), cost=PCIE3)
    waiting = simulate(ir, Plan((dataclasses.replace(swap_a, swap_out_before="c"),), "d", "h", {}, {}), cost=PCIE3)
    # over PCIe the copy of a is still running when c is computed: a, b, c (and the loss) together
    assert free_running.peak_bytes == 3 * 4 * MiB + 4
    # c waits until a is on the host: only b, c and the loss remain
    assert waiting.peak_bytes == 2 * 4 * MiB + 4
    assert waiting.op_intervals["c"][0] >= waiting.op_intervals["swap_out/a:0"][1]
    assert waiting.step_time_s > free_running.step_time_s


def _link_bound_plan(recorded):
    """The budget planner's own tools, forced on: every movable tensor swapped with the forward
    pass waiting for its copies out, and one backward ordering at the simulated peak."""
    def plan(ir, policies, *, device, cost, scope_aliases=None):
        step = PlanningStep.build(ir, policies, device=device, cost=cost, scope_aliases=scope_aliases)
        check, branches = FitCheck(step), BranchOrdering(ir)
        swapped = assemble(step, set(step.eligible), {}, Tools(throttle=True))
        sim = check.simulate(swapped)
        orderings = []
        for a, b in branches.branch_pairs(sim):
            for first, then in ((a, b), (b, a)):
                ordering = branches.ordering(first, then)
                if ordering is not None and not orderings:
                    try:  # the same check the planner makes: no cycle with the swap-in triggers
                        check.simulate(dataclasses.replace(swapped, orderings=(ordering,)))
                        orderings.append(ordering)
                    except PlanCycleError:
                        pass
        result = dataclasses.replace(swapped, orderings=tuple(orderings), budget_bytes=sim.peak_bytes,
                                     predictions=Predictions(feasible=True))
        recorded.append(result)
        return result
    return plan


@pytest.mark.timeout(300)
def test_waits_and_orderings_train_to_the_plain_numbers_in_the_planned_order(cpu_lms, monkeypatch):
    from lms_tf import _compat
    from lms_tf.tf import driver
    from lms_tf.tf.diagnostics import executed_ops, find_executed
    from lms_tf.tf.rewrite.common import LMS_ATTR, count_lms_ops

    recorded = []
    monkeypatch.setattr(driver, "make_budget_plan", _link_bound_plan(recorded))
    plain = custom_loop(zoo.inception_style, tf.function)
    planned = custom_loop(zoo.inception_style, lambda f: lms_tf.function(
        f, budget="50%", device_spec="v100-16gb-pcie3", **cpu_lms))
    # numbers: three steps, losses and weights
    assert_same_numbers(plain, planned)

    plan = recorded[-1]
    waits = [d for d in plan.swapped if d.swap_out_before is not None]
    assert len(waits) >= 5 and len(plan.orderings) == 1
    # structure: one Shape on the host and one signal per wait, one barrier per ordering,
    # wired into the ops the plan names
    fn = planned[2]
    _, (xs, ys) = zoo.inception_style()
    x, y = tf.constant(xs[:zoo.BATCH]), tf.constant(ys[:zoo.BATCH])
    graph = fn.get_concrete_function(x, y).graph
    counts = count_lms_ops(graph)
    assert counts["swap_out_done"] == 2 * len(waits) and counts["order"] == 1
    for d in waits:
        signals = [c for c in graph.get_operation_by_name(d.swap_out_before).control_inputs
                   if _compat.string_attr(c, LMS_ATTR) == "swap_out_done"]
        sources = {s.inputs[0].op.inputs[0].op.name for s in signals}
        assert any(_compat.string_attr(graph.get_operation_by_name(n), LMS_ATTR) == "swap_out" for n in sources)

    # behaviour: the order TensorFlow executed the ops in
    events = executed_ops(lambda: fn(x, y).numpy())
    (ordering,) = plan.orderings
    waited = [find_executed(events, n) for n in ordering.waiters]
    finished = [find_executed(events, n) for n in ordering.after]
    waited, finished = [e for e in waited if e], [e for e in finished if e]
    assert waited and finished
    assert min(e.start_ps for e in waited) >= max(e.end_ps for e in finished)
    # The copy out itself (a host Identity) is not among the profiled kernels; the signal that
    # reads it (its Shape, sent to the waiter's device) is, and it cannot start before the copy ended.
    swap_outs = {op.inputs[0].name: op.name for op in graph.get_operations()
                 if _compat.string_attr(op, LMS_ATTR) == "swap_out"}
    checked = 0
    for d in waits:
        signal = [e for e in events if f"{swap_outs[d.tensor]}_done" in e.node]
        waiter = find_executed(events, d.swap_out_before)
        if signal and waiter:
            # start, not end: the signal's _Send/_Recv are asynchronous kernels whose recorded end
            # is not when the value arrived
            assert waiter.start_ps >= min(e.start_ps for e in signal), (
                d.tensor, d.swap_out_before, waiter, [e for e in events if e.start_ps <= waiter.end_ps and (
                    "lms_tf" in e.node or e.end_ps >= waiter.start_ps - 10**8)])
            checked += 1
    assert checked >= len(waits) // 2, (checked, len(waits))


def test_an_unknown_batch_trace_offers_the_same_tensors_as_a_concrete_one():
    """With an unknown batch dimension the gradient reads activations' shapes through Shape ops
    that run during the forward pass. They only read metadata: they must neither make a tensor a
    candidate nor stop it from being swapped (the largest-batch search plans such traces)."""
    from lms_tf.core.op_kinds import METADATA_READER_TYPES
    from lms_tf.planner.candidates import collect_candidates
    from lms_tf.tf.trace import build_ir
    from lms_tf.tf.workloads import train_step

    model, (x, _) = zoo.inception_style()
    step = tf.function(train_step(model))
    concrete = build_ir(step.get_concrete_function(tf.TensorSpec((8,) + x.shape[1:]),
                                                   tf.TensorSpec((8,), tf.int32)).graph)
    unknown = build_ir(step.get_concrete_function(tf.TensorSpec((None,) + x.shape[1:]),
                                                  tf.TensorSpec((None,), tf.int32)).graph, batch_size=8)
    assert any(op.type in METADATA_READER_TYPES and op.phase is Phase.BACKWARD for op in unknown.ops)
    options = Policies(host="/CPU:1", min_swap_bytes=1)
    found = {name: collect_candidates(ir, options, device="/device:CPU:0") for name, ir in
             (("concrete", concrete), ("unknown", unknown))}
    for candidates in found.values():
        assert not any(c.type in METADATA_READER_TYPES for readers in candidates.backward_of.values()
                       for c in readers)
    # every activation the concrete trace may move, the unknown-batch one may move too
    sizes = {name: collections.Counter(ir.tensors[t].nbytes for t in found[name].eligible
                                       if ir.tensors[t].nbytes >= 64 * 2**10)
             for name, ir in (("concrete", concrete), ("unknown", unknown))}
    assert sizes["concrete"] and not sizes["concrete"] - sizes["unknown"]
