"""Standard training workloads for the CLI and benchmarks: a model by name, a batch, a train step.

Examples:
    >>> from lms_tf.tf.workloads import build_model
    >>> build_model("MobileNetV2", image_size=32, classes=10).name
    'mobilenetv2_1.00_32'
"""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Callable, Optional, Tuple

import numpy as np
import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError


def unet(image_size: int = 128, classes: int = 2, base_filters: int = 16, depth: int = 4):
    """A U-Net for segmentation (Ronneberger et al. 2015): conv blocks, skips across the bottleneck.

    Examples:
        >>> unet(image_size=32, depth=2).output_shape
        (None, 32, 32, 2)
    """
    keras = _compat.keras_module()
    layers = keras.layers
    inputs = keras.Input((image_size, image_size, 3))
    x, skips = inputs, []
    for level in range(depth):
        filters = base_filters * 2 ** level
        x = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"down{level}_conv1")(x)
        x = layers.BatchNormalization(name=f"down{level}_bn")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"down{level}_conv2")(x)
        skips.append(x)
        x = layers.MaxPooling2D(name=f"down{level}_pool")(x)
    x = layers.Conv2D(base_filters * 2 ** depth, 3, padding="same", activation="relu", name="bottleneck")(x)
    for level in reversed(range(depth)):
        filters = base_filters * 2 ** level
        x = layers.Conv2DTranspose(filters, 2, strides=2, padding="same", name=f"up{level}_deconv")(x)
        x = layers.Concatenate(name=f"up{level}_concat")([x, skips[level]])
        x = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"up{level}_conv1")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"up{level}_conv2")(x)
    outputs = layers.Conv2D(classes, 1, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs, name="unet")


