"""Every private TensorFlow/Keras API lms-tf relies on still behaves as expected.

If one of these fails after a TensorFlow or Keras upgrade, the lms_tf/_compat package needs an update.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from lms_tf import _compat
from lms_tf.tf.workloads import train_step
from tests import zoo


def test_private_tf_operation_apis_exist():
    _compat.check_private_apis()


def test_graph_editing_helpers_rewire_inputs_and_set_attributes():
    graph = tf.Graph()
    with graph.as_default():
        a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        c = tf.identity(a, name="c")
        gate = tf.raw_ops.NoOp(name="gate")
    _compat.update_input(c.op, 0, b)
    _compat.add_control_input(c.op, gate)
    _compat.set_string_attr(c.op, "_lms", "swap_in")
    _compat.set_bool_attr(c.op, "_grappler_do_not_remove", True)
    assert c.op.inputs[0].name == "b:0" and gate in c.op.control_inputs
    assert _compat.string_attr(c.op, "_lms") == "swap_in" and _compat.string_attr(a.op, "_lms") is None
    _compat.set_int_attr(c.op, "_lms_serial", 7)
    node = next(n for n in graph.as_graph_def().node if n.name == "c")
    assert node.attr["_grappler_do_not_remove"].b is True and node.attr["_lms_serial"].i == 7


def test_automatic_control_dependencies_are_added_when_the_block_ends():
    """Two assignments to one variable are chained in creation order before the trace ends."""
    v = tf.Variable(0.0)
    seen = {}

    @tf.function
    def step():
        with _compat.automatic_control_dependencies() as mark_as_return:
            first = v.assign_add(1.0)
            second = v.assign(5.0)
            result = mark_as_return({"value": second, "keep": 1})
        seen["chained"] = first.op in second.op.control_inputs
        return result["value"]

    assert float(step()) == 5.0 and seen["chained"]


def test_shape_inference_with_concrete_inputs():
    f = tf.function(lambda x: tf.nn.relu(tf.concat([x, x], axis=1)))
    graph = f.get_concrete_function(tf.TensorSpec((None, 3))).graph
    shapes = _compat.infer_shapes_with_inputs(graph, {graph.inputs[0].name: tf.TensorShape((5, 3))})
    relu = next(op for op in graph.get_operations() if op.type == "Relu")
    assert shapes[relu.outputs[0].name].as_list() == [5, 6]


def test_fit_batch_size_and_layer_scopes_are_readable_from_a_callback():
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["batch"] = _compat.fit_batch_size()

    zoo.reseed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")], name="probe_model")
    model.compile("sgd", "mse")
    model.fit(np.ones((12, 4)), np.ones((12, 2)), batch_size=6, epochs=1, verbose=0, callbacks=[Probe()])
    assert seen["batch"] == 6
    graph = tf.Graph()
    with graph.as_default(), tf.name_scope("probe_model_1"):
        tf.constant(0.0, name="x")
    assert _compat.layer_scope_aliases(model, graph)["d"] == "d_1"
    assert _compat.fit_batch_size() is None


def test_jit_compile_attribute_round_trips():
    zoo.reseed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    _compat.set_jit_compile(model, True)
    assert _compat.get_jit_compile(model) is True
    _compat.set_jit_compile(model, False)
    assert _compat.get_jit_compile(model) is False


def test_profiler_reports_executed_kernels():
    f = tf.function(lambda x: tf.nn.relu(tf.matmul(x, x)))
    f(tf.ones((8, 8)))
    events = _compat.profile_executed_ops(lambda: f(tf.ones((8, 8))))
    # Node names, not kernel types: oneDNN renames kernels on some CPUs (MatMul runs as _MklMatMul).
    nodes = [e[0] for e in events]
    assert "MatMul" in nodes and "Relu" in nodes
    assert nodes.index("MatMul") < nodes.index("Relu")


def test_grappler_virtual_cluster_reports_a_peak():
    f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
    graph = f.get_concrete_function(tf.ones((256, 256))).graph
    graph_def = graph.as_graph_def()
    gpu = "/job:localhost/replica:0/task:0/device:GPU:0"
    for node in graph_def.node:
        node.device = gpu
    peaks = _compat.grappler_peak_memory(graph_def, [t.op.name for t in graph.outputs], [(gpu, "GPU", 2**30)])
    assert peaks[gpu] >= 256 * 256 * 4


def test_a_functional_models_layer_calls_replay_its_own_call():
    """Pipeline stages run a model's nodes one by one (``_compat.call_node``) in the order
    ``Functional.call`` runs them; together they must give the model's own output, with
    ``training`` reaching the layers that take it (dropout active: two identical builds, since a
    dropout layer's seed state advances with each call)."""
    def build():
        zoo.reseed(3)
        inputs = keras.Input((6,))
        a = keras.layers.Dense(6, name="a")(inputs)
        b = keras.layers.Dense(6, activation="relu", name="b")(a)
        c = keras.layers.Dropout(0.5, seed=1, name="drop")(keras.layers.Add(name="add")([a, b]))
        return keras.Model(inputs, keras.layers.Dense(2, name="head")(c))

    x = np.random.RandomState(0).rand(4, 6).astype("float32")
    for training in (False, True):
        model, twin = build(), build()
        expected = model(x, training=training).numpy()
        graph = _compat.functional_graph(twin)
        assert [node.operation.name for node in _compat.nodes_in_call_order(graph)] == ["a", "b", "add", "drop", "head"]
        values = {id(graph.inputs[0]): tf.constant(x)}
        for node in _compat.nodes_in_call_order(graph):
            _compat.call_node(graph, node, values, training=training)
        replayed = values[id(graph.outputs[0])].numpy()
        assert np.array_equal(replayed, expected), training
        assert np.array_equal(replayed, twin(x, training=False).numpy()) != training  # dropout ran only when training
    assert _compat.functional_graph(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])) is not None


