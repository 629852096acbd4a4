"""Layers whose weights are split across the ranks of a Horovod group (SplitBrain).

Each of the G ranks keeps 1/G of the layer's weights, their gradients and optimizer slots. The
rest of the model stays data-parallel: every rank trains on its own batch, and the replicated
layers' gradients are averaged (``DistributedCallback``, ``lms_tf.function(horovod=True)``), which
leave the shards' gradients alone (:func:`lms_tf.horovod.mark_sharded`).

Three ways to split, each with the collectives that move the least data for it
(:func:`sent_bytes_per_row` counts them):

- :class:`ShardedDense` ``sharding="columns"``: rank r holds output columns
  ``[r * U/G, (r + 1) * U/G)`` and their bias. Forward: the ranks' batches are gathered
  (``allgather``), each rank computes its columns for the whole group's batch, and an
  ``alltoall`` gives each rank its own rows with every column. Backward: an ``alltoall`` sends
  each rank the output gradients of its columns for every batch; the input gradient is a partial
  sum per rank, and a ``reducescatter`` adds them up and gives each rank its own rows.
- :class:`ShardedDense` ``sharding="rows"``: rank r holds input features
  ``[r * F/G, (r + 1) * F/G)`` (the bias stays whole, replicated). Forward: an ``alltoall`` gives
  each rank its features of every rank's rows, each rank multiplies them by its rows of the kernel,
  and a ``reducescatter`` adds the partial products and gives each rank its rows. Backward: an
  ``allgather`` of the output gradients, and an ``alltoall`` that returns each rank's input
  gradient. Cheaper than columns when the layer has more inputs than outputs.
- :class:`ShardedEmbedding` ``sharding="columns"``: rank r holds columns
  ``[r * U/G, (r + 1) * U/G)`` of every vector. Forward: the ids are gathered, each rank looks up
  its columns of all of them, and an ``alltoall`` gives each rank its ids' whole vectors.
  Backward: an ``alltoall`` sends each rank its columns of every output gradient (a sparse
  gradient of the gathered ids, as ``keras.layers.Embedding``'s). The cheaper split.
- :class:`ShardedEmbedding` ``sharding="rows"``: rank r holds the token ids
  ``[r * V/G, (r + 1) * V/G)``, for a group that does not divide the vectors. Forward: the ids are
  gathered, each rank looks up those it holds (zeros elsewhere), and a ``reducescatter`` adds them
  up (one term is not zero) and gives each rank its rows. Backward: an ``allgather`` of the output
  gradients; each rank keeps those of its ids.

Every kernel gradient covers the whole group's batch, whose rows each carry their own rank's
``1 / local batch``: it is divided by G, as averaging divides the replicated layers' gradients.
Every rank must feed the same batch size (``drop_remainder=True``): block r of a gathered tensor is
rank r's rows.

Examples:
    >>> import keras
    >>> layer = ShardedDense(8, shard_index=0, shard_count=1)   # one rank: an ordinary Dense layer
    >>> layer(keras.ops.ones((2, 4))).shape
    TensorShape([2, 8])
"""

from __future__ import annotations

import weakref
from typing import Optional

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError
from lms_tf.horovod import horovod_tensorflow, is_sharded, mark_sharded

keras = _compat.keras_module()

#: How a :class:`ShardedDense` splits its kernel: by output columns or by input rows.
SHARDINGS = ("columns", "rows")


def _group():
    hvd = horovod_tensorflow()
    return hvd, hvd.rank(), hvd.size()


def even_shard(size: int, index: int, count: int, what: str = "output units", layer: str = "layer") -> slice:
    """The part ``[index * size/count, (index + 1) * size/count)`` that shard ``index`` of ``count`` holds.

    Args:
        size: The length of the split axis (a Dense layer's units or input features, an
            Embedding's vocabulary).
        index: The shard.
        count: The number of shards (ranks).
        what: What ``size`` counts, for the error.
        layer: The layer's name, for the error.

    Raises:
        LMSOptionError: ``count`` does not divide ``size``.

    Examples:
        >>> even_shard(8, 1, 4)
        slice(2, 4, None)
    """
    if size % count:
        raise LMSOptionError(
            f"{layer}: {size} {what} do not split evenly across a group of {count} ranks; received "
            f"group_size={count}. Use a group size that divides {size} (e.g. "
            f"{max(d for d in range(1, count + 1) if size % d == 0)}), or leave this layer replicated.")
    width = size // count
    return slice(index * width, (index + 1) * width)


