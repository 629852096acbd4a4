"""Memory and time simulator: replays a step, with or without a plan, on a device.

The step is replayed as TensorFlow's executor runs it on an accelerator: one compute
stream that runs ops in the order they become ready (first ready, first run; ties in
graph order), and one copy stream per direction for swap-outs and swap-ins. Memory follows
TensorFlow's rules:

* an op's outputs are allocated when it starts; a buffer is freed when its last reader
  ends (Identity, IdentityN, StopGradient, Reshape, Squeeze and ExpandDims alias their
  input: Grappler removes identities, and the others share the buffer);
* elementwise kernels reuse an input buffer of the same size that nobody else will read
  (``forward_input_or_allocate_output``), so ``Relu(BiasAdd(...))`` allocates once;
* convolution kernels hold scratch memory about the size of their largest operand while
  they run (cuDNN's workspace on a GPU, im2col buffers of TensorFlow's Eigen kernels on the
  CPU); with ``kernels="onednn"`` (TensorFlow's default CPU kernels on x86) they take none
  from TensorFlow's allocator, but a max pool whose gradient is taken keeps a one-byte-per-
  element workspace from its forward run until that gradient ends;
* variables, constants and the step's inputs are resident (not counted); an update of a
  variable while one of its reads is still pending copies the variable first
  (TensorFlow's copy-on-write), which is counted;
* with a plan, a swapped tensor leaves the device when its swap-out copy ends (and its
  forward readers are done), and a forward op told to wait for that copy starts after it;
  its swap-in is allocated when the copy back starts, right after its trigger op, and
  consumers wait for the copy to end; recompute clones run after their gate and hold their
  outputs until their backward readers end; a plan's orderings hold backward ops back until
  other backward ops ended.

``peak_bytes`` sums the live tensors. TensorFlow's allocator holds whole chunks, which can be
larger: ``simulate(..., allocator=tensorflow_gpu_allocator(...))`` replays the same allocations
through a model of it (:mod:`lms_tf.simulate.allocator`) into ``allocator_peak_bytes``, after
what the pool served before the first step (:func:`pool_history`).

Two rules of TensorFlow's executor decide which buffers are reused and freed when:

* Grappler sorts a commutative op's inputs by name, and an elementwise kernel writes into the
  first input nobody else reads (a gradient sum at a residual connection keeps the buffer of
  the branch whose name sorts first); a kernel's inputs are released in input order;
* Grappler's memory optimizer turns some sums of three or more gradients into additions into
  a temporary variable (``accumulated_sums``): such a sum takes a buffer of its own.

Example:
    >>> import tensorflow as tf
    >>> from lms_tf.tf.trace import build_ir
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> @tf.function
    ... def f(x):
    ...     return tf.reduce_sum(tf.nn.relu(x * 2.0) + 1.0)
    >>> ir = build_ir(f.get_concrete_function(tf.ones((1024, 256))).graph)
    >>> sim = simulate(ir, cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    >>> sim.peak_bytes // 2**10   # KiB: one 1 MiB buffer, reused in place by Relu and Add (+ the 4-byte sum)
    1024
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import random
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from lms_tf.core.errors import LMSOptionError, PlanCycleError
from lms_tf.core.ir import GraphIR, OpInfo
from lms_tf.core.op_kinds import (
    ALIAS_TYPES,
    COMMUTATIVE_TYPES,
    FORWARDING_TYPES,
    MAXPOOL_GRAD_TYPES,
    MAXPOOL_TYPES,
    RECOMPUTE_PREFIX,
    RESIDENT_TYPES,
    SWAP_IN_PREFIX,
    VARIABLE_UPDATE_PREFIXES,
    WORKSPACE_TYPES,
    recompute_clone_name,
)
from lms_tf.core.plan import Decision, Plan
from lms_tf.cost.model import CostModel
from lms_tf.simulate.allocator import BFCAllocatorModel, replay_allocations

#: Kernel libraries whose scratch memory :func:`simulate` models (``kernels=``). ``"cudnn"`` (a GPU)
#: and ``"eigen"`` (TensorFlow's CPU kernels with ``TF_ENABLE_ONEDNN_OPTS=0``) take convolution
#: scratch from TensorFlow's allocator; ``"onednn"`` (TensorFlow's default CPU kernels on x86)
#: takes none, and gives a max pool a workspace output its gradient reads (one byte per
#: element: TensorFlow's allocation trace shows ``[12845056]`` beside a ``[16,112,112,64]``
#: float32 pool output).
KERNEL_LIBRARIES = ("cudnn", "eigen", "onednn")
#: Suffix of the buffer key of a max pool's oneDNN workspace (``<pool output key>#workspace``).
POOL_WORKSPACE = "#workspace"

#: How many out-edges TensorFlow keeps in insertion order (``EdgeSet``'s inline array: 64 bytes
#: of pointers); a node with more keeps them in a hash set of pointers, whose order changes from
#: one process to the next, and the executor queues the ops it makes ready in that order.
EDGE_SET_INLINE = 8

_COMPUTE, _TO_HOST, _TO_DEVICE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The outcome of replaying one step.

    Attributes:
        peak_bytes: Peak device bytes of the step's transient tensors (resident
            variables and inputs excluded).
        peak_op: The op running when the peak was reached.
        live_at_peak: The largest buffers alive at the peak, ``(name, bytes)``.
        step_time_s: Predicted step time, stalls for swap-ins included.
        compute_time_s: Sum of compute-stream op times (recompute clones included).
        swap_out_bytes: Bytes copied device -> host.
        swap_in_bytes: Bytes copied host -> device.
        timeline: ``(seconds, bytes in use, bytes in flight to host, bytes in flight to device)``
            after every allocation or free.
        peak_time_s: When the peak was reached.
        op_intervals: Op name -> (start, end) seconds, for every op the simulation ran.
        allocations: With ``log_allocations=True``, every device allocation, free and in-place
            hand-over in the order the step ran them (``("alloc", key, bytes)``,
            ``("free", key, 0)``, ``("rename", old key, new key)``), kernel scratch included:
            what :func:`lms_tf.simulate.allocator.replay_allocations` feeds to a model of
            TensorFlow's allocator.
        allocator_peak_bytes: With ``allocator=``, the step's peak as TensorFlow's allocator
            counts it (whole chunks, after a warm-up step): the figure to compare with
            ``lms_tf.measure_peak_memory`` on a real run.

    Example:
        >>> Simulation(10, "a", (), 1.0, 1.0, 0, 0, ()).peak_bytes
        10
    """

    peak_bytes: int
    peak_op: str
    live_at_peak: Tuple[Tuple[str, int], ...]
    step_time_s: float
    compute_time_s: float
    swap_out_bytes: int
    swap_in_bytes: int
    timeline: Tuple[Tuple[float, int, int, int], ...]
    peak_time_s: float = 0.0
    op_intervals: Mapping[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)
    allocations: Tuple[Tuple[str, str, object], ...] = ()
    allocator_peak_bytes: Optional[int] = None

    @property
    def held_bytes(self) -> int:
        """What device memory must hold at the peak: the tensors, or the allocator's whole
        chunks when the allocations were replayed through a model of it (whichever is larger).

        Example:
            >>> Simulation(10, "a", (), 1.0, 1.0, 0, 0, (), allocator_peak_bytes=12).held_bytes
            12
        """
        return max(self.peak_bytes, self.allocator_peak_bytes or 0)


