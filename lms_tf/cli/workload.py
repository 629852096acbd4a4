"""What the subcommands do with TensorFlow: devices to rewrite on, and the plain step traced once.

Examples:
    >>> from lms_tf.cli.workload import devices
"""

from __future__ import annotations

import logging
import time
from typing import Tuple

import tensorflow as tf

from lms_tf import _compat

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


def trace_decoder_widths(widths, *, depth: int, seq_len: int, batch: int, vocab: int, head_size: int):
    """The Adam train step of :func:`~lms_tf.tf.workloads.decoder_lm` traced at each width, as IRs.

    The optimizer is named, and every layer is, so the graphs at every width have the same op
    names (what :meth:`~lms_tf.core.ir.ScaledIR.fit` needs).

    Returns:
        Width -> the step's :class:`~lms_tf.core.ir.GraphIR`.

    Examples:
        >>> irs = trace_decoder_widths((64, 128), depth=1, seq_len=8, batch=2, vocab=50, head_size=32)
        >>> [op.name for op in irs[64].ops] == [op.name for op in irs[128].ops]
        True
    """
    keras = _compat.keras_module()
    from lms_tf.tf.trace import build_ir
    from lms_tf.tf.workloads import decoder_lm, train_step

    irs = {}
    for i, width in enumerate(widths):
        started = time.perf_counter()
        model = decoder_lm(width=width, depth=depth, seq_len=seq_len, vocab=vocab, head_size=head_size)
        spec = tf.TensorSpec((batch, seq_len), tf.int32)
        graph = tf.function(train_step(model, keras.optimizers.Adam(name="adam"))).get_concrete_function(spec, spec).graph
        irs[width] = build_ir(graph)
        logger.info("[%d/%d] traced the decoder's Adam train step at width %d (%d ops) in %.1f s", i + 1, len(widths),
                    width, len(irs[width].ops), time.perf_counter() - started)
    return irs
