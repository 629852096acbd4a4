"""The slice step: a backward op run a slice of the batch at a time (:class:`~lms_tf.core.plan.SlicedOp`).

For a sliced op ``g`` with ``k`` slices, an input ``x`` it copies from the host a slice at a time
(``x`` is swapped: the swap step made its host copy) and an input ``d`` read on the device::

    swap_out(x) (host) -> Identity (host, gated) -> Slice i (host) -> read (Identity, device) -\\
    d (device) -> Slice i (device: a view of d's buffer) --------------------> clone of g on slice i
    clone 0, ..., clone k-1 -> ConcatV2 (axis 0, device) -> g's consumers
    gate of slice i: trigger (i < 2) or clone i-2 -> Shape -> Identity (host) -^ (control edge, host -> host)

A ``Slice`` along the first dimension shares its input's buffer where the slice is aligned (the
batch of an NHWC tensor is), so the host slice copies nothing until the device reads it, and
the device's slice of ``d`` is a view. The original op is left with no readers: TensorFlow prunes
it from the function before it runs. The clones are named ``<g>-lms_slice_<i>`` and carry
``_lms="slice"``, with the op they slice and their index in ``_lms_slice_of``/``_lms_slice``;
the concatenation is ``<g>-lms_slice_concat`` (``_lms="slice_concat"``), which the simulator
calls ``g``.

Examples:
    >>> from lms_tf.tf.rewrite.slices import insert_slices
"""

from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import RewriteError
from lms_tf.core.op_kinds import BATCH_SLICED_INPUTS
from lms_tf.core.plan import Plan, SlicedOp
from lms_tf.tf.rewrite.common import mark, sorting_as
from lms_tf.tf.rewrite.swap import device_read, gated_swap_in

SLICE_OF_ATTR = "_lms_slice_of"
SLICE_INDEX_ATTR = "_lms_slice"


def insert_slices(graph: tf.Graph, plan: Plan, swap_outs: Dict[str, tf.Tensor], inserted: Dict[str, int]) -> int:
    """Runs each of the plan's sliced ops a slice of the batch at a time and re-points its readers
    to the concatenation of the slices.

    Must run inside ``graph.as_default()`` under the lms-tf name scope, after every other step: each
    clone waits for what the op waits for (its control inputs, an ordering's barrier among them), and
    whatever reads the op or waits for it (a consumer, a gate it triggers) reads or waits for the
    concatenation instead, so nothing keeps the original op in the function.

    Args:
        graph: The graph being rewritten.
        plan: The plan.
        swap_outs: Swapped tensor name -> its swap-out (host) tensor (from the swap step).
        inserted: Counter of inserted ops by ``_lms`` kind, updated in place.

    Returns:
        The number of inputs re-pointed to a concatenation.

    Raises:
        RewriteError: A sliced op's batch is not known in the graph, or an input it copies from the
            host a slice at a time has no swap-out.

    Examples:
        >>> import collections
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.reshape(tf.range(32.0), (2, 4, 4, 1), name="x")
        ...     y = tf.nn.max_pool2d(x, 2, 2, "VALID", name="pool")
        ...     dx = tf.raw_ops.MaxPoolGrad(orig_input=x, orig_output=y, grad=tf.ones_like(y), ksize=[1, 2, 2, 1],
        ...                                 strides=[1, 2, 2, 1], padding="VALID", name="pool_grad")
        ...     out = tf.identity(dx, name="out")
        ...     rerouted = insert_slices(g, Plan((), "/device:CPU:0", "/device:CPU:1", {}, {},
        ...                                      sliced=(SlicedOp("pool_grad", 2, (), "pool"),)), {},
        ...                              collections.Counter())
        >>> rerouted, out.op.inputs[0].op.type, [t.op.name for t in out.op.inputs[0].op.inputs[:2]]
        (1, 'ConcatV2', ['pool_grad-lms_slice_0', 'pool_grad-lms_slice_1'])
    """
    rerouted = 0
    for sliced in plan.sliced:
        original = graph.get_operation_by_name(sliced.op)
        batch = original.outputs[0].shape[0] if original.outputs[0].shape.rank else None
        if batch is None:
            raise RewriteError(f"sliced op {sliced.op!r} has no static batch in the graph (its output's shape is "
                               f"{original.outputs[0].shape}); trace the step with a fixed batch size to slice it.")
        missing = [t for t in sliced.from_host if t not in swap_outs]
        if missing:
            raise RewriteError(f"sliced op {sliced.op!r} copies {missing} from the host a slice at a time, but the "
                               f"plan does not swap them out; swap them, or read them whole on the device.")
        clones = _slices(graph, plan, sliced, original, sliced.bounds(int(batch)), swap_outs, inserted)
        rerouted += _concatenate(graph, original, clones, inserted)
    return rerouted