@dataclasses.dataclass(slots=True)
class _Op:
    name: str
    stream: int
    duration: float
    reads: List[str]
    writes: List[Tuple[str, int]]
    deps: List[int]
    forwarding: bool = False
    updates: Optional[str] = None  # variable handle tensor
    order: float = 0.0
    trigger: Optional[str] = None  # IR op after which a copy may start
    workspace: int = 0  # scratch bytes the kernel holds while it runs


class _Builder:
    """Turns the IR plus a plan into simulator ops with buffer keys."""

    def __init__(self, ir: GraphIR, cost: CostModel):
        self.ir = ir
        self.cost = cost
        self.ops: List[_Op] = []
        self.index_of: Dict[str, int] = {}
        self.replace: Dict[Tuple[str, str], str] = {}
        self.buffer_producer: Dict[str, int] = {}
        self.accumulated_sums: frozenset = frozenset()
        self.read_handles: Dict[str, str] = {}  # read buffer -> variable handle tensor

    def source(self, consumer: str, tensor: str) -> str:
        """The buffer ``consumer`` really reads for input ``tensor`` (aliases and re-pointing resolved)."""
        ir = self.ir
        while True:
            key = self.replace.get((consumer, tensor))
            if key is not None:
                return key
            producer = ir.op(ir.tensors[tensor].producer)
            if producer.type not in ALIAS_TYPES or not producer.inputs:
                return tensor
            position = producer.outputs.index(tensor) if producer.type == "IdentityN" else 0
            consumer, tensor = producer.name, producer.inputs[min(position, len(producer.inputs) - 1)]

    def counted(self, tensor: str) -> bool:
        cache = self.ir.__dict__.get("_counted")
        if cache is None:
            cache = {}
            object.__setattr__(self.ir, "_counted", cache)
        known = cache.get(tensor)
        if known is None:
            known = cache[tensor] = self._counted(tensor)
        return known

    def _counted(self, tensor: str) -> bool:
        info = self.ir.tensors.get(tensor)
        if info is None:
            return True  # a buffer the plan introduced
        producer = self.ir.op(info.producer)
        return not (producer.type in RESIDENT_TYPES or producer.name in self.ir.function_inputs
                    or info.dtype in ("resource", "variant", "string") or not info.nbytes)

    def add(self, op: _Op) -> int:
        self.ops.append(op)
        index = len(self.ops) - 1
        for key, _ in op.writes:
            self.buffer_producer[key] = index
        return index

    def indices_of(self, name: str) -> List[int]:
        """The simulator ops an IR op's name stands for: itself, or for an alias op (which the
        simulator does not run) the ops it waits for."""
        if name in self.index_of:
            return [self.index_of[name]]
        return [self.index_of[n] for n in self.producer_deps(self.ir.op(name))]

    def producer_deps(self, op: OpInfo) -> List[str]:
        """Names of the non-alias ops an IR op waits for: producers of the buffers it reads (through
        aliases, output by output) and its control inputs (an alias op as a control input waits for
        all of its inputs)."""
        ir, names = self.ir, []
        for t in op.inputs:
            key = self.source(op.name, t)
            if key in ir.tensors:
                names.append(ir.tensors[key].producer)
        stack, seen = list(op.control_inputs), set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            dep = ir.op(name)
            if dep.type in ALIAS_TYPES:
                stack.extend(ir.tensors[t].producer for t in dep.inputs)
                stack.extend(dep.control_inputs)
            else:
                names.append(name)
        return names


