"""serialize=True: the step's compute ops run one at a time in the simulator's order.

Proven three ways: the numbers equal the plain step's; the graph carries a chain of control
edges in the order the simulator ran the ops; TensorFlow executes the ops in exactly that order,
with two inter-op threads that would otherwise run branches in parallel.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError, RewriteError
from lms_tf.core.op_kinds import FREE_TYPES
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.simulate import simulate
from lms_tf.tf.diagnostics import executed_ops, virtual_gpu_peak
from lms_tf.tf.rewrite.recompute import simulator_name
from lms_tf.tf.rewrite import serialize as serialize_module
from lms_tf.tf.rewrite.serialize import (
    bypass_identity_n,
    fused_kernel_waits,
    gate_free_ops,
    grappler_fused_kernels,
    grappler_rewritten_ops,
    impose_order,
    onednn_may_fuse,
    ranked_topological_order,
    serial_chain,
    serialize_step,
)
from tests import zoo
from tests.helpers import ancestors, assert_same_numbers, custom_loop, fit_steps, graph_probe, lms_function

SPEC = "v100-16gb-pcie3"


def test_chain_follows_the_ranks_where_the_graph_allows():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, name="x")
        a = tf.exp(x, name="a")
        b = tf.sqrt(x, name="b")
        c = tf.add(a, b, name="c")
        tf.negative(x, name="d")
    # d ranks before a, and c before d; but c reads a, so c must wait for a.
    order = ranked_topological_order(g, {"d": 0, "c": 1, "b": 2, "a": 3})
    assert order == ["x", "d", "b", "a", "c"]
    assert impose_order(g, {"d": 0, "c": 1, "b": 2, "a": 3}) == 3
    controls = {op.name: [c.name for c in op.control_inputs] for op in g.get_operations()}
    assert controls == {"x": [], "d": [], "b": ["d"], "a": ["b"], "c": ["a"]}
    del c


def test_identity_n_readers_are_re_pointed_and_values_kept():
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(3.0, name="x")
        first, second = tf.identity_n([tf.square(x, name="sq"), tf.exp(x, name="ex")], name="both")
        late = tf.negative(first, name="late")
    assert bypass_identity_n(g) == 1
    assert [t.name for t in late.op.inputs] == ["sq:0"]
    with tf.compat.v1.Session(graph=g) as session:
        assert session.run(late) == -9.0
    del second


def test_collectives_and_what_waits_on_them_stay_off_the_chain():
    """A collective waits for every rank: nothing on one rank's compute chain may wait behind it,
    and a gradient bucket must be sent as soon as it exists (the data-parallel pipelining)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4,), name="x")
        grad = tf.square(x, name="grad")
        summed = tf.raw_ops.CollectiveReduceV2(input=grad, group_size=1, group_key=1, instance_key=1,
                                               ordering_token=[], merge_op="Add", final_op="Id", name="allreduce")
        update = tf.negative(summed, name="update")
        tf.exp(update, name="after_update")
        tf.sqrt(x, name="compute")
    rank = {"grad": 0, "allreduce": 1, "update": 2, "after_update": 3, "compute": 4}
    impose_order(g, rank)
    assert [op.name for op in serial_chain(g)] == ["grad", "compute"]
    assert all(not op.control_inputs for op in g.get_operations() if op.name != "compute")


def test_ops_grappler_fuses_stay_off_the_chain():
    """Grappler's remapper fuses MatMul + BiasAdd + Relu only if none of them has a control edge, and
    oneDNN fuses a BiasAddGrad with the MatMul/Conv2DBackpropFilter reading the same gradient only
    if neither has one: chained, they would run other kernels (other last bits) or deadlock."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        w = tf.compat.v1.placeholder(tf.float32, (8, 8), name="w")
        b = tf.compat.v1.placeholder(tf.float32, (8,), name="b")
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w, name="mm"), b, name="bias"), name="act")
        c = tf.compat.v1.placeholder(tf.float32, (4, 8), name="c")
        out = tf.multiply(h, c, name="scaled")
        dy = tf.add(out, c, name="dy")
        tf.raw_ops.BiasAddGrad(out_backprop=dy, name="bias_grad")
        tf.matmul(x, dy, transpose_a=True, name="weight_grad")
        tf.matmul(dy, w, transpose_b=True, name="input_grad")
    fused = grappler_rewritten_ops(g, "/device:CPU:0", 2**28)
    assert {"mm", "bias", "act"} <= fused and not {"scaled", "dy"} & fused
    rank = {name: i for i, name in enumerate(["mm", "bias", "act", "scaled", "dy", "bias_grad", "weight_grad",
                                               "input_grad"])}
    impose_order(g, rank, leave_free=fused)
    # "scaled", the one elementwise reader of the fused op, stays free too: oneDNN may extend the
    # fusion by it after Grappler (MatMul + BiasAdd + Add in bfloat16 did).
    assert [op.name for op in serial_chain(g)] == ["dy"]


def _matmul_step_graph(head="scale"):
    """x -> exp -> MatMul + BiasAdd + Relu (fused by the remapper) -> * max(c) (not elementwise:
    ``c``'s sole elementwise reader would be left free, as oneDNN may fuse one into ``c``'s producer)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        c = tf.compat.v1.placeholder(tf.float32, (4, 8), name="c")
        w = tf.constant(np.random.RandomState(2).rand(8, 8).astype("float32"), name="w")  # as a weight's read:
        b = tf.constant(np.random.RandomState(3).rand(8).astype("float32"), name="b")  # not from the inputs
        e = tf.exp(x, name="e")
        s = tf.reduce_max(c, axis=0, name="s")
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(e, w, name="mm"), b, name="bias"), name="act")
        if head == "scale":
            tf.multiply(h, s, name="out")
        else:  # not elementwise: nothing for oneDNN to extend the fused MatMul by; "later" reads
            # nothing of the kernel
            tf.add(tf.reduce_sum(h, axis=0), tf.reduce_min(c, axis=0, name="later"), name="out")
    return g


