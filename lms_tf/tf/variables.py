"""Where variables live and how many bytes they take there (Keras 3 and TF variables alike).

Examples:
    >>> import tensorflow as tf
    >>> with tf.device("/CPU:0"):
    ...     v = tf.Variable(tf.zeros((4,)))
    >>> variable_bytes_by_device([v])
    {'/job:localhost/replica:0/task:0/device:CPU:0': 16}
"""

from __future__ import annotations

import contextlib
from typing import Dict

import numpy as np
import tensorflow as tf


def variable_device(variable) -> str:
    """The device of a TF variable, or of the TF variable behind a Keras 3 variable (``.value``).

    Examples:
        >>> with tf.device("/CPU:0"):
        ...     v = tf.Variable(1.0)
        >>> variable_device(v)
        '/job:localhost/replica:0/task:0/device:CPU:0'
    """
    device = getattr(variable, "device", None)
    if device is None:
        device = getattr(getattr(variable, "value", None), "device", None)
    return device or ""


def variable_bytes_by_device(variables) -> Dict[str, int]:
    """Bytes of ``variables`` per device they live on (full device names).

    Examples:
        >>> with tf.device("/CPU:0"):
        ...     v = tf.Variable(tf.zeros((4,)))
        >>> variable_bytes_by_device([v])
        {'/job:localhost/replica:0/task:0/device:CPU:0': 16}
    """
    totals: Dict[str, int] = {}
    for variable in variables:
        # Keras 3 variables give shape as a tuple and dtype as a string; tf.Variable as TF types.
        nbytes = int(np.prod(tuple(variable.shape), dtype=np.int64)) * tf.as_dtype(variable.dtype).size
        device = variable_device(variable)
        totals[device] = totals.get(device, 0) + nbytes
    return totals


def place_weights(model, optimizer=None, host: str = "/CPU:0") -> int:
    """Moves a Keras model's variables (its metrics', and its optimizer's when built) to ``host`` memory, for
    ``weights="host"``: each is then copied to the device per window of the layers that read it.

    ``LMSCallback(weights="host")`` calls it at the start of ``fit``; a custom loop with
    ``lms_tf.function(weights="host")`` calls it before the first step. Functions traced before
    (``predict``, ``evaluate``) are traced again, since they captured the old variables.

    Args:
        model: A Keras model (or layer).
        optimizer: Its optimizer (default: ``model.optimizer`` when the model is compiled).
        host: The host device.

    Returns:
        How many variables moved.

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> place_weights(model, host="/CPU:1"), sorted({variable_device(v)[-5:] for v in model.variables})
        (2, ['CPU:1'])
    """
    from lms_tf import _compat

    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    # The compiled metrics' variables too: the train step reads them on the device like weights.
    variables = list(model.variables) + list(getattr(model, "metrics_variables", None) or []) \
        + (list(optimizer.variables) if optimizer is not None else [])
    moved = _compat.move_variables(variables, host)
    if optimizer is not None:
        _compat.rekey_optimizer(optimizer)
    for cached in ("train_function", "test_function", "predict_function"):
        if getattr(model, cached, None) is not None:
            setattr(model, cached, None)
    return moved


@contextlib.contextmanager
def variables_created_on(device: str):
    """Variables created inside (a layer built on its first call, an optimizer's slots, a compiled
    metric's totals, all during the first traced step) are created on ``device``: with
    ``weights="host"``, those :func:`place_weights` could not move yet.

    Examples:
        >>> with variables_created_on("/CPU:0"):
        ...     v = tf.Variable(1.0)
        >>> variable_device(v).endswith("CPU:0")
        True
    """
    def creator(next_creator, **kwargs):
        with tf.device(device):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield
