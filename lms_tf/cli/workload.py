"""What the subcommands do with TensorFlow: devices to rewrite on, and the plain step traced once.

Examples:
    >>> from lms_tf.cli.workload import devices
"""

from __future__ import annotations

import logging
import time
from typing import Tuple

import tensorflow as tf

logger = logging.getLogger("lms_tf")


def devices() -> Tuple[str, str]:
    """The managed device and host: the GPU if present, else two logical CPUs standing in.

    Examples:
        >>> devices()[1] in ("/CPU:0", "/CPU:1")
        True
    """
    if tf.config.list_physical_devices("GPU"):
        return "/GPU:0", "/CPU:0"
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) < 2:  # keep a caller's own split
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
        except RuntimeError:
            pass  # already initialised (tests, a second call)
    return "/CPU:0", "/CPU:1"


def trace_unbatched(args):
    """Builds the model and traces its plain train step with an unknown batch dimension.

    Returns:
        ``(model, step, graph, x_spec, y_spec)``.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> args = build_parser().parse_args(["max-batch", "--model", "unet", "--input-shape", "32x32"])
        >>> model, step, graph, x_spec, y_spec = trace_unbatched(args)
        >>> graph.inputs[0].shape.as_list()
        [None, 32, 32, 3]
    """
    from lms_tf.tf.workloads import build_model, step_specs, train_step

    logger.info("building %s (%s)", args.model, args.input_shape)
    model = build_model(args.model, image_size=args.input_shape, classes=args.classes)
    x_spec, y_spec = step_specs(model, None)
    step = train_step(model)
    started = time.perf_counter()
    graph = tf.function(step).get_concrete_function(x_spec, y_spec).graph
    logger.info("traced the plain train step (%d ops) in %.1f s", len(graph.get_operations()),
                time.perf_counter() - started)
    return model, step, graph, x_spec, y_spec
