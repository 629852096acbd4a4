"""Which forward tensors a plan may move: the ones a backward op reads that are eligible, and the gates.

A forward tensor is a candidate when a backward op reads its value. It is eligible to be
swapped or recomputed unless it is a variable read, a function input, a host-resident value,
a control-flow value, derived from variables or constants only, read by an update op, placed on
another device, or excluded by the user (the reason is kept with its KEEP decision). Gates are
the backward ops that may trigger a swap-in or start a recomputation: they carry gradient data,
so they run in the backward pass, after the forward pass ended.

Examples:
    >>> from lms_tf.core import Policies, make_ir
    >>> collect_candidates(make_ir([]), Policies(), device="/device:GPU:0").eligible
    ()
"""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from lms_tf.core.errors import LMSOptionError, UnknownSizeError
from lms_tf.core.ir import GraphIR, OpInfo, Phase, layer_of, same_device
from lms_tf.core.op_kinds import (
    REGROUPED_ARITHMETIC_TYPES,
    CONSTANT_PUSHDOWN_FAMILIES,
    CONSTANT_TYPES,
    CONTROL_FLOW_OP_TYPES,
    FUSABLE_GATE_TYPES,
    HOST_DTYPES,
    LAYER_OP_TYPES,
    LIST_CONSTRUCTOR_TYPES,
    METADATA_READER_TYPES,
    NEVER_CLONED_TYPES,
    VARIABLE_READ_TYPES,
    WHILE_OP_TYPES,
)
from lms_tf.core.plan import Decision, TensorDecision
from lms_tf.core.policy import Policies

_GLOB_CHARS = set("*?[")
#: How a decision's reason starts for a loop's accumulator that cannot be sized.
UNSIZED_LOOP_REASON = "unsized loop values"


def clonable(op: OpInfo) -> bool:
    """Whether the recompute pass may clone ``op``: not stateful, not in :data:`NEVER_CLONED_TYPES`.

    Examples:
        >>> from lms_tf.core.ir import OpInfo, Phase
        >>> clonable(OpInfo("p", "MaxPool", 0, Phase.FORWARD, "", (), (), ())), clonable(OpInfo("r", "Relu", 0, Phase.FORWARD, "", (), (), ()))
        (False, True)
    """
    return (not op.stateful or op.reads_state_only) and op.type not in NEVER_CLONED_TYPES


def is_loop_accumulator(ir: GraphIR, tensor: str) -> bool:
    """Whether ``tensor`` is a forward loop's sized TensorList accumulator that only loops read.

    The trace describes such a list by its elements (element dtype, ``(iterations, *shape)``); its
    readers are the gradient loop (and nothing that would need the list inside a forward op).

    Examples:
        >>> from lms_tf.core import make_ir
        >>> ir = make_ir([dict(name="loop", type="While", outputs=[("loop:1", (20, 4, 16))]),
        ...               dict(name="grad", type="StatelessWhile", inputs=["loop:1"], phase="backward")])
        >>> is_loop_accumulator(ir, "loop:1")
        True
    """
    info = ir.tensors[tensor]
    return (ir.op(info.producer).type in WHILE_OP_TYPES and info.nbytes is not None and bool(info.shape)
            and all(ir.op(c).type in WHILE_OP_TYPES for c in info.consumers))


def _is_glob(entry: str) -> bool:
    return bool(_GLOB_CHARS & set(entry))


