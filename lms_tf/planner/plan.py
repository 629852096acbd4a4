"""The plan: an immutable, printable value saying what happens to each forward tensor.

Example:
    >>> p = Plan(decisions=(), device="/device:GPU:0", host="/device:CPU:0", options={}, phase_counts={})
    >>> p.swapped_bytes, p.num_swap_ins
    (0, 0)
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple


class Decision(str, enum.Enum):
    """What happens to a forward tensor that the backward pass reads.

    Example:
        >>> Decision.SWAP.value
        'swap'
    """

    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclasses.dataclass(frozen=True)
class SwapIn:
    """One swap-in: the op that triggers it and the backward consumers it feeds.

    Example:
        >>> SwapIn(trigger="gradient_tape/dense/MatMul", consumers=("gradient_tape/conv/ReluGrad",)).trigger
        'gradient_tape/dense/MatMul'
    """

    trigger: str
    consumers: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TensorDecision:
    """The decision for one forward tensor read by the backward pass.

    Attributes:
        tensor: Tensor name.
        layer: Layer (name-scope path) of its producer.
        shape: Resolved shape, when known.
        nbytes: Size in bytes, when known.
        decision: KEEP or SWAP.
        reason: Why, in words.
        distance: Ops between the producer and the first backward consumer.
        swap_ins: For SWAP, one entry per group of backward consumers.
        recompute_ops: For RECOMPUTE, the forward ops cloned into the backward pass to
            produce it again, in execution order (their inputs outside this list are
            checkpoints: kept, or swapped in).
        gate: For RECOMPUTE, the backward op the clones wait for (the one just before
            the first backward consumer).
        consumers: For RECOMPUTE, the backward ops re-pointed to the clone.
        swap_out_before: For SWAP, a later forward op that waits until the copy out has ended
            (TFLMS's synchronous swap-out): it holds the forward pass back to the link's pace so
            the swapped bytes have left the device before the backward pass starts. None: the
            forward pass never waits for this copy.

    Example:
        >>> d = TensorDecision("c/Relu:0", "c", (8, 8), 256, Decision.KEEP, "smaller than min_swap_bytes", 3, ())
        >>> d.decision.value
        'keep'
    """

    tensor: str
    layer: str
    shape: Optional[Tuple[Optional[int], ...]]
    nbytes: Optional[int]
    decision: Decision
    reason: str
    distance: Optional[int]
    swap_ins: Tuple[SwapIn, ...]
    recompute_ops: Tuple[str, ...] = ()
    gate: Optional[str] = None
    consumers: Tuple[str, ...] = ()
    swap_out_before: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Ordering:
    """An order the backward pass must keep: ``waiters`` start only after every op in ``after`` ended.

    The executor runs ready ops first come, first served, so two independent backward branches
    (a residual block's shortcut and main path) run interleaved and hold both branches'
    temporaries at once. One branch waiting for the other halves that working set.

    Attributes:
        waiters: The first ops of the branch that waits.
        after: The last ops of the branch that runs first.
        reason: Why, in words.

    Example:
        >>> Ordering(("gradient_tape/block/shortcut_bn/mul",), ("gradient_tape/block/main_bn/AddN",), "").waiters
        ('gradient_tape/block/shortcut_bn/mul',)
    """

    waiters: Tuple[str, ...]
    after: Tuple[str, ...]
    reason: str


def _mib(nbytes: Optional[int]) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**20:.2f}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the swap pass will do to one traced step.

    Attributes:
        decisions: One entry per forward tensor that a backward op reads, in execution order.
        device: The managed accelerator.
        host: Where swapped tensors live.
        options: The options the plan was made with.
        phase_counts: Number of forward/backward/update ops in the step.
        budget_bytes: The memory budget the planner fitted (None: the default plan, no budget).
        baseline_peak_bytes: Simulated peak of the plain step.
        planned_peak_bytes: Simulated peak with this plan.
        planned_allocator_peak_bytes: The planned step's peak as TensorFlow's GPU allocator
            counts it (whole chunks: :mod:`lms_tf.planner.allocator`); the budget planner makes
            this fit the budget too.
        baseline_step_time_s: Predicted time of the plain step with unlimited memory.
        predicted_step_time_s: Predicted time with this plan (swap stalls, recompute included).
        device_spec: Name of the device the simulation modelled.
        feasible: Whether the simulated peak fits the budget.
        orderings: Backward branches made to run one after the other (see :class:`Ordering`).

    Example:
        >>> plan = Plan((), "/device:GPU:0", "/device:CPU:0", {}, {"forward": 3})
        >>> print(plan.one_line())
        lms-tf: swapped 0 of 0 candidate tensors (0.00 MiB of 0.00 MiB) with 0 swap-ins, device /device:GPU:0 -> host /device:CPU:0
    """

    decisions: Tuple[TensorDecision, ...]
    device: str
    host: str
    options: Mapping[str, Any]
    phase_counts: Mapping[str, int]
    budget_bytes: Optional[int] = None
    baseline_peak_bytes: Optional[int] = None
    planned_peak_bytes: Optional[int] = None
    planned_allocator_peak_bytes: Optional[int] = None
    baseline_step_time_s: Optional[float] = None
    predicted_step_time_s: Optional[float] = None
    device_spec: Optional[str] = None
    feasible: Optional[bool] = None
    orderings: Tuple[Ordering, ...] = ()

    @property
    def predicted_overhead(self) -> Optional[float]:
        """Predicted step time with the plan / without it (unlimited memory), or None.

        Example:
            >>> Plan((), "d", "h", {}, {}, baseline_step_time_s=2.0, predicted_step_time_s=2.5).predicted_overhead
            1.25
        """
        if not self.baseline_step_time_s or self.predicted_step_time_s is None:
            return None
        return self.predicted_step_time_s / self.baseline_step_time_s

    def layer_table(self) -> List[Dict[str, Any]]:
        """One row per layer: tensors and bytes per decision, and the most common reason.

        Example:
            >>> d = TensorDecision("c/Relu:0", "c", (8,), 32, Decision.SWAP, "swap", 40, ())
            >>> Plan((d,), "d", "h", {}, {}).layer_table()[0]["swap_bytes"]
            32
        """
        rows: Dict[str, Dict[str, Any]] = {}
        for d in self.decisions:
            row = rows.setdefault(d.layer or "(top)", {"layer": d.layer or "(top)", "keep_bytes": 0, "swap_bytes": 0,
                                                       "recompute_bytes": 0, "tensors": 0, "reasons": []})
            row[f"{d.decision.value}_bytes"] += d.nbytes or 0
            row["tensors"] += 1
            row["reasons"].append(d.reason.split(" (")[0])
        table = []
        for row in rows.values():
            decided = [k for k in ("swap", "recompute", "keep") if row[f"{k}_bytes"]]
            row["decision"] = "+".join(decided) or "keep"
            row["why"] = collections.Counter(row.pop("reasons")).most_common(1)[0][0]
            table.append(row)
        return table

    @property
    def swapped(self) -> Tuple[TensorDecision, ...]:
        """Decisions whose tensor is swapped.

        Example:
            >>> Plan((), "d", "h", {}, {}).swapped
            ()
        """
        return tuple(d for d in self.decisions if d.decision is Decision.SWAP)

    @property
    def swapped_bytes(self) -> int:
        """Bytes swapped out (and in) per step.

        Example:
            >>> Plan((), "d", "h", {}, {}).swapped_bytes
            0
        """
        return sum(d.nbytes or 0 for d in self.swapped)

    @property
    def recomputed(self) -> Tuple[TensorDecision, ...]:
        """Decisions whose tensor is recomputed in the backward pass.

        Example:
            >>> Plan((), "d", "h", {}, {}).recomputed
            ()
        """
        return tuple(d for d in self.decisions if d.decision is Decision.RECOMPUTE)

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of forward tensors that are recomputed instead of kept.

        Example:
            >>> Plan((), "d", "h", {}, {}).recomputed_bytes
            0
        """
        return sum(d.nbytes or 0 for d in self.recomputed)

    @property
    def num_recompute_clones(self) -> int:
        """Number of ops the recompute pass clones (an op shared by regions with one gate is cloned once).

        Example:
            >>> Plan((), "d", "h", {}, {}).num_recompute_clones
            0
        """
        return len({(op, d.gate) for d in self.recomputed for op in d.recompute_ops})

    @property
    def num_swap_ins(self) -> int:
        """Number of swap-in ops the rewrite inserts.

        Example:
            >>> Plan((), "d", "h", {}, {}).num_swap_ins
            0
        """
        return sum(len(d.swap_ins) for d in self.swapped)

    def kept_reasons(self) -> Dict[str, int]:
        """How many tensors were kept for each reason.

        Example:
            >>> Plan((), "d", "h", {}, {}).kept_reasons()
            {}
        """
        return dict(collections.Counter(d.reason.split(" (")[0] for d in self.decisions
                                        if d.decision is Decision.KEEP))

    def one_line(self) -> str:
        """A one-line summary for logs.

        Example:
            >>> Plan((), "d", "h", {}, {}).one_line().startswith("lms-tf: swapped 0")
            True
        """
        total = sum(d.nbytes or 0 for d in self.decisions)
        line = (f"lms-tf: swapped {len(self.swapped)} of {len(self.decisions)} candidate tensors "
                f"({_mib(self.swapped_bytes)} MiB of {_mib(total)} MiB) with {self.num_swap_ins} swap-ins, "
                f"device {self.device} -> host {self.host}")
        if self.recomputed:
            line += (f"; recomputed {len(self.recomputed)} ({_mib(self.recomputed_bytes)} MiB) "
                     f"with {self.num_recompute_clones} cloned ops")
        return line

    def summary(self, max_rows: int = 60) -> str:
        """A table of the swapped tensors (trigger, bytes) and a tally of why others were kept.

        Example:
            >>> print(Plan((), "d", "h", {}, {}).summary().splitlines()[0])
            lms-tf: swapped 0 of 0 candidate tensors (0.00 MiB of 0.00 MiB) with 0 swap-ins, device d -> host h
        """
        lines = [self.one_line()]
        if self.budget_bytes is not None:
            lines.append(self.budget_line())
            lines.append(f"{'layer':<48} {'decision':<16} {'keep MiB':>9} {'swap MiB':>9} {'recomp MiB':>10}  why")
            for row in self.layer_table()[:max_rows]:
                lines.append(f"{row['layer'][-48:]:<48} {row['decision']:<16} {_mib(row['keep_bytes']):>9} "
                             f"{_mib(row['swap_bytes']):>9} {_mib(row['recompute_bytes']):>10}  {row['why']}")
            if len(self.layer_table()) > max_rows:
                lines.append(f"... {len(self.layer_table()) - max_rows} more layers")
            waits = sum(1 for d in self.swapped if d.swap_out_before is not None)
            if waits:
                lines.append(f"the forward pass waits for {waits} copies out (the link sets its pace)")
            for ordering in self.orderings[:max_rows]:
                lines.append(f"order: {ordering.reason}")
            return "\n".join(lines)
        rows = self.swapped
        if rows:
            lines.append(f"{'tensor':<52} {'shape':<22} {'MiB':>8} {'dist':>5}  trigger -> consumers")
            for d in rows[:max_rows]:
                for i, s in enumerate(d.swap_ins):
                    head = (f"{d.tensor[-52:]:<52} {str(d.shape)[:22]:<22} {_mib(d.nbytes):>8} {d.distance:>5}"
                            if i == 0 else " " * 90)
                    lines.append(f"{head}  {s.trigger} -> {len(s.consumers)} op(s)")
            if len(rows) > max_rows:
                lines.append(f"... {len(rows) - max_rows} more swapped tensors")
        if self.recomputed:
            lines.append(f"{'recomputed tensor':<52} {'shape':<22} {'MiB':>8} {'ops':>5}  gate")
            for d in self.recomputed[:max_rows]:
                lines.append(f"{d.tensor[-52:]:<52} {str(d.shape)[:22]:<22} {_mib(d.nbytes):>8} "
                             f"{len(d.recompute_ops):>5}  {d.gate}")
            if len(self.recomputed) > max_rows:
                lines.append(f"... {len(self.recomputed) - max_rows} more recomputed tensors")
        reasons = self.kept_reasons()
        if reasons:
            lines.append("kept: " + "; ".join(f"{n} {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])))
        return "\n".join(lines)

    def budget_line(self) -> str:
        """Budget, simulated peaks and predicted overhead in one line.

        Example:
            >>> p = Plan((), "d", "h", {}, {}, budget_bytes=2**20, baseline_peak_bytes=2**21,
            ...          planned_peak_bytes=2**20, baseline_step_time_s=1.0, predicted_step_time_s=1.1,
            ...          device_spec="v100-16gb-pcie3", feasible=True)
            >>> print(p.budget_line())
            budget 1.00 MiB on v100-16gb-pcie3: simulated peak 2.00 MiB plain -> 1.00 MiB planned (fits); predicted step 1000.0 ms -> 1100.0 ms (1.10x)
        """
        fits = "fits" if self.feasible else "DOES NOT FIT"
        return (f"budget {_mib(self.budget_bytes)} MiB on {self.device_spec}: simulated peak "
                f"{_mib(self.baseline_peak_bytes)} MiB plain -> {_mib(self.planned_peak_bytes)} MiB planned"
                f"{'' if self.planned_allocator_peak_bytes is None else f', {_mib(self.planned_allocator_peak_bytes)} MiB in allocator chunks'}"
                f" ({fits}); "
                f"predicted step {1e3 * (self.baseline_step_time_s or 0):.1f} ms -> "
                f"{1e3 * (self.predicted_step_time_s or 0):.1f} ms ({self.predicted_overhead or 0:.2f}x)")

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> Dict[str, Any]:
        """The plan as plain data.

        Example:
            >>> {"decisions", "device", "planned_peak_bytes"} <= set(Plan((), "d", "h", {}, {}).to_dict())
            True
        """
        return {
            "device": self.device, "host": self.host, "options": dict(self.options),
            "phase_counts": dict(self.phase_counts), "swapped_bytes": self.swapped_bytes,
            "num_swapped": len(self.swapped), "num_swap_ins": self.num_swap_ins,
            "recomputed_bytes": self.recomputed_bytes, "num_recomputed": len(self.recomputed),
            "num_recompute_clones": self.num_recompute_clones,
            "budget_bytes": self.budget_bytes, "baseline_peak_bytes": self.baseline_peak_bytes,
            "planned_peak_bytes": self.planned_peak_bytes,
            "planned_allocator_peak_bytes": self.planned_allocator_peak_bytes, "baseline_step_time_s": self.baseline_step_time_s,
            "predicted_step_time_s": self.predicted_step_time_s, "predicted_overhead": self.predicted_overhead,
            "device_spec": self.device_spec, "feasible": self.feasible,
            "layers": self.layer_table(),
            "orderings": [dataclasses.asdict(o) for o in self.orderings],
            "decisions": [
                {**{k: v for k, v in dataclasses.asdict(d).items() if k != "swap_ins"},
                 "decision": d.decision.value,
                 "swap_ins": [dataclasses.asdict(s) for s in d.swap_ins]}
                for d in self.decisions],
        }

    def to_json(self, **kwargs) -> str:
        """The plan as JSON.

        Example:
            >>> Plan((), "d", "h", {}, {}).to_json().startswith("{")
            True
        """
        return json.dumps(self.to_dict(), **kwargs)