def test_a_fused_kernel_is_held_at_its_place_in_the_chain_through_a_gate():
    """The fused MatMul is off the chain; its read of ``e`` goes through a kept Identity that waits
    for the chained op ranked before the pattern, and Grappler still fuses the pattern."""
    g = _matmul_step_graph()
    kernels = grappler_fused_kernels(g, "/device:CPU:0", 2**28)
    assert [(k.name, k.kernel, sorted(k.ops), k.entries) for k in kernels] == [
        ("act", "_FusedMatMul", ["act", "bias", "mm"], (("bias", 1), ("mm", 0), ("mm", 1)))]
    rank = {name: i for i, name in enumerate(["e", "s", "mm", "bias", "act", "out"])}
    report = serialize_step(g, rank, "/device:CPU:0", 2**28, onednn_fusions=True)
    assert report.gates == 1 and not report.gates_undone  # the weight and bias need no gate
    assert [op.name for op in serial_chain(g)] == ["e", "s"]  # "out", oneDNN's possible extension, stays free
    gate = g.get_operation_by_name("mm").inputs[0].op
    assert gate.type == "Identity" and gate.inputs[0].name == "e:0"
    assert [op.name for op in gate.control_inputs] == ["s"]
    assert _compat.string_attr(gate, "_lms") == "serial_gate"
    assert not g.get_operation_by_name("mm").control_inputs  # the pattern itself has no control edge
    # Grappler, run on the gated graph, still fuses the pattern: the gate sits outside it.
    assert [(k.name, k.kernel) for k in grappler_fused_kernels(g, "/device:CPU:0", 2**28)] == [
        ("act", "_FusedMatMul")]
    # The gated step computes what the plain one does.
    feeds = {f"{n}:0": np.random.RandomState(i).rand(*shape).astype("float32")
             for i, (n, shape) in enumerate([("x", (4, 8)), ("c", (4, 8))])}
    plain = _matmul_step_graph()
    with tf.compat.v1.Session(graph=plain) as session:
        expected = session.run("out:0", feeds)
    with tf.compat.v1.Session(graph=g) as session:
        assert np.array_equal(session.run("out:0", feeds), expected)


def _dense_gradient_graph():
    """A dense layer's weight gradients: the bias gradient and the kernel gradient oneDNN may fuse
    it into (both read ``dy``), each read by an elementwise op (as an update reads it)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        dy = tf.exp(tf.compat.v1.placeholder(tf.float32, (4, 8), name="g"), name="dy")
        # (squares, not products with a learning rate: Grappler folds a scalar product into the MatMul)
        tf.square(tf.raw_ops.BiasAddGrad(out_backprop=dy, name="db"), name="lr_db")
        tf.square(tf.matmul(x, dy, transpose_a=True, name="dw"), name="lr_dw")
    return g


def test_without_onednn_a_bias_gradient_and_its_kernel_gradient_are_chained_like_any_op():
    """Only oneDNN fuses a bias gradient into its kernel gradient, and only on a CPU: elsewhere the
    pair is chained in the simulated order. Left free (as it must be where oneDNN may fuse it), a
    weight's gradient ran whenever the executor picked it, beside the previous weight's update
    (Grappler's virtual GPU: 12.3 MiB against the simulator's 8.4 for a serialized wide MLP with
    its weights on the host)."""
    rank = {name: i for i, name in enumerate(["dy", "dw", "lr_dw", "db", "lr_db"])}
    fused = _dense_gradient_graph()
    serialize_step(fused, rank, "/device:CPU:0", 2**28, onednn_fusions=True)
    assert not {"dw", "db"} & {op.name for op in serial_chain(fused)}
    plain = _dense_gradient_graph()
    serialize_step(plain, rank, "/device:CPU:0", 2**28, onednn_fusions=False)
    assert [op.name for op in serial_chain(plain)] == ["dy", "dw", "lr_dw", "db", "lr_db"]
    assert [op.name for op in plain.get_operation_by_name("db").control_inputs] == ["lr_dw"]
    assert [op.name for op in plain.get_operation_by_name("dw").control_inputs] == ["dy"]
    assert not serialize_module.onednn_may_fuse("/job:localhost/replica:0/task:0/device:GPU:0")
    # The default follows the device and TensorFlow's kernels (this suite runs without oneDNN).
    assert serialize_module.onednn_may_fuse("/device:CPU:0") == _compat.onednn_enabled()


def test_a_kernel_whose_input_comes_from_the_last_chained_op_before_it_needs_no_gate():
    g = _matmul_step_graph()
    rank = {name: i for i, name in enumerate(["s", "e", "mm", "bias", "act", "out"])}
    free = grappler_rewritten_ops(g, "/device:CPU:0", 2**28)
    impose_order(g, rank, leave_free=free)
    assert [op.name for op in serial_chain(g)] == ["s", "e"]
    assert gate_free_ops(g, rank, grappler_fused_kernels(_matmul_step_graph(), "/device:CPU:0", 2**28), free) == []
    assert g.get_operation_by_name("mm").inputs[0].name == "e:0"


def test_held_ops_wait_for_each_other_and_the_chain_waits_for_them_through_exits():
    """Here Grappler rewrites the reductions ``s`` and ``later`` too (their axes fold), so the order
    is: ``e`` (chained), ``s`` (held), the fused MatMul (held), ``Sum`` (chained). Each held op's
    result is read by a kept exit Identity: the kernel's entry gate waits for ``s``'s exit, and
    ``Sum`` for the kernel's. The pattern itself keeps no control edge, and still fuses."""
    g = _matmul_step_graph(head="sum")
    rank = {name: i for i, name in enumerate(["e", "s", "mm", "bias", "act", "Sum", "later", "out"])}
    report = serialize_step(g, rank, "/device:CPU:0", 2**28, onednn_fusions=True)
    assert [op.name for op in serial_chain(g)] == ["e", "Sum"]
    assert report.gates == 3 and not report.gates_undone  # two exits and the kernel's entry gate
    exits = {op.inputs[0].name: op for op in g.get_operations() if _compat.string_attr(op, "_lms") == "serial_exit"}
    assert sorted(exits) == ["act:0", "s:0"] and all(op.type == "Identity" for op in exits.values())
    entry = g.get_operation_by_name("mm").inputs[0].op
    assert entry.inputs[0].name == "e:0" and entry.control_inputs == [exits["s:0"]]
    assert exits["act:0"] in g.get_operation_by_name("Sum").control_inputs
    assert not any(g.get_operation_by_name(name).control_inputs for name in ("mm", "bias", "act"))
    assert [(k.name, k.kernel) for k in grappler_fused_kernels(g, "/device:CPU:0", 2**28)] == [
        ("act", "_FusedMatMul")]
    # Undone, nothing waits for an exit any more.
    serialize_module.undo_gates(g, [serialize_module.SerialGate("exit", op.name, 0, value, "")
                                    for value, op in exits.items()])
    assert not entry.control_inputs and exits["act:0"] not in g.get_operation_by_name("Sum").control_inputs


