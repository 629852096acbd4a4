"""Grappler's live set at its peak (``virtual_gpu_peak_report``) and the in-place pairs it counts twice."""

import tensorflow as tf

from lms_tf.diagnostics import virtual_gpu_peak, virtual_gpu_peak_report

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


def test_an_input_read_again_later_is_not_overwritten():
    report = _report(lambda x: (lambda t: tf.reduce_sum(t / 3.0) + tf.reduce_max(t))(tf.tile(x, [4])))
    assert {nbytes for _, _, nbytes in report.live} >= {4 * MiB}
    assert report.in_place_bytes == 0  # Tile's output has a second reader, so truediv gets its own buffer


def test_tensorflow_really_computes_that_output_in_the_input_buffer():
    """The real CPU allocator (BFC, set by the conftest) hands out one 4 MiB buffer, to Tile:
    truediv (a Mul by 1/3 after Grappler's rewrites) runs and writes into it. Grappler's
    virtual cluster, above, counts two."""
    from lms_tf.diagnostics import allocation_trace, executed_ops

    step = tf.function(lambda x: tf.reduce_sum(tf.tile(x, [4]) / 3.0))
    step(X)
    big = [e.op.rpartition("/")[2] for e in allocation_trace(lambda: step(X).numpy())
           if e.kind == "alloc" and e.requested_bytes >= 4 * MiB]
    assert big == ["Tile"]
    assert "truediv" in [e.node for e in executed_ops(lambda: step(X).numpy())]
