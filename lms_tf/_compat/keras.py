"""Keras internals: which Keras runs, a model's XLA flag, layer name scopes, fit's batch size, and the
private optimizer classes whose update methods receive the gradients.

Examples:
    >>> from lms_tf._compat import keras
    >>> keras.keras_module().__name__ in ("keras", "tf_keras")
    True
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from typing import Dict, Iterable, List, Optional, Tuple

import tensorflow as tf

from lms_tf._compat.data import dataset_batch_size
from lms_tf._compat.graph import current_graph


def using_legacy_keras() -> bool:
    """Whether ``TF_USE_LEGACY_KERAS=1`` selects tf-keras (Keras 2) instead of Keras 3.

    Examples:
        >>> using_legacy_keras()   # TF_USE_LEGACY_KERAS is not set here
        False
    """
    return os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in ("1", "true", "yes")


def keras_module():
    """The Keras package models are built with: ``tf_keras`` under legacy mode, else ``keras``.

    Examples:
        >>> keras_module().__name__
        'keras'
    """
    if using_legacy_keras():
        import tf_keras

        return tf_keras
    import keras

    return keras


def get_jit_compile(model) -> bool:
    """The model's effective ``jit_compile`` setting (True, False or resolved "auto").

    Examples:
        >>> keras = keras_module()
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse", jit_compile=False)
        >>> get_jit_compile(model)
        False
    """
    value = getattr(model, "jit_compile", None)
    if value is None:
        value = getattr(model, "_jit_compile", None)
    return bool(value) if value not in ("auto",) else True


def set_jit_compile(model, value: bool) -> None:
    """Sets the model's resolved ``jit_compile`` (``_jit_compile`` in Keras 3 and tf-keras).

    The attribute is written directly: Keras 3's property setter re-validates against
    the current machine and would refuse to restore a value resolved on a GPU.

    Examples:
        >>> keras = keras_module()
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> set_jit_compile(model, False); get_jit_compile(model)
        False
    """
    if hasattr(model, "_jit_compile"):
        model._jit_compile = value  # pylint: disable=protected-access
    else:
        model.jit_compile = value


def layer_scope_aliases(model, graph: tf.Graph) -> Dict[str, str]:
    """Maps each layer name of ``model`` to the name scope its ops got in ``graph``.

    Keras traces the train step after other uses of the model's name scope, so TF
    uniquifies every scope of the trace with the same suffix (``seq_cnn`` -> ``seq_cnn_1``,
    ``conv0`` -> ``conv0_1``). The suffix is read off the model's own scope.

    Examples:
        >>> import tensorflow as tf
        >>> keras = keras_module()
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")], name="seq")
        >>> graph = tf.function(lambda x: model(x)).get_concrete_function(tf.TensorSpec((1, 2))).graph
        >>> layer_scope_aliases(model, graph)["d"]
        'd_1'
    """
    return layer_scope_aliases_in(model, (op.name for op in graph.get_operations()))


def nested_layers(layer) -> list:
    """``layer`` and every layer inside it, however deep (a subclassed model's attributes, a
    layer's sublayers), through Keras's private walk.

    Examples:
        >>> keras = keras_module()
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")], name="seq")
        >>> [type(layer).__name__ for layer in nested_layers(model)]
        ['Sequential', 'InputLayer', 'Dense']
    """
    return list(layer._flatten_layers(include_self=True, recursive=True))  # pylint: disable=protected-access


def layer_scope_aliases_in(model, op_names: Iterable[str]) -> Dict[str, str]:
    """:func:`layer_scope_aliases` from the names of the trace's ops (an IR's, say).

    Examples:
        >>> keras = keras_module()
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")], name="seq")
        >>> layer_scope_aliases_in(model, ["seq_2/d_2/MatMul"])["d"]
        'd_2'
    """
    names = [layer.name for layer in nested_layers(model)[1:]]
    op_names = list(op_names)
    first_segments = {name.split("/")[0] for name in op_names}
    suffix, model_scope = "", model.name
    if model.name not in first_segments:
        for segment in first_segments:
            tail = segment[len(model.name):]
            if segment.startswith(model.name + "_") and tail[1:].isdigit():
                suffix, model_scope = tail, segment
                break
    aliases = {name: name + suffix for name in names}
    # TensorFlow uniquifies a scope already taken by another layer's scope differently: layer
    # "conv2d_1" gets "conv2d_1_2" when "conv2d" took "conv2d_1". Such layers take the first
    # unclaimed scope under the model's, in trace order, that is their name plus "_<n>" suffixes.
    seen: Dict[str, None] = {}
    for name in op_names:
        parts = name.split("/")
        if len(parts) > 2 and parts[0] == model_scope:
            seen.setdefault(parts[1], None)
    if seen:
        claimed = {alias for alias in aliases.values() if alias in seen}
        for name in names:
            if aliases[name] in seen:
                continue
            pattern = re.compile(re.escape(name) + r"(_\d+)+")
            match = next((scope for scope in seen if scope not in claimed and pattern.fullmatch(scope)), None)
            if match is not None:
                aliases[name] = match
                claimed.add(match)
    return aliases


def fit_batch_size() -> Optional[int]:
    """The (largest) batch size of the ``Model.fit`` call that is running, read from its frame.

    Keras does not hand callbacks the batch size; ``fit`` holds it in its epoch iterator
    (Keras 3: ``epoch_iterator.data_adapter.batch_size``; tf-keras: ``data_handler._batch_size``)
    or its ``batch_size`` argument. Those say None for a ``tf.data.Dataset`` batched without
    ``drop_remainder``: its pipeline's last ``batch`` gives the size then
    (:func:`~lms_tf._compat.data.dataset_batch_size`). A ``keras.utils.PyDataset`` gives it
    from its first batch (random access, as Keras itself reads it). Returns None when no
    such frame is found or the size cannot be read.

    Examples:
        >>> fit_batch_size() is None   # not inside model.fit
        True
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and "self" in frame.f_locals:
                return _batch_size_in_fit(frame.f_locals)
            frame = frame.f_back
        return None
    finally:
        del frame