def test_a_chained_op_waits_for_every_held_item_since_the_chained_op_before_it():
    """Ranked ``e, mm, bias, s, act, Sum``: the fused pattern spans positions 1-4 and the held
    ``s`` sits inside it, ending first. ``Sum`` waits for both exits: waiting only for the item
    that ends last (the kernel) left ``s`` free to run at any time after ``e`` (on U-Net, held
    recomputes ran long after their place)."""
    g = _matmul_step_graph(head="sum")
    rank = {name: i for i, name in enumerate(["e", "mm", "bias", "s", "act", "Sum", "later", "out"])}
    report = serialize_step(g, rank, "/device:CPU:0", 2**28, onednn_fusions=True)
    assert [op.name for op in serial_chain(g)] == ["e", "Sum"] and not report.gates_undone
    exits = {op.inputs[0].name: op for op in g.get_operations() if _compat.string_attr(op, "_lms") == "serial_exit"}
    assert sorted(exits) == ["act:0", "s:0"]
    assert set(exits.values()) <= set(g.get_operation_by_name("Sum").control_inputs)
    assert not any(g.get_operation_by_name(name).control_inputs for name in ("mm", "bias", "act", "s"))


def test_no_exit_reads_an_op_whose_readers_are_all_rewritten():
    """A second reader stops the arithmetic optimizer's regrouping of ``(a * b) * c`` through the
    inner product, and oneDNN's extension of a fused contraction by its sole elementwise reader."""
    g = tf.Graph()
    with g.as_default():
        a = tf.compat.v1.placeholder(tf.float32, (4, 8), name="a")
        inner = tf.multiply(a, tf.exp(a), name="inner")
        tf.reduce_sum(tf.multiply(inner, 3.0, name="outer"), name="total")
        tf.reduce_max(inner, name="peak")
    may_read = serialize_module._may_read_for_exit
    assert not may_read(g, "inner", kernel_names=(), leave_free={"inner", "outer", "peak"})
    assert may_read(g, "inner", kernel_names=(), leave_free={"inner", "outer"})  # "peak" is not rewritten
    assert may_read(g, "outer", kernel_names=(), leave_free={"inner", "outer"})  # read by a Sum
    # "out" is elementwise, and "act" ends a fused MatMul: oneDNN may extend that kernel by "out"
    assert not may_read(_matmul_step_graph(), "act", kernel_names={"act"}, leave_free={"mm", "bias", "act"})


