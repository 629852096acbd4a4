"""Lowering a step and a plan to events: compute ops, copies out and back, recompute clones, with the
buffers each reads and writes under TensorFlow's memory rules (aliasing, in-place kernels, kernel
workspaces, copy-on-write of variables).

Examples:
    >>> KERNEL_LIBRARIES
    ('cudnn', 'eigen', 'onednn')
"""

from __future__ import annotations

import collections
import dataclasses
from typing import AbstractSet, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import GraphIR, OpInfo, Phase
from lms_tf.core.op_kinds import (
    ALIAS_TYPES,
    BATCH_SLICED_INPUTS,
    COMMUTATIVE_TYPES,
    FORWARDING_TYPES,
    MAXPOOL_GRAD_TYPES,
    MAXPOOL_TYPES,
    RESIDENT_TYPES,
    SWAP_IN_PREFIX,
    TO_HOST_PREFIX,
    VARIABLE_UPDATE_PREFIXES,
    WORKSPACE_TYPES,
    recompute_clone_name,
)
from lms_tf.core.plan import Decision, Plan, SlicedOp, TensorDecision, WeightDecision
from lms_tf.cost.model import CostModel
from lms_tf.simulate.pool import optimizer_slots, update_products_on_device, variables_on_host

#: Kernel libraries whose scratch memory :func:`simulate` models (``kernels=``). ``"cudnn"`` (a GPU)
#: and ``"eigen"`` (TensorFlow's CPU kernels with ``TF_ENABLE_ONEDNN_OPTS=0``) take convolution
#: scratch from TensorFlow's allocator (Eigen's filter gradient a fixed ~30 MiB:
#: :func:`_eigen_workspace`); ``"onednn"`` (TensorFlow's default CPU kernels on x86)
#: takes none, and gives a max pool a workspace output its gradient reads (one byte per
#: element: TensorFlow's allocation trace shows ``[12845056]`` beside a ``[16,112,112,64]``
#: float32 pool output).
KERNEL_LIBRARIES = ("cudnn", "eigen", "onednn")


#: Suffix of the buffer key of a max pool's oneDNN workspace (``<pool output key>#workspace``).
POOL_WORKSPACE = "#workspace"


COMPUTE_STREAM, TO_HOST_STREAM, TO_DEVICE_STREAM, HOST_COMPUTE_STREAM = 0, 1, 2, 3


@dataclasses.dataclass(slots=True)
class Event:
    """One thing the simulator runs: a compute op, a copy or a clone, with the buffers it reads and writes.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> event = lowered.ops[1]
        >>> event.name, event.reads, event.writes
        ('a', ['x:0'], [('a:0', 4194304)])
    """
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
    # An op of the update on the host: the host buffers it reads (a gradient copied out, another
    # host op's output) and writes, which host memory holds until their last reader ends.
    host_reads: List[str] = dataclasses.field(default_factory=list)
    host_writes: List[Tuple[str, int]] = dataclasses.field(default_factory=list)


class Lowered:
    """Turns the IR plus a plan into simulator ops with buffer keys.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> [event.name for event in lowered.ops]
        ['x', 'a', 'b', 'c', 'loss', 'g3', 'g2', 'g1']
    """

    def __init__(self, ir: GraphIR, cost: CostModel):
        self.ir = ir
        self.cost = cost
        self.ops: List[Event] = []
        self.index_of: Dict[str, int] = {}
        self.replace: Dict[Tuple[str, str], str] = {}
        self.buffer_producer: Dict[str, int] = {}
        self.accumulated_sums: frozenset = frozenset()
        self.read_handles: Dict[str, str] = {}  # read buffer -> variable handle tensor
        self.on_host: frozenset = frozenset()  # handles of the variables on the host (weights="host")
        self.slice_waits: Dict[str, List[str]] = {}  # a sliced op's slice -> the ops (and copies) it waits for
        # Whether a buffer counts, per buffer key: the same for every plan of one IR, so kept on it.
        self._counted_cache: Dict[str, bool] = ir.memo("_counted", dict)  # filled as buffers are asked about

    def source(self, consumer: str, tensor: str) -> str:
        """The buffer ``consumer`` really reads for input ``tensor`` (aliases and re-pointing resolved).

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
            >>> lowered.source("g1", "a:0")   # no alias and no plan: g1 reads a's own buffer
            'a:0'
        """
        replace = self.replace
        for reader, read in _alias_chain(self.ir, consumer, tensor):
            key = replace.get((reader, read))
            if key is not None:
                return key
        return read

    def counted(self, tensor: str) -> bool:
        """Whether ``tensor``'s buffer counts as step memory (variables, constants and inputs are resident).

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
            >>> lowered.counted("a:0"), lowered.counted("x:0")   # x is the step's input
            (True, False)
        """
        known = self._counted_cache.get(tensor)
        if known is None:
            known = self._counted_cache[tensor] = self._counted(tensor)
        return known

    def _counted(self, tensor: str) -> bool:
        info = self.ir.tensors.get(tensor)
        if info is None:
            return True  # a buffer the plan introduced
        producer = self.ir.op(info.producer)
        return not (producer.type in RESIDENT_TYPES or producer.name in self.ir.function_inputs
                    or info.dtype in ("resource", "variant", "string") or not info.nbytes
                    or producer.name in self.ir.host_placed)

    def add(self, op: Event) -> int:
        """Appends ``op`` and records it as the producer of the buffers it writes; returns its index.

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
            >>> lowered.add(Event("extra", COMPUTE_STREAM, 0.0, [], [("extra:0", 4)], [])), lowered.buffer_producer["extra:0"]
            (8, 8)
        """
        self.ops.append(op)
        index = len(self.ops) - 1
        for key, _ in op.writes:
            self.buffer_producer[key] = index
        return index

    def indices_of(self, name: str) -> List[int]:
        """The simulator ops an IR op's name stands for: itself, or for an alias op (which the
        simulator does not run) the ops it waits for.

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
            >>> lowered.indices_of("g1")
            [7]
        """
        if name in self.index_of:
            return [self.index_of[name]]
        return [self.index_of[n] for n in self.producer_deps(self.ir.op(name))]

    def producer_deps(self, op: OpInfo) -> List[str]:
        """Names of the non-alias ops an IR op waits for: producers of the buffers it reads (through
        aliases, output by output) and its control inputs (an alias op as a control input waits for
        all of its inputs).

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> from lms_tf.cost import CostModel, get_device_spec
            >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
            >>> lowered.producer_deps(lowered.ir.op("g1"))
            ['g2', 'a']
        """
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
            if dep.is_alias:
                stack.extend(ir.tensors[t].producer for t in dep.inputs)
                stack.extend(dep.control_inputs)
            else:
                names.append(name)
        return names


