"""Layers whose weights are split across the ranks of a Horovod group (SplitBrain).

Each of the G ranks keeps 1/G of the layer's kernel, bias, gradients and optimizer slots. The
rest of the model stays data-parallel: every rank trains on its own batch, and the replicated
layers' gradients are averaged (``DistributedCallback``, ``lms_tf.function(horovod=True)``), which
leave the shards' gradients alone (:func:`lms_tf.horovod.mark_sharded`).

:class:`ShardedDense` is column-sharded: rank r holds output columns ``[r * U/G, (r + 1) * U/G)``.

- Forward: the ranks' batches are gathered (``allgather``), each rank computes its columns for the
  whole group's batch, and an ``alltoall`` gives each rank its own rows with every column.
- Backward: an ``alltoall`` sends each rank the output gradients of its columns for every batch.
  The kernel gradient is then the whole group's (divided by G, as the replicated layers' average
  divides). The input gradient is a partial sum per rank, and a ``reducescatter`` adds them up and
  gives each rank its own rows.

Examples:
    >>> import keras
    >>> layer = ShardedDense(8, shard_index=0, shard_count=1)   # one rank: an ordinary Dense layer
    >>> layer(keras.ops.ones((2, 4))).shape
    TensorShape([2, 8])
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError
from lms_tf.horovod import horovod_tensorflow, mark_sharded

keras = _compat.keras_module()


def _group():
    hvd = horovod_tensorflow()
    return hvd, hvd.rank(), hvd.size()


def column_shard(units: int, index: int, count: int, layer: str = "layer") -> slice:
    """The output columns shard ``index`` of ``count`` holds.

    Raises:
        LMSOptionError: ``count`` does not divide ``units``.

    Examples:
        >>> column_shard(8, 1, 4)
        slice(2, 4, None)
    """
    if units % count:
        raise LMSOptionError(
            f"{layer}: {units} output units do not split evenly across a group of {count} ranks; received "
            f"group_size={count}. Use a group size that divides {units} (e.g. "
            f"{max(d for d in range(1, count + 1) if units % d == 0)}), or leave this layer replicated.")
    width = units // count
    return slice(index * width, (index + 1) * width)


class ShardedDense(keras.layers.Layer):
    """A ``Dense`` layer whose kernel and bias columns are split across the ranks of a Horovod job.

    Args:
        units: Output units of the whole layer (divisible by the number of ranks).
        activation: As ``keras.layers.Dense``.
        use_bias: As ``keras.layers.Dense``.
        kernel_initializer: Initialises the whole kernel (the same on every rank, from its seed);
            each rank keeps its columns.
        bias_initializer: As ``keras.layers.Dense``.
        shard_index: This rank's shard (default: the Horovod rank).
        shard_count: Number of shards (default: the Horovod size).
        planning: Stand in for the collectives with local ops of the same shapes
            (:class:`StandInCollectives`): one process traces a rank's step to plan it
            (``lms-tf plan --hybrid G``). Such a layer cannot train.

    Examples:
        >>> layer = ShardedDense(6, activation="relu", shard_index=0, shard_count=1)
        >>> layer.build((None, 3)); [tuple(w.shape) for w in layer.weights]
        [(3, 6), (6,)]
    """

    def __init__(self, units: int, activation=None, use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", shard_index: Optional[int] = None, shard_count: Optional[int] = None,
                 planning: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.planning = bool(planning)
        if shard_index is None or shard_count is None:
            _, rank, size = _group()
            shard_index = rank if shard_index is None else shard_index
            shard_count = size if shard_count is None else shard_count
        self.units = int(units)
        self.shard_index, self.shard_count = int(shard_index), int(shard_count)
        self.columns = column_shard(self.units, self.shard_index, self.shard_count, layer=self.name)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        features = int(input_shape[-1])
        width = self.columns.stop - self.columns.start
        whole = self.kernel_initializer((features, self.units))  # every rank draws the same kernel
        self.kernel = self.add_weight(name="kernel", shape=(features, width),
                                      initializer=lambda shape, dtype=None: whole[:, self.columns])
        mark_sharded(self.kernel, self.shard_index, self.shard_count)
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(width,), initializer=self.bias_initializer)
            mark_sharded(self.bias, self.shard_index, self.shard_count)

    def set_whole_weights(self, kernel, bias=None) -> None:
        """Sets this rank's shard from the whole layer's weights (those of a ``Dense`` layer).

        Examples:
            >>> import numpy as np
            >>> layer = ShardedDense(4, shard_index=1, shard_count=2); layer.build((None, 2))
            >>> layer.set_whole_weights(np.arange(8.0).reshape(2, 4), np.arange(4.0))
            >>> layer.kernel.numpy().tolist(), layer.bias.numpy().tolist()
            ([[2.0, 3.0], [6.0, 7.0]], [2.0, 3.0])
        """
        self.kernel.assign(kernel[:, self.columns])
        if self.bias is not None and bias is not None:
            self.bias.assign(bias[self.columns])

    def call(self, inputs):
        # Rows are every position of every example (a sequence model's tokens too): the collectives
        # split and join along them.
        shape = tf.shape(inputs)
        rows = tf.reshape(inputs, (-1, inputs.shape[-1]))
        outputs = _column_sharded_dense(rows, self.kernel, self.bias, self.shard_count, self.name, self.planning)
        outputs = tf.reshape(outputs, tf.concat([shape[:-1], [self.units]], axis=0))
        return self.activation(outputs) if self.activation is not None else outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        config = super().get_config()
        config.update(units=self.units, activation=keras.activations.serialize(self.activation),
                      use_bias=self.use_bias, shard_index=self.shard_index, shard_count=self.shard_count,
                      planning=self.planning,
                      kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                      bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return config


class StandInCollectives:
    """Ops of the same shapes as the collectives one rank of a group of ``count`` runs, computed in
    one process: what planning a rank's step needs (the simulator sizes tensors; it does not need
    the other ranks' values). Never used to train: the numbers are not a rank's.

    Examples:
        >>> ops = StandInCollectives(4)
        >>> ops.allgather(tf.ones((2, 3)), name="x").shape, ops.reducescatter(tf.ones((8, 3)), name="dx").shape
        (TensorShape([8, 3]), TensorShape([2, 3]))
    """

    Sum = "sum"

    def __init__(self, count: int):
        self.count = count

    def allgather(self, tensor, name=None):
        """``count`` copies of ``tensor`` along its first axis: the gathered shape.

        Examples:
            >>> StandInCollectives(2).allgather(tf.ones((1, 3))).shape
            TensorShape([2, 3])
        """
        return tf.tile(tensor, [self.count] + [1] * (len(tensor.shape) - 1), name=name)

    def alltoall(self, tensor, name=None):
        """``tensor`` itself: an even ``alltoall`` keeps the shape.

        Examples:
            >>> StandInCollectives(2).alltoall(tf.ones((4, 3))).shape
            TensorShape([4, 3])
        """
        return tf.identity(tensor, name=name)

    def reducescatter(self, tensor, op=None, name=None):
        """The first 1/``count`` of ``tensor``'s rows: one rank's share of the reduced tensor.

        Examples:
            >>> StandInCollectives(2).reducescatter(tf.ones((4, 3))).shape
            TensorShape([2, 3])
        """
        rows = tf.shape(tensor)[0] // self.count
        return tf.identity(tensor[:rows], name=name)


def _column_sharded_dense(inputs, kernel, bias, count: int, name: str, planning: bool = False):
    """``inputs @ whole_kernel + whole_bias`` for this rank's rows, from this rank's columns."""
    kernel = tf.convert_to_tensor(kernel)
    bias = None if bias is None else tf.convert_to_tensor(bias)
    if count == 1:
        outputs = tf.matmul(inputs, kernel)
        return outputs if bias is None else tf.nn.bias_add(outputs, bias)
    hvd = StandInCollectives(count) if planning else horovod_tensorflow()
    # Horovod matches collectives across ranks by name: the layer's name is the same everywhere.
    tag = f"lms_tf_sharded_{name}"

    @tf.custom_gradient
    def sharded(x, w, *b):
        batch = tf.shape(x)[0]
        gathered = hvd.allgather(x, name=f"{tag}_x")                    # (G*batch, features)
        mine = tf.matmul(gathered, w)                                   # (G*batch, units/G)
        if b:
            mine = tf.nn.bias_add(mine, b[0])
        width = tf.shape(mine)[1]
        received = hvd.alltoall(mine, name=f"{tag}_y")                 # block r: rank r's columns, my rows
        outputs = tf.reshape(tf.transpose(tf.reshape(received, (count, batch, width)), (1, 0, 2)),
                             (batch, count * width))

        def grad(upstream):
            blocks = tf.reshape(tf.transpose(tf.reshape(upstream, (batch, count, width)), (1, 0, 2)),
                                (count * batch, width))
            mine_grad = hvd.alltoall(blocks, name=f"{tag}_dy")         # my columns, every rank's rows
            # The whole group's batch: divided by G like the replicated layers' averaged gradients.
            w_grad = tf.matmul(gathered, mine_grad, transpose_a=True) / count
            x_partial = tf.matmul(mine_grad, w, transpose_b=True)
            x_grad = hvd.reducescatter(x_partial, op=hvd.Sum, name=f"{tag}_dx")
            grads = [x_grad, w_grad]
            if b:
                grads.append(tf.reduce_sum(mine_grad, axis=0) / count)
            return grads

        return outputs, grad

    return sharded(inputs, kernel, *([] if bias is None else [bias]))