def test_an_exit_may_read_an_op_that_is_neither_a_product_nor_ends_a_contraction():
    """A concatenation gradient's ``Slice`` (Grappler folds its offset) read only by a gradient sum
    (``AddN``, elementwise): neither rewrite above applies, so an exit reads it and the chained op
    after it waits. Without one it ran just before the sum's other input (U-Net's skip connection)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        part = tf.slice(tf.exp(x, name="grad"), [0, 0], [4, 4], name="part")
        later = tf.slice(tf.sqrt(x, name="later"), [0, 0], [4, 4])
        tf.add_n([part, later], name="sum")
    assert serialize_module._may_read_for_exit(g, "part", kernel_names=(), leave_free={"part"})
    rank = {"grad": 0, "part": 1, "later": 2, "sum": 3}
    impose_order(g, rank, leave_free={"part"})
    gates = gate_free_ops(g, rank, [], {"part"})
    (exit_op,) = [g.get_operation_by_name(gate.reader) for gate in gates if gate.kind == "exit"]
    assert exit_op.inputs[0].name == "part:0" and exit_op in g.get_operation_by_name("later").control_inputs


def test_gates_that_would_change_a_kernel_are_undone_and_the_log_says_where(monkeypatch, caplog):
    """If Grappler, run on the gated step, ran another kernel or read operands in another order,
    the gates there are undone (all of them, if it still does after the last check): the step
    keeps its numbers, and the log says where the order is looser."""
    monkeypatch.setattr(serialize_module, "kernels_changed_by_gates", lambda before, after, names: ["somewhere"])
    g = _matmul_step_graph()
    report = serialize_step(g, {name: i for i, name in enumerate(["e", "s", "mm", "bias", "act", "out"])},
                            "/device:CPU:0", 2**28)
    assert report.gates == 0 and report.gates_undone == ("somewhere",)
    assert g.get_operation_by_name("mm").inputs[0].name == "e:0"
    model, (x, y) = zoo.resnet_style()
    callback = lms_tf.LMSCallback(device="/CPU:0", swap=False, recompute="sqrt", serialize=True, device_spec=SPEC)
    with caplog.at_level("INFO", logger="lms_tf"):
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0, callbacks=[callback])
    assert any("except where Grappler" in r.message and "(somewhere)" in r.message for r in caplog.records)


def test_only_the_gates_on_what_changed_are_undone(monkeypatch):
    """A kernel that changed takes the gates on its own pattern's reads out; the others hold."""
    g = _matmul_step_graph()
    rank = {name: i for i, name in enumerate(["e", "s", "mm", "bias", "act", "out"])}
    checks = []

    def changed_once(before, after, names):  # the first check blames the fused kernel, the second nothing
        checks.append(1)
        return ["act"] if len(checks) == 1 else []
    monkeypatch.setattr(serialize_module, "kernels_changed_by_gates", changed_once)
    with g.as_default():  # a second held op: a sum the arithmetic optimizer regroups (off the chain)
        total = tf.add(tf.add(tf.sin(g.get_tensor_by_name("x:0"), name="ex"), tf.cos(g.get_tensor_by_name("x:0"), name="ey"),
                              name="partial"), g.get_tensor_by_name("x:0"), name="total")
        tf.reduce_max(total, name="m")
    rank.update({"ex": 6, "ey": 7, "partial": 8, "total": 9, "m": 10})
    report = serialize_step(g, rank, "/device:CPU:0", 2**28, onednn_fusions=True)
    assert len(checks) == 2 and report.gates_undone == ("act",) and report.gates == 1
    assert g.get_operation_by_name("mm").inputs[0].name == "e:0"  # the kernel's gate is out
    held = g.get_operation_by_name("partial").inputs[0].op  # the sum's read of "ex" waits for "ey"
    assert held.type == "Identity" and [op.name for op in held.control_inputs] == ["ey"]


def test_grappler_runs_offline_on_the_step_as_the_runtime_runs_it(monkeypatch):
    """The runtime's arithmetic optimizer runs a gradient's ``(g * r) * lr`` as ``(lr * g) * r``
    (another rounding) when it knows ``lr`` is a scalar, which it reads off the variable's
    function argument, and ``g * r`` has one reader once what the step does not return is
    pruned. The offline run must see both, or ``g * r`` is chained, the regrouping cannot happen,
    and the numbers change (ResNet-style with SGD, on a CPU without AVX2: one last bit)."""
    lr, v1, v2 = tf.Variable(0.1), tf.Variable(tf.ones(16)), tf.Variable(tf.ones(16))
    found = {}

    def step():
        product = tf.multiply(tf.exp(v1), tf.sqrt(v2), name="product")
        tf.identity(product, name="dead_end")  # as Keras keeps an unused identity of each gradient
        out = tf.exp(tf.multiply(product, lr, name="scaled"), name="out")
        graph = _compat.current_graph()
        found["returned"] = grappler_rewritten_ops(graph, "/device:CPU:0", 2**28, outputs=[out])
        found["every_sink"] = grappler_rewritten_ops(graph, "/device:CPU:0", 2**28)
        with monkeypatch.context() as patch:  # variables as plain resource placeholders, of unknown shape
            patch.setattr(_compat, "function_body_graph_def", lambda graph: graph.as_graph_def())
            found["shapeless"] = grappler_rewritten_ops(graph, "/device:CPU:0", 2**28, outputs=[out])
        return out

    tf.function(step)()
    assert {"product", "scaled", "dead_end"} <= found["returned"]
    # Kept as a fetch, the dead end is a second reader: nothing is regrouped (fewer rewrites found).
    assert not {"product", "scaled"} & found["every_sink"]
    # Without the learning rate's shape, nothing is regrouped either.
    assert not {"product", "scaled"} & found["shapeless"]