def _batch_size_in_fit(local) -> Optional[int]:
    it = local.get("epoch_iterator")
    adapter = getattr(it, "data_adapter", None) or getattr(it, "_data_adapter", None)
    size = getattr(adapter, "batch_size", None)
    if size is None:
        size = getattr(local.get("data_handler"), "_batch_size", None)
    if size is None and isinstance(local.get("x"), tf.data.Dataset):
        size = dataset_batch_size(local["x"])
    if size is None and getattr(adapter, "py_dataset", None) is not None:
        size = _first_batch_size(adapter.py_dataset)
    if size is None:
        size = local.get("batch_size")
    return int(size) if size else None


def _first_batch_size(py_dataset) -> Optional[int]:
    try:
        first = py_dataset[0]
    except Exception:  # noqa: BLE001 - a dataset that cannot be indexed here just gives no size
        return None
    leaves = tf.nest.flatten(first)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else None


# The methods through which a train step hands (gradients, variables) to a Keras optimizer.
# Keras 3: apply_gradients() calls apply(); LossScaleOptimizer/MultiOptimizer override apply()
# and call their inner optimizers' apply(). tf-keras: apply_gradients() on both optimizer bases.
_KERAS3_APPLY = ("keras.src.optimizers.base_optimizer:BaseOptimizer",
                 "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer",
                 "keras.src.optimizers.multi_optimizer:MultiOptimizer")


_TF_KERAS_APPLY_GRADIENTS = ("tf_keras.src.optimizers.optimizer:Optimizer",
                             "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2",
                             "tf_keras.src.mixed_precision.loss_scale_optimizer:LossScaleOptimizer",
                             "tf_keras.src.mixed_precision.loss_scale_optimizer:LossScaleOptimizerV3")


