"""``weights="auto"``: the budget planner chooses which variables live on the host.

The budget counts the variables that stay on the device, so moving a weight to the host makes
room (a weight on the host costs a copy per window of its readers instead). The planner moves the
fewest, cheapest in link time per byte first, with which the step fits, then keeps back on the device
any it does not need; the front-end moves them
while the step is traced. These tests prove the choice (planner), the numbers and the graph
(front-ends). On logical CPUs a fetch moves no bytes: memory is the simulator's figure here.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.planner.budget import KEEP_BACK_TRIES, offload_order
from lms_tf.planner.search import BudgetSearch
from lms_tf.planner.step import PlanningStep
from lms_tf.tf.rewrite import LMS_ATTR
from lms_tf.tf.trace import build_ir
from lms_tf.tf.variables import variable_device
from tests.helpers import CPU_LMS, assert_same_numbers, fit_steps
from tests.test_frontends_weights import _mlp_data, _mlp_step, _wide_mlp

SPEC = "v100-16gb-pcie3"
MiB = 2**20


def _mlp_ir():
    """The wide MLP's step with Adam (built first, so its slots are variables, not initial values)."""
    model, optimizer = _wide_mlp(), keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    return build_ir(tf.function(_mlp_step(model, optimizer)).get_concrete_function(*_mlp_data()).graph), model


def _plan(ir, budget):
    return make_budget_plan(ir, Policies(host="/CPU:1", budget=budget, weights="auto"), device="/device:CPU:0",
                            cost=CostModel(get_device_spec(SPEC)))


def _needed(ir, plan):
    """What the plan holds on the device: the variables that stay, plus the simulated transient peak."""
    kept = sum(w.nbytes for w in plan.weights if w.decision is lms_tf.Decision.KEEP)
    return kept + max(plan.predictions.planned_peak_bytes, plan.predictions.planned_allocator_peak_bytes or 0)


@pytest.mark.timeout(300)
def test_the_planner_moves_nothing_when_the_budget_fits_some_when_it_must_and_says_when_nothing_fits():
    ir, model = _mlp_ir()
    weights = sum(np.array(v).nbytes for v in model.trainable_variables)  # 22 MiB; the step's transient ~24 MiB
    roomy = _plan(ir, 80 * MiB)
    assert not roomy.offloaded_weights and len(roomy.weights) == 14
    assert all(w.reason.startswith("weights='auto': stays on the device") for w in roomy.weights)

    tight = _plan(ir, 40 * MiB)
    assert 0 < len(tight.offloaded_weights) < len(tight.weights)
    assert _needed(ir, tight) <= tight.budget_bytes == 40 * MiB
    assert tight.predictions.planned_peak_bytes + weights > 40 * MiB  # all of them resident would not fit
    with pytest.raises(lms_tf.InfeasibleBudgetError):   # nor does the same budget with the weights on the device
        make_budget_plan(ir, Policies(host="/CPU:1", budget=40 * MiB - weights), device="/device:CPU:0",
                         cost=CostModel(get_device_spec(SPEC)))

    with pytest.raises(lms_tf.InfeasibleBudgetError, match=r"with every variable on the host \(weights='auto' "
                                                           r"counts them\) still needs"):
        _plan(ir, 4 * MiB)


@pytest.mark.timeout(300)
def test_the_planner_moves_no_variable_it_does_not_need():
    """Keeping any one of the chosen variables on the device instead leaves the step over the
    budget, or makes it slower: the planner does not move weights it does not need to (each costs
    copies). The planner tries at most KEEP_BACK_TRIES such sets; fewer are chosen here."""
    ir, _ = _mlp_ir()
    budget = 40 * MiB
    plan = _plan(ir, budget)
    step = PlanningStep.build(ir, Policies(host="/CPU:1", budget=budget, weights="auto"), device="/device:CPU:0",
                              cost=CostModel(get_device_spec(SPEC)))
    chosen = frozenset(w.variable for w in plan.offloaded_weights)
    assert 0 < len(chosen) <= KEEP_BACK_TRIES
    for variable in sorted(chosen):
        fewer = step.with_offloaded(chosen - {variable})
        sim = BudgetSearch(fewer).fit(budget - fewer.resident)[1]
        assert (fewer.resident + sim.held_bytes > budget
                or sim.step_time_s > plan.predictions.predicted_step_time_s), variable
    # The order: the least link time per byte freed first (a weight read in one window before one
    # read forward and backward, among equal sizes).
    kernels = [w for w in offload_order(step) if len(w.shape) == 2 and w.shape[0] == w.shape[1] == 1024]
    assert [len(w.fetches) for w in kernels] == sorted(len(w.fetches) for w in kernels)