def test_serialized_step_runs_grapplers_fused_kernels():
    """An 8-layer conv net through ``model.fit`` with Adam for 10 steps: serialized, it gives exactly
    the plain step's numbers. Chaining the fused ops (as before) left them unfused and moved the
    weights by 3.5e-3 (Adam magnifies a last-bit difference where a gradient is near zero)."""
    def conv_stack():
        zoo.reseed(7)
        model = keras.Sequential([keras.Input((32, 32, 3))]
                                 + [keras.layers.Conv2D(32, 3, padding="same", activation="relu") for _ in range(8)]
                                 + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, zoo._images(n=10 * zoo.BATCH, size=32, classes=10)

    plain = fit_steps(conv_stack)
    callback = lms_tf.LMSCallback(device="/CPU:0", swap=False, serialize=True, device_spec=SPEC)
    serialized = fit_steps(conv_stack, callbacks=[callback])
    assert len(plain[0]) == 10
    assert_same_numbers(plain, serialized, rtol=0.0)


def test_a_cycle_is_reported():
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(1.0, name="a")
        b = tf.negative(a, name="b")
    _compat.add_control_input(a.op, b.op)
    with pytest.raises(RewriteError, match="cycle"):
        ranked_topological_order(g, {})


@pytest.mark.parametrize("builder", [zoo.resnet_style, zoo.inception_style, zoo.subclassed],
                         ids=["resnet", "inception", "subclassed"])
@pytest.mark.parametrize("recompute", [None, "sqrt"])
def test_serialized_step_trains_to_the_same_numbers(builder, recompute, capfd):
    _check_serialized_numbers(builder, recompute, capfd)


@pytest.mark.parametrize("name", ["sequential_cnn", "text_embedding", "dropout_mlp", "lstm",
                                  "shared_multi_input_residual"])
def test_every_model_family_serializes_to_the_same_numbers(name, capfd):
    """Sequential, an embedding, Dropout's random ops (stateful: kept in creation order), an
    LSTM's while loop (one node outside its body) and two inputs through shared layers."""
    _check_serialized_numbers(zoo.FIT_ZOO[name], None, capfd)


def _check_serialized_numbers(builder, recompute, capfd):
    """Plain: bit-identical. With recompute: within the recompute pass's own tolerance (Grappler
    optimises a cloned subgraph on its own, tests/test_tf_recompute.py). Grappler accepts the graph:
    a chain against the graph's edges would make its optimizers fail their topological sort."""
    options = dict(device="/CPU:0", swap=False, serialize=True, device_spec=SPEC)
    if recompute:
        options["recompute"] = recompute
    plain = custom_loop(builder, tf.function)
    serialized = custom_loop(builder, lms_function(**options))
    assert_same_numbers(plain, serialized, rtol=0.0)
    graph = serialized[2].get_concrete_function(*_first_batch(builder)).graph
    assert len(serial_chain(graph)) >= 20  # a chain through the step, not a handful of ops (20-30 here)
    if recompute:
        assert serialized[2].plan.recomputed
    assert "topological" not in capfd.readouterr().err


def test_serialized_swap_plan_trains_to_the_same_numbers_and_keeps_copies_off_the_chain():
    """Swap copies are not chained (they run on their own streams); the compute around them is."""
    options = dict(device="/CPU:0", host="/CPU:1", swapout_threshold=4, min_swap_bytes=1024, serialize=True,
                   device_spec=SPEC)
    plain = custom_loop(zoo.resnet_style, tf.function)
    serialized = custom_loop(zoo.resnet_style, lms_function(**options))
    assert_same_numbers(plain, serialized)
    assert serialized[2].plan.swapped
    graph = serialized[2].get_concrete_function(*_first_batch(zoo.resnet_style)).graph
    copies = [op for op in graph.get_operations() if _compat.string_attr(op, "_lms") in ("swap_out", "swap_in")]
    chain = serial_chain(graph)
    assert copies and not set(copies) & set(chain)
    assert len(chain) > 100


def _first_batch(builder):
    model, (x, y) = builder()
    first = tuple(tf.constant(a[:zoo.BATCH]) for a in x) if isinstance(x, tuple) else tf.constant(x[:zoo.BATCH])
    return first, tf.constant(y[:zoo.BATCH])


@pytest.mark.parametrize("recompute", [None, "sqrt"])
def test_tensorflow_runs_the_ops_in_the_simulated_order(recompute):
    """Two inter-op threads would run the inception branches side by side; the chain forbids it.
    The executed start order equals the simulation's, clones included."""
    model, (x, y) = zoo.inception_style()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.05)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    options = dict(device="/CPU:0", swap=False, serialize=True, device_spec=SPEC)
    if recompute:
        options["recompute"] = recompute
    fn = lms_tf.function(step, **options)
    xb, yb = tf.constant(x[:8]), tf.constant(y[:8])
    graph = fn.get_concrete_function(xb, yb).graph
    simulated = list(simulate(fn.plain_irs[-1], fn.plan, cost=CostModel(get_device_spec(SPEC))).op_intervals)
    position = {name: i for i, name in enumerate(simulated)}
    chain = serial_chain(graph)
    # Structure: every chained op waits for the one before it, and the chain is the simulated order
    # (the convolutions Grappler fuses with their bias and activation run off the chain), except,
    # with oneDNN on, that what reads a bias gradient oneDNN fuses into its filter gradient runs
    # once the fused kernel can: right after the last op that kernel reads (with recompute, the
    # dense layer's bias update waits for the recomputed pooling its weight gradient reads). With recompute,
    # 28 ops or more: what Grappler folds once dead ends are pruned, as the runtime does, is off.
    assert len(chain) >= 25
    assert all(before in after.control_inputs for before, after in zip(chain, chain[1:]))
    chained = [simulator_name(graph, op.name) for op in chain]
    # (the suite runs with oneDNN off: nothing fuses, and the chain is the simulated order itself)
    waits = fused_kernel_waits(graph) if onednn_may_fuse("/CPU:0") else {}
    bias_grads = [graph.get_operation_by_name(name) for name in waits]

    def runs_from(op) -> float:
        """Where the op can run in the simulated order: at its place, or just after the last op a
        fused kernel it waits for reads."""
        kernel_reads = [position[simulator_name(graph, name)] for grad in bias_grads if op in _downstream(graph, [grad])
                        for name in waits[grad.name] if simulator_name(graph, name) in position]
        return max([position[simulator_name(graph, op.name)]] + [read + 0.5 for read in kernel_reads])

    runs = [(runs_from(op), position[name]) for op, name in zip(chain, chained)]
    assert runs == sorted(runs)
    assert recompute is None or not waits or any(place != start for start, place in runs)  # the bias update moved
    if recompute:
        # The plan recomputes whole branches, but their clones are Conv2D + BiasAdd + ReLU, which
        # Grappler fuses, so they run off the chain; the pooling clone is chained. (Chained loss-head
        # clones counted here once were gated on a gradient op TensorFlow prunes.)
        assert len(fn.plan.recomputed) > 5 and any(name.startswith("recompute/") for name in chained)
    # Behaviour: TensorFlow ran the chained ops in that order.
    fn(xb, yb)
    events = executed_ops(lambda: fn(xb, yb).numpy())
    serial = {op.name: position for position, op in enumerate(chain)}
    ran = [serial[e.node] for e in events if e.node in serial]
    # The rest were fused or folded by Grappler, or are ops the profiler does not trace (placeholders,
    # aliases, shape arithmetic): at least half of the kernels among the chained ops must be seen.
    kernels = [op for op in chain if op.type not in FREE_TYPES | {"Placeholder"}]
    assert len(ran) >= 0.5 * len(kernels), (len(ran), len(kernels))
    assert ran == sorted(ran)
    # The fused kernels run off the chain, each held behind a gate: it starts after the chained op
    # its gate waits for (without the gate, a recomputed one would start with the forward pass).
    gates = [op for op in graph.get_operations() if _compat.string_attr(op, "_lms") == "serial_gate"]
    readers = {reader.name: gate.control_inputs[0].name for gate in gates for reader in gate.outputs[0].consumers()}
    gated_kernels = {kernel.name: readers[reader] for kernel in grappler_fused_kernels(graph, "/device:CPU:0", 2**28)
                     for reader in kernel.ops if reader in readers}
    started = {}
    for index, event in enumerate(events):
        started.setdefault(event.node, index)
    seen = [(started[after], started[kernel]) for kernel, after in gated_kernels.items()
            if kernel in started and after in started]
    assert len(gated_kernels) >= 5 and len(seen) >= 0.5 * len(gated_kernels), (len(gated_kernels), len(seen))
    assert all(after < kernel for after, kernel in seen), seen
    # The unserialized step runs in another order on this machine: the check can fail.
    free = tf.function(step)
    free(xb, yb)
    free_ran = [serial[e.node] for e in executed_ops(lambda: free(xb, yb).numpy()) if e.node in serial]
    assert free_ran != sorted(free_ran)


