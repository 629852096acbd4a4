"""Replays a step, with or without a plan, on a modelled device: peak memory and step time.

:mod:`~lms_tf.simulate.simulator` lowers a plan to events (compute, copies out, copies back,
recompute clones) and replays them as TensorFlow's executor runs them;
:mod:`~lms_tf.simulate.allocator` models TensorFlow's BFC allocator, after the pool's history.

Example:
    >>> from lms_tf.simulate import simulate, tensorflow_gpu_allocator
"""

from lms_tf.simulate.allocator import (
                                       BFCAllocatorModel,
                                       replay_allocations,
                                       tensorflow_cpu_allocator,
                                       tensorflow_gpu_allocator,
)
from lms_tf.simulate.simulator import (
                                       Simulation,
                                       pool_history,
                                       resident_buffers,
                                       resident_bytes,
                                       simulate,
                                       simulate_tie_orders,
)

__all__ = ["BFCAllocatorModel", "Simulation", "pool_history", "replay_allocations", "resident_buffers",
           "resident_bytes", "simulate", "simulate_tie_orders", "tensorflow_cpu_allocator",
           "tensorflow_gpu_allocator"]