def _alias_chain(ir: GraphIR, consumer: str, tensor: str) -> Iterator[Tuple[str, str]]:
    """The reads from ``consumer``'s input ``tensor`` up to the buffer behind it: that read, then
    each alias op's read of the input it passes on (an ``IdentityN`` output's own input, else the
    first). The last read's tensor is the buffer."""
    while True:
        yield consumer, tensor
        producer = ir.op(ir.tensors[tensor].producer)
        if not producer.is_alias or not producer.inputs:
            return
        if producer.passes_through is not None:  # x * 1: its readers read x
            position = producer.passes_through
        else:
            position = producer.outputs.index(tensor) if producer.type == "IdentityN" else 0
        consumer, tensor = producer.name, producer.inputs[min(position, len(producer.inputs) - 1)]


def _readers_through_alias(ir: GraphIR) -> Dict[str, frozenset]:
    """Alias op name -> the non-alias ops whose reads resolve through it (:meth:`Lowered.source`
    follows one input of each alias op up the chain). Re-pointing an alias op's read re-points
    theirs. Cached on the IR."""
    def build() -> Dict[str, frozenset]:
        readers: Dict[str, set] = collections.defaultdict(set)
        for op in ir.ops:
            if op.is_alias:
                continue
            for t in op.inputs:
                for reader, _ in _alias_chain(ir, op.name, t):
                    if reader != op.name:
                        readers[reader].add(op.name)
        return {name: frozenset(names) for name, names in readers.items()}

    return ir.memo("_readers_through_alias", build)


@dataclasses.dataclass(frozen=True, slots=True)
class _PlainOp:
    """What lowering needs of one non-alias op of the plain step, computed once per IR: the
    buffers it reads (as resolved through aliases, and in the order TensorFlow runs them), writes
    and waits for. An op a plan does not re-point or make wait reuses all of it; ``waits_for``
    names the plain ops it waits for in graph order (so their indices in any lowering come out
    sorted)."""
    sources: Tuple[str, ...]
    reads: Tuple[str, ...]
    writes: List[Tuple[str, int]]
    producer_deps: Tuple[str, ...]
    waits_for: Tuple[str, ...]
    forwarding: bool
    updates: Optional[str]
    workspace: int  # scratch bytes with kernels that take it from TensorFlow's allocator


def _plain_template(ir: GraphIR) -> Dict[str, _PlainOp]:
    """Non-alias op name -> its :class:`_PlainOp`. Cached on the IR: planners replay one step
    many times and a plan changes few ops."""
    def build() -> Dict[str, _PlainOp]:
        b = Lowered(ir, None)
        writer = {t: op.name for op in ir.ops if not op.is_alias for t in op.outputs}
        cached = {}
        for op in ir.ops:
            if op.is_alias:
                continue
            sources = tuple(b.source(op.name, t) for t in op.inputs)
            producer_deps = tuple(b.producer_deps(op))
            # What the plain lowering's dependency pass finds: the writers of the buffers read and
            # the ops waited for (a max-pool gradient's workspace read adds nothing: its writer is
            # the pool, whose output the gradient already reads).
            names = {writer[k] for k in sources if k in writer} | set(producer_deps)
            names.discard(op.name)
            cached[op.name] = _PlainOp(
                sources, tuple(_canonical_reads(op, sources)), [(t, ir.tensors[t].nbytes or 0) for t in op.outputs],
                producer_deps, tuple(sorted(names, key=lambda n: ir.op(n).index)), op.type in FORWARDING_TYPES,
                op.inputs[0] if op.type.startswith(VARIABLE_UPDATE_PREFIXES) and op.inputs else None,
                _workspace(ir, op, "cudnn"))
        return cached

    return ir.memo("_plain_template", build)


@dataclasses.dataclass(frozen=True)
class _HostUpdate:
    """The optimizer update on the host (weights or slots there), as the plain step's reads make
    it, computed once per IR (:func:`_host_update_template`): an op of it whose reads a plan
    re-points is worked out again with that plan's reads."""
    ops: frozenset  # the update's ops that run on the host
    on_device: frozenset  # the update's ops the device keeps (:func:`update_products_on_device`)
    order: Tuple[str, ...]  # ``ops`` in graph order
    # op -> ``(buffer, its producer, bytes, gradients crossing as it)`` per device buffer it
    # reads, each copied to the host after its producer (:func:`_update_reads`)
    reads: Mapping[str, Tuple[Tuple[str, str, int, Tuple[str, ...]], ...]]
    buffers: Mapping[str, Tuple[List[str], List[Tuple[str, int]]]]  # op -> :func:`_host_buffers`


