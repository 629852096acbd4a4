"""The planning core: plain data and rules, no TensorFlow.

The graph IR (:mod:`~lms_tf.core.ir`), the one table of op kinds (:mod:`~lms_tf.core.op_kinds`),
policy values (:mod:`~lms_tf.core.policy`), the plan (:mod:`~lms_tf.core.plan`) and the
library's error types (:mod:`~lms_tf.core.errors`). Everything above it (cost model, simulator,
planner) runs on these values; only :mod:`lms_tf.tf` and the front-ends touch TensorFlow.

Examples:
    >>> from lms_tf.core import Plan, Policies, make_ir
    >>> Plan.from_json(Plan((), "/device:GPU:0", "/device:CPU:0", {}, {}).to_json()).device
    '/device:GPU:0'
"""

from lms_tf.core.errors import (
                                GraphAnalysisError,
                                InfeasibleBudgetError,
                                LMSError,
                                LMSOptionError,
                                LMSWarning,
                                PlanCycleError,
                                RewriteError,
)
from lms_tf.core.ir import BatchSizedIR, GraphIR, OpInfo, Phase, TensorInfo, layer_of, make_ir
from lms_tf.core.plan import (PLAN_SCHEMA_VERSION, Decision, Ordering, Plan, SlicedOp, SwapIn, TensorDecision,
                              WeightDecision)
from lms_tf.core.policy import Policies, parse_budget, parse_bytes, resolve_budget

__all__ = ["BatchSizedIR", "Decision", "GraphAnalysisError", "GraphIR", "InfeasibleBudgetError", "LMSError", "LMSOptionError",
           "LMSWarning", "OpInfo", "Ordering", "PLAN_SCHEMA_VERSION", "Phase", "Plan", "PlanCycleError",
           "Policies", "RewriteError", "SlicedOp", "SwapIn", "TensorDecision", "TensorInfo", "WeightDecision", "layer_of", "make_ir",
           "parse_budget", "parse_bytes", "resolve_budget"]
