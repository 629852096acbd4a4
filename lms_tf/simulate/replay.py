"""The replay engine: runs lowered events as TensorFlow's executor does (one compute stream, first ready
first run, one copy stream per direction, and one host stream for an optimizer update
that runs on the host) and tracks live buffers, the peak and the step time.

Examples:
    >>> EDGE_SET_INLINE
    8
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import random
from typing import Dict, List, Mapping, Optional, Tuple

from lms_tf.core.errors import PlanCycleError
from lms_tf.core.ir import Phase
from lms_tf.core.op_kinds import RECOMPUTE_PREFIX, SWAP_IN_PREFIX
from lms_tf.simulate.allocator import BFCAllocatorModel, replay_allocations
from lms_tf.simulate.lower import COMPUTE_STREAM, HOST_COMPUTE_STREAM, TO_DEVICE_STREAM, TO_HOST_STREAM, Lowered
from lms_tf.simulate.pool import host_resident, pool_history

#: The streams events run on; each runs one event at a time.
STREAMS = (COMPUTE_STREAM, TO_HOST_STREAM, TO_DEVICE_STREAM, HOST_COMPUTE_STREAM)

#: How many out-edges TensorFlow keeps in insertion order (``EdgeSet``'s inline array: 64 bytes
#: of pointers); a node with more keeps them in a hash set of pointers, whose order changes from
#: one process to the next, and the executor queues the ops it makes ready in that order.
EDGE_SET_INLINE = 8

#: How the host may run an optimizer update placed there (``simulate(host_update=)``).
HOST_UPDATE_ORDERS = ("all_at_once", "one_variable_at_a_time")


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
        timeline: ``(seconds, bytes in use, bytes in flight to host, bytes in flight to device,
            recomputed bytes in use, swapped-in bytes in use)`` after every allocation or free
            (the last two are parts of the bytes in use).
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
        backward_start_s: When the forward pass ended (its last op finished) in a step that has a
            backward pass, else None: where a plot marks the boundary.
        host_peak_bytes: Peak host bytes the step needs in this process: the variables on the
            host (:func:`~lms_tf.simulate.pool.host_resident`), each copy out from its start until
            its last copy back ends, weight gradients copied out for the host update, and the
            outputs of the update's ops on the host until their last reader ends.
        host_compute_time_s: Sum of the host stream's op times (the optimizer update, when it
            runs on the host).

    Examples:
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
    backward_start_s: Optional[float] = None
    host_peak_bytes: int = 0
    host_compute_time_s: float = 0.0

    @property
    def held_bytes(self) -> int:
        """What device memory must hold at the peak: the tensors, or the allocator's whole
        chunks when the allocations were replayed through a model of it (whichever is larger).

        Examples:
            >>> Simulation(10, "a", (), 1.0, 1.0, 0, 0, (), allocator_peak_bytes=12).held_bytes
            12
        """
        return max(self.peak_bytes, self.allocator_peak_bytes or 0)


def _kind(key: str) -> Optional[str]:
    """The prefix of a recomputed or swapped-in buffer's key, None for any other buffer."""
    if key.startswith(RECOMPUTE_PREFIX):
        return RECOMPUTE_PREFIX
    if key.startswith(SWAP_IN_PREFIX):
        return SWAP_IN_PREFIX
    return None


def _forward_op_names(ir) -> Tuple[Tuple[str, ...], bool]:
    """The IR's forward ops' names and whether it has a backward pass (cached on the IR: every
    replay marks where the forward pass ends)."""
    return ir.memo("_forward_op_names", lambda: (tuple(op.name for op in ir.ops if op.phase is Phase.FORWARD),
                                                 any(op.phase is Phase.BACKWARD for op in ir.ops)))