def ALIAS_OP_NAMES(ir: GraphIR) -> frozenset:  # noqa: N802 - a cached constant of the IR
    """Names of the IR's alias ops (cached on the IR)."""
    cached = ir.__dict__.get("_alias_op_names")
    if cached is None:
        cached = frozenset(op.name for op in ir.ops if op.type in ALIAS_TYPES)
        object.__setattr__(ir, "_alias_op_names", cached)
    return cached


def READS_ALIAS(ir: GraphIR) -> frozenset:  # noqa: N802 - a cached constant of the IR
    """Names of the IR's ops that read an alias op's output (cached on the IR)."""
    cached = ir.__dict__.get("_reads_alias")
    if cached is None:
        aliases = ALIAS_OP_NAMES(ir)
        cached = frozenset(op.name for op in ir.ops if any(ir.tensors[t].producer in aliases for t in op.inputs))
        object.__setattr__(ir, "_reads_alias", cached)
    return cached


def _plain_structure(ir: GraphIR) -> Dict[str, Tuple[Tuple[str, ...], List[Tuple[str, int]], Tuple[str, ...]]]:
    """Per non-alias op of the plain step: buffers read, buffers written, ops waited for.
    Cached on the IR: planners replay one step many times and a plan changes few ops."""
    cached = ir.__dict__.get("_plain_structure")
    if cached is None:
        b = _Builder(ir, None)
        cached = {}
        for op in ir.ops:
            if op.type not in ALIAS_TYPES:
                cached[op.name] = (tuple(b.source(op.name, t) for t in op.inputs),
                                   [(t, ir.tensors[t].nbytes or 0) for t in op.outputs],
                                   tuple(b.producer_deps(op)))
        object.__setattr__(ir, "_plain_structure", cached)
    return cached


def _canonical_reads(op: OpInfo, reads: Iterable[str]) -> List[str]:
    """``reads`` (one buffer per input of ``op``) in the order TensorFlow runs them: Grappler's
    canonicalizer sorts a commutative op's inputs by their names (``"x"`` for output 0, ``"x:1"``),
    and the kernel forwards into the first one it may reuse."""
    reads = list(reads)
    if op.type not in COMMUTATIVE_TYPES or len(reads) != len(op.inputs):
        return reads

    def grappler_name(tensor: str) -> str:
        return tensor[:-2] if tensor.endswith(":0") else tensor

    order = sorted(range(len(reads)), key=lambda i: grappler_name(op.inputs[i]))
    return [reads[i] for i in order]


def _workspace(ir: GraphIR, op: OpInfo, kernels: str) -> int:
    """Scratch bytes a convolution kernel holds while it runs: about its largest operand (cuDNN's
    workspace, or the im2col buffers of TensorFlow's Eigen kernels; oneDNN takes its scratchpad
    from elsewhere)."""
    if op.type not in WORKSPACE_TYPES or kernels == "onednn":
        return 0
    return max([ir.tensors[t].nbytes or 0 for t in op.inputs] or [0])


