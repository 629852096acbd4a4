"""Which buffer TensorFlow's executor reuses and in which order it releases them, and what a
Keras process allocated before its first step, against the simulator's allocation log.

These rules decide where later tensors land in the allocator, so the simulator must follow them:

* Grappler sorts the inputs of a commutative op (``AddV2``, ``AddN``, ``Mul``, ...) by name,
  and the elementwise kernel writes its output into the first input it may reuse. A gradient
  sum at a residual connection thus keeps the buffer of the branch whose name sorts first.
* After a kernel runs, the executor releases its inputs in input order.
* Grappler accumulates some sums of three gradients into a temporary variable: the sum gets a
  buffer of its own, and the zeros it starts from stay allocated.
* Keras creates a kernel through two temporaries of its size (:func:`pool_history`).

Each rule is checked on a small step three ways: the IR's input order differs from the rule's,
the simulator's log follows the rule, and TensorFlow's allocation trace shows the real buffers
reused and freed that way.
"""

import pytest
import tensorflow as tf

from lms_tf.cost import CostModel, get_device_spec
from lms_tf.simulate import pool_history, resident_buffers, simulate
from lms_tf.tf.diagnostics import allocation_trace, grappler_accumulated_sums
from lms_tf.tf.trace import build_ir
from tests import zoo

V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
MiB = 2**20
X = tf.random.stateless_normal((512, 1024), seed=(1, 2))  # 2 MiB


def _big_events(step):
    """The 2 MiB allocations and frees of one real run, each named by the op that allocated it."""
    step(X)
    owner, events = {}, []
    for event in allocation_trace(lambda: step(X).numpy()):
        if event.kind == "alloc":
            owner[event.address] = event.op
        if event.requested_bytes >= MiB:
            events.append((event.kind, owner[event.address]))
    return events


def _simulated_events(step):
    ir = build_ir(step.get_concrete_function(X).graph)
    log = simulate(ir, None, cost=V100, log_allocations=True).allocations
    return ir, [event for event in log if event[0] != "alloc" or event[2] >= MiB]


def test_a_sum_writes_into_the_input_whose_name_sorts_first():
    @tf.function
    def step(x):
        z = tf.exp(x, name="z_exp")
        a = tf.sin(x, name="a_sin")
        return tf.reduce_sum(tf.add(z, a, name="sum"))

    ir, simulated = _simulated_events(step)
    assert ir.op("sum").inputs == ("z_exp:0", "a_sin:0")  # the traced order: z first
    assert simulated[:4] == [("alloc", "z_exp:0", 2 * MiB), ("alloc", "a_sin:0", 2 * MiB),
                             ("rename", "a_sin:0", "sum:0"), ("free", "z_exp:0", 0)]
    # TensorFlow: no allocation for the sum, and z's buffer is released first (a's became the sum).
    # z and a are both ready after x, and two inter-op threads run them in either order.
    real = _big_events(step)
    assert sorted(op for event, op in real if event == "alloc") == ["a_sin", "z_exp"]
    assert [op for event, op in real if event == "free"] == ["z_exp", "a_sin"]


def test_inputs_are_released_in_input_order():
    @tf.function
    def step(x):
        z = tf.exp(x, name="z_exp")
        a = tf.sin(x, name="a_sin")
        m = tf.cos(x, name="m_cos")
        return tf.reduce_sum(tf.concat([z, m, a], axis=0, name="joined"))

    _, simulated = _simulated_events(step)
    frees = [key for event, key, _ in simulated if event == "free" and key in ("z_exp:0", "m_cos:0", "a_sin:0")]
    assert frees == ["z_exp:0", "m_cos:0", "a_sin:0"]  # neither allocation nor name order
    real_frees = [op for event, op in _big_events(step) if event == "free" and op != "joined"]
    assert real_frees == ["z_exp", "m_cos", "a_sin"]


def _dense_bn_step(batch: int):
    """A Keras training step (Dense + BatchNormalization + ReLU, three times) and its batch: the
    gradient of each BatchNormalization sums three terms with one ``AddN``."""
    import keras

    zoo.reseed(0)
    inputs = keras.Input((512,))
    h = inputs
    for _ in range(3):
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Dense(1024)(h)))
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    optimizer = keras.optimizers.SGD(0.01)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step, tf.random.stateless_normal((batch, 512), seed=(5, 6)), tf.zeros((batch,), tf.int32)


