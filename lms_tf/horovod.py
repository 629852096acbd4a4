"""The distributed core: data-parallel training over Horovod's TensorFlow ops, with no Keras in it.

Horovod's TensorFlow ops (``allreduce``, ``grouped_allreduce``, ``broadcast``) work with
TF 2.21 and Keras 3 once Horovod is built (``scripts/install_horovod.sh``); its Keras
wrappers (``DistributedOptimizer``, its callbacks) target Keras 2 and do not. This module
holds what both front-ends share, built on those ops only: bucketing the gradients in the order
the backward pass makes them, one grouped allreduce per bucket, the variables' broadcast, and the
average of logged numbers. The front-ends on top of it:

* :class:`lms_tf.keras.DistributedCallback` for ``model.fit`` (broadcast, gradient averaging
  in the traced train step, metric averaging at epoch end); it composes with
  :class:`lms_tf.LMSCallback` in either order, and the swap/recompute pass sees the allreduce ops;
* ``@lms_tf.function(horovod=True)`` for a custom training loop.

The gradient exchange is *pipelined* (KARMA): the gradients are grouped into buckets in
the order the backward pass produces them (last layer first) and each bucket gets its own
``grouped_allreduce`` op, which TensorFlow starts as soon as that bucket's gradients exist,
so communication overlaps the rest of the backward pass and its swap-ins. Horovod still
fuses the tensors of a bucket (and of buckets that become ready in the same cycle) into
one message.

Examples:
    >>> import lms_tf.horovod as lms_hvd
    >>> lms_hvd.DEFAULT_BUCKET_BYTES
    4194304
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import LMSError
from lms_tf.core.policy import DEFAULT_BUCKET_BYTES
from lms_tf.tf.optimizer_offload import current_update_placement

logger = logging.getLogger("lms_tf")

# Outside the optimizer_on_host hook (order 1): average on the device, then update on the host.
ALLREDUCE_ORDER = 0


def horovod_tensorflow():
    """Imports ``horovod.tensorflow`` and initialises Horovod once.

    Returns:
        The ``horovod.tensorflow`` module, initialised.

    Raises:
        LMSError: Horovod is not installed, or was built against another TensorFlow.

    Examples:
        >>> hvd = horovod_tensorflow()
        >>> hvd.size() >= 1
        True
    """
    try:
        import horovod.tensorflow as hvd
    except Exception as error:  # noqa: BLE001 - ImportError or a TF op library that does not load
        raise LMSError(
            f"Horovod is not usable in this Python ({type(error).__name__}: {error}). Build it against the "
            f"installed TensorFlow with: bash scripts/install_horovod.sh [python]") from error
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def pin_gpu() -> Optional[str]:
    """Makes only this rank's GPU (``hvd.local_rank()``) visible to TensorFlow, as Horovod requires.

    Call it at the top of the training script, before anything touches a GPU. On a machine
    without GPUs it does nothing.

    Returns:
        The name of the physical GPU this rank uses, or None without GPUs.

    Raises:
        LMSError: This node has fewer GPUs than ranks on it, or TensorFlow already
            initialised its GPUs.

    Examples:
        >>> pin_gpu() is None  # no GPU on the test machine
        True
    """
    hvd = horovod_tensorflow()
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    local_rank = hvd.local_rank()
    if local_rank >= len(gpus):
        raise LMSError(f"pin_gpu: rank {hvd.rank()} is local rank {local_rank} on this node, which has only "
                       f"{len(gpus)} GPU(s). Start at most {len(gpus)} ranks per node (horovodrun -H host:{len(gpus)}).")
    try:
        tf.config.set_visible_devices(gpus[local_rank], "GPU")
        tf.config.experimental.set_memory_growth(gpus[local_rank], True)
    except RuntimeError as error:
        raise LMSError(f"pin_gpu() must run before TensorFlow initialises its GPUs ({error}); call it "
                       f"at the top of the script, before building a model or creating a tensor.") from error
    return gpus[local_rank].name


def _nbytes(tensor) -> int:
    shape = tensor.shape
    if shape.rank is None or not shape.is_fully_defined():
        return DEFAULT_BUCKET_BYTES  # unknown size: give it a bucket of its own
    return int(np.prod(shape.as_list(), dtype=np.int64)) * tensor.dtype.size


def backward_order(grads: Sequence) -> List[int]:
    """Indices of ``grads`` in the order the backward pass produces them.

    In a trace, TensorFlow creates the gradient ops in backward order, so the creation
    index of each gradient's op is its production order. Eagerly (no graph), Keras'
    variable order reversed is the best guess (last layer first).

    Args:
        grads: Gradients (tensors, IndexedSlices or None).

    Returns:
        A permutation of ``range(len(grads))``; None gradients come last.

    Examples:
        >>> backward_order([tf.constant(1.0), None, tf.constant(2.0)])
        [2, 0, 1]
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    missing = [i for i, g in enumerate(grads) if g is None]
    if tf.executing_eagerly() or not present:
        return present[::-1] + missing
    graph = _compat.current_graph()
    created = {op.name: position for position, op in enumerate(graph.get_operations())}

    def produced_at(i):
        g = grads[i]
        op = (g.values if isinstance(g, tf.IndexedSlices) else g).op
        return created.get(op.name, -1)
    return sorted(present, key=produced_at) + missing


