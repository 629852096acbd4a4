"""A swap must not change how Grappler regroups the backward pass's arithmetic.

Grappler regroups trees of ``Mul``/``Add`` ops (constant folding's ``ConstantPushDown``, the
arithmetic optimizer's tree rewrites). Constant folding leaves a tree alone when one of its
leaves is on another device, and the arithmetic optimizer orders the leaves it regroups by node
name. A backward op that read a host copy of a swapped tensor directly was regrouped otherwise
than in the plain step: on a MultiHeadAttention classifier the query and key gradients differed
after one step once the softmax was swapped. Each swap-in is therefore read on the device
through an ``Identity`` named to sort as the swapped tensor's producer (``device_read``).

Proven three ways: the numbers (bit-identical losses and weights, through ``fit`` and a custom
loop); the structure (every device read on the plan's device, sorting against every other node
as its producer does); the behaviour (the graph Grappler hands TensorFlow's executor holds the
same ops with the same inputs as the plain step's, the swap-ins mapped back to their tensors).
A weight on the host is a leaf of such trees too: a model whose weights sit in constant-scaled
products trains with ``weights="host"`` bit for bit like the plain step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import lms_tf
from lms_tf import _compat
from lms_tf.tf.rewrite import LMS_ATTR
from tests import zoo
from tests.helpers import (BATCH, CPU_LMS, assert_same_numbers, custom_loop, fit_steps, keras_train_step,
                           lms_function)

#: Small enough that the attention's tensors (a few KiB at this size) are swapped.
SWAP_ALL = dict(CPU_LMS, swapout_threshold=4, min_swap_bytes=1024, swapin_ahead=2)


def attention_classifier():
    """Self-attention over a float sequence, LayerNorm over a residual, average pooling, Adam: the
    model the defect was found on (no mask, no embedding: unlike the zoo's decoder)."""
    zoo.reseed()
    inputs = keras.Input((10, 16))
    attended = keras.layers.MultiHeadAttention(2, 8)(inputs, inputs)
    h = keras.layers.LayerNormalization()(inputs + attended)
    model = keras.Model(inputs, keras.layers.Dense(5)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(5)
    return model, (rng.random((3 * BATCH, 10, 16)).astype("float32"), rng.integers(0, 5, 3 * BATCH).astype("int32"))


class _Gain(keras.layers.Layer):
    """A per-feature gain inside constant factors: its weight is a leaf of the backward pass's
    ``Mul``/``Add`` trees."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return 0.5 * (x * self.gain) + 0.25 * self.gain


def gelu_block():
    """Attention, LayerNorm, a constant-scaled gain, a GELU Dense and an RMS-scaled LayerNorm: the
    GELU's gradient is a tree of backward ``Mul`` ops, which a recompute gate waiting on one of
    them kept Grappler from regrouping as in the plain step."""
    zoo.reseed()
    inputs = keras.Input((10, 16))
    h = keras.layers.LayerNormalization()(inputs + keras.layers.MultiHeadAttention(2, 8)(inputs, inputs))
    h = keras.layers.Dense(16, activation="gelu")(_Gain()(h))
    h = keras.layers.LayerNormalization(epsilon=1e-5, center=False)(h)
    model = keras.Model(inputs, keras.layers.Dense(5)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(5)
    return model, (rng.random((3 * BATCH, 10, 16)).astype("float32"), rng.integers(0, 5, 3 * BATCH).astype("int32"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [None, "cheap"])
def test_fit_swapping_and_recomputing_a_gelu_block_equals_plain_fit(recompute):
    plain = fit_steps(gelu_block)
    callback = lms_tf.LMSCallback(**SWAP_ALL, **({"recompute": recompute} if recompute else {}))
    rewritten = fit_steps(gelu_block, callbacks=[callback])
    plan = callback.plan
    assert plan.swapped and (plan.recomputed or not recompute), lms_tf.explain(callback)
    assert_same_numbers(plain, rewritten)


class _ScaledWeights(keras.layers.Layer):
    """Two weights as leaves of constant-scaled product trees, which Grappler regroups: with the
    weights on the host, each is read from a fetch made there."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")
        self.v = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

    def call(self, x):
        return 2.0 * (x * self.w) * 3.0 + (self.v * 0.5) * 4.0 + x * self.v * self.w * 1.5


def scaled_weights_mlp():
    """Dense layers around two :class:`_ScaledWeights` and a GELU, Adam."""
    zoo.reseed()
    inputs = keras.Input((16,))
    h = _ScaledWeights()(keras.layers.Dense(16)(inputs))
    h = _ScaledWeights()(keras.layers.Dense(16, activation="gelu")(h))
    model = keras.Model(inputs, keras.layers.Dense(5)(h))
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(5)
    return model, (rng.random((3 * BATCH, 16)).astype("float32"), rng.integers(0, 5, 3 * BATCH).astype("int32"))


@pytest.mark.timeout(300)
def test_weights_on_the_host_as_leaves_of_constant_scaled_products_keep_the_numbers():
    plain = fit_steps(scaled_weights_mlp)
    callback = lms_tf.LMSCallback(**SWAP_ALL, weights="host")
    rewritten = fit_steps(scaled_weights_mlp, callbacks=[callback])
    assert len(callback.plan.offloaded_weights) >= 10, lms_tf.explain(callback)
    assert_same_numbers(plain, rewritten)
    plain = custom_loop(scaled_weights_mlp, tf.function, optimizer=keras.optimizers.Adam())
    to_host = lambda model, optimizer: lms_tf.place_weights(model, optimizer, host=CPU_LMS["host"])  # noqa: E731
    rewritten = custom_loop(scaled_weights_mlp, lms_function(**SWAP_ALL, weights="host"),
                            optimizer=keras.optimizers.Adam(), prepare=to_host)
    assert len(rewritten[2].plan.offloaded_weights) >= 10, lms_tf.explain(rewritten[2])
    assert_same_numbers(plain, rewritten)


def _moves_the_softmax(plan, recomputed=False) -> bool:
    return any(d.tensor.endswith("/Softmax:0") for d in plan.swapped + (plan.recomputed if recomputed else ()))


@pytest.mark.timeout(300)
def test_fit_swapping_the_attention_softmax_equals_plain_fit():
    plain = fit_steps(attention_classifier)
    callback = lms_tf.LMSCallback(**SWAP_ALL)
    rewritten = fit_steps(attention_classifier, callbacks=[callback])
    assert _moves_the_softmax(callback.plan), lms_tf.explain(callback)
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [None, "cheap"])
def test_custom_loop_swapping_the_attention_softmax_equals_plain(recompute):
    optimizer = lambda: keras.optimizers.Adam()  # noqa: E731
    plain = custom_loop(attention_classifier, tf.function, optimizer=optimizer())
    options = dict(SWAP_ALL, **({"recompute": recompute} if recompute else {}))
    rewritten = custom_loop(attention_classifier, lms_function(**options), optimizer=optimizer())
    # With recompute allowed the planner recomputes the softmax: its clone is read on the device.
    assert _moves_the_softmax(rewritten[2].plan, recomputed=bool(recompute)), lms_tf.explain(rewritten[2])
    assert_same_numbers(plain, rewritten)


