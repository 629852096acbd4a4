"""XLA's own memory plan for a function a step calls compiled (``jit_compile=True`` inside the step).

TensorFlow runs such a call as one kernel: XLA compiles the whole function, plans its buffers
itself and takes its temporaries from TensorFlow's allocator as one block per call. The graph
does not show that block, so the simulator asks XLA for it: the function is compiled for the
device type (as the runtime will compile it) and its buffer assignment is read from the
optimized HLO module. Keras 3 compiles every grouped convolution this way (``Conv2D(groups=...)``
on TensorFlow: ConvNeXt's depthwise convolutions): on the CPU, XLA computes the filter gradient
of a grouped convolution through a dense filter, ``2 * k * k * C * C`` float32 bytes of
temporaries (220.5 MiB for ConvNeXt-Tiny's last stage, C = 768), where the tensors the graph
shows are under 1 MiB.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import tensorflow as tf


def must_compile(op: tf.Operation) -> bool:
    """Whether ``op`` calls a function TensorFlow compiles with XLA (``_XlaMustCompile``).

    Examples:
        >>> import tensorflow as tf
        >>> inner = tf.function(lambda x: x * 2.0, jit_compile=True)
        >>> graph = tf.function(lambda x: inner(x) + 1.0).get_concrete_function(tf.TensorSpec((4,))).graph
        >>> [op.type for op in graph.get_operations() if must_compile(op)]
        ['PartitionedCall']
    """
    if op.type not in ("PartitionedCall", "StatefulPartitionedCall"):
        return False
    try:
        return bool(op.get_attr("_XlaMustCompile"))
    except ValueError:  # no such attribute: an ordinary call
        return False


def compiled_temp_bytes(graph: tf.Graph, op: tf.Operation, shapes: Sequence[Optional[Tuple[int, ...]]],
                        device_type: str) -> int:
    """Bytes of temporaries XLA plans for the call ``op`` (:func:`must_compile`), compiled for
    ``device_type`` with inputs of ``shapes``: its buffer allocations that are neither arguments,
    outputs, constants nor thread-local.

    Args:
        graph: The step's graph (its captures give the variables a call reads).
        op: The call.
        shapes: Each input's concrete shape (ignored for resource inputs).
        device_type: ``"CPU"`` or ``"GPU"``; a device of that type must be visible.

    Returns:
        The temporaries' bytes.

    Raises:
        ValueError: An input's shape is unknown, or a variable it reads is not a capture of ``graph``.
        tf.errors.OpError: XLA cannot compile the function for that device.

    Examples:
        >>> import tensorflow as tf
        >>> inner = tf.function(lambda x: tf.reduce_sum(tf.exp(x) * tf.sin(x)), jit_compile=True)
        >>> graph = tf.function(lambda x: inner(x)).get_concrete_function(tf.TensorSpec((1024,))).graph
        >>> call = next(op for op in graph.get_operations() if must_compile(op))
        >>> compiled_temp_bytes(graph, call, [(1024,)], "CPU") >= 0
        True
    """
    from tensorflow.compiler.xla.service import hlo_pb2
    from tensorflow.python.eager import context

    captured = {internal.name: external for external, internal in getattr(graph, "captures", ())}
    with tf.init_scope():  # eager, also while ``graph`` is still being traced
        has_variables = any(t.dtype == tf.resource for t in op.inputs)
        args = []
        for tensor, shape in zip(op.inputs, shapes):
            if tensor.dtype == tf.resource:
                if tensor.name not in captured:
                    raise ValueError(f"{op.name} reads {tensor.name}, which is not a variable the step captures")
                args.append(captured[tensor.name])
            elif shape is None or any(d is None for d in shape):
                raise ValueError(f"{op.name}'s input {tensor.name} has no concrete shape ({shape})")
            elif has_variables:  # with a variable, every argument must be a tensor
                args.append(tf.zeros(shape, tensor.dtype))
            else:
                args.append(tf.TensorSpec(shape, tensor.dtype))
        serialized = context.context().get_compiler_ir(
            device_name=f"/job:localhost/replica:0/task:0/device:{device_type}:0", platform_name=None,
            function_name=op.get_attr("f").name, flat_args=args, captured_inputs=[],
            stage="optimized_hlo_proto_serialized")
    module = hlo_pb2.HloProto()
    module.ParseFromString(serialized)
    return sum(a.size for a in module.buffer_assignment.buffer_allocations
               if not (a.is_entry_computation_parameter or a.maybe_live_out or a.is_constant or a.is_thread_local))