@pytest.mark.parametrize("name", sorted(zoo.FIT_ZOO))
def test_model_fit_serialized_by_the_callback_trains_to_the_same_numbers(name, capfd):
    """``LMSCallback(serialize=True)``: every model family through ``model.fit``, bit-identical,
    and Grappler accepts the chained graph."""
    plain = fit_steps(zoo.FIT_ZOO[name])
    callback = lms_tf.LMSCallback(device="/CPU:0", swap=False, serialize=True, device_spec=SPEC)
    serialized = fit_steps(zoo.FIT_ZOO[name], callbacks=[callback])
    assert callback.plan is not None
    assert_same_numbers(plain, serialized)
    assert "topological" not in capfd.readouterr().err


def test_model_fit_serialized_with_swaps_chains_the_compute_in_the_simulated_order(capfd, monkeypatch):
    """Structure of the callback's serialized step with swaps and recompute: each chained op waits
    for the one before it, recompute clones are on the chain, swap copies are off it, and Grappler
    accepts the graph (Keras's own control edges did not close a cycle with the chain)."""
    from lms_tf.keras.step_hooks import add_step_hook, remove_step_hook

    # As on a CPU with oneDNN on (TensorFlow's x86 default; this suite runs without it).
    monkeypatch.setattr(serialize_module, "onednn_may_fuse", lambda device: True)
    model, (x, y) = zoo.resnet_style()
    facts = {}
    probe = graph_probe(facts)
    add_step_hook(model, probe)
    callback = lms_tf.LMSCallback(device="/CPU:0", host="/CPU:1", swapout_threshold=4, min_swap_bytes=1024,
                                  recompute="sqrt", serialize=True, device_spec=SPEC)
    try:
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    finally:
        remove_step_hook(model, probe)
    graph, plan = facts["graph"], callback.plan
    assert plan.swapped and plan.recomputed
    chain = serial_chain(graph)
    assert len(chain) > 100
    copies = {op for op in graph.get_operations() if _compat.string_attr(op, "_lms") in ("swap_out", "swap_in")}
    assert copies and not copies & set(chain)
    # A bias's gradient comes out of the fused Conv2DBackpropFilter after oneDNN's fusion: the pair
    # stays off the chain, and what reads the bias gradient (its update) is chained after every
    # chained op the fused kernel reads. The kernels' updates are on the chain too, where the
    # simulator frees their gradients.
    updates = {op for op in graph.get_operations() if op.type.startswith(("Assign", "ResourceApply"))
               and "gradient_tape" not in op.name}
    bias_grads = [op for op in graph.get_operations() if op.type == "BiasAddGrad"]
    assert bias_grads and not set(bias_grads) & set(chain)
    after_bias_grad = _downstream(graph, bias_grads)
    assert updates & after_bias_grad & set(chain) and updates - after_bias_grad & set(chain)
    place, waits, ordered_pairs = {op.name: i for i, op in enumerate(chain)}, fused_kernel_waits(graph), 0
    for bias_grad in bias_grads:
        read_by_kernel = [place[name] for name in waits.get(bias_grad.name, ()) if name in place]
        readers = [place[op.name] for op in _downstream(graph, [bias_grad]) if op.name in place]
        if read_by_kernel and readers:
            assert max(read_by_kernel) < min(readers), bias_grad.name
            ordered_pairs += 1
    assert ordered_pairs
    # The fused pair takes no edge itself, but the chained op after it waits for an exit reading the
    # bias gradient, i.e. for the fused kernel: the pair cannot run after its place.
    exits = {op.inputs[0].op: op for op in graph.get_operations() if _compat.string_attr(op, "_lms") == "serial_exit"}
    for bias_grad in bias_grads:
        assert bias_grad in exits, bias_grad.name
        assert set(exits[bias_grad]._control_outputs) & set(chain), bias_grad.name
    for earlier, later in zip(chain, chain[1:]):
        assert earlier in later.control_inputs, f"{later.name} does not wait for {earlier.name}"
    simulated = [simulator_name(graph, op.name) for op in chain]
    assert any(name.startswith("recompute/") for name in simulated)
    assert "topological" not in capfd.readouterr().err