def _pool_workspace_bytes(ir: GraphIR, tensor: str) -> int:
    """oneDNN's max-pool workspace for the pool output ``tensor``: one byte per element (0 when
    its size is unknown)."""
    info = ir.tensors[tensor]
    if not info.nbytes:
        return 0
    count = 1
    for d in info.shape:
        count *= d
    return count


def _pooled_for_gradient(b: "_Builder") -> frozenset:
    """Names of the max pools whose output a max-pool gradient reads (oneDNN gives those a
    workspace); aliases between them resolved by the builder, before any plan re-points reads."""
    ir, pools = b.ir, set()
    for op in ir.ops:
        if op.type in MAXPOOL_GRAD_TYPES and len(op.inputs) > 1:
            producer = ir.op(ir.tensors[b.source(op.name, op.inputs[1])].producer)
            if producer.type in MAXPOOL_TYPES:
                pools.add(producer.name)
    return frozenset(pools)


def _build(ir: GraphIR, plan: Optional[Plan], cost: CostModel, op_times: Optional[Mapping[str, float]] = None,
           kernels: str = "cudnn", accumulated_sums: frozenset = frozenset()) -> _Builder:
    if kernels not in KERNEL_LIBRARIES:
        raise LMSOptionError(f"simulate(kernels=...) must be one of {', '.join(map(repr, KERNEL_LIBRARIES))} "
                             f"(the kernel library whose scratch memory to model); got {kernels!r}.")
    b = _Builder(ir, cost)
    b.accumulated_sums = accumulated_sums
    pooled = _pooled_for_gradient(b) if kernels == "onednn" else frozenset()
    op_time = (lambda op: op_times[op.name]) if op_times is not None else (lambda op: cost.op_time(ir, op))  # noqa
    ir_names = {op.name for op in ir.ops if op.type not in ALIAS_TYPES}
    decisions = {d.tensor: d for d in plan.decisions} if plan is not None else {}
    swapped = {t for t, d in decisions.items() if d.decision is Decision.SWAP}
    # Re-pointing decided by the plan: backward consumers read swap-ins and clones.
    for d in decisions.values():
        if d.decision is Decision.SWAP:
            for i, s in enumerate(d.swap_ins):
                for consumer in s.consumers:
                    b.replace[(consumer, d.tensor)] = f"{SWAP_IN_PREFIX}{d.tensor}/{i}"
        elif d.decision is Decision.RECOMPUTE:
            for consumer in d.consumers:
                b.replace[(consumer, d.tensor)] = recompute_clone_name(d.gate, d.tensor)

    extra_after: Dict[str, List[_Op]] = collections.defaultdict(list)  # ops gated by an IR op
    extra_deps: Dict[str, List[str]] = collections.defaultdict(list)  # IR op -> names of extra ops it waits for
    for t in sorted(swapped, key=lambda t: ir.op(ir.tensors[t].producer).index):
        d, nbytes = decisions[t], decisions[t].nbytes or 0
        extra_after[ir.tensors[t].producer].append(_Op(
            f"swap_out/{t}", _TO_HOST, cost.transfer_time(nbytes, "device_to_host"), [b.source("", t)],
            [(f"host/{t}", 0)], []))
        if d.swap_out_before is not None:
            extra_deps[d.swap_out_before].append(f"swap_out/{t}")
        for i, s in enumerate(d.swap_ins):
            key = f"{SWAP_IN_PREFIX}{t}/{i}"
            extra_after[s.trigger].append(_Op(key, _TO_DEVICE, cost.transfer_time(nbytes, "host_to_device"),
                                              [f"host/{t}"], [(key, nbytes)], [], trigger=s.trigger))
            for consumer in s.consumers:
                extra_deps[consumer].append(key)
    cloned = set()
    for d in decisions.values():
        if d.decision is not Decision.RECOMPUTE:
            continue
        region = set(d.recompute_ops)
        for name in d.recompute_ops:
            if (name, d.gate) in cloned:
                continue
            cloned.add((name, d.gate))
            op = ir.op(name)
            reads = []
            for t in op.inputs:
                producer = ir.tensors[t].producer
                if producer in region:
                    reads.append(recompute_clone_name(d.gate, t))
                elif t in swapped:
                    key = f"{SWAP_IN_PREFIX}{t}/@{d.gate}"
                    if not any(o.name == key for o in extra_after[d.gate]):
                        nbytes = decisions[t].nbytes or 0
                        extra_after[d.gate].append(_Op(key, _TO_DEVICE, cost.transfer_time(nbytes, "host_to_device"),
                                                       [f"host/{t}"], [(key, nbytes)], [], trigger=d.gate))
                    reads.append(key)
                else:
                    reads.append(b.source(name, t))
            writes = [(recompute_clone_name(d.gate, t), ir.tensors[t].nbytes or 0) for t in op.outputs]
            extra_after[d.gate].append(_Op(recompute_clone_name(d.gate, name), _COMPUTE, op_time(op),
                                           _canonical_reads(op, reads),
                                           writes, [], forwarding=op.type in FORWARDING_TYPES, trigger=d.gate))
        for consumer in d.consumers:
            extra_deps[consumer].append(recompute_clone_name(d.gate, ir.tensors[d.tensor].producer))

    for ordering in plan.orderings if plan is not None else ():
        for waiter in ordering.waiters:
            extra_deps[waiter].extend(ordering.after)

    plain = _plain_structure(ir)
    reads_alias = READS_ALIAS(ir)
    # Ops whose reads and waits differ from the plain step's: re-pointed consumers, and readers of
    # an alias (whose source may now be a swap-in or a clone). The others reuse the cached structure.
    rebuilt = {consumer for consumer, _ in b.replace} | reads_alias if b.replace else set()
    for op in ir.ops:
        if op.type in ALIAS_TYPES:
            for extra in extra_after.get(op.name, ()):
                extra.order = op.index + 0.5
                b.index_of[extra.name] = b.add(extra)
            continue
        cached_reads, writes, _ = plain[op.name]
        reads = _canonical_reads(op, [b.source(op.name, t) for t in op.inputs] if op.name in rebuilt else cached_reads)
        if op.name in pooled:
            writes = writes + [(op.outputs[0] + POOL_WORKSPACE, _pool_workspace_bytes(ir, op.outputs[0]))]
        if op.type in MAXPOOL_GRAD_TYPES and len(cached_reads) > 1 and ir.tensors[cached_reads[1]].producer in pooled:
            # Max pools are never cloned (NEVER_CLONED_TYPES): the gradient reads the workspace its
            # forward pool wrote, also when it reads the pool output itself from a swap-in.
            reads.append(cached_reads[1] + POOL_WORKSPACE)
        updates = op.inputs[0] if op.type.startswith(VARIABLE_UPDATE_PREFIXES) and op.inputs else None
        index = b.add(_Op(op.name, _COMPUTE, op_time(op), reads, writes, [],
                          forwarding=op.type in FORWARDING_TYPES and op.name not in accumulated_sums,
                          updates=updates, order=op.index,
                          workspace=_workspace(ir, op, kernels)))
        b.index_of[op.name] = index
        if op.type == "ReadVariableOp" and op.inputs:
            b.read_handles[op.outputs[0]] = op.inputs[0]
        for extra in extra_after.get(op.name, ()):
            extra.order = op.index + 0.5
            b.index_of[extra.name] = b.add(extra)

    # Dependencies: producers of every buffer read, control edges, triggers (gates) and swap-ins.
    for index, sim in enumerate(b.ops):
        deps = {b.buffer_producer[k] for k in sim.reads if k in b.buffer_producer}
        if sim.trigger is not None:
            deps.update(b.indices_of(sim.trigger))
        if sim.name in ir_names:
            names = b.producer_deps(ir.op(sim.name)) if sim.name in rebuilt else plain[sim.name][2]
            deps.update(b.index_of[n] for n in names)
            for n in extra_deps.get(sim.name, ()):
                deps.update(b.indices_of(n))
        sim.deps = sorted(deps - {index})
    return b


