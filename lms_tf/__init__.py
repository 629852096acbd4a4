"""lms-tf: Large Model Support for TensorFlow 2.16+ / Keras 3.

Rewrites the traced training step to swap activations to host memory and back,
so a model trains with more memory than the accelerator has.

Example:
    >>> import lms_tf
    >>> callback = lms_tf.LMSCallback()            # for model.fit
    >>> @lms_tf.function(swapin_ahead=4)            # for custom training loops
    ... def train_step(x, y):
    ...     ...
"""

from lms_tf.errors import GraphAnalysisError, LMSError, LMSOptionError, LMSWarning, RewriteError
from lms_tf.function import LMSFunction, function
from lms_tf.keras import LMSCallback
from lms_tf.memory import PeakMemory, measure_peak_memory
from lms_tf.options import LMSOptions
from lms_tf.planner import Decision, Plan

__version__ = "0.1.0"


def explain(obj) -> str:
    """The latest plan of an :class:`LMSFunction` or :class:`LMSCallback`, as a printable table.

    Args:
        obj: An ``lms_tf.function`` or an ``LMSCallback`` (after training), or a Plan.

    Returns:
        What was swapped (tensor, shape, MiB, trigger) and why the rest was kept.

    Raises:
        LMSError: ``obj`` has no plan yet (it was never traced) or is of the wrong type.

    Example:
        >>> import tensorflow as tf
        >>> f = function(lambda x: x * 2.0, device="/CPU:0", host="/CPU:1")
        >>> _ = f(tf.constant(1.0))
        >>> print(explain(f))
        lms-tf: swapped 0 of 0 candidate tensors (0.00 MiB of 0.00 MiB) with 0 swap-ins, device /device:CPU:0 -> host /device:CPU:1
    """
    if isinstance(obj, Plan):
        return obj.summary()
    if not isinstance(obj, (LMSFunction, LMSCallback)):
        raise LMSError(f"explain() takes an lms_tf.function, an LMSCallback or a Plan; received "
                       f"{type(obj).__name__}.")
    if obj.plan is None:
        raise LMSError(f"{obj!r} has no plan yet: call it (or train with it) first. If it was called, the "
                       f"step was left untouched because no accelerator was found (see the warning).")
    return obj.plan.summary()


__all__ = ["Decision", "GraphAnalysisError", "LMSCallback", "LMSError", "LMSFunction", "LMSOptionError",
           "LMSOptions", "LMSWarning", "PeakMemory", "Plan", "RewriteError", "explain", "function",
           "measure_peak_memory", "__version__"]