def sent_bytes_per_row(kind: str, features: int, units: int, count: int, itemsize: int = 4) -> int:
    """Bytes one rank sends per row of its batch, forward and backward, for one sharded layer.

    Each collective sends the other ``count - 1`` ranks their blocks: an ``allgather`` this rank's
    rows, an ``alltoall`` or ``reducescatter`` the other ranks' rows of what this rank computed.

    Args:
        kind: ``"columns"`` or ``"rows"`` (a :class:`ShardedDense`), ``"embedding_rows"`` or
            ``"embedding_columns"`` (a :class:`ShardedEmbedding`).
        features: The layer's input features (an Embedding: 1, the token id).
        units: Its outputs (an Embedding: the output dimension).
        count: The ranks it is split across.
        itemsize: Bytes per element of the activations.

    Examples:
        >>> sent_bytes_per_row("columns", 4096, 4096, 4), sent_bytes_per_row("rows", 25088, 4096, 4)
        (122880, 248832)
    """
    others = count - 1
    if kind == "columns":   # allgather x, alltoall y, alltoall dy, reducescatter dx
        return others * itemsize * (2 * features + 2 * units // count)
    if kind == "rows":      # alltoall x, reducescatter y, allgather dy, alltoall dx
        return others * itemsize * (2 * features // count + 2 * units)
    if kind == "embedding_rows":     # allgather ids (int32), reducescatter y, allgather dy
        return others * (4 + 2 * itemsize * units)
    if kind == "embedding_columns":  # allgather ids (int32), alltoall y, alltoall dy
        return others * (4 + 2 * itemsize * units // count)
    raise ValueError(f"kind must be 'columns', 'rows', 'embedding_rows' or 'embedding_columns'; received {kind!r}")


def cheaper_sharding(features: int, units: int, count: int) -> Optional[str]:
    """The sharding of a ``features`` x ``units`` kernel across ``count`` ranks that sends the
    fewest bytes and splits evenly, or None when neither splits evenly.

    Columns send ``2 F + 2 U / G`` per row and rows ``2 F / G + 2 U``: rows win when the layer has
    more inputs than outputs.

    Examples:
        >>> cheaper_sharding(512, 4096, 4), cheaper_sharding(25088, 4096, 4), cheaper_sharding(6, 10, 4)
        ('columns', 'rows', None)
    """
    fits = [kind for kind, size in (("columns", units), ("rows", features)) if size % count == 0]
    if not fits:
        return None
    # (With one rank neither sends anything: the same rule, by shape, keeps the choice stable.)
    return min(fits, key=lambda kind: (sent_bytes_per_row(kind, features, units, count),
                                       (kind == "rows") != (features > units)))


def cheaper_embedding_sharding(input_dim: int, output_dim: int, count: int) -> Optional[str]:
    """How to split an ``input_dim`` x ``output_dim`` embedding table across ``count`` ranks:
    ``"columns"`` (each rank a slice of every vector) when ``count`` divides the output
    dimension, else ``"rows"`` (each rank a range of token ids) when it divides the vocabulary,
    else None.

    Columns send ``2 U / G`` values per looked-up id, rows ``2 U`` (each rank's partial lookups
    are summed): columns always send less.

    Examples:
        >>> cheaper_embedding_sharding(50000, 512, 4), cheaper_embedding_sharding(1000, 6, 4)
        ('columns', 'rows')
    """
    if output_dim % count == 0:
        return "columns"
    return "rows" if input_dim % count == 0 else None


def _gather(part, axis: int, name: str, count: int):
    """The whole of a weight split along ``axis`` across ``count`` ranks (an ``allgather``)."""
    if count == 1:
        return part
    hvd = horovod_tensorflow()
    # Horovod gathers along the first axis, in rank order: a column shard is gathered transposed.
    if axis == 1:
        return hvd.allgather(part.T, name=name, ignore_name_scope=True).numpy().T
    return hvd.allgather(part, name=name, ignore_name_scope=True).numpy()


class _ShardedLayer(keras.layers.Layer):
    """What the sharded layers share: the shard, the group, planning mode, serialisation."""

    def __init__(self, shard_index: Optional[int] = None, shard_count: Optional[int] = None,
                 planning: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.planning = bool(planning)
        if shard_index is None or shard_count is None:
            _, rank, size = _group()
            shard_index = rank if shard_index is None else shard_index
            shard_count = size if shard_count is None else shard_count
        self.shard_index, self.shard_count = int(shard_index), int(shard_count)
        self._calls_per_graph = weakref.WeakKeyDictionary()

    def _collectives(self):
        """The collectives of this call and the prefix of their names.

        Horovod matches a collective across ranks by its name, so the name must not depend on
        anything a rank counts for itself: not the model's auto-name (``functional_3`` on a rank
        that built one model more), so no name scope (``ignore_name_scope``). The layer's name is
        the same on every rank; a second call of the layer in one trace (a shared layer) adds
        its call number there, in trace order, as every rank traces it.
        """
        graph = tf.compat.v1.get_default_graph()
        calls = self._calls_per_graph.get(graph, 0)
        self._calls_per_graph[graph] = calls + 1
        tag = f"lms_tf_sharded_{self.name}" + (f"_call{calls}" if calls else "")
        return (StandInCollectives(self.shard_count) if self.planning else _NamedCollectives()), tag

    def _shard_weight(self, name: str, whole_shape, part: slice, axis: int, initializer):
        """Adds this rank's part of a weight; every rank draws the same whole weight (one seed)."""
        # Drawn eagerly: a layer built inside a trace (a subclassed model's first call, which
        # Keras traces to infer shapes) would otherwise hand the variable a symbolic tensor.
        with tf.init_scope():
            whole = initializer(tuple(whole_shape))
        index = [slice(None)] * len(whole_shape)
        index[axis] = part
        shape = list(whole_shape)
        shape[axis] = part.stop - part.start
        variable = self.add_weight(name=name, shape=tuple(shape),
                                   initializer=lambda shape, dtype=None: whole[tuple(index)])
        mark_sharded(variable, self.shard_index, self.shard_count)
        return variable

    def _mark_realized_shards(self) -> None:
        """Marks the TensorFlow variables under this layer's shards, again.

        A layer built inside a stateless scope (a subclassed model built by a symbolic call)
        gets its TensorFlow variables only when that scope ends, after :meth:`_shard_weight`
        marked the Keras variables: the trace's own variables, which the broadcasts read, would
        not be marked, and the root rank's shard would overwrite the others'. Every call marks
        them (cheap), so every trace sees them marked.
        """
        for variable in self.weights:
            if is_sharded(variable):
                mark_sharded(variable, self.shard_index, self.shard_count)

    def get_config(self):
        config = super().get_config()
        config.update(shard_index=self.shard_index, shard_count=self.shard_count, planning=self.planning)
        return config


@keras.saving.register_keras_serializable(package="lms_tf")
class ShardedDense(_ShardedLayer):
    """A ``Dense`` layer whose kernel is split across the ranks of a Horovod job, by output columns
    or by input rows (see the module's docstring for the collectives of each).

    Args:
        units: Output units of the whole layer.
        activation: As ``keras.layers.Dense``.
        use_bias: As ``keras.layers.Dense``.
        kernel_initializer: Initialises the whole kernel (the same on every rank, from its seed);
            each rank keeps its part.
        bias_initializer: As ``keras.layers.Dense``.
        sharding: ``"columns"`` (split the units; the group must divide them), ``"rows"`` (split the
            input features; the group must divide them) or ``"auto"``
            (:func:`cheaper_sharding`: rows when there are more inputs than outputs).
        shard_index: This rank's shard (default: the Horovod rank).
        shard_count: Number of shards (default: the Horovod size).
        planning: Stand in for the collectives with local ops of the same shapes
            (:class:`StandInCollectives`): one process traces a rank's step to plan it
            (``lms-tf plan --hybrid G``). Such a layer cannot train.

    Examples:
        >>> layer = ShardedDense(6, activation="relu", shard_index=0, shard_count=1)
        >>> layer.build((None, 3)); [tuple(w.shape) for w in layer.weights]
        [(3, 6), (6,)]
        >>> rows = ShardedDense(6, sharding="rows", shard_index=1, shard_count=3); rows.build((None, 9))
        >>> [tuple(w.shape) for w in rows.weights]
        [(3, 6), (6,)]
    """

    def __init__(self, units: int, activation=None, use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", sharding: str = "columns", shard_index: Optional[int] = None,
                 shard_count: Optional[int] = None, planning: bool = False, **kwargs):
        super().__init__(shard_index=shard_index, shard_count=shard_count, planning=planning, **kwargs)
        if sharding not in SHARDINGS + ("auto",):
            raise LMSOptionError(f"{self.name}: sharding must be 'columns', 'rows' or 'auto'; received {sharding!r}.")
        self.units = int(units)
        self.sharding = sharding
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        if sharding == "columns":
            self.part = even_shard(self.units, self.shard_index, self.shard_count, layer=self.name)

    def build(self, input_shape):
        features = int(input_shape[-1])
        if self.sharding == "auto":
            self.sharding = cheaper_sharding(features, self.units, self.shard_count) or "columns"
        if self.sharding == "columns":
            self.part = even_shard(self.units, self.shard_index, self.shard_count, layer=self.name)
            self.kernel = self._shard_weight("kernel", (features, self.units), self.part, 1, self.kernel_initializer)
        else:
            self.part = even_shard(features, self.shard_index, self.shard_count, what="input features",
                                   layer=self.name)
            self.kernel = self._shard_weight("kernel", (features, self.units), self.part, 0, self.kernel_initializer)
        self.bias = None
        if self.use_bias:
            if self.sharding == "columns":
                self.bias = self._shard_weight("bias", (self.units,), self.part, 0, self.bias_initializer)
            else:  # added after the partial products are summed: whole on every rank, averaged
                self.bias = self.add_weight(name="bias", shape=(self.units,), initializer=self.bias_initializer)

    def gather_whole_weights(self) -> list:
        """The whole layer's weights (``[kernel, bias]``, as a ``Dense`` layer's), gathered from
        every rank of the group: a collective, every rank calls it.

        Examples:
            >>> layer = ShardedDense(4, shard_index=0, shard_count=1); layer.build((None, 2))
            >>> [w.shape for w in layer.gather_whole_weights()]
            [(2, 4), (4,)]
        """
        columns = self.sharding == "columns"
        tag = f"lms_tf_unshard_{self.name}"
        whole = [_gather(self.kernel.numpy(), 1 if columns else 0, f"{tag}_kernel", self.shard_count)]
        if self.bias is not None:  # a row-sharded layer's bias is whole on every rank
            whole.append(_gather(self.bias.numpy(), 0, f"{tag}_bias", self.shard_count) if columns
                         else self.bias.numpy())
        return whole

    def set_whole_weights(self, kernel, bias=None) -> None:
        """Sets this rank's shard from the whole layer's weights (those of a ``Dense`` layer).

        Examples:
            >>> import numpy as np
            >>> layer = ShardedDense(4, shard_index=1, shard_count=2); layer.build((None, 2))
            >>> layer.set_whole_weights(np.arange(8.0).reshape(2, 4), np.arange(4.0))
            >>> layer.kernel.numpy().tolist(), layer.bias.numpy().tolist()
            ([[2.0, 3.0], [6.0, 7.0]], [2.0, 3.0])
        """
        columns = self.sharding == "columns"
        self.kernel.assign(kernel[:, self.part] if columns else kernel[self.part])
        if self.bias is not None and bias is not None:
            self.bias.assign(bias[self.part] if columns else bias)

    def call(self, inputs):
        self._mark_realized_shards()
        # Rows are every position of every example (a sequence model's tokens too): the collectives
        # split and join along them.
        shape = tf.shape(inputs)
        rows = tf.reshape(inputs, (-1, inputs.shape[-1]))
        kernel = tf.convert_to_tensor(self.kernel)
        bias = None if self.bias is None else tf.convert_to_tensor(self.bias)
        if self.shard_count == 1:
            outputs = tf.matmul(rows, kernel)
            outputs = outputs if bias is None else tf.nn.bias_add(outputs, bias)
        elif self.sharding == "columns":
            outputs = _column_sharded_dense(rows, kernel, bias, self.shard_count, self.name, *self._collectives())
        else:
            outputs = _row_sharded_dense(rows, kernel, self.shard_count, self.name, *self._collectives())
            outputs = outputs if bias is None else tf.nn.bias_add(outputs, bias)
        outputs = tf.reshape(outputs, tf.concat([shape[:-1], [self.units]], axis=0))
        return self.activation(outputs) if self.activation is not None else outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        config = super().get_config()
        config.update(units=self.units, activation=keras.activations.serialize(self.activation),
                      use_bias=self.use_bias, sharding=self.sharding,
                      kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                      bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return config


@keras.saving.register_keras_serializable(package="lms_tf")
class ShardedEmbedding(_ShardedLayer):
    """An ``Embedding`` whose table is split across the ranks of a Horovod job: by token id (rank
    r holds rows ``[r * V/G, (r + 1) * V/G)``) or by the vectors' columns (rank r holds columns
    ``[r * U/G, (r + 1) * U/G)`` of every row); see the module's docstring for the collectives.

    Args:
        input_dim: The vocabulary of the whole table.
        output_dim: The embedding dimension.
        embeddings_initializer: Initialises the whole table (the same on every rank, from its
            seed); each rank keeps its part.
        mask_zero: As ``keras.layers.Embedding``: id 0 is padding, masked downstream.
        sharding: ``"rows"`` (split the token ids; the group must divide ``input_dim``),
            ``"columns"`` (split the vectors; the group must divide ``output_dim``) or ``"auto"``
            (:func:`cheaper_embedding_sharding`: columns when they split evenly).
        shard_index: This rank's shard (default: the Horovod rank).
        shard_count: Number of shards (default: the Horovod size).
        planning: As :class:`ShardedDense`.

    Examples:
        >>> layer = ShardedEmbedding(10, 4, shard_index=1, shard_count=2)
        >>> layer.build((None, 4)); tuple(layer.embeddings.shape)
        (5, 4)
        >>> columns = ShardedEmbedding(10, 4, sharding="columns", shard_index=1, shard_count=2)
        >>> columns.build((None, 4)); tuple(columns.embeddings.shape)
        (10, 2)
        >>> ShardedEmbedding(10, 3, shard_index=0, shard_count=1)(tf.constant([[1, 2]])).shape
        TensorShape([1, 2, 3])
    """

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer="uniform", mask_zero: bool = False,
                 sharding: str = "rows", shard_index: Optional[int] = None, shard_count: Optional[int] = None,
                 planning: bool = False, **kwargs):
        super().__init__(shard_index=shard_index, shard_count=shard_count, planning=planning, **kwargs)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.mask_zero = bool(mask_zero)
        if sharding == "auto":
            sharding = cheaper_embedding_sharding(self.input_dim, self.output_dim, self.shard_count) or "rows"
        if sharding not in SHARDINGS:
            raise LMSOptionError(f"{self.name}: sharding must be 'rows', 'columns' or 'auto'; received {sharding!r}.")
        self.sharding = sharding
        if sharding == "rows":
            self.part = even_shard(self.input_dim, self.shard_index, self.shard_count, what="token ids (input_dim)",
                                   layer=self.name)
        else:
            self.part = even_shard(self.output_dim, self.shard_index, self.shard_count,
                                   what="embedding columns (output_dim)", layer=self.name)

    def build(self, input_shape=None):
        self.embeddings = self._shard_weight("embeddings", (self.input_dim, self.output_dim), self.part,
                                             0 if self.sharding == "rows" else 1, self.embeddings_initializer)

    def gather_whole_weights(self) -> list:
        """The whole table (``[embeddings]``), gathered from every rank of the group: a
        collective, every rank calls it.

        Examples:
            >>> layer = ShardedEmbedding(4, 2, shard_index=0, shard_count=1); layer.build()
            >>> [w.shape for w in layer.gather_whole_weights()]
            [(4, 2)]
        """
        return [_gather(self.embeddings.numpy(), 0 if self.sharding == "rows" else 1,
                        f"lms_tf_unshard_{self.name}_embeddings", self.shard_count)]

    def set_whole_weights(self, embeddings) -> None:
        """Sets this rank's part from the whole table (that of an ``Embedding`` layer).

        Examples:
            >>> import numpy as np
            >>> layer = ShardedEmbedding(4, 2, shard_index=1, shard_count=2); layer.build()
            >>> layer.set_whole_weights(np.arange(8.0).reshape(4, 2)); layer.embeddings.numpy().tolist()
            [[4.0, 5.0], [6.0, 7.0]]
        """
        self.embeddings.assign(embeddings[self.part] if self.sharding == "rows" else embeddings[:, self.part])

    def call(self, inputs):
        self._mark_realized_shards()
        ids = tf.cast(inputs, tf.int32)
        table = tf.convert_to_tensor(self.embeddings)
        flat = tf.reshape(ids, (-1,))
        if self.shard_count == 1:
            found = tf.gather(table, flat)
        elif self.sharding == "rows":
            found = _row_sharded_lookup(flat, table, self.part.start, self.shard_count, self.name,
                                        *self._collectives())
        else:
            found = _column_sharded_lookup(flat, table, self.shard_count, self.name, *self._collectives())
        return tf.reshape(found, tf.concat([tf.shape(ids), [self.output_dim]], axis=0))

    def compute_mask(self, inputs, mask=None):
        return tf.not_equal(inputs, 0) if self.mask_zero else None

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(input_dim=self.input_dim, output_dim=self.output_dim, mask_zero=self.mask_zero,
                      sharding=self.sharding,
                      embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer))
        return config


class _NamedCollectives:
    """Horovod's collectives, each named by its ``name`` alone (no name scope)."""

    def __init__(self):
        self._hvd = horovod_tensorflow()
        self.Sum = self._hvd.Sum

    def allgather(self, tensor, name):
        return self._hvd.allgather(tensor, name=name, ignore_name_scope=True)

    def alltoall(self, tensor, name):
        return self._hvd.alltoall(tensor, name=name, ignore_name_scope=True)

    def reducescatter(self, tensor, op, name):
        return self._hvd.reducescatter(tensor, op=op, name=name, ignore_name_scope=True)


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


def _to_blocks(tensor, count: int, batch):
    """(batch, count * width) -> (count * batch, width): block k holds column block k of every row."""
    width = tensor.shape[1] // count
    return tf.reshape(tf.transpose(tf.reshape(tensor, (batch, count, width)), (1, 0, 2)), (count * batch, width))


def _from_blocks(tensor, count: int, batch):
    """(count * batch, width) -> (batch, count * width): the inverse of :func:`_to_blocks`."""
    width = tensor.shape[1]
    return tf.reshape(tf.transpose(tf.reshape(tensor, (count, batch, width)), (1, 0, 2)), (batch, count * width))


def _same_batch_on_every_rank(gathered, batch, count: int, name: str):
    """The collectives split the gathered rows evenly: a rank with another batch size (an uneven
    last batch) would get another rank's rows. Say so instead of computing with them."""
    return tf.debugging.assert_equal(
        tf.shape(gathered)[0], count * batch,
        # (No quotes in the message: TensorFlow escapes them in the error it raises.)
        message=f"{name}: every rank of the group of a sharded layer must feed the same batch size (an uneven "
                f"last batch gives ranks different sizes): use drop_remainder=True in tf.data, or a dataset size "
                f"that the global batch divides. Rows gathered from the group, then {count} x the rows of this rank:")


def _while_in_flight(x_partial):
    """Ops made under this run after the input gradient's partial product, not before it.

    The layers below wait for the input gradient; the kernel's gradient, not on their way, is
    computed while the collective that completes the input gradient is in flight. (Left to
    itself the executor may run the kernel's product first, which delays that collective, and
    everything below, by the product's time: on a GPU's one compute stream they cannot overlap.)
    """
    return tf.control_dependencies([x_partial])


def _column_sharded_dense(inputs, kernel, bias, count: int, name: str, hvd, tag: str):
    """``inputs @ whole_kernel + whole_bias`` for this rank's rows, from this rank's columns."""

    @tf.custom_gradient
    def sharded(x, w, *b):
        batch = tf.shape(x)[0]
        gathered = hvd.allgather(x, name=f"{tag}_x")                    # (G*batch, features)
        with tf.control_dependencies([_same_batch_on_every_rank(gathered, batch, count, name)]):
            mine = tf.matmul(gathered, w)                               # (G*batch, units/G)
        if b:
            mine = tf.nn.bias_add(mine, b[0])
        received = hvd.alltoall(mine, name=f"{tag}_y")                 # block r: rank r's columns, my rows
        outputs = _from_blocks(received, count, batch)

        def grad(upstream):
            mine_grad = hvd.alltoall(_to_blocks(upstream, count, batch), name=f"{tag}_dy")  # my columns, all rows
            x_partial = tf.matmul(mine_grad, w, transpose_b=True, name="input_gradient_part")
            x_grad = hvd.reducescatter(x_partial, op=hvd.Sum, name=f"{tag}_dx")
            with _while_in_flight(x_partial):
                grads = [x_grad, tf.matmul(gathered, mine_grad, transpose_a=True, name="kernel_gradient") / count]
                if b:
                    grads.append(tf.reduce_sum(mine_grad, axis=0) / count)
            return grads

        return outputs, grad

    return sharded(inputs, kernel, *([] if bias is None else [bias]))


def _row_sharded_dense(inputs, kernel, count: int, name: str, hvd, tag: str):
    """``inputs @ whole_kernel`` for this rank's rows, from this rank's rows of the kernel."""

    @tf.custom_gradient
    def sharded(x, w):
        batch = tf.shape(x)[0]
        # Block r of what this rank sends: its rows, rank r's features.
        received = hvd.alltoall(_to_blocks(x, count, batch), name=f"{tag}_x")   # every rank's rows, my features
        with tf.control_dependencies([_same_batch_on_every_rank(received, batch, count, name)]):
            partial = tf.matmul(received, w)                                   # (G*batch, units), my features' part
        outputs = hvd.reducescatter(partial, op=hvd.Sum, name=f"{tag}_y")      # summed, my rows

        def grad(upstream):
            every = hvd.allgather(upstream, name=f"{tag}_dy")                  # (G*batch, units)
            x_partial = tf.matmul(every, w, transpose_b=True, name="input_gradient_part")  # all rows, my features
            x_grad = _from_blocks(hvd.alltoall(x_partial, name=f"{tag}_dx"), count, batch)
            with _while_in_flight(x_partial):
                w_grad = tf.matmul(received, every, transpose_a=True, name="kernel_gradient") / count
            return x_grad, w_grad

        return outputs, grad

    return sharded(inputs, kernel)


def _row_sharded_lookup(ids, table, start: int, count: int, name: str, hvd, tag: str):
    """The embeddings of this rank's ``ids`` (flat), from this rank's rows ``[start, start + rows)``."""
    every_id = hvd.allgather(ids, name=f"{tag}_ids")
    local = every_id - start
    held = tf.logical_and(local >= 0, local < tf.shape(table)[0])

    @tf.custom_gradient
    def lookup(t):
        found = tf.where(held[:, None], tf.gather(t, tf.where(held, local, 0)), tf.zeros((), t.dtype))
        # One rank holds each id: the sum over ranks adds zeros to it, exactly.
        with tf.control_dependencies([_same_batch_on_every_rank(every_id, tf.shape(ids)[0], count, name)]):
            outputs = hvd.reducescatter(found, op=hvd.Sum, name=f"{tag}_y")

        def grad(upstream):
            every = hvd.allgather(upstream, name=f"{tag}_dy")
            # Sparse, as Embedding's own gradient: only the rows this rank's ids read.
            return tf.IndexedSlices(tf.boolean_mask(every, held) / count, tf.boolean_mask(local, held),
                                    tf.shape(t))

        return outputs, grad

    return lookup(table)


def _column_sharded_lookup(ids, table, count: int, name: str, hvd, tag: str):
    """The embeddings of this rank's ``ids`` (flat), from this rank's columns of every row."""
    every_id = hvd.allgather(ids, name=f"{tag}_ids")
    batch = tf.shape(ids)[0]

    @tf.custom_gradient
    def lookup(t):
        with tf.control_dependencies([_same_batch_on_every_rank(every_id, batch, count, name)]):
            mine = tf.gather(t, every_id)                                   # my columns, every rank's ids
        outputs = _from_blocks(hvd.alltoall(mine, name=f"{tag}_y"), count, batch)   # every column, my ids

        def grad(upstream):
            mine_grad = hvd.alltoall(_to_blocks(upstream, count, batch), name=f"{tag}_dy")  # my columns, all ids
            # Sparse, as Embedding's own gradient: the rows every rank's ids read, this rank's columns.
            return tf.IndexedSlices(mine_grad / count, every_id, tf.shape(t))

        return outputs, grad

    return lookup(table)