def _one_step(decorate):
    """A step of the attention classifier run once: (the step function, its batch)."""
    model, (x, y) = attention_classifier()
    fn = custom_loop(lambda: (model, (x, y)), decorate, steps=1, optimizer=keras.optimizers.SGD(0.1))[2]
    return fn, (tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))


@pytest.mark.timeout(300)
def test_every_swap_in_is_read_on_the_device_under_a_name_that_sorts_as_its_producer():
    fn, batch = _one_step(lms_function(**SWAP_ALL))
    graph = fn.get_concrete_function(*batch).graph
    device = tf.DeviceSpec.from_string(CPU_LMS["device"])
    others = [op.name for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) is None]
    swap_ins = [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "swap_in"]
    assert len(swap_ins) == fn.plan.num_swap_ins >= 6
    for swap_in in swap_ins:
        (read,) = swap_in.outputs[0].consumers()   # the device's read, and nothing else
        assert _compat.string_attr(read, LMS_ATTR) == "device_read"
        assert tf.DeviceSpec.from_string(read.device).device_index == device.device_index
        producer = swap_in.inputs[0].op.inputs[0].op.name   # swap-in <- swap-out <- the swapped tensor
        assert read.name.startswith(producer + "-lms_read")
        others_but_it = [name for name in others if name != producer]
        assert [name < producer for name in others_but_it] == [name < read.name for name in others_but_it]
        readers = read.outputs[0].consumers()
        assert readers and all(r.name.startswith("gradient_tape/") for r in readers)


def _first_call_graph(decorate) -> tuple:
    """(the step, its batch, node name -> NodeDef of the graphs Grappler handed TensorFlow's
    executor on the step's first call). Run metadata holds a function's graphs only from the
    call that instantiates it, so it is on from the first call."""
    model, (x, y) = attention_classifier()
    fn = decorate(keras_train_step(model, keras.optimizers.SGD(0.1)))
    batch = (tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))
    context.enable_run_metadata()
    try:
        fn(*batch)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    return fn, batch, {node.name: node for function in metadata.function_graphs
                       for node in function.post_optimization_graph.node}


@pytest.mark.timeout(300)
def test_grappler_regroups_the_rewritten_step_as_the_plain_step():
    _, _, before = _first_call_graph(tf.function)
    fn, batch, after = _first_call_graph(lms_function(**SWAP_ALL))
    graph = fn.get_concrete_function(*batch).graph
    # Each copy back (a device read, or a swap-in read directly) stands for the tensor it copies.
    stands_for = {}
    for op in graph.get_operations():
        copy = op.inputs[0].op if _compat.string_attr(op, LMS_ATTR) == "device_read" else op
        if _compat.string_attr(copy, LMS_ATTR) == "swap_in":
            original = copy.inputs[0].op.inputs[0]   # swap-in <- swap-out <- the swapped tensor
            stands_for[op.name] = original.op.name + ("" if original.value_index == 0 else f":{original.value_index}")
    assert stands_for and before and after

    def data_inputs(node):
        return [stands_for.get(i, i) for i in node.input if not i.startswith("^")]

    compared = 0
    for name, node in before.items():
        if node.op in ("_Arg", "_Retval"):
            continue
        assert name in after, f"{name} ({node.op}) is gone from the rewritten step"
        assert (after[name].op, data_inputs(after[name])) == (node.op, data_inputs(node)), name
        compared += 1
    # The softmax gradient's regrouped product is among them.
    assert any(n.op == "Mul" and "multi_head_attention" in name and "gradient_tape" in name for name, n in before.items())
    assert compared >= 150
