"""lms-tf: Large Model Support for TensorFlow / Keras 3 (tested on TensorFlow 2.20 and 2.21 with Keras 3.15).

Rewrites the traced training step to swap activations to host memory and back,
so a model trains with more memory than the accelerator has.

Examples:
    >>> import lms_tf
    >>> callback = lms_tf.LMSCallback()            # for model.fit
    >>> @lms_tf.function(swapin_ahead=4)            # for custom training loops
    ... def train_step(x, y):
    ...     ...
"""

import importlib

from lms_tf.core.errors import (
    GraphAnalysisError,
    HostBudgetError,
    InfeasibleBudgetError,
    LMSError,
    LMSOptionError,
    LMSWarning,
    RewriteError,
)
from lms_tf.core.plan import Decision, Plan
from lms_tf.core.policy import Policies

# The front-ends import TensorFlow; they load on first use, so `import lms_tf` (and the CLI's
# --help, and the planning core) stay free of it.
_LAZY = {"LMSFunction": "lms_tf.decorator", "function": "lms_tf.decorator", "LMSCallback": "lms_tf.keras",
         "PeakMemory": "lms_tf.tf.memory", "measure_peak_memory": "lms_tf.tf.memory", "LMSOptions": "lms_tf.options",
         "partition": "lms_tf.partitioning", "PipelineStep": "lms_tf.tf.pipeline_step",
         "accumulation_step": "lms_tf.tf.pipeline_step", "place_stages": "lms_tf.tf.pipeline_step",
         "place_weights": "lms_tf.tf.variables",
         "connect_stages": "lms_tf.tf.pipeline_cluster"}


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


#: Subpackages loaded on first use the same way (``lms_tf.parallel.hybridize(...)``).
_LAZY_MODULES = {"parallel": "lms_tf.parallel"}


def __getattr__(name):
    if name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lms_tf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__version__ = "0.1.0"


def explain(obj) -> str:
    """The latest plan of an :class:`LMSFunction` or :class:`LMSCallback`, as a printable table.

    Args:
        obj: An ``lms_tf.function`` or an ``LMSCallback`` (after training), or a Plan.

    Returns:
        What was swapped (tensor, shape, MiB, trigger) and why the rest was kept.

    Raises:
        LMSError: ``obj`` has no plan yet (it was never traced) or is of the wrong type.

    Examples:
        >>> import tensorflow as tf, lms_tf
        >>> f = lms_tf.function(lambda x: x * 2.0, device="/CPU:0", host="/CPU:1")
        >>> _ = f(tf.constant(1.0))
        >>> print(explain(f))
        lms-tf: swapped 0 of 0 candidate tensors (0.00 MiB of 0.00 MiB) with 0 swap-ins, device /device:CPU:0 -> host /device:CPU:1
    """
    if isinstance(obj, Plan):
        return obj.summary()
    from lms_tf.decorator import LMSFunction
    from lms_tf.keras import LMSCallback


    if not isinstance(obj, (LMSFunction, LMSCallback)):
        raise LMSError(f"explain() takes an lms_tf.function, an LMSCallback or a Plan; received "
                       f"{type(obj).__name__}.")
    if obj.plan is None:
        raise LMSError(f"this {type(obj).__name__} has no plan yet: call it (or train with it) first. If it was called, the "
                       f"step was left untouched because no accelerator was found (see the warning).")
    return obj.plan.summary()


__all__ = ["Decision", "GraphAnalysisError", "HostBudgetError", "InfeasibleBudgetError", "LMSCallback", "LMSError", "LMSFunction",
           "LMSOptionError", "LMSOptions", "LMSWarning", "PeakMemory", "PipelineStep", "Plan", "Policies", "RewriteError",
           "accumulation_step", "place_stages", "place_weights", "connect_stages", "explain", "function", "measure_peak_memory", "partition", "__version__"]
