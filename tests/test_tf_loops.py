"""Recurrent layers: a ``While`` loop's accumulated per-step values, swapped or recomputed.

On a CPU each Keras recurrent layer is a ``While`` loop. Its gradient loop reads TensorLists the
forward loop filled, one element per step; the trace sizes them (element dtype and shape times
the trip count), so the planner moves them like any activation: swapped to the host after the
forward loop, or the whole loop run again (cloned) just before its gradient loop.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.tf.rewrite import LMS_ATTR
from lms_tf.tf.rewrite.recompute import CLONE_OF_ATTR
from lms_tf.tf.trace import build_ir
from tests import zoo
from tests.allocator_runs import run_allocator_worker
from tests.helpers import CPU_LMS, assert_same_numbers, behind_device_read, fit_steps, keras_train_step

SWAP = dict(CPU_LMS, min_swap_bytes=1024, swapout_threshold=1)
RECOMPUTE = dict(device="/CPU:0", swap=False, recompute="sqrt")
MODES = {"swap": SWAP, "recompute": RECOMPUTE}


def _is_loop_value(name: str) -> bool:
    return "/while:" in name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(zoo.RECURRENT_ZOO))
def test_recurrent_fit_with_loop_values_moved_equals_plain(name, mode):
    builder = zoo.RECURRENT_ZOO[name]
    plain = fit_steps(builder)
    callback = lms_tf.LMSCallback(**MODES[mode])
    rewritten = fit_steps(builder, callbacks=[callback])
    plan = callback.plan
    moved = [d for d in plan.swapped + plan.recomputed if _is_loop_value(d.tensor)]
    assert moved, lms_tf.explain(callback)
    if mode == "swap":
        assert any(_is_loop_value(d.tensor) for d in plan.swapped)
    if mode == "recompute":
        assert any(op.endswith("/while") for d in plan.recomputed for op in d.recompute_ops)
    assert_same_numbers(plain, rewritten)


def _traced(builder, **options):
    model, (x, y) = builder()
    fn = lms_tf.function(keras_train_step(model), **options)
    graph = fn.get_concrete_function(tf.constant(x[:zoo.BATCH]), tf.constant(y[:zoo.BATCH])).graph
    return fn, graph, model


@pytest.mark.timeout(300)
def test_loop_accumulators_are_sized_from_their_elements_and_variable_reads_are_not_counted():
    fn, graph, model = _traced(zoo.stacked_recurrent, **RECOMPUTE)
    ir = fn.plain_irs[-1]
    loops = [op for op in ir.ops if op.type == "While" and op.phase.value == "forward"]
    assert len(loops) == 3 and all(op.reads_state_only for op in loops)
    lists = [ir.tensors[t.name] for op in loops for i, t in enumerate(graph.get_operation_by_name(op.name).outputs)
             if t.dtype == tf.variant and t.op.inputs[i].op.type in ("EmptyTensorList", "TensorListReserve")]
    assert lists and all(t.nbytes is not None for t in lists)  # every accumulator of these loops is sized
    sized = [t for t in lists if t.nbytes]
    # Per-step activations: (steps, batch, units) float32 for the units-wide gates and states.
    assert any(t.shape == (20, zoo.BATCH, 32) and t.dtype == "float32" for t in sized)
    assert all(t.shape[0] == 20 for t in sized if t.dtype == "float32")
    # A weight read inside the body is pushed every step but shares the variable's buffer: never
    # counted as (steps, *kernel shape).
    kernels = {tuple(v.shape) for v in model.trainable_variables if len(v.shape) == 2}
    assert not any(t.shape[1:] in kernels for t in sized), [t.shape for t in sized]
    assert any(t.shape[1:] in kernels and t.nbytes == 0 for t in lists)


@pytest.mark.timeout(300)
def test_a_recomputed_loop_is_cloned_gated_without_control_inputs_and_reads_the_same_variables():
    fn, graph, _ = _traced(zoo.stacked_recurrent, **RECOMPUTE)
    clones = [op for op in graph.get_operations()
              if _compat.string_attr(op, LMS_ATTR) == "recompute" and op.type == "While"]
    assert clones, lms_tf.explain(fn)
    gates = {d.gate for d in fn.plan.recomputed}
    for clone in clones:
        original = graph.get_operation_by_name(_compat.string_attr(clone, CLONE_OF_ATTR))
        assert original.type == "While" and clone.get_attr("body").name == original.get_attr("body").name
        # No control input (tf.function's automatic control dependencies would otherwise order it
        # after the optimizer's writes); the first input waits for the gate through an Identity.
        assert not clone.control_inputs
        gate = clone.inputs[0].op
        assert _compat.string_attr(gate, LMS_ATTR) == "recompute_gate"
        assert {c.name for c in gate.control_inputs} <= gates and gate.inputs[0] is original.inputs[0]
        for i, t in enumerate(clone.inputs):
            if t.dtype == tf.resource:  # the variables, through the loop's own pass-through outputs
                assert t is original.outputs[i]
        # The gradient loop reads the recomputed lists from the clone, no longer from the forward loop.
        readers = [c for out in clone.outputs for c in out.consumers()]
        assert any(r.type in ("While", "StatelessWhile") and r.name.startswith("gradient_tape/") for r in readers)
    for decision in fn.plan.recomputed:
        for consumer in decision.consumers:
            assert decision.tensor not in [t.name for t in graph.get_operation_by_name(consumer).inputs]


@pytest.mark.timeout(300)
def test_swapped_loop_values_reach_the_gradient_loop_through_gated_swap_ins():
    fn, graph, _ = _traced(zoo.stacked_recurrent, **SWAP)
    swapped = [d for d in fn.plan.swapped if _is_loop_value(d.tensor)]
    assert swapped, lms_tf.explain(fn)
    for decision in swapped:
        out = graph.get_tensor_by_name(decision.tensor)
        assert out.dtype == tf.variant  # the TensorList itself goes to the host and back
        for consumer in decision.consumers:
            reads = graph.get_operation_by_name(consumer).inputs
            swap_ins = [behind_device_read(t.op) for t in reads]
            swap_ins = [op for op in swap_ins if _compat.string_attr(op, LMS_ATTR) == "swap_in"]
            assert swap_ins and all(op.device.endswith("CPU:1") and op.control_inputs for op in swap_ins)


def deep_recurrent(layers=4, steps=100, features=32, units=128):
    zoo.reseed(0)
    inputs = keras.Input((steps, features))
    x = inputs
    for i in range(layers):
        cell = keras.layers.GRU if i % 2 == 0 else keras.layers.LSTM
        x = cell(units, return_sequences=True)(x)
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x)))


def small_stack():
    """A 3-layer GRU/LSTM/GRU stack over 40 steps, compiled, and one batch of 32."""
    model = deep_recurrent(layers=3, steps=40, features=16, units=64)
    model.compile(keras.optimizers.SGD(0.01))
    rng = np.random.RandomState(1)
    return model, tf.constant(rng.rand(32, 40, 16).astype("float32")), tf.constant(rng.randint(0, 4, 32))


@pytest.mark.timeout(300)
def test_recomputing_stacked_loops_lowers_the_real_cpu_allocator_peak():
    rng = np.random.RandomState(0)
    x, y = tf.constant(rng.rand(64, 100, 32).astype("float32")), tf.constant(rng.randint(0, 4, 64))
    peaks = {}
    for name, decorate in (("plain", tf.function), ("sqrt", lambda f: lms_tf.function(f, **RECOMPUTE))):
        model = deep_recurrent()
        model.compile(keras.optimizers.SGD(0.01))
        fn = decorate(keras_train_step(model))
        fn(x, y).numpy()
        fn(x, y).numpy()
        with lms_tf.measure_peak_memory("CPU:0", settle_seconds=0.3) as memory:
            fn(x, y).numpy()
        peaks[name] = memory.peak_bytes
        if name == "sqrt":
            assert sum(op.endswith("/while") for d in fn.plan.recomputed for op in d.recompute_ops) >= 3
    # Measured 109 -> 57 MiB: each layer's per-step values live only around its own gradient loop.
    assert peaks["sqrt"] <= 0.7 * peaks["plain"], {k: v / 2**20 for k, v in peaks.items()}


@pytest.mark.timeout(300)
def test_a_budget_is_met_on_a_recurrent_model_by_moving_loop_values():
    model, x, y = small_stack()
    fn = lms_tf.function(keras_train_step(model), budget="60%", device_spec="v100-16gb-pcie3", **CPU_LMS)
    fn.get_concrete_function(x, y)
    plan = fn.plan
    assert plan.predictions.feasible and plan.predictions.planned_peak_bytes <= 0.6 * plan.predictions.baseline_peak_bytes
    assert any(_is_loop_value(d.tensor) for d in plan.swapped + plan.recomputed), lms_tf.explain(fn)


def lstm_sequence_model():
    """A held-out model for the simulator's loop rules (they were read from a GRU's traces)."""
    inputs = keras.Input((100, 32))
    x = keras.layers.LSTM(128, return_sequences=True)(inputs)
    return keras.Model(inputs, keras.layers.Dense(100, activation="softmax")(keras.layers.GlobalAveragePooling1D()(x)))


@pytest.mark.timeout(900)
def test_the_simulator_predicts_recurrent_steps_within_ten_percent_of_the_real_allocator():
    # One process per model and order (the allocator's history stays out of the next peak).
    # StackedRNN is an embedding, a bidirectional GRU, an LSTM and a GRU; LSTM is a single layer.
    specs = ("StackedRNN,100,64", "tests.test_tf_loops:lstm_sequence_model,100,64")
    serialized = run_allocator_worker("--order", "serialized", "--step", "plain", *specs, timeout=580)
    free = run_allocator_worker("--step", "plain", *specs, timeout=580)
    in_order = {row["model"]: row["plain_serialized"]["blind_allocator"] / row["plain_serialized"]["real"]
                for row in serialized}
    tensors = {row["model"]: row["plain_serialized"]["blind"] / row["plain_serialized"]["real_requested"]
               for row in serialized}
    ratios = {row["model"]: row["plain"]["blind_allocator"] / row["plain"]["real"] for row in free}
    # Serialized (the simulator's order imposed, the prediction is of the run measured), in tensor
    # bytes (the simulator's live tensors against the most bytes the real allocations asked for at
    # once): measured 0.893-0.896 (StackedRNN) and 1.004-1.007 (LSTM) over five processes, each
    # with 0 inversions. Counting each pushed weight read as a copy gave 2.1. The stacked model's
    # lower bound is 0.85: the simulator treats a loop as one op whose peak is at its end
    # (docs/limits.md), 10% under the real peak of four stacked loops. It read 0.93 while the IR
    # still counted Keras's probing step of each cell outside its loop, which TensorFlow prunes: a
    # wrong op that hid part of that gap.
    assert 0.85 <= tensors["StackedRNN"] <= 1.1 and all(
        0.97 <= r <= 1.03 for m, r in tensors.items() if m != "StackedRNN"), tensors
    # The same runs as the allocator counts them (whole chunks): 0.909-0.915 (StackedRNN) and
    # 0.995-1.095 (LSTM; 1.105 in one CI run). The LSTM's spread is the allocator's, not the
    # order's: for the same requests (30.5-30.6 MB) its chunks at the peak came to 30.7-33.8 MB,
    # because BFC hands a request a free chunk whole unless the chunk is at least twice the
    # request (the loop's 3.3 MB TensorListStack took a 5.7 MB chunk in some processes), and
    # which free chunks exist depends on the order the loop's iterations freed theirs. The
    # simulator's allocator model adds one fixed rounding (33.6 MB); the bound above 1.1 is that
    # measured spread.
    assert 0.85 <= in_order["StackedRNN"] <= 1.1 and all(
        0.9 <= r <= 1.12 for m, r in in_order.items() if m != "StackedRNN"), in_order
    # TensorFlow's own order: it changes from run to run (five orders in five runs of one process
    # here) and the real peak with it. Measured 0.90-0.92 (StackedRNN) and 1.02-1.10 (LSTM) over
    # processes, the LSTM's runs all at 1.10 in one process: the same spread as the held-out free-order
    # table's (max/min up to 1.09 over five processes). Above by that spread, never below 0.85.
    assert all(0.85 <= r <= 1.1 * 1.09 for r in ratios.values()), ratios


@pytest.mark.timeout(300)
def test_a_loop_with_a_run_time_trip_count_is_named_when_a_budget_cannot_be_met():
    w = tf.Variable(tf.ones((64, 64)) * 0.01)

    @tf.autograph.experimental.do_not_convert
    def step(x):
        with tf.GradientTape() as tape:
            steps = tf.cast(tf.reduce_sum(x) * 0.0 + 30.0, tf.int32)  # known only when the step runs
            _, h = tf.while_loop(lambda i, h: i < steps, lambda i, h: (i + 1, tf.tanh(h @ w)), [tf.constant(0), x])
            loss = tf.reduce_sum(h)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        return loss

    graph = tf.function(step).get_concrete_function(tf.TensorSpec((128, 64))).graph
    ir = build_ir(graph)
    lists = [t.name for op in graph.get_operations() if op.type == "While" and not op.name.startswith("gradient")
             for t in op.outputs if t.dtype == tf.variant]
    assert lists and all(ir.tensors[t].nbytes is None for t in lists)
    fn = lms_tf.function(step, budget="30%", device_spec="v100-16gb-pcie3", **CPU_LMS)
    with pytest.raises(lms_tf.InfeasibleBudgetError, match=r"Loops 'while' keep per-iteration values whose size "
                                                           r"is not static.*maximum_iterations"):
        fn(tf.ones((128, 64)))


@pytest.mark.timeout(300)
def test_the_simulator_shows_the_saving_of_swapping_loop_values():
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.simulate import simulate

    model, x, y = small_stack()
    fn = lms_tf.function(keras_train_step(model), **SWAP)
    fn.get_concrete_function(x, y)
    loops = [d for d in fn.plan.swapped if _is_loop_value(d.tensor)]
    assert loops, lms_tf.explain(fn)
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    plain = simulate(fn.plain_irs[-1], None, cost=cost)
    swapped = simulate(fn.plain_irs[-1], fn.plan, cost=cost)
    # On a GPU the swapped lists leave the device between the two loops (a CPU run moves no bytes).
    # Every swapped list is live at the plain peak; the swapped step's peak (now while they come
    # back) is lower by at least 30% of their bytes.
    assert swapped.peak_bytes <= plain.peak_bytes - 0.3 * sum(d.nbytes for d in loops), (plain.peak_bytes,
                                                                                       swapped.peak_bytes)
    assert swapped.swap_out_bytes >= sum(d.nbytes for d in loops)