def transformer_encoder(seq_len: int = 128, vocab: int = 1000, dim: int = 256, heads: int = 4, blocks: int = 4,
                        classes: int = 10):
    """A Transformer encoder classifier: embedding, ``MultiHeadAttention`` + MLP blocks, pooled head.

    Examples:
        >>> transformer_encoder(seq_len=16, dim=32, blocks=1).output_shape
        (None, 10)
    """
    keras = _compat.keras_module()
    layers = keras.layers
    inputs = keras.Input((seq_len,), dtype="int32")
    x = layers.Embedding(vocab, dim, name="embedding")(inputs)
    for block in range(blocks):
        attention = layers.MultiHeadAttention(heads, dim // heads, name=f"block{block}_attention")(x, x)
        x = layers.LayerNormalization(name=f"block{block}_norm1")(x + attention)
        hidden = layers.Dense(4 * dim, activation="gelu", name=f"block{block}_mlp1")(x)
        x = layers.LayerNormalization(name=f"block{block}_norm2")(x + layers.Dense(dim, name=f"block{block}_mlp2")(hidden))
    outputs = layers.Dense(classes, activation="softmax", name="head")(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, outputs, name="transformer_encoder")


def decoder_lm(width: int = 256, depth: int = 2, seq_len: int = 128, vocab: int = 1000, head_size: int = 64):
    """A decoder-only Transformer language model (GPT-style), the family ``lms-tf max-params`` scales.

    Token embedding whose matrix is also the output projection (tied), then ``depth`` pre-norm
    blocks: causal ``MultiHeadAttention`` with ``width // head_size`` heads of ``head_size``, and
    a ``4 * width`` GELU MLP, each added to the residual stream; a final LayerNorm; a softmax over
    the vocabulary at every position (sparse labels shaped ``(batch, seq_len)``). Every layer is
    named, so two models of the same depth trace to graphs with the same op names at any width.

    Args:
        width: Model width (a multiple of ``head_size``).
        depth: Number of blocks.
        seq_len: Tokens per sample.
        vocab: Vocabulary size.
        head_size: Width of one attention head.

    Raises:
        LMSOptionError: ``width`` is not a positive multiple of ``head_size``.

    Examples:
        >>> model = decoder_lm(width=64, depth=1, seq_len=8, vocab=50, head_size=32)
        >>> model.output_shape, model.count_params()
        ((None, 8, 50), 53312)
    """
    if width <= 0 or width % head_size:
        raise LMSOptionError(f"decoder_lm: width must be a positive multiple of head_size={head_size}; "
                             f"received width={width}. Pick a width such as {max(1, width // head_size) * head_size}.")
    keras = _compat.keras_module()
    layers = keras.layers
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    embedding = layers.Embedding(vocab, width, name="embedding")
    x = embedding(tokens)
    for block in range(depth):
        h = layers.LayerNormalization(name=f"block{block}_norm1")(x)
        h = layers.MultiHeadAttention(width // head_size, head_size, name=f"block{block}_attention")(
            h, h, use_causal_mask=True)
        x = layers.Add(name=f"block{block}_add1")([x, h])
        h = layers.LayerNormalization(name=f"block{block}_norm2")(x)
        h = layers.Dense(4 * width, activation="gelu", name=f"block{block}_mlp1")(h)
        x = layers.Add(name=f"block{block}_add2")([x, layers.Dense(width, name=f"block{block}_mlp2")(h)])
    x = layers.LayerNormalization(name="final_norm")(x)
    # The output projection is the embedding matrix, transposed (tied weights, as GPT-2).
    logits = layers.Lambda(lambda t: keras.ops.matmul(t, keras.ops.transpose(embedding.embeddings)),
                           name="tied_output")(x)
    return keras.Model(tokens, layers.Activation("softmax", name="softmax")(logits), name="decoder_lm")


def decoder_lm_params(width: int, depth: int, vocab: int) -> int:
    """The trainable parameters of :func:`decoder_lm`, by arithmetic (no model built): the
    embedding (also the output projection), per block two LayerNorms, four ``width x width``
    attention projections and the ``width x 4 width`` MLP with their biases, a final LayerNorm.

    Examples:
        >>> decoder_lm_params(64, 1, 50) == decoder_lm(width=64, depth=1, seq_len=8, vocab=50, head_size=32).count_params()
        True
    """
    return vocab * width + depth * (12 * width * width + 13 * width) + 2 * width


def stacked_rnn(seq_len: int = 100, vocab: int = 1000, dim: int = 64, units: int = 128, classes: int = 10):
    """A stacked recurrent classifier: embedding, bidirectional GRU, LSTM and GRU, all returning sequences.

    On a CPU (and on a GPU when cuDNN's conditions are not met) each recurrent layer is a
    ``While`` loop whose gradient reads the per-step values the forward loop accumulated.

    Examples:
        >>> stacked_rnn(seq_len=8, dim=8, units=8).output_shape
        (None, 10)
    """
    keras = _compat.keras_module()
    layers = keras.layers
    inputs = keras.Input((seq_len,), dtype="int32")
    x = layers.Embedding(vocab, dim, name="embedding")(inputs)
    x = layers.Bidirectional(layers.GRU(units // 2, return_sequences=True), name="bigru")(x)
    x = layers.LSTM(units, return_sequences=True, name="lstm")(x)
    x = layers.GRU(units, return_sequences=True, name="gru")(x)
    outputs = layers.Dense(classes, activation="softmax", name="head")(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, outputs, name="stacked_rnn")


#: Built-in workloads beside ``keras.applications`` (name -> builder taking image_size, classes).
BUILTIN_MODELS = {
    "UNet": lambda image_size, classes: unet(image_size=image_size, classes=min(classes, 16)),
    "TransformerEncoder": lambda image_size, classes: transformer_encoder(seq_len=image_size, classes=classes),
    "StackedRNN": lambda image_size, classes: stacked_rnn(seq_len=image_size, classes=classes),
}


def build_model(spec: str, *, image_size: int = 224, classes: int = 1000):
    """Builds an untrained model from a ``keras.applications`` name, a built-in workload, a ``.keras`` file or ``module:factory``.

    Built-in workloads: ``"UNet"`` (``image_size`` x ``image_size`` segmentation),
    ``"TransformerEncoder"`` and ``"StackedRNN"`` (``image_size`` is the sequence length).

    Args:
        spec: e.g. ``"ResNet50"``, ``"UNet"``, ``"model.keras"`` or ``"my_pkg.models:build"``.
        image_size: Input height and width for ``keras.applications`` models.
        classes: Number of classes for ``keras.applications`` models.

    Raises:
        LMSOptionError: The spec names nothing that can be built.

    Examples:
        >>> build_model("NoSuchNet")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: model 'NoSuchNet' is not a keras.applications name...
    """
    keras = _compat.keras_module()
    if spec.endswith(".keras") or spec.endswith(".h5"):
        if not os.path.exists(spec):
            raise LMSOptionError(f"model file {spec!r} does not exist.")
        return keras.models.load_model(spec, compile=False)
    if ":" in spec:
        module_name, _, factory = spec.partition(":")
        try:
            return getattr(importlib.import_module(module_name), factory)()
        except (ImportError, AttributeError) as err:
            raise LMSOptionError(f"model {spec!r}: cannot load {factory!r} from {module_name!r} ({err}).") from None
    # Names are matched without regard to case: "resnet50" is keras.applications.ResNet50.
    names = {n.lower(): n for n in dir(keras.applications) if n[0].isupper() and callable(getattr(keras.applications, n))}
    builtin = {n.lower(): n for n in BUILTIN_MODELS}
    if spec.lower() in builtin:
        return BUILTIN_MODELS[builtin[spec.lower()]](image_size, classes)
    if spec.lower() not in names:
        close = difflib.get_close_matches(spec.lower(), list(names) + list(builtin), n=3)
        hint = f" Did you mean {', '.join(names.get(c, builtin.get(c)) for c in close)}?" if close else ""
        raise LMSOptionError(
            f"model {spec!r} is not a keras.applications name, a built-in workload ({', '.join(BUILTIN_MODELS)}), "
            f"a .keras file or module:factory.{hint} Examples: {', '.join(sorted(names.values())[:8])} ...")
    constructor = getattr(keras.applications, names[spec.lower()])
    return constructor(weights=None, input_shape=(image_size, image_size, 3), classes=classes)


def step_specs(model, batch_size: Optional[int], input_shape=None,
               sparse: bool = True) -> Tuple[object, tf.TensorSpec]:
    """The specs a train step is traced with: the model's input (int32 token ids or float32; a list
    of specs, one per input, for a model with several) and its labels (sparse int32 class ids, or
    float32 shaped as the output with ``sparse=False``), ``batch_size`` samples (None: unknown).
    ``input_shape`` (one sample's) overrides the model's and is traced through its forward pass
    once for the output (a subclassed model has no ``Input``).

    Examples:
        >>> m = build_model("MobileNetV2", image_size=32, classes=10)
        >>> [spec.shape.as_list() for spec in step_specs(m, None)]
        [[None, 32, 32, 3], [None]]
    """
    if input_shape is None:
        specs = [tf.TensorSpec((batch_size,) + tuple(t.shape[1:]), "int32" if t.dtype in ("int32", "int64") else "float32")
                 for t in model.inputs]
        x = specs[0] if len(specs) == 1 else specs  # a model with several inputs takes a list
        output = (batch_size,) + tuple(model.output_shape[1:])
    else:
        x = tf.TensorSpec((batch_size,) + tuple(input_shape), "float32")
        output = tuple(tf.function(lambda t: model(t, training=False)).get_concrete_function(x).output_shapes)
    return x, tf.TensorSpec(output[:-1], "int32") if sparse else tf.TensorSpec(output)


def synthetic_batch(model, batch_size: int, seed: int = 0) -> Tuple[tf.Tensor, tf.Tensor]:
    """A deterministic random batch matching the model's input and class count.

    Examples:
        >>> m = build_model("MobileNetV2", image_size=32, classes=10)
        >>> [t.shape.as_list() for t in synthetic_batch(m, 2)]
        [[2, 32, 32, 3], [2]]
    """
    rng = np.random.RandomState(seed)
    shape = (batch_size,) + tuple(model.input_shape[1:])
    classes = int(model.output_shape[-1])
    if model.inputs[0].dtype in ("int32", "int64"):  # token ids
        x = rng.randint(0, 1000, shape).astype("int32")
    else:
        x = rng.rand(*shape).astype("float32")
    labels = (batch_size,) + tuple(model.output_shape[1:-1])  # per-pixel labels for segmentation
    return tf.constant(x), tf.constant(rng.randint(0, classes, labels).astype("int32"))


def train_step(model, optimizer=None) -> Callable:
    """A plain supervised train step (forward, loss, gradients, update) to wrap in a tf.function.

    Examples:
        >>> m = build_model("MobileNetV2", image_size=32, classes=10)
        >>> step = tf.function(train_step(m))
        >>> float(step(*synthetic_batch(m, 2))) > 0
        True
    """
    keras = _compat.keras_module()
    optimizer = optimizer or keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def compile_for_fit(model, optimizer=None) -> None:
    """Compiles ``model`` as the CLI's workloads train: SGD (or ``optimizer``), sparse categorical cross-entropy.

    Examples:
        >>> m = build_model("MobileNetV2", image_size=32, classes=10)
        >>> compile_for_fit(m); type(m.optimizer).__name__
        'SGD'
    """
    keras = _compat.keras_module()
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False))


def fit_step(model, *, inner: Optional[Callable] = None) -> Callable:
    """The step ``model.fit`` traces, as a function of one batch ``(x, y)`` to wrap in a tf.function.

    Runs the compiled model's own ``train_step`` (or ``inner``, a function wrapping it) under its
    distribution strategy, as Keras's train function does, so a plan made for this trace applies
    to ``model.fit`` with ``LMSCallback(plan=...)``.

    Examples:
        >>> m = build_model("MobileNetV2", image_size=32, classes=10)
        >>> compile_for_fit(m)
        >>> step = tf.function(fit_step(m))
        >>> sorted(step(synthetic_batch(m, 2)))
        ['loss']
    """
    run = inner or model.train_step

    @tf.autograph.experimental.do_not_convert
    def step(data):
        return model.distribute_strategy.run(run, args=(data,))

    return step