def _slices(graph: tf.Graph, plan: Plan, sliced: SlicedOp, original: tf.Operation, bounds, swap_outs,
            inserted: Dict[str, int]) -> List[tf.Operation]:
    """The op's clones, one per slice, each reading its part of the batch-sized inputs."""
    trigger = graph.get_operation_by_name(sliced.trigger)
    batch_inputs = set(BATCH_SLICED_INPUTS[original.type])
    clones: List[tf.Operation] = []
    for i, (start, size) in enumerate(bounds):
        inputs = []
        for j, tensor in enumerate(original.inputs):
            if j not in batch_inputs:
                inputs.append(tensor)
                continue
            begin = [start] + [0] * (tensor.shape.rank - 1)
            extent = [size] + [-1] * (tensor.shape.rank - 1)
            if tensor.name in sliced.from_host:
                gate = trigger if i < 2 else clones[i - 2]
                host = _gated_host_slice(graph, swap_outs[tensor.name], gate, plan.host, begin, extent,
                                         f"slice_in_{sliced.op.replace('/', '_')}_{j}_{i}")
                inserted["swap_gate"] += 2
                inserted["slice_in"] += 1
                inserted["slice_part"] += 1
                inputs.append(device_read(graph, host, original.device, tensor.op.name))
                inserted["device_read"] += 1
            else:  # a view of the device tensor's buffer
                with graph.colocate_with(None, ignore_existing=True), graph.device(original.device), \
                        graph.name_scope(None):
                    view = tf.slice(tensor, begin, extent, name=sorting_as(tensor.op.name, f"slice_view_{i}"))
                mark(view.op, "slice_view")
                inserted["slice_view"] += 1
                inputs.append(view)
        with graph.name_scope(None):
            clone = _compat.clone_op(graph, original, inputs, name=sorting_as(original.name, f"slice_{i}"))
        for control in original.control_inputs:
            _compat.add_control_input(clone, control)
        mark(clone, "slice")
        _compat.set_string_attr(clone, SLICE_OF_ATTR, original.name)
        _compat.set_int_attr(clone, SLICE_INDEX_ATTR, i)
        inserted["slice"] += 1
        clones.append(clone)
    return clones


def _gated_host_slice(graph: tf.Graph, source: tf.Tensor, gate: tf.Operation, host: str, begin, extent,
                      name: str) -> tf.Tensor:
    """A host ``Slice`` of the host tensor ``source`` that cannot run before ``gate``: the gated
    swap-in of one slice (:func:`~lms_tf.tf.rewrite.swap.gated_swap_in` gates an Identity the
    same way; here the slice is the op behind the gate)."""
    whole = gated_swap_in(graph, source, gate, host, f"{name}_whole", kind="slice_in")
    with graph.colocate_with(None, ignore_existing=True), graph.device(host):
        part = tf.slice(whole, begin, extent, name=name)
    mark(part.op, "slice_part")
    return part


def _concatenate(graph: tf.Graph, original: tf.Operation, clones: List[tf.Operation],
                 inserted: Dict[str, int]) -> int:
    """Puts the clones' outputs together along the batch and re-points the original's readers
    (data and control) to that; returns how many inputs were re-pointed."""
    rerouted = 0
    for k, output in enumerate(original.outputs):
        with graph.colocate_with(None, ignore_existing=True), graph.device(original.device), graph.name_scope(None):
            joined = tf.concat([clone.outputs[k] for clone in clones], axis=0,
                               name=sorting_as(original.name, "slice_concat" if k == 0 else f"slice_concat_{k}"))
        mark(joined.op, "slice_concat")
        _compat.set_string_attr(joined.op, SLICE_OF_ATTR, original.name)
        inserted["slice_concat"] += 1
        for consumer in list(output.consumers()):
            if consumer is joined.op:
                continue
            for index, tensor in enumerate(list(consumer.inputs)):
                if tensor is output:
                    _compat.update_input(consumer, index, joined)
                    rerouted += 1
        for follower in _compat.control_outputs(original):
            _compat.remove_control_input(follower, original)
            _compat.add_control_input(follower, joined.op)
    return rerouted