def optimizer_entry_points() -> List[Tuple[type, str]]:
    """(class, method) pairs that receive gradients, for the Keras packages that are importable.

    Examples:
        >>> import keras
        >>> ("BaseOptimizer", "apply") in [(cls.__name__, method) for cls, method in optimizer_entry_points()]
        True
    """
    import importlib

    entries = []
    for paths, method in ((_KERAS3_APPLY, "apply"), (_TF_KERAS_APPLY_GRADIENTS, "apply_gradients")):
        for path in paths:
            module_name, class_name = path.split(":")
            if module_name.split(".")[0] not in sys.modules:
                continue  # a Keras package nobody imported cannot be running the step
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                continue
            if method in cls.__dict__:
                entries.append((cls, method))
    return entries


def functional_graph(model):
    """The layer graph a Sequential or Functional Keras 3 model calls (None for a subclassed model).

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> functional_graph(model) is not None
        True
    """
    import keras

    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if getattr(model, "_nodes_by_depth", None) is not None and getattr(model, "_inputs_struct", None) is not None:
        return model
    return None


def nodes_in_call_order(graph) -> list:
    """The graph's layer calls (Keras nodes) in the order ``Functional.call`` runs them: deepest
    first, each depth in its list's order. Running a subset of them in this order records the
    same ops in the same relative order as the whole model's call (a tape then sums a tensor's
    gradients in the same order).

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
        >>> [node.operation.name for node in nodes_in_call_order(functional_graph(model))]
        ['d']
    """
    nodes = []
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        nodes.extend(node for node in graph._nodes_by_depth[depth] if node.operation and not node.is_input)
    return nodes


def flat_model_inputs(graph, inputs) -> list:
    """``inputs`` as the model takes them (a tensor, a list, a dict by input name) as one tensor
    per input of ``graph``, in its order: what ``Functional.call`` feeds its layer graph.

    Examples:
        >>> import keras, numpy as np
        >>> a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
        >>> graph = functional_graph(keras.Model([a, b], keras.layers.Concatenate()([a, b])))
        >>> [tuple(t.shape) for t in flat_model_inputs(graph, {"b": np.ones((1, 3)), "a": np.ones((1, 2))})]
        [(1, 2), (1, 3)]
    """
    return list(graph._standardize_inputs(inputs))


def call_node(graph, node, values: Dict[int, object], training) -> None:
    """Runs one layer call of ``graph`` as ``Functional.call`` does (call-context arguments such
    as ``training`` passed to the layers that take them), reading and writing ``values`` (the
    graph's symbolic tensor ids -> tensors).

    Examples:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
        >>> graph = functional_graph(model)
        >>> values = {id(graph.inputs[0]): np.ones((1, 4), "float32")}
        >>> call_node(graph, nodes_in_call_order(graph)[0], values, training=True)
        >>> tuple(values[id(graph.outputs[0])].shape)
        (1, 2)
    """
    from keras import tree
    from keras.src.models.functional import operation_fn

    args, kwargs = node.arguments.fill_in(values)
    operation = graph._get_operation_for_node(node) if hasattr(graph, "_get_operation_for_node") else node.operation
    outputs = operation_fn(operation, training=training)(*args, **kwargs)
    for symbolic, value in zip(node.outputs, tree.flatten(outputs)):
        values[id(symbolic)] = value


def _already_on(current, wanted) -> bool:
    """Whether a variable on ``current`` is on ``wanted``: the fields ``wanted`` names (job, replica
    and task too, so a host in another process of a cluster is not taken for this one's CPU), its
    device index 0 when it names none.

    Examples:
        >>> spec = tf.DeviceSpec.from_string
        >>> here = spec("/job:worker/replica:0/task:0/device:CPU:0")
        >>> _already_on(here, spec("/CPU:0")), _already_on(here, spec("/job:worker/replica:0/task:1/device:CPU:0"))
        (True, False)
    """
    if (current.device_type, current.device_index) != (wanted.device_type, wanted.device_index or 0):
        return False
    return all(getattr(wanted, field) is None or getattr(wanted, field) == getattr(current, field)
               for field in ("job", "replica", "task"))


