"""Layer 3: applies a Plan to a graph, and nothing else.

Examples:
    >>> from lms_tf.tf.rewrite import apply_plan, count_lms_ops
"""

from lms_tf.tf.rewrite.apply import apply_plan, apply_plans
from lms_tf.tf.rewrite.common import LMS_ATTR, RewriteReport, count_lms_ops, is_rewritten

__all__ = ["LMS_ATTR", "RewriteReport", "apply_plan", "apply_plans", "count_lms_ops", "is_rewritten"]
