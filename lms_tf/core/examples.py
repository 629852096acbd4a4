"""Small training steps as IRs, for examples and tests (the planning layers need no TensorFlow to run them).

Examples:
    >>> ir = chain_ir()
    >>> [op.name for op in ir.ops_in(Phase.BACKWARD)]
    ['g3', 'g2', 'g1']
"""

from __future__ import annotations

from lms_tf.core.ir import GraphIR, Phase, make_ir  # noqa: F401 - Phase is used by the examples

MiB = 2**20


def chain_ir(mib: int = 4) -> GraphIR:
    """``x -> a -> b -> c -> loss`` (``mib`` MiB each, the loss 4 bytes) and its backward pass
    ``g3 -> g2 -> g1``, which reads ``c``, ``b`` and ``a`` in that order.

    Examples:
        >>> ir = chain_ir()
        >>> ir.tensors["a:0"].nbytes, ir.tensors["a:0"].consumers
        (4194304, ('b', 'g1'))
        >>> ir.op("g1").phase is Phase.BACKWARD
        True
    """
    shape, scalar = (mib * MiB // 4,), (1,)
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", shape)]),
        dict(name="a", type="Exp", inputs=["x:0"], outputs=[("a:0", shape)]),
        dict(name="b", type="Exp", inputs=["a:0"], outputs=[("b:0", shape)]),
        dict(name="c", type="Exp", inputs=["b:0"], outputs=[("c:0", shape)]),
        dict(name="loss", type="Sum", inputs=["c:0"], outputs=[("loss:0", scalar)]),
        dict(name="g3", type="Mul", phase="backward", inputs=["loss:0", "c:0"], outputs=[("g3:0", shape)]),
        dict(name="g2", type="Mul", phase="backward", inputs=["g3:0", "b:0"], outputs=[("g2:0", shape)]),
        dict(name="g1", type="Mul", phase="backward", inputs=["g2:0", "a:0"], outputs=[("g1:0", shape)]),
    ], function_inputs=["x"])
