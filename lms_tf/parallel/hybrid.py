"""Hybrid parallelism (SplitBrain): the memory-heavy layers of a model sharded across ranks.

:func:`plan_hybrid` decides, per layer, sharded or replicated, and says why; :func:`hybridize`
returns a copy of the model with those layers replaced by sharded ones holding this rank's part
of the original weights; :func:`unshard` gathers the parts back into an ordinary model (to
evaluate on one process), and :func:`save_unsharded` saves that model (``keras.models.load_model``
then gives back the ordinary model, and :func:`hybridize` splits it again).

Examples:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, name="fc"),
    ...                           keras.layers.Dense(10, name="out")])
    >>> print(plan_hybrid(model, min_param_bytes=32 * 1024, group_size=2).summary())
    layer  kind   parameters  MiB   decision           why
    fc     Dense  16640       0.06  sharded (columns)  16640 parameters (65.0 KiB) >= min_param_bytes (32.0 KiB)
    out    Dense  2570        0.01  replicated         2570 parameters (10.0 KiB) < min_param_bytes (32.0 KiB)
    sharded: 16640 of 19210 parameters (86.6%); each of 2 ranks holds 1/2 of them
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError
from lms_tf.core.policy import describe, format_bytes
from lms_tf.horovod import horovod_tensorflow
from lms_tf.parallel.sharded import ShardedDense, ShardedEmbedding, cheaper_embedding_sharding, cheaper_sharding

keras = _compat.keras_module()


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer of a :class:`HybridPlan`.

    Attributes:
        layer: The layer's name.
        kind: Its class name.
        parameters: Its number of parameters.
        nbytes: Their bytes.
        sharded: Whether it is split across the group.
        why: The rule's reason, in words.
        sharding: How a sharded layer is split: ``"columns"`` or ``"rows"`` of a Dense layer's
            kernel (:func:`~lms_tf.parallel.sharded.cheaper_sharding`) or of an Embedding's
            table (:func:`~lms_tf.parallel.sharded.cheaper_embedding_sharding`); empty when
            replicated.

    Examples:
        >>> LayerChoice("fc1", "Dense", 10, 40, True, "large").sharded
        True
    """

    layer: str
    kind: str
    parameters: int
    nbytes: int
    sharded: bool
    why: str
    sharding: str = ""


@dataclasses.dataclass(frozen=True)
class HybridPlan:
    """Which layers are sharded across a group of ranks, and why (data: print, edit, apply).

    Attributes:
        group_size: Ranks each sharded layer is split across.
        layers: One :class:`LayerChoice` per layer with weights, in model order.

    Examples:
        >>> plan = HybridPlan(2, (LayerChoice("fc1", "Dense", 10, 40, True, "large"),))
        >>> plan.sharded_layers
        ('fc1',)
    """

    group_size: int
    layers: Tuple[LayerChoice, ...]

    @property
    def sharded_layers(self) -> Tuple[str, ...]:
        """Names of the sharded layers.

        Examples:
            >>> HybridPlan(2, ()).sharded_layers
            ()
        """
        return tuple(c.layer for c in self.layers if c.sharded)

    def summary(self) -> str:
        """A table: layer, kind, parameters, MiB, sharded (how) or replicated, why; then the totals.

        Examples:
            >>> print(HybridPlan(2, ()).summary().splitlines()[-1])
            sharded: 0 of 0 parameters (0.0%); each of 2 ranks holds 1/2 of them
        """
        rows = [("layer", "kind", "parameters", "MiB", "decision", "why")]
        rows += [(c.layer, c.kind, str(c.parameters), f"{c.nbytes / 2**20:.2f}",
                  f"sharded ({c.sharding})" if c.sharded else "replicated", c.why) for c in self.layers]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(r[:5], widths)) + "  " + r[5] for r in rows]
        total = sum(c.parameters for c in self.layers)
        sharded = sum(c.parameters for c in self.layers if c.sharded)
        lines.append(f"sharded: {sharded} of {total} parameters ({100 * sharded / max(total, 1):.1f}%); each of "
                     f"{self.group_size} ranks holds 1/{self.group_size} of them")
        return "\n".join(lines)