def simulate(ir: GraphIR, plan: Optional[Plan] = None, *, cost: CostModel, top: Optional[int] = 8,
             priority: Optional[Dict[str, float]] = None,
             op_times: Optional[Mapping[str, float]] = None, log_allocations: bool = False,
             allocator: Optional[BFCAllocatorModel] = None, tie_seed: Optional[int] = None,
             kernels: str = "cudnn", accumulated_sums: Iterable[str] = ()) -> Simulation:
    """Replays the step (rewritten by ``plan``, if given) and reports memory and time.

    Args:
        ir: The step's IR (of the plain, un-rewritten step).
        plan: A plan for this IR, or None for the plain step.
        cost: Op and transfer times on the target device.
        top: How many of the largest live buffers to report at the peak (None: all).
        priority: Op name -> rank; among ready ops the lowest rank runs first (e.g. the start
            times of a profiled real step, to replay the order TensorFlow really used).
        op_times: Op name -> predicted seconds, when already computed with ``cost`` (planners
            simulate one step many times).
        log_allocations: Record :attr:`Simulation.allocations`.
        allocator: A fresh model of TensorFlow's allocator (e.g. :func:`tensorflow_cpu_allocator`)
            to replay the step's allocations through: fills :attr:`Simulation.allocator_peak_bytes`.
        tie_seed: For ops with more than :data:`EDGE_SET_INLINE` successors, queue the ops
            their end makes ready in a random order drawn from this seed instead of graph
            order, as TensorFlow's executor does in another process (its order for those comes
            from a hash set of pointers): the spread of the peak over a few seeds is how much
            the prediction depends on it.
        kernels: The kernel library whose scratch memory to model (:data:`KERNEL_LIBRARIES`):
            ``"cudnn"`` on a GPU; on the CPU ``"onednn"`` (TensorFlow's default on x86) or
            ``"eigen"`` (with ``TF_ENABLE_ONEDNN_OPTS=0``).
        accumulated_sums: ``AddN`` ops that Grappler's memory optimizer turns into additions
            into a temporary variable (:func:`lms_tf.tf.diagnostics.grappler_accumulated_sums`):
            their sum takes a buffer of its own instead of writing into an input.

    Returns:
        A :class:`Simulation`.

    Raises:
        LMSOptionError: ``kernels`` is not one of :data:`KERNEL_LIBRARIES`.

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> simulate(GraphIR((), {}, frozenset(), {}), cost=CostModel(get_device_spec("a100-40gb-pcie4"))).peak_bytes
        0
    """
    return _replay(_build(ir, plan, cost, op_times, kernels, frozenset(accumulated_sums)), top=top, priority=priority,
                   log_allocations=log_allocations, allocator=allocator, tie_seed=tie_seed)


