"""With the optimizer update on the host, the simulator keeps on the device what the rewrite keeps
there: the products of the gradients alone (SGD's learning rate times the gradient,
:func:`lms_tf.simulate.update_products_on_device`). Until 2026-12-03 it ran the whole update on
the host, so such products never held device memory in its replay, and the gradients they read
were freed as soon as their own copies out ended. Adam's squared gradient is computed on the host
since 2026-12-03 (it was made on the device and sent beside the gradient: two copies of each)."""

import keras
import pytest
import tensorflow as tf

import lms_tf
from lms_tf.core.ir import Phase
from lms_tf.core.op_kinds import TO_HOST_PREFIX
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.simulate import gradients_crossing_as, simulate, update_products_on_device
from tests import zoo

V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
COMPUTING = ("ReadVariableOp", "Const", "Placeholder", "NoOp", "VarHandleOp", "_Arg")


def _traced(optimizer, hidden=(128,)):
    """An MLP (``hidden`` widths, then 8 outputs) with its weights on the host, traced by
    ``lms_tf.function``: the IR holds where TensorFlow's graph places each update op
    (``GraphIR.host_placed``)."""
    zoo.reseed()
    model = keras.Sequential([keras.Input((64,)), *[keras.layers.Dense(w, activation="relu") for w in hidden],
                              keras.layers.Dense(8)])
    optimizer.build(model.trainable_variables)
    lms_tf.place_weights(model, optimizer, host="/CPU:1")

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    fn = lms_tf.function(step, device="/CPU:0", host="/CPU:1", weights="host", swap=False,
                         device_spec="v100-16gb-pcie3")
    fn(tf.ones((16, 64)), tf.ones((16, 8)))
    return fn.plain_irs[-1], fn.plan


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", [keras.optimizers.Adam, keras.optimizers.SGD,
                                       lambda: keras.optimizers.SGD(momentum=0.9)], ids=["adam", "sgd", "momentum"])
def test_the_rule_on_the_ir_is_where_the_rewrite_places_the_update(optimizer):
    """Every computing op of the update that the traced step leaves on the device is one the rule
    names, and no other: the simulator and the rewrite place the update alike."""
    ir, _ = _traced(optimizer())
    on_device = update_products_on_device(ir)
    left = {op.name for op in ir.ops if op.phase is Phase.UPDATE and op.name not in ir.host_placed
            and op.type not in COMPUTING}
    assert on_device == left
    squares = {op.name for op in ir.ops if op.phase is Phase.UPDATE and op.type == "Square"}
    if optimizer is keras.optimizers.Adam:
        # one per weight, each on the host: the host squares the gradient it receives
        assert len(squares) == 4 and squares <= ir.host_placed and not on_device, (squares, on_device)
    else:
        assert on_device and {ir.op(name).type for name in on_device} <= {"Mul", "Neg"}, on_device


@pytest.mark.timeout(120)
def test_adam_sends_each_gradient_once_and_the_host_squares_it():
    """In the replay each weight gradient is copied to the host once, and no square is: the host
    computes it from the gradient, where Adam's first moment reads the gradient too. (Squared on
    the device, each gradient crossed twice: itself and its square.)"""
    ir, plan = _traced(keras.optimizers.Adam())
    sim = simulate(ir, plan, cost=V100, log_allocations=True)
    squares = [op for op in ir.ops if op.phase is Phase.UPDATE and op.type == "Square"]
    copies = [name[len(TO_HOST_PREFIX):] for name in sim.op_intervals if name.startswith(TO_HOST_PREFIX)]
    on_device = update_products_on_device(ir)
    # each square reads its gradient through the optimizer's IdentityN: named by its buffer
    gradients = {g for square in squares for g in gradients_crossing_as(ir, square.inputs[0], on_device)}
    assert len(squares) == len(gradients) == 4   # two kernels, two biases
    carried = [gradients_crossing_as(ir, copy, on_device) for copy in copies]
    for gradient in gradients:
        assert carried.count([gradient]) == 1, (gradient, copies)   # one copy carries it
    assert not {square.outputs[0] for square in squares} & set(copies)
    allocated = {key for kind, key, _ in sim.allocations if kind == "alloc"}
    assert not {square.outputs[0] for square in squares} & allocated   # no device memory


def _update_of_each_variable(ir, plan):
    """Host op name -> the weight whose update it belongs to: the ops from which a write to exactly
    one weight descends, through data and control edges (a write to Adam's moments, then its read,
    then the weight's write). The learning rate's ops feed every update and belong to none."""
    producers = {t: op.name for op in ir.ops for t in op.outputs}
    preds = {op.name: {producers[t] for t in op.inputs if t in producers} | set(op.control_inputs) for op in ir.ops}
    weights = {w.variable for w in plan.offloaded_weights}
    owners = {}
    for op in ir.ops:
        if op.inputs and op.inputs[0] in weights and op.type.startswith(("Assign", "ResourceApply")):
            stack, seen = [op.name], set()
            while stack:
                name = stack.pop()
                if name not in seen:
                    seen.add(name)
                    stack.extend(preds[name])
            for name in seen:
                owners.setdefault(name, set()).add(op.inputs[0])
    return {name: next(iter(found)) for name, found in owners.items() if len(found) == 1}


def test_the_host_runs_one_variables_update_after_another_when_asked():
    """``host_update="one_variable_at_a_time"``: on the host's stream each weight's update runs
    whole before the next starts (the ops of each weight that make tensors are one run in the
    order they started),
    and the host holds no more than with every update started as its gradient arrives (the
    default, ``host_peak_bytes``)."""
    # Wide layers whose gradients reach the host faster than it updates them: the first in first
    # out order interleaves their updates.
    ir, plan = _traced(keras.optimizers.Adam(), hidden=(1024, 1024, 1024))
    owner = _update_of_each_variable(ir, plan)
    by_name = {op.name: op for op in ir.ops}

    def tensor_sized(name):  # not the learning rate's scalars, which each weight has its own of
        return any((ir.tensors[t].nbytes or 0) > 64 for t in by_name[name].outputs)

    runs = {}
    for order in ("all_at_once", "one_variable_at_a_time"):
        sim = simulate(ir, plan, cost=V100, host_update=order)
        started = sorted((start, name) for name, (start, _) in sim.op_intervals.items()
                         if name in owner and name in ir.host_placed and tensor_sized(name))
        labels = [owner[name] for _, name in started]
        runs[order] = ([label for i, label in enumerate(labels) if i == 0 or labels[i - 1] != label], sim)
    grouped, one_at_a_time = runs["one_variable_at_a_time"]
    assert len(grouped) == len(set(grouped)) >= 7, grouped  # the last bias (8 floats) makes no tensor over 64 bytes
    interleaved, all_at_once = runs["all_at_once"]
    assert len(interleaved) > len(set(interleaved)), interleaved
    assert one_at_a_time.host_peak_bytes < all_at_once.host_peak_bytes
    with pytest.raises(lms_tf.LMSOptionError, match="host_update"):
        simulate(ir, plan, cost=V100, host_update="sometimes")