def _check_group_size(group_size) -> int:
    if group_size is None:
        return horovod_tensorflow().size()
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise LMSOptionError(f"group_size must be an int >= 1 (the ranks a sharded layer is split across); "
                             f"received {describe(group_size)}.")
    return group_size


def _how_to_shard(layer, group_size: int) -> Tuple[str, str]:
    """How ``layer`` would be split across ``group_size`` ranks, or ``("", why it cannot be")``."""
    if isinstance(layer, keras.layers.Embedding):
        if getattr(layer, "lora_enabled", False) or layer.embeddings_regularizer or layer.embeddings_constraint:
            return "", "an Embedding with LoRA, a regularizer or a constraint, which ShardedEmbedding does not carry"
        sharding = cheaper_embedding_sharding(layer.input_dim, layer.output_dim, group_size)
        if sharding is None:
            return "", (f"neither its {layer.output_dim} columns nor its {layer.input_dim} token ids split across "
                        f"{group_size} ranks")
        return sharding, ""
    if isinstance(layer, keras.layers.Dense) and len(layer.kernel.shape) == 2:
        if getattr(layer, "lora_enabled", False) or layer.kernel_regularizer or layer.kernel_constraint \
                or layer.bias_regularizer or layer.bias_constraint:
            return "", "a Dense layer with LoRA, a regularizer or a constraint, which ShardedDense does not carry"
        features, units = (int(n) for n in layer.kernel.shape)
        sharding = cheaper_sharding(features, units, group_size)
        if sharding is None:
            return "", f"neither its {units} units nor its {features} input features split across {group_size} ranks"
        return sharding, ""
    return "", "only Dense and Embedding layers are sharded"


def plan_hybrid(model, min_param_bytes: int = 16 * 2**20, group_size: Optional[int] = None,
                layers: Optional[Sequence[str]] = None) -> HybridPlan:
    """Chooses the layers to shard: ``Dense`` and ``Embedding`` layers holding at least
    ``min_param_bytes`` of parameters that the group splits evenly (or exactly ``layers``, names
    given). A Dense layer is split by columns or rows, whichever sends fewer bytes
    (:func:`~lms_tf.parallel.sharded.cheaper_sharding`); an Embedding by columns, or by token id
    when the group does not divide its vectors.

    Args:
        model: A Keras model.
        min_param_bytes: A layer at least this large is sharded.
        group_size: Ranks to split across (default: the Horovod size).
        layers: Names of the layers to shard instead of the rule (the user's override).

    Returns:
        The :class:`HybridPlan`.

    Raises:
        LMSOptionError: A bad ``group_size`` or ``min_param_bytes``, or a named layer that is not a
            layer of the model or cannot be sharded (the error says why).

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc")])
        >>> plan_hybrid(model, group_size=2, layers=["fc"]).sharded_layers
        ('fc',)
    """
    group_size = _check_group_size(group_size)
    if not isinstance(min_param_bytes, int) or min_param_bytes < 0:
        raise LMSOptionError(f"min_param_bytes must be an int >= 0; received {describe(min_param_bytes)}.")
    named = set(layers or ())
    known = {layer.name: layer for layer in model.layers}
    unknown = sorted(named - set(known))
    if unknown:
        raise LMSOptionError(f"layers={unknown} are not layers of {model.name!r}; its layers with weights are "
                             f"{sorted(n for n, layer in known.items() if layer.weights)}.")
    choices: List[LayerChoice] = []
    for layer in known.values():
        if not layer.weights:
            continue
        parameters = int(sum(np.prod(w.shape) for w in layer.weights))
        nbytes = int(sum(np.prod(w.shape) * np.dtype(w.dtype).itemsize for w in layer.weights))
        kind = type(layer).__name__
        size = f"{parameters} parameters ({format_bytes(nbytes)})"
        sharding, cannot = _how_to_shard(layer, group_size)
        if named:
            if layer.name in named and not sharding:
                raise LMSOptionError(f"layers=[{layer.name!r}]: {layer.name!r} ({kind}, group_size={group_size}) "
                                     f"cannot be sharded: {cannot}. Leave it out of layers=.")
            sharded, why = layer.name in named, "named in layers=" if layer.name in named else "not named in layers="
        elif not sharding:
            sharded, why = False, f"{size}; {cannot}"
        elif nbytes < min_param_bytes:
            sharded, why = False, f"{size} < min_param_bytes ({format_bytes(min_param_bytes)})"
        else:
            sharded, why = True, f"{size} >= min_param_bytes ({format_bytes(min_param_bytes)})"
        choices.append(LayerChoice(layer.name, kind, parameters, nbytes, sharded, why, sharding if sharded else ""))
    return HybridPlan(group_size, tuple(choices))