def exclusion_matcher(ir: GraphIR, exclude: Sequence[str], scope_aliases: Mapping[str, str], option: str = "exclude"):
    """Returns op name -> matching exclude entry; raises for entries that match nothing.

    A plain entry names a name-scope segment (a layer) or an op; ``scope_aliases`` maps a
    Keras layer name to the scope it got in this trace (Keras/TF may suffix it, e.g. ``_1``).
    ``option`` is the option the entries came from (``exclude``, or ``recompute``'s list), which
    the error names.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> match = exclusion_matcher(chain_ir(), ["b", "g*"], {})
        >>> match("b"), match("g1"), match("a")
        ('b', 'g*', None)
    """
    scopes: Set[str] = set()
    for op in ir.ops:
        scopes.update(op.name.split("/")[:-1])
    targets = {entry: scope_aliases.get(entry, entry) for entry in exclude}
    for entry in exclude:
        if _is_glob(entry):
            if not any(fnmatch.fnmatchcase(op.name, entry) for op in ir.ops):
                raise LMSOptionError(
                    f"{option} pattern {entry!r} matches no op of the traced step. Patterns are matched "
                    f"against op names such as {ir.ops[len(ir.ops) // 2].name!r}; fix or remove it.")
        elif targets[entry] not in scopes and not any(op.name == entry for op in ir.ops):
            layers = sorted({layer_of(op.name).split("/")[-1] for op in ir.ops
                             if op.phase is Phase.FORWARD and op.type in LAYER_OP_TYPES} - {""})
            raise LMSOptionError(
                f"{option} entry {entry!r} is not a layer name or op name of the traced step. "
                f"Layers with compute ops in this trace: {', '.join(layers[:20])}"
                f"{' ...' if len(layers) > 20 else ''}. Use a layer name, an op name or a glob pattern "
                f"like '*/{entry}*/*'.")

    def match(op_name: str) -> Optional[str]:
        segments = op_name.split("/")
        for entry in exclude:
            if _is_glob(entry):
                if fnmatch.fnmatchcase(op_name, entry):
                    return entry
            elif entry == op_name or targets[entry] in segments[:-1]:
                return entry
        return None

    return match


def reads_value_in_backward(op: OpInfo) -> bool:
    """Whether ``op`` is a backward op that needs the values it reads (not only their shape).

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> ir = chain_ir()
        >>> reads_value_in_backward(ir.op("g1")), reads_value_in_backward(ir.op("b"))
        (True, False)
    """
    return op.phase is Phase.BACKWARD and op.type not in METADATA_READER_TYPES


