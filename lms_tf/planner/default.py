"""The default plan until the budget planner exists: TFLMS-style swaps plus a recompute policy.

Swap: a forward tensor is swapped when the backward pass reads it, its first backward
consumer runs at least ``swapout_threshold`` ops after its producer, it is at least
``min_swap_bytes`` big, and it is eligible (not a variable read, function input,
host-resident value, control-flow value, or excluded by the user).

Recompute (``recompute=``): ``"sqrt"`` keeps about sqrt(n) of the n articulation
tensors (the only batch-derived value alive at that point of the forward pass) as
checkpoints, spaced for equal activation bytes per segment, and recomputes every other
activation (Chen et al. 2016); ``"cheap"`` recomputes outputs of :data:`CHEAP_OP_TYPES`
from the articulation tensors and expensive outputs; a list names layers or op patterns.
A recomputed tensor overrides a swap; the checkpoints its clones start from may be
swapped (KARMA). Stateful ops (variable reads, random ops with hidden state) are never
cloned; stateless random ops are, with their seed tensor from the forward pass, so they
give the same values.

Example:
    >>> import tensorflow as tf
    >>> from lms_tf.tf.trace import build_ir
    >>> from lms_tf.core.policy import Policies
    >>> w = tf.Variable(tf.ones((64, 64)))
    >>> @tf.function
    ... def step(x):
    ...     with tf.GradientTape() as tape:
    ...         h = x
    ...         for _ in range(4):
    ...             h = tf.nn.relu(h @ w)
    ...         loss = tf.reduce_sum(h)
    ...     w.assign_sub(tape.gradient(loss, w))
    ...     return loss
    >>> ir = build_ir(step.get_concrete_function(tf.ones((256, 64))).graph)
    >>> opts = Policies(host="/CPU:1", swapout_threshold=4, swapin_ahead=1, min_swap_bytes=1)
    >>> plan = make_plan(ir, opts, device="/device:CPU:0")
    >>> [d.tensor for d in plan.swapped]   # the last one is read by the very first gradient op
    ['Relu:0', 'Relu_1:0', 'Relu_2:0']
"""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from lms_tf.core.errors import GraphAnalysisError, LMSOptionError
from lms_tf.core.ir import GraphIR, OpInfo, Phase, device_kind_and_index, layer_of
from lms_tf.core.op_kinds import (
    CHEAP_OP_TYPES,
    CONTROL_FLOW_OP_TYPES,
    DATA_SOURCE_OP_TYPES,
    FUSABLE_GATE_TYPES,
    HOST_DTYPES,
    LAYER_OP_TYPES,
    METADATA_READER_TYPES,
    NEVER_CLONED_TYPES,
    VARIABLE_READ_TYPES,
)
from lms_tf.core.plan import Decision, Plan, SwapIn, TensorDecision
from lms_tf.core.policy import Policies

_GLOB_CHARS = set("*?[")


def clonable(op: OpInfo) -> bool:
    """Whether the recompute pass may clone ``op``: not stateful, not in :data:`NEVER_CLONED_TYPES`.

    Example:
        >>> from lms_tf.core.ir import OpInfo, Phase
        >>> clonable(OpInfo("p", "MaxPool", 0, Phase.FORWARD, "", (), (), ())), clonable(OpInfo("r", "Relu", 0, Phase.FORWARD, "", (), (), ()))
        (False, True)
    """
    return not op.stateful and op.type not in NEVER_CLONED_TYPES




def _is_glob(entry: str) -> bool:
    return bool(_GLOB_CHARS & set(entry))


