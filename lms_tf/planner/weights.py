"""Weights on the host (KARMA, ZeRO-Offload): each variable the device reads is fetched per window.

With ``weights="host"`` the variables live in host memory. The device gets a copy of a variable
just before each window of ops that read it (the forward layer, then its gradient ops), gated
like a swap-in, and frees it after the window's last reader; nothing is copied out, since the
host holds the variable itself. A variable read by several layers (a shared layer, tied
embeddings) is fetched once per window, whichever of its reads the window's ops take.

A window is a run of readers within ``swapin_groupby`` ops of its first; its copy is triggered
``swapin_ahead`` gates before that first reader (the swap-in rule). Forward gates are forward ops
that Grappler's remapper does not fuse into the op after them (a gate reads its trigger's output,
and an extra reader would stop that fusion and change the kernels, so the numbers); backward gates
are the swap-ins' (:mod:`~lms_tf.planner.candidates`).

Examples:
    >>> from lms_tf.core import Policies
    >>> from lms_tf.core.examples import weighted_chain_ir
    >>> policies = Policies(weights="host", swapin_groupby=1)
    >>> [(w.variable, len(w.fetches)) for w in plan_weights(weighted_chain_ir(), policies)]
    [('w1:0', 1), ('w2:0', 2)]
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import AbstractSet, Callable, Dict, List, Mapping, Optional, Tuple

from lms_tf.core.ir import GraphIR, OpInfo, Phase, same_device
from lms_tf.core.op_kinds import (CONSTANT_TYPES, CONTROL_FLOW_OP_TYPES, METADATA_READER_TYPES, RESIDENT_TYPES,
                                  STATE_READ_TYPES)
from lms_tf.core.plan import Decision, SwapIn, WeightDecision
from lms_tf.core.policy import Policies
from lms_tf.planner.candidates import backward_gates, regrouped_with_a_reader

#: Ops that give a view of a weight without computing anything (Keras 3's ``EinsumDense``, in
#: every ``MultiHeadAttention``, reshapes its kernel before the einsum): when a read's only reader
#: is one of them, the view is what the layer reads, forward and backward, and what is fetched.
WEIGHT_VIEW_TYPES = frozenset({"Reshape", "Identity", "Squeeze", "ExpandDims", "StopGradient", "Snapshot",
                               "EnsureShape"})

#: Reads of a variable whose value a device op takes (a gather reads on the variable's own
#: device, so an embedding lookup moves only its rows and needs no fetch).
WEIGHT_READ_TYPES = frozenset({"ReadVariableOp"})

#: Ops Grappler's remapper fuses into the op before them (bias, batch norm, activations, the
#: residual add of a fused convolution): the op before must not be a gate.
FUSED_AFTER_TYPES = frozenset({
    "BiasAdd", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "Relu", "Relu6", "Elu", "LeakyRelu",
    "Selu", "Tanh", "Sigmoid", "Softplus", "Softsign", "Add", "AddV2", "Mul", "Erf", "Gelu",
})


def forward_gates(ir: GraphIR) -> List[OpInfo]:
    """Forward ops that can trigger a weight fetch: they compute on the step's data (an input made
    by a forward op that depends, through data edges, on the step's inputs), have a numeric
    output, and no reader Grappler fuses into them.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> [op.name for op in forward_gates(weighted_chain_ir())]
        ['r1', 'r2', 'loss']
    """
    gates = []
    # Transitively, not only an input made by a forward op: an op computed from constants and
    # shapes alone (a causal mask's LogicalAnd) has no place in the step's order. TensorFlow's
    # executor runs it as soon as the step starts (Grappler folds it into a constant), and a
    # fetch it triggered would arrive blocks before its layer.
    on_data_ops = _computes_on_data(ir)
    for op in ir.ops:
        if op.phase is not Phase.FORWARD or op.type in RESIDENT_TYPES or op.type in ("Const", "NoOp") \
                or op.type in CONTROL_FLOW_OP_TYPES:
            continue
        on_data = op.name in on_data_ops and any(
            ir.op(ir.tensors[t].producer).phase is Phase.FORWARD
            and ir.op(ir.tensors[t].producer).type not in RESIDENT_TYPES for t in op.inputs)
        numeric = any(ir.tensors[t].dtype not in ("resource", "variant", "string") for t in op.outputs)
        fused_into = any(ir.op(c).type in FUSED_AFTER_TYPES for t in op.outputs for c in ir.tensors[t].consumers)
        if on_data and numeric and not fused_into and not regrouped_with_a_reader(ir, op) \
                and not rewritten_by_grappler(ir, op):
            gates.append(op)
    return gates


def rewritten_by_grappler(ir: GraphIR, op: OpInfo) -> bool:
    """Whether Grappler folds ``op`` into another op in this step (:attr:`GraphIR.grappler_rewritten`:
    an inner op of a fused or regrouped group): a gate reading ``op`` would stop that rewrite.
    Seen on a decoder trained with Adam: fetches gated on a kernel's gradient ``MatMul`` (which
    the CPU fuses with the bias gradient) made the first update differ from the plain step's in
    the last bits.

    Examples:
        >>> import dataclasses
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> ir = dataclasses.replace(weighted_chain_ir(), grappler_rewritten=frozenset({"m2"}))
        >>> rewritten_by_grappler(ir, ir.op("m2")), rewritten_by_grappler(ir, ir.op("r1"))
        (True, False)
    """
    return op.name in ir.grappler_rewritten


def weight_gates(ir: GraphIR) -> List[OpInfo]:
    """:func:`forward_gates` and the backward gates, in run order (cached on the IR).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> [op.name for op in weight_gates(weighted_chain_ir())]
        ['r1', 'r2', 'loss', 'gx2', 'gw2', 'g1', 'gw1']
    """
    def build():
        # Swap-ins keep every backward gate (their plans depend on them, and the numbers tests hold
        # on the zoo and beyond); a fetch skips the ones a gate could make Grappler regroup
        # otherwise (backward_gates already skips those it folds into another op).
        backward = [op for op in backward_gates(ir) if not regrouped_with_a_reader(ir, op)]
        return sorted(forward_gates(ir) + backward, key=lambda op: op.index)

    return ir.memo("_weight_gates", build)


def timed_fetches(ir: GraphIR, weights: Tuple[WeightDecision, ...], intervals: Mapping[str, Tuple[float, float]],
                  copy_time: Callable[[int], float], lead: float = 1.0) -> Tuple[WeightDecision, ...]:
    """``weights`` with each fetch triggered by the latest gate that ends at least ``lead`` copy
    times before its window's first reader starts (by a simulation's ``intervals``): the copy is
    hidden behind compute and the device holds it as briefly as it can. A window no gate ends
    early enough for is fetched at the start of the step. A copy that would start before the
    previous window's last reader ends is not made: that window's copy is kept for both.

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> ir = weighted_chain_ir()
        >>> planned = plan_weights(ir, Policies(weights="host", swapin_groupby=1))
        >>> intervals = {op.name: (float(op.index), op.index + 1.0) for op in ir.ops}   # one second per op
        >>> w2 = timed_fetches(ir, planned, intervals, copy_time=lambda nbytes: 0.5)[1]
        >>> [(f.trigger, f.consumers) for f in w2.fetches]   # r1 ends as m2 starts: too late to copy
        [('', ('m2',)), ('loss', ('gx2',))]
    """
    gates = weight_gates(ir)
    positions = [op.index for op in gates]
    timed = []
    for weight in weights:
        head_start = lead * copy_time(weight.nbytes or 0)
        fetches: List[SwapIn] = []
        last_read = -1.0  # when the previous window's last reader ends
        for fetch in weight.fetches:
            readers = sorted((ir.op(c) for c in fetch.consumers if c in intervals), key=lambda op: op.index)
            if not readers:  # alias ops only (no time of their own): keep the rule's trigger
                fetches.append(fetch)
                continue
            position = bisect.bisect_left(positions, readers[0].index) - 1
            deadline = intervals[readers[0].name][0] - head_start
            while position >= 0 and intervals.get(gates[position].name, (0.0, float("inf")))[1] > deadline:
                position -= 1
            trigger = gates[position].name if position >= 0 else ""
            # A copy that would have to start before the previous window ends (a large weight read
            # again soon: the last layers' forward and backward) holds it twice: keep the first.
            if fetches and (position < 0 or intervals.get(trigger, (0.0, 0.0))[1] < last_read):
                fetches[-1] = SwapIn(fetches[-1].trigger, fetches[-1].consumers + fetch.consumers)
            else:
                fetches.append(SwapIn(trigger, fetch.consumers))
            last_read = max([last_read] + [intervals[op.name][1] for op in readers])
        timed.append(dataclasses.replace(weight, fetches=tuple(fetches),
                                         reason="weights='host': fetched just in time for each window of readers"))
    return tuple(timed)


def _computes_on_data(ir: GraphIR) -> set:
    """Names of the forward ops that depend on the step's inputs (through data edges)."""
    # The step's data, not the variables' handles (captured inputs too).
    reached = {name for name in ir.function_inputs
               if any(ir.tensors[t].dtype != "resource" for t in ir.op(name).outputs)}
    for op in ir.ops:
        if op.phase is Phase.FORWARD and any(ir.tensors[t].producer in reached for t in op.inputs):
            reached.add(op.name)
    return reached


