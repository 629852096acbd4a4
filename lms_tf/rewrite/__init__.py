"""Layer 3: applies a Plan to a graph, and nothing else.

Example:
    >>> from lms_tf.rewrite import apply_swap_plan, count_lms_ops
"""

from lms_tf.rewrite.swap import LMS_ATTR, RewriteReport, apply_swap_plan, count_lms_ops, is_rewritten

__all__ = ["LMS_ATTR", "RewriteReport", "apply_swap_plan", "count_lms_ops", "is_rewritten"]
