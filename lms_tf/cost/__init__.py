"""Layer 2: device presets and the cost model the planner and simulator use.

Examples:
    >>> from lms_tf.cost import PRESETS, get_device_spec, CostModel
    >>> "v100-16gb-pcie3" in PRESETS
    True
"""

from lms_tf.cost.devices import PRESETS, DeviceSpec, detect_device_spec, get_device_spec
from lms_tf.cost.model import AveragingCost, CostModel, OpCost, op_class, op_cost, step_compute_time

__all__ = ["AveragingCost", "CostModel", "DeviceSpec", "OpCost", "PRESETS", "detect_device_spec", "get_device_spec", "op_class",
           "op_cost", "step_compute_time"]