def bucket_by_bytes(order: Sequence[int], sizes: Sequence[int], bucket_bytes: Optional[int]) -> List[List[int]]:
    """Splits ``order`` into consecutive buckets of at most ``bucket_bytes`` (at least one tensor each).

    Args:
        order: Gradient indices in production order.
        sizes: Bytes of each gradient, by index.
        bucket_bytes: Bucket capacity; None puts everything in one bucket.

    Returns:
        Buckets of indices, in production order.

    Examples:
        >>> bucket_by_bytes([2, 0, 1], [4, 4, 8], bucket_bytes=8)
        [[2], [0, 1]]
    """
    if bucket_bytes is None:
        return [list(order)] if order else []
    buckets: List[List[int]] = []
    filled = math.inf
    for index in order:
        if filled + sizes[index] > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += sizes[index]
    return buckets


#: The attribute :func:`mark_sharded` sets on a variable: (shard index, number of shards).
SHARD_ATTR = "_lms_tf_shard"


def mark_sharded(variable, index: int, count: int) -> None:
    """Marks ``variable`` as shard ``index`` of ``count`` of a layer sharded across ranks
    (:mod:`lms_tf.parallel`): each rank holds a different part, so its gradient is already the
    whole batch's and is not averaged with the other ranks' (:func:`allreduce_gradients`).

    Examples:
        >>> v = tf.Variable([1.0, 2.0])
        >>> mark_sharded(v, 0, 2); is_sharded(v), is_sharded(tf.Variable(0.0))
        (True, False)
    """
    setattr(variable, SHARD_ATTR, (index, count))
    inner = getattr(variable, "_value", None)  # the TensorFlow variable under a Keras 3 one
    if inner is not None and inner is not variable:
        setattr(inner, SHARD_ATTR, (index, count))


def is_sharded(variable) -> bool:
    """Whether ``variable`` is a shard (:func:`mark_sharded`).

    Examples:
        >>> is_sharded(tf.Variable(1.0))
        False
    """
    return getattr(variable, SHARD_ATTR, None) is not None


def allreduce_gradients(grads: Sequence, *, bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES,
                        name: str = "lms_tf_allreduce", variables: Optional[Sequence] = None,
                        on: Optional[str] = None) -> List:
    """Averages gradients across Horovod ranks, one ``grouped_allreduce`` per bucket.

    Args:
        grads: Gradients of one update (tensors, ``tf.IndexedSlices`` or None).
        bucket_bytes: Bucket capacity in bytes, filled in backward order (pipelined
            exchange). None: one group for all gradients (starts after the whole backward).
        name: Prefix of the allreduce op names (identical on every rank).
        variables: The variables of ``grads``, in the same order: the gradients of sharded ones
            (:func:`mark_sharded`) are left as they are.
        on: The device to average on (the host, when the update runs there and averaging after
            the move costs less); each gradient is first copied there (``{name}_move_{i}``) as
            soon as it is complete. None: where the gradients are.

    Returns:
        The averaged gradients, in the order given (None stays None).

    Examples:
        >>> [g.numpy() for g in allreduce_gradients([tf.constant([2.0])])]  # one process: unchanged
        [array([2.], dtype=float32)]
    """
    hvd = horovod_tensorflow()
    grads = list(grads)
    averaged = list(grads)
    if variables is not None:
        # A shard's gradient stays where it is: its own rank is the only one that has it.
        grads = [None if is_sharded(v) else g for g, v in zip(grads, variables)]
    order = backward_order(grads)
    dense = [i for i in order if grads[i] is not None and not isinstance(grads[i], tf.IndexedSlices)]
    with tf.device(on) if on is not None else contextlib.nullcontext():
        if on is not None:
            # The move first, one copy a gradient as soon as it exists (each bucket's allreduce
            # then waits on the host, not the device); the update would copy them anyway.
            grads = [g if g is None or isinstance(g, tf.IndexedSlices) else tf.identity(g, name=f"{name}_move_{i}")
                     for i, g in enumerate(grads)]
        for i in order:
            if isinstance(grads[i], tf.IndexedSlices):
                # Sparse gradients (embeddings) are averaged by allgather inside hvd.allreduce.
                averaged[i] = hvd.allreduce(grads[i], op=hvd.Average, name=f"{name}_sparse_{i}")
        sizes = [_nbytes(g) if g is not None and not isinstance(g, tf.IndexedSlices) else 0 for g in grads]
        for number, bucket in enumerate(bucket_by_bytes(dense, sizes, bucket_bytes)):
            reduced = hvd.grouped_allreduce([grads[i] for i in bucket], op=hvd.Average, name=f"{name}_{number}")
            for i, tensor in zip(bucket, reduced):
                averaged[i] = tensor
    return averaged