def simulate_tie_orders(ir: GraphIR, plan: Optional[Plan], seeds: Iterable[int], *, cost: CostModel,
                        op_times: Optional[Mapping[str, float]] = None) -> Iterator[Simulation]:
    """:func:`simulate` with ``tie_seed`` set to each of ``seeds`` in turn, allocations logged
    (the step is built once: planners check one plan in several tie orders).

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> [s.peak_bytes for s in simulate_tie_orders(GraphIR((), {}, frozenset(), {}), None, [0, 1],
        ...                                            cost=CostModel(get_device_spec("a100-40gb-pcie4")))]
        [0, 0]
    """
    builder = _build(ir, plan, cost, op_times)
    for seed in seeds:
        yield _replay(builder, top=1, priority=None, log_allocations=True, allocator=None, tie_seed=seed)


def _replay(builder: _Builder, *, top: Optional[int], priority: Optional[Dict[str, float]],
            log_allocations: bool, allocator: Optional[BFCAllocatorModel], tie_seed: Optional[int]) -> Simulation:
    """Runs the built step on the compute and copy streams (see :func:`simulate`). Leaves
    ``builder`` as it found it unless ``priority`` is given, so a step built once can be replayed
    in several tie orders."""
    ops, read_handles, counted = builder.ops, builder.read_handles, builder.counted
    if priority is not None:
        # Ops the ranking does not name (clones, copies) rank right after their trigger, others
        # right after the op before them in graph order.
        previous = 0.0
        for op in ops:
            if op.name in priority:
                op.order = previous = priority[op.name]
            elif op.trigger is not None and op.trigger in priority:
                op.order = priority[op.trigger] + 1e-9
            else:
                op.order = previous = previous + 1e-9
    uses: Dict[str, int] = collections.Counter()
    for op in ops:
        for key in set(op.reads):
            uses[key] += 1
    handle_reads: Dict[str, List[str]] = collections.defaultdict(list)
    for key, handle in read_handles.items():
        handle_reads[handle].append(key)
    successors: List[List[int]] = [[] for _ in ops]
    pending = [len(op.deps) for op in ops]
    for i, op in enumerate(ops):
        for d in op.deps:
            successors[d].append(i)
    if tie_seed is not None:
        rng = random.Random(tie_seed)
        for ready_together in successors:
            if len(ready_together) > EDGE_SET_INLINE:
                rng.shuffle(ready_together)

    alive: Dict[str, int] = {}
    copy_on_write: Dict[str, List[str]] = {}  # cow buffer -> reads it waits for
    in_use = peak = 0
    peak_op, live_at_peak = "", ()
    in_flight = [0, 0, 0]
    timeline: List[Tuple[float, int, int, int]] = []
    now = peak_time = 0.0
    intervals: Dict[str, Tuple[float, float]] = {}
    compute_time = 0.0
    swap_bytes = [0, 0, 0]

    def record(t: float) -> None:
        timeline.append((t, in_use, in_flight[_TO_HOST], in_flight[_TO_DEVICE]))

    allocations: Optional[List[Tuple[str, str, object]]] = [] if log_allocations or allocator else None

    def allocate(key: str, nbytes: int) -> None:
        nonlocal in_use
        alive[key] = nbytes
        in_use += nbytes
        if allocations is not None:
            allocations.append(("alloc", key, nbytes))

    def free(key: str) -> None:
        nonlocal in_use
        size = alive.pop(key, None)
        if size is not None:
            in_use -= size
            if allocations is not None:
                allocations.append(("free", key, 0))

    ready: List[collections.deque] = [collections.deque(), collections.deque(), collections.deque()]
    initial = sorted((i for i, n in enumerate(pending) if n == 0), key=lambda i: ops[i].order)
    for i in initial:
        ready[ops[i].stream].append(i)
    busy = [False, False, False]
    events: List[Tuple[float, int, int]] = []

    def start(stream: int, at: float) -> None:
        nonlocal peak, peak_op, live_at_peak, compute_time, peak_time
        i = ready[stream].popleft()
        op = ops[i]
        busy[stream] = True
        for key, nbytes in op.writes:
            if stream == _TO_HOST or not counted(key) and not key.startswith((SWAP_IN_PREFIX, RECOMPUTE_PREFIX)):
                continue
            reuse = None
            if op.forwarding:
                reuse = next((r for r in op.reads if r in alive and uses[r] == 1 and alive[r] == nbytes), None)
            if reuse is not None:
                alive[key] = alive.pop(reuse)
                uses[reuse] = 0
                if allocations is not None:
                    allocations.append(("rename", reuse, key))
                continue
            allocate(key, nbytes)
        if op.updates is not None:
            pending_reads = [r for r in handle_reads.get(op.updates, ()) if uses[r] > 0]
            if pending_reads:
                key = f"copy_on_write/{op.name}"
                allocate(key, builder.ir.tensors[pending_reads[0]].nbytes or 0)
                copy_on_write[key] = pending_reads
        if allocations is not None and op.workspace:
            allocations.append(("alloc", f"workspace/{op.name}", op.workspace))
        if stream == _COMPUTE:
            compute_time += op.duration
        else:
            nbytes = sum(builder.ir.tensors[r[len("host/"):]].nbytes or 0 for r in op.reads if r.startswith("host/")) \
                if stream == _TO_DEVICE else sum(builder.ir.tensors[r].nbytes or 0 for r in op.reads)
            in_flight[stream] += nbytes
            swap_bytes[stream] += nbytes
        intervals[op.name] = (at, at + op.duration)
        if in_use + op.workspace > peak:
            peak, peak_op, peak_time = in_use + op.workspace, op.name, at
            live_at_peak = tuple(sorted(alive.items(), key=lambda kv: -kv[1])[:top])
        record(at)
        heapq.heappush(events, (at + op.duration, i, stream))

    def finish(i: int, at: float) -> None:
        op = ops[i]
        busy[op.stream] = False
        if allocations is not None and op.workspace:
            allocations.append(("free", f"workspace/{op.name}", 0))
        if op.stream != _COMPUTE:
            in_flight[op.stream] -= sum(builder.ir.tensors[r[len("host/"):]].nbytes or 0 for r in op.reads
                                        if r.startswith("host/")) if op.stream == _TO_DEVICE else \
                sum(builder.ir.tensors[r].nbytes or 0 for r in op.reads)
        for key in dict.fromkeys(op.reads):  # TensorFlow's executor releases inputs in order
            uses[key] -= 1
            if uses[key] <= 0:
                free(key)
        for key, _ in op.writes:
            if uses[key] <= 0:
                free(key)
        for key in [k for k, reads in copy_on_write.items() if all(uses[r] <= 0 for r in reads)]:
            del copy_on_write[key]
            free(key)
        record(at)
        for s in successors[i]:
            pending[s] -= 1
            if pending[s] == 0:
                if priority is None:
                    ready[ops[s].stream].append(s)
                else:  # keep the ready queue sorted by the given rank
                    queue = ready[ops[s].stream]
                    queue.append(s)
                    if len(queue) > 1 and ops[queue[-2]].order > ops[s].order:
                        ready[ops[s].stream] = collections.deque(sorted(queue, key=lambda j: ops[j].order))

    while True:
        for stream in (_COMPUTE, _TO_HOST, _TO_DEVICE):
            if not busy[stream] and ready[stream]:
                start(stream, now)
        if not events:
            break
        now, i, _ = heapq.heappop(events)
        finish(i, now)
        while events and events[0][0] <= now:
            _, j, _ = heapq.heappop(events)
            finish(j, now)
    if len(intervals) < len(ops):
        stuck = [op.name for op in ops if op.name not in intervals][:5]
        raise PlanCycleError(
            f"the plan makes {len(ops) - len(intervals)} ops of the step wait for each other, e.g. {stuck}: "
            f"its gates, orderings or waits for copies out form a cycle. Drop the plan's added waits for these ops.")
    return Simulation(peak_bytes=peak, peak_op=peak_op, live_at_peak=live_at_peak, step_time_s=now,
                      compute_time_s=compute_time, swap_out_bytes=swap_bytes[_TO_HOST],
                      swap_in_bytes=swap_bytes[_TO_DEVICE], timeline=tuple(timeline), peak_time_s=peak_time,
                      op_intervals=intervals, allocations=tuple(allocations or ()) if log_allocations else (),
                      allocator_peak_bytes=None if allocator is None else replay_allocations(
                          allocations, allocator, history=pool_history(builder.ir, builder.accumulated_sums)))


