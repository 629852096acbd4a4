"""The ordering step: a backward branch waits for another (see :class:`lms_tf.planner.Ordering`).

For each ordering, on the waiters' device::

    after ops -^ order (NoOp) -^ waiters (control edges only)

One NoOp instead of an edge from every ``after`` op to every waiter keeps the graph small.

Examples:
    >>> from lms_tf.tf.rewrite.order import insert_orderings
"""

from __future__ import annotations

from typing import Dict

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.plan import Plan
from lms_tf.tf.rewrite.common import mark


def insert_orderings(graph: tf.Graph, plan: Plan, inserted: Dict[str, int]) -> None:
    """Makes every ordering's waiters start after all of its ``after`` ops.

    Must run inside ``graph.as_default()`` under the lms-tf name scope.

    Examples:
        >>> import collections
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(1.0, name="x")
        ...     y, t = tf.square(x, name="y"), tf.negative(x, name="t")
        ...     z = tf.multiply(y, t, name="z")
        >>> from lms_tf.core.plan import Ordering, Plan
        >>> plan = Plan((), "/device:CPU:0", "/device:CPU:1", {}, {}, orderings=(Ordering(("t",), ("y",), "why"),))
        >>> inserted = collections.Counter()
        >>> with g.as_default():
        ...     insert_orderings(g, plan, inserted)
        >>> [op.name for op in t.op.control_inputs], dict(inserted)
        (['order_0'], {'order': 1})
    """
    for i, ordering in enumerate(plan.orderings):
        waiters = [graph.get_operation_by_name(n) for n in ordering.waiters]
        after = [graph.get_operation_by_name(n) for n in ordering.after]
        with graph.colocate_with(waiters[0]), graph.control_dependencies(after):
            barrier = tf.raw_ops.NoOp(name=f"order_{i}")
        mark(barrier, "order")
        inserted["order"] += 1
        for waiter in waiters:
            _compat.add_control_input(waiter, barrier)