def _leads_to_the_step(ir: GraphIR, op: OpInfo, on_data: set, hops: int = 3) -> bool:
    """Whether ``op`` is, or feeds within ``hops`` forward ops, an op on the data or a gradient op."""
    if op.phase is Phase.BACKWARD or op.name in on_data:
        return True
    if hops == 0 or op.phase is not Phase.FORWARD:
        return False
    return any(_leads_to_the_step(ir, ir.op(c), on_data, hops - 1) for t in op.outputs for c in ir.tensors[t].consumers)


def _windows(ir: GraphIR, readers: List[OpInfo], groupby: int, forms: AbstractSet[str]) -> List[List[OpInfo]]:
    """``readers`` of one variable (read as ``forms``) in windows: runs of ops within ``groupby``
    of the window's first. A reader of shapes only joins the first window still running when it
    becomes ready (:func:`ready_position`)."""
    windows: List[List[OpInfo]] = []
    shape_readers = []
    for op in sorted(readers, key=lambda o: o.index):
        if op.type in METADATA_READER_TYPES:
            shape_readers.append(op)
        elif windows and op.index - windows[-1][0].index <= groupby:
            windows[-1].append(op)
        else:
            windows.append([op])
    for op in shape_readers:
        ready = ready_position(ir, op, forms)
        window = next((w for w in windows if w[-1].index >= ready), None)
        if window is None:
            windows.append([op])
        else:
            window.append(op)
    return windows