def _host_update_template(ir: GraphIR) -> _HostUpdate:
    """The :class:`_HostUpdate` of ``ir`` (cached on it)."""
    def build() -> _HostUpdate:
        # The update runs on the host but for the products of the gradients alone, which the
        # rewrite keeps on the device: they read the gradients there, and what they make crosses.
        on_device = update_products_on_device(ir)
        order = tuple(op.name for op in ir.ops
                      if op.phase is Phase.UPDATE and not op.is_alias and op.name not in on_device)
        ops, plain = frozenset(order), Lowered(ir, None)
        return _HostUpdate(ops, on_device, order,
                           reads={name: _update_reads(plain, ir.op(name), ops, on_device) for name in order},
                           buffers={name: _host_buffers(plain, ir.op(name), ops) for name in order})

    return ir.memo("_host_update_template", build)


def _update_reads(b: "Lowered", op: OpInfo, host_update: AbstractSet[str],
                  on_device: AbstractSet[str]) -> Tuple[Tuple[str, str, int, Tuple[str, ...]], ...]:
    """The device buffers ``op`` (of the update on the host, ``host_update``) reads, as ``b``'s
    reads resolve: ``(buffer, its producer, bytes, the weight gradients crossing as it)`` each
    (``on_device``: the update's products the device keeps); not the update's own outputs, nor
    what is not step memory (variables, constants, inputs)."""
    ir, found = b.ir, []
    for t in op.inputs:
        source = b.source(op.name, t)
        producer = ir.tensors[source].producer if source in ir.tensors else None
        if producer is None or producer in host_update or not b.counted(source):
            continue
        found.append((source, producer, ir.tensors[source].nbytes or 0,
                      tuple(gradients_crossing_as(ir, source, on_device))))
    return tuple(found)


def _host_buffers(b: "Lowered", op: OpInfo, host_update: AbstractSet[str]) -> Tuple[List[str], List[Tuple[str, int]]]:
    """The host memory an op of the update on the host reads and writes: the outputs of the update's
    other host ops it reads, and its own outputs, leaving out what host memory holds anyway
    (variables, their reads, constants) and what takes no buffer (resources, empty tensors).

    A gradient copied out is not among the reads: the host keeps it until the step ends. Whether the
    update's ops keep up with the gradients' arrival depends on how fast the host is beside the
    device, which the step's timing does not settle; measured with the host in a process of its
    own, every gradient was there at its peak (``tests/test_weights_cluster.py``)."""
    ir = b.ir

    def transient(tensor: str) -> bool:
        info = ir.tensors.get(tensor)
        return info is not None and bool(info.nbytes) and info.dtype not in ("resource", "variant", "string") \
            and ir.op(info.producer).type not in RESIDENT_TYPES and info.producer not in ir.function_inputs

    reads = []
    for t in op.inputs:
        source = b.source(op.name, t)
        info = ir.tensors.get(source)
        if info is None or not transient(source):
            continue
        if info.producer in host_update:
            reads.append(source)
    return (list(dict.fromkeys(reads)),
            [(t, ir.tensors[t].nbytes) for t in op.outputs if not op.is_alias and transient(t)])


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


def check_kernel_library(kernels) -> str:
    """``kernels`` if it is one of :data:`KERNEL_LIBRARIES`, else the library's error.

    Examples:
        >>> check_kernel_library("mkl")
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: kernels= must be one of 'cudnn', 'eigen', 'onednn' (the kernel library whose scratch memory to count); got 'mkl'.
    """
    if kernels not in KERNEL_LIBRARIES:
        raise LMSOptionError(f"kernels= must be one of {', '.join(map(repr, KERNEL_LIBRARIES))} (the kernel library "
                             f"whose scratch memory to count); got {kernels!r}.")
    return kernels


def kernel_scratch_bytes(ir: GraphIR, op: OpInfo, kernels: str = "cudnn",
                         cudnn_workspace_limit: Optional[int] = None) -> int:
    """Scratch bytes ``op``'s kernel takes from TensorFlow's allocator while it runs, with the
    kernel library ``kernels`` (one of :data:`KERNEL_LIBRARIES`): what :func:`simulate` holds
    beside the op's inputs and outputs, for per-layer models to count the same. With cuDNN,
    ``cudnn_workspace_limit`` caps the workspace (:attr:`~lms_tf.cost.DeviceSpec.cudnn_workspace_limit_bytes`).

    Raises:
        LMSOptionError: An unknown kernel library.

    Examples:
        >>> from lms_tf.core import make_ir
        >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (16, 32, 32, 64))]),
        ...               dict(name="dy", type="Placeholder", outputs=[("dy:0", (16, 32, 32, 64))]),
        ...               dict(name="s", type="Const", outputs=[("s:0", (4,))]),
        ...               dict(name="g", type="Conv2DBackpropFilter", inputs=["x:0", "s:0", "dy:0"],
        ...                    outputs=[("g:0", (3, 3, 64, 64))])])
        >>> [kernel_scratch_bytes(ir, ir.op("g"), k) for k in KERNEL_LIBRARIES]
        [4194304, 28311552, 0]
        >>> kernel_scratch_bytes(ir, ir.op("g"), "cudnn", cudnn_workspace_limit=2**20)
        1048576
    """
    check_kernel_library(kernels)
    scratch = _eigen_workspace(ir, op) if kernels == "eigen" else _workspace(ir, op, kernels)
    if kernels == "cudnn" and cudnn_workspace_limit is not None:
        scratch = min(scratch, cudnn_workspace_limit)
    return scratch + _compiled_scratch(ir, op.name, kernels)


