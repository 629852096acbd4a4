"""Weights on the host read by recompute clones, fetched in turn (``clone_fetches_after``).

A recompute region that recomputes several layers reads each layer's weight through a copy made
behind the region's gate; by default every such copy starts when the gate has run, back to back
on the copy stream, and the device holds them all while the first layer is recomputed. An entry
``(gate, op)`` in a weight's ``clone_fetches_after`` makes its copy wait for the clone of ``op``
instead. Proven here on a wide MLP whose two middle layers are recomputed behind one gate: the
numbers, the graph (what gates each copy), the executed order (TensorFlow's profiler), the
simulator's order, the plan file, and the errors for entries that cannot hold. The planner's use
of it (VGG16 on a PCIe V100) is in tests/test_planner_late_copies.py.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core.plan import Decision, Plan, WeightDecision
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.simulate import simulate
from lms_tf.tf.diagnostics import executed_ops, find_executed
from lms_tf.tf.rewrite import LMS_ATTR
from lms_tf.tf.rewrite.recompute import CLONE_GATE_ATTR, CLONE_OF_ATTR
from lms_tf.tf.trace import build_ir
from tests.helpers import BATCH, CPU_LMS, assert_same_numbers, custom_loop, keras_train_step, lms_function

#: The two middle layers, recomputed: the second's region holds the first's clones too.
RECOMPUTED = ["*/dense_3*/*", "*/dense_4*/*"]


def _wide_mlp():
    """Six 1024-wide Dense layers (4 MiB kernels) and a classifier, with its data; names made anew
    each build (a plan made on one build applies to the next)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(1024, activation="relu") for _ in range(6)]
                             + [keras.layers.Dense(10)])
    rng = np.random.default_rng(5)
    return model, (rng.random((3 * BATCH, 512), dtype=np.float32), rng.integers(0, 10, 3 * BATCH))


def _on_host(model, optimizer):
    lms_tf.place_weights(model, optimizer, host="/CPU:1")


def _first_batch():
    _, (x, y) = _wide_mlp()
    return tf.constant(x[:BATCH]), tf.constant(y[:BATCH])


def _two_layer_gate(plan: Plan):
    """The gate behind which both layers are cloned, and the first layer's Relu (cloned there)."""
    gate = next(d.gate for d in plan.recomputed if any("dense_4" in op for op in d.recompute_ops))
    relu = next(op for op in plan.clones_behind(gate) if "dense_3" in op and op.endswith("/Relu"))
    return gate, relu


def _in_turn(plan: Plan) -> Plan:
    """``plan`` with the second layer's kernel and bias fetched, behind the shared gate, after the
    first layer's Relu clone."""
    gate, relu = _two_layer_gate(plan)
    weights = tuple(dataclasses.replace(w, clone_fetches_after=((gate, relu),)) if "dense_4" in w.variable else w
                    for w in plan.weights)
    return dataclasses.replace(plan, weights=weights)


@pytest.fixture(scope="module")
def planned():
    """The plain run, the run with the planner's plan, and the one with that plan fetching in turn."""
    plain = custom_loop(_wide_mlp, tf.function)
    options = dict(CPU_LMS, weights="host", swap=False)
    made = custom_loop(_wide_mlp, lms_function(**options, recompute=RECOMPUTED), prepare=_on_host)
    plan = _in_turn(made[2].plan)
    ordered = custom_loop(_wide_mlp, lms_function(**CPU_LMS, plan=plan), prepare=_on_host)
    return plain, made, ordered, plan


@pytest.mark.timeout(300)
def test_fetching_a_regions_weights_in_turn_keeps_the_numbers(planned):
    plain, made, ordered, plan = planned
    gate, _ = _two_layer_gate(plan)
    clones = plan.clones_behind(gate)
    assert any("dense_3" in op for op in clones) and any("dense_4" in op for op in clones), clones
    assert sum(1 for w in plan.offloaded_weights if w.clone_fetches_after) == 2   # dense_4's kernel and bias
    assert_same_numbers(plain, made)
    assert_same_numbers(plain, ordered)


def _clone_fetches(graph: tf.Graph):
    """Each copy recompute clones read -> the op its gate reads (the trigger)."""
    fetches = {}
    for op in graph.get_operations():
        if _compat.string_attr(op, LMS_ATTR) == "weight_fetch" and "recompute_weight_fetch" in op.name:
            gate = next(c for c in op.control_inputs if _compat.string_attr(c, LMS_ATTR) == "swap_gate")
            shape = gate.inputs[0].op
            assert shape.type == "Shape", shape.type
            fetches[op] = shape.inputs[0].op
    return fetches


@pytest.mark.timeout(300)
def test_each_fetch_is_gated_by_the_clone_the_plan_names(planned):
    *_, ordered, plan = planned
    gate, relu = _two_layer_gate(plan)
    graph = ordered[2].get_concrete_function(*_first_batch()).graph
    behind_gate = {op: trigger for op, trigger in _clone_fetches(graph).items()
                   if any(_compat.string_attr(c, CLONE_GATE_ATTR) == gate for t in op.outputs for c in t.consumers())}
    by_layer = {}
    for fetch, trigger in behind_gate.items():
        layer = "dense_4" if any("dense_4" in _compat.string_attr(c, CLONE_OF_ATTR) for c in fetch.outputs[0].consumers()) \
            else "dense_3"
        by_layer.setdefault(layer, []).append(trigger)
    # The first layer's kernel and bias are fetched behind the gate itself; the second's after
    # the first layer's Relu clone (the clone of that op behind that gate).
    assert len(by_layer["dense_3"]) == len(by_layer["dense_4"]) == 2, by_layer
    assert all(t.name == gate for t in by_layer["dense_3"]), by_layer
    for trigger in by_layer["dense_4"]:
        assert _compat.string_attr(trigger, LMS_ATTR) == "recompute", trigger.name
        assert (_compat.string_attr(trigger, CLONE_OF_ATTR), _compat.string_attr(trigger, CLONE_GATE_ATTR)) == (relu, gate)
    # Without the entries, every copy behind the gate is gated by the gate.
    made_graph = planned[1][2].get_concrete_function(*_first_batch()).graph
    assert all(t.name == gate for op, t in _clone_fetches(made_graph).items()
               if any(_compat.string_attr(c, CLONE_GATE_ATTR) == gate for c in op.outputs[0].consumers()))


