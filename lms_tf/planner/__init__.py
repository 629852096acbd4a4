"""Layer 2: decides, per forward tensor, KEEP or SWAP (RECOMPUTE arrives with its pass).

Example:
    >>> from lms_tf.planner import Plan, plan_swaps, Decision
"""

from lms_tf.planner.default import plan_swaps
from lms_tf.planner.plan import Decision, Plan, SwapIn, TensorDecision

__all__ = ["Decision", "Plan", "SwapIn", "TensorDecision", "plan_swaps"]