def move_variables(variables, device: str) -> int:
    """Re-creates each Keras 3 variable's TensorFlow variable on ``device`` with its value, name and
    settings (Keras keeps it in the private ``_value``); an optimizer built on them is re-keyed by
    :func:`rekey_optimizer`. Returns how many moved (those already there stay).

    Examples:
        >>> keras = keras_module()
        >>> layer = keras.layers.Dense(2)
        >>> layer.build((None, 3))
        >>> move_variables(layer.weights, "/CPU:0"), layer.kernel.value.device.endswith("CPU:0")
        (0, True)
    """
    moved = 0
    wanted = tf.DeviceSpec.from_string(device)
    for variable in variables:
        inner = getattr(variable, "_value", None)
        if not isinstance(inner, tf.Variable):
            continue
        if _already_on(tf.DeviceSpec.from_string(inner.device), wanted):
            continue
        with tf.init_scope(), tf.device(device):
            variable._value = tf.Variable(inner.read_value(), dtype=inner.dtype, trainable=inner.trainable,
                                          name=inner.name.split(":")[0], aggregation=inner.aggregation,
                                          synchronization=inner.synchronization)
        moved += 1
    return moved


def rekey_optimizer(optimizer) -> None:
    """Keras 3's TensorFlow optimizers find a variable's slots by its TensorFlow variable's id: after
    :func:`move_variables`, the index must be rebuilt from the (same) Keras variables.

    Examples:
        >>> keras = keras_module()
        >>> rekey_optimizer(keras.optimizers.SGD())   # not built: nothing to re-key
    """
    variables = getattr(optimizer, "_trainable_variables", None)
    if not getattr(optimizer, "built", False) or variables is None:
        return
    optimizer._trainable_variables_indices = {optimizer._var_key(v): i for i, v in enumerate(variables)}


#: TensorFlow's stateful random ops: run a second time, one draws other numbers.
STATEFUL_RANDOM_OP_TYPES = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal", "ParameterizedTruncatedNormal",
    "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial", "RandomCrop",
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormal",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial"})


def run_again_without_updates(function, layers) -> Tuple[object, Optional[str]]:
    """Runs ``function()`` (a second run of ``layers``' calls) inside Keras's ``StatelessScope``,
    so the variable updates it makes are dropped (a BatchNormalization's moving statistics move
    once per forward pass, as without the second run), and says whether the run drew random
    numbers that differ from the first run's: a Keras ``SeedGenerator`` (a layer's, or Keras's
    global one) advanced by it, or one of TensorFlow's stateful random ops created by it.

    Returns:
        ``(what function returned, None)``, or ``(..., the name of what drew)`` when it drew.

    Examples:
        >>> keras = keras_module()
        >>> dense, drop = keras.layers.Dense(2, name="d"), keras.layers.Dropout(0.5, name="drop")
        >>> x = tf.ones((2, 3))
        >>> run_again_without_updates(lambda: dense(x), [dense])[1] is None
        True
        >>> run_again_without_updates(lambda: drop(x, training=True), [drop])[1]
        'drop'
    """
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    keras = keras_module()
    owners = {id(g.state): sub.name for layer in layers for sub in nested_layers(layer)
              for g in getattr(sub, "_seed_generators", ())}
    graph = current_graph()
    first = len(graph.get_operations()) if not tf.executing_eagerly() else None
    with keras.StatelessScope() as scope:
        result = function()
    drawn = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    if drawn is not None:
        owners.setdefault(id(drawn.state), "Keras's global seed generator")
    for key, owner in owners.items():
        if key in scope.state_mapping:
            return result, owner
    if first is not None:
        for op in graph.get_operations()[first:]:
            if op.type in STATEFUL_RANDOM_OP_TYPES:
                return result, op.name
    return result, None
