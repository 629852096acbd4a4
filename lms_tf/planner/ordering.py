"""Backward branch ordering: two branches alive together at the peak, made to run one after the other.

The executor runs ready ops first come, first served, so two independent backward branches (a
residual block's shortcut and main path) run interleaved and hold both branches' temporaries at
once. One branch waiting for the other halves that working set.

Examples:
    >>> from lms_tf.core import make_ir
    >>> BranchOrdering(make_ir([])).ordering(("a",), ("b",)) is None
    True
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

from lms_tf.core.ir import GraphIR, Phase, device_kind_and_index, layer_of
from lms_tf.core.op_kinds import FUSABLE_GATE_PARTNER_TYPES, FUSABLE_GATE_TYPES
from lms_tf.core.plan import Ordering
from lms_tf.simulate import Simulation

#: How many of the largest backward temporaries alive at the peak are paired up when looking
#: for two branches to run one after the other.
ORDERING_CANDIDATES = 8
#: How many of those pairs (largest first) are tried per round.
ORDERING_PAIRS = 3


class BranchOrdering:
    """The backward graph's reachability, for finding branches and ordering them without a cycle
    (``device``: where the ops without a device of their own run).

    Examples:
        >>> from lms_tf.core import make_ir
        >>> BranchOrdering(make_ir([])).ir.ops
        ()
    """

    def __init__(self, ir: GraphIR, device: str = ""):
        self.ir = ir
        self.device = device  # where the ops without a device of their own run
        self._successors: Optional[Dict[str, List[str]]] = None
        self._paths: Dict[str, List[str]] = {}

    def _backward_graph(self) -> Tuple[Dict[str, List[str]], Dict[str, List[str]]]:
        """Successors (data and control) of every op, and each backward op's name path without
        gradient scopes; built on first use (only plans that need orderings pay for it)."""
        if self._successors is None:
            ir = self.ir
            self._successors = {op.name: [] for op in ir.ops}
            for op in ir.ops:
                for t in op.inputs:
                    self._successors[ir.tensors[t].producer].append(op.name)
                for c in op.control_inputs:
                    self._successors[c].append(op.name)
            self._paths = {op.name: layer_of(op.name).split("/") for op in ir.ops if op.phase is Phase.BACKWARD}
        return self._successors, self._paths

    def _reaches(self, sources: List[str], targets: Set[str]) -> bool:
        """Whether a path of data or control edges leads from one of ``sources`` to a target."""
        successors, _ = self._backward_graph()
        stack, seen = list(sources), set(sources)
        while stack:
            name = stack.pop()
            if name in targets:
                return True
            for nxt in successors[name]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def _splits_a_fused_kernel(self, first: Set[str], then: Set[str]) -> bool:
        """Whether ``first`` and ``then`` hold, one each, a bias gradient and an op on a CPU that
        oneDNN runs with it as one kernel (:data:`~lms_tf.core.op_kinds.FUSABLE_GATE_TYPES`, reading
        the same gradient). Ordered, the two run apart, and the bias gradient, summed by another
        kernel, rounds differently: the step's numbers would change (VGG16's bias weights by 6e-6
        after 10 steps). On a GPU nothing fuses them."""
        ir = self.ir
        for name in first | then:
            op = ir.op(name)
            if (op.type not in FUSABLE_GATE_TYPES or not op.inputs
                    or device_kind_and_index(op.device or self.device)[0] != "CPU"):
                continue
            other = then if name in first else first
            if any(ir.op(c).type in FUSABLE_GATE_PARTNER_TYPES and c in other
                   for c in ir.tensors[op.inputs[0]].consumers):
                return True
        return False

    def branch_pairs(self, sim: Simulation) -> List[Tuple[Tuple[str, ...], Tuple[str, ...]]]:
        """Pairs of backward branches (name scopes) whose temporaries are alive together at the peak,
        largest first. A branch is the scope where the two producers' name paths part.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> BranchOrdering(step.ir).branch_pairs(step.baseline)   # a chain has no two branches
            []
        """
        ir = self.ir
        _, paths = self._backward_graph()
        live = [(nbytes, ir.tensors[name].producer) for name, nbytes in sim.live_at_peak
                if name in ir.tensors and ir.tensors[name].producer in paths and nbytes]
        live.sort(reverse=True)
        pairs, seen = [], set()
        for i, (_, a) in enumerate(live[:ORDERING_CANDIDATES]):
            for _, b in live[i + 1:ORDERING_CANDIDATES]:
                pa, pb = paths[a], paths[b]
                common = next((k for k, (x, y) in enumerate(zip(pa, pb)) if x != y), None)
                if common is None:
                    continue  # one scope inside the other: not two branches
                key = (tuple(pa[:common + 1]), tuple(pb[:common + 1]))
                if key not in seen and key[::-1] not in seen:
                    seen.add(key)
                    pairs.append(key)
        return pairs

    def ordering(self, first: Tuple[str, ...], then: Tuple[str, ...]) -> Optional[Ordering]:
        """``then``'s first backward ops wait for ``first``'s last ones, if that makes no cycle.

        Examples:
            >>> from lms_tf.core.examples import MiB
            >>> from lms_tf.planner.step import PlanningStep
            >>> step = PlanningStep.example()   # core.examples.chain_ir planned for 75% on a GH200
            >>> BranchOrdering(step.ir).ordering(("g3",), ("g2",)) is None   # g3 already runs before g2
            True
        """
        ir = self.ir
        successors, paths = self._backward_graph()
        in_first = {n for n, p in paths.items() if tuple(p[:len(first)]) == first}
        in_then = {n for n, p in paths.items() if tuple(p[:len(then)]) == then}
        if not in_first or not in_then:
            return None
        exits = sorted((n for n in in_first if not successors[n] or any(s not in in_first for s in successors[n])),
                       key=lambda n: ir.op(n).index)
        # The branch starts where a gradient enters it: ops reading a backward tensor made outside
        # it. (Its shape and constant ops may run early; holding them back would keep the forward
        # tensors they read alive.)
        waiters = sorted((n for n in in_then if not ir.op(n).is_alias and any(
            ir.tensors[t].producer in paths and ir.tensors[t].producer not in in_then for t in ir.op(n).inputs)),
            key=lambda n: ir.op(n).index)
        if not waiters or not exits or self._reaches(waiters, set(exits)):
            return None
        if self._splits_a_fused_kernel(in_first, in_then):
            return None
        devices = {ir.op(n).device for n in waiters + exits}
        if len(devices) > 1:
            return None  # a control edge across devices can hang TensorFlow's executor (docs/design.md)
        return Ordering(tuple(waiters), tuple(exits),
                        f"backward of {'/'.join(then)} waits for {'/'.join(first)}: their temporaries "
                        f"were alive together at the simulated peak")