def _exclusion_matcher(ir: GraphIR, exclude: Sequence[str], scope_aliases: Mapping[str, str]):
    """Returns op name -> matching exclude entry; raises for entries that match nothing.

    A plain entry names a name-scope segment (a layer) or an op; ``scope_aliases`` maps a
    Keras layer name to the scope it got in this trace (Keras/TF may suffix it, e.g. ``_1``).
    """
    scopes: Set[str] = set()
    for op in ir.ops:
        scopes.update(op.name.split("/")[:-1])
    targets = {entry: scope_aliases.get(entry, entry) for entry in exclude}
    for entry in exclude:
        if _is_glob(entry):
            if not any(fnmatch.fnmatchcase(op.name, entry) for op in ir.ops):
                raise LMSOptionError(
                    f"exclude pattern {entry!r} matches no op of the traced step. Patterns are matched "
                    f"against op names such as {ir.ops[len(ir.ops) // 2].name!r}; fix or remove it.")
        elif targets[entry] not in scopes and not any(op.name == entry for op in ir.ops):
            layers = sorted({layer_of(op.name).split("/")[-1] for op in ir.ops
                             if op.phase is Phase.FORWARD and op.type in LAYER_OP_TYPES} - {""})
            raise LMSOptionError(
                f"exclude entry {entry!r} is not a layer name or op name of the traced step. "
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




def _reads_value_in_backward(op: OpInfo) -> bool:
    """Whether ``op`` is a backward op that needs the values it reads (not only their shape)."""
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


def _gate_candidates(ir: GraphIR) -> List[OpInfo]:
    """Backward ops that can trigger a swap-in: they carry gradient data, so they run in the backward pass."""
    candidates = []
    after_forward = _after_the_forward_pass(ir)
    for op in ir.ops:
        if (op.phase is not Phase.BACKWARD or op.type in ("Const", "NoOp") or op.type in CONTROL_FLOW_OP_TYPES
                or op.type in FUSABLE_GATE_TYPES or op.name not in after_forward):
            continue
        gradient_input = any(ir.op(ir.tensors[t].producer).phase is Phase.BACKWARD
                             and ir.op(ir.tensors[t].producer).type != "Const" for t in op.inputs)
        numeric_output = any(ir.tensors[t].dtype not in ("resource", "variant", "string") for t in op.outputs)
        if gradient_input and numeric_output:
            candidates.append(op)
    return candidates


def _same_device(op_device: str, device: str) -> bool:
    """An op without a requested device is placed on the accelerator by TF's placer."""
    return not op_device or device_kind_and_index(op_device) == device_kind_and_index(device)


def _ineligible(ir: GraphIR, op: OpInfo, tensor, readers, device: str, excluded_by) -> Optional[str]:
    """Why a forward tensor may be neither swapped nor recomputed, or None."""
    exclusion = excluded_by(op.name)
    if op.name in ir.function_inputs:
        return "function input"
    if op.type in VARIABLE_READ_TYPES or tensor.dtype == "resource":
        return "variable read"
    if op.name not in ir.data_dependent:
        return "derived from variables or constants only"
    if tensor.dtype in HOST_DTYPES:
        return f"host-resident dtype ({tensor.dtype})"
    if not _same_device(op.device, device):
        return f"placed on {op.device}, not the managed device"
    if op.type in CONTROL_FLOW_OP_TYPES or any(c.type in CONTROL_FLOW_OP_TYPES for c in readers):
        return "control-flow value (while/cond bodies stay untouched)"
    if exclusion is not None:
        return f"excluded by {exclusion!r}"
    if any(c.phase is Phase.UPDATE for c in readers):
        return "read by an update op"
    if tensor.shape is None:
        return "rank unknown to TensorFlow's own shape inference (op-internal scratch output)"
    return None


def _swap_decision(ir: GraphIR, op: OpInfo, tensor, backward, distance, policies: Policies,
                   gates: Sequence[OpInfo], gate_positions: Sequence[int]) -> TensorDecision:
    name = tensor.name

    def keep(reason: str) -> TensorDecision:
        return TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes, Decision.KEEP, reason,
                              distance, ())

    if distance < policies.swapout_threshold:
        return keep(f"needed again after {distance} ops (< swapout_threshold={policies.swapout_threshold})")
    if tensor.nbytes < policies.min_swap_bytes:
        return keep(f"smaller than min_swap_bytes ({tensor.nbytes} < {policies.min_swap_bytes})")
    groups: List[List[OpInfo]] = []
    for consumer in sorted(backward, key=lambda c: c.index):
        if groups and consumer.index - groups[-1][0].index <= policies.swapin_groupby:
            groups[-1].append(consumer)
        else:
            groups.append([consumer])
    swap_ins = []
    for group in groups:
        before = bisect.bisect_left(gate_positions, group[0].index)
        if before == 0:
            return keep("no backward op runs before its first backward consumer to trigger a swap-in")
        trigger = gates[max(0, before - policies.swapin_ahead)]
        swap_ins.append(SwapIn(trigger.name, tuple(c.name for c in group)))
    return TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes, Decision.SWAP, "swap", distance,
                          tuple(swap_ins))


