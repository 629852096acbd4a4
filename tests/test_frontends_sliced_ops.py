"""Max-pool gradients run a slice of the batch at a time (``Plan.sliced``), rewritten.

The front-ends' own plans, with every max-pool gradient whose input is swapped sliced
(:func:`lms_tf.planner.slicing.slice_op`), must train exactly as the plain step, with the
slices, their gated copies and the concatenation in the graph, the whole op gone from what runs,
and each slice's copy leaving the host only after the slice two before it ended. On logical CPUs
the copies move no bytes, but the executor orders them as on a GPU. The simulator's side (how
much less the sliced op holds): tests/test_planner_slicing.py.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.policy import Policies
from lms_tf.planner.slicing import slice_op
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import Tools, assemble
from lms_tf.tf import driver
from lms_tf.tf.diagnostics import executed_ops, find_executed
from lms_tf.tf.rewrite import LMS_ATTR
from tests import zoo
from tests.helpers import BATCH, CPU_LMS, assert_same_numbers, custom_loop, first_batch, fit_steps, lms_function

OPTIONS = dict(CPU_LMS, budget="80%", recompute=False, device_spec="v100-16gb-pcie3", min_swap_bytes=0)
#: Uneven slices (BATCH is not a multiple of 3): the last ones are one example shorter.
SLICES = 3


def sliced_pool_gradients(ir, plan, request):
    """``plan`` with each max-pool gradient's input swapped, and the gradient sliced into
    :data:`SLICES` (copied in a slice at a time)."""
    step = PlanningStep.build(ir, Policies.from_dict(plan.policies), device=request.device,
                              cost=request.cost_model())
    grads = [op for op in ir.ops if op.type == "MaxPoolGrad"]
    swapped = {d.tensor for d in plan.swapped} | {op.inputs[0] for op in grads if op.inputs[0] in step.found.eligible}
    made = assemble(step, swapped, {}, Tools(), plan.orderings, weights=plan.weights)
    plan = dataclasses.replace(plan, decisions=made.decisions, orderings=made.orderings)
    for op in grads:
        plan = slice_op(plan, ir, op.name, SLICES, reason="test")
    return plan


@pytest.fixture
def sliced_plans(monkeypatch):
    planned = driver._make_plan
    monkeypatch.setattr(driver, "_make_plan", lambda ir, request, aliases, **kwargs: sliced_pool_gradients(
        ir, planned(ir, request, aliases, **kwargs), request))


def _by_kind(graph, kind):
    return [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == kind]


@pytest.mark.timeout(300)
def test_a_custom_loop_with_its_pool_gradient_sliced_equals_plain_and_runs_the_slices_in_order(sliced_plans):
    plain = custom_loop(zoo.sequential_cnn, tf.function)
    rewritten = custom_loop(zoo.sequential_cnn, lms_function(**OPTIONS))
    assert_same_numbers(plain, rewritten)
    fn = rewritten[2]
    plan = fn.plan
    assert len(plan.sliced) == 1, plan.summary()
    sliced = plan.sliced[0]
    assert sliced.slices == SLICES and sliced.from_host, sliced
    xb, yb = first_batch(zoo.sequential_cnn)
    graph = fn.get_concrete_function(xb, yb).graph
    # Structure: one clone per slice, reading a gated host slice of the swapped input; their
    # concatenation is what the op's readers read; the op itself has no reader left.
    clones = sorted(_by_kind(graph, "slice"), key=lambda op: op.get_attr("_lms_slice"))
    assert [op.type for op in clones] == ["MaxPoolGrad"] * SLICES
    sizes = [op.outputs[0].shape[0] for op in clones]
    assert sizes == [len(range(i, BATCH, SLICES)) for i in range(SLICES)], sizes
    copies = _by_kind(graph, "slice_in")
    assert len(copies) == SLICES * len(sliced.from_host)
    for copy in copies:
        assert any(_compat.string_attr(c, LMS_ATTR) == "swap_gate" for c in copy.control_inputs), copy.name
    for clone in clones:
        read = clone.inputs[0]
        assert _compat.string_attr(read.op, LMS_ATTR) == "device_read", read.name
        assert _compat.string_attr(read.op.inputs[0].op, LMS_ATTR) == "slice_part", read.op.inputs[0].name
    concat, = _by_kind(graph, "slice_concat")
    assert [t.op for t in concat.inputs[:SLICES]] == clones
    assert _compat.is_dead_end(graph.get_operation_by_name(sliced.op))
    assert concat.outputs[0].consumers()
    # Executed order: the whole op does not run; slice i's copy leaves the host after slice i-2
    # ended, and each slice runs after its copy.
    events = executed_ops(lambda: fn(xb, yb))
    ran = [find_executed(events, clone.name) for clone in clones]
    assert all(ran), [clone.name for clone, event in zip(clones, ran) if event is None]
    assert not [e for e in events if e.type == "MaxPoolGrad" and not e.node.split("/")[-1].startswith(
        sliced.op.split("/")[-1] + "-lms_slice_")], [e.node for e in events if e.type == "MaxPoolGrad"]
    for i in range(2, SLICES):
        sends = [e for e in events if "slice_in_" in e.node and e.node.endswith(f"_{i}") and e.type == "Slice"]
        assert sends, i
        assert ran[i - 2].end_ps <= sends[0].start_ps, (i, ran[i - 2], sends[0])
        assert sends[0].end_ps <= ran[i].start_ps, i


@pytest.mark.timeout(300)
@pytest.mark.parametrize("builder", [zoo.inception_style, zoo.sequential_cnn], ids=["overlapping_windows", "cnn"])
def test_fit_with_pool_gradients_sliced_equals_plain(sliced_plans, builder):
    """Through ``model.fit``; the inception-style model's 3x3 stride-1 pools have overlapping
    windows, where one input's gradient sums several windows' contributions."""
    import lms_tf

    plain = fit_steps(builder)
    callback = lms_tf.LMSCallback(**dict(OPTIONS, budget="95%"))
    rewritten = fit_steps(builder, callbacks=[callback])
    assert_same_numbers(plain, rewritten)
    assert any(p is not None and p.sliced for p in callback.plans), [p and p.summary() for p in callback.plans]


@pytest.mark.timeout(300)
def test_a_saved_sliced_plan_applies_and_a_bad_edit_is_refused_before_the_step_runs(sliced_plans, monkeypatch,
                                                                                    tmp_path):
    """The sliced plan saved as JSON and given back with ``plan=`` trains as the plain step; the
    same file edited to more slices than the batch has is refused with the library's error."""
    import lms_tf

    rewritten = custom_loop(zoo.sequential_cnn, lms_function(**OPTIONS))
    plan = rewritten[2].plan
    assert plan.sliced
    monkeypatch.undo()  # planning no longer happens: the file decides
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    plain = custom_loop(zoo.sequential_cnn, tf.function)
    again = custom_loop(zoo.sequential_cnn, lms_function(**CPU_LMS, plan=str(path)))
    assert_same_numbers(plain, again)
    assert again[2].plan.sliced == plan.sliced
    bad = dataclasses.replace(plan, sliced=(dataclasses.replace(plan.sliced[0], slices=BATCH + 1),))
    path.write_text(bad.to_json())
    with pytest.raises(lms_tf.LMSOptionError, match=f"between 2 and its batch of {BATCH}"):
        custom_loop(zoo.sequential_cnn, lms_function(**CPU_LMS, plan=str(path)))