def _custom_loop_run(lms, budget=None, steps=10):
    model, optimizer = _wide_mlp(), keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = _mlp_step(model, optimizer)
    fn = (lms_tf.function(step, **CPU_LMS, weights="auto", budget=budget, device_spec=SPEC) if lms
          else tf.function(step))
    rng = np.random.default_rng(7)
    batches = [(tf.constant(rng.random((16, 512), dtype=np.float32)), tf.constant(rng.integers(0, 10, 16)))
               for _ in range(3)]
    losses = [float(fn(*batches[i % 3])) for i in range(steps)]
    return losses, [np.array(w) for w in model.get_weights()], fn, model, batches[0]


@pytest.mark.timeout(600)
def test_a_custom_loop_with_weights_auto_equals_plain_and_fetches_exactly_the_planned_variables():
    plain = _custom_loop_run(False)
    rewritten = _custom_loop_run(True, budget=40 * MiB)
    assert_same_numbers(plain, rewritten)
    fn, model = rewritten[2], rewritten[3]
    plan = fn.plan
    assert 0 < len(plan.offloaded_weights) < len(model.trainable_variables)
    # The variables the plan put on the host live there; the others stay on the device.
    on_host = sorted(v.path for v in model.trainable_variables if variable_device(v).endswith("CPU:1"))
    assert len(on_host) == len(plan.offloaded_weights), on_host
    # Structure: one gated fetch per window of each variable on the host, none for the others.
    graph = fn.get_concrete_function(*rewritten[4]).graph
    fetches = [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "weight_fetch"]
    assert len(fetches) == plan.num_weight_fetches
    fetched = {op.inputs[0].name for op in fetches}
    kept = {w.variable for w in plan.weights if w.decision is lms_tf.Decision.KEEP}
    assert fetched and not fetched & kept


@pytest.mark.timeout(600)
def test_fit_with_weights_auto_equals_plain_fit():
    def builder():
        model = _wide_mlp()
        model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        rng = np.random.default_rng(5)
        return model, (rng.random((48, 512), dtype=np.float32), rng.integers(0, 10, 48))

    plain = fit_steps(builder)
    callback = lms_tf.LMSCallback(**CPU_LMS, weights="auto", budget=40 * MiB, device_spec=SPEC)
    rewritten = fit_steps(builder, callbacks=[callback])
    assert_same_numbers(plain, rewritten)
    plan = callback.plan
    assert 0 < len(plan.offloaded_weights) < len(plan.weights), lms_tf.explain(callback)
    model = rewritten[2]
    assert 0 < sum(variable_device(v).endswith("CPU:1") for v in model.trainable_variables) \
        < len(model.trainable_variables)
    # The optimizer's moments live on the host, whatever happens to the weights.
    moments = [v for v in model.optimizer.variables if "moment" in v.path or "velocity" in v.path]
    assert moments and all(variable_device(v).endswith("CPU:1") for v in moments)


def test_weights_auto_needs_a_budget():
    with pytest.raises(lms_tf.LMSOptionError, match=r"weights='auto' lets the budget planner choose .* needs a "
                                                    r"budget; received budget=None"):
        lms_tf.LMSCallback(weights="auto")
    with pytest.raises(lms_tf.LMSOptionError, match=r"weights must be 'device', 'host' or 'auto'; received 'some'"):
        lms_tf.function(lambda: None, weights="some")