def gradient_allreduce_hook(bucket_bytes: Optional[int], counter: Optional[List[int]] = None) -> Callable:
    """An optimizer-update hook that averages the gradients across ranks before the update.

    Args:
        bucket_bytes: See :func:`allreduce_gradients`.
        counter: A one-element list incremented per intercepted update (lets a front-end
            check that the step did update through a Keras optimizer).

    Returns:
        ``hook(optimizer, grads, variables, update)`` for ``intercept_optimizer_updates``.

    Examples:
        >>> hook = gradient_allreduce_hook(bucket_bytes=None)
    """
    def hook(optimizer, grads, variables, update):
        if counter is not None:
            counter[0] += 1
        # With the update on the host (an lms-tf front-end's placement), average before or after
        # the move, whichever the cost model says costs less.
        placement = current_update_placement()
        on = None
        if placement is not None:
            dense = [g for g in grads if g is not None and not isinstance(g, tf.IndexedSlices)]
            on = placement.averaging_device(sum(_nbytes(g) for g in dense), horovod_tensorflow().size())
        # Horovod matches tensors across ranks by op name, so the name must not depend on
        # anything rank-local (an optimizer's auto-name counts the optimizers this process
        # made). A second update in the same trace gets a graph-uniquified name, in trace order.
        return update(allreduce_gradients(grads, bucket_bytes=bucket_bytes, variables=variables, on=on), variables)
    return hook


def broadcast_variables(variables: Sequence, root_rank: int = 0) -> int:
    """Sets ``variables`` on every rank to their values on ``root_rank`` (eagerly); shards
    (:func:`mark_sharded`) are left alone.

    Args:
        variables: Keras or TF variables, identical in order and shape on every rank.
        root_rank: The rank whose values win.

    Returns:
        The number of variables broadcast.

    Examples:
        >>> broadcast_variables([tf.Variable(1.0)])
        1
    """
    hvd = horovod_tensorflow()
    # A shard differs from rank to rank by design: the root's must not overwrite it.
    variables = [v for v in variables if not is_sharded(v)]

    # One traced function that closes over the variables (Horovod's own broadcast_variables
    # passes them as arguments, which turns Keras 3 variables into tensors that cannot be
    # assigned); the broadcasts run concurrently and Horovod fuses them.
    @tf.function(autograph=False)
    def broadcast_all():
        for index, variable in enumerate(variables):
            variable.assign(hvd.broadcast(tf.convert_to_tensor(variable), root_rank,
                                          name=f"lms_tf_broadcast_{index}"))

    if variables:
        broadcast_all()
    return len(variables)


def _is_scalar_number(value) -> bool:
    if isinstance(value, (bool, str, bytes)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return np.ndim(value) == 0


def average_logs(logs: Dict[str, object], name: str = "lms_tf_metrics") -> Dict[str, object]:
    """Averages the numeric entries of Keras ``logs`` across ranks (one allreduce for all).

    Args:
        logs: A Keras logs dict (same keys on every rank).
        name: Name of the allreduce (identical on every rank).

    Returns:
        A new dict: numeric entries averaged, the rest unchanged.

    Examples:
        >>> average_logs({"loss": 2.0, "note": "x"})
        {'loss': 2.0, 'note': 'x'}
    """
    hvd = horovod_tensorflow()
    keys = sorted(k for k, v in logs.items() if _is_scalar_number(v))
    result = dict(logs)
    if keys:
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        mean = hvd.allreduce(values, op=hvd.Average, name=name).numpy()
        result.update({k: float(m) for k, m in zip(keys, mean)})
    return result
