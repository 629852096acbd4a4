"""Keras front-end: :class:`LMSCallback` for ``model.fit``.

Example:
    >>> from lms_tf.keras import LMSCallback
"""

from lms_tf.keras.callback import LMSCallback

__all__ = ["LMSCallback"]