@pytest.mark.parametrize("batch", [4096, 8192])
def test_grappler_accumulates_the_gradient_sums_it_was_predicted_to(batch):
    """Grappler rewrites a sum of three gradients into additions into a temporary variable when
    its estimate of the step exceeds 80% of the 256 MiB it is told a CPU has: not at batch 4096,
    at 8192. The offline prediction (TensorFlow's optimizer run on the traced step) names the
    sums TensorFlow's allocator then really serves a ``<sum>/tmp_var`` for."""
    step, x, y = _dense_bn_step(batch)
    concrete = step.get_concrete_function(x, y)
    predicted = grappler_accumulated_sums(concrete)
    step(x, y)
    seen = {event.op[:-len("/tmp_var")] for event in allocation_trace(lambda: step(x, y).numpy())
            if event.kind == "alloc" and event.op.endswith("/tmp_var")}
    assert predicted == seen
    assert bool(seen) == (batch == 8192)
    if seen:
        (name,) = seen
        ir = build_ir(concrete.graph)
        log = simulate(ir, None, cost=V100, log_allocations=True, accumulated_sums=seen).allocations
        plain_log = simulate(ir, None, cost=V100, log_allocations=True).allocations
        assert ("alloc", f"{name}:0", ir.tensors[f"{name}:0"].nbytes) in log  # a buffer of its own
        assert any(event[0] == "rename" and event[2] == f"{name}:0" for event in plain_log)  # else: in place
        assert ("alloc", f"{name}/tmp_var_zeros", ir.tensors[f"{name}:0"].nbytes) in pool_history(ir, seen)


def test_keras_creates_a_kernel_through_two_temporaries_of_its_size():
    """What :func:`pool_history` assumes of a variable's creation, seen in TensorFlow's trace:
    a Dense kernel takes three buffers of its size (random draw, scaled, shifted), the first two
    freed; its bias one."""
    import keras

    layer = keras.layers.Dense(1000)
    events = allocation_trace(lambda: layer.build((None, 500)))
    kernel_bytes = 500 * 1000 * 4
    owner = {}
    big = []
    for event in events:
        if event.kind == "alloc":
            owner[event.address] = event.op
        if event.requested_bytes == kernel_bytes:
            big.append((event.kind, owner.get(event.address, "")))
    assert [kind for kind, _ in big] == ["alloc", "alloc", "alloc", "free", "free"], big
    assert [op.split("/")[-1] for _, op in big[:3]] == ["StatelessRandomUniformV2", "Mul", "AddV2"], big

    v = tf.Variable(tf.zeros((500, 1000)))
    b = tf.Variable(tf.zeros((1000,)))

    @tf.function
    def step(x):
        return tf.reduce_sum(x @ v + b)

    ir = build_ir(step.get_concrete_function(tf.ones((8, 500))).graph)
    kernel, bias = [handle for handle, _ in resident_buffers(ir)]
    assert pool_history(ir) == [
        ("alloc", f"{kernel}#initializer_draw", kernel_bytes), ("alloc", f"{kernel}#initializer_scaled", kernel_bytes),
        ("alloc", kernel, kernel_bytes), ("free", f"{kernel}#initializer_scaled", 0),
        ("free", f"{kernel}#initializer_draw", 0), ("alloc", bias, 4000), ("alloc", "x:0", 8 * 500 * 4)]


def _swish_step():
    """A swish (``tf.nn.silu``) between two 2 MiB tensors, trained. Its gradient function (a
    ``custom_gradient``) also computes the gradient of its constant ``beta`` (a ``Square`` of the
    input, ...), which no one asks for, and multiplies the input by ``beta = 1.0``."""
    w = tf.Variable(tf.ones((1024,)), name="w")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.silu(tf.multiply(x, w, name="scaled")))
        w.assign_sub(0.01 * tape.gradient(loss, w))
        return loss

    return step


def _big_allocations_by_type(step, graph):
    """How many 1 MiB-or-larger buffers each op type allocated in one real run."""
    step(X)
    counts = {}
    for event in allocation_trace(lambda: step(X).numpy()):
        if event.kind == "alloc" and event.requested_bytes >= MiB and event.op:
            op_type = graph.get_operation_by_name(event.op).type
            counts[op_type] = counts.get(op_type, 0) + 1
    return counts


def test_ops_tensorflow_prunes_allocate_nothing_and_are_not_in_the_ir():
    """TensorFlow runs only what the step's outputs and its stateful ops need. The unused
    ``beta`` gradient of a swish (a ``Square`` of its input, and what reads it) never runs: the IR
    leaves it out, so the simulator does not hold its 2 MiB from the forward pass to the backward."""
    step = _swish_step()
    graph = step.get_concrete_function(X).graph
    squares = [op.name for op in graph.get_operations() if op.type == "Square"]
    assert squares  # traced: the beta gradient squares the swish's input
    ir = build_ir(graph)
    assert not set(squares) & {op.name for op in ir.ops}
    # Still there: the swish's real gradient (sigmoid recomputed behind the incoming gradient).
    assert any(op.type == "Sigmoid" and op.phase.value == "backward" for op in ir.ops)
    real = _big_allocations_by_type(step, graph)
    assert "Square" not in real
    log = simulate(ir, None, cost=V100, log_allocations=True).allocations
    simulated = sum(1 for event in log if event[0] == "alloc" and event[2] >= MiB)
    assert simulated == sum(real.values())
    # Counting the pruned ops (what the IR held before) allocates more than TensorFlow did.
    unpruned = build_ir(graph, outputs=[t for op in graph.get_operations() for t in op.outputs
                                        if not t.consumers() and t.dtype != tf.resource])
    log = simulate(unpruned, None, cost=V100, log_allocations=True).allocations
    assert sum(1 for event in log if event[0] == "alloc" and event[2] >= MiB) > simulated


