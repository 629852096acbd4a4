"""A Keras model's per-layer profile for pipeline partitioning: its training step traced at one micro-batch.

The step is traced once, never run (:func:`~lms_tf.tf.trace.trace_step_ir`), and its ops are
grouped into the model's top-level layers by their name scopes; the memory and times come from
the IR and the cost model (:mod:`lms_tf.pipeline.profile`).

Examples:
    >>> import keras
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="a"),
    ...                           keras.layers.Dense(4, activation="softmax", name="b")], name="mlp")
    >>> profile = trace_profile(model, microbatch=2, cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    >>> [(layer.name, layer.param_bytes) for layer in profile.layers]
    [('a', 576), ('b', 272)]
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError
from lms_tf.cost.model import CostModel
from lms_tf.pipeline.profile import PipelineProfile, profile_layers
from lms_tf.simulate import check_kernel_library
from lms_tf.tf.trace import trace_step_ir

logger = logging.getLogger("lms_tf")


def trace_profile(model, *, microbatch: int, cost: CostModel, optimizer=None,
                  input_shape: Optional[Sequence[int]] = None, kernels: str = "cudnn") -> PipelineProfile:
    """Traces ``model``'s training step at ``microbatch`` samples and profiles its layers.

    The step is the model's own ``train_step`` when it is compiled with a loss (what
    ``model.fit`` runs), else a plain step with sparse categorical cross-entropy (as ``lms-tf
    plan`` traces) and ``optimizer`` (default SGD).

    Args:
        model: A built Keras model (Sequential, Functional with one input or several, or subclassed).
        microbatch: Samples per micro-batch.
        cost: The cost model of the device planned for.
        optimizer: The optimizer of the uncompiled step (its slots count as memory per weight).
        input_shape: One sample's shape, for a subclassed model that has no ``Input``.
        kernels: The kernel library whose scratch the layers' working sets include
            (:func:`local_kernel_library` names this process's).

    Returns:
        The :class:`~lms_tf.pipeline.profile.PipelineProfile`.

    Raises:
        LMSOptionError: The model's input shape is unknown.

    Examples:
        >>> trace_profile.__name__
        'trace_profile'
    """
    from lms_tf.tf.workloads import fit_step, step_specs, train_step

    check_kernel_library(kernels)

    inputs = getattr(model, "inputs", None)
    if input_shape is None and not inputs:
        raise LMSOptionError(f"the input shape of {model.name!r} is unknown (a subclassed model has no Input): pass "
                             f"input_shape=, one sample's shape, e.g. input_shape=(224, 224, 3).")
    compiled = getattr(model, "optimizer", None) is not None and getattr(model, "loss", None) is not None
    x, y = step_specs(model, microbatch, input_shape, sparse=not compiled or "sparse" in str(model.loss).lower())
    started = time.perf_counter()
    if compiled:
        ir = trace_step_ir(model.train_step, (x, y), wrap=lambda inner: fit_step(model, inner=inner))
    else:
        ir = trace_step_ir(train_step(model, optimizer), x, y)
    logger.info("traced %s's training step at %d samples (%d ops) in %.1f s", model.name, microbatch, len(ir.ops),
                time.perf_counter() - started)
    aliases = _compat.layer_scope_aliases_in(model, (op.name for op in ir.ops))
    top = {layer.name for layer in model.layers}
    return profile_layers(ir, cost, layer_scopes={k: v for k, v in aliases.items() if k in top}, microbatch=microbatch,
                          kernels=kernels)


def local_kernel_library() -> str:
    """The kernel library this process runs a step with: ``"cudnn"`` when it sees a GPU, else its
    CPU's (``"eigen"`` with ``TF_ENABLE_ONEDNN_OPTS=0``, ``"onednn"`` otherwise).

    Examples:
        >>> local_kernel_library() in ("cudnn", "eigen", "onednn")
        True
    """
    import tensorflow as tf

    from lms_tf.tf.diagnostics import cpu_kernel_library

    return "cudnn" if tf.config.list_logical_devices("GPU") else cpu_kernel_library()
