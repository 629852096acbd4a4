"""Replays a step, with or without a plan, on a modelled device: peak memory and step time.

:mod:`~lms_tf.simulate.lower` lowers the step and a plan to events (compute, copies out, copies
back, recompute clones) under TensorFlow's memory rules; :mod:`~lms_tf.simulate.replay` runs them
as TensorFlow's executor does; :mod:`~lms_tf.simulate.allocator` models TensorFlow's BFC allocator,
after the pool's history (:mod:`~lms_tf.simulate.pool`). :func:`simulate` is the entry point.

Examples:
    >>> from lms_tf.core import make_ir
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (256,))]),
    ...               dict(name="e", type="Exp", inputs=["x:0"], outputs=[("e:0", (256,))])])
    >>> simulate(ir, cost=CostModel(get_device_spec("v100-16gb-pcie3"))).peak_bytes
    1024
"""

from lms_tf.simulate.allocator import (
                                       BFCAllocatorModel,
                                       replay_allocations,
                                       tensorflow_cpu_allocator,
                                       tensorflow_gpu_allocator,
)
from lms_tf.simulate.bounds import WholeOpFloor, link_lower_bound, whole_op_floor
from lms_tf.simulate.lower import (KERNEL_LIBRARIES, check_clone_fetches, check_kernel_library, clone_readers, check_sliced_op,
                                   without_unsound_clone_fetches, gradients_crossing_as,
                                   kernel_scratch_bytes)
from lms_tf.simulate.pool import (host_resident, input_bytes, optimizer_slots, pool_history, resident_buffers, resident_bytes,
                                  update_products_on_device, variables_on_host)
from lms_tf.simulate.replay import HOST_UPDATE_ORDERS, Simulation
from lms_tf.simulate.simulator import simulate, simulate_tie_orders

__all__ = ["BFCAllocatorModel", "HOST_UPDATE_ORDERS", "WholeOpFloor", "whole_op_floor", "KERNEL_LIBRARIES", "Simulation", "check_clone_fetches", "check_kernel_library", "check_sliced_op", "host_resident", "kernel_scratch_bytes",
           "link_lower_bound", "pool_history", "replay_allocations",
           "input_bytes", "resident_buffers", "resident_bytes", "simulate", "simulate_tie_orders", "tensorflow_cpu_allocator",
           "tensorflow_gpu_allocator", "variables_on_host", "optimizer_slots", "gradients_crossing_as",
           "update_products_on_device", "without_unsound_clone_fetches", "clone_readers"]