def articulation_count(ir: GraphIR) -> int:
    """How many articulation tensors the forward pass has (segment boundaries for ``"sqrt"``).

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> articulation_count(GraphIR((), {}, frozenset(), {}))
        0
    """
    return len(_articulation_tensors(ir))


def _articulation_tensors(ir: GraphIR) -> List[str]:
    """Forward tensors that are the only batch-derived value alive at their point of the forward pass.

    Every later forward op depends on the batch only through such a tensor, so a
    checkpoint there cuts the graph: recomputing anything after it never needs anything
    before it (Chen et al. 2016 checkpoint these "articulation points").
    """
    forward = [op for op in ir.ops if op.phase is Phase.FORWARD]
    position = {op.name: i for i, op in enumerate(forward)}
    last_use: Dict[str, int] = {}
    for op in forward:
        # Inputs themselves (the batch, the labels the loss reads at the end) are not activations.
        if op.name not in ir.data_dependent or op.name in ir.function_inputs or op.type in DATA_SOURCE_OP_TYPES:
            continue
        for t in op.outputs:
            uses = [position[c] for c in ir.tensors[t].consumers if c in position]
            if uses and ir.tensors[t].dtype not in HOST_DTYPES:
                last_use[t] = max(uses)
    ends: Dict[int, int] = {}
    for t, end in last_use.items():
        ends[end] = ends.get(end, 0) + 1
    live, cuts = 0, []
    for i, op in enumerate(forward):
        produced = [t for t in op.outputs if t in last_use]
        live += len(produced) - ends.get(i, 0)
        if live == 1 and len(produced) == 1 and last_use[produced[0]] > i:
            cuts.append(produced[0])
    return cuts


def _balanced_checkpoints(ir: GraphIR, cuts: Sequence[str], activations: Sequence[str],
                          segments: Optional[int] = None) -> Set[str]:
    """About sqrt(n) of the n articulation tensors, spaced so each segment holds equal activation bytes.

    Chen et al. balance segments by memory, not by count: the early stages of a CNN hold
    much larger activations than the late ones.
    """
    segments = segments or max(1, math.ceil(math.sqrt(len(cuts))))
    index = {t: ir.op(ir.tensors[t].producer).index for t in activations}
    ordered = sorted(activations, key=index.get)
    total = sum(ir.tensors[t].nbytes or 0 for t in ordered) or 1
    target = total / segments
    cut_positions = sorted((index[t], t) for t in cuts)
    checkpoints: Set[str] = set()
    acc, next_cut = 0, 0
    for t in ordered:
        acc += ir.tensors[t].nbytes or 0
        while next_cut < len(cut_positions) and cut_positions[next_cut][0] <= index[t]:
            if acc >= target:
                checkpoints.add(cut_positions[next_cut][1])
                acc = 0
            next_cut += 1
    return checkpoints


