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


def weighted_chain_ir(units: int = 256, batch: int = 32) -> GraphIR:
    """Two dense layers ``x -> m1 = x @ w1 -> r1 = relu -> m2 = r1 @ w2 -> r2 = relu -> loss``, their
    backward pass and the two variable updates. ``w1`` is read by ``m1`` only (its weight gradient
    needs ``x``, not ``w1``); ``w2`` by ``m2`` and by ``gx2``, the gradient with respect to ``r1``.

    Examples:
        >>> ir = weighted_chain_ir()
        >>> ir.tensors["rw2:0"].consumers, ir.tensors["rw2:0"].nbytes
        (('m2', 'gx2'), 262144)
    """
    act, weight = (batch, units), (units, units)
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", act)]),
        dict(name="w1", type="Placeholder", outputs=[("w1:0", (), "resource")]),
        dict(name="w2", type="Placeholder", outputs=[("w2:0", (), "resource")]),
        dict(name="rw1", type="ReadVariableOp", inputs=["w1:0"], outputs=[("rw1:0", weight)]),
        dict(name="rw2", type="ReadVariableOp", inputs=["w2:0"], outputs=[("rw2:0", weight)]),
        dict(name="m1", type="MatMul", inputs=["x:0", "rw1:0"], outputs=[("m1:0", act)]),
        dict(name="r1", type="Relu", inputs=["m1:0"], outputs=[("r1:0", act)]),
        dict(name="m2", type="MatMul", inputs=["r1:0", "rw2:0"], outputs=[("m2:0", act)]),
        dict(name="r2", type="Relu", inputs=["m2:0"], outputs=[("r2:0", act)]),
        dict(name="loss", type="Sum", inputs=["r2:0"], outputs=[("loss:0", (1,))]),
        dict(name="g2", type="ReluGrad", phase="backward", inputs=["loss:0", "r2:0"], outputs=[("g2:0", act)]),
        dict(name="gx2", type="MatMul", phase="backward", inputs=["g2:0", "rw2:0"], outputs=[("gx2:0", act)]),
        dict(name="gw2", type="MatMul", phase="backward", inputs=["r1:0", "g2:0"], outputs=[("gw2:0", weight)]),
        dict(name="g1", type="ReluGrad", phase="backward", inputs=["gx2:0", "r1:0"], outputs=[("g1:0", act)]),
        dict(name="gw1", type="MatMul", phase="backward", inputs=["x:0", "g1:0"], outputs=[("gw1:0", weight)]),
        dict(name="u2", type="ResourceApplyGradientDescent", phase="update", inputs=["w2:0", "gw2:0"], outputs=[]),
        dict(name="u1", type="ResourceApplyGradientDescent", phase="update", inputs=["w1:0", "gw1:0"], outputs=[]),
    ], function_inputs=["x"])
