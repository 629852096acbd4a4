"""Runs layers 1-3 (IR, planner, rewriter) on the graph being traced; used by every front-end.

Example:
    >>> from lms_tf.pipeline import resolve_device
    >>> from lms_tf.options import LMSOptions
    >>> resolve_device(LMSOptions(device="/CPU:0", host="/CPU:1"))
    '/device:CPU:0'
"""

from __future__ import annotations

import logging
import warnings
from typing import Dict, Mapping, Optional, Sequence

import tensorflow as tf

from lms_tf import _compat
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.errors import LMSError, LMSWarning
from lms_tf.graph import build_ir
from lms_tf.options import LMSOptions
from lms_tf.planner import Plan, make_budget_plan, make_plan, simulate
from lms_tf.rewrite import apply_plan
from lms_tf.rewrite.recompute import simulator_name
from lms_tf.rewrite.serialize import impose_order

logger = logging.getLogger("lms_tf")
_warned = set()


def warn_once(key: str, message: str) -> None:
    """Issues an LMSWarning (and a log line) once per process for ``key``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     warn_once("doc-example", "shown once")
    """
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message)
    warnings.warn(message, LMSWarning, stacklevel=3)


def resolve_device(options: LMSOptions) -> Optional[str]:
    """The accelerator to manage: ``options.device``, else the first GPU, else None.

    Example:
        >>> resolve_device(LMSOptions(device="/GPU:1"))
        '/device:GPU:1'
    """
    if options.device is not None:
        return options.device
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return tf.DeviceSpec.from_string(gpus[0].name).replace(job=None, replica=None, task=None).to_string()
    return None


def no_accelerator_message(api: str) -> str:
    """The warning given when there is no GPU and no explicit ``device=``.

    Example:
        >>> "untouched" in no_accelerator_message("lms_tf.function")
        True
    """
    return (f"{api}: no GPU is visible and no device= was given, so the training step is left untouched "
            f"(nothing to swap from). Pass device='/GPU:0' on a GPU machine, or device='/CPU:0', "
            f"host='/CPU:1' with two logical CPUs to exercise the pass on a CPU.")


@tf.autograph.experimental.do_not_convert
def call_step_for_rewrite(options: LMSOptions, step, *args, **kwargs):
    """Calls the step being traced. With ``serialize=True`` it runs inside TensorFlow's automatic
    control dependencies, added now: the order the pass imposes must respect the edges TF adds
    between stateful ops, which would otherwise come when the trace ends and close a cycle.

    Example:
        >>> call_step_for_rewrite(LMSOptions(device="/CPU:0", swap=False, recompute="sqrt"), lambda x: x + 1, 1)
        2
    """
    if not options.serialize:
        return step(*args, **kwargs)
    with _compat.automatic_control_dependencies() as mark_as_return:
        return mark_as_return(step(*args, **kwargs))


def rewrite_traced_step(options: LMSOptions, *, api: str,
                        input_shapes: Optional[Mapping[str, Sequence[Optional[int]]]] = None,
                        batch_size: Optional[int] = None,
                        scope_aliases: Optional[Mapping[str, str]] = None,
                        irs: Optional[list] = None, serialize: bool = False) -> Optional[Plan]:
    """Plans and applies the swap pass to the ``tf.function`` graph being traced right now.

    Call it inside the traced body, after the gradients and the update were built.

    Args:
        options: Validated options.
        api: Front-end name for messages.
        input_shapes: Concrete shapes of the function's input placeholders, by op name.
        batch_size: Batch size to resolve unknown leading input dimensions with.
        scope_aliases: Keras layer name -> its name scope in this trace (for ``exclude``).
        irs: If given, the IR of the step before the rewrite is appended to it (to simulate the plan).
        serialize: Also chain the step's ops in the simulator's order (:mod:`lms_tf.rewrite.serialize`).

    Returns:
        The plan applied, or None when the step was left untouched (no accelerator).

    Raises:
        LMSError: Not inside a ``tf.function`` trace (eager execution), or the pass failed.

    Example:
        >>> rewrite_traced_step(LMSOptions(device="/CPU:0", host="/CPU:1"), api="doc")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.errors.LMSError: doc: the step runs eagerly...
    """
    graph = _compat.current_graph()
    if not _compat.is_function_graph(graph):
        raise LMSError(
            f"{api}: the step runs eagerly (received a {type(graph).__name__}, not a tf.function graph), so "
            f"there is no graph to rewrite. Remove run_eagerly=True from compile() and do not call "
            f"tf.config.run_functions_eagerly(True).")
    device = resolve_device(options)
    if device is None:
        warn_once(f"no-accelerator:{api}", no_accelerator_message(api))
        return None
    ir = build_ir(graph, input_shapes=input_shapes, batch_size=batch_size or options.batch_size)
    if irs is not None:
        irs.append(ir)
    if options.budget is not None:
        plan = make_budget_plan(ir, options, device=device, scope_aliases=scope_aliases)
    else:
        plan = make_plan(ir, options, device=device, scope_aliases=scope_aliases)
    report = apply_plan(graph, ir, plan)
    logger.info("%s (graph %s; inserted %s)", plan.one_line(), graph.name, report.inserted)
    if serialize:
        edges = impose_order(graph, simulated_ranks(graph, ir, plan, options))
        logger.info("serialized graph %s in the simulated order (%d control edges)", graph.name, edges)
    return plan


def simulated_ranks(graph: tf.Graph, ir, plan: Plan, options: LMSOptions) -> Dict[str, float]:
    """Graph op name -> its start rank in the simulation of ``plan`` (compute ops only).

    Swap copies run on their own streams and are left out, so they still overlap compute.

    Example:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(2.0, name="x")
        ...     y = tf.square(x, name="y")
        >>> plan = Plan((), "/device:CPU:0", "/device:CPU:1", {}, {"forward": 1})
        >>> simulated_ranks(g, build_ir(g), plan, LMSOptions(device="/CPU:0", host="/CPU:1",
        ...                                                   device_spec="a100-40gb-pcie4"))
        {'x': 0.0, 'y': 1.0}
    """
    sim = simulate(ir, plan, cost=CostModel(get_device_spec(options.device_spec or "auto")), top=1)
    graph_name = {simulator_name(graph, op.name): op.name for op in graph.get_operations()}
    names = (graph_name.get(name) for name in sim.op_intervals)
    return {name: float(i) for i, name in enumerate(n for n in names if n is not None)}
