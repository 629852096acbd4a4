"""What lives on the device besides the step: resident variables, and the pool's history before the first
step; and what lives on the host for the whole step (weights placed there, their optimizer slots).

Examples:
    >>> from lms_tf.core import make_ir
    >>> resident_bytes(make_ir([]))
    0
"""

from __future__ import annotations

from typing import Collection, Dict, Iterable, List, Tuple

from lms_tf.core.ir import GraphIR, Phase
from lms_tf.core.op_kinds import update_products_of_gradients


def resident_buffers(ir: GraphIR, on_host: Collection[str] = ()) -> List[Tuple[str, int]]:
    """The variables the step reads (weights, optimizer slots), ``(handle, bytes)`` in graph
    order: resident for the whole step, except those whose handles are in ``on_host`` (weights
    on the host: :class:`~lms_tf.core.plan.WeightDecision`).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> resident_buffers(weighted_chain_ir()), resident_buffers(weighted_chain_ir(), on_host={"w1:0"})
        ([('w1:0', 262144), ('w2:0', 262144)], [('w2:0', 262144)])
    """
    sizes: Dict[str, int] = {}
    for op in ir.ops:
        if op.type == "ReadVariableOp" and op.inputs and op.inputs[0] not in on_host:
            sizes[op.inputs[0]] = max(sizes.get(op.inputs[0], 0), ir.tensors[op.outputs[0]].nbytes or 0)
    return list(sizes.items())


def variables_on_host(ir: GraphIR, offloaded: Collection[str]) -> frozenset:
    """The handles of the variables that live on the host: the ``offloaded`` weights and, when
    there are any, the variables only the optimizer update reads (its slots: with weights on the
    host the optimizer's variables are placed there too, and the update runs there).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> sorted(variables_on_host(weighted_chain_ir(), {"w1:0"})), variables_on_host(weighted_chain_ir(), ())
        (['w1:0'], frozenset())
    """
    if not offloaded:
        return frozenset()
    return frozenset(offloaded) | optimizer_slots(ir)


def optimizer_slots(ir: GraphIR) -> frozenset:
    """The handles of the variables only the optimizer update reads: its slots (Adam's moments,
    the step count), what ``optimizer_on_host=True`` keeps in host memory.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> optimizer_slots(weighted_chain_ir())   # the weights are read forward: not slots
        frozenset()
    """
    return ir.memo("_optimizer_slots", lambda: _optimizer_slots(ir))


def _optimizer_slots(ir: GraphIR) -> frozenset:
    phases: Dict[str, set] = {}
    for op in ir.ops:
        if op.type == "ReadVariableOp" and op.inputs:
            seen = phases.setdefault(op.inputs[0], set())
            seen.add(op.phase)
            if _feeds_the_backward_pass(ir, op):
                seen.add(Phase.BACKWARD)
    # In a custom loop's trace some of the update's reads of a slot are tagged forward (the phases
    # follow data edges, and the update's last assign reads only a slot); a slot is still never
    # read on the way to a gradient, which every trained weight is.
    return frozenset(handle for handle, seen in phases.items()
                     if Phase.UPDATE in seen and Phase.BACKWARD not in seen)


def update_products_on_device(ir: GraphIR) -> frozenset:
    """The optimizer update's ops that stay on the device when the update runs on the host: those
    computing from the weight gradients (and scalar hyperparameters) alone, not from a slot or a
    weight (SGD's learning rate times the gradient; not Adam's square, which the host computes
    from the gradient it receives anyway). The rewrite keeps them there
    (:func:`lms_tf.tf.optimizer_offload.keep_gradient_products_on_device`; both apply
    :func:`lms_tf.core.op_kinds.update_products_of_gradients`) so the device runs what it runs in
    the plain step: each holds its gradient on the device until it runs, and its output crosses
    to the host beside (or instead of) the gradient.

    Examples:
        >>> from lms_tf.core import make_ir
        >>> from lms_tf.core.ir import Phase
        >>> ir = make_ir([dict(name="g", type="MatMul", phase=Phase.BACKWARD, outputs=[("g:0", (4, 4))]),
        ...               dict(name="lr", type="Const", phase=Phase.UPDATE, outputs=[("lr:0", ())]),
        ...               dict(name="step", type="Mul", phase=Phase.UPDATE, inputs=["g:0", "lr:0"],
        ...                    outputs=[("step:0", (4, 4))]),
        ...               dict(name="m", type="ReadVariableOp", phase=Phase.UPDATE, inputs=["slot:0"],
        ...                    outputs=[("m:0", (4, 4))]),
        ...               dict(name="square", type="Square", phase=Phase.UPDATE, inputs=["g:0"],
        ...                    outputs=[("square:0", (4, 4))]),
        ...               dict(name="moment", type="Sub", phase=Phase.UPDATE, inputs=["square:0", "m:0"],
        ...                    outputs=[("moment:0", (4, 4))])])
        >>> sorted(update_products_on_device(ir))   # Adam's square runs on the host, from the gradient
        ['step']
    """
    return ir.memo("_update_products_on_device", lambda: _update_products_on_device(ir))


