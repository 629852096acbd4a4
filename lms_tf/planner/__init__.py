"""Decides, per forward tensor, KEEP, SWAP or RECOMPUTE: policy values and an IR in, a plan out.

:func:`make_plan` applies the TFLMS swap rule and a recompute policy; :func:`make_budget_plan`
searches for the plan that fits a memory budget at the least predicted slowdown, judged by the
simulator (:mod:`lms_tf.simulate`). Neither touches TensorFlow.

Examples:
    >>> from lms_tf.core import Policies, make_ir
    >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (2,))])])
    >>> make_plan(ir, Policies(), device="/device:GPU:0").decisions
    ()
"""

from lms_tf.planner.budget import make_budget_plan
from lms_tf.planner.fit_check import check_plain_step
from lms_tf.planner.tflms import make_plan

__all__ = ["check_plain_step", "make_budget_plan", "make_plan"]