def _recompute_targets(ir: GraphIR, eligible: Sequence[str], policies: Policies,
                       scope_aliases: Mapping[str, str], segments: Optional[int] = None):
    """The tensors the policy recomputes, the segment each belongs to, and which pure
    intermediates a clone may recompute through.

    Tensors of one segment share one gate, so the segment is recomputed once in the
    backward pass (Chen et al.). Segments run between articulation tensors: with "sqrt"
    about sqrt(n) of the n articulation tensors, spaced for equal activation bytes per
    segment, are kept as checkpoints and the rest of the activations are recomputed; with "cheap" and named policies every
    articulation tensor is a checkpoint that bounds a segment.
    """
    clonable_tensors = [t for t in eligible if clonable(ir.op(ir.tensors[t].producer))]
    eligible_set = set(clonable_tensors)
    cuts = [t for t in _articulation_tensors(ir) if t in eligible_set]
    index = lambda t: ir.op(ir.tensors[t].producer).index  # noqa: E731
    policy = policies.recompute
    if policy == "sqrt":
        if len(cuts) < 4:  # no usable articulation points: fall back to evenly spaced checkpoints
            cuts = sorted(clonable_tensors, key=index)
        checkpoints = _balanced_checkpoints(ir, cuts, clonable_tensors, segments)
        selected = [t for t in clonable_tensors if t not in checkpoints]
        bounds = sorted(index(t) for t in checkpoints)
        through = lambda op: True  # noqa: E731
    else:
        if policy == "cheap":
            # Articulation tensors stay as checkpoints: a residual chain is all cheap ops (Add, Relu),
            # and recomputing through it would reach back to the first block from every block.
            cut_set = set(cuts)
            selected = [t for t in clonable_tensors if ir.op(ir.tensors[t].producer).type in CHEAP_OP_TYPES
                        and t not in cut_set]
            through = lambda op: op.type in CHEAP_OP_TYPES  # noqa: E731
        else:  # named layers / patterns: exactly what the user asked for
            matcher = _exclusion_matcher(ir, policy, scope_aliases)
            selected = [t for t in clonable_tensors if matcher(ir.tensors[t].producer) is not None]
            through = lambda op: matcher(op.name) is not None  # noqa: E731
        bounds = sorted(index(t) for t in cuts)
    segment = {t: bisect.bisect_left(bounds, index(t)) for t in selected}
    return segment, through


class _RegionFinder:
    """Forward ops to clone to produce a tensor again from its nearest checkpoints, memoised per
    op: regions of one segment overlap, so each op's own region is found once."""

    def __init__(self, ir: GraphIR, targets: Set[str], through):
        self.ir, self.targets, self.through = ir, targets, through
        self.memo: Dict[str, frozenset] = {}

    def _extends_through(self, t: str) -> bool:
        ir = self.ir
        info = ir.tensors[t]
        if t in self.targets:
            return True
        producer = ir.op(info.producer)
        return (producer.phase is Phase.FORWARD and producer.name in ir.data_dependent
                and clonable(producer) and producer.name not in ir.function_inputs
                and producer.type not in CONTROL_FLOW_OP_TYPES and producer.type not in VARIABLE_READ_TYPES
                and info.dtype not in ("resource", "variant")
                and not any(_reads_value_in_backward(ir.op(c)) for c in info.consumers)
                and self.through(producer))  # a pure intermediate: recompute it too

    def op_region(self, name: str) -> frozenset:
        ir, memo = self.ir, self.memo
        stack = [(name, False)]
        while stack:
            current, expanded = stack.pop()
            if current in memo:
                continue
            feeders = [ir.tensors[t].producer for t in ir.op(current).inputs if self._extends_through(t)]
            if not expanded:
                stack.append((current, True))
                stack.extend((f, False) for f in feeders if f not in memo)
                continue
            region = {current}
            for feeder in feeders:
                region |= memo.get(feeder, frozenset((feeder,)))  # a cycle cannot occur in a DAG
            memo[current] = frozenset(region)
        return memo[name]

    def region(self, tensor: str) -> Tuple[str, ...]:
        ir = self.ir
        return tuple(sorted(self.op_region(ir.tensors[tensor].producer), key=lambda n: ir.op(n).index))


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The forward tensors a backward op reads, and which of them a plan may move.

    Attributes:
        order: Every such tensor, in execution order.
        eligible: Those that may be swapped or recomputed.
        kept: Decisions (KEEP, with the reason) for the others.
        backward_of: Tensor -> its backward consumers.
        distance: Tensor -> ops between its producer and its first backward consumer.
        gates: Backward ops that can trigger a swap-in or gate a recompute.
        gate_positions: Their execution indices.

    Example:
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

    def gates_before(self, index: int) -> int:
        """How many gates run before the op at execution index ``index`` (``gates[n - 1]`` is the last).

        Example:
            >>> from lms_tf.core.ir import GraphIR
            >>> collect_candidates(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0").gates_before(5)
            0
        """
        return bisect.bisect_left(self.gate_positions, index)