#: The device type each kernel library runs on.
_LIBRARY_DEVICE = {"cudnn": "GPU", "eigen": "CPU", "onednn": "CPU"}


def _compiled_scratch(ir: GraphIR, name: str, kernels: str) -> int:
    """XLA's temporaries for the compiled call ``name`` (:attr:`GraphIR.compiled_scratch`), when they
    were planned for the device type ``kernels`` runs on; 0 otherwise (the TensorFlow side warns
    when it could not ask XLA)."""
    if not ir.compiled_scratch or _LIBRARY_DEVICE[kernels] != ir.compiled_for:
        return 0
    return ir.compiled_scratch.get(name, 0)


#: The working set TensorFlow's CPU ``Conv2DBackpropFilter`` kernel (without oneDNN) sizes its
#: im2col buffer for: its fixed L3 cache estimate, 30 MiB.
EIGEN_FILTER_GRAD_WORKING_SET_BYTES = 30 << 20


def _eigen_workspace(ir: GraphIR, op: OpInfo) -> int:
    """Scratch bytes of TensorFlow's Eigen CPU kernels (``TF_ENABLE_ONEDNN_OPTS=0``).

    A 2-D filter gradient (``Conv2DCustomBackpropFilterOp``) unfolds ``shard`` images into one
    im2col buffer, ``shard = ceil(30 MiB / (element size x (P x F + P x O + F x O)))`` for an output
    of ``P`` pixels, ``F = kh x kw x in_channels`` and ``O`` out channels, whatever the batch: about
    30 MiB for every filter gradient, which dominates the memory of small convolutional stages
    (TensorFlow's allocation trace shows ``[12, 1024, 576]`` for a 3x3, 64-channel convolution on
    32x32 images, batch 16). Other convolution kernels: about their largest operand. Example:
    :func:`kernel_scratch_bytes` with ``"eigen"``.
    """
    if op.type != "Conv2DBackpropFilter" or len(op.inputs) < 3:
        return _workspace(ir, op, "eigen")
    grad, out_backprop = ir.tensors[op.outputs[0]], ir.tensors[op.inputs[2]]
    if not grad.nbytes or not grad.shape or len(grad.shape) != 4 or not out_backprop.shape \
            or len(out_backprop.shape) != 4 or any(d is None for d in (*grad.shape, *out_backprop.shape)):
        return _workspace(ir, op, "eigen")
    kh, kw, channels_in, channels_out = grad.shape
    itemsize = grad.nbytes // (kh * kw * channels_in * channels_out)
    pixels, patch = out_backprop.shape[1] * out_backprop.shape[2], kh * kw * channels_in
    work = pixels * patch + pixels * channels_out + patch * channels_out
    shard = -(-(EIGEN_FILTER_GRAD_WORKING_SET_BYTES // itemsize) // work)
    return shard * pixels * patch * itemsize


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


def _pooled_for_gradient(b: "Lowered") -> frozenset:
    """Names of the max pools whose output a max-pool gradient reads (oneDNN gives those a
    workspace); aliases between them resolved by the builder, before any plan re-points reads."""
    ir, pools = b.ir, set()
    for op in ir.ops:
        if op.type in MAXPOOL_GRAD_TYPES and len(op.inputs) > 1:
            producer = ir.op(ir.tensors[b.source(op.name, op.inputs[1])].producer)
            if producer.type in MAXPOOL_TYPES:
                pools.add(producer.name)
    return frozenset(pools)


def _copy_in(key: str, host_buffer: str, nbytes: int, cost: CostModel, trigger: Optional[str]) -> Event:
    """A host-to-device copy of ``host_buffer`` into device buffer ``key``, started after ``trigger``
    (a swap-in, a weight fetch, or the copy a recompute clone reads)."""
    return Event(key, TO_DEVICE_STREAM, cost.transfer_time(nbytes, "host_to_device"), [host_buffer], [(key, nbytes)],
                 [], trigger=trigger)


def _once(events: List[Event], event: Event) -> None:
    """Appends ``event`` unless one of that name is there (several clones behind one gate share a copy)."""
    if not any(e.name == event.name for e in events):
        events.append(event)


def gradients_crossing_as(ir: GraphIR, tensor: str, on_device: AbstractSet[str]) -> List[str]:
    """The weight gradients whose values cross to the host as ``tensor``: itself, when a backward
    op makes it, or those a product of the update kept on the device (``on_device``:
    :func:`~lms_tf.simulate.pool.update_products_on_device`) is computed from; each named by its
    buffer (through views: a bias gradient's reshape, the optimizer's ``IdentityN``).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> gradients_crossing_as(weighted_chain_ir(), "gw2:0", frozenset())
        ['gw2:0']
    """
    found: List[str] = []
    frontier, seen = [tensor], set()
    while frontier:
        name = frontier.pop()
        if name in seen or name not in ir.tensors:
            continue
        seen.add(name)
        producer = ir.op(ir.tensors[name].producer)
        if producer.type in ALIAS_TYPES and producer.inputs:  # a view: the buffer is its input's
            index = producer.outputs.index(name) if producer.type == "IdentityN" else 0
            frontier.append(producer.inputs[min(index, len(producer.inputs) - 1)])
        elif producer.phase is Phase.BACKWARD:
            found.append(name)
        elif producer.name in on_device:
            frontier.extend(producer.inputs)
    return sorted(found)


def _batch_of(ir: GraphIR, sliced: SlicedOp) -> int:
    """The batch a sliced op's output holds (its first dimension)."""
    op = ir.op(sliced.op)
    shape = ir.tensors[op.outputs[0]].shape if op.outputs else None
    if not shape or not shape[0]:
        raise LMSOptionError(f"plan error: sliced op {sliced.op!r} has no known batch (its output's shape is "
                             f"{shape}); only an op whose output's first dimension is known can be sliced.")
    return int(shape[0])


def check_sliced_op(ir: GraphIR, sliced: SlicedOp, decisions: Mapping[str, TensorDecision]) -> None:
    """Raises the library's error unless ``sliced`` can be applied to ``ir`` with the plan's
    ``decisions`` (tensor -> decision): a known op of a type that may be sliced, a trigger that runs
    before it, and inputs copied in a slice at a time that it slices, the plan swaps, and it reads
    from none of their swap-ins.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> check_sliced_op(chain_ir(), SlicedOp("g2", 2, (), "g3"), {})
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: plan error: sliced op 'g2' is a Mul; only MaxPool3DGrad, MaxPoolGrad, MaxPoolGradV2 compute each example apart so that slices give the whole op's values. Remove the entry from the plan's 'sliced'.
    """
    if not ir.has_op(sliced.op):
        raise LMSOptionError(f"plan error: sliced op {sliced.op!r} is not in the step; remove it from the plan's "
                             f"'sliced' (was the plan made for another model?).")
    op = ir.op(sliced.op)
    if op.type not in BATCH_SLICED_INPUTS:
        raise LMSOptionError(f"plan error: sliced op {sliced.op!r} is a {op.type}; only "
                             f"{', '.join(sorted(BATCH_SLICED_INPUTS))} compute each example apart so that slices "
                             f"give the whole op's values. Remove the entry from the plan's 'sliced'.")
    if not ir.has_op(sliced.trigger) or ir.op(sliced.trigger).index >= op.index:
        raise LMSOptionError(f"plan error: sliced op {sliced.op!r} has trigger {sliced.trigger!r}, which is not an "
                             f"op of the step that runs before it; name an op before it.")
    sliced.bounds(_batch_of(ir, sliced))
    batch_inputs = {op.inputs[i] for i in BATCH_SLICED_INPUTS[op.type] if i < len(op.inputs)}
    for t in sliced.from_host:
        d = decisions.get(t)
        why = ("it is not an input the op slices" if t not in batch_inputs
               else "the plan does not swap it" if d is None or d.decision is not Decision.SWAP
               else "the op also reads one of its swap-ins" if any(sliced.op in s.consumers for s in d.swap_ins)
               else None)
        if why:
            raise LMSOptionError(f"plan error: sliced op {sliced.op!r} copies {t!r} from the host a slice at a time, "
                                 f"but {why}. Copy in slices only a swapped input the op reads from no swap-in.")


def check_clone_fetches(ir: GraphIR, plan: Plan) -> None:
    """Raises the library's error unless each ``clone_fetches_after`` entry of ``plan``'s weights on
    the host is sound (:func:`clone_fetch_problem`).

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.core.plan import WeightDecision
        >>> w = WeightDecision("w2:0", ("rw2:0",), None, 4, Decision.SWAP, "", (), (("g1", "m2"),))
        >>> check_clone_fetches(weighted_chain_ir(), Plan((), "d", "h", {}, {}, weights=(w,)))
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: plan error: the clones behind 'g1' fetch 'w2:0' after the clone of 'm2', but no clone behind 'g1' reads 'w2:0' (the plan recomputes nothing behind that gate). Remove the entry from the weight's clone_fetches_after.
    """
    for weight in plan.offloaded_weights:
        for gate, after in weight.clone_fetches_after:
            why = clone_fetch_problem(ir, plan, weight, gate, after)
            if why:
                raise LMSOptionError(
                    f"plan error: the clones behind {gate!r} fetch {weight.variable!r} after the clone of {after!r}, "
                    f"but {why}. Remove the entry from the weight's clone_fetches_after.")


def without_unsound_clone_fetches(ir: GraphIR, plan: Plan) -> Plan:
    """``plan`` with each ``clone_fetches_after`` entry :func:`clone_fetch_problem` refuses dropped:
    what a plan whose recompute decisions changed (another recompute base, a pipeline stage's share
    of the plan) keeps of the entries made for the old ones.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.core.plan import WeightDecision
        >>> w = WeightDecision("w2:0", ("rw2:0",), None, 4, Decision.SWAP, "", (), (("g1", "m2"),))
        >>> plan = without_unsound_clone_fetches(weighted_chain_ir(), Plan((), "d", "h", {}, {}, weights=(w,)))
        >>> plan.weights[0].clone_fetches_after
        ()
    """
    if not any(w.clone_fetches_after for w in plan.weights):
        return plan
    weights = tuple(dataclasses.replace(w, clone_fetches_after=tuple(
        (gate, after) for gate, after in w.clone_fetches_after if clone_fetch_problem(ir, plan, w, gate, after) is None))
        for w in plan.weights)
    return dataclasses.replace(plan, weights=weights)


def clone_readers(ir: GraphIR, clones: Tuple[str, ...], weight: WeightDecision) -> List[int]:
    """The positions in ``clones`` (:meth:`Plan.clones_behind`) of the ops that read ``weight``.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.core.plan import WeightDecision
        >>> w = WeightDecision("w2:0", ("rw2:0",), None, 4, Decision.SWAP, "", ())
        >>> clone_readers(weighted_chain_ir(), ("r1", "m2"), w)
        [1]
    """
    reads = set(weight.reads)
    return [i for i, name in enumerate(clones) if ir.has_op(name) and reads & set(ir.op(name).inputs)]


def clone_fetch_problem(ir: GraphIR, plan: Plan, weight: WeightDecision, gate: str, after: str) -> Optional[str]:
    """Why the clones behind recompute gate ``gate`` cannot fetch ``weight`` after the clone of
    ``after``, or None: some clone behind that gate reads the weight, and ``after`` is cloned there
    before the first that does (so the copy waits for a clone that cannot wait for the copy), with
    a numeric output a gate can read.

    Examples:
        >>> from lms_tf.core.examples import weighted_chain_ir
        >>> from lms_tf.core.plan import WeightDecision
        >>> w = WeightDecision("w2:0", ("rw2:0",), None, 4, Decision.SWAP, "", ())
        >>> clone_fetch_problem(weighted_chain_ir(), Plan((), "d", "h", {}, {}, weights=(w,)), w, "g1", "m2")
        "no clone behind 'g1' reads 'w2:0' (the plan recomputes nothing behind that gate)"
    """
    order = plan.clones_behind(gate)
    readers = clone_readers(ir, order, weight)
    if not readers:
        return (f"no clone behind {gate!r} reads {weight.variable!r} (the plan recomputes "
                + ("nothing behind that gate)" if not order else "no reader of it there)"))
    if after not in order:
        return f"{after!r} is not cloned behind {gate!r}"
    if order.index(after) >= readers[0]:
        return f"{after!r} is cloned after the first clone that reads it"
    if not ir.has_op(after) or not any(ir.tensors[t].dtype not in ("resource", "variant", "string")
                                       for t in ir.op(after).outputs):
        return f"{after!r} has no numeric output a gate can read"
    return None


def _slice_copy(ir: GraphIR, sliced: SlicedOp, tensor: str, index: int, size: int, cost: CostModel,
                trigger: str) -> Event:
    nbytes = (ir.tensors[tensor].nbytes or 0) * size // _batch_of(ir, sliced)
    return _copy_in(sliced.copy_name(tensor, index), f"host/{tensor}", nbytes, cost, trigger)


def _add_slices(b: "Lowered", op: OpInfo, sliced: SlicedOp, reads: List[str], op_time: float,
                extra_deps: Mapping[str, List[str]], pool_workspace: bool) -> List[str]:
    """Adds the slices of sliced op ``op`` (``reads``: what the whole op would read) and the copies
    of later slices' inputs (each after the slice two before ends); returns what the op itself,
    the ``ConcatV2`` of their outputs, reads. A slice reads its part of each input copied from the
    host and the whole of the others (a slice of a device tensor is a view of it); it waits for
    what the whole op would (control inputs, orderings, swap-ins)."""
    ir, cost = b.ir, b.cost
    batch = _batch_of(ir, sliced)
    bounds = sliced.bounds(batch)
    launch = cost.device.launch_overhead_s
    waits = list(b.producer_deps(op)) + list(extra_deps.get(op.name, ()))
    outputs = []
    for i, (start, size) in enumerate(bounds):
        name = sliced.slice_name(i)
        slice_reads = [sliced.copy_name(t, i) if t in sliced.from_host else key for t, key in zip(op.inputs, reads)]
        if pool_workspace:  # oneDNN: every slice reads the workspace the forward pool wrote
            slice_reads.append(b.source(op.name, op.inputs[1]) + POOL_WORKSPACE)
        writes = [(f"{name}:{j}", (ir.tensors[t].nbytes or 0) * size // batch) for j, t in enumerate(op.outputs)]
        event = Event(name, COMPUTE_STREAM, max(op_time - launch, 0.0) * size / batch + launch, slice_reads, writes,
                      [], order=op.index - 0.5 + i / (2 * len(bounds)))
        b.index_of[name] = b.add(event)
        b.slice_waits[name] = waits
        outputs.extend(key for key, _ in writes)
        if i + 2 < len(bounds):
            for t in sliced.from_host:
                copy = _slice_copy(ir, sliced, t, i + 2, bounds[i + 2][1], cost, name)
                copy.order = event.order + 1 / (4 * len(bounds))
                b.index_of[copy.name] = b.add(copy)
    return outputs


def lower(ir: GraphIR, plan: Optional[Plan], cost: CostModel, op_times: Optional[Mapping[str, float]] = None,
           kernels: str = "cudnn", accumulated_sums: frozenset = frozenset(), *, reuse_plain: bool = True) -> Lowered:
    """Lowers ``ir`` with ``plan`` (None: the plain step) to the events :func:`~lms_tf.simulate.replay.replay` runs.

    A plan changes few ops: the others take their reads, writes and waits from a template of the
    plain step built once per IR. ``reuse_plain=False`` builds every op from the IR instead (the
    same events, slower: what the tests compare the template with).

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> lowered = lower(chain_ir(), None, CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> len(lowered.ops), lowered.ops[-1].deps   # g1 waits for a and g2
        (8, [1, 6])
    """
    check_kernel_library(kernels)
    b = Lowered(ir, cost)
    b.accumulated_sums = accumulated_sums
    pooled = _pooled_for_gradient(b) if kernels == "onednn" else frozenset()
    op_time = (lambda op: op_times[op.name]) if op_times is not None else (lambda op: cost.op_time(ir, op))  # noqa
    ir_names = {op.name for op in ir.ops if not op.is_alias}
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

    extra_after: Dict[str, List[Event]] = collections.defaultdict(list)  # ops gated by an IR op
    extra_deps: Dict[str, List[str]] = collections.defaultdict(list)  # IR op -> names of extra ops it waits for
    sliced = {s.op: s for s in plan.sliced} if plan is not None else {}
    for s in sliced.values():
        check_sliced_op(ir, s, decisions)
        for t in s.from_host:  # the first two slices' copies start after the trigger
            for i, (start, size) in enumerate(s.bounds(_batch_of(ir, s))[:2]):
                extra_after[s.trigger].append(_slice_copy(ir, s, t, i, size, cost, s.trigger))
    for t in sorted(swapped, key=lambda t: ir.op(ir.tensors[t].producer).index):
        d, nbytes = decisions[t], decisions[t].nbytes or 0
        extra_after[ir.tensors[t].producer].append(Event(
            f"swap_out/{t}", TO_HOST_STREAM, cost.transfer_time(nbytes, "device_to_host"), [b.source("", t)],
            [(f"host/{t}", 0)], []))
        if d.swap_out_before is not None:
            extra_deps[d.swap_out_before].append(f"swap_out/{t}")
        for i, s in enumerate(d.swap_ins):
            key = f"{SWAP_IN_PREFIX}{t}/{i}"
            extra_after[s.trigger].append(_copy_in(key, f"host/{t}", nbytes, cost, s.trigger))
            for consumer in s.consumers:
                extra_deps[consumer].append(key)
    # Reads of variables on the host: a recompute clone fetches its own copy behind its gate (or
    # after an earlier clone behind it: clone_fetches_after).
    if plan is not None:
        check_clone_fetches(ir, plan)
    weight_of = {read: w for w in plan.offloaded_weights for read in w.reads} if plan is not None else {}
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
                    _once(extra_after[d.gate], _copy_in(key, f"host/{t}", decisions[t].nbytes or 0, cost, d.gate))
                    reads.append(key)
                elif t in weight_of:
                    weight = weight_of[t]
                    key = weight.clone_fetch_name(d.gate)
                    after = weight.clone_fetch_after(d.gate)  # fetched in turn: after an earlier clone
                    trigger = d.gate if after is None else recompute_clone_name(d.gate, after)
                    _once(extra_after[d.gate], _copy_in(key, f"host/{weight.variable}", weight.nbytes or 0, cost,
                                                        trigger))
                    reads.append(key)
                else:
                    reads.append(b.source(name, t))
            writes = [(recompute_clone_name(d.gate, t), ir.tensors[t].nbytes or 0) for t in op.outputs]
            extra_after[d.gate].append(Event(recompute_clone_name(d.gate, name), COMPUTE_STREAM, op_time(op),
                                           _canonical_reads(op, reads),
                                           writes, [], forwarding=op.type in FORWARDING_TYPES, trigger=d.gate))
        for consumer in d.consumers:
            extra_deps[consumer].append(recompute_clone_name(d.gate, ir.tensors[d.tensor].producer))

    for ordering in plan.orderings if plan is not None else ():
        for waiter in ordering.waiters:
            extra_deps[waiter].extend(ordering.after)
    at_start: List[Event] = []  # weight fetches nothing on the device runs before
    b.on_host = variables_on_host(ir, [w.variable for w in plan.offloaded_weights] if plan is not None else ())
    if plan is not None and plan.policies.get("weights") == "auto":  # the slots live on the host whatever moves
        b.on_host |= optimizer_slots(ir)
    gradient_waits: List[Tuple[str, Tuple[str, ...]]] = []
    for weight in plan.offloaded_weights if plan is not None else ():
        reads, nbytes = set(weight.reads), weight.nbytes or 0
        for i, fetch in enumerate(weight.fetches):
            key = weight.fetch_name(i)
            event = _copy_in(key, f"host/{weight.variable}", nbytes, cost, fetch.trigger or None)
            (extra_after[fetch.trigger] if fetch.trigger else at_start).append(event)
            for consumer in fetch.consumers:
                for t in ir.op(consumer).inputs:
                    if t in reads:
                        b.replace[(consumer, t)] = key
                extra_deps[consumer].append(key)
            # The fetch starts once these weight gradients are on the host (their device buffers
            # freed): resolved below, once what of each gradient crosses is known.
            gradient_waits.append((key, fetch.after_gradients))

    # Weights on the host: the optimizer update runs there too. Each device buffer it reads (a
    # weight gradient) is copied out as soon as it is complete and freed after the copy; the update
    # ops hold no device memory and run one after another on the host's own stream, timed by the
    # bytes they move through host memory (:meth:`CostModel.host_op_time`).
    # Ops whose reads and waits differ from the plain step's: re-pointed consumers, and the ops
    # reading through a re-pointed alias op. The others reuse the cached structure (of the plain
    # step, and of its update on the host). Nothing re-points a read after this.
    rebuilt = {consumer for consumer, _ in b.replace} | set(sliced)
    through_alias = _readers_through_alias(ir)
    for consumer in list(rebuilt):
        rebuilt |= through_alias.get(consumer, frozenset())
    if not reuse_plain:
        rebuilt = ir_names
    host_update: AbstractSet[str] = frozenset()
    crossings: Dict[str, List[str]] = {}  # weight gradient -> the copies to the host of it or its products
    if b.on_host:
        update = _host_update_template(ir)
        host_update = update.ops
        for name in update.order:
            reads = (_update_reads(b, ir.op(name), host_update, update.on_device) if name in rebuilt
                     else update.reads[name])
            for source, producer, nbytes, gradients in reads:
                key = f"{TO_HOST_PREFIX}{source}"
                _once(extra_after[producer],
                      Event(key, TO_HOST_STREAM, cost.transfer_time(nbytes, "device_to_host"), [source], [], []))
                extra_deps[name].append(key)
                for gradient in gradients:
                    if key not in crossings.setdefault(gradient, []):
                        crossings[gradient].append(key)
    for key, gradients in gradient_waits:
        # What of a gradient crosses is the gradient, or the products the device makes of it
        # (SGD sends only the learning rate times the gradient, Adam the gradient and its square).
        extra_deps[key].extend(k for g in gradients for k in crossings.get(g, [f"{TO_HOST_PREFIX}{g}"]))
    template = _plain_template(ir)
    with_workspace = kernels != "onednn"
    limit = cost.device.cudnn_workspace_limit_bytes
    cudnn_limit = limit if limit is not None else float("inf")  # TF_CUDNN_WORKSPACE_LIMIT_IN_MB
    settled = set()  # events whose dependencies are the plain op's (computed below for the others)
    for extra in at_start:
        extra.order = -0.5
        b.index_of[extra.name] = b.add(extra)
    for op in ir.ops:
        cached = template.get(op.name)
        if cached is None:  # an alias op: not run
            for extra in extra_after.get(op.name, ()):
                extra.order = op.index + 0.5
                b.index_of[extra.name] = b.add(extra)
            continue
        name = op.name
        if name in rebuilt:
            reads = _canonical_reads(op, [b.source(name, t) for t in op.inputs])
        else:
            reads = list(cached.reads)
        writes = cached.writes
        if name in sliced:  # its slices run first; the op itself puts their outputs together
            reads = _add_slices(b, op, sliced[name], reads, op_time(op), extra_deps,
                                pool_workspace=bool(pooled) and op.type in MAXPOOL_GRAD_TYPES
                                and len(cached.sources) > 1 and ir.tensors[cached.sources[1]].producer in pooled)
        if pooled and name not in sliced:
            cached_reads = cached.sources
            if name in pooled:
                writes = writes + [(op.outputs[0] + POOL_WORKSPACE, _pool_workspace_bytes(ir, op.outputs[0]))]
            if op.type in MAXPOOL_GRAD_TYPES and len(cached_reads) > 1 and ir.tensors[cached_reads[1]].producer in pooled:
                # Max pools are never cloned (NEVER_CLONED_TYPES): the gradient reads the workspace its
                # forward pool wrote, also when it reads the pool output itself from a swap-in.
                reads.append(cached_reads[1] + POOL_WORKSPACE)
        event = Event(name, COMPUTE_STREAM, op_times[name] if op_times is not None else op_time(op), reads, writes, [],
                      forwarding=cached.forwarding and (not accumulated_sums or name not in accumulated_sums),
                      updates=cached.updates, order=op.index,
                      # an op placed off the device (on the host, on another pipeline stage) takes its
                      # scratch there
                      workspace=(0 if name in ir.host_placed else _compiled_scratch(ir, name, kernels) + (
                          0 if not with_workspace else _eigen_workspace(ir, op) if kernels == "eigen"
                          else min(cached.workspace, cudnn_limit))))
        if name in sliced:  # a ConcatV2 of the slices' outputs: a copy through device memory
            event.forwarding, event.workspace = False, 0
            event.duration = 2 * sum(n for _, n in writes) / cost.device.memory_bytes_per_s + \
                cost.device.launch_overhead_s
        if name in host_update:  # runs on the host: nothing on the device, host time
            event.reads, event.writes, event.updates, event.workspace = [], [], None, 0
            event.stream, event.duration = HOST_COMPUTE_STREAM, cost.host_op_time(ir, op)
            event.host_reads, event.host_writes = (_host_buffers(b, op, host_update) if name in rebuilt
                                                   else update.buffers[name])
            writes = []
        as_planned = name not in rebuilt and name not in extra_deps and name not in host_update
        if as_planned:
            index_of = b.index_of
            event.deps = [index_of[n] for n in cached.waits_for]
        index = len(b.ops)  # b.add(event), inline: this loop runs once per op of the step
        b.ops.append(event)
        for key, _ in writes:
            b.buffer_producer[key] = index
        b.index_of[name] = index
        if as_planned:
            settled.add(index)
        if op.type == "ReadVariableOp" and op.inputs:
            b.read_handles[op.outputs[0]] = op.inputs[0]
        for extra in extra_after.get(name, ()):
            extra.order = op.index + 0.5
            b.index_of[extra.name] = b.add(extra)

    # Dependencies of the others: producers of every buffer read, control edges, triggers (gates)
    # and swap-ins.
    for index, sim in enumerate(b.ops):
        if index in settled:
            continue
        deps = {b.buffer_producer[k] for k in sim.reads if k in b.buffer_producer}
        if sim.trigger is not None:
            deps.update(b.indices_of(sim.trigger))
        if sim.name in b.slice_waits:  # a slice waits for what its op would (IR ops: aliases resolved)
            for n in b.slice_waits[sim.name]:
                deps.update(b.indices_of(n))
        elif sim.name in ir_names:
            names = b.producer_deps(ir.op(sim.name)) if sim.name in rebuilt else template[sim.name].producer_deps
            deps.update(b.index_of[n] for n in names)
            for n in extra_deps.get(sim.name, ()):
                deps.update(b.indices_of(n))
        else:
            for n in extra_deps.get(sim.name, ()):  # a weight fetch waiting for gradients' copies out
                if n not in b.index_of:
                    raise LMSOptionError(
                        f"plan error: weight fetch {sim.name!r} waits for {n[len(TO_HOST_PREFIX):]!r} to reach the "
                        f"host, but the step copies no such tensor to the host (after_gradients names the weight "
                        f"gradients the optimizer update reads on the host). Remove it from after_gradients.")
                deps.add(b.index_of[n])
        sim.deps = sorted(deps - {index})
    return b