def test_a_models_inputs_flatten_in_its_input_order():
    """Pipeline stages take a model's inputs as ``Functional.call`` feeds them to its layer graph
    (``_compat.flat_model_inputs``): a list in order, a dict by input name, whatever its order."""
    a, b = keras.Input((2,), name="left"), keras.Input((3,), name="right")
    graph = _compat.functional_graph(keras.Model([a, b], keras.layers.Concatenate()([a, b])))
    left, right = np.ones((4, 2), "float32"), np.zeros((4, 3), "float32")
    for given in ([left, right], {"right": right, "left": left}):
        flat = _compat.flat_model_inputs(graph, given)
        assert [tuple(t.shape) for t in flat] == [(4, 2), (4, 3)] and np.array_equal(np.asarray(flat[0]), left)
    single = _compat.functional_graph(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    assert len(_compat.flat_model_inputs(single, left)) == 1


def test_a_variable_moved_while_a_step_is_traced_is_the_one_the_step_reads_and_writes():
    """``weights="auto"``: the same Python variable now names a resource on the other device, and
    the trace that had already read it captures the new handle, not the old one."""
    v = tf.Variable([1.0, 2.0])
    moved = []

    @tf.function
    def step():
        v.assign_add([1.0, 1.0])
        if not moved:
            graph = _compat.current_graph()
            assert any(w is v for w in _compat.traced_variables(graph))
            _compat.move_variable_in_place(v, "/CPU:1", graph)
            moved.append(True)
        return v.read_value()

    assert step().numpy().tolist() == [2.0, 3.0] and step().numpy().tolist() == [3.0, 4.0]
    assert v.device.endswith("CPU:1") and v.numpy().tolist() == [3.0, 4.0]
    assert all(external.device.endswith("CPU:1") for external, _ in step.get_concrete_function().graph.captures)


@pytest.mark.parametrize("family", ["resnet_style", "dropout_mlp", "text_embedding", "lstm"])
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_automatic_control_edges_are_the_ones_the_finished_trace_holds(family, optimizer):
    """``automatic_control_edges`` predicts, from the ops alone, the edges TensorFlow's automatic
    control dependencies add when a trace ends: every predicted edge is in the finished step's
    graph, and every control edge between two stateful ops there (the only kind those rules add)
    was predicted. Adam and momentum SGD read a slot after writing it."""
    zoo.reseed()
    model, (x, y) = zoo.FIT_ZOO[family]()
    step = tf.function(train_step(model, keras.optimizers.Adam() if optimizer == "adam"
                                  else keras.optimizers.SGD(0.05, momentum=0.9)))
    graph = step.get_concrete_function(tf.constant(x[:zoo.BATCH]), tf.constant(y[:zoo.BATCH])).graph
    predicted = _compat.automatic_control_edges(graph.get_operations())
    present = {(op.name, c.name) for op in graph.get_operations() for c in op.control_inputs}
    predicted_pairs = {(op, before) for op, befores in predicted.items() for before in befores}
    assert predicted_pairs and predicted_pairs <= present
    stateful = {op.name for op in graph.get_operations() if op.op_def.is_stateful}
    between_stateful = {(a, b) for a, b in present if a in stateful and b in stateful
                        and graph.get_operation_by_name(a).type not in ("Identity", "NoOp")}
    assert between_stateful <= predicted_pairs, sorted(between_stateful - predicted_pairs)[:5]


def test_an_update_that_reads_a_slot_after_writing_it_is_not_taken_for_the_forward_pass():
    """The IR is built while the step is traced, before TensorFlow adds its automatic control
    edges: it adds them itself, so Adam's second half (a read of each moment after its write, and
    what follows) is in the update phase, in the IR's edges, and runs after the write."""
    from lms_tf.core.ir import Phase
    from lms_tf.tf.trace import trace_step_ir

    zoo.reseed()
    model, (x, y) = zoo.dropout_mlp()
    ir = trace_step_ir(train_step(model, keras.optimizers.Adam()), tf.constant(x[:zoo.BATCH]), tf.constant(y[:zoo.BATCH]))
    writes = [op for op in ir.ops if op.type.startswith("AssignAddVariableOp") and "adam" in op.name]
    assert writes
    for op in ir.ops:
        if op.type == "ReadVariableOp" and any(w.name in op.control_inputs for w in writes):
            assert op.phase is Phase.UPDATE, op
    forward_update_math = [op.name for op in ir.ops if op.phase is Phase.FORWARD and "adam" in op.name
                           and op.type not in ("Placeholder", "Const", "ReadVariableOp")]
    assert forward_update_math == [], forward_update_math


def test_the_step_traced_by_the_pass_simulates_as_the_finished_step_does():
    """The IR the pass builds mid-trace, with the automatic control edges added by the trace,
    replays to the same peak as the IR of the finished step's graph, which holds TensorFlow's own
    edges (a decoder with Adam: without them the mid-trace replay ran Adam's second half at the
    step's start and read twice the peak: 3.6 MB against 1.7)."""
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.simulate import simulate
    from lms_tf.tf.trace import build_ir, trace_step_ir
    from lms_tf.tf.workloads import decoder_lm

    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 17)).astype("int32")
    x, y = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    peaks = []
    for mid_trace in (True, False):
        keras.utils.set_random_seed(0)
        step = train_step(decoder_lm(width=128, depth=2, seq_len=16, vocab=256), keras.optimizers.Adam())
        ir = (trace_step_ir(step, x, y) if mid_trace
              else build_ir(tf.function(step).get_concrete_function(x, y).graph))
        peaks.append(simulate(ir, cost=cost).peak_bytes)
    assert peaks[0] == peaks[1], peaks