def test_a_multiplication_by_one_is_a_buffer_of_its_input():
    """Grappler's constant folding removes ``x * 1`` (the swish gradient's ``beta * x``): its
    readers read ``x``. The IR marks the op as passing its input through, the simulator allocates
    nothing for it, and TensorFlow's allocator served nothing to a multiplication by one."""
    step = _swish_step()
    graph = step.get_concrete_function(X).graph
    ir = build_ir(graph)
    by_one = [op for op in ir.ops if op.passes_through is not None]
    assert by_one and all(op.type == "Mul" for op in by_one)
    for op in by_one:
        constant = graph.get_tensor_by_name(op.inputs[1 - op.passes_through])
        assert tf.get_static_value(constant) == 1.0
    step(X)
    served = {event.op for event in allocation_trace(lambda: step(X).numpy()) if event.kind == "alloc"}
    assert not served & {op.name for op in by_one}
    log = simulate(ir, None, cost=V100, log_allocations=True).allocations
    assert not {event[1] for event in log if event[0] == "alloc"} & {f"{op.name}:0" for op in by_one}
    # The other multiplications are real kernels, and are not passed through.
    assert any(op.type == "Mul" and op.passes_through is None and op.name in served for op in ir.ops)


def _grouped_conv_step(channels: int = 256):
    """A Keras grouped (depthwise) convolution, trained: Keras 3 compiles it with XLA on
    TensorFlow, so the step calls two XLA-compiled functions (the convolution and its gradient)."""
    import keras

    zoo.reseed(0)
    model = keras.Sequential([keras.Input((8, 8, channels)),
                              keras.layers.Conv2D(channels, 7, padding="same", groups=channels),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    optimizer = keras.optimizers.SGD(0.01)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step, tf.random.stateless_normal((4, 8, 8, channels), seed=(3, 4))


def test_xla_compiled_calls_take_the_temporaries_xla_planned():
    """XLA plans a compiled call's temporaries itself and takes them from TensorFlow's allocator
    as one block (unnamed in the trace). On the CPU it computes a grouped convolution's filter
    gradient through a dense filter: 2 * 7 * 7 * C * C float32 bytes for C channels. The IR reads
    that figure from XLA's buffer plan, TensorFlow's allocator served exactly that block, and the
    simulator holds it while the call runs (on a GPU, where XLA plans otherwise, not)."""
    import dataclasses

    channels = 256
    step, x = _grouped_conv_step(channels)
    ir = build_ir(step.get_concrete_function(x).graph)
    assert ir.compiled_for == "CPU"
    dense_filter_gradient = 2 * 7 * 7 * channels * channels * 4
    assert sorted(ir.compiled_scratch.values())[-1] == dense_filter_gradient  # 24.5 MiB
    step(x)
    blocks = [e.requested_bytes for e in allocation_trace(lambda: step(x).numpy()) if e.kind == "alloc" and not e.op]
    assert dense_filter_gradient in blocks
    sim = simulate(ir, None, cost=V100, kernels="onednn")
    without = simulate(dataclasses.replace(ir, compiled_scratch={}), None, cost=V100, kernels="onednn")
    assert sim.peak_bytes >= without.peak_bytes + dense_filter_gradient - 2 * MiB  # the block dominates the peak
    assert simulate(ir, None, cost=V100, kernels="cudnn").peak_bytes < sim.peak_bytes  # planned for the CPU only


def test_a_compiled_call_xla_cannot_size_is_named_in_a_warning():
    from lms_tf import _compat
    from lms_tf.core.errors import LMSWarning

    step, x = _grouped_conv_step(8)
    graph = step.get_concrete_function(x).graph
    call = next(op for op in graph.get_operations() if _compat.must_compile(op))
    with pytest.raises(ValueError, match="no concrete shape"):
        _compat.compiled_temp_bytes(graph, call, [None] * len(call.inputs), "CPU")
    unsized = step.get_concrete_function(tf.TensorSpec((None, 8, 8, 8))).graph
    with pytest.warns(LMSWarning, match="XLA could not be asked"):
        ir = build_ir(unsized)
    assert ir.compiled_for == "CPU" and len(ir.compiled_scratch) < sum(map(_compat.must_compile, unsized.get_operations()))
