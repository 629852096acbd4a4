"""A model of TensorFlow's BFC allocator: what a sequence of allocations really occupies.

TensorFlow serves tensors on a GPU (and on the CPU with ``TF_CPU_ALLOCATOR_USE_BFC=true``)
from a best-fit-with-coalescing allocator (``tsl/framework/bfc_allocator.cc``). Its
``bytes_in_use``, the figure ``tf.config.experimental.get_memory_info`` reports, counts whole
chunks, not requested bytes: a request is served from the smallest free chunk that fits, and
that chunk is split only when it is at least twice the request (or the rest is at least
128 MiB). A 147 MiB activation placed in a freed 256 MiB chunk occupies 256 MiB. On
MobileNetV2 and a Transformer encoder this internal fragmentation is 10-15% of the peak,
which a model that sums tensor sizes cannot see.

The model follows the allocator's rules: sizes rounded up to 256 bytes; 21 bins of free chunks
by power-of-two size class, each ordered by (size, address); best fit from the request's bin
upwards; the split rule above; a freed chunk merges with free neighbours in its region; with
``allow_growth`` (the CPU allocator) the pool grows by regions of 2 MiB, doubling each time,
and chunks never merge across regions; without it (the GPU default) one region holds the
whole memory limit. Where regions come from matters on ties: the CPU allocator's regions are
``mmap``-ed, and Linux places each new mapping below the last, so of two equal free chunks the
one in the newer region has the lower address and is served first.

Examples:
    >>> bfc = BFCAllocatorModel(memory_limit_bytes=2**30)
    >>> bfc.allocate("a", 100 * 2**20); bfc.allocate("b", 60 * 2**20)
    >>> bfc.free("a")
    >>> bfc.allocate("c", 60 * 2**20)   # best fit: the freed 100 MiB chunk, not split (< 2 x 60)
    >>> bfc.in_use_bytes // 2**20
    160
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from lms_tf.core.errors import LMSError

MIN_ALLOCATION_BYTES = 256
NUM_BINS = 21
MAX_INTERNAL_FRAGMENTATION_BYTES = 128 << 20
INITIAL_GROWTH_REGION_BYTES = 2 << 20
#: ``TF_CPU_BFC_MEM_LIMIT_IN_MB``'s default: the CPU allocator's memory limit (64 GiB).
CPU_MEMORY_LIMIT_BYTES = 64 << 30
#: Address space left between regions, so chunks of two regions are never neighbours.
_REGION_GAP = 1 << 40


def rounded_bytes(nbytes: int) -> int:
    """A request's size as the allocator serves it: at least 256 bytes, a multiple of 256.

    Examples:
        >>> rounded_bytes(1), rounded_bytes(257)
        (256, 512)
    """
    return max(MIN_ALLOCATION_BYTES, -(-nbytes // MIN_ALLOCATION_BYTES) * MIN_ALLOCATION_BYTES)


def bin_index(nbytes: int) -> int:
    """The free-list bin of a chunk: bin b holds sizes in [256 * 2**b, 256 * 2**(b+1)).

    Examples:
        >>> bin_index(256), bin_index(511), bin_index(512), bin_index(2**40)
        (0, 0, 1, 20)
    """
    return min(max(nbytes // MIN_ALLOCATION_BYTES, 1).bit_length() - 1, NUM_BINS - 1)


@dataclasses.dataclass
class _Chunk:
    ptr: int
    size: int
    in_use: bool = False
    prev: Optional["_Chunk"] = None
    next: Optional["_Chunk"] = None


class BFCAllocatorModel:
    """Replays allocations and frees through TensorFlow's BFC allocator rules.

    Args:
        memory_limit_bytes: The allocator's limit (a GPU: its memory; the CPU allocator:
            64 GiB unless ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` says otherwise).
        allow_growth: Grow the pool region by region (the CPU allocator, and GPUs with
            ``set_memory_growth``); otherwise one region of ``memory_limit_bytes``.
        new_regions_below: Each new region lies at lower addresses than the ones before (the
            CPU allocator on Linux, whose regions are ``mmap``-ed top-down), so best-fit ties go
            to the newest region; otherwise to the oldest.

    Attributes:
        in_use_bytes: Bytes of the chunks in use (TensorFlow's ``bytes_in_use``).
        peak_bytes: Largest ``in_use_bytes`` since creation or :meth:`reset_peak`.
        requested_bytes: Bytes requested by the allocations alive now.

    Raises:
        LMSError: An allocation does not fit in ``memory_limit_bytes``, or a key is
            allocated twice or freed without an allocation.

    Examples:
        >>> bfc = BFCAllocatorModel(memory_limit_bytes=2**30, allow_growth=True)
        >>> bfc.allocate("x", 3 * 2**20)   # more than the first 2 MiB region: a 4 MiB one is added,
        >>> bfc.pool_bytes // 2**20, bfc.in_use_bytes // 2**20   # and served whole (4 < 2 x 3)
        (4, 4)
    """

    def __init__(self, *, memory_limit_bytes: int, allow_growth: bool = False, new_regions_below: bool = False):
        self.memory_limit_bytes = int(memory_limit_bytes)
        self.allow_growth = allow_growth
        self.new_regions_below = new_regions_below
        self._next_region_bytes = rounded_bytes(min(self.memory_limit_bytes, INITIAL_GROWTH_REGION_BYTES)) \
            if allow_growth else rounded_bytes(self.memory_limit_bytes)
        self._bins: List[List[Tuple[int, int]]] = [[] for _ in range(NUM_BINS)]
        self._free_by_ptr: Dict[int, _Chunk] = {}
        self._allocated: Dict[str, Tuple[_Chunk, int]] = {}
        self.pool_bytes = 0
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.requested_bytes = 0
        self._regions = 0

    def allocate(self, key: str, nbytes: int) -> None:
        """Serves ``nbytes`` for ``key`` (a zero-byte request takes no memory, as in TF).

        Examples:
            >>> allocator = tensorflow_gpu_allocator(2**30)
            >>> allocator.allocate("t", 1000); allocator.in_use_bytes   # rounded to 256 bytes
            1024
        """
        if key in self._allocated:
            raise LMSError(f"allocator model: {key!r} is allocated twice; free it first.")
        if nbytes <= 0:
            return
        size = rounded_bytes(nbytes)
        chunk = self._best_fit(size)
        if chunk is None:
            self._extend(size)
            chunk = self._best_fit(size)
        if chunk.size >= 2 * size or chunk.size - size >= MAX_INTERNAL_FRAGMENTATION_BYTES:
            self._split(chunk, size)
        chunk.in_use = True
        self._allocated[key] = (chunk, nbytes)
        self.in_use_bytes += chunk.size
        self.requested_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)

    def free(self, key: str) -> None:
        """Returns ``key``'s chunk; it merges with free neighbours of its region.

        Examples:
            >>> allocator = tensorflow_gpu_allocator(2**30)
            >>> allocator.allocate("t", 1000); allocator.free("t"); allocator.in_use_bytes, allocator.peak_bytes
            (0, 1024)
        """
        entry = self._allocated.pop(key, None)
        if entry is None:
            return
        chunk, nbytes = entry
        self.in_use_bytes -= chunk.size
        self.requested_bytes -= nbytes
        chunk.in_use = False
        if chunk.next is not None and not chunk.next.in_use:
            self._unbin(chunk.next)
            self._absorb_next(chunk)
        if chunk.prev is not None and not chunk.prev.in_use:
            chunk = chunk.prev
            self._unbin(chunk)
            self._absorb_next(chunk)
        self._bin(chunk)

    def rename(self, old: str, new: str) -> None:
        """``new`` takes over ``old``'s buffer (a kernel writing its output into an input).

        Examples:
            >>> allocator = tensorflow_gpu_allocator(2**30)
            >>> allocator.allocate("t", 1000); allocator.rename("t", "u"); allocator.keys()
            ['u']
        """
        if old in self._allocated:
            self._allocated[new] = self._allocated.pop(old)

    def reset_peak(self) -> None:
        """Starts a new peak from the bytes in use now.

        Examples:
            >>> allocator = tensorflow_gpu_allocator(2**30)
            >>> allocator.allocate("t", 4096); allocator.free("t"); allocator.reset_peak(); allocator.peak_bytes
            0
        """
        self.peak_bytes = self.in_use_bytes

    def keys(self) -> List[str]:
        """The keys allocated now.

        Examples:
            >>> allocator = tensorflow_gpu_allocator(2**30)
            >>> allocator.allocate("b", 8); allocator.allocate("a", 8); allocator.keys()
            ['b', 'a']
        """
        return list(self._allocated)

    # --- free lists ---------------------------------------------------------------------------

    def _bin(self, chunk: _Chunk) -> None:
        bisect.insort(self._bins[bin_index(chunk.size)], (chunk.size, chunk.ptr))
        self._free_by_ptr[chunk.ptr] = chunk

    def _unbin(self, chunk: _Chunk) -> None:
        entries = self._bins[bin_index(chunk.size)]
        del entries[bisect.bisect_left(entries, (chunk.size, chunk.ptr))]
        del self._free_by_ptr[chunk.ptr]

    def _best_fit(self, size: int) -> Optional[_Chunk]:
        for index in range(bin_index(size), NUM_BINS):
            entries = self._bins[index]
            position = bisect.bisect_left(entries, (size,))  # the first chunk of at least size
            if position < len(entries):
                chunk = self._free_by_ptr[entries[position][1]]
                self._unbin(chunk)
                return chunk
        return None

    def _split(self, chunk: _Chunk, size: int) -> None:
        rest = _Chunk(ptr=chunk.ptr + size, size=chunk.size - size, prev=chunk, next=chunk.next)
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next, chunk.size = rest, size
        self._bin(rest)

    @staticmethod
    def _absorb_next(chunk: _Chunk) -> None:
        following = chunk.next
        chunk.size += following.size
        chunk.next = following.next
        if following.next is not None:
            following.next.prev = chunk

    def _extend(self, size: int) -> None:
        available = (self.memory_limit_bytes - self.pool_bytes) // MIN_ALLOCATION_BYTES * MIN_ALLOCATION_BYTES
        if size > available:
            raise LMSError(
                f"allocator model: a request of {size} bytes does not fit: {self.pool_bytes} of "
                f"{self.memory_limit_bytes} bytes are already pooled and {self.in_use_bytes} in use. "
                f"Model a larger memory_limit_bytes, or a plan with a lower peak.")
        grew = False
        while size > self._next_region_bytes:
            self._next_region_bytes *= 2
            grew = True
        region_bytes = min(self._next_region_bytes, available)
        if not grew:
            self._next_region_bytes *= 2
        self._regions += 1
        self.pool_bytes += region_bytes
        base = (-self._regions if self.new_regions_below else self._regions) * _REGION_GAP
        self._bin(_Chunk(ptr=base, size=region_bytes))


def tensorflow_cpu_allocator() -> BFCAllocatorModel:
    """TensorFlow's CPU allocator with ``TF_CPU_ALLOCATOR_USE_BFC=true``: 64 GiB, grows by regions,
    each new one ``mmap``-ed below the last.

    Examples:
        >>> cpu = tensorflow_cpu_allocator()
        >>> cpu.allow_growth, cpu.new_regions_below
        (True, True)
    """
    return BFCAllocatorModel(memory_limit_bytes=CPU_MEMORY_LIMIT_BYTES, allow_growth=True, new_regions_below=True)


def tensorflow_gpu_allocator(memory_bytes: int) -> BFCAllocatorModel:
    """TensorFlow's GPU allocator by default: one region of the device's memory, reserved up front.

    Examples:
        >>> tensorflow_gpu_allocator(16 * 2**30).allow_growth
        False
    """
    return BFCAllocatorModel(memory_limit_bytes=memory_bytes, allow_growth=False)


def replay_allocations(log: Sequence[Tuple[str, str, object]], model: BFCAllocatorModel, *,
                       resident: Sequence[Tuple[str, int]] = (), history: Sequence[Tuple[str, str, object]] = (),
                       warm_steps: int = 1) -> int:
    """Peak bytes in use above the step's start when ``log`` runs through ``model``.

    What the process allocated before (``history``, then the ``resident`` buffers) comes
    first, then the step's log runs ``warm_steps`` times before the measured run, as in a real
    training loop where the pool's regions and free chunks come from the steps before.

    Args:
        log: ``("alloc", key, bytes)``, ``("free", key, 0)`` and ``("rename", old, new)``
            events in the order the step ran them (:attr:`Simulation.allocations`).
        model: A fresh allocator model.
        resident: ``(key, bytes)`` buffers alive for the whole run.
        history: Events before the first step, in the same form as ``log``; what they leave
            allocated stays (e.g. :func:`lms_tf.simulate.simulator.pool_history`).
        warm_steps: Steps replayed before the measured one.

    Returns:
        The measured step's peak ``bytes_in_use`` minus ``bytes_in_use`` at its start, the
        figure ``lms_tf.measure_peak_memory`` reads on the real allocator.

    Examples:
        >>> log = [("alloc", "a", 3 << 20), ("alloc", "b", 1 << 20), ("free", "a", 0), ("free", "b", 0)]
        >>> replay_allocations(log, BFCAllocatorModel(memory_limit_bytes=1 << 30, allow_growth=True)) // 2**20
        5
    """
    _apply(history, model)
    for key, nbytes in resident:
        model.allocate(key, nbytes)
    for _ in range(warm_steps):
        _run(log, model)
    start = model.in_use_bytes
    model.reset_peak()
    _run(log, model)
    return model.peak_bytes - start


def chunk_peak_moment(log: Sequence[Tuple[str, str, object]], model: BFCAllocatorModel, *,
                      history: Sequence[Tuple[str, str, object]] = (), warm_steps: int = 1
                      ) -> Tuple[int, Optional[str], Tuple[Tuple[str, int], ...]]:
    """Where :func:`replay_allocations`'s peak is reached: the peak (the same figure), the key of
    the allocation that reached it (None if nothing was allocated) and the step's buffers in use
    then (not what was allocated before it), ``(key, bytes asked for)``, those in the largest
    chunks first. The whole chunks can peak at
    another moment than the tensors (a buffer served from a larger free chunk holds all of it),
    and what lowers the one need not lower the other.

    Examples:
        >>> log = [("alloc", "a", 3 << 20), ("alloc", "b", 1 << 20), ("free", "a", 0), ("free", "b", 0)]
        >>> held, key, live = chunk_peak_moment(log, BFCAllocatorModel(memory_limit_bytes=1 << 30, allow_growth=True))
        >>> held // 2**20, key, [(k, n // 2**20) for k, n in live]
        (5, 'b', [('a', 3), ('b', 1)])
    """
    _apply(history, model)
    for _ in range(warm_steps):
        _run(log, model)
    start, before = model.in_use_bytes, set(model.keys())
    best, key, live = 0, None, ()
    for event in log:
        _apply((event,), model)
        if event[0] == "alloc" and model.in_use_bytes - start > best:
            best, key = model.in_use_bytes - start, event[1]
            live = tuple((k, nbytes) for k, (_, nbytes) in
                         sorted(model._allocated.items(), key=lambda item: (-item[1][0].size, item[0]))
                         if k not in before)
    return best, key, live


def _apply(log: Sequence[Tuple[str, str, object]], model: BFCAllocatorModel) -> None:
    for event, key, value in log:
        if event == "alloc":
            model.allocate(key, value)
        elif event == "free":
            model.free(key)
        else:
            model.rename(key, value)


def _run(log: Sequence[Tuple[str, str, object]], model: BFCAllocatorModel) -> None:
    before = set(model.keys())
    _apply(log, model)
    for key in set(model.keys()) - before:  # what the step left allocated (its outputs) goes with it
        model.free(key)