def resident_buffers(ir: GraphIR) -> List[Tuple[str, int]]:
    """The variables the step reads (weights, optimizer slots), ``(handle, bytes)`` in graph
    order: resident for the whole step.

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> resident_buffers(GraphIR((), {}, frozenset(), {}))
        []
    """
    sizes: Dict[str, int] = {}
    for op in ir.ops:
        if op.type == "ReadVariableOp" and op.inputs:
            sizes[op.inputs[0]] = max(sizes.get(op.inputs[0], 0), ir.tensors[op.outputs[0]].nbytes or 0)
    return list(sizes.items())


def pool_history(ir: GraphIR, accumulated_sums: Iterable[str] = ()) -> List[Tuple[str, str, int]]:
    """What a Keras training process asks the allocator for before its first step, as
    ``("alloc" | "free", key, bytes)`` events (:func:`replay_allocations`' ``history``).

    The free chunks the first step finds decide where its tensors land, so the order matters:

    1. each variable the step reads, in graph order, as Keras creates it: a kernel (rank 2 or
       more) through a random initializer (Glorot, He: a draw, scaled, then shifted, each a
       buffer of the variable's size; the first two are freed), a vector from a constant;
    2. the step's inputs;
    3. for each of ``accumulated_sums``, the zeros constant its temporary variable starts from
       (kept while the step's function lives).

    TensorFlow's allocation trace shows this sequence (``StatelessRandomUniformV2``, ``Mul``,
    ``AddV2`` per kernel; ``AddN_98/tmp_var_zeros`` on ResNet-50).

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> pool_history(GraphIR((), {}, frozenset(), {}))
        []
    """
    events: List[Tuple[str, str, int]] = []
    ranks: Dict[str, int] = {}
    for op in ir.ops:
        if op.type == "ReadVariableOp" and op.inputs:
            ranks[op.inputs[0]] = max(ranks.get(op.inputs[0], 0), len(ir.tensors[op.outputs[0]].shape or ()))
    for handle, nbytes in resident_buffers(ir):
        if ranks.get(handle, 0) >= 2:
            draw, scaled = f"{handle}#initializer_draw", f"{handle}#initializer_scaled"
            events += [("alloc", draw, nbytes), ("alloc", scaled, nbytes), ("alloc", handle, nbytes),
                       ("free", scaled, 0), ("free", draw, 0)]
        else:
            events.append(("alloc", handle, nbytes))
    for op in ir.ops:
        if op.type in ("Placeholder", "_Arg") and op.outputs and ir.tensors[op.outputs[0]].dtype != "resource":
            events.append(("alloc", op.outputs[0], ir.tensors[op.outputs[0]].nbytes or 0))
    for name in sorted(accumulated_sums):
        if f"{name}:0" in ir.tensors:
            events.append(("alloc", f"{name}/tmp_var_zeros", ir.tensors[f"{name}:0"].nbytes or 0))
    return events


def resident_bytes(ir: GraphIR) -> int:
    """Bytes of the variables the step reads (weights, optimizer slots): resident for the whole step.

    Example:
        >>> from lms_tf.core.ir import GraphIR
        >>> resident_bytes(GraphIR((), {}, frozenset(), {}))
        0
    """
    return sum(nbytes for _, nbytes in resident_buffers(ir))
