"""Independent evidence of what a rewrite does: Grappler's GPU peak and TF's executed-op order.

* :func:`virtual_gpu_peak` simulates a traced step on a virtual GPU + host with
  Grappler's virtual cluster (TensorFlow's own memory simulator) and returns the
  GPU's peak bytes. No GPU is needed. It reads low in absolute terms on large
  models (docs/design.md), so compare a plain and a rewritten step with it.
  :func:`virtual_gpu_peak_report` adds the tensors it counts at the peak.
* :func:`executed_ops` runs a step under TensorFlow's profiler and returns the
  kernels in the order TensorFlow actually executed them.
* :func:`allocation_trace` runs a step under the profiler and returns every buffer the
  allocator handed out and took back (what the simulator's memory rules are checked against);
  :func:`allocation_log` turns it into the simulator's allocation log, to put a real run's
  requests through the allocator model.
* :func:`cpu_kernel_library` names TensorFlow's CPU kernels here (``simulate(kernels=)``).
* :func:`grappler_baseline_report` runs Grappler's own memory optimizer offline (the baseline
  to beat) and judges the result by the same oracle.
* :func:`grappler_accumulated_sums` names the sums TensorFlow's optimizer will accumulate into
  a temporary variable (``simulate(accumulated_sums=)``).

Examples:
    >>> import tensorflow as tf
    >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
    >>> peak = virtual_gpu_peak(f.get_concrete_function(tf.ones((256, 256))))
    >>> peak > 0
    True
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.ir import same_device
from lms_tf.core.op_kinds import ALIAS_TYPES, FORWARDING_TYPES
from lms_tf.tf.variables import variable_bytes_by_device

_VIRTUAL_GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
_VIRTUAL_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
#: The memory TensorFlow's runtime tells Grappler a CPU device has (its ``memory_limit``).
CPU_GRAPPLER_MEMORY_BYTES = 256 << 20


def virtual_gpu_peak(concrete_function, *, host: str = "/CPU:1", gpu_memory_bytes: int = 16 * 2**30,
                     host_memory_bytes: int = 256 * 2**30, include_variables: bool = False,
                     variable_shapes: bool = False) -> int:
    """Peak GPU bytes of a traced step by Grappler's virtual cluster.

    Ops without a device, or on a device other than ``host``, are put on a virtual
    GPU (a 16 GB V100-like device by default); ops on ``host`` on a virtual CPU.

    Args:
        concrete_function: A ``ConcreteFunction`` (e.g. ``fn.get_concrete_function(...)``).
        host: The device the rewrite used as host.
        gpu_memory_bytes: Memory of the virtual GPU.
        host_memory_bytes: Memory of the virtual host.
        include_variables: Add the bytes of the variables the step captures that live
            off ``host`` (model weights, optimizer slots). Grappler simulates only the
            tensors a step computes: variables are resident for the whole step, so they
            add to its peak as a constant; this is how ``optimizer_on_host`` shows.
        variable_shapes: Tell Grappler's shape inference the shape of every variable read
            (:func:`with_variable_shapes`). Without them, tensors whose shape follows from
            a weight's count as unknown: a ResNet-50 1x1 convolution's output counts as
            ``batch x channels x 4`` bytes, and the oracle reads about 40% low. With them it
            sizes tensors as the simulator does. Its own scheduler then decides the peak,
            unless the step was serialized (``serialize=True``).

    Returns:
        The virtual GPU's peak memory in bytes.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: x + 1.0)
        >>> virtual_gpu_peak(f.get_concrete_function(tf.ones((1024,)))) >= 4096
        True
    """
    report = virtual_gpu_peak_report(concrete_function, host=host, gpu_memory_bytes=gpu_memory_bytes,
                                     host_memory_bytes=host_memory_bytes, variable_shapes=variable_shapes)
    resident = 0
    if include_variables:
        resident = sum(n for device, n in variable_bytes_by_device(concrete_function.variables).items()
                       if not same_device(device, host))
    return report.peak_bytes + resident


@dataclasses.dataclass(frozen=True)
class OraclePeak:
    """Grappler's virtual-GPU peak of a step, with the tensors it counts at that moment.

    Grappler gives every op output a buffer of its own. TensorFlow's elementwise kernels write
    into an input buffer nobody else reads (``forward_input_or_allocate_output``), so where such
    an input and the output it becomes are both live at the peak, the peak counts one buffer
    twice; :attr:`in_place_bytes` is how much.

    Attributes:
        peak_bytes: The virtual GPU's peak.
        live: ``(node, output index, bytes)`` of each tensor live at the peak, largest first.
        in_place_bytes: Bytes of the live tensors whose one reader is an elementwise kernel
            (the simulator's ``FORWARDING_TYPES``) whose output is live too, of the same size:
            TensorFlow computes that output into this tensor's buffer.
        variable_read_bytes: Bytes of the live outputs of variable reads (``ReadVariableOp``, or
            the constants :func:`with_variable_shapes` puts in their place), and of the live
            aliases of those outputs. Grappler gives each one a buffer; TensorFlow's read hands
            out the variable's own buffer, which is resident, not step memory.
        alias_bytes: Bytes of the live outputs of alias ops (``Identity``, ``Reshape``...: the
            simulator's ``ALIAS_TYPES``) whose source, or another alias of it, is live too: beyond
            the largest of each such group. TensorFlow hands an alias its input's buffer; Grappler
            gives it one of its own. A serialized step's kept ``Identity`` gates and exits are such
            aliases (784 MiB of VGG16's serialized plain step at batch 16). An alias of a tensor
            copied from another device shares the buffer the copy was received into.
        released_bytes: Bytes of the live tensors whose last reader ended at the peak's instant.
            Grappler frees them 1 ns later, after the ops starting at that instant allocated;
            TensorFlow's executor releases them before it starts those ops (a ``ConcatV2`` of
            16 slices: their 64 MiB counted beside the concatenation's reader).
        step_bytes_released_first: The step's own tensors at the peak's instant (as
            :attr:`step_peak_bytes` counts them) once those are released. The peak as TensorFlow
            would hold Grappler's schedule is between this and :attr:`step_peak_bytes` (it may be
            at another instant).

    Examples:
        >>> OraclePeak(300, (("a", 0, 100), ("b", 0, 100), ("c", 0, 100)), 100).peak_bytes_counting_in_place_once
        200
        >>> OraclePeak(300, (("read", 0, 100), ("b", 0, 200)), 0, variable_read_bytes=100).step_peak_bytes
        200
        >>> OraclePeak(300, (("x", 0, 100), ("gate", 0, 100), ("y", 0, 100)), 0, alias_bytes=100).step_peak_bytes
        200
    """

    peak_bytes: int
    live: Tuple[Tuple[str, int, int], ...]
    in_place_bytes: int
    variable_read_bytes: int = 0
    alias_bytes: int = 0
    released_bytes: int = 0
    step_bytes_released_first: Optional[int] = None

    @property
    def step_peak_bytes(self) -> int:
        """The peak of the step's own tensors, as TensorFlow's allocator holds them: each buffer
        counted once (in-place pairs and aliases), and variable reads not counted (the variables
        are resident; add them to compare with a whole device's memory).

        Examples:
            >>> OraclePeak(300, (), 50, variable_read_bytes=100).step_peak_bytes
            150
        """
        return self.peak_bytes - self.in_place_bytes - self.alias_bytes - self.variable_read_bytes

    @property
    def peak_bytes_counting_buffers_once(self) -> int:
        """The peak with each buffer counted once: in-place pairs and aliases (variable reads
        still counted, as in :attr:`peak_bytes`).

        Examples:
            >>> OraclePeak(300, (), 50, alias_bytes=100).peak_bytes_counting_buffers_once
            150
        """
        return self.peak_bytes - self.in_place_bytes - self.alias_bytes

    @property
    def peak_bytes_counting_in_place_once(self) -> int:
        """The peak with each input/output pair of an in-place kernel counted once.

        Examples:
            >>> OraclePeak(300, (), 100).peak_bytes_counting_in_place_once
            200
        """
        return self.peak_bytes - self.in_place_bytes


def virtual_gpu_peak_report(concrete_function, *, host: str = "/CPU:1", gpu_memory_bytes: int = 16 * 2**30,
                            host_memory_bytes: int = 256 * 2**30, variable_shapes: bool = False) -> OraclePeak:
    """:func:`virtual_gpu_peak` with what Grappler counts at the peak (arguments as there).

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(tf.tile(x, [4])) * 2.0)
        >>> report = virtual_gpu_peak_report(f.get_concrete_function(tf.ones((1024,))))
        >>> report.peak_bytes >= 4 * 4096, report.in_place_bytes <= report.peak_bytes
        (True, True)
    """
    graph = concrete_function.graph
    graph_def = with_variable_shapes(graph.as_graph_def(add_shapes=True)) if variable_shapes else graph.as_graph_def()
    # TensorFlow's placer runs an op that takes a variable's handle where the variable lives: a
    # read of a variable on the host (weights="host") runs on the host, whatever its device string.
    on_host = {internal.op.name for external, internal in graph.captures
               if getattr(external, "dtype", None) == tf.resource and same_device(external.device or "", host)}
    for node in graph_def.node:
        # (with_variable_shapes turns a read's handle input into a control input: "^handle")
        takes_host_handle = any(name.lstrip("^").split(":")[0] in on_host for name in node.input)
        node.device = _VIRTUAL_CPU if (node.device and same_device(node.device, host)) or node.name in on_host \
            or takes_host_handle else _VIRTUAL_GPU
    fetches = sorted({t.op.name for t in graph.outputs} | {op.name for op in graph.control_outputs})
    peaks = _compat.grappler_peak_live_tensors(
        graph_def, fetches, [(_VIRTUAL_GPU, "GPU", gpu_memory_bytes), (_VIRTUAL_CPU, "CPU", host_memory_bytes)],
        with_times=True)
    peak, timed = peaks.get(_VIRTUAL_GPU, (0, []))
    live = [(node, port, nbytes) for node, port, nbytes, _, _ in timed]
    # Grappler frees an op's inputs 1 ns after it ends, so the ops starting then allocate beside
    # them; TensorFlow's executor releases them before it starts the ops they make ready.
    instant = max((allocated for *_, allocated, _ in timed), default=0)
    released = {(node, port) for node, port, _, allocated, freed in timed if allocated < instant <= freed <= instant + 1}
    op_types = {node.name: node.op for node in graph_def.node}
    device_of = {node.name: node.device for node in graph_def.node}
    # Only what the step runs reads a tensor: TensorFlow prunes the ops no fetch needs (Keras's
    # optimizer leaves an ``IdentityN`` of every gradient unread), and Grappler schedules the
    # fetches' fan-in alone. Counting a pruned reader would deny an elementwise kernel its input.
    inputs_of = {node.name: [name.lstrip("^").partition(":")[0] for name in node.input] for node in graph_def.node}
    runs, pending = set(), list(fetches)
    while pending:
        name = pending.pop()
        if name not in runs and name in inputs_of:
            runs.add(name)
            pending.extend(inputs_of[name])
    readers: Dict[Tuple[str, int], List[str]] = {}
    for node in graph_def.node:
        if node.name not in runs:
            continue
        for name in node.input:
            if not name.startswith("^"):
                source_name, _, port = name.partition(":")
                readers.setdefault((source_name, int(port or 0)), []).append(node.name)
    reads = {op.name for op in graph.get_operations() if op.type == "ReadVariableOp"}
    data_inputs = {node.name: [name for name in node.input if not name.startswith("^")] for node in graph_def.node}

    def source(node: str, port: int) -> Tuple[str, int]:
        """The tensor whose buffer an alias op's output is (through chains of aliases). An alias
        of a tensor on another device gets the buffer the copy across was received into: Grappler
        lists it as ``Recv_<node>_<port>_on_<device>``."""
        if node not in op_types and node.startswith("Recv_") and "_on_" in node:
            return node.rpartition("_on_")[0], 0
        for _ in range(len(data_inputs)):
            inputs = data_inputs.get(node, [])
            index = port if op_types.get(node) == "IdentityN" else 0
            if op_types.get(node) not in ALIAS_TYPES or index >= len(inputs):
                break
            name, _, read_port = inputs[index].partition(":")
            if device_of.get(name) != device_of.get(node):
                return f"Recv_{name}_{int(read_port or 0)}", 0
            node, port = name, int(read_port or 0)
        return node, port

    def counted_twice(sizes: Dict[Tuple[str, int], int]) -> Tuple[int, int, int]:
        """Of ``sizes`` (live tensors): the in-place, variable-read and alias bytes."""
        buffers: Dict[Tuple[str, int], List[Tuple[str, int]]] = {}
        for tensor in sizes:
            buffers.setdefault(source(*tensor), []).append(tensor)
        read_bytes = sum(sum(sizes[t] for t in group) for (node, _), group in buffers.items() if node in reads)

        def passed_on(tensor: Tuple[str, int]) -> bool:
            """Whether ``tensor``'s only reader is an alias of it: once that alias has run, TensorFlow's
            executor has released ``tensor`` and the alias alone holds the buffer (Grappler may still
            list both, e.g. a kernel gradient and the serializing gate that holds it). A copy
            Grappler received from another device is read by what it was sent to: its alias."""
            if tensor[0] not in op_types:
                return True
            reader = readers.get(tensor, [])
            return len(reader) == 1 and op_types.get(reader[0]) in ALIAS_TYPES and source(reader[0], 0) == source(*tensor)

        # An elementwise kernel writes into its input's buffer only when nothing else holds it: not
        # when a live alias shares it, unless every other holder has passed the buffer on down the
        # chain of aliases the kernel reads (a gate of one reader between a producer and the kernel).
        in_place = 0
        for tensor, nbytes in sizes.items():
            reader = readers.get(tensor, [])
            holders = [t for t in buffers[source(*tensor)] if t != tensor]
            if (len(reader) == 1 and op_types.get(reader[0]) in FORWARDING_TYPES and sizes.get((reader[0], 0)) == nbytes
                    and all(passed_on(t) for t in holders)):
                in_place += nbytes
        alias = sum(sum(sizes[t] for t in group) - max(sizes[t] for t in group)
                    for (node, _), group in buffers.items() if node not in reads)
        return in_place, read_bytes, alias

    sizes = {(node, port): nbytes for node, port, nbytes in live}
    in_place, read_bytes, alias = counted_twice(sizes)
    kept = {tensor: nbytes for tensor, nbytes in sizes.items() if tensor not in released}
    kept_in_place, kept_reads, kept_alias = counted_twice(kept)
    released_first = sum(kept.values()) - kept_in_place - kept_reads - kept_alias
    return OraclePeak(peak, tuple(sorted(live, key=lambda t: -t[2])), in_place, read_bytes, alias,
                      released_bytes=sum(sizes[t] for t in released),
                      step_bytes_released_first=released_first)


def with_variable_shapes(graph_def):
    """A copy of ``graph_def`` whose variable reads are constants of the traced shape.

    Grappler's shape inference does not look through a resource handle, so a
    ``ReadVariableOp`` has an unknown shape. Each one becomes a ``Const`` with the dtype and
    shape that tracing recorded (``as_graph_def(add_shapes=True)``), and no data. Grappler
    counts such a constant in its peak while a reader needs it, as it counted the read
    (:attr:`OraclePeak.variable_read_bytes` says how much of a peak that is). It keeps a control edge from the variable's handle and the read's own control
    inputs, so it runs where the read ran. This is for memory simulation only: the graph
    no longer reads its variables.

    Examples:
        >>> v = tf.Variable(tf.ones((3, 5)))
        >>> f = tf.function(lambda x: x @ v)
        >>> graph_def = f.get_concrete_function(tf.ones((2, 3))).graph.as_graph_def(add_shapes=True)
        >>> read = next(n for n in with_variable_shapes(graph_def).node if n.name.endswith("ReadVariableOp"))
        >>> read.op, [d.size for d in read.attr["value"].tensor.tensor_shape.dim]
        ('Const', [3, 5])
    """
    shaped = type(graph_def)()
    shaped.CopyFrom(graph_def)
    for node in shaped.node:
        if node.op != "ReadVariableOp" or "_output_shapes" not in node.attr:
            continue
        shape, dtype = node.attr["_output_shapes"].list.shape[0], node.attr["dtype"].type
        if any(d.size < 0 for d in shape.dim) or shape.unknown_rank:
            continue
        handle = node.input[0].split(":")[0].lstrip("^")
        controls = [name for name in node.input[1:] if name.startswith("^")]
        node.op = "Const"
        del node.input[:]
        node.input.extend([f"^{handle}"] + controls)
        node.attr.clear()
        node.attr["dtype"].type = dtype
        node.attr["value"].tensor.dtype = dtype
        node.attr["value"].tensor.tensor_shape.CopyFrom(shape)
    return shaped


@dataclasses.dataclass(frozen=True)
class GrapplerBaseline:
    """What Grappler's own memory optimizer did to a plain step, judged by the oracle.

    Attributes:
        mode: ``"SWAPPING_HEURISTICS"`` or ``"RECOMPUTATION_HEURISTICS"``.
        peak_bytes: The virtual GPU's peak of the optimized step.
        swapped: The tensors Grappler swaps out (inputs of its ``_CopyFromGpuToHost`` ops).
        recomputed: The ops Grappler clones for the backward pass (their original names).

    Examples:
        >>> GrapplerBaseline("SWAPPING_HEURISTICS", 1 << 20, ("conv/Relu:0",), ()).swapped
        ('conv/Relu:0',)
    """

    mode: str
    peak_bytes: int
    swapped: Tuple[str, ...]
    recomputed: Tuple[str, ...]


def grappler_baseline_report(concrete_function, mode: str, *, gpu_memory_bytes: int = 16 * 2**30,
                             host_memory_bytes: int = 256 * 2**30, target_bytes: Optional[int] = None,
                             variable_shapes: bool = False) -> GrapplerBaseline:
    """Grappler's own memory optimizer run offline on a plain step: what it swapped or
    recomputed, and the virtual-GPU peak of the result.

    Args:
        concrete_function: The plain (un-rewritten) step.
        mode: ``"SWAPPING_HEURISTICS"`` or ``"RECOMPUTATION_HEURISTICS"``.
        gpu_memory_bytes: Memory of the virtual GPU the result is measured on.
        host_memory_bytes: Memory of the virtual host.
        target_bytes: The GPU memory Grappler's optimizer is told about (default:
            ``gpu_memory_bytes``); it swaps or recomputes only when the step does not fit it.
        variable_shapes: Give Grappler the traced shape of every variable read
            (:func:`with_variable_shapes`), for its heuristics and for the judge. Without
            them, its static estimate misses the activations whose shapes follow from a weight.

    Returns:
        The optimizer's choices and the peak, judged by the same oracle as
        :func:`virtual_gpu_peak`. Grappler's swap-out copies are counted in host memory,
        where their kernel allocates them.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> report = grappler_baseline_report(f.get_concrete_function(tf.ones((256, 256))), "SWAPPING_HEURISTICS")
        >>> report.peak_bytes > 0, report.swapped
        (True, ())
    """
    graph = concrete_function.graph
    graph_def = with_variable_shapes(graph.as_graph_def(add_shapes=True)) if variable_shapes else graph.as_graph_def()
    for node in graph_def.node:
        node.device = _VIRTUAL_GPU
    fetches = sorted({t.op.name for t in graph.outputs} | {op.name for op in graph.control_outputs})
    devices = [(_VIRTUAL_GPU, "GPU", gpu_memory_bytes), (_VIRTUAL_CPU, "CPU", host_memory_bytes)]
    target = [(_VIRTUAL_GPU, "GPU", target_bytes or gpu_memory_bytes), (_VIRTUAL_CPU, "CPU", host_memory_bytes)]
    optimized, peaks = _compat.grappler_memory_optimized(graph_def, fetches, devices, mode, optimizer_devices=target)
    swapped = tuple(sorted(node.input[0] for node in optimized.node if node.op == _compat.GRAPPLER_SWAP_OPS[0]))
    prefix = _compat.GRAPPLER_RECOMPUTED_PREFIX
    recomputed = tuple(sorted(node.name[len(prefix):] for node in optimized.node if node.name.startswith(prefix)))
    return GrapplerBaseline(mode, peaks.get(_VIRTUAL_GPU, 0), swapped, recomputed)


def grappler_baseline_peak(concrete_function, mode: str, **kwargs) -> int:
    """:attr:`GrapplerBaseline.peak_bytes` of :func:`grappler_baseline_report` (same arguments).

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> grappler_baseline_peak(f.get_concrete_function(tf.ones((256, 256))), "RECOMPUTATION_HEURISTICS") > 0
        True
    """
    return grappler_baseline_report(concrete_function, mode, **kwargs).peak_bytes


@dataclasses.dataclass(frozen=True)
class ExecutedOp:
    """One kernel execution seen by TensorFlow's profiler.

    Attributes:
        node: Node name as executed (Grappler may prefix inlined function nodes).
        type: Op type.
        start_ps: Start time in picoseconds since the Unix epoch (wall clock).
        end_ps: End time in picoseconds since the Unix epoch.

    Examples:
        >>> ExecutedOp("a/Relu", "Relu", 0, 10).end_ps
        10
    """

    node: str
    type: str
    start_ps: int
    end_ps: int


def executed_ops(run_step: Callable[[], object]) -> List[ExecutedOp]:
    """Runs ``run_step()`` under TensorFlow's profiler; returns executed kernels by start time.

    Args:
        run_step: Runs one (already traced) step.

    Returns:
        Executed kernels, ordered by start time.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x))
        >>> _ = f(tf.ones((4,)))
        >>> any(e.type == "Relu" for e in executed_ops(lambda: f(tf.ones((4,)))))
        True
    """
    return [ExecutedOp(*event) for event in _compat.profile_executed_ops(run_step)]


def measured_op_seconds(run_step: Callable[[], object], op_names, steps: int = 3) -> Dict[str, float]:
    """Each traced op's median kernel time over ``steps`` runs of ``run_step()`` under TensorFlow's profiler.

    An executed node is matched to the traced op whose name it ends with (the profiler may prefix
    an inlined function's scope). Ops Grappler fused or renamed, and kernels run inline (which
    the profiler does not see), have no entry: about half a step's ops on a CPU.

    Args:
        run_step: Runs one already traced, warmed-up step.
        op_names: The traced ops' names (``op.name for op in ir.ops``).
        steps: Runs profiled.

    Returns:
        Op name -> median seconds.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x, name="r"))
        >>> _ = f(tf.ones((4,)))
        >>> list(measured_op_seconds(lambda: f(tf.ones((4,))), ["r"], steps=1))
        ['r']
    """
    names = set(op_names)
    samples: Dict[str, List[float]] = collections.defaultdict(list)
    for _ in range(steps):
        for event in executed_ops(run_step):
            parts = event.node.split("/")
            name = next(("/".join(parts[i:]) for i in range(len(parts)) if "/".join(parts[i:]) in names), None)
            if name is not None:
                samples[name].append((event.end_ps - event.start_ps) / 1e12)
    return {name: statistics.median(values) for name, values in samples.items()}


def find_executed(events: List[ExecutedOp], op_name: str) -> Optional[ExecutedOp]:
    """The first execution of a node whose name is ``op_name`` or ends with ``/op_name``.

    Examples:
        >>> find_executed([ExecutedOp("call/a/Relu", "Relu", 0, 1)], "a/Relu").node
        'call/a/Relu'
    """
    for event in events:
        if event.node == op_name or event.node.endswith("/" + op_name):
            return event
    return None


@dataclasses.dataclass(frozen=True)
class AllocationEvent:
    """One request to (or release from) TensorFlow's BFC allocator, from its profiler trace.

    Attributes:
        kind: ``"alloc"`` or ``"free"``.
        op: Node name of the kernel that allocated (empty on frees).
        region_type: ``"output"``, ``"temp"`` (kernel scratch), ... (empty on frees).
        requested_bytes: Bytes requested.
        chunk_bytes: Bytes of the chunk that served it.
        address: The buffer's address (pairs a free with its allocation).
        shape: The tensor's shape as TensorFlow prints it, e.g. ``"[16,112,112,64]"``.

    Examples:
        >>> AllocationEvent("alloc", "pool/MaxPool", "output", 1000, 1024, 0x10, "[250]").chunk_bytes
        1024
    """

    kind: str
    op: str
    region_type: str
    requested_bytes: int
    chunk_bytes: int
    address: int
    shape: str


def allocation_trace(run_step: Callable[[], object]) -> List[AllocationEvent]:
    """Runs ``run_step()`` under TensorFlow's profiler; returns the allocator's requests in order.

    On the CPU the trace exists only with TensorFlow's BFC allocator
    (``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts); otherwise it is empty.

    Args:
        run_step: Runs one (already traced) step.

    Returns:
        Allocations and frees in time order.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> _ = f(tf.ones((4,)))
        >>> events = allocation_trace(lambda: f(tf.ones((4,))))
        >>> all(e.kind in ("alloc", "free") for e in events)
        True
    """
    return [AllocationEvent(*event) for event in _compat.profile_allocations(run_step)]


def live_at_allocator_peak(events: Sequence[AllocationEvent]) -> Tuple[int, List[AllocationEvent]]:
    """The allocator's peak over a trace and the buffers live at it.

    Counts whole chunks (what the allocator's own peak counts), from the trace's start: a
    buffer allocated before the trace began is not seen, and its free is ignored.

    Args:
        events: An :func:`allocation_trace`, in time order.

    Returns:
        ``(peak chunk bytes, the allocations live at the peak, in the order they were made)``.

    Examples:
        >>> events = [AllocationEvent("alloc", "a", "output", 1000, 1024, 1, "[250]"),
        ...           AllocationEvent("alloc", "b", "temp", 2000, 2048, 2, "[500]"),
        ...           AllocationEvent("free", "", "", 2000, 2048, 2, ""),
        ...           AllocationEvent("alloc", "c", "output", 500, 512, 3, "[125]")]
        >>> peak, live = live_at_allocator_peak(events)
        >>> peak, [e.op for e in live]
        (3072, ['a', 'b'])
    """
    live: Dict[int, AllocationEvent] = {}
    in_use = peak = 0
    at_peak: List[AllocationEvent] = []
    for event in events:
        if event.kind == "alloc":
            live[event.address] = event
            in_use += event.chunk_bytes
            if in_use > peak:
                peak, at_peak = in_use, list(live.values())
        elif event.address in live:
            in_use -= live.pop(event.address).chunk_bytes
    return peak, at_peak


def requested_peak(events: Sequence[AllocationEvent]) -> int:
    """The most bytes a trace's live allocations asked for at once: the peak of the tensors
    themselves, before the allocator serves each from a whole chunk (what the simulator's
    ``peak_bytes`` predicts; :func:`live_at_allocator_peak` counts the chunks).

    Examples:
        >>> events = [AllocationEvent("alloc", "a", "output", 1000, 1024, 1, "[250]"),
        ...           AllocationEvent("alloc", "b", "temp", 2000, 2048, 2, "[500]"),
        ...           AllocationEvent("free", "", "", 2000, 2048, 2, "")]
        >>> requested_peak(events)
        3000
    """
    live: Dict[int, int] = {}
    in_use = peak = 0
    for event in events:
        if event.kind == "alloc":
            live[event.address] = event.requested_bytes
            in_use += event.requested_bytes
            peak = max(peak, in_use)
        elif event.address in live:
            in_use -= live.pop(event.address)
    return peak


def allocation_log(events: Sequence[AllocationEvent]) -> List[Tuple[str, str, int]]:
    """A real run's requests in the form of :attr:`lms_tf.simulate.Simulation.allocations`, so
    :func:`lms_tf.simulate.allocator.replay_allocations` can put them through the allocator
    model: the model's rules checked on the very requests a run made, apart from whether the
    simulator predicted those requests.

    Each allocation gets a key of its own (an address is reused); a free of a buffer allocated
    before the trace began is dropped.

    Args:
        events: An :func:`allocation_trace`, in time order.

    Returns:
        ``("alloc", key, requested bytes)`` and ``("free", key, 0)`` events.

    Examples:
        >>> events = [AllocationEvent("alloc", "a", "output", 1000, 1024, 1, "[250]"),
        ...           AllocationEvent("free", "", "", 1000, 1024, 1, ""),
        ...           AllocationEvent("alloc", "b", "output", 500, 512, 1, "[125]"),
        ...           AllocationEvent("free", "", "", 8, 256, 9, "")]
        >>> allocation_log(events)
        [('alloc', 'a#0', 1000), ('free', 'a#0', 0), ('alloc', 'b#2', 500)]
    """
    live: Dict[int, str] = {}
    log: List[Tuple[str, str, int]] = []
    for position, event in enumerate(events):
        if event.kind == "alloc":
            live[event.address] = f"{event.op}#{position}"
            log.append(("alloc", live[event.address], event.requested_bytes))
        elif event.address in live:
            log.append(("free", live.pop(event.address), 0))
    return log


def cpu_kernel_library() -> str:
    """TensorFlow's CPU kernel library in this process, as :func:`lms_tf.planner.simulate`'s
    ``kernels=`` names it: ``"onednn"`` (the default on x86) or ``"eigen"``
    (``TF_ENABLE_ONEDNN_OPTS=0``).

    Examples:
        >>> cpu_kernel_library() in ("onednn", "eigen")
        True
    """
    return "onednn" if _compat.onednn_enabled() else "eigen"


def grappler_accumulated_sums(concrete_function, *, device_memory_bytes: int = CPU_GRAPPLER_MEMORY_BYTES
                              ) -> frozenset:
    """The ``AddN`` ops TensorFlow will run as additions into a temporary variable.

    When a step's estimated peak exceeds 80% of the memory the runtime tells Grappler its device
    has, Grappler's memory optimizer rewrites each ``AddN`` of three or more inputs that are
    live at that peak: the sum is accumulated into a temporary variable initialised from a
    zeros constant, so it takes a buffer of its own where the plain kernel would write into an
    input, and the constant stays allocated. A CPU device is said to have 256 MiB, so on the
    CPU a real model's step passes the threshold, and has such a sum when one is live at the
    estimated peak: ResNet-50's and MobileNetV2's steps one each, VGG16's, a U-Net's and a
    Transformer encoder's none. This runs TensorFlow's default optimizer pipeline offline on
    the traced step, as the runtime does before the first run, and reads the rewrite off its
    result. It named the same sums as the runtime on those five models' plain and
    recompute-only steps and on a Keras MLP either side of the threshold
    (``tests/test_simulate_executor_rules.py``, ``benchmarks/allocator_validation.py``). It can differ
    where the offline estimate does: variable reads are given to it as constants of their
    shape, and on a hand-written elementwise step with a 64 MiB input and no layers it stayed
    under the threshold where the runtime's estimate went over.

    Args:
        concrete_function: The traced step (for an ``lms_tf.function`` step, the rewritten one
            that runs: ``step.get_concrete_function(...)``).
        device_memory_bytes: The memory Grappler is told the device has (a CPU's 256 MiB; a
            GPU's memory limit).

    Returns:
        The ``AddN`` op names, for :func:`lms_tf.planner.simulate`'s ``accumulated_sums``.

    Examples:
        >>> import tensorflow as tf
        >>> v = tf.Variable(tf.ones((256, 256)))
        >>> @tf.function
        ... def step(x):
        ...     with tf.GradientTape() as tape:
        ...         h = tf.nn.relu(x @ v)
        ...         loss = tf.reduce_sum(tf.exp(h) + tf.sin(h) + h * h)   # dloss/dh: a sum of three
        ...     return tape.gradient(loss, v)
        >>> concrete = step.get_concrete_function(tf.ones((256, 256)))
        >>> sorted(grappler_accumulated_sums(concrete, device_memory_bytes=2**20))   # estimate > 0.8 MiB
        ['AddN']
        >>> sorted(grappler_accumulated_sums(concrete))   # a CPU's 256 MiB: the step is far smaller
        []
    """
    graph = concrete_function.graph
    graph_def = with_variable_shapes(graph.as_graph_def(add_shapes=True))
    for node in graph_def.node:
        node.device = _VIRTUAL_CPU
    fetches = sorted({t.op.name for t in graph.outputs} | {op.name for op in graph.control_outputs})
    return frozenset(_compat.grappler_accumulated_sums(graph_def, fetches, (_VIRTUAL_CPU, "CPU", device_memory_bytes)))
