"""Structure, executed order and GPU-memory oracle of the swap rewrite."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core.errors import RewriteError
from lms_tf.core.ir import Phase
from lms_tf.tf.diagnostics import executed_ops, find_executed, virtual_gpu_peak
from lms_tf.tf.rewrite import LMS_ATTR, apply_plan, count_lms_ops
from lms_tf.tf.trace import build_ir
from tests import zoo
from tests.helpers import CPU_LMS, device_readers


def toy_cnn():
    """The 8-conv toy of docs/design.md's Grappler measurements: batch 32, 64x64x3, eight 32-channel 3x3 convs."""
    zoo.reseed(1)
    model = keras.Sequential([keras.Input((64, 64, 3))] + [
        keras.layers.Conv2D(32, 3, padding="same", activation="relu") for _ in range(8)] + [
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    return model, keras.optimizers.SGD(0.01)


def toy_step(model, optimizer):
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            step.logits_op = logits.op.name
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


@pytest.fixture(scope="module")
def toy():
    x = tf.constant(np.random.RandomState(0).rand(32, 64, 64, 3).astype("float32"))
    y = tf.constant(np.random.RandomState(1).randint(0, 4, 32).astype("int32"))
    plain = tf.function(toy_step(*toy_cnn()))
    rewritten = lms_tf.function(toy_step(*toy_cnn()), **CPU_LMS)
    for _ in range(2):
        assert float(plain(x, y)) == float(rewritten(x, y))
    return plain, rewritten, x, y


@pytest.mark.timeout(240)
def test_inserted_ops_match_the_plan(toy):
    _, fn, x, y = toy
    plan = fn.plan
    graph = fn.get_concrete_function(x, y).graph
    assert len(plan.swapped) >= 6
    assert count_lms_ops(graph) == {"swap_out": len(plan.swapped), "swap_in": plan.num_swap_ins,
                                    "device_read": plan.num_swap_ins, "swap_gate": 2 * plan.num_swap_ins,
                                    "marker": 1}
    host = tf.DeviceSpec.from_string(CPU_LMS["host"])
    for op in graph.get_operations():
        kind = _compat.string_attr(op, LMS_ATTR)
        if kind in ("swap_out", "swap_in"):
            assert tf.DeviceSpec.from_string(op.device).device_index == host.device_index
            assert op.get_attr("_grappler_do_not_remove") is True


@pytest.mark.timeout(240)
def test_each_swap_in_is_gated_by_an_earlier_backward_trigger_through_a_data_edge(toy):
    _, fn, x, y = toy
    graph = fn.get_concrete_function(x, y).graph
    swapped = {d.tensor: d for d in fn.plan.swapped}
    # Phases and positions come from the plan's own view of the unrewritten step.
    order = {}
    for op in graph.get_operations():
        if not op.name.startswith("lms_tf/"):
            order[op.name] = len(order)
    for swap_in in [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "swap_in"]:
        (gate,) = swap_in.control_inputs
        assert _compat.string_attr(gate, LMS_ATTR) == "swap_gate"
        assert gate.device == swap_in.device  # the only control edge stays on the host
        shape = gate.inputs[0].op
        assert shape.type == "Shape" and _compat.string_attr(shape, LMS_ATTR) == "swap_gate"
        trigger = shape.inputs[0].op
        assert trigger.name.startswith("gradient_tape/")
        swap_out = swap_in.inputs[0].op
        assert _compat.string_attr(swap_out, LMS_ATTR) == "swap_out"
        original = swap_out.inputs[0]
        assert original.name in swapped
        consumers = device_readers(swap_in)
        assert consumers and all(c.name.startswith("gradient_tape/") for c in consumers)
        assert all(order[trigger.name] < order[c.name] for c in consumers)
        assert not any(t is original for c in consumers for t in c.inputs)


@pytest.mark.timeout(240)
def test_no_variable_read_or_function_input_is_swapped(toy):
    _, fn, x, y = toy
    graph = fn.get_concrete_function(x, y).graph
    inputs = {t.op.name for t in graph.inputs}
    for op in graph.get_operations():
        if _compat.string_attr(op, LMS_ATTR) == "swap_out":
            source = op.inputs[0].op
            assert source.type not in ("ReadVariableOp", "Placeholder") and source.name not in inputs
    kept = fn.plan.kept_reasons()
    assert kept.get("variable read", 0) > 0 and kept.get("function input", 0) > 0


@pytest.mark.timeout(240)
def test_rewriting_twice_is_refused(toy):
    _, fn, x, y = toy
    graph = fn.get_concrete_function(x, y).graph
    ir = build_ir(graph)
    with pytest.raises(RewriteError, match="already rewritten"):
        apply_plan(graph, ir, fn.plan)


@pytest.mark.timeout(240)
def test_executed_order_swap_out_in_forward_swap_in_after_trigger_before_consumer(toy):
    """TensorFlow's profiler shows when each swap crossed the device boundary.

    Identity kernels are not traced, but the host->device ``_Send`` of each swap-in
    (named after it) and the device->host ``_Send`` of each swapped tensor are.
    """
    _, fn, x, y = toy
    events = executed_ops(lambda: fn(x, y))
    graph = fn.get_concrete_function(x, y).graph
    # The logits end the forward pass: every gradient op depends on them.
    logits = find_executed(events, fn.python_function.logits_op)
    assert logits is not None, "the op computing the logits must appear in the profile"
    sends = [e for e in events if e.type == "_Send"]

    def send_of(op_name):
        matches = [e for e in sends if e.node.rsplit("/_", 1)[0].endswith(op_name)]
        assert matches, f"no transfer of {op_name} was executed"
        return min(matches, key=lambda e: e.start_ps)

    checked = 0
    swap_outs = {}
    for swap_in in [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "swap_in"]:
        swap_out = swap_in.inputs[0].op
        original = swap_out.inputs[0]
        # Nothing but the tensor itself holds a swap-out back: the graph lets it start at once.
        assert not swap_out.control_inputs, swap_out.name
        swap_out_transfer = send_of(original.op.name)
        gate_transfer = send_of(swap_in.control_inputs[0].inputs[0].op.name)
        swap_in_transfer = send_of(swap_in.name)
        swap_outs[original.op.name] = swap_out_transfer
        assert swap_out_transfer.start_ps < swap_in_transfer.start_ps
        # swap-in: only in the backward pass, after its trigger's gate, before its consumers.
        assert swap_in_transfer.start_ps > logits.end_ps
        assert swap_in_transfer.start_ps >= gate_transfer.start_ps
        trigger = find_executed(events, swap_in.control_inputs[0].inputs[0].op.inputs[0].op.name)
        if trigger is not None:
            assert gate_transfer.start_ps >= trigger.end_ps
        for consumer in device_readers(swap_in):
            ran = find_executed(events, consumer.name)
            if ran is not None:
                assert ran.start_ps >= swap_in_transfer.start_ps
                checked += 1
    assert checked >= len(fn.plan.swapped), "too few consumers were seen executing to prove the order"
    # swap-out: each tensor left the device during the forward pass, before the logits existed.
    # The graph does not order a ready _Send against the forward ops still to run; the executor
    # starts it when an inter-op thread is free (here 20-130 us after its producer). The tensor
    # the forward pass makes last has only the pooling and the dense layer (about 1 ms) before
    # the logits, and with two pytest workers on two cores its send once started 0.2 ms after
    # them; every other swapped tensor has at least one more convolution (14 ms or more).
    last_made = max(swap_outs, key=lambda name: find_executed(events, name).end_ps)
    for name, transfer in swap_outs.items():
        if name != last_made:
            assert transfer.start_ps < logits.end_ps, name
    assert len(swap_outs) - 1 >= 6


@pytest.mark.timeout(240)
def test_grappler_oracle_shows_lower_gpu_peak(toy):
    plain, fn, x, y = toy
    baseline = virtual_gpu_peak(plain.get_concrete_function(x, y), host=CPU_LMS["host"])
    rewritten = virtual_gpu_peak(fn.get_concrete_function(x, y), host=CPU_LMS["host"])
    # The design notes measured 194 -> 82 MiB for a naive swap-everything rewrite of this toy.
    assert rewritten < 0.6 * baseline, (baseline / 2**20, rewritten / 2**20)


@pytest.mark.timeout(240)
def test_phases_on_every_model_family():
    for name, builder in zoo.FIT_ZOO.items():
        model, _ = builder()
        graphs = []
        original = model.train_step

        def capture(data, original=original):
            out = original(data)
            graphs.append(_compat.current_graph())
            return out

        model.train_step = capture
        model.make_train_function(force=True)
        model, (x, y) = model, builder()[1]
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, steps_per_epoch=1, verbose=0)
        ir = build_ir(graphs[0], batch_size=zoo.BATCH)
        by_phase = {p: ir.ops_in(p) for p in Phase}
        for op in ir.ops:
            if op.name.startswith("gradient_tape/") and op.phase is not Phase.BACKWARD:
                # Only while_v2's accumulators (added in place to the forward loop) and their
                # inputs may carry the gradient scope yet run in the forward pass.
                assert op.phase is Phase.FORWARD and op.type in ("Const", "EmptyTensorList"), (name, op.name)
                readers = [c for t in op.outputs for c in ir.tensors[t].consumers]
                assert readers and all(ir.op(c).phase is Phase.FORWARD for c in readers), (name, op.name)
            if op.type in ("AssignSubVariableOp", "AssignVariableOp") and op.name.startswith(("sgd", "SGD")):
                assert op.phase is Phase.UPDATE, (name, op.name)
            if op.type in ("Conv2D", "MatMul", "BatchMatMulV2") and not op.name.startswith(("gradient_tape/", "sgd")):
                assert op.phase is Phase.FORWARD, (name, op.name)
        # Structural: nothing forward reads a backward or update value.
        for op in by_phase[Phase.FORWARD]:
            for t in op.inputs:
                assert ir.op(ir.tensors[t].producer).phase is Phase.FORWARD, (name, op.name, t)
        assert by_phase[Phase.BACKWARD] and by_phase[Phase.UPDATE], name
        assert [o.name for o in build_ir(graphs[0], batch_size=zoo.BATCH).ops] == [o.name for o in ir.ops]
