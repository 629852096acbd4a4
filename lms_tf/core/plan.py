"""The plan: an immutable value saying what happens to each forward tensor, to print, save, edit and apply.

Decisions (KEEP / SWAP / RECOMPUTE per tensor, with the ops that trigger, gate and read each
move, and the orderings imposed on backward branches) are kept apart from predictions (the
simulated peaks and step times), which the planner fills in and an edit does not need to keep.
``Plan.from_json(plan.to_json()) == plan``; the JSON carries :data:`PLAN_SCHEMA_VERSION`.

Examples:
    >>> p = Plan(decisions=(), device="/device:GPU:0", host="/device:CPU:0", policies={}, phase_counts={})
    >>> p.swapped_bytes, p.num_swap_ins
    (0, 0)
    >>> Plan.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple

from lms_tf.core.errors import LMSOptionError

#: Version of the plan's JSON form; :meth:`Plan.from_json` refuses any other.
PLAN_SCHEMA_VERSION = 1


class Decision(str, enum.Enum):
    """What happens to a forward tensor that the backward pass reads.

    Examples:
        >>> Decision.SWAP.value
        'swap'
    """

    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclasses.dataclass(frozen=True)
class SwapIn:
    """One swap-in (or weight fetch): the op that triggers it and the device ops it feeds.

    Attributes:
        trigger: The op whose output starts the copy (``""``, for a weight fetch: the step's start).
        consumers: The ops that read the copy instead of the tensor.
        after_gradients: For a weight fetch only: weight gradients (tensor names) whose copy to
            the host must have ended before this fetch starts. The window's ops wait for the fetch,
            so the backward pass does not run ahead while a large gradient is still on the device
            being copied out (it is freed when its copy ends).

    Examples:
        >>> SwapIn(trigger="gradient_tape/dense/MatMul", consumers=("gradient_tape/conv/ReluGrad",)).trigger
        'gradient_tape/dense/MatMul'
        >>> SwapIn("g", ("c",), after_gradients=("gradient_tape/fc1/MatMul_1:0",)).after_gradients
        ('gradient_tape/fc1/MatMul_1:0',)
    """

    trigger: str
    consumers: Tuple[str, ...]
    after_gradients: Tuple[str, ...] = ()


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

    Examples:
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

    def kept(self, reason: str) -> "TensorDecision":
        """This decision turned into KEEP, with nothing left of its swap or recompute, for ``reason``.

        Examples:
            >>> d = TensorDecision("c/Relu:0", "c", (8, 8), 256, Decision.SWAP, "largest", 3, ())
            >>> k = d.kept("kept: the stage fits without it")
            >>> k.decision.value, k.reason, k.swap_ins, k.swap_out_before
            ('keep', 'kept: the stage fits without it', (), None)
        """
        return dataclasses.replace(self, decision=Decision.KEEP, reason=reason, swap_ins=(), recompute_ops=(),
                                   gate=None, consumers=(), swap_out_before=None)


@dataclasses.dataclass(frozen=True)
class WeightDecision:
    """Where one variable lives during the step, and when the device gets a copy of it.

    A variable on the host is not resident on the device: each window of device ops that read
    it gets its own copy, made just before the window (like a swap-in, with nothing to copy out:
    the host holds the variable itself) and freed after the window's last reader.

    Attributes:
        variable: The variable's handle in the step (the tensor its reads take).
        reads: The step's reads of it that device ops consume (``ReadVariableOp`` outputs); a
            variable read by several layers (a shared layer, tied embeddings) has several.
        shape: Its shape, when known.
        nbytes: Its size in bytes, when known.
        decision: KEEP (resident on the device) or SWAP (on the host, fetched per window).
        reason: Why, in words.
        fetches: For SWAP, one per window: the op whose output triggers the copy (``""``: the
            start of the step, for a window nothing on the device runs before) and the device
            ops of the window, which read the copy instead of the variable.
        clone_fetches_after: For SWAP, ``(gate, op)`` pairs: behind recompute gate ``gate``, the
            copy the recompute clones read is made once the clone of ``op`` has ended, not when
            the gate has (``op`` is cloned behind that gate before the first clone that reads this
            variable). A region that recomputes several layers fetches their weights from one gate,
            back to back, and holds them all at once; fetched in turn, each layer's weight arrives
            after the layer before it has been recomputed.

    Examples:
        >>> w = WeightDecision("dense/kernel", ("dense/MatMul/ReadVariableOp:0",), (4, 4), 64, Decision.SWAP,
        ...                    "weights='host'", (SwapIn("", ("dense/MatMul",)),))
        >>> w.fetch_name(0)
        'fetch/dense/kernel/0'
    """

    variable: str
    reads: Tuple[str, ...]
    shape: Optional[Tuple[Optional[int], ...]]
    nbytes: Optional[int]
    decision: Decision
    reason: str
    fetches: Tuple[SwapIn, ...] = ()
    clone_fetches_after: Tuple[Tuple[str, str], ...] = ()

    def clone_fetch_after(self, gate: str) -> Optional[str]:
        """The op whose clone the copy for the clones behind ``gate`` waits for (None: the gate itself).

        Examples:
            >>> w = WeightDecision("v", (), None, 0, Decision.SWAP, "", (), (("g", "fc1/Relu"),))
            >>> w.clone_fetch_after("g"), w.clone_fetch_after("other")
            ('fc1/Relu', None)
        """
        return next((op for g, op in self.clone_fetches_after if g == gate), None)

    def clone_fetch_name(self, gate: str) -> str:
        """The simulator's name of the copy the clones behind recompute gate ``gate`` read.

        Examples:
            >>> WeightDecision("v", (), None, 0, Decision.SWAP, "", ()).clone_fetch_name("g")
            'fetch/v/@g'
        """
        return f"fetch/{self.variable}/@{gate}"

    def fetch_name(self, window: int) -> str:
        """The simulator's name of the copy for window ``window``.

        Examples:
            >>> WeightDecision("v", (), None, 0, Decision.SWAP, "", ()).fetch_name(2)
            'fetch/v/2'
        """
        return f"fetch/{self.variable}/{window}"


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

    Examples:
        >>> Ordering(("gradient_tape/block/shortcut_bn/mul",), ("gradient_tape/block/main_bn/AddN",), "").waiters
        ('gradient_tape/block/shortcut_bn/mul',)
    """

    waiters: Tuple[str, ...]
    after: Tuple[str, ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class SlicedOp:
    """A backward op run a slice of the batch at a time, its slices put back together after.

    An op that reads and writes several batch-sized tensors at once (a max pool's gradient reads
    the pool's input, output and output gradient and writes the input gradient) can hold more
    device memory than any plan that runs it whole can go below. Run in ``slices`` parts, with its
    largest input copied from the host one slice at a time, it holds one slice of that input and
    of its output instead of the whole; a ``ConcatV2`` puts the output slices together for its
    readers. Only types in :data:`~lms_tf.core.op_kinds.BATCH_SLICED_INPUTS` are sliced, whose
    slices compute exactly what the whole op does.

    Attributes:
        op: The op sliced.
        slices: How many parts the batch is cut into (near-equal, in order; at least 2).
        from_host: Its inputs copied from the host a slice at a time: each is swapped by the plan,
            and the op reads none of that tensor's swap-ins. Its other inputs are read whole, on the device.
        trigger: The op after which the copies of the first two slices may start; the copy of slice
            ``i`` starts when slice ``i - 2`` has ended, so two slices are on the device at most.
        reason: Why, in words.

    Examples:
        >>> s = SlicedOp("gradient_tape/pool/MaxPoolGrad", 4, ("conv/Relu:0",), "gradient_tape/conv2/MatMul")
        >>> s.slice_name(1), s.copy_name("conv/Relu:0", 3)
        ('slice/gradient_tape/pool/MaxPoolGrad/1', 'swap_in/conv/Relu:0/slice/gradient_tape/pool/MaxPoolGrad/3')
        >>> [s.bounds(16)[i] for i in (0, 3)], SlicedOp("g", 3, (), "t").bounds(8)
        ([(0, 4), (12, 4)], ((0, 3), (3, 3), (6, 2)))
    """

    op: str
    slices: int
    from_host: Tuple[str, ...]
    trigger: str
    reason: str = ""

    def slice_name(self, index: int) -> str:
        """The simulator's name of slice ``index`` of the op (its kernel on that part of the batch).

        Examples:
            >>> SlicedOp("pool_grad", 2, (), "t").slice_name(0)
            'slice/pool_grad/0'
        """
        return f"slice/{self.op}/{index}"

    def copy_name(self, tensor: str, index: int) -> str:
        """The simulator's name of the copy to the device of slice ``index`` of input ``tensor``.

        Examples:
            >>> SlicedOp("pool_grad", 2, ("x:0",), "t").copy_name("x:0", 1)
            'swap_in/x:0/slice/pool_grad/1'
        """
        return f"swap_in/{tensor}/slice/{self.op}/{index}"

    def bounds(self, batch: int) -> Tuple[Tuple[int, int], ...]:
        """``(start, size)`` of each slice of a batch of ``batch``: near-equal parts, the larger first.

        Raises:
            LMSOptionError: Fewer than 2 slices, or more slices than the batch has examples.

        Examples:
            >>> SlicedOp("pool_grad", 2, (), "t").bounds(5)
            ((0, 3), (3, 2))
        """
        if not 2 <= self.slices <= batch:
            raise LMSOptionError(f"sliced op {self.op!r}: slices={self.slices} must be between 2 and its batch of "
                                 f"{batch}; edit the plan's 'sliced' entry (or remove it to run the op whole).")
        size, extra = divmod(batch, self.slices)
        starts, start = [], 0
        for i in range(self.slices):
            n = size + (1 if i < extra else 0)
            starts.append((start, n))
            start += n
        return tuple(starts)


@dataclasses.dataclass(frozen=True)
class Predictions:
    """What the simulator predicts for a plan on the device it was planned for.

    Attributes:
        baseline_peak_bytes: Simulated peak of the plain step.
        planned_peak_bytes: Simulated peak with the plan.
        planned_allocator_peak_bytes: The planned step's peak as TensorFlow's GPU allocator
            counts it (whole chunks: :mod:`lms_tf.simulate.allocator`).
        baseline_step_time_s: Predicted time of the plain step with unlimited memory.
        predicted_step_time_s: Predicted time with the plan (swap stalls, recompute included).
        feasible: Whether the simulated peak fits the budget.
        bytes_to_host: Bytes the planned step copies from the device to the host.
        bytes_to_device: Bytes it copies back (a tensor read in several windows comes back once per window).
        least_step_time_s: The least step time any plan fitting the budget could have, whatever it
            moves (:func:`lms_tf.simulate.bounds.fit_lower_bound`); None where moving tensors alone
            cannot fit and the plan also reorders ops.
        least_traffic_bytes: The bytes that least-time plan copies each way.
        host_peak_bytes: The most host memory the planned step holds at once in one process:
            weights and optimizer slots on the host, swapped tensors, gradients copied out, the
            update's temporaries there.

    Examples:
        >>> Predictions(baseline_step_time_s=2.0, predicted_step_time_s=2.5).overhead
        1.25
    """

    baseline_peak_bytes: Optional[int] = None
    planned_peak_bytes: Optional[int] = None
    planned_allocator_peak_bytes: Optional[int] = None
    baseline_step_time_s: Optional[float] = None
    predicted_step_time_s: Optional[float] = None
    feasible: Optional[bool] = None
    bytes_to_host: Optional[int] = None
    bytes_to_device: Optional[int] = None
    least_step_time_s: Optional[float] = None
    least_traffic_bytes: Optional[int] = None
    host_peak_bytes: Optional[int] = None

    @property
    def overhead(self) -> Optional[float]:
        """Predicted step time with the plan / without it (unlimited memory), or None.

        Examples:
            >>> Predictions().overhead is None
            True
        """
        if not self.baseline_step_time_s or self.predicted_step_time_s is None:
            return None
        return self.predicted_step_time_s / self.baseline_step_time_s


def shorten(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters, cut in the middle with an ellipsis: the start (the
    model) and the end (the layer and op, kept whole when they fit) are what tell rows apart.

    Examples:
        >>> shorten("efficientnetb0_1/block1a_project_conv_1/convolution", 40)
        'efficientnetb…project_conv_1/convolution'
    """
    if len(name) <= width:
        return name
    first = name.split("/", 1)[0] + "/"
    head = min(len(first), width // 3)
    return name[:head] + "…" + name[len(name) - (width - 1 - head):]


def _why(kind: str, reason: str) -> str:
    """A decision's reason, prefixed by the decision unless the reason already starts with it."""
    return reason if reason.startswith(kind) else f"{kind}: {reason}"


def _mib(nbytes: Optional[int]) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**20:.2f}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the swap pass will do to one traced step.

    Attributes:
        decisions: One entry per forward tensor that a backward op reads, in execution order.
        device: The managed accelerator.
        host: Where swapped tensors live.
        policies: The policies the plan was made with (:meth:`lms_tf.core.policy.Policies.to_dict`).
        phase_counts: Number of forward/backward/update ops in the step.
        budget_bytes: The memory budget the planner fitted (None: the TFLMS rule, no budget).
        device_spec: Name of the device the simulation modelled.
        orderings: Backward branches made to run one after the other (see :class:`Ordering`).
        predictions: The simulator's peaks and times for this plan (:class:`Predictions`).
        weights: One entry per variable the device reads (:class:`WeightDecision`); empty when
            the weights stay on the device (the default).
        sliced: Backward ops run a slice of the batch at a time (:class:`SlicedOp`).

    Examples:
        >>> plan = Plan((), "/device:GPU:0", "/device:CPU:0", {}, {"forward": 3})
        >>> print(plan.one_line())
        lms-tf: swapped 0 of 0 candidate tensors (0.00 MiB of 0.00 MiB) with 0 swap-ins, device /device:GPU:0 -> host /device:CPU:0
    """

    decisions: Tuple[TensorDecision, ...]
    device: str
    host: str
    policies: Mapping[str, Any]
    phase_counts: Mapping[str, int]
    budget_bytes: Optional[int] = None
    device_spec: Optional[str] = None
    orderings: Tuple[Ordering, ...] = ()
    predictions: Predictions = Predictions()
    weights: Tuple[WeightDecision, ...] = ()
    sliced: Tuple[SlicedOp, ...] = ()

    @property
    def offloaded_weights(self) -> Tuple[WeightDecision, ...]:
        """The variables that live on the host and are fetched per window.

        Examples:
            >>> Plan((), "d", "h", {}, {}).offloaded_weights
            ()
        """
        return tuple(w for w in self.weights if w.decision is Decision.SWAP)

    @property
    def offloaded_weight_bytes(self) -> int:
        """Bytes of the variables on the host (no longer resident on the device).

        Examples:
            >>> Plan((), "d", "h", {}, {}).offloaded_weight_bytes
            0
        """
        return sum(w.nbytes or 0 for w in self.offloaded_weights)

    @property
    def num_gradient_waits(self) -> int:
        """How many weight fetches wait for a weight gradient's copy to the host (``after_gradients``).

        Examples:
            >>> Plan((), "d", "h", {}, {}).num_gradient_waits
            0
        """
        return sum(1 for w in self.offloaded_weights for f in w.fetches if f.after_gradients)

    @property
    def num_weight_fetches(self) -> int:
        """Copies of weights to the device per step (one per window of each offloaded variable).

        Examples:
            >>> Plan((), "d", "h", {}, {}).num_weight_fetches
            0
        """
        return sum(len(w.fetches) for w in self.offloaded_weights)

    def layer_table(self) -> List[Dict[str, Any]]:
        """One row per layer: tensors and bytes per decision, and why, per decision the layer has.

        The "why" gives, for each decision taken in the layer (most bytes first), the reason of
        its largest tensor: a layer whose output is swapped and whose small shape tensors are kept
        reads "swap (...); keep: derived from variables or constants only".

        Examples:
            >>> d = TensorDecision("c/Relu:0", "c", (8,), 32, Decision.SWAP, "swap (read again 40 ops later)", 40, ())
            >>> row = Plan((d,), "d", "h", {}, {}).layer_table()[0]
            >>> row["swap_bytes"], row["why"]
            (32, 'swap (read again 40 ops later)')
        """
        rows: Dict[str, Dict[str, Any]] = {}
        for d in self.decisions:
            row = rows.setdefault(d.layer or "(top)", {"layer": d.layer or "(top)", "keep_bytes": 0, "swap_bytes": 0,
                                                       "recompute_bytes": 0, "tensors": 0, "largest": {}})
            row[f"{d.decision.value}_bytes"] += d.nbytes or 0
            row["tensors"] += 1
            largest = row["largest"].get(d.decision.value)
            if largest is None or (d.nbytes or 0) > (largest.nbytes or 0):
                row["largest"][d.decision.value] = d
        table = []
        for row in rows.values():
            decided = sorted((k for k in ("swap", "recompute", "keep") if row[f"{k}_bytes"]),
                             key=lambda k: -row[f"{k}_bytes"])
            row["decision"] = "+".join(decided) or "keep"
            largest = row.pop("largest")
            row["why"] = "; ".join(_why(kind, largest[kind].reason) for kind in (decided or list(largest)))
            table.append(row)
        return table

    @property
    def swapped(self) -> Tuple[TensorDecision, ...]:
        """Decisions whose tensor is swapped.

        Examples:
            >>> Plan((), "d", "h", {}, {}).swapped
            ()
        """
        return tuple(d for d in self.decisions if d.decision is Decision.SWAP)

    @property
    def swapped_bytes(self) -> int:
        """Bytes swapped out (and in) per step.

        Examples:
            >>> Plan((), "d", "h", {}, {}).swapped_bytes
            0
        """
        return sum(d.nbytes or 0 for d in self.swapped)

    @property
    def recomputed(self) -> Tuple[TensorDecision, ...]:
        """Decisions whose tensor is recomputed in the backward pass.

        Examples:
            >>> Plan((), "d", "h", {}, {}).recomputed
            ()
        """
        return tuple(d for d in self.decisions if d.decision is Decision.RECOMPUTE)

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of forward tensors that are recomputed instead of kept.

        Examples:
            >>> Plan((), "d", "h", {}, {}).recomputed_bytes
            0
        """
        return sum(d.nbytes or 0 for d in self.recomputed)

    @property
    def num_recompute_clones(self) -> int:
        """Number of ops the recompute pass clones (an op shared by regions with one gate is cloned once).

        Examples:
            >>> Plan((), "d", "h", {}, {}).num_recompute_clones
            0
        """
        return len({(op, d.gate) for d in self.recomputed for op in d.recompute_ops})

    def clones_behind(self, gate: str) -> Tuple[str, ...]:
        """The ops cloned behind recompute gate ``gate``, each once, in the order the rewrite clones
        them (decision by decision, each region in order): a clone reads only clones made before it.

        Examples:
            >>> a = TensorDecision("b:0", "", (), 4, Decision.RECOMPUTE, "", 1, (), recompute_ops=("a", "b"), gate="g")
            >>> c = TensorDecision("c:0", "", (), 4, Decision.RECOMPUTE, "", 1, (), recompute_ops=("b", "c"), gate="g")
            >>> Plan((a, c), "d", "h", {}, {}).clones_behind("g")
            ('a', 'b', 'c')
        """
        return tuple(dict.fromkeys(op for d in self.recomputed if d.gate == gate for op in d.recompute_ops))

    @property
    def num_swap_ins(self) -> int:
        """Number of swap-in ops the rewrite inserts.

        Examples:
            >>> Plan((), "d", "h", {}, {}).num_swap_ins
            0
        """
        return sum(len(d.swap_ins) for d in self.swapped)

    def kept_reasons(self) -> Dict[str, int]:
        """How many tensors were kept for each reason.

        Examples:
            >>> Plan((), "d", "h", {}, {}).kept_reasons()
            {}
        """
        return dict(collections.Counter(d.reason.split(" (")[0] for d in self.decisions
                                        if d.decision is Decision.KEEP))

    def one_line(self) -> str:
        """A one-line summary for logs.

        Examples:
            >>> Plan((), "d", "h", {}, {}).one_line().startswith("lms-tf: swapped 0")
            True
        """
        total = sum(d.nbytes or 0 for d in self.decisions)
        line = (f"lms-tf: swapped {len(self.swapped)} of {len(self.decisions)} candidate tensors "
                f"({_mib(self.swapped_bytes)} MiB of {_mib(total)} MiB) with {self.num_swap_ins} swap-ins, "
                f"device {self.device} -> host {self.host}")
        if self.device_spec:
            line += f", planned for {self.device_spec}"
        if self.recomputed:
            line += (f"; recomputed {len(self.recomputed)} ({_mib(self.recomputed_bytes)} MiB) "
                     f"with {self.num_recompute_clones} cloned ops")
        if self.offloaded_weights:
            line += (f"; weights on the host: {len(self.offloaded_weights)} variables "
                     f"({_mib(self.offloaded_weight_bytes)} MiB) fetched {self.num_weight_fetches} times")
            if self.num_gradient_waits:
                line += f", {self.num_gradient_waits} of the fetches after a gradient reached the host"
        if self.sliced:
            line += (f"; {len(self.sliced)} op{'s' if len(self.sliced) > 1 else ''} run a slice of the batch at "
                     f"a time ({sum(s.slices for s in self.sliced)} slices)")
        if self.predictions.host_peak_bytes:
            line += f"; host memory at most {_mib(self.predictions.host_peak_bytes)} MiB"
        return line

    def summary(self, max_rows: int = 60, wide: bool = False) -> str:
        """A table of the swapped tensors (trigger, bytes) and a tally of why others were kept.

        Long layer and tensor names are cut in the middle (the model's and the layer's ends stay);
        ``wide=True`` prints them whole.

        Examples:
            >>> print(Plan((), "d", "h", {}, {}).summary().splitlines()[0])
            lms-tf: swapped 0 of 0 candidate tensors (0.00 MiB of 0.00 MiB) with 0 swap-ins, device d -> host h
        """
        lines = [self.one_line()]
        if self.budget_bytes is not None:
            lines.append(self.budget_line())
            table = self.layer_table()
            width = max([48] + [len(row["layer"]) for row in table]) if wide else 48
            lines.append(f"{'layer':<{width}} {'decision':<16} {'keep MiB':>9} {'swap MiB':>9} {'recomp MiB':>10}  why")
            for row in table[:max_rows]:
                layer = row["layer"] if wide else shorten(row["layer"], width)
                lines.append(f"{layer:<{width}} {row['decision']:<16} {_mib(row['keep_bytes']):>9} "
                             f"{_mib(row['swap_bytes']):>9} {_mib(row['recompute_bytes']):>10}  {row['why']}")
            if len(table) > max_rows:
                lines.append(f"... {len(table) - max_rows} more layers")
            waits = sum(1 for d in self.swapped if d.swap_out_before is not None)
            if waits:
                lines.append(f"the forward pass waits for {waits} copies out (the link sets its pace)")
            for ordering in self.orderings[:max_rows]:
                lines.append(f"order: {ordering.reason}")
            lines.extend(self._sliced_lines(max_rows))
            return "\n".join(lines)
        rows = self.swapped
        name = (lambda text: text) if wide else (lambda text: shorten(text, 52))  # noqa: E731
        if rows:
            lines.append(f"{'tensor':<52} {'shape':<22} {'MiB':>8} {'dist':>5}  trigger -> consumers")
            for d in rows[:max_rows]:
                for i, s in enumerate(d.swap_ins):
                    head = (f"{name(d.tensor):<52} {str(d.shape)[:22]:<22} {_mib(d.nbytes):>8} {d.distance:>5}"
                            if i == 0 else " " * 90)
                    lines.append(f"{head}  {s.trigger} -> {len(s.consumers)} op(s)")
            if len(rows) > max_rows:
                lines.append(f"... {len(rows) - max_rows} more swapped tensors")
        if self.recomputed:
            lines.append(f"{'recomputed tensor':<52} {'shape':<22} {'MiB':>8} {'ops':>5}  gate")
            for d in self.recomputed[:max_rows]:
                lines.append(f"{name(d.tensor):<52} {str(d.shape)[:22]:<22} {_mib(d.nbytes):>8} "
                             f"{len(d.recompute_ops):>5}  {d.gate}")
            if len(self.recomputed) > max_rows:
                lines.append(f"... {len(self.recomputed) - max_rows} more recomputed tensors")
        if self.offloaded_weights:
            lines.append(f"{'weight on the host':<52} {'shape':<22} {'MiB':>8} {'reads':>5}  fetch triggers")
            for w in self.offloaded_weights[:max_rows]:
                triggers = ", ".join((f.trigger or "(start)") + (f" (after {len(f.after_gradients)} gradient"
                                                                   f"{'s' if len(f.after_gradients) > 1 else ''} "
                                                                   f"reached the host)" if f.after_gradients else "")
                                     for f in w.fetches)
                triggers += "".join(f"; behind {gate}: after {op}'s clone" for gate, op in w.clone_fetches_after)
                lines.append(f"{name(w.variable):<52} {str(w.shape)[:22]:<22} {_mib(w.nbytes):>8} "
                             f"{len(w.reads):>5}  {triggers}")
            if len(self.offloaded_weights) > max_rows:
                lines.append(f"... {len(self.offloaded_weights) - max_rows} more weights on the host")
        lines.extend(self._sliced_lines(max_rows))
        reasons = self.kept_reasons()
        if reasons:
            lines.append("kept: " + "; ".join(f"{n} {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])))
        return "\n".join(lines)

    def _sliced_lines(self, max_rows: int) -> List[str]:
        lines = []
        for s in self.sliced[:max_rows]:
            host = f", {len(s.from_host)} input(s) copied in a slice at a time" if s.from_host else ""
            lines.append(f"sliced: {s.op} in {s.slices} slices of the batch{host}, after {s.trigger}"
                         + (f" ({s.reason})" if s.reason else ""))
        return lines

    def budget_line(self) -> str:
        """Budget, simulated peaks and predicted overhead in one line.

        Examples:
            >>> p = Plan((), "d", "h", {}, {}, budget_bytes=2**20, device_spec="v100-16gb-pcie3",
            ...          predictions=Predictions(baseline_peak_bytes=2**21, planned_peak_bytes=2**20,
            ...                                  baseline_step_time_s=1.0, predicted_step_time_s=1.1, feasible=True,
            ...                                  least_step_time_s=1.05))
            >>> print(p.budget_line())
            budget 1.00 MiB on v100-16gb-pcie3: simulated peak 2.00 MiB plain -> 1.00 MiB planned (fits); predicted step 1000.0 ms -> 1100.0 ms (1.10x); no plan that fits can beat 1050.0 ms
        """
        pred = self.predictions
        fits = "fits" if pred.feasible else "DOES NOT FIT"
        chunks = ("" if pred.planned_allocator_peak_bytes is None
                  else f", {_mib(pred.planned_allocator_peak_bytes)} MiB in allocator chunks")
        head = (f"budget {_mib(self.budget_bytes)} MiB on {self.device_spec}: simulated peak "
                f"{_mib(pred.baseline_peak_bytes)} MiB plain -> {_mib(pred.planned_peak_bytes)} MiB planned"
                f"{chunks} ({fits})")
        if pred.baseline_step_time_s is None:  # memory only (a pipeline stage held to its budget)
            return head
        return (f"{head}; "
                f"predicted step {1e3 * (pred.baseline_step_time_s or 0):.1f} ms -> "
                f"{1e3 * (pred.predicted_step_time_s or 0):.1f} ms ({pred.overhead or 0:.2f}x)"
                + ("" if pred.least_step_time_s is None else
                   f"; no plan that fits can beat {1e3 * pred.least_step_time_s:.1f} ms"))

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> Dict[str, Any]:
        """The plan as plain data: decisions, predictions, and derived totals for reading.

        Examples:
            >>> {"decisions", "device", "predictions", "schema_version"} <= set(Plan((), "d", "h", {}, {}).to_dict())
            True
        """
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "device": self.device, "host": self.host, "policies": dict(self.policies),
            "phase_counts": dict(self.phase_counts),
            "budget_bytes": self.budget_bytes, "device_spec": self.device_spec,
            "orderings": [dataclasses.asdict(o) for o in self.orderings],
            "decisions": [
                {**{k: v for k, v in dataclasses.asdict(d).items() if k != "swap_ins"},
                 "decision": d.decision.value,
                 "swap_ins": [dataclasses.asdict(s) for s in d.swap_ins]}
                for d in self.decisions],
            "weights": [{**{k: v for k, v in dataclasses.asdict(w).items() if k != "fetches"},
                         "decision": w.decision.value, "fetches": [dataclasses.asdict(f) for f in w.fetches]}
                        for w in self.weights],
            "sliced": [dataclasses.asdict(s) for s in self.sliced],
            "predictions": {**dataclasses.asdict(self.predictions), "overhead": self.predictions.overhead},
            # Derived from the decisions, for people and tools reading the file; ignored on load.
            "totals": {"swapped_bytes": self.swapped_bytes, "num_swapped": len(self.swapped),
                       "num_swap_ins": self.num_swap_ins, "recomputed_bytes": self.recomputed_bytes,
                       "num_recomputed": len(self.recomputed), "num_recompute_clones": self.num_recompute_clones,
                       "offloaded_weight_bytes": self.offloaded_weight_bytes,
                       "num_offloaded_weights": len(self.offloaded_weights),
                       "num_weight_fetches": self.num_weight_fetches, "num_gradient_waits": self.num_gradient_waits},
            "layers": self.layer_table(),
        }

    def to_json(self, **kwargs) -> str:
        """The plan as JSON (:meth:`from_json` reads it back).

        Examples:
            >>> Plan((), "d", "h", {}, {}).to_json().startswith("{")
            True
        """
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """The plan :meth:`to_dict` described (derived totals and layer rows are ignored).

        Raises:
            LMSOptionError: The data is not a plan of this schema version, or a field is malformed.

        Examples:
            >>> d = TensorDecision("c/Relu:0", "c", (8,), 32, Decision.SWAP, "swap", 40, (SwapIn("g", ("r",)),))
            >>> Plan.from_dict(Plan((d,), "d", "h", {}, {}).to_dict()).decisions == (d,)
            True
        """
        if not isinstance(data, Mapping) or data.get("schema_version") != PLAN_SCHEMA_VERSION:
            found = data.get("schema_version") if isinstance(data, Mapping) else type(data).__name__
            raise LMSOptionError(
                f"not an lms-tf plan of schema version {PLAN_SCHEMA_VERSION}: found schema_version={found!r}. "
                f"Make the plan again with this lms-tf (`lms-tf plan ... --out plan.json`).")
        try:
            decisions = tuple(_decision_from_dict(d) for d in data["decisions"])
            orderings = tuple(Ordering(tuple(o["waiters"]), tuple(o["after"]), o["reason"])
                              for o in data.get("orderings", ()))
            fields = {f.name for f in dataclasses.fields(Predictions)}
            predictions = Predictions(**{k: v for k, v in (data.get("predictions") or {}).items() if k in fields})
            weights = tuple(_weight_from_dict(w) for w in data.get("weights", ()))
            sliced = tuple(SlicedOp(s["op"], int(s["slices"]), tuple(s["from_host"]), s["trigger"], s.get("reason", ""))
                           for s in data.get("sliced", ()))
            return cls(decisions=decisions, device=data["device"], host=data["host"],
                       policies=dict(data.get("policies") or {}), phase_counts=dict(data.get("phase_counts") or {}),
                       budget_bytes=data.get("budget_bytes"), device_spec=data.get("device_spec"),
                       orderings=orderings, predictions=predictions, weights=weights, sliced=sliced)
        except (KeyError, TypeError, ValueError) as err:
            raise LMSOptionError(f"malformed lms-tf plan: {type(err).__name__}: {err}. A plan file holds what "
                                 f"Plan.to_json() wrote; an edit may change a decision's 'decision' "
                                 f"field (keep/swap/recompute) and what it names.") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan in ``text`` (what :meth:`to_json` wrote).

        Raises:
            LMSOptionError: Not JSON, another schema version, or a malformed field.

        Examples:
            >>> Plan.from_json('{"schema_version": 0}')  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            lms_tf.LMSOptionError: not an lms-tf plan of schema version 1: found schema_version=0...
        """
        try:
            data = json.loads(text)
        except ValueError as err:
            raise LMSOptionError(f"a plan must be JSON (what Plan.to_json() wrote); it does not parse: {err}.") \
                from None
        return cls.from_dict(data)


def _decision_from_dict(d: Mapping[str, Any]) -> TensorDecision:
    shape = d.get("shape")
    return TensorDecision(
        tensor=d["tensor"], layer=d["layer"], shape=None if shape is None else tuple(shape), nbytes=d.get("nbytes"),
        decision=Decision(d["decision"]), reason=d.get("reason", ""), distance=d.get("distance"),
        swap_ins=tuple(SwapIn(s["trigger"], tuple(s["consumers"])) for s in d.get("swap_ins", ())),
        recompute_ops=tuple(d.get("recompute_ops", ())), gate=d.get("gate"), consumers=tuple(d.get("consumers", ())),
        swap_out_before=d.get("swap_out_before"))


def _weight_from_dict(w: Mapping[str, Any]) -> WeightDecision:
    shape = w.get("shape")
    return WeightDecision(
        variable=w["variable"], reads=tuple(w["reads"]), shape=None if shape is None else tuple(shape),
        nbytes=w.get("nbytes"), decision=Decision(w["decision"]), reason=w.get("reason", ""),
        fetches=tuple(SwapIn(f["trigger"], tuple(f["consumers"]), tuple(f.get("after_gradients", ())))
                      for f in w.get("fetches", ())),
        clone_fetches_after=tuple((gate, op) for gate, op in w.get("clone_fetches_after", ())))