def hybridize(model, min_param_bytes: int = 16 * 2**20, group_size: Optional[int] = None,
              layers: Optional[Sequence[str]] = None, plan: Optional[HybridPlan] = None, planning: bool = False):
    """A copy of ``model`` whose chosen ``Dense`` and ``Embedding`` layers are :class:`ShardedDense`
    and :class:`ShardedEmbedding` layers holding this rank's part of the original weights; the other
    layers are copies with the original weights. ``model`` is left as it is. Every rank of the group calls it, with the same model.

    Args:
        model: A built Sequential or Functional Keras model.
        min_param_bytes: The rule of :func:`plan_hybrid`: the smallest layer sharded.
        group_size: Ranks to split across (default: the Horovod size).
        layers: Names of the layers to shard instead of the rule.
        plan: A :class:`HybridPlan` to apply instead (from :func:`plan_hybrid`, maybe edited).
        planning: One process stands in for a rank of the group (no Horovod): the copy has one
            rank's shapes, for planning its step (``lms-tf plan --hybrid G``); it cannot train.

    Returns:
        The new model (its ``hybrid_plan`` attribute holds the plan), not compiled.

    Raises:
        LMSOptionError: A subclassed model (its layers cannot be replaced from outside), or a bad
            argument (:func:`plan_hybrid`).

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc")])
        >>> hybrid = hybridize(model, min_param_bytes=0, group_size=1)
        >>> type(hybrid.get_layer("fc")).__name__, hybrid.hybrid_plan.sharded_layers
        ('ShardedDense', ('fc',))
    """
    if not isinstance(model, (keras.Sequential, keras.Model)) or not _is_graph_model(model):
        raise LMSOptionError(
            f"hybridize needs a Sequential or Functional model; received {type(model).__name__}, whose layers "
            f"cannot be replaced from outside. Use lms_tf.parallel.ShardedDense in its definition instead.")
    if planning and group_size is None and plan is None:
        raise LMSOptionError("hybridize(planning=True) stands in for one rank of a group: pass group_size= "
                             "(the group planned for); received group_size=None.")
    plan = plan or plan_hybrid(model, min_param_bytes=min_param_bytes, group_size=group_size, layers=layers)
    hvd = horovod_tensorflow() if plan.group_size > 1 and not planning else None
    index = hvd.rank() if hvd is not None else 0
    if hvd is not None and hvd.size() != plan.group_size:
        raise LMSOptionError(f"the plan shards across {plan.group_size} ranks, but this Horovod job has "
                             f"{hvd.size()}; plan with group_size={hvd.size()}.")
    if hvd is not None:
        _check_same_model_on_every_rank(hvd, model, plan)
    chosen = {c.layer: c.sharding for c in plan.layers if c.sharded}

    def clone(layer):
        if layer.name not in chosen:
            return layer.__class__.from_config(layer.get_config())
        shard = dict(name=layer.name, shard_index=index, shard_count=plan.group_size, dtype=layer.dtype_policy,
                     planning=planning)
        if isinstance(layer, keras.layers.Embedding):
            return ShardedEmbedding(layer.input_dim, layer.output_dim, mask_zero=layer.mask_zero,
                                    sharding=chosen[layer.name], **shard)
        return ShardedDense(layer.units, activation=layer.activation, use_bias=layer.use_bias,
                            sharding=chosen[layer.name], **shard)

    hybrid = keras.models.clone_model(model, clone_function=clone)
    for original in model.layers:
        if not original.weights:
            continue  # (an input layer's name may differ in the copy)
        copy = hybrid.get_layer(original.name)
        if original.name in chosen:
            copy.set_whole_weights(*original.get_weights())
        else:
            copy.set_weights(original.get_weights())
    hybrid.hybrid_plan = plan
    return hybrid


