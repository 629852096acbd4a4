"""Layer 2: decides, per forward tensor, KEEP, SWAP or RECOMPUTE.

Example:
    >>> from lms_tf.planner import Plan, plan_swaps, Decision
"""

from lms_tf.planner.default import CHEAP_OP_TYPES, plan_swaps
from lms_tf.planner.plan import Decision, Plan, SwapIn, TensorDecision

__all__ = ["CHEAP_OP_TYPES", "Decision", "Plan", "SwapIn", "TensorDecision", "plan_swaps"]