def _downstream(graph: tf.Graph, sources) -> set:
    """The ops that wait for any of ``sources`` (data or control edges), sources included."""
    seen, stack = set(), list(sources)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(reader for t in op.outputs for reader in t.consumers())
            stack.extend(op._control_outputs)
    return seen


def test_what_follows_a_fusable_bias_gradient_is_chained_after_its_partners_inputs():
    """oneDNN fuses ``BiasAddGrad`` into the ``Conv2DBackpropFilter`` reading the same gradient, so
    the bias gradient then waits for the filter gradient's other input (here a recomputed
    activation, ranked late). A chained reader of the bias gradient ranked before that activation
    closed a cycle at run time on ResNet-50 ("778 nodes in a cycle"). The readers are chained
    after that activation instead; the fused pair itself stays off the chain."""
    g = tf.Graph()
    with g.as_default():
        dy = tf.compat.v1.placeholder(tf.float32, (2, 4, 4, 8), name="dy")
        bias_grad = tf.raw_ops.BiasAddGrad(out_backprop=dy, name="bias_grad")
        bias_step = tf.multiply(bias_grad, 0.1, name="bias_step")
        tf.negative(bias_step, name="bias_update")
        activation = tf.nn.relu(tf.compat.v1.placeholder(tf.float32, (2, 4, 4, 3), name="x"), name="recomputed")
        filter_grad = tf.raw_ops.Conv2DBackpropFilter(input=activation, filter_sizes=[1, 1, 3, 8], out_backprop=dy,
                                                      strides=[1, 1, 1, 1], padding="VALID", name="filter_grad")
        tf.negative(filter_grad, name="filter_update")
    rank = {"bias_grad": 0, "bias_step": 1, "bias_update": 2, "recomputed": 3, "filter_grad": 4, "filter_update": 5}
    impose_order(g, rank)
    assert [op.name for op in serial_chain(g)] == ["recomputed", "bias_step", "bias_update", "filter_update"]


def test_a_bias_gradient_its_filter_gradient_waits_for_is_not_fused_with_it():
    """A plan may make a convolution's backward wait for its bias gradient (the planner's
    ordering of backward branches: their temporaries were alive together at the peak). oneDNN
    cannot then run the two as one kernel, so the bias gradient does not wait for the filter
    gradient's inputs: counting that wait put the bias gradient after itself, and the serializer
    refused the U-Net's planned step ("a cycle through ... BiasAddGrad ... Conv2DBackpropFilter")."""
    g = tf.Graph()
    with g.as_default():
        dy = tf.compat.v1.placeholder(tf.float32, (2, 4, 4, 8), name="dy")
        bias_grad = tf.raw_ops.BiasAddGrad(out_backprop=dy, name="bias_grad")
        tf.negative(bias_grad, name="bias_update")
        activation = tf.nn.relu(tf.compat.v1.placeholder(tf.float32, (2, 4, 4, 3), name="x"), name="activation")
        filter_grad = tf.raw_ops.Conv2DBackpropFilter(input=activation, filter_sizes=[1, 1, 3, 8], out_backprop=dy,
                                                      strides=[1, 1, 1, 1], padding="VALID", name="filter_grad")
        tf.negative(filter_grad, name="filter_update")
    assert {"activation", "dy"} <= fused_kernel_waits(g)["bias_grad"]   # its partner's inputs
    _compat.add_control_input(filter_grad.op, bias_grad.op)   # the plan's ordering
    assert fused_kernel_waits(g) == {}
    rank = {"bias_grad": 0, "bias_update": 1, "activation": 2, "filter_grad": 3, "filter_update": 4}
    assert ranked_topological_order(g, rank, fused_kernel_waits(g)).index("bias_grad") < \
        ranked_topological_order(g, rank, fused_kernel_waits(g)).index("filter_grad")
    impose_order(g, rank)   # no cycle