def _update_products_on_device(ir: GraphIR) -> frozenset:
    updates = {op.name for op in ir.ops if op.phase is Phase.UPDATE}

    def producer(tensor: str) -> str:
        """What made ``tensor``, seen through the ``IdentityN`` the optimizer wraps the gradients in
        (a tensor from outside the IR, a captured variable's handle, by its name)."""
        if tensor not in ir.tensors:
            return tensor.split(":")[0]
        made_by = ir.op(ir.tensors[tensor].producer)
        if made_by.type == "IdentityN" and made_by.name in updates and tensor in made_by.outputs:
            return ir.tensors[made_by.inputs[made_by.outputs.index(tensor)]].producer
        return made_by.name

    def reads_state(op) -> bool:
        shape = ir.tensors[op.outputs[0]].shape if op.outputs else None
        return op.type == "ReadVariableOp" and (shape is None or len(shape) != 0)

    update_ops = [(op.name, op.type, [producer(t) for t in op.inputs], reads_state(op),
                   any(t in ir.tensors and ir.tensors[t].dtype == "resource" for t in op.inputs))
                  for op in ir.ops if op.name in updates]
    gradients = {op.name for op in ir.ops if op.phase is Phase.BACKWARD}
    return frozenset(update_products_of_gradients(update_ops, gradients))


def _feeds_the_backward_pass(ir: GraphIR, op, hops: int = 3) -> bool:
    """Whether an output of ``op`` is read by a backward op within ``hops`` ops."""
    if hops == 0:
        return False
    for t in op.outputs:
        for name in ir.tensors[t].consumers:
            consumer = ir.op(name)
            if consumer.phase is Phase.BACKWARD or _feeds_the_backward_pass(ir, consumer, hops - 1):
                return True
    return False


def host_resident(ir: GraphIR, on_host: Collection[str] = ()) -> List[Tuple[str, int]]:
    """The variables that live in host memory for the whole step, ``(handle, bytes)``
    (:func:`variables_on_host` of the offloaded weights ``on_host``).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> host_resident(weighted_chain_ir(), on_host={"w1:0"}), host_resident(weighted_chain_ir())
        ([('w1:0', 262144)], [])
    """
    handles = variables_on_host(ir, on_host)
    return [(handle, nbytes) for handle, nbytes in resident_buffers(ir) if handle in handles] if handles else []


def pool_history(ir: GraphIR, accumulated_sums: Iterable[str] = (),
                 on_host: Collection[str] = ()) -> List[Tuple[str, str, int]]:
    """What a Keras training process asks the allocator for before its first step, as
    ``("alloc" | "free", key, bytes)`` events (:func:`replay_allocations`' ``history``).

    The free chunks the first step finds decide where its tensors land, so the order matters:

    1. each variable the step reads, in graph order, as Keras creates it: a kernel (rank 2 or
       more) through a random initializer (Glorot, He: a draw, scaled, then shifted, each a
       buffer of the variable's size; the first two are freed), a vector from a constant;
    2. the step's inputs;
    3. for each of ``accumulated_sums``, the zeros constant its temporary variable starts from
       (kept while the step's function lives).

    Variables whose handles are in ``on_host`` live on the host: the device never holds them.

    TensorFlow's allocation trace shows this sequence (``StatelessRandomUniformV2``, ``Mul``,
    ``AddV2`` per kernel; ``AddN_98/tmp_var_zeros`` on ResNet-50).

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> pool_history(GraphIR((), {}, frozenset(), {}))
        []
    """
    events: List[Tuple[str, str, int]] = []
    ranks: Dict[str, int] = {}
    for op in ir.ops:
        if op.type == "ReadVariableOp" and op.inputs:
            ranks[op.inputs[0]] = max(ranks.get(op.inputs[0], 0), len(ir.tensors[op.outputs[0]].shape or ()))
    for handle, nbytes in resident_buffers(ir, on_host):
        if ranks.get(handle, 0) >= 2:
            draw, scaled = f"{handle}#initializer_draw", f"{handle}#initializer_scaled"
            events += [("alloc", draw, nbytes), ("alloc", scaled, nbytes), ("alloc", handle, nbytes),
                       ("free", scaled, 0), ("free", draw, 0)]
        else:
            events.append(("alloc", handle, nbytes))
    events += [("alloc", tensor, nbytes) for tensor, nbytes in _input_buffers(ir)]
    for name in sorted(accumulated_sums):
        if f"{name}:0" in ir.tensors:
            events.append(("alloc", f"{name}/tmp_var_zeros", ir.tensors[f"{name}:0"].nbytes or 0))
    return events


def input_bytes(ir: GraphIR) -> int:
    """Bytes of the step's inputs (its batch): on the device for the whole step, as the variables
    are, and no more step memory than they are (the simulator does not count them in a peak).
    A budget of the device's memory (``budget="auto"``, the largest batch or model that fits) must
    leave room for them: a ResNet-50 batch of 786 images at 224² is 0.44 GiB, which Grappler's
    virtual V100 counted above a plan the simulator put within its budget.

    Examples:
        >>> from lms_tf.core import make_ir
        >>> input_bytes(make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (4, 8))])]))
        128
    """
    return sum(nbytes for _, nbytes in _input_buffers(ir))


def _input_buffers(ir: GraphIR) -> List[Tuple[str, int]]:
    """``(tensor, bytes)`` of each step input that is not a variable's handle, in graph order."""
    return [(op.outputs[0], ir.tensors[op.outputs[0]].nbytes or 0) for op in ir.ops
            if op.type in ("Placeholder", "_Arg") and op.outputs and ir.tensors[op.outputs[0]].dtype != "resource"]


def resident_bytes(ir: GraphIR, on_host: Collection[str] = ()) -> int:
    """Bytes of the variables the step reads (weights, optimizer slots): resident for the whole
    step, except those whose handles are in ``on_host``.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> resident_bytes(GraphIR((), {}, frozenset(), {}))
        0
    """
    return sum(nbytes for _, nbytes in resident_buffers(ir, on_host))