def ready_position(ir: GraphIR, op: OpInfo, forms: AbstractSet[str]) -> float:
    """Where ``op`` takes its place among a weight's readers: its index in the step, except for a
    reader of shapes only (:data:`~lms_tf.core.op_kinds.METADATA_READER_TYPES`), which
    TensorFlow's executor runs as soon as its inputs exist. A convolution's gradient takes the
    shapes of its input and kernel with one ``ShapeN``, indexed with the backward pass but ready as
    soon as the forward layer's input exists: in the backward window it would read the backward
    fetch, and hold the layer's input on the device (swapped out or not) until that fetch arrives.
    It belongs to the window of the forward layer that runs when it becomes ready (a reader of the
    weight alone is ready at the step's start).

    Examples:
        >>> from lms_tf.core import make_ir
        >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (2, 4))]),
        ...               dict(name="w", type="ReadVariableOp", outputs=[("w:0", (4, 4))]),
        ...               dict(name="y", type="MatMul", inputs=["x:0", "w:0"], outputs=[("y:0", (2, 4))]),
        ...               dict(name="shapes", type="ShapeN", inputs=["x:0", "w:0"],
        ...                    outputs=[("shapes:0", (2,)), ("shapes:1", (2,))])])
        >>> ready_position(ir, ir.op("y"), {"w:0"}), ready_position(ir, ir.op("shapes"), {"w:0"})
        (2, 0.5)
    """
    if op.type not in METADATA_READER_TYPES:
        return op.index
    made = [ir.op(ir.tensors[t].producer).index for t in op.inputs if t not in forms and ir.tensors[t].producer]
    return max(made) + 0.5 if made else -1.0


def weight_view(ir: GraphIR, read: str) -> str:
    """The tensor device ops take a weight as: ``read`` itself, or, when its only reader is a view
    of it (:data:`WEIGHT_VIEW_TYPES`, whose other inputs are constants), that view's output
    (followed as far as views go). Fetching the view keeps the backward pass from reading a view
    of the forward pass's copy, which would hold that copy on the device until then.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> weight_view(weighted_chain_ir(), "w1:0")   # read by a matmul directly
        'w1:0'
    """
    while True:
        readers = ir.tensors[read].consumers
        if len(readers) != 1:
            return read
        view = ir.op(readers[0])
        if view.type not in WEIGHT_VIEW_TYPES or view.phase is not Phase.FORWARD or len(view.outputs) != 1 \
                or view.inputs[0] != read \
                or any(ir.op(ir.tensors[t].producer).type not in CONSTANT_TYPES for t in view.inputs[1:]):
            return read
        read = view.outputs[0]


