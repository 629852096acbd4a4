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

import dataclasses
import logging
import time
from typing import Dict, Optional, Sequence

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import GraphIR
from lms_tf.cost.model import CostModel
from lms_tf.pipeline.calibration import CALIBRATION_IN_FLIGHT, Calibration
from lms_tf.pipeline.profile import PipelineProfile, profile_layers
from lms_tf.simulate import check_kernel_library
from lms_tf.tf.trace import trace_step_ir

logger = logging.getLogger("lms_tf")


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A model's training step traced at one micro-batch, ready to be profiled with any cost model
    (so calibrating op times needs no second trace).

    Attributes:
        ir: The step's IR.
        layer_scopes: Each top-level layer's name scope in the trace.
        microbatch: Samples the step was traced at.
        kernels: The kernel library whose scratch the layers' working sets include.

    Examples:
        >>> TracedStep.profile.__name__
        'profile'
    """

    ir: GraphIR
    layer_scopes: Dict[str, str]
    microbatch: int
    kernels: str

    def profile(self, cost: CostModel) -> PipelineProfile:
        """The per-layer profile with op times from ``cost``.

        Examples:
            >>> TracedStep.profile.__doc__.split(".")[0]
            'The per-layer profile with op times from ``cost``'
        """
        return profile_layers(self.ir, cost, layer_scopes=self.layer_scopes, microbatch=self.microbatch,
                              kernels=self.kernels)


def trace_step(model, *, microbatch: int, optimizer=None, input_shape: Optional[Sequence[int]] = None,
               kernels: str = "cudnn") -> TracedStep:
    """Traces ``model``'s training step at ``microbatch`` samples (never runs it).

    The step is the model's own ``train_step`` when it is compiled with a loss (what
    ``model.fit`` runs), else a plain step with sparse categorical cross-entropy (as ``lms-tf
    plan`` traces) and ``optimizer`` (default SGD).

    Args:
        model: A built Keras model (Sequential, Functional with one input or several, or subclassed).
        microbatch: Samples per micro-batch.
        optimizer: The optimizer of the uncompiled step (its slots count as memory per weight).
        input_shape: One sample's shape, for a subclassed model that has no ``Input``.
        kernels: The kernel library whose scratch the layers' working sets include
            (:func:`local_kernel_library` names this process's).

    Returns:
        The :class:`TracedStep`.

    Raises:
        LMSOptionError: The model's input shape is unknown.

    Examples:
        >>> trace_step.__name__
        'trace_step'
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
    return TracedStep(ir, {k: v for k, v in aliases.items() if k in top}, microbatch, kernels)


def trace_profile(model, *, microbatch: int, cost: CostModel, optimizer=None,
                  input_shape: Optional[Sequence[int]] = None, kernels: str = "cudnn") -> PipelineProfile:
    """Traces ``model``'s training step at ``microbatch`` samples and profiles its layers
    (:func:`trace_step`, then :meth:`TracedStep.profile`).

    Args:
        model: A built Keras model (see :func:`trace_step`).
        microbatch: Samples per micro-batch.
        cost: The cost model of the device planned for (op times).
        optimizer: The optimizer of an uncompiled step.
        input_shape: One sample's shape, for a subclassed model that has no ``Input``.
        kernels: The kernel library whose scratch the working sets include.

    Returns:
        The :class:`~lms_tf.pipeline.profile.PipelineProfile`.

    Raises:
        LMSOptionError: The model's input shape is unknown.

    Examples:
        >>> trace_profile.__name__
        'trace_profile'
    """
    return trace_step(model, microbatch=microbatch, optimizer=optimizer, input_shape=input_shape,
                      kernels=kernels).profile(cost)


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


def check_calibration(model, devices=None) -> str:
    """Checks, before any slow work, that :func:`measure_calibration` can run here; returns the device
    it reads.

    Args:
        model: The model to calibrate.
        devices: The presets the partition is for (None: this machine's own device).

    Raises:
        LMSOptionError: ``model`` is subclassed (the calibration trains it as a pipeline stage), or
            ``devices`` names presets while this process has no GPU (a CPU's allocator says nothing
            about them).
        LMSError: The device's allocator keeps no statistics (on the CPU:
            ``TF_CPU_ALLOCATOR_USE_BFC=true`` was not set before TensorFlow started).

    Examples:
        >>> import keras
        >>> check_calibration(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])) in ("CPU:0", "GPU:0")
        True
    """
    from lms_tf.tf.memory import default_device, measure_peak_memory

    if _compat.functional_graph(model) is None:
        raise LMSOptionError(f"calibrate=True trains {getattr(model, 'name', 'the model')!r} as one pipeline stage, "
                             f"which needs a Sequential or Functional model; received a subclassed "
                             f"{type(model).__name__}. Partition it without calibrate.")
    device = default_device()
    if devices is not None and device.startswith("CPU"):
        raise LMSOptionError(f"calibrate=True reads this process's allocator, and this process has no GPU, so it "
                             f"cannot calibrate for devices={devices!r}; calibrate on a machine with that GPU, or "
                             f"drop devices= to partition for this machine's CPU.")
    with measure_peak_memory(device):  # the library's error, saying how to turn statistics on
        pass
    return device


def _trained_copy(model, whole, device: str, optimizer, batch: int, sparse: Optional[bool] = None):
    """A copy of ``model`` on ``device`` to train instead of it (``place_stages``), the optimizer to
    train it with (a new one of ``optimizer``'s configuration for an uncompiled model; None: the
    copy's own, or SGD), and a batch of zeros of ``batch`` samples (class ids as labels when
    ``sparse``; None: as the model's loss takes them)."""
    import tensorflow as tf

    from lms_tf.tf.pipeline_step import place_stages
    from lms_tf.tf.workloads import step_specs

    compiled = getattr(model, "optimizer", None) is not None and getattr(model, "loss", None) is not None
    placed = place_stages(model, whole, [device])
    own = None if compiled or optimizer is None else optimizer.__class__.from_config(optimizer.get_config())
    if sparse is None:
        sparse = not compiled or "sparse" in str(model.loss).lower()
    x_spec, y_spec = step_specs(placed, batch, sparse=sparse)
    x = [tf.zeros(s.shape, s.dtype) for s in x_spec] if isinstance(x_spec, list) else tf.zeros(x_spec.shape, x_spec.dtype)
    return placed, own, (x, tf.zeros(y_spec.shape, y_spec.dtype))


def calibrated_cost(model, profile: PipelineProfile, cost: CostModel, *, microbatch: int,
                    device: Optional[str] = None, optimizer=None, steps: int = 3) -> CostModel:
    """``cost`` scaled per op class by measured kernel times (:meth:`~lms_tf.cost.CostModel.calibrate`):
    a copy of ``model`` runs a plain training step at one micro-batch on ``device`` under
    TensorFlow's profiler, ``steps`` times after two warm-ups; ``model`` is not changed.

    Args:
        model: A built Sequential or Functional Keras model.
        profile: Its per-layer profile (which layers to copy).
        cost: The cost model to scale.
        microbatch: Samples per micro-batch.
        device: Where the copy runs; default: the first GPU, else ``"CPU:0"``.
        optimizer: For a model that is not compiled, the optimizer of its step (a copy runs).
        steps: Steps profiled (each op's median is taken).

    Returns:
        The scaled :class:`~lms_tf.cost.CostModel`.

    Examples:
        >>> calibrated_cost.__name__
        'calibrated_cost'
    """
    import tensorflow as tf

    from lms_tf.pipeline.partition import partition_layers
    from lms_tf.tf.diagnostics import measured_op_seconds
    from lms_tf.tf.memory import default_device
    from lms_tf.tf.trace import build_ir
    from lms_tf.tf.workloads import train_step

    device = device or default_device()
    started = time.perf_counter()
    # (the plain step's loss is sparse categorical cross-entropy, whatever the model was compiled with:
    # the op classes, not the loss's few ops, are what is measured)
    placed, own, (x, y) = _trained_copy(model, partition_layers(profile, stages=1, microbatches=1), device,
                                        optimizer, microbatch, sparse=True)
    with tf.device(device):
        step = tf.function(train_step(placed, own or getattr(placed, "optimizer", None)))
        ir = build_ir(step.get_concrete_function(x, y).graph)
        for _ in range(2):
            step(x, y).numpy()
        seconds = measured_op_seconds(lambda: step(x, y).numpy(), (op.name for op in ir.ops), steps=steps)
    scaled = cost.calibrate(ir, seconds)
    logger.info("calibration: %s's op times measured on %s (%d of %d ops matched, %.1f s): per op class, measured "
                "over predicted %s", model.name, device, len(seconds), len(ir.ops), time.perf_counter() - started,
                ", ".join(f"{kind} x{factor:.3g}" for kind, factor in sorted(scaled.scale.items())))
    return scaled


def whole_model_peak(model, profile: PipelineProfile, *, microbatch: int, microbatches: int,
                     schedule: str = "gpipe", device: Optional[str] = None, optimizer=None) -> int:
    """The real allocator peak of ``model`` trained as one pipeline stage, weights and slots included.

    Trains a copy of the model (:func:`~lms_tf.tf.pipeline_step.place_stages`, with a new
    optimizer of the same configuration) on zeros, its ops serialized in the schedule's order, so
    the peak follows the order the per-layer model counts; ``model`` and ``optimizer`` are not
    changed. Two steps warm up (tracing, the optimizer's slots); the third is measured, and the
    copy's weights and slots, resident before it, are added. With GPipe all ``microbatches`` are
    in flight at once; with 1F1B, one.

    Args:
        model: A built Sequential or Functional Keras model.
        profile: Its per-layer profile at ``microbatch`` samples (:func:`trace_profile`).
        microbatch: Samples per micro-batch.
        microbatches: Micro-batches per step.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        device: Whose allocator is read; default: the first GPU, else ``"CPU:0"`` (whose
            statistics need ``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts).
        optimizer: For a model that is not compiled, the optimizer whose slots are counted
            (default SGD); a copy is trained.

    Returns:
        Bytes.

    Raises:
        LMSError: The device's allocator keeps no statistics.

    Examples:
        >>> whole_model_peak.__name__
        'whole_model_peak'
    """
    import tensorflow as tf

    from lms_tf.core.ir import same_device
    from lms_tf.pipeline.partition import partition_layers
    from lms_tf.tf.memory import default_device, measure_peak_memory
    from lms_tf.tf.pipeline_step import PipelineStep
    from lms_tf.tf.variables import variable_bytes_by_device

    device = device or default_device()
    whole = partition_layers(profile, stages=1, microbatches=microbatches, schedule=schedule)
    placed, own, (x, y) = _trained_copy(model, whole, device, optimizer, microbatch * microbatches)
    step = PipelineStep(placed, whole, devices=[device], serialize=True, optimizer=own)
    with tf.device(device):
        for _ in range(2):
            step(x, y).numpy()
        with measure_peak_memory(device, settle_seconds=0.3) as memory:
            step(x, y).numpy()
    resident = variable_bytes_by_device(list(placed.weights) + list(step.optimizer.variables))
    return memory.peak_bytes + sum(b for where, b in resident.items() if same_device(where, device))


def measure_calibration(model, profile: PipelineProfile, *, microbatch: int, device: Optional[str] = None,
                        optimizer=None) -> Calibration:
    """Reads the real allocator peak of ``model`` trained as one stage with one and with two
    micro-batches in flight (mCAP's calibration, :mod:`lms_tf.pipeline.calibration`), by
    :func:`whole_model_peak`: two micro-batches a step both times, so gradients are accumulated as
    in any pipeline, 1F1B for one in flight (each backward pass before the next forward) and GPipe
    for two. ``model`` and ``optimizer`` are not changed.

    Args:
        model: A built Sequential or Functional Keras model.
        profile: Its per-layer profile at ``microbatch`` samples (:func:`trace_profile`).
        microbatch: Samples per micro-batch.
        device: Whose allocator is read (see :func:`whole_model_peak`).
        optimizer: For a model that is not compiled, the optimizer whose slots are counted.

    Returns:
        The :class:`~lms_tf.pipeline.calibration.Calibration`.

    Raises:
        LMSError: The device's allocator keeps no statistics.

    Examples:
        >>> measure_calibration.__name__
        'measure_calibration'
    """
    from lms_tf.tf.memory import default_device

    device = device or default_device()
    measured = []
    for flight in CALIBRATION_IN_FLIGHT:
        started = time.perf_counter()
        measured.append(whole_model_peak(model, profile, microbatch=microbatch, microbatches=2,
                                         schedule="1f1b" if flight == 1 else "gpipe", device=device,
                                         optimizer=optimizer))
        logger.info("calibration: %s as one stage, %d micro-batch(es) in flight: real peak %.1f MiB on %s (%.1f s)",
                    model.name, flight, measured[-1] / 2**20, device, time.perf_counter() - started)
    return Calibration.from_profile(profile, tuple(measured), device=device)


def calibrated_profile(model, traced: TracedStep, cost: CostModel, *, device: str,
                       optimizer=None) -> "tuple[PipelineProfile, Calibration]":
    """The profile of ``traced`` calibrated on this process's device: op times by measured kernel
    times (:func:`calibrated_cost`), memory by two real runs (:func:`measure_calibration`), both
    logged, with a warning when the runs resolve only bytes. What ``lms_tf.partition(calibrate=True)``
    and ``lms-tf partition --calibrate`` do after tracing.

    Args:
        model: The traced model (Sequential or Functional).
        traced: Its :class:`TracedStep`.
        cost: The cost model of the device planned for.
        device: This process's device whose allocator and kernels are read.
        optimizer: For a model that is not compiled, the optimizer of its step.

    Returns:
        The calibrated profile and the :class:`~lms_tf.pipeline.calibration.Calibration`.

    Examples:
        >>> calibrated_profile.__name__
        'calibrated_profile'
    """
    from lms_tf.core.policy import format_bytes
    from lms_tf.pipeline.calibration import RESOLVABLE_SHARE

    scaled = calibrated_cost(model, traced.profile(cost), cost, microbatch=traced.microbatch, device=device,
                             optimizer=optimizer)
    profile = traced.profile(scaled)
    calibration = dataclasses.replace(
        measure_calibration(model, profile, microbatch=traced.microbatch, device=device, optimizer=optimizer),
        op_time_scale=tuple(sorted(scaled.scale.items())))
    logger.info("%s", calibration.describe())
    if not calibration.resolves_activations:
        logger.warning("calibrate: one micro-batch's activations (%s by the per-layer model) are under %d%% of the "
                       "peak, less than the allocator's chunks move it, so the two runs calibrate the fixed part only",
                       format_bytes(calibration.predicted[1] - calibration.predicted[0]), round(100 * RESOLVABLE_SHARE))
    elif calibration.mcap_scale < 1:
        logger.info("calibrate: the two runs differ by %.2fx the activations the per-layer model counts per "
                    "micro-batch; activations are kept at the model's (a calibration raises figures, never lowers "
                    "them: the line through two runs can lie below larger runs)", calibration.mcap_scale)
    return calibration.apply(profile), calibration


def profile_for_partition(model, traced: TracedStep, cost: CostModel, *, calibrate_on: Optional[str] = None,
                          optimizer=None) -> "tuple[PipelineProfile, Optional[Calibration]]":
    """The profile a partition is cut by: ``traced`` with ``cost``'s op times, or with
    ``calibrate_on`` (a device, from :func:`check_calibration`) calibrated there
    (:func:`calibrated_profile`). What both ``lms_tf.partition`` and ``lms-tf partition`` call.

    Examples:
        >>> profile_for_partition.__name__
        'profile_for_partition'
    """
    if calibrate_on is None:
        return traced.profile(cost), None
    return calibrated_profile(model, traced, cost, device=calibrate_on, optimizer=optimizer)
