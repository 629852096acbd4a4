"""Bounds on a planned step's time that no plan moving the same bytes can beat.

Example:
    >>> from lms_tf.simulate.bounds import link_lower_bound
"""

from __future__ import annotations

from lms_tf.cost.model import CostModel


def link_lower_bound(compute_s: float, planned, cost: CostModel) -> float:
    """Least possible step time for the bytes the plan moves: the compute (recompute included)
    or the busier link direction, whichever is longer.

    Example:
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> class P: compute_time_s, swap_out_bytes, swap_in_bytes = 0.5, 12 * 10**9, 6 * 10**9
        >>> link_lower_bound(0.4, P, CostModel(get_device_spec("v100-16gb-pcie3")))
        1.0
    """
    return max(planned.compute_time_s, compute_s,
               cost.transfer_time(planned.swap_out_bytes, "device_to_host"),
               cost.transfer_time(planned.swap_in_bytes, "host_to_device"))