def replay(builder: Lowered, *, top: Optional[int], priority: Optional[Dict[str, float]],
            log_allocations: bool, allocator: Optional[BFCAllocatorModel], tie_seed: Optional[int],
            host_update: str = "all_at_once") -> Simulation:
    """Runs the built step on the compute and copy streams (see :func:`simulate`). Leaves
    ``builder`` as it found it unless ``priority`` is given, so a step built once can be replayed
    in several tie orders.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> from lms_tf.simulate.lower import lower
        >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> replay(lowered, top=1, priority=None, log_allocations=False, allocator=None, tie_seed=None).peak_bytes
        12582916
    """
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
    uses: Dict[str, int] = {}
    for op in ops:
        for key in set(op.reads):
            uses[key] = uses.get(key, 0) + 1
        for key in op.host_reads:  # distinct keys, never a device buffer's
            uses[key] = uses.get(key, 0) + 1
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
    # Host memory: the offloaded weights for the whole step, plus each copy out from its start
    # until its last reader (a swap-in) ends, a weight gradient copied out for the host update until
    # the step ends (lower._host_buffers says why), and what the update's ops on the host make,
    # until their last reader ends.
    on_host_alive: Dict[str, int] = {}
    host_in_use = host_peak = sum(nbytes for handle, nbytes in host_resident(builder.ir, builder.on_host))
    copy_on_write: Dict[str, List[str]] = {}  # cow buffer -> reads it waits for
    in_use = peak = 0
    by_kind: Dict[Optional[str], int] = {None: 0, RECOMPUTE_PREFIX: 0, SWAP_IN_PREFIX: 0}  # bytes per _kind
    peak_op, alive_at_peak = "", {}
    in_flight = [0] * len(STREAMS)
    copying: Dict[int, int] = {}  # copy event -> the bytes it put in flight (a weight fetch's are the weight's)
    timeline: List[Tuple[float, int, int, int, int, int]] = []
    now = peak_time = 0.0
    intervals: Dict[str, Tuple[float, float]] = {}
    compute_time = host_compute_time = 0.0
    swap_bytes = [0] * len(STREAMS)

    # (The timeline is appended to inline after each start and finish: a replay of ResNet-50
    # starts and finishes about 15,000 events.)
    allocations: Optional[List[Tuple[str, str, object]]] = [] if log_allocations or allocator else None

    def allocate(key: str, nbytes: int) -> None:
        nonlocal in_use
        alive[key] = nbytes
        in_use += nbytes
        by_kind[_kind(key)] += nbytes
        if allocations is not None:
            allocations.append(("alloc", key, nbytes))

    def free(key: str) -> None:
        nonlocal in_use, host_in_use
        size = alive.pop(key, None)
        if size is not None:
            in_use -= size
            by_kind[_kind(key)] -= size
            if allocations is not None:
                allocations.append(("free", key, 0))
        elif key in on_host_alive:
            host_in_use -= on_host_alive.pop(key)

    # Each stream's ready ops, first in first out; with a ranking, by rank and then as they became
    # ready (a heap of (rank, arrival, op): what a stable sort of the queue by rank gives, without
    # sorting a long queue again each time an op ranked before its tail becomes ready).
    #
    # With ``host_update="one_variable_at_a_time"`` (and no ranking) the host's stream goes chain by
    # chain: an op made ready by the end of a host op takes that op's rank, any other (the first op
    # of a variable's update, made ready by its gradient's copy arriving) a new one. So the host
    # finishes each variable's update before it goes on with the next, in the order their gradients
    # arrived, as one of TensorFlow's executor threads does (it runs the op an inexpensive kernel
    # makes ready next, on the same thread), and holds one variable's temporaries at a time. By
    # default ("all_at_once") it is first in first out: each variable's update starts as its
    # gradient arrives, as on a host with a thread for each, and their temporaries are held
    # together. A host process with two threads lies between the two (the 4x decoder's host:
    # 208.4 and 259.5 MiB predicted, 208-228 measured).
    by_chain = priority is None and host_update == "one_variable_at_a_time"
    ranked = [priority is not None or (by_chain and stream == HOST_COMPUTE_STREAM) for stream in STREAMS]
    ready: List = [[] if by_rank else collections.deque() for by_rank in ranked]
    arrivals = itertools.count()
    chain_of: Dict[int, int] = {}

    def make_ready(i: int, made_ready_by: Optional[int] = None) -> None:
        stream = ops[i].stream
        if not ranked[stream]:
            ready[stream].append(i)
            return
        arrival = next(arrivals)
        if by_chain:
            same_chain = made_ready_by is not None and ops[made_ready_by].stream == stream
            rank = chain_of[i] = chain_of[made_ready_by] if same_chain else arrival
        else:
            rank = ops[i].order
        heapq.heappush(ready[stream], (rank, arrival, i))

    for i in sorted((i for i, n in enumerate(pending) if n == 0), key=lambda i: ops[i].order):
        make_ready(i)
    busy = [False] * len(STREAMS)
    events: List[Tuple[float, int, int]] = []

    def start(stream: int, at: float) -> None:
        nonlocal peak, peak_op, alive_at_peak, compute_time, host_compute_time, peak_time, host_in_use, host_peak
        i = heapq.heappop(ready[stream])[2] if ranked[stream] else ready[stream].popleft()
        op = ops[i]
        busy[stream] = True
        for key, nbytes in op.writes:
            if stream == TO_HOST_STREAM or not counted(key) and not key.startswith((SWAP_IN_PREFIX, RECOMPUTE_PREFIX)):
                continue
            reuse = None
            if op.forwarding:
                reuse = next((r for r in op.reads if r in alive and uses.get(r, 0) == 1 and alive[r] == nbytes), None)
            if reuse is not None:
                alive[key] = alive.pop(reuse)
                by_kind[_kind(reuse)] -= alive[key]  # the buffer may now hold another kind of value
                by_kind[_kind(key)] += alive[key]
                uses[reuse] = 0
                if allocations is not None:
                    allocations.append(("rename", reuse, key))
                continue
            allocate(key, nbytes)
        if op.updates is not None:
            pending_reads = [r for r in handle_reads.get(op.updates, ()) if uses.get(r, 0) > 0]
            if pending_reads:
                key = f"copy_on_write/{op.name}"
                allocate(key, builder.ir.tensors[pending_reads[0]].nbytes or 0)
                copy_on_write[key] = pending_reads
        if allocations is not None and op.workspace:
            allocations.append(("alloc", f"workspace/{op.name}", op.workspace))
        if stream == COMPUTE_STREAM:
            compute_time += op.duration
        elif stream == HOST_COMPUTE_STREAM:
            host_compute_time += op.duration
            for key, nbytes in op.host_writes:
                # Element-wise kernels write into an input nothing else reads, as on the device.
                reuse = next((r for r in op.host_reads if uses.get(r, 0) == 1 and on_host_alive.get(r) == nbytes),
                             None) if op.forwarding else None
                if reuse is not None:
                    on_host_alive[key] = on_host_alive.pop(reuse)
                    uses[reuse] = 0
                    continue
                on_host_alive[key] = nbytes
                host_in_use += nbytes
            host_peak = max(host_peak, host_in_use)
        else:
            # A copy in writes what it brings (a swap-in, a weight fetch); a copy out reads it.
            nbytes = sum(n for _, n in op.writes) if stream == TO_DEVICE_STREAM \
                else sum(builder.ir.tensors[r].nbytes or 0 for r in op.reads)
            in_flight[stream] += nbytes
            copying[i] = nbytes  # what its end takes off again
            swap_bytes[stream] += nbytes
            if stream == TO_HOST_STREAM:
                on_host_alive[op.writes[0][0] if op.writes else op.name] = nbytes
                host_in_use += nbytes
                host_peak = max(host_peak, host_in_use)
        intervals[op.name] = (at, at + op.duration)
        if in_use + op.workspace > peak:
            peak, peak_op, peak_time = in_use + op.workspace, op.name, at
            alive_at_peak = dict(alive)  # sorted once, at the end: the peak rises thousands of times
        timeline.append((at, in_use, in_flight[TO_HOST_STREAM], in_flight[TO_DEVICE_STREAM],
                         by_kind[RECOMPUTE_PREFIX], by_kind[SWAP_IN_PREFIX]))
        heapq.heappush(events, (at + op.duration, i, stream))

    def finish(i: int, at: float) -> None:
        op = ops[i]
        busy[op.stream] = False
        if allocations is not None and op.workspace:
            allocations.append(("free", f"workspace/{op.name}", 0))
        if op.stream in (TO_HOST_STREAM, TO_DEVICE_STREAM):
            in_flight[op.stream] -= copying.pop(i, 0)
        # The device's buffers, then the host's (an update op on the host has only those).
        for reads, writes in ((dict.fromkeys(op.reads), op.writes), (op.host_reads, op.host_writes)):
            for key in reads:  # TensorFlow's executor releases inputs in order
                uses[key] -= 1
                if uses[key] <= 0:
                    free(key)
            for key, _ in writes:
                if uses.get(key, 0) <= 0:
                    free(key)
        if copy_on_write:
            for key in [k for k, reads in copy_on_write.items() if all(uses.get(r, 0) <= 0 for r in reads)]:
                del copy_on_write[key]
                free(key)
        timeline.append((at, in_use, in_flight[TO_HOST_STREAM], in_flight[TO_DEVICE_STREAM],
                         by_kind[RECOMPUTE_PREFIX], by_kind[SWAP_IN_PREFIX]))
        for s in successors[i]:
            pending[s] -= 1
            if pending[s] == 0:
                make_ready(s, made_ready_by=i)

    while True:
        for stream in STREAMS:
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
    # The forward pass ends with its last op (the loss): backward ops that need no gradient
    # (shapes, constants) may start long before it.
    live_at_peak = tuple(sorted(alive_at_peak.items(), key=lambda kv: -kv[1])[:top])
    forward_names, has_backward = _forward_op_names(builder.ir)
    forward_ends = [intervals[name][1] for name in forward_names if name in intervals]
    return Simulation(peak_bytes=peak, peak_op=peak_op, live_at_peak=live_at_peak, step_time_s=now,
                      compute_time_s=compute_time, host_compute_time_s=host_compute_time, swap_out_bytes=swap_bytes[TO_HOST_STREAM],
                      swap_in_bytes=swap_bytes[TO_DEVICE_STREAM], timeline=tuple(timeline), peak_time_s=peak_time,
                      op_intervals=intervals, allocations=tuple(allocations or ()) if log_allocations else (),
                      allocator_peak_bytes=None if allocator is None else replay_allocations(
                          allocations, allocator, history=pool_history(builder.ir, builder.accumulated_sums,
                                                               builder.on_host)),
                      backward_start_s=max(forward_ends) if forward_ends and has_backward else None,
                      host_peak_bytes=host_peak)