def model_fingerprint(model, plan: HybridPlan) -> List[int]:
    """One number per layer with weights, then one for the plan, that differ when two models or
    plans differ: each layer's class and weight shapes (and its name when it is sharded: its
    collectives are named after it; Keras numbers unnamed layers per process), each decision and
    the group size.

    Examples:
        >>> import keras
        >>> a = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc")])
        >>> b = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="fc")])
        >>> model_fingerprint(a, plan_hybrid(a, group_size=2)) == model_fingerprint(b, plan_hybrid(b, group_size=2))
        False
    """
    import zlib

    sharded = set(plan.sharded_layers)
    return [zlib.crc32(_describe_layer(layer, layer.name in sharded).encode()) for layer in _weighted(model)] + \
        [zlib.crc32(repr([c.sharding for c in plan.layers] + sorted(sharded) + [plan.group_size]).encode())]


def _weighted(model) -> List:
    return [layer for layer in model.layers if layer.weights]


def _describe_layer(layer, named: bool = True) -> str:
    return (f"{layer.name} " if named else "") + f"({type(layer).__name__}, weights {[tuple(w.shape) for w in layer.weights]})"


def _check_same_model_on_every_rank(hvd, model, plan: HybridPlan) -> None:
    """Every rank must shard the same layers of the same model, or the collectives of the step
    would not match (Horovod would stop the job later, or wait). Two allgathers compare them."""
    import tensorflow as tf

    mine = model_fingerprint(model, plan)
    counts = hvd.allgather(tf.constant([len(mine)], tf.int64), name="lms_tf_hybridize_layers").numpy().tolist()
    values = hvd.allgather(tf.constant(mine, tf.int64), name="lms_tf_hybridize_fingerprint").numpy().tolist()
    per_rank = [values[sum(counts[:r]):sum(counts[:r + 1])] for r in range(len(counts))]
    differ = [rank for rank, theirs in enumerate(per_rank) if theirs != per_rank[0]]
    if not differ:
        return
    me = hvd.rank()
    where = ""
    if me in differ:
        first = next((i for i, (a, b) in enumerate(zip(mine, per_rank[0])) if a != b), min(len(mine), len(per_rank[0])))
        layers = _weighted(model)
        where = (f" Here (rank {me}) the first difference is the layer with weights number {first}: "
                 + (_describe_layer(layers[first]) if first < len(layers) else "the plan (decisions or group size)")
                 + (f"; this rank has {len(layers)} layers with weights, rank 0 {len(per_rank[0]) - 1}"
                    if len(mine) != len(per_rank[0]) else "") + ".")
    raise LMSOptionError(
        f"hybridize: the ranks do not agree on the model or the plan: ranks {differ} differ from rank 0 (layer "
        f"names, classes, weight shapes and decisions).{where} Build the same model with the same input shape and "
        f"layer names on every rank (name the layers, or build the same layers in the same order, since Keras "
        f"numbers unnamed ones per process), and pass every rank the same min_param_bytes, group_size and layers.")


def _is_graph_model(model) -> bool:
    return isinstance(model, keras.Sequential) or getattr(model, "_is_graph_network", False) \
        or type(model).__name__ == "Functional"