def collect_candidates(ir: GraphIR, policies: Policies, *, device: str,
                       scope_aliases: Optional[Mapping[str, str]] = None) -> Candidates:
    """Finds the forward tensors the backward pass reads and which of them may be moved.

    Raises:
        LMSOptionError: An ``exclude`` entry matches nothing in the step.
        GraphAnalysisError: A movable tensor has an unresolvable size.

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> collect_candidates(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0").order
        ()
    """
    excluded_by = _exclusion_matcher(ir, policies.exclude, scope_aliases or {})
    gates = _gate_candidates(ir)
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
            backward = tuple(c for c in readers if _reads_value_in_backward(c))
            if not backward:
                continue
            order.append(name)
            backward_of[name] = backward
            distances[name] = distance = min(c.index for c in backward) - op.index
            reason = _ineligible(ir, op, tensor, readers, device, excluded_by)
            if reason is None and tensor.nbytes is None:
                raise GraphAnalysisError(
                    f"cannot size tensor {name!r} (shape {tensor.shape}, dtype {tensor.dtype}): a dimension is "
                    f"unknown and could not be resolved from the traced inputs "
                    f"(resolved: {dict(ir.resolved_dims) or 'none'}). Pass batch_size=<int> to lms-tf, or "
                    f"trace the step with a fully defined input_signature.")
            if reason is not None:
                kept[name] = TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes,
                                            Decision.KEEP, reason, distance, ())
            else:
                eligible.append(name)
    return Candidates(tuple(order), tuple(eligible), kept, backward_of, distances, tuple(gates),
                      tuple(op.index for op in gates))


def checkpoint_gates(ir: GraphIR, found: Candidates, tensor: str,
                     recomputed: Iterable[TensorDecision]) -> Tuple[str, ...]:
    """Gates that may run the clones of a checkpoint recomputed too (``make_plan(also_recompute=)``).

    The first is the earliest gate of the recompute regions that read the checkpoint, if it runs
    before the checkpoint's own backward readers: one clone serves the regions and the readers,
    and is held from that gate to the last reader. The second is the gate just before its first
    backward reader: the regions clone it again for themselves, but the clone is held less long.
    None if no gate runs before its first backward reader.

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> found = collect_candidates(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0")
        >>> checkpoint_gates(GraphIR((), {}, frozenset(), {}), found, "t:0", [])
        ()
    """
    readers = found.backward_of.get(tensor)
    before = found.gates_before(min(c.index for c in readers)) if readers else 0
    if before == 0:
        return ()
    own = found.gates[before - 1]
    positions = {g.name: g.index for g in found.gates}
    shared = [d.gate for d in recomputed if d.gate in positions and positions[d.gate] < own.index
              and any(tensor in ir.op(name).inputs for name in d.recompute_ops)]
    return tuple(([min(shared, key=positions.get)] if shared else []) + [own.name])


def _check_also_recompute(ir: GraphIR, found: Candidates, deeper: Mapping[str, str]) -> None:
    eligible = set(found.eligible)
    gate_index = {g.name: g.index for g in found.gates}
    for tensor, gate in deeper.items():
        if tensor not in eligible or not clonable(ir.op(ir.tensors[tensor].producer)):
            raise LMSOptionError(
                f"also_recompute: {tensor!r} cannot be recomputed: it is not a forward tensor the backward pass "
                f"reads that may be moved, made by a clonable op. Name one of Candidates.eligible whose producer "
                f"is stateless.")
        first_reader = min(c.index for c in found.backward_of[tensor])
        if gate not in gate_index or gate_index[gate] >= first_reader:
            raise LMSOptionError(
                f"also_recompute: gate {gate!r} of {tensor!r} is not a backward op that runs before the tensor's "
                f"first backward reader, so its clone could not run in time. Use one of checkpoint_gates(...): "
                f"{list(checkpoint_gates(ir, found, tensor, ()))}.")