def test_a_planned_wait_for_a_bias_gradient_serializes_trains_and_runs_in_that_order(monkeypatch):
    """Through the front-end: each convolution's backward waits for its bias gradient (an
    ordering added to the plan); serialized, the step trains to the plain step's numbers and
    TensorFlow runs each bias gradient before its convolution's filter gradient. (With oneDNN
    off, the suite's setting, nothing fuses the two; with it on: tests/test_tf_onednn.py.)"""
    import dataclasses

    from lms_tf.core.plan import Ordering
    from lms_tf.tf import driver

    planned = driver._make_plan

    def with_orderings(ir, request, aliases, **kwargs):
        plan = planned(ir, request, aliases, **kwargs)
        orderings = []
        for op in ir.ops:
            if op.type == "Conv2DBackpropFilter":
                bias = next(o.name for o in ir.ops if o.type == "BiasAddGrad" and o.inputs[0] == op.inputs[2])
                backward = tuple(o.name for o in ir.ops if o.type.startswith("Conv2DBackprop")
                                 and o.inputs[2] == op.inputs[2])
                orderings.append(Ordering(backward, (bias,), "test: the bias gradient first"))
        assert len(orderings) == 4   # the four convolutions
        return dataclasses.replace(plan, orderings=plan.orderings + tuple(orderings))

    monkeypatch.setattr(driver, "_make_plan", with_orderings)
    options = dict(device="/CPU:0", swap=False, serialize=True, device_spec=SPEC)
    plain = custom_loop(zoo.sequential_cnn, tf.function)
    serialized = custom_loop(zoo.sequential_cnn, lms_function(**options))
    assert_same_numbers(plain, serialized, rtol=0.0)
    fn = serialized[2]
    x, y = _first_batch(zoo.sequential_cnn)
    graph = fn.get_concrete_function(x, y).graph
    filters = [op for op in graph.get_operations() if op.type == "Conv2DBackpropFilter"]
    assert len(filters) == 4
    events = executed_ops(lambda: fn(x, y))
    for op in filters:
        bias = next(c for c in op.inputs[2].consumers() if c.type == "BiasAddGrad")
        assert bias in ancestors(op), op.name   # the ordering is in the graph
        ran_bias = [e for e in events if e.node.endswith(bias.name)]
        ran_filter = [e for e in events if e.node.endswith(op.name)]
        assert ran_bias and ran_filter, (bias.name, op.name, sorted({e.type for e in events}))
        assert ran_bias[0].end_ps <= ran_filter[0].start_ps, op.name


def test_serialize_must_be_a_boolean():
    with pytest.raises(LMSOptionError, match="serialize must be True or False"):
        lms_tf.function(lambda x: x, device="/CPU:0", serialize="yes")


def test_grappler_sizes_tensors_that_follow_from_a_weight_shape_when_given_variable_shapes():
    """A 1x1 convolution's output shape follows from the kernel's. Grappler cannot see through
    the variable handle, so by default the 16 MiB output counts as almost nothing. Given the
    variable shapes, it counts the output and the Relu's (Grappler does not model a buffer
    reused in place)."""
    kernel = tf.Variable(tf.ones((1, 1, 8, 256)))

    @tf.function
    def step(x):
        return tf.reduce_sum(tf.nn.relu(tf.nn.conv2d(x, kernel, 1, "SAME")))

    concrete = step.get_concrete_function(tf.ones((4, 64, 64, 8)))
    output = 4 * 64 * 64 * 256 * 4
    assert virtual_gpu_peak(concrete) < output / 10
    shaped = virtual_gpu_peak(concrete, variable_shapes=True)
    assert 2 * output <= shaped <= 2 * output + 4 * 64 * 64 * 8 * 4 + 8 * 256 * 4 + 4096


@pytest.mark.parametrize("batch", [4, None], ids=["known-batch", "unknown-batch"])
def test_grappler_runs_offline_with_the_step_inputs_shapes(monkeypatch, batch):
    """The runtime's arithmetic optimizer regroups an addition tree (``AddOpsRewrite``: a
    LayerNorm's ``x * scale + offset`` parts) only when it knows the shapes, which the runtime
    reads off the step's arguments. Offline, a data ``Placeholder`` is a feed, of no shape to
    Grappler: the regrouping was not found, ``serialize`` chained the tree, and a serialized
    recompute step of the Transformer encoder moved its losses in the 7th digit. With an unknown
    batch the runtime's argument still has its rank, and so does the offline input."""
    scale, offset = tf.Variable(tf.ones(8)), tf.Variable(tf.zeros(8))
    found = {}

    @tf.function(input_signature=[tf.TensorSpec((batch, 8), tf.float32)])
    def step(x):
        total = tf.add(tf.multiply(x, scale, name="scaled"), offset, name="add_1")
        total = tf.add(total, tf.multiply(x, x, name="square"), name="add_2")
        out = tf.exp(total, name="out")
        graph = _compat.current_graph()
        found["shaped"] = grappler_rewritten_ops(graph, "/device:CPU:0", 2**28, outputs=[out])
        with monkeypatch.context() as patch:  # the data input left a Placeholder, i.e. a feed
            patch.setattr(_compat.graph, "_shaped_default", lambda node: [])
            found["fed"] = grappler_rewritten_ops(graph, "/device:CPU:0", 2**28, outputs=[out])
        return out

    step.get_concrete_function()
    # The tree's inner addition is absorbed into the regrouped sum (its root keeps its name, and
    # changes either way: Grappler turns x * x into Square, which the root reads).
    assert {"add_1", "add_2"} <= found["shaped"], sorted(found["shaped"])
    assert "add_1" not in found["fed"], sorted(found["fed"])


def test_grappler_offline_does_not_make_up_an_unknown_batch():
    """With the batch unknown, the offline run must not fold the step's shapes to a size: the
    runtime cannot (a default input of batch 1 once let Grappler fold every ``Shape`` and
    convolution-gradient size to it, leaving those ops off the serialization chain)."""
    found = {}

    @tf.function(input_signature=[tf.TensorSpec((None, 8), tf.float32)])
    def step(x):
        size = tf.shape(x, name="batch_shape")
        total = tf.reduce_sum(x, 1, keepdims=True, name="total")
        out = tf.exp(tf.broadcast_to(total, size, name="spread"), name="out")
        found["rewritten"] = grappler_rewritten_ops(_compat.current_graph(), "/device:CPU:0", 2**28, outputs=[out])
        return out

    step.get_concrete_function()
    assert not {"batch_shape", "spread"} & found["rewritten"], sorted(found["rewritten"])