def plan_weights(ir: GraphIR, policies: Policies,
                 offloaded: Optional[AbstractSet[str]] = None) -> Tuple[WeightDecision, ...]:
    """One :class:`~lms_tf.core.plan.WeightDecision` per variable the step's forward or backward
    ops read: SWAP (fetched per window) with ``weights="host"``, none with ``weights="device"``.
    With ``weights="auto"``, those of the variables in ``offloaded`` (their handles: the budget
    planner's choice among :func:`weight_candidates`), none when it is None.

    Cached on the IR per ``(swapin_ahead, swapin_groupby, host)``: the budget planner assembles
    many plans of one step.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> plan_weights(weighted_chain_ir(), Policies())   # weights on the device: nothing to plan
        ()
        >>> w1, w2 = plan_weights(weighted_chain_ir(), Policies(weights="host", swapin_ahead=1, swapin_groupby=1))
        >>> [(f.trigger or "(start)", f.consumers) for f in w1.fetches]   # nothing runs before the first layer
        [('(start)', ('m1',))]
        >>> [(f.trigger, f.consumers) for f in w2.fetches]   # the forward layer, then its input's gradient
        [('r1', ('m2',)), ('loss', ('gx2',))]
        >>> [w.variable for w in plan_weights(weighted_chain_ir(), Policies(weights="auto", budget="50%"), {"w2:0"})]
        ['w2:0']
    """
    if policies.weights == "device" or (policies.weights == "auto" and not offloaded):
        return ()
    every = weight_candidates(ir, policies)
    return every if policies.weights == "host" else tuple(w for w in every if w.variable in offloaded)


def weight_candidates(ir: GraphIR, policies: Policies) -> Tuple[WeightDecision, ...]:
    """Every variable the device reads that could live on the host, each fetched per window
    (what ``weights="host"`` plans; ``weights="auto"`` chooses among them), in the order of the
    step's first reads.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> [w.variable for w in weight_candidates(weighted_chain_ir(), Policies())]
        ['w1:0', 'w2:0']
    """
    key = (policies.swapin_ahead, policies.swapin_groupby, policies.host)
    cache = ir.__dict__.setdefault("_planned_weights", {})
    if key in cache:
        return cache[key]
    # Where each variable is written (the optimizer's update; a metric's total, batch norm's
    # moving statistics in the forward pass). A write between a variable's first read and its
    # last reader would make one fetch serve values from both sides of it: such a variable is
    # left where it is. (Phases cannot tell: in a custom loop's trace the update's last assign
    # reads only a slot, so it is tagged forward; its place in the run order is after the readers.)
    writes: Dict[str, List[int]] = {}
    for op in ir.ops:
        if op.type in STATE_READ_TYPES or op.type == "ResourceGather":
            continue
        for t in op.inputs:
            if ir.tensors[t].dtype == "resource":
                writes.setdefault(t, []).append(op.index)
    # A weight is read by the forward pass's work on the data, or by gradient ops; an optimizer's
    # slot is read by ops on neither (the update's arithmetic, whatever phase it is tagged with).
    on_data = _computes_on_data(ir)
    reads: Dict[str, List[str]] = {}
    readers: Dict[str, Dict[str, OpInfo]] = {}
    for op in ir.ops:
        if op.type not in WEIGHT_READ_TYPES or not op.inputs or not op.outputs:
            continue
        form = weight_view(ir, op.outputs[0])
        users = [ir.op(c) for c in ir.tensors[form].consumers]
        users = [u for u in users if u.phase in (Phase.FORWARD, Phase.BACKWARD)
                 and not same_device(u.device, policies.host)]  # the host update reads it there
        # A layer may shape or cast its weight first (a convolution's bias reshaped, a bfloat16
        # cast): those ops read it on the device too, on the way to the work on the data.
        if not any(_leads_to_the_step(ir, u, on_data) for u in users):
            users = []
        if not users:
            continue  # read by the update only: it runs where the variable is
        handle = op.inputs[0]
        reads.setdefault(handle, []).append(form)
        readers.setdefault(handle, {}).update((u.name, u) for u in users)
    gates = weight_gates(ir)
    positions = [op.index for op in gates]
    decisions = []
    for handle, names in reads.items():
        first_read = min(ir.op(ir.tensors[n].producer).index for n in names)
        last_reader = max(op.index for op in readers[handle].values())
        if any(first_read < w < last_reader for w in writes.get(handle, ())):
            continue
        info = ir.tensors[names[0]]
        fetches = []
        for window in _windows(ir, list(readers[handle].values()), policies.swapin_groupby, frozenset(names)):
            before = bisect.bisect_left(positions, window[0].index)
            trigger = gates[max(0, before - policies.swapin_ahead)].name if before > 0 else ""
            fetches.append(SwapIn(trigger, tuple(op.name for op in window)))
        decisions.append(WeightDecision(handle, tuple(names), info.shape, info.nbytes, Decision.SWAP,
                                        "weights='host': fetched before each window of readers", tuple(fetches)))
    cache[key] = tuple(decisions)
    return cache[key]
