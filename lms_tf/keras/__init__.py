"""Keras front-end: :class:`LMSCallback` for ``model.fit``, and :class:`DistributedCallback` for Horovod.

Examples:
    >>> from lms_tf.keras import DistributedCallback, LMSCallback
"""

from lms_tf.keras.callback import LMSCallback
from lms_tf.keras.distributed import DistributedCallback

__all__ = ["DistributedCallback", "LMSCallback"]
