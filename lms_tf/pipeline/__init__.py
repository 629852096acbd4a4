"""Pipeline partitioning by memory: per-layer memory and time read off the step (no profiling run),
and contiguous stages that minimise the largest stage's predicted peak (mCAP / CAPSlog).

No TensorFlow here: :func:`profile_layers` reads an IR, :func:`partition_layers` cuts a profile.
``lms_tf.partition(model, ...)`` and ``lms-tf partition`` trace a Keras model and call both.

Examples:
    >>> from lms_tf.pipeline import PipelineProfile, partition_layers
    >>> p = partition_layers(PipelineProfile.chain([100] * 6), stages=3, microbatches=4)
    >>> [len(s.layers) for s in p.stages], [s.in_flight for s in p.stages]   # 300, 300 + 200, 300 + 100 B
    ([1, 2, 3], [3, 2, 1])
"""

from lms_tf.pipeline.calibration import Calibration
from lms_tf.pipeline.partition import (
    OBJECTIVES,
    RULES,
    SCHEDULES,
    Partition,
    Stage,
    check_arguments,
    evaluate,
    exhaustive_partition,
    in_flight,
    partition_layers,
    received_ahead,
    recompute_peak,
    stage_peak,
)
from lms_tf.pipeline.profile import LayerProfile, PipelineProfile, layer_keys, profile_layers
from lms_tf.pipeline.schedule import Task, max_in_flight, run_order, stage_tasks

__all__ = ["OBJECTIVES", "RULES", "SCHEDULES", "Calibration", "LayerProfile", "Partition", "PipelineProfile", "Stage", "check_arguments", "evaluate",
           "exhaustive_partition", "in_flight", "layer_keys", "max_in_flight", "partition_layers", "profile_layers",
           "received_ahead", "recompute_peak", "run_order", "stage_peak", "stage_tasks", "Task"]
