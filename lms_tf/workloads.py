"""Standard training workloads for the CLI and benchmarks: a model by name, a batch, a train step.

Example:
    >>> from lms_tf.workloads import build_model
    >>> build_model("MobileNetV2", image_size=32, classes=10).name
    'mobilenetv2_1.00_32'
"""

from __future__ import annotations

import importlib
import os
from typing import Callable, Tuple

import numpy as np
import tensorflow as tf

from lms_tf import _compat
from lms_tf.errors import LMSOptionError


def build_model(spec: str, *, image_size: int = 224, classes: int = 1000):
    """Builds an untrained model from a ``keras.applications`` name, a ``.keras`` file or ``module:factory``.

    Args:
        spec: e.g. ``"ResNet50"``, ``"model.keras"`` or ``"my_pkg.models:build"``.
        image_size: Input height and width for ``keras.applications`` models.
        classes: Number of classes for ``keras.applications`` models.

    Raises:
        LMSOptionError: The spec names nothing that can be built.

    Example:
        >>> build_model("NoSuchNet")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.errors.LMSOptionError: model 'NoSuchNet' is not a keras.applications name...
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
    constructor = getattr(keras.applications, spec, None)
    if constructor is None or not callable(constructor):
        names = sorted(n for n in dir(keras.applications) if n[0].isupper())
        raise LMSOptionError(
            f"model {spec!r} is not a keras.applications name, a .keras file or module:factory. "
            f"Examples: {', '.join(names[:8])} ...")
    return constructor(weights=None, input_shape=(image_size, image_size, 3), classes=classes)


def synthetic_batch(model, batch_size: int, seed: int = 0) -> Tuple[tf.Tensor, tf.Tensor]:
    """A deterministic random batch matching the model's input and class count.

    Example:
        >>> m = build_model("MobileNetV2", image_size=32, classes=10)
        >>> [t.shape.as_list() for t in synthetic_batch(m, 2)]
        [[2, 32, 32, 3], [2]]
    """
    rng = np.random.RandomState(seed)
    shape = (batch_size,) + tuple(model.input_shape[1:])
    classes = int(model.output_shape[-1])
    return (tf.constant(rng.rand(*shape).astype("float32")),
            tf.constant(rng.randint(0, classes, batch_size).astype("int32")))


def train_step(model, optimizer=None) -> Callable:
    """A plain supervised train step (forward, loss, gradients, update) to wrap in a tf.function.

    Example:
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