def _after_the_forward_pass(ir: GraphIR) -> Set[str]:
    """Backward ops that have a forward ancestor at the end of the forward pass.

    Depth is the longest chain of data edges from the step's inputs. The end of the forward
    pass is the deepest level that at least half of the backward ops descend from: the gradient
    chain descends from the logits' side (the cross-entropy, the last activations), while the
    loss's own reductions feed only a few backward ops, and gradient-scoped shape bookkeeping or
    label handling descends from shallow ops only. Only ops at that level are sure to run after
    the forward pass; the others may run while it is still going.
    """
    depth: Dict[str, int] = {}
    reach: Dict[str, int] = {}  # deepest forward ancestor of each op
    for op in ir.ops:
        depth[op.name] = 1 + max((depth.get(ir.tensors[t].producer, 0) for t in op.inputs), default=0)
        levels = []
        for t in op.inputs:
            producer = ir.op(ir.tensors[t].producer)
            forward = producer.phase is Phase.FORWARD and producer.name in ir.data_dependent
            levels.append(depth[producer.name] if forward else reach.get(producer.name, 0))
        reach[op.name] = max(levels, default=0)
    backward_levels = sorted((reach[op.name] for op in ir.ops
                              if op.phase is Phase.BACKWARD and reach[op.name] > 0), reverse=True)
    if not backward_levels:
        return set()
    level = backward_levels[(len(backward_levels) - 1) // 2]  # at least half reach this deep
    return {op.name for op in ir.ops if op.phase is Phase.BACKWARD and reach[op.name] >= level}


def backward_gates(ir: GraphIR) -> List[OpInfo]:
    """Backward ops that can trigger a swap-in: they carry gradient data, so they run in the backward pass.

    An op Grappler folds into another (:attr:`GraphIR.grappler_rewritten`, when the caller found
    them) is never one: the gate's extra reader would stop the rewrite and change the numbers.
    A recompute gate is also never an op Grappler may absorb into its reader's tree
    (:attr:`Candidates.recompute_gates`).
    Nor is an op run off the device (:attr:`GraphIR.host_placed`: the update on the host, or in a
    pipeline stage's view, another stage's ops): the swap-in would wait for another device's
    progress."""
    candidates = []
    after_forward = _after_the_forward_pass(ir)
    for op in ir.ops:
        if (op.phase is not Phase.BACKWARD or op.type in ("Const", "NoOp") or op.type in CONTROL_FLOW_OP_TYPES
                or op.type in FUSABLE_GATE_TYPES or op.name not in after_forward or op.name in ir.grappler_rewritten
                or op.name in ir.host_placed):
            continue
        gradient_input = any(ir.op(ir.tensors[t].producer).phase is Phase.BACKWARD
                             and ir.op(ir.tensors[t].producer).type != "Const" for t in op.inputs)
        numeric_output = any(ir.tensors[t].dtype not in ("resource", "variant", "string") for t in op.outputs)
        if gradient_input and numeric_output:
            candidates.append(op)
    return candidates


def regrouped_with_a_reader(ir: GraphIR, op: OpInfo) -> bool:
    """Whether Grappler's arithmetic optimizer may regroup ``op`` with the ops next to it: ``op``
    and one of its readers or one of its inputs' producers are all
    :data:`~lms_tf.core.op_kinds.REGROUPED_ARITHMETIC_TYPES` (a chain or a tree of them). It
    regroups only through ops with one reader and none that waits on them, so a gate reading
    ``op`` would change the plain step's arithmetic. Seen at run time, not in an offline run of
    Grappler: a LayerNorm's ``beta + mean * scale + x * scale`` tree, gated at its root, was
    summed in another order.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> ir = chain_ir()
        >>> regrouped_with_a_reader(ir, ir.op("a"))
        False
    """
    if op.type not in REGROUPED_ARITHMETIC_TYPES:
        return False
    readers = (c for t in op.outputs for c in ir.tensors[t].consumers)
    producers = (ir.tensors[t].producer for t in op.inputs if t in ir.tensors)
    return any(ir.op(name).type in REGROUPED_ARITHMETIC_TYPES for name in (*readers, *producers))


def absorbed_by_its_reader(ir: GraphIR, op: OpInfo) -> bool:
    """Whether Grappler's arithmetic optimizer may absorb ``op`` into the tree of the op that reads
    it: both are :data:`~lms_tf.core.op_kinds.REGROUPED_ARITHMETIC_TYPES` and that reader is its
    only one. It absorbs only such an op, and only when no control edge leaves it, so a recompute
    gate (a control edge out of its gate op) on ``op`` changes the tree and its rounding. The tree's
    root may drive control edges: gating it changes nothing.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> ir = chain_ir()   # g3 -> g2 -> g1, products in a chain
        >>> [absorbed_by_its_reader(ir, ir.op(name)) for name in ("g3", "g2", "g1", "b")]
        [True, True, False, False]
    """
    if op.type not in REGROUPED_ARITHMETIC_TYPES:
        return False
    readers = [c for t in op.outputs for c in ir.tensors[t].consumers]
    return len(readers) == 1 and ir.op(readers[0]).type in REGROUPED_ARITHMETIC_TYPES


def _accumulates(ir: GraphIR, op: OpInfo, tensor: str) -> bool:
    """Whether ``tensor`` is a loop output that starts as an empty (or reserved) TensorList: values
    the loop appends to, as opposed to a list it only passes through."""
    if op.type not in WHILE_OP_TYPES or tensor not in op.outputs:
        return False
    index = op.outputs.index(tensor)
    return index < len(op.inputs) and ir.op(ir.tensors[op.inputs[index]].producer).type in LIST_CONSTRUCTOR_TYPES


def _same_device(op_device: str, device: str) -> bool:
    """An op without a requested device is placed on the accelerator by TF's placer."""
    return not op_device or same_device(op_device, device)


def _ineligible(ir: GraphIR, op: OpInfo, tensor, readers, device: str, excluded_by) -> Optional[str]:
    """Why a forward tensor may be neither swapped nor recomputed, or None."""
    exclusion = excluded_by(op.name)
    if op.name in ir.function_inputs:
        return "function input"
    if op.type in VARIABLE_READ_TYPES or tensor.dtype == "resource":
        return "variable read"
    if op.name not in ir.data_dependent:
        return "derived from variables or constants only"
    if tensor.dtype == "variant" and _accumulates(ir, op, tensor.name) and any(c.type in WHILE_OP_TYPES for c in readers):
        return (f"{UNSIZED_LOOP_REASON}: the trip count or element shape of loop {op.name!r} is not static, "
                f"so its per-iteration values are neither counted nor moved")
    if tensor.dtype in HOST_DTYPES:
        return f"host-resident dtype ({tensor.dtype})"
    if not _same_device(op.device, device):
        return f"placed on {op.device}, not the managed device"
    if (op.type in CONTROL_FLOW_OP_TYPES or any(c.type in CONTROL_FLOW_OP_TYPES for c in readers)) and not (
            is_loop_accumulator(ir, tensor.name) and clonable(op)):
        return ("control-flow value (a loop whose per-iteration values are not TensorLists of a static size, "
                "whose functions change state, or whose variables are written before its gradient; while/cond "
                "bodies stay untouched)")
    if exclusion is not None:
        return f"excluded by {exclusion!r}"
    if any(c.phase is Phase.UPDATE for c in readers):
        return "read by an update op"
    if tensor.shape is None:
        return "rank unknown to TensorFlow's own shape inference (op-internal scratch output)"
    if _constant_pushed_into_reader(ir, op, readers):
        return ("constant factor Grappler regroups with a backward reader (ConstantPushDown); a copy or a clone "
                "in between would change the rounding")
    if _read_by_duplicate_backward_ops(ir, readers):
        return ("read by two identical backward ops that Grappler merges into one (a LayerNorm's gradient "
                "computes dy * scale twice); a copy or a clone would keep them apart and change the rounding")
    return None


def _read_by_duplicate_backward_ops(ir: GraphIR, readers) -> bool:
    """Whether two backward readers compute the same thing (same op type, same inputs in any
    order): Grappler's arithmetic optimizer merges them (``DedupComputations``), and what it
    rewrites after that, so the numbers, depends on it. When one of them reads a swap-in or a clone
    and the other does not, or each its own copy, they are no longer the same and stay apart."""
    seen = set()
    for reader in readers:
        # Arithmetic only: what Grappler regroups after merging them (shape ops and gradient
        # kernels merged or not compute the same values).
        if reader.phase is not Phase.BACKWARD or reader.type not in REGROUPED_ARITHMETIC_TYPES:
            continue
        key = (reader.type, tuple(sorted(reader.inputs)))
        if key in seen:
            return True
        seen.add(key)
    return False


def _constant_pushed_into_reader(ir: GraphIR, op: OpInfo, readers) -> bool:
    """Whether ``op`` is ``c * x`` (or ``c + x``) with a constant ``c`` and a backward reader of the same
    family, which Grappler's constant folding regroups with it."""
    family = next((f for f in CONSTANT_PUSHDOWN_FAMILIES if op.type in f), None)
    if family is None or not any(ir.op(ir.tensors[t].producer).type in CONSTANT_TYPES for t in op.inputs
                                 if t in ir.tensors):
        return False
    return any(c.type in family and c.phase is Phase.BACKWARD for c in readers)


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The forward tensors a backward op reads, and which of them a plan may move.

    Attributes:
        order: Every such tensor, in execution order.
        eligible: Those that may be swapped or recomputed.
        kept: Decisions (KEEP, with the reason) for the others.
        backward_of: Tensor -> its backward consumers.
        distance: Tensor -> ops between its producer and its first backward consumer.
        gates: Backward ops that can trigger a swap-in.
        gate_positions: Their execution indices.
        recompute_gates: Those of them that can gate a recompute: not an op Grappler may absorb into
            its reader's tree (:func:`absorbed_by_its_reader`). The clones wait on their gate
            through a control edge, and an op that drives one is never absorbed: on a GELU's
            gradient, clones gated on a backward ``Mul`` changed Adam's updates from the first
            step. Swap-ins keep every gate (docs/design.md says why).
        recompute_gate_positions: Their execution indices.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> collect_candidates(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0").eligible
        ()
    """

    order: Tuple[str, ...]
    eligible: Tuple[str, ...]
    kept: Mapping[str, TensorDecision]
    backward_of: Mapping[str, Tuple[OpInfo, ...]]
    distance: Mapping[str, int]
    gates: Tuple[OpInfo, ...]
    gate_positions: Tuple[int, ...]
    recompute_gates: Tuple[OpInfo, ...] = ()
    recompute_gate_positions: Tuple[int, ...] = ()

    def gates_before(self, index: int) -> int:
        """How many gates run before the op at execution index ``index`` (``gates[n - 1]`` is the last).

        Examples:
            >>> from lms_tf.core.ir import GraphIR
            >>> collect_candidates(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0").gates_before(5)
            0
        """
        return bisect.bisect_left(self.gate_positions, index)

    def recompute_gates_before(self, index: int) -> int:
        """How many recompute gates run before the op at execution index ``index``
        (``recompute_gates[n - 1]`` is the last).

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> found = collect_candidates(chain_ir(), Policies(), device="/device:GPU:0")
            >>> found.recompute_gates_before(len(chain_ir().ops)) <= found.gates_before(len(chain_ir().ops))
            True
        """
        return bisect.bisect_left(self.recompute_gate_positions, index)


def collect_candidates(ir: GraphIR, policies: Policies, *, device: str,
                       scope_aliases: Optional[Mapping[str, str]] = None) -> Candidates:
    """Finds the forward tensors the backward pass reads and which of them may be moved.

    Raises:
        LMSOptionError: An ``exclude`` entry matches nothing in the step.
        GraphAnalysisError: A movable tensor has an unresolvable size.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> collect_candidates(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0").order
        ()
    """
    excluded_by = exclusion_matcher(ir, policies.exclude, scope_aliases or {})
    gates = backward_gates(ir)
    order: List[str] = []
    kept: Dict[str, TensorDecision] = {}
    backward_of: Dict[str, Tuple[OpInfo, ...]] = {}
    distances: Dict[str, int] = {}
    eligible: List[str] = []
    for op in ir.ops:
        if op.phase is not Phase.FORWARD:
            continue
        for name in op.outputs:
            tensor = ir.tensors[name]
            readers = [ir.op(c) for c in tensor.consumers]
            backward = tuple(c for c in readers if reads_value_in_backward(c))
            if not backward:
                continue
            order.append(name)
            backward_of[name] = backward
            distances[name] = distance = min(c.index for c in backward) - op.index
            reason = _ineligible(ir, op, tensor, readers, device, excluded_by)
            if reason is None and tensor.nbytes is None:
                raise UnknownSizeError(
                    f"cannot size tensor {name!r} (shape {tensor.shape}, dtype {tensor.dtype}): a dimension is "
                    f"unknown and could not be resolved from the traced inputs "
                    f"(resolved: {dict(ir.resolved_dims) or 'none'}). Pass batch_size=<int> to lms-tf, or "
                    f"trace the step with a fully defined input_signature.", tensor=name, shape=tensor.shape)
            if reason is not None:
                kept[name] = TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes,
                                            Decision.KEEP, reason, distance, ())
            else:
                eligible.append(name)
    recompute_gates = tuple(op for op in gates if not absorbed_by_its_reader(ir, op))
    return Candidates(tuple(order), tuple(eligible), kept, backward_of, distances, tuple(gates),
                      tuple(op.index for op in gates), recompute_gates, tuple(op.index for op in recompute_gates))
