"""Where variables live and how many bytes they take there (Keras 3 and TF variables alike).

Examples:
    >>> import tensorflow as tf
    >>> with tf.device("/CPU:0"):
    ...     v = tf.Variable(tf.zeros((4,)))
    >>> variable_bytes_by_device([v])
    {'/job:localhost/replica:0/task:0/device:CPU:0': 16}
"""

from __future__ import annotations

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
