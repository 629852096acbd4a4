"""Layer 2: decides, per forward tensor, KEEP, SWAP or RECOMPUTE.

Example:
    >>> from lms_tf.planner import Plan, make_plan, Decision
"""

from lms_tf.planner.allocator import BFCAllocatorModel, tensorflow_cpu_allocator, tensorflow_gpu_allocator
from lms_tf.planner.budget import InfeasibleBudgetError, make_budget_plan, resolve_budget
from lms_tf.planner.default import CHEAP_OP_TYPES, make_plan
from lms_tf.planner.simulator import Simulation, pool_history, resident_bytes, simulate
from lms_tf.planner.plan import Decision, Ordering, Plan, SwapIn, TensorDecision

__all__ = ["BFCAllocatorModel", "CHEAP_OP_TYPES", "Decision", "InfeasibleBudgetError", "Ordering", "Plan", "Simulation", "SwapIn", "TensorDecision",
           "make_budget_plan", "make_plan", "pool_history", "resident_bytes", "resolve_budget", "simulate",
           "tensorflow_cpu_allocator", "tensorflow_gpu_allocator"]