def make_plan(ir: GraphIR, policies: Policies, *, device: str,
              scope_aliases: Optional[Mapping[str, str]] = None, sqrt_segments: Optional[int] = None,
              candidates: Optional["Candidates"] = None, also_recompute: Optional[Mapping[str, str]] = None) -> Plan:
    """Makes the default plan for a traced step: swaps (TFLMS rule) and the recompute policy.

    Args:
        ir: The step's IR.
        policies: Validated policies.
        device: Full name of the managed accelerator.
        scope_aliases: Keras layer name -> its name scope in this trace, for ``exclude``.
        sqrt_segments: With ``recompute="sqrt"``, the number of segments (default: about the
            square root of the number of articulation tensors). The budget planner tries several.
        candidates: The step's :func:`collect_candidates` for these policies, if already known.
        also_recompute: Checkpoints of the recompute policy to recompute too, from the checkpoints
            before them (recursive recompute: more compute, fewer bytes kept or swapped), each
            mapped to its gate (one of :func:`checkpoint_gates`). The budget planner picks these.

    Returns:
        The plan, with one decision per forward tensor that a backward op reads.

    Raises:
        LMSOptionError: An ``exclude`` entry matches nothing in the step, or an ``also_recompute``
            entry is not a movable tensor made by a clonable op, or its gate does not run before
            the tensor's backward readers.
        GraphAnalysisError: A tensor that would be swapped has an unresolvable size.

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> make_plan(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0").decisions
        ()
    """
    aliases = scope_aliases or {}
    found = candidates or collect_candidates(ir, policies, device=device, scope_aliases=aliases)
    gates, gate_positions, backward_of, eligible = (found.gates, found.gate_positions, found.backward_of,
                                                    found.eligible)
    order = found.order
    decisions: Dict[str, TensorDecision] = dict(found.kept)
    for name in eligible:
        op, tensor = ir.op(ir.tensors[name].producer), ir.tensors[name]
        distance = found.distance[name]
        if policies.swap:
            decisions[name] = _swap_decision(ir, op, tensor, backward_of[name], distance, policies, gates,
                                             gate_positions)
        else:
            decisions[name] = TensorDecision(name, layer_of(op.name), tensor.shape, tensor.nbytes,
                                             Decision.KEEP, "swap=False", distance, ())

    if policies.recompute:
        segment_of, through = _recompute_targets(ir, eligible, policies, aliases, sqrt_segments)
        # A tensor read before any gate can run (label handling at the very start of the backward
        # pass) cannot be recomputed; it must not drag its segment's shared gate before every gate.
        segment_of = {name: seg for name, seg in segment_of.items()
                      if found.gates_before(min(c.index for c in backward_of[name])) > 0}
        deeper = {t: gate for t, gate in (also_recompute or {}).items() if t not in segment_of}
        _check_also_recompute(ir, found, deeper)
        targets = set(segment_of) | set(deeper)
        regions = _RegionFinder(ir, targets, through)
        first_use: Dict[int, int] = {}
        for name, seg in segment_of.items():
            first = min(c.index for c in backward_of[name])
            first_use[seg] = min(first, first_use.get(seg, first))
        for name in eligible:
            if name in deeper:
                old = decisions[name]
                decisions[name] = TensorDecision(
                    name, old.layer, old.shape, old.nbytes, Decision.RECOMPUTE,
                    "recompute (a checkpoint, from the checkpoints before it)", old.distance, (),
                    recompute_ops=regions.region(name), gate=deeper[name],
                    consumers=tuple(c.name for c in sorted(backward_of[name], key=lambda c: c.index)))
                continue
            if name not in targets:
                producer = ir.op(ir.tensors[name].producer)
                if not clonable(producer) and decisions[name].decision is Decision.KEEP:
                    decisions[name] = dataclasses.replace(
                        decisions[name], reason="stateful op: never recomputed" if producer.stateful else
                        f"{producer.type}: never recomputed (oneDNN pairs its gradient with its workspace)")
                continue
            before = found.gates_before(first_use[segment_of[name]])
            if before == 0:
                continue
            old = decisions[name]
            why = f"recompute ({policies.recompute})" if isinstance(policies.recompute, str) else "recompute (named)"
            decisions[name] = TensorDecision(
                name, old.layer, old.shape, old.nbytes, Decision.RECOMPUTE, why, old.distance, (),
                recompute_ops=regions.region(name), gate=gates[before - 1].name,
                consumers=tuple(c.name for c in sorted(backward_of[name], key=lambda c: c.index)))

    return Plan(decisions=tuple(decisions[n] for n in order), device=device, host=policies.host,
                policies=policies.to_dict(), phase_counts=ir.phase_counts())
