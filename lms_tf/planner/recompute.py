"""Recompute policies: which forward tensors are computed again in the backward pass, from which checkpoints.

``"sqrt"`` keeps about sqrt(n) of the n articulation tensors (the only batch-derived value
alive at that point of the forward pass) as checkpoints, spaced for equal activation bytes per
segment, and recomputes every other activation (Chen et al. 2016); ``"cheap"`` recomputes the
outputs of cheap op types (:data:`lms_tf.core.op_kinds.CHEAP_OP_TYPES`) from the articulation
tensors and expensive outputs; a list names layers or op patterns. Each segment is recomputed
once, behind one gate. A checkpoint may itself be recomputed from the checkpoints before it
(``also_recompute``: recursive recompute, which the budget planner chooses per checkpoint).

Examples:
    >>> from lms_tf.core import make_ir
    >>> articulation_count(make_ir([]))
    0
"""

from __future__ import annotations

import bisect
import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import GraphIR, Phase
from lms_tf.core.op_kinds import (
    CHEAP_OP_TYPES,
    CONTROL_FLOW_OP_TYPES,
    DATA_SOURCE_OP_TYPES,
    HOST_DTYPES,
    VARIABLE_READ_TYPES,
)
from lms_tf.core.plan import TensorDecision
from lms_tf.core.policy import Policies
from lms_tf.planner.candidates import Candidates, clonable, exclusion_matcher, reads_value_in_backward


def articulation_count(ir: GraphIR) -> int:
    """How many articulation tensors the forward pass has (segment boundaries for ``"sqrt"``).

    Examples:
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


def recompute_targets(ir: GraphIR, eligible: Sequence[str], policies: Policies,
                       scope_aliases: Mapping[str, str], segments: Optional[int] = None):
    """The tensors the policy recomputes, the segment each belongs to, and which pure
    intermediates a clone may recompute through.

    Tensors of one segment share one gate, so the segment is recomputed once in the
    backward pass (Chen et al.). Segments run between articulation tensors: with "sqrt"
    about sqrt(n) of the n articulation tensors, spaced for equal activation bytes per
    segment, are kept as checkpoints and the rest of the activations are recomputed; with "cheap" and named policies every
    articulation tensor is a checkpoint that bounds a segment.

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import chain_ir
        >>> segments, _ = recompute_targets(chain_ir(), ["a:0", "b:0", "c:0"], Policies(recompute="sqrt"), {})
        >>> segments   # b is kept as the checkpoint; a and c are recomputed, each in its segment
        {'a:0': 0, 'c:0': 1}
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
            matcher = exclusion_matcher(ir, policy, scope_aliases, option="recompute")
            selected = [t for t in clonable_tensors if matcher(ir.tensors[t].producer) is not None]
            through = lambda op: matcher(op.name) is not None  # noqa: E731
        bounds = sorted(index(t) for t in cuts)
    segment = {t: bisect.bisect_left(bounds, index(t)) for t in selected}
    return segment, through


class RegionFinder:
    """Forward ops to clone to produce a tensor again from its nearest checkpoints, memoised per
    op: regions of one segment overlap, so each op's own region is found once.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> RegionFinder(chain_ir(), {"b:0", "c:0"}, through=lambda op: True).region("c:0")
        ('b', 'c')
    """

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
                and not any(reads_value_in_backward(ir.op(c)) for c in info.consumers)
                and self.through(producer))  # a pure intermediate: recompute it too

    def op_region(self, name: str) -> frozenset:
        """The forward ops that recompute op ``name`` from the nearest checkpoints (memoised).

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> sorted(RegionFinder(chain_ir(), {"b:0", "c:0"}, through=lambda op: True).op_region("c"))
            ['b', 'c']
        """
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
        """The ops to clone to produce ``tensor`` again, in execution order.

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> RegionFinder(chain_ir(), {"c:0"}, through=lambda op: True).region("c:0")
            ('c',)
        """
        ir = self.ir
        return tuple(sorted(self.op_region(ir.tensors[tensor].producer), key=lambda n: ir.op(n).index))


def checkpoint_gates(ir: GraphIR, found: Candidates, tensor: str,
                     recomputed: Iterable[TensorDecision]) -> Tuple[str, ...]:
    """Gates that may run the clones of a checkpoint recomputed too (``make_plan(also_recompute=)``).

    The first is the earliest gate of the recompute regions that read the checkpoint, if it runs
    before the checkpoint's own backward readers: one clone serves the regions and the readers,
    and is held from that gate to the last reader. The second is the gate just before its first
    backward reader: the regions clone it again for themselves, but the clone is held less long.
    None if no gate runs before its first backward reader.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> from lms_tf.planner.candidates import collect_candidates
        >>> found = collect_candidates(GraphIR((), {}, frozenset(), {}), Policies(), device="/device:GPU:0")
        >>> checkpoint_gates(GraphIR((), {}, frozenset(), {}), found, "t:0", [])
        ()
    """
    readers = found.backward_of.get(tensor)
    before = found.recompute_gates_before(min(c.index for c in readers)) if readers else 0
    if before == 0:
        return ()
    own = found.recompute_gates[before - 1]
    positions = {g.name: g.index for g in found.recompute_gates}
    shared = [d.gate for d in recomputed if d.gate in positions and positions[d.gate] < own.index
              and any(tensor in ir.op(name).inputs for name in d.recompute_ops)]
    return tuple(([min(shared, key=positions.get)] if shared else []) + [own.name])


def check_also_recompute(ir: GraphIR, found: Candidates, deeper: Mapping[str, str]) -> None:
    """Raises the library's error for an ``also_recompute`` entry that cannot be recomputed in time.

    Examples:
        >>> from lms_tf.core import Policies
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.planner.candidates import collect_candidates
        >>> ir = chain_ir()
        >>> check_also_recompute(ir, collect_candidates(ir, Policies(), device="/device:GPU:0"), {"x:0": "g2"})
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: also_recompute: 'x:0' cannot be recomputed: it is not a forward tensor the backward pass reads that may be moved, made by a clonable op. Name one of Candidates.eligible whose producer is stateless.
    """
    eligible = set(found.eligible)
    gate_index = {g.name: g.index for g in found.recompute_gates}
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