@pytest.mark.timeout(300)
def test_executed_order_the_second_layers_weights_cross_after_the_first_layer_is_recomputed(planned):
    """TensorFlow's profiler: the copy of each of the second layer's weights to the device (the
    ``_Send`` named after its fetch) starts after the first layer's Relu clone (MatMul, BiasAdd and
    Relu fused, run under the Relu's name) has ended, and the second layer's clone starts after it."""
    *_, ordered, plan = planned
    fn = ordered[2]
    x, y = _first_batch()
    fn(x, y)
    events = executed_ops(lambda: fn(x, y))
    graph = fn.get_concrete_function(x, y).graph
    checked = 0
    for fetch, trigger in _clone_fetches(graph).items():
        if _compat.string_attr(trigger, LMS_ATTR) != "recompute":
            continue
        ran = find_executed(events, trigger.name)
        assert ran is not None, f"no run of {trigger.name} in the profile"
        sends = [e for e in events if e.type == "_Send" and e.node.rsplit("/_", 1)[0].endswith(fetch.name)]
        assert sends, f"no copy of {fetch.name} in the profile"
        copied = min(e.start_ps for e in sends)
        assert copied >= ran.end_ps, (fetch.name, trigger.name)
        for reader in fetch.outputs[0].consumers():
            clone = next(filter(None, (find_executed(events, name) for name in _fused_name(reader))), None)
            assert clone is not None, f"no run of {reader.name} (or what it is fused into) in the profile"
            assert clone.start_ps >= copied, (fetch.name, reader.name)
        checked += 1
    assert checked == 2, checked


def _fused_name(op):
    """``op``'s name and those of the ops Grappler fuses it into (MatMul -> BiasAdd -> Relu)."""
    names = [op.name]
    while len(op.outputs) == 1 and len(op.outputs[0].consumers()) == 1 and \
            op.outputs[0].consumers()[0].type in ("BiasAdd", "Relu"):
        op = op.outputs[0].consumers()[0]
        names.append(op.name)
    return list(reversed(names))


@pytest.mark.timeout(300)
def test_the_simulator_starts_the_copy_when_the_clone_ends(planned):
    """The simulator replays the entry as the rewrite makes it: the copy of the second layer's
    kernel for the clones behind the gate starts when the first layer's Relu clone ends, and
    without the entry when the gate does."""
    *_, ordered, plan = planned
    model, _ = _wide_mlp()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    _on_host(model, optimizer)
    ir = build_ir(tf.function(keras_train_step(model, optimizer)).get_concrete_function(*_first_batch()).graph)
    gate, relu = _two_layer_gate(plan)
    kernel = next(w for w in plan.offloaded_weights if w.clone_fetches_after and w.shape == (1024, 1024))
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    fetch = kernel.clone_fetch_name(gate)
    in_turn = simulate(ir, plan, cost=cost)
    clone_end = in_turn.op_intervals[f"recompute/{gate}/{relu}"][1]
    assert in_turn.op_intervals[fetch][0] == pytest.approx(clone_end)
    at_gate = simulate(ir, dataclasses.replace(plan, weights=tuple(
        dataclasses.replace(w, clone_fetches_after=()) for w in plan.weights)), cost=cost)
    assert at_gate.op_intervals[fetch][0] < at_gate.op_intervals[f"recompute/{gate}/{relu}"][1]


def test_clone_fetches_after_survive_the_plan_file_and_show_in_the_summary():
    weight = WeightDecision("w:0", ("r:0",), (4, 4), 64, Decision.SWAP, "weights='host'", (),
                            (("gradient_tape/g", "layer/Relu"),))
    plan = Plan((), "/device:GPU:0", "/device:CPU:1", {"weights": "host"}, {}, weights=(weight,))
    assert Plan.from_json(plan.to_json()).weights == plan.weights
    assert "behind gradient_tape/g: after layer/Relu's clone" in plan.summary()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("edit, message", [
    # The copy would wait for a clone made after the first that reads it: it could wait for itself.
    (lambda gate, relu, plan: (gate, next(op for op in plan.clones_behind(gate) if "dense_4" in op and op.endswith("/Relu"))),
     r"is cloned after the first clone that reads it\. Remove the entry from the weight's clone_fetches_after"),
    (lambda gate, relu, plan: ("no/such/gate", relu), r"op 'no/such/gate', named by .*clone_fetches_after, is not in it"),
    (lambda gate, relu, plan: (gate, gate), r"is not cloned behind"),
], ids=["after-its-reader", "unknown-gate", "not-cloned-there"])
def test_an_entry_that_cannot_hold_is_refused_before_rewriting(planned, edit, message):
    *_, plan = planned
    gate, relu = _two_layer_gate(plan)
    bad = dataclasses.replace(plan, weights=tuple(
        dataclasses.replace(w, clone_fetches_after=(edit(gate, relu, plan),)) if "dense_4" in w.variable else w
        for w in plan.weights))
    with pytest.raises(lms_tf.LMSOptionError, match=message):
        custom_loop(_wide_mlp, lms_function(**CPU_LMS, plan=bad), steps=1, prepare=_on_host)