def _group_of(hybrid):
    """Horovod, when a layer of ``hybrid`` is split across more than one rank; else None."""
    sharded = [layer for layer in hybrid.layers if isinstance(layer, (ShardedDense, ShardedEmbedding))]
    return horovod_tensorflow() if any(layer.shard_count > 1 for layer in sharded) else None


def unshard(hybrid):
    """The ordinary model a :func:`hybridize` model stands for: each sharded layer a ``Dense`` or
    ``Embedding`` layer with the whole weights, gathered from every rank (a collective: every rank
    calls it).

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc")])
        >>> back = unshard(hybridize(model, min_param_bytes=0, group_size=1))
        >>> type(back.get_layer("fc")).__name__, np.array_equal(back.get_weights()[0], model.get_weights()[0])
        ('Dense', True)
    """
    def clone(layer):
        if isinstance(layer, ShardedEmbedding):
            return keras.layers.Embedding(layer.input_dim, layer.output_dim, mask_zero=layer.mask_zero,
                                          name=layer.name, dtype=layer.dtype_policy)
        if isinstance(layer, ShardedDense):
            return keras.layers.Dense(layer.units, activation=layer.activation, use_bias=layer.use_bias,
                                      name=layer.name, dtype=layer.dtype_policy)
        return layer.__class__.from_config(layer.get_config())

    model = keras.models.clone_model(hybrid, clone_function=clone)
    for layer in hybrid.layers:
        if not layer.weights:
            continue
        copy = model.get_layer(layer.name)
        if isinstance(layer, (ShardedDense, ShardedEmbedding)):
            copy.set_weights(layer.gather_whole_weights())
        else:
            copy.set_weights(layer.get_weights())
    return model


def whole_weights(model) -> list:
    """``model.weights`` as the unsharded model holds them: each sharded layer's shards gathered
    from every rank of its group (a collective: every rank calls it), every other weight as it
    is. Works on any model that contains sharded layers, a subclassed one too, where
    :func:`unshard` cannot rebuild the model.

    Examples:
        >>> import keras
        >>> class Net(keras.Model):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = ShardedDense(4, shard_index=0, shard_count=1)
        ...     def call(self, x):
        ...         return self.fc(x)
        >>> net = Net(); _ = net(np.ones((1, 2), "float32"))
        >>> [w.shape for w in whole_weights(net)]
        [(2, 4), (4,)]
    """
    whole = {}
    for layer in _compat.nested_layers(model):
        if isinstance(layer, (ShardedDense, ShardedEmbedding)):
            whole.update((id(v), array) for v, array in zip(layer.weights, layer.gather_whole_weights()))
    return [whole[id(v)] if id(v) in whole else v.numpy() for v in model.weights]


def save_unsharded(hybrid, filepath: str):
    """Saves the ordinary model a :func:`hybridize` model stands for (:func:`unshard`), written by
    rank 0 alone: ``keras.models.load_model(filepath)`` gives it back on one process, and
    :func:`hybridize` splits it again to resume. A collective: every rank calls it.

    Args:
        hybrid: The model :func:`hybridize` returned (trained or not).
        filepath: Where to save it (``.keras``, as ``Model.save``).

    Returns:
        The unsharded model (on every rank), once the file is written: every rank may load it next
        (on a file system they share).

    Examples:
        >>> import keras, os, tempfile
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc")])
        >>> path = os.path.join(tempfile.mkdtemp(), "model.keras")
        >>> _ = save_unsharded(hybridize(model, min_param_bytes=0, group_size=1), path)
        >>> type(keras.models.load_model(path).get_layer("fc")).__name__
        'Dense'
    """
    model = unshard(hybrid)
    hvd = _group_of(hybrid)
    if hvd is None:
        model.save(filepath)
        return model
    import tensorflow as tf

    if hvd.rank() == 0:
        model.save(filepath)
    hvd.allreduce(tf.constant(0), name="lms_tf_save_unsharded_written")  # the others wait for rank 0's file
    return model