@pytest.mark.timeout(300)
def test_serialized_the_concatenation_takes_the_ops_place_and_the_whole_op_stays_out(sliced_plans):
    """``serialize=True`` chains the step's compute ops in the simulated order: the concatenation
    of the slices is chained where the simulator ran the op, nothing chains the sliced op itself
    back in (it would run whole), and the numbers are the plain step's."""
    plain = custom_loop(zoo.sequential_cnn, tf.function)
    rewritten = custom_loop(zoo.sequential_cnn, lms_function(**OPTIONS, serialize=True))
    assert_same_numbers(plain, rewritten)
    fn = rewritten[2]
    sliced = fn.plan.sliced[0]
    xb, yb = first_batch(zoo.sequential_cnn)
    graph = fn.get_concrete_function(xb, yb).graph
    assert _compat.is_dead_end(graph.get_operation_by_name(sliced.op))
    # The concatenation takes the op's place in the chain (the simulator calls it by the op's name).
    concat, = _by_kind(graph, "slice_concat")
    assert "_lms_serial" in concat.node_def.attr
    events = executed_ops(lambda: fn(xb, yb))
    ran = [e.node for e in events if e.type == "MaxPoolGrad"]
    assert len(ran) == SLICES and all("-lms_slice_" in node for node in ran), ran


def _pool_heavy_step():
    """A CNN whose max pool's gradient needs the most at once: 8 input channels, 64 after the
    first convolution (64 MiB at batch 16), pooled to 16 MiB."""
    import keras

    zoo.reseed()
    model = keras.Sequential([keras.Input((128, 128, 8)), keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                              keras.layers.MaxPool2D(), keras.layers.Conv2D(64, 3, padding="same"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    return step, tf.constant(rng.standard_normal((16, 128, 128, 8), dtype=np.float32)), tf.zeros((16,), tf.int32)


@pytest.mark.timeout(300)
def test_grappler_judges_a_sliced_step_within_its_bounds(monkeypatch):
    """Grappler's virtual GPU, told the variable shapes, on the serialized step (the simulator's
    order) the budget search slices (the pool gradient holds 160 MiB run whole; 85% is 136 MiB).
    Grappler frees the 16 slices 1 ns after the concatenation ends, beside what its reader then
    allocates (:attr:`~lms_tf.tf.diagnostics.OraclePeak.released_bytes`), and gives the swap-in's
    read a buffer of its own besides the one it received (counted once since this test): the
    peak as TensorFlow would hold it is between its figure with those slices released and its
    step peak. The simulator's is in that range (128 MiB; Grappler 136 and 200)."""
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.simulate import simulate
    from lms_tf.tf.diagnostics import virtual_gpu_peak_report

    import lms_tf

    monkeypatch.setenv("TF_CUDNN_WORKSPACE_LIMIT_IN_MB", "8")   # the convolutions' gradients stay below the pool's
    step, x, y = _pool_heavy_step()
    fn = lms_tf.function(step, device="/CPU:0", host="/CPU:1", budget="85%", device_spec="v100-16gb-pcie3",
                         serialize=True, min_swap_bytes=0)
    concrete = fn.get_concrete_function(x, y)
    assert [s.slices for s in fn.plan.sliced] == [16], fn.plan.summary()
    simulated = simulate(fn.plain_irs[-1], fn.plan, cost=CostModel(get_device_spec("v100-16gb-pcie3"))).peak_bytes
    report = virtual_gpu_peak_report(concrete, variable_shapes=True)
    MiB = 2**20
    slices = [nbytes for node, _, nbytes in report.live if node.rpartition("-lms_slice_")[2].isdigit()]
    # the slices, and a scalar or two released by the same op's end
    assert len(slices) == 16 and sum(slices) == 64 * MiB <= report.released_bytes < 65 * MiB, report
    assert report.step_bytes_released_first <= simulated * 1.1 and simulated <= report.step_peak_bytes, (
        report.step_bytes_released_first / MiB, simulated / MiB, report.step_peak_bytes / MiB)
    assert simulated < 160 * MiB   # less than the pool gradient run whole
