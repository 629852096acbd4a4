"""``lms_tf.partition``: where to cut a Keras model into pipeline stages so the largest stage needs the least memory.

Traces the model's training step once at one micro-batch (never runs it), reads each layer's
memory and time off the trace (:mod:`lms_tf.pipeline.profile`) and cuts the layers into
contiguous stages (:func:`lms_tf.pipeline.partition_layers`). ``lms-tf partition`` is the same on
the command line.

Examples:
    >>> import keras, lms_tf
    >>> model = keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(32, name=f"d{i}") for i in range(5)]
    ...                          + [keras.layers.Dense(4, activation="softmax", name="head")], name="mlp")
    >>> p = lms_tf.partition(model, stages=2, microbatches=4, batch_size=16)
    >>> len(p.stages), sum(len(s.layers) for s in p.stages), p.feasible
    (2, 6, True)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.policy import describe
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.cost.devices import DeviceSpec
from lms_tf.pipeline import Partition, check_arguments, partition_layers

#: The preset op times come from when no device is given.
DEFAULT_DEVICE = "v100-16gb-pcie3"


def partition(model, *, stages: int, microbatches: int, batch_size: int, schedule: str = "1f1b",
              devices: Union[None, str, DeviceSpec, Sequence[Union[str, DeviceSpec]]] = None,
              budget: Union[None, int, str] = None, rule: str = "memory", objective: str = "memory",
              optimizer=None, input_shape: Optional[Sequence[int]] = None, swap: bool = True,
              host_budget: Union[None, int, str] = None, recompute: bool = False,
              calibrate: bool = False) -> Partition:
    """Cuts ``model`` into ``stages`` pipeline stages balanced by predicted peak memory (mCAP).

    Args:
        model: A built Keras model (Sequential, Functional with branches and skips, subclassed).
        stages: How many pipeline stages.
        microbatches: Micro-batches per step; each stage's activations are counted per micro-batch in flight.
        batch_size: Samples per step, split into ``microbatches`` equal micro-batches.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        devices: A device preset (``lms-tf version --devices`` lists them) for every stage, or one per
            stage; None balances bytes alone for the devices this process has (op times then come
            from ``v100-16gb-pcie3``; kernel scratch is that of this process's kernels: Eigen's
            or oneDNN's on a CPU).
        budget: Bytes (or ``"12GiB"``) no stage may exceed.
        rule: ``"memory"`` (default), or DeepSpeed's ``"parameters"`` / ``"uniform"`` for comparison.
        objective: ``"memory"``, or ``"time"``: the fastest cut whose stages fit their devices and the budget.
        optimizer: For a model that is not compiled: the optimizer whose slots are counted (default SGD).
            A compiled model's own step and optimizer are used.
        input_shape: One sample's shape, for a subclassed model built without an ``Input``.
        swap: Whether a stage that does not fit its device may swap activations to the host (just
            the bytes over; at least two layers' kept activations stay). Only when no cut fits
            without it; ``False`` never swaps.
        host_budget: Host memory one stage's process may take for what it swaps (bytes or
            ``"64GiB"``); None: this machine's physical memory.
        recompute: Whether a stage that does not fit may keep only what it receives and run its
            forward pass again in each backward task (GPipe's re-materialization); where both
            fit a stage, the one with less time is taken. ``PipelineStep(partition,
            recompute=True)`` runs those stages so.
        calibrate: Whether to calibrate the profile on this process's device (mCAP's two runs):
            a copy of the model (``model`` is not changed) runs a step under TensorFlow's profiler,
            and every op's time is scaled per op class by the measured kernels; then it trains
            twice as one stage, with one and with two micro-batches in flight, and every stage is
            raised to cover what the allocator really held (never lowered:
            :mod:`lms_tf.pipeline.calibration`). The device is this process's first GPU, else its
            CPU (set ``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts); so with
            ``devices=`` presets it needs a GPU here. Sequential and Functional models only.

    Returns:
        The :class:`~lms_tf.pipeline.Partition`: print it, or ``to_json()`` it.

    Raises:
        LMSOptionError: A bad argument (checked before the model is traced), or more stages than layers.
        LMSError: ``calibrate`` and the allocator keeps no statistics (checked before tracing).
        InfeasibleBudgetError: ``budget`` was given and no cut meets it (the message names the least it can be).

    Examples:
        >>> import keras, lms_tf
        >>> lms_tf.partition(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), stages=1, microbatches=3,
        ...                  batch_size=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: batch_size=4 does not split into 3 equal micro-batches...
    """
    check_arguments(stages=stages, microbatches=microbatches, schedule=schedule, rule=rule, objective=objective,
                    devices=devices, budget=budget, swap=swap, host_budget=host_budget)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise LMSOptionError(f"batch_size must be a positive int; received {describe(batch_size)}.")
    if batch_size % microbatches:
        raise LMSOptionError(f"batch_size={batch_size} does not split into {microbatches} equal micro-batches; pass a "
                             f"batch_size divisible by microbatches (e.g. {batch_size // microbatches * microbatches or microbatches}).")
    if not isinstance(calibrate, bool):
        raise LMSOptionError(f"calibrate must be True or False; received {describe(calibrate)}.")
    from lms_tf.tf.pipeline import check_calibration, local_kernel_library, profile_for_partition, trace_step

    calibration_device = check_calibration(model, devices) if calibrate else None
    first = devices if isinstance(devices, (str, DeviceSpec)) else (devices[0] if devices else DEFAULT_DEVICE)
    cost = CostModel(first if isinstance(first, DeviceSpec) else get_device_spec(first))
    traced = trace_step(model, microbatch=batch_size // microbatches, optimizer=optimizer, input_shape=input_shape,
                        kernels="cudnn" if devices else local_kernel_library())
    profile, calibration = profile_for_partition(model, traced, cost, calibrate_on=calibration_device,
                                                 optimizer=optimizer)
    result = partition_layers(profile, stages=stages, microbatches=microbatches, schedule=schedule, devices=devices,
                              budget=budget, rule=rule, objective=objective, model=model.name, swap=swap,
                              host_budget=host_budget, recompute=recompute)
    return dataclasses.replace(result, calibration=calibration) if calibration else result
