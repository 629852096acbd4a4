"""Grappler's live set at its peak (``virtual_gpu_peak_report``), the in-place pairs it counts
twice, and how Grappler's own swap pass is judged (``grappler_baseline_report``)."""

import tensorflow as tf

from lms_tf.tf.diagnostics import virtual_gpu_peak, virtual_gpu_peak_report

MiB = 2**20
X = tf.ones((MiB // 4,))  # 1 MiB; tiled 4x: 4 MiB


def _report(fn):
    return virtual_gpu_peak_report(tf.function(fn).get_concrete_function(X))


def test_an_elementwise_kernel_overwriting_its_only_input_is_counted_once():
    report = _report(lambda x: tf.reduce_sum(tf.tile(x, [4]) / 3.0))
    names = {node.rpartition("/")[2]: nbytes for node, _, nbytes in report.live}
    assert names["Tile"] == names["truediv"] == 4 * MiB  # Grappler holds both at its peak
    assert report.in_place_bytes == 4 * MiB  # TensorFlow writes truediv into Tile's buffer
    assert report.peak_bytes_counting_in_place_once == report.peak_bytes - 4 * MiB
    assert report.peak_bytes == virtual_gpu_peak(tf.function(lambda x: tf.reduce_sum(tf.tile(x, [4]) / 3.0))
                                                 .get_concrete_function(X))


def test_a_reader_the_step_does_not_run_does_not_stop_an_in_place_kernel():
    """Keras's optimizer passes every gradient through an ``IdentityN`` nothing reads; TensorFlow
    prunes it, so the learning-rate product still writes into the gradient's buffer."""
    def step(x):
        t = tf.tile(x, [4])
        tf.identity_n([t])  # unread: pruned
        return tf.reduce_sum(t / 3.0)

    report = _report(step)
    assert report.in_place_bytes == 4 * MiB
    assert report.step_peak_bytes == report.peak_bytes - 4 * MiB


def test_an_input_read_again_later_is_not_overwritten():
    report = _report(lambda x: (lambda t: tf.reduce_sum(t / 3.0) + tf.reduce_max(t))(tf.tile(x, [4])))
    assert {nbytes for _, _, nbytes in report.live} >= {4 * MiB}
    assert report.in_place_bytes == 0  # Tile's output has a second reader, so truediv gets its own buffer


def test_tensorflow_really_computes_that_output_in_the_input_buffer():
    """The real CPU allocator (BFC, set by the conftest) hands out one 4 MiB buffer, to Tile:
    truediv (a Mul by 1/3 after Grappler's rewrites) runs and writes into it. Grappler's
    virtual cluster, above, counts two."""
    from lms_tf.tf.diagnostics import allocation_trace, executed_ops

    step = tf.function(lambda x: tf.reduce_sum(tf.tile(x, [4]) / 3.0))
    step(X)
    big = [e.op.rpartition("/")[2] for e in allocation_trace(lambda: step(X).numpy())
           if e.kind == "alloc" and e.requested_bytes >= 4 * MiB]
    assert big == ["Tile"]
    assert "truediv" in [e.node for e in executed_ops(lambda: step(X).numpy())]


def _gated(x):
    """A 4 MiB tensor read again through a kept ``Identity`` that waits for another op (a
    serialization gate, kept from Grappler as the rewrite keeps it), and directly."""
    from lms_tf.tf.rewrite.common import mark

    t = tf.tile(x, [4])
    with tf.control_dependencies([tf.reduce_sum(x)]):
        gate = tf.identity(t, name="gate")
    mark(gate.op, "serial_gate")
    return tf.reduce_sum(gate * 2.0) + tf.reduce_max(t)


def test_an_alias_of_a_live_tensor_is_counted_once():
    """Grappler gives the kept ``Identity`` a 4 MiB buffer of its own beside the ``Tile`` it reads;
    ``step_peak_bytes`` counts their one buffer once."""
    report = _report(_gated)
    names = {node.rpartition("/")[2]: nbytes for node, _, nbytes in report.live}
    assert names["gate"] == names["Tile"] == 4 * MiB
    assert report.alias_bytes == 4 * MiB and report.in_place_bytes == 0
    assert report.step_peak_bytes == report.peak_bytes_counting_buffers_once == report.peak_bytes - 4 * MiB


def _gate_then_elementwise(x):
    """A 4 MiB tensor whose one reader is a kept serialization gate, whose one reader is an
    elementwise kernel: a sharded layer's kernel gradient, gated, then divided by the ranks."""
    from lms_tf.tf.rewrite.common import mark

    t = tf.tile(x, [4])
    with tf.control_dependencies([tf.reduce_sum(x)]):
        gate = tf.identity(t, name="gate")
    mark(gate.op, "serial_gate")
    return tf.reduce_max(gate / 3.0)


def test_a_buffer_passed_on_through_a_gate_to_an_elementwise_kernel_is_counted_once():
    """Grappler lists the ``Tile``, its gate and the division, 4 MiB each, at its peak; once the
    gate has run, TensorFlow's executor has released the ``Tile``'s own reference, so the division
    writes into the one buffer (next test). Before this rule the oracle counted 8 MiB of it: VGG16's
    hybrid rank step read 0.27 of the one-GPU peak on Grappler against the simulator's 0.22."""
    report = _report(_gate_then_elementwise)
    names = {node.rpartition("/")[2]: nbytes for node, _, nbytes in report.live}
    assert names["Tile"] == names["gate"] == names["truediv"] == 4 * MiB
    assert report.alias_bytes == 4 * MiB and report.in_place_bytes == 4 * MiB
    assert report.step_peak_bytes == report.peak_bytes - 8 * MiB


def test_tensorflow_really_writes_through_the_gate_into_the_producers_buffer():
    """The real CPU allocator hands out one 4 MiB buffer for the chain above, to ``Tile``."""
    from lms_tf.tf.diagnostics import allocation_trace

    step = tf.function(_gate_then_elementwise)
    step(X)
    big = [e.op.rpartition("/")[2] for e in allocation_trace(lambda: step(X).numpy())
           if e.kind == "alloc" and e.requested_bytes >= 4 * MiB]
    assert big == ["Tile"]


def test_tensorflow_really_hands_the_identity_its_input_buffer():
    """On the real CPU allocator the kept ``Identity`` allocates nothing: the one 4 MiB buffer it
    reads is the ``Tile``'s. (The profiler does not trace an ``Identity`` kernel.) The product
    gets a buffer of its own when it runs before the ``reduce_max`` of ``Tile``; run after it, it
    is the last reader and TensorFlow writes it into that same buffer (CI saw both orders on two
    inter-op threads), so the test holds the order fixed each way and checks both."""
    from lms_tf.tf.diagnostics import allocation_trace

    def gated(x, max_first):
        from lms_tf.tf.rewrite.common import mark

        t = tf.tile(x, [4])
        if max_first:
            largest = tf.reduce_max(t)
        with tf.control_dependencies([largest] if max_first else [tf.reduce_sum(x)]):
            gate = tf.identity(t, name="gate")
        mark(gate.op, "serial_gate")
        product = gate * 2.0
        if not max_first:
            with tf.control_dependencies([product]):
                largest = tf.reduce_max(t)
        return tf.reduce_sum(product) + largest

    for max_first, expected in ((True, ["Tile"]), (False, ["Tile", "mul"])):
        step = tf.function(lambda x: gated(x, max_first))
        step(X)
        big = sorted(e.op.rpartition("/")[2] for e in allocation_trace(lambda: step(X).numpy())
                     if e.kind == "alloc" and e.requested_bytes >= 4 * MiB)
        assert big == expected, (max_first, big)


def _eight_conv_step():
    """The 8-conv toy of the Grappler measurements in docs/design.md: eight 32-channel 3x3 convolutions
    on 32 x 64x64x3, trained by SGD."""
    kernels = [tf.Variable(tf.random.stateless_normal((3, 3, 3 if i == 0 else 32, 32), seed=(i, 0)) * 0.1)
               for i in range(8)]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for kernel in kernels:
                h = tf.nn.relu(tf.nn.conv2d(h, kernel, 1, "SAME"))
            loss = tf.reduce_mean(h)
        for kernel, grad in zip(kernels, tape.gradient(loss, kernels)):
            kernel.assign_sub(0.01 * grad)
        return loss

    return step.get_concrete_function(tf.ones((32, 64, 64, 3)))


def test_grappler_swap_copies_are_judged_in_host_memory():
    """Grappler's ``_CopyFromGpuToHost`` kernel allocates its output on the host
    (``alloc_attrs.set_on_host(true)``), but the virtual scheduler counts every output on its
    node's device. The baseline judge places Grappler's swap ops on the host, so the swapped
    tensors leave the GPU until the gated swap-in brings them back. This is also how lms-tf's
    own swap-ins are judged. (Grappler's swap pass is not deterministic: which tensors it swaps
    moves from run to run, so one optimized graph is judged both ways.)

    Whether the swaps beat the plain step is not asserted: it moves with the number of swaps
    Grappler happens to make. On this toy, 25 runs judged on the host read 0.5x to 1.0x of the
    plain peak (14 to 9 swaps), and a CI run with 8 swaps read 1.10x. The planner benchmark
    reports that spread over several runs (``grappler_baselines``)."""
    from lms_tf import _compat
    from lms_tf.tf.diagnostics import _VIRTUAL_CPU, _VIRTUAL_GPU, grappler_baseline_report, with_variable_shapes

    concrete = _eight_conv_step()
    plain = virtual_gpu_peak(concrete, variable_shapes=True)
    graph_def = with_variable_shapes(concrete.graph.as_graph_def(add_shapes=True))
    for node in graph_def.node:
        node.device = _VIRTUAL_GPU
    fetches = sorted({t.op.name for t in concrete.graph.outputs} | {op.name for op in concrete.graph.control_outputs})
    devices = [(_VIRTUAL_GPU, "GPU", 16 * 2**30), (_VIRTUAL_CPU, "CPU", 256 * 2**30)]
    optimized, peaks = _compat.grappler_memory_optimized(
        graph_def, fetches, devices, "SWAPPING_HEURISTICS", optimizer_devices=[(_VIRTUAL_GPU, "GPU", plain // 4), devices[1]])
    op_types = {node.name: node.op for node in optimized.node}
    assert sum(op == "_CopyFromGpuToHost" for op in op_types.values()) >= 4
    # Left on the GPU, the swap-out copies are counted there, and the "swapped" step reads higher
    # than the plain one.
    on_gpu, live = _compat.grappler_peak_live_tensors(optimized, fetches, devices)[_VIRTUAL_GPU]
    copies_at_peak = [nbytes for node, _, nbytes in live if op_types.get(node) == "_CopyFromGpuToHost"]
    assert copies_at_peak and on_gpu > plain
    # Judged where the copies live, they leave the GPU's peak: at least one of them comes off it.
    assert peaks[_VIRTUAL_GPU] <= on_gpu - min(copies_at_peak)

    report = grappler_baseline_report(concrete, "SWAPPING_HEURISTICS", target_bytes=plain // 4, variable_shapes=True)
    assert report.swapped and report.recomputed == ()
    assert all(name.rpartition("/")[2].startswith(("Relu", "ReluGrad", "Conv2D")) for name in report.swapped)
    assert 0 < report.peak_bytes < on_gpu  # every run's copies are judged on the host


def test_grappler_recompute_clones_are_reported():
    from lms_tf.tf.diagnostics import grappler_baseline_report

    concrete = _eight_conv_step()
    plain = virtual_gpu_peak(concrete, variable_shapes=True)
    report = grappler_baseline_report(concrete, "RECOMPUTATION_HEURISTICS", target_bytes=plain // 4,
                                      variable_shapes=True)
    assert report.swapped == ()
    assert {name.rpartition("/")[2] for name in report.recomputed} >= {f"Relu_{i}" for i in range(1, 5)}


def test_a_variable_read_is_counted_by_grappler_and_reported_as_not_step_memory():
    """Grappler gives a variable's read its own buffer while its reader runs (its whole size when
    told the variable's shape; without, a guess from the unknown shape); TensorFlow's read returns
    the variable's own buffer, and the real allocator allocates nothing for it.
    ``step_peak_bytes`` leaves it out."""
    from lms_tf.tf.diagnostics import allocation_trace

    weight = tf.Variable(tf.ones((512, 2048)))  # 4 MiB

    @tf.function
    def step(x):
        return tf.reduce_sum(tf.matmul(tf.reshape(x[:512 * 8], (8, 512)), weight))

    for shapes in (False, True):
        report = virtual_gpu_peak_report(step.get_concrete_function(X), variable_shapes=shapes)
        reads = [nbytes for node, _, nbytes in report.live if node.endswith("ReadVariableOp")]
        assert len(reads) == 1 and report.variable_read_bytes == reads[0] > 0, (shapes, report.live)
        # (the slice's reshape is an alias: its buffer counts once)
        assert report.step_peak_bytes == report.peak_bytes - report.in_place_bytes - report.alias_bytes - reads[0]
        if shapes:
            assert reads == [4 * MiB]
    step(X)
    allocated = [e for e in allocation_trace(lambda: step(X).numpy()) if e.kind == "alloc" and e.requested_bytes >= MiB]
    assert allocated == [], allocated   # the real step allocates no buffer for the read
