"""Every use of a private TensorFlow or Keras API in lms-tf lives in this module.

The rest of the package goes through these helpers, so a TensorFlow or Keras
release that changes one of them breaks here, loudly, and is tested in
``tests/test_compat.py``.

Example:
    >>> from lms_tf import _compat
    >>> _compat.check_private_apis()  # raises LMSError if this TF lacks an API we need
"""

from __future__ import annotations

import contextlib
import functools
import glob
import inspect
import os
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from lms_tf.core.errors import LMSError


def check_private_apis() -> None:
    """Raises LMSError naming each private API this TensorFlow no longer provides.

    Example:
        >>> check_private_apis()
    """
    missing = [name for name in ("_update_input", "_add_control_input", "_set_attr", "_get_attr_type")
               if not hasattr(tf.Operation, name)]
    from tensorflow.python.framework import func_graph  # noqa: F401 - import is the check

    if missing:
        raise LMSError(
            f"TensorFlow {tf.__version__} lacks tf.Operation.{', '.join(missing)}, which lms-tf uses to "
            f"rewrite graphs. Install a tested version (see README) or report the TF version."
        )


# --- graph editing -----------------------------------------------------------------------------

def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """Re-points input ``index`` of ``op`` to ``tensor`` (in place, during tracing)."""
    op._update_input(index, tensor)  # pylint: disable=protected-access


@contextlib.contextmanager
def automatic_control_dependencies():
    """Adds ``tf.function``'s automatic control edges between the stateful ops created in the
    block when it ends, instead of when the trace ends. Yields ``mark_as_return``, which must
    wrap the block's results."""
    from tensorflow.python.framework import auto_control_deps

    with auto_control_deps.AutomaticControlDependencies() as deps:
        yield lambda structure: tf.nest.map_structure(
            lambda t: deps.mark_as_return(t) if isinstance(t, tf.Tensor) else t, structure)


def add_control_input(op: tf.Operation, control: tf.Operation) -> None:
    """Adds the control edge ``control -> op``."""
    op._add_control_input(control)  # pylint: disable=protected-access


def set_string_attr(op: tf.Operation, name: str, value: str) -> None:
    """Sets a string attribute such as ``_lms`` on ``op``."""
    op._set_attr(name, attr_value_pb2.AttrValue(s=value.encode()))  # pylint: disable=protected-access


def set_bool_attr(op: tf.Operation, name: str, value: bool) -> None:
    """Sets a boolean attribute such as ``_grappler_do_not_remove`` on ``op``."""
    op._set_attr(name, attr_value_pb2.AttrValue(b=value))  # pylint: disable=protected-access


def set_int_attr(op: tf.Operation, name: str, value: int) -> None:
    """Sets an integer attribute such as ``_lms_serial`` on ``op``."""
    op._set_attr(name, attr_value_pb2.AttrValue(i=value))  # pylint: disable=protected-access


def string_attr(op: tf.Operation, name: str) -> Optional[str]:
    """Returns the string attribute ``name`` of ``op``, or None when absent."""
    try:
        value = op.get_attr(name)
    except ValueError:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def clone_op(graph: tf.Graph, op: tf.Operation, inputs: List[tf.Tensor], name: str) -> tf.Operation:
    """Creates a copy of ``op`` (same type and attributes, on the same device) reading ``inputs``.

    The copy has no control inputs; colocation constraints of the original are dropped.
    """
    attrs = {key: value for key, value in op.node_def.attr.items() if key != "_class"}
    with graph.device(op.device):
        return graph._create_op_internal(  # pylint: disable=protected-access
            op.type, inputs, dtypes=[out.dtype for out in op.outputs], name=name, attrs=attrs, op_def=op.op_def)


def is_function_graph(graph: tf.Graph) -> bool:
    """Whether ``graph`` is a ``FuncGraph`` (the graph of a ``tf.function`` being traced)."""
    from tensorflow.python.framework import func_graph

    return isinstance(graph, func_graph.FuncGraph)


def current_graph() -> tf.Graph:
    """The graph ops are being added to: the FuncGraph while a ``tf.function`` traces."""
    return tf.compat.v1.get_default_graph()


def infer_shapes_with_inputs(graph: tf.Graph, tensor_shapes: Dict[str, tf.TensorShape]
                             ) -> Dict[str, tf.TensorShape]:
    """Re-runs TensorFlow's shape inference with concrete shapes for some tensors.

    The graph is exported and imported into a scratch graph in which the tensors named in
    ``tensor_shapes`` (placeholders, iterator outputs) are replaced by placeholders of those
    shapes; TensorFlow infers every other op's shape again while importing.

    Returns:
        Tensor name -> inferred shape, for every tensor of the graph.
    """
    graph_def = graph.as_graph_def()
    scratch = tf.Graph()
    with scratch.as_default():
        input_map = {}
        for i, (name, shape) in enumerate(sorted(tensor_shapes.items())):
            dtype = graph.get_tensor_by_name(name).dtype
            input_map[name] = tf.compat.v1.placeholder(dtype, shape=shape, name=f"lms_input_{i}")
        tf.graph_util.import_graph_def(graph_def, input_map=input_map, name="s")
    shapes = {}
    for op in scratch.get_operations():
        if op.name.startswith("s/"):
            for out in op.outputs:
                shapes[out.name[2:]] = out.shape
    return shapes


# --- Keras -------------------------------------------------------------------------------------

def using_legacy_keras() -> bool:
    """Whether ``TF_USE_LEGACY_KERAS=1`` selects tf-keras (Keras 2) instead of Keras 3."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in ("1", "true", "yes")


def keras_module():
    """The Keras package models are built with: ``tf_keras`` under legacy mode, else ``keras``."""
    if using_legacy_keras():
        import tf_keras

        return tf_keras
    import keras

    return keras


def get_jit_compile(model) -> bool:
    """The model's effective ``jit_compile`` setting (True, False or resolved "auto")."""
    value = getattr(model, "jit_compile", None)
    if value is None:
        value = getattr(model, "_jit_compile", None)
    return bool(value) if value not in ("auto",) else True


def set_jit_compile(model, value: bool) -> None:
    """Sets the model's resolved ``jit_compile`` (``_jit_compile`` in Keras 3 and tf-keras).

    The attribute is written directly: Keras 3's property setter re-validates against
    the current machine and would refuse to restore a value resolved on a GPU.
    """
    if hasattr(model, "_jit_compile"):
        model._jit_compile = value  # pylint: disable=protected-access
    else:
        model.jit_compile = value


def layer_scope_aliases(model, graph: tf.Graph) -> Dict[str, str]:
    """Maps each layer name of ``model`` to the name scope its ops got in ``graph``.

    Keras traces the train step after other uses of the model's name scope, so TF
    uniquifies every scope of the trace with the same suffix (``seq_cnn`` -> ``seq_cnn_1``,
    ``conv0`` -> ``conv0_1``). The suffix is read off the model's own scope.
    """
    layers = model._flatten_layers(include_self=False, recursive=True)  # pylint: disable=protected-access
    names = [layer.name for layer in layers]
    first_segments = {op.name.split("/")[0] for op in graph.get_operations()}
    suffix = ""
    if model.name not in first_segments:
        for segment in first_segments:
            tail = segment[len(model.name):]
            if segment.startswith(model.name + "_") and tail[1:].isdigit():
                suffix = tail
                break
    return {name: name + suffix for name in names}


def fit_batch_size() -> Optional[int]:
    """The batch size of the ``Model.fit`` call that is running, read from its frame.

    Keras does not hand callbacks the batch size; ``fit`` holds it in its epoch iterator
    (Keras 3: ``epoch_iterator.data_adapter.batch_size``; tf-keras: ``data_handler._batch_size``)
    or its ``batch_size`` argument. Returns None when no such frame is found.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and "self" in frame.f_locals:
                local = frame.f_locals
                it = local.get("epoch_iterator")
                adapter = getattr(it, "data_adapter", None) or getattr(it, "_data_adapter", None)
                size = getattr(adapter, "batch_size", None)
                if size is None:
                    handler = local.get("data_handler")
                    size = getattr(handler, "_batch_size", None)
                if size is None:
                    size = local.get("batch_size")
                return int(size) if size else None
            frame = frame.f_back
        return None
    finally:
        del frame


# --- Keras optimizer updates --------------------------------------------------------------------

# The methods through which a train step hands (gradients, variables) to a Keras optimizer.
# Keras 3: apply_gradients() calls apply(); LossScaleOptimizer/MultiOptimizer override apply()
# and call their inner optimizers' apply(). tf-keras: apply_gradients() on both optimizer bases.
_KERAS3_APPLY = ("keras.src.optimizers.base_optimizer:BaseOptimizer",
                 "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer",
                 "keras.src.optimizers.multi_optimizer:MultiOptimizer")
_TF_KERAS_APPLY_GRADIENTS = ("tf_keras.src.optimizers.optimizer:Optimizer",
                             "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2",
                             "tf_keras.src.mixed_precision.loss_scale_optimizer:LossScaleOptimizer",
                             "tf_keras.src.mixed_precision.loss_scale_optimizer:LossScaleOptimizerV3")


def _optimizer_entry_points() -> List[Tuple[type, str]]:
    """(class, method) pairs that receive gradients, for the Keras packages that are importable."""
    import importlib

    entries = []
    for paths, method in ((_KERAS3_APPLY, "apply"), (_TF_KERAS_APPLY_GRADIENTS, "apply_gradients")):
        for path in paths:
            module_name, class_name = path.split(":")
            if module_name.split(".")[0] not in sys.modules:
                continue  # a Keras package nobody imported cannot be running the step
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                continue
            if method in cls.__dict__:
                entries.append((cls, method))
    return entries


_intercept_state = threading.local()


def _split_update_args(method: str, args, kwargs):
    """(grads, variables, rebuild) for a call of ``apply(grads, vars)`` or ``apply_gradients(pairs)``."""
    if method == "apply":
        grads = list(args[0] if args else kwargs.pop("grads"))
        variables = args[1] if len(args) > 1 else kwargs.pop("trainable_variables", None)
        rest = args[2:]

        def rebuild(new_grads, new_variables):
            return (new_grads, new_variables) + tuple(rest), kwargs
        return grads, (None if variables is None else list(variables)), rebuild
    pairs = list(args[0] if args else kwargs.pop("grads_and_vars"))
    rest = args[1:]
    grads, variables = [g for g, _ in pairs], [v for _, v in pairs]

    def rebuild(new_grads, new_variables):
        return (list(zip(new_grads, new_variables)),) + tuple(rest), kwargs
    return grads, variables, rebuild


def _run_hooks(optimizer, method, original, args, kwargs):
    grads, variables, rebuild = _split_update_args(method, args, dict(kwargs))
    hooks = [hook for _, _, hook in sorted(_intercept_state.hooks, key=lambda entry: entry[:2])]

    def call(position, new_grads, new_variables):
        if position < len(hooks):
            return hooks[position](optimizer, list(new_grads), new_variables,
                                   lambda g, v: call(position + 1, g, v))
        new_args, new_kwargs = rebuild(list(new_grads), new_variables)
        _intercept_state.depth += 1
        try:
            return original(optimizer, *new_args, **new_kwargs)
        finally:
            _intercept_state.depth -= 1
    return call(0, grads, variables)


def _patched(method, original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if getattr(_intercept_state, "depth", 0) > 0 or not getattr(_intercept_state, "hooks", None):
            return original(self, *args, **kwargs)
        return _run_hooks(self, method, original, args, kwargs)
    wrapper.__lms_tf_original__ = original
    return wrapper


@contextlib.contextmanager
def intercept_optimizer_updates(hook, order: int = 0):
    """While active, every Keras optimizer update in this thread passes through ``hook`` first.

    ``hook(optimizer, grads, variables, update)`` receives the gradients and variables of one
    ``optimizer.apply(...)`` / ``apply_gradients(...)`` call (``variables`` may be None when
    Keras 3's ``apply(grads)`` is called without them) and must call
    ``update(grads, variables)`` to go on, possibly with new gradients or under a device
    scope, and return its result. Active hooks run nested by ascending ``order`` (then by
    entry), so a gradient-averaging hook (order 0) runs outside a placement hook (order 1).
    Only the outermost call of a nested chain (LossScaleOptimizer -> inner optimizer) is
    intercepted. The class-level patch (the step's optimizer is unknown before it runs) is
    installed while any hook is active, i.e. while a step is being traced.
    """
    if not hasattr(_intercept_state, "hooks"):
        _intercept_state.hooks, _intercept_state.depth, _intercept_state.serial = [], 0, 0
    with _intercept_lock:
        global _patch_users
        if _patch_users == 0:
            entries = _optimizer_entry_points()
            if not entries:
                raise LMSError("found no Keras optimizer class to intercept (neither Keras 3 nor tf-keras "
                               "is importable); lms-tf's optimizer options need one of them.")
            for cls, method in entries:
                setattr(cls, method, _patched(method, cls.__dict__[method]))
                _patched_entries.append((cls, method))
        _patch_users += 1
    _intercept_state.serial += 1
    entry = (order, _intercept_state.serial, hook)
    _intercept_state.hooks.append(entry)
    try:
        yield
    finally:
        _intercept_state.hooks.remove(entry)
        with _intercept_lock:
            _patch_users -= 1
            if _patch_users == 0:
                for cls, method in _patched_entries:
                    setattr(cls, method, cls.__dict__[method].__lms_tf_original__)
                _patched_entries.clear()


_intercept_lock = threading.Lock()
_patch_users = 0
_patched_entries: List[Tuple[type, str]] = []


# --- Grappler's virtual cluster (the GPU memory oracle) ------------------------------------------

def grappler_peak_memory(graph_def, fetch_names: Sequence[str], devices: Sequence[Tuple[str, str, int]]
                         ) -> Dict[str, int]:
    """Simulates ``graph_def`` on virtual devices and returns the peak bytes per device.

    Args:
        graph_def: A GraphDef whose nodes all carry a full device name.
        fetch_names: Node names the step must compute (the graph's outputs and stateful ops).
        devices: ``(full_name, type, memory_bytes)`` for each virtual device.
    """
    return {dev: peak for dev, (peak, _) in grappler_peak_live_tensors(graph_def, fetch_names, devices).items()}


def grappler_peak_live_tensors(graph_def, fetch_names: Sequence[str], devices: Sequence[Tuple[str, str, int]]
                               ) -> Dict[str, Tuple[int, List[Tuple[str, int, int]]]]:
    """:func:`grappler_peak_memory` with the tensors live at each device's peak.

    Returns:
        Device -> (peak bytes, ``(node, output index, bytes)`` of each tensor live at the peak).
    """
    from tensorflow.core.protobuf import device_properties_pb2, meta_graph_pb2
    from tensorflow.python.grappler import cluster as gcluster
    from tensorflow.python.grappler import item as gitem

    named = [device_properties_pb2.NamedDevice(name=name, properties=_device_properties(dev_type, memory))
             for name, dev_type, memory in devices]
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    meta.collection_def["train_op"].node_list.value.extend(fetch_names)
    cluster = gcluster.Cluster(devices=named)
    try:
        peaks = cluster.DeterminePeakMemoryUsage(gitem.Item(meta, ignore_colocation=True))
    finally:
        cluster.Shutdown()
    # Each live tensor: (node, output id, bytes, allocation time, deallocation time).
    return {dev: (int(peak), [(str(t[0]), int(t[1]), int(t[2])) for t in live]) for dev, (peak, live) in peaks.items()}


#: Grappler's swap pair. The swap-out kernel allocates its output in host memory, and the
#: swap-in kernel, gated by a trigger, copies it back into a GPU buffer of its own.
GRAPPLER_SWAP_OPS = ("_CopyFromGpuToHost", "_CopyFromHostToGpu")
#: The name scope Grappler's recomputation pass gives the ops it clones.
GRAPPLER_RECOMPUTED_PREFIX = "Recomputed/"


def grappler_memory_optimized(graph_def, fetch_names: Sequence[str], devices: Sequence[Tuple[str, str, int]],
                              mode: str, name_scope: str = "gradient_tape/",
                              optimizer_devices: Optional[Sequence[Tuple[str, str, int]]] = None):
    """Runs Grappler's own memory optimizer offline, then simulates the result on the same devices.

    Args:
        graph_def: A GraphDef whose nodes all carry a full device name.
        fetch_names: Node names the step must compute.
        devices: ``(full_name, type, memory_bytes)`` for each virtual device; the first CPU
            one is the host.
        mode: ``"SWAPPING_HEURISTICS"`` or ``"RECOMPUTATION_HEURISTICS"``.
        name_scope: ``memory_optimizer_target_node_name_scope`` (the gradient scope).
        optimizer_devices: The devices the optimizer is told about (default: ``devices``).
            Grappler's memory optimizer acts only when the graph does not fit them, and its
            peak simulation refuses a graph that does not fit, so optimise for a small device
            and measure on a large one.

    Returns:
        ``(optimized GraphDef, peak bytes per device)``. For the simulation, Grappler's swap
        ops are placed on the host. Left on the GPU, the virtual scheduler would count the
        swap-out's output as GPU memory, though its kernel allocates it on the host. On the
        host, the swapped tensor comes back into GPU memory when the gated swap-in runs. This
        is how the swap-in would run, and how lms-tf's own swap-ins are judged.
    """
    from tensorflow.core.protobuf import config_pb2, device_properties_pb2, meta_graph_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import cluster as gcluster
    from tensorflow.python.grappler import item as gitem
    from tensorflow.python.grappler import tf_optimizer

    def named(specs):
        return [device_properties_pb2.NamedDevice(name=name, properties=_device_properties(dev_type, memory))
                for name, dev_type, memory in specs]

    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    meta.collection_def["train_op"].node_list.value.extend(fetch_names)
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    # The default optimizer pipeline with memory_optimization set (an explicit optimizers list
    # that names only "memory" leaves the memory optimizer inactive).
    rewrite.memory_optimization = getattr(rewriter_config_pb2.RewriterConfig, mode)
    rewrite.memory_optimizer_target_node_name_scope = name_scope
    rewrite.min_graph_nodes = -1
    cluster = gcluster.Cluster(devices=named(optimizer_devices or devices))
    try:
        optimized = tf_optimizer.OptimizeGraph(config, meta, cluster=cluster)
    finally:
        cluster.Shutdown()
    host = next(name for name, dev_type, _ in devices if dev_type == "CPU")
    judged = type(optimized)()
    judged.CopyFrom(optimized)
    for node in judged.node:
        if node.op in GRAPPLER_SWAP_OPS:
            node.device = host
    meta.graph_def.CopyFrom(judged)
    cluster = gcluster.Cluster(devices=named(devices))
    try:
        peaks = cluster.DeterminePeakMemoryUsage(gitem.Item(meta, ignore_colocation=True))
    finally:
        cluster.Shutdown()
    return optimized, {dev: int(value[0]) for dev, value in peaks.items()}


def grappler_accumulated_sums(graph_def, fetch_names: Sequence[str], device: Tuple[str, str, int]) -> List[str]:
    """The ``AddN`` nodes that TensorFlow's default Grappler pipeline turns into additions into a
    temporary variable (its memory optimizer's scheduling pass), run offline on one device.

    Args:
        graph_def: A GraphDef whose nodes all carry ``device``'s full name.
        fetch_names: Node names the step must compute.
        device: ``(full_name, type, memory_bytes)``; ``memory_bytes`` is what the runtime tells
            Grappler (the device's ``memory_limit``: 256 MiB for a CPU).

    Returns:
        The rewritten nodes' names, sorted.
    """
    from tensorflow.core.protobuf import config_pb2, device_properties_pb2, meta_graph_pb2
    from tensorflow.python.grappler import cluster as gcluster
    from tensorflow.python.grappler import tf_optimizer

    name, dev_type, memory = device
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    meta.collection_def["train_op"].node_list.value.extend(fetch_names)
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.min_graph_nodes = -1
    cluster = gcluster.Cluster(devices=[device_properties_pb2.NamedDevice(
        name=name, properties=_device_properties(dev_type, memory))])
    try:
        optimized = tf_optimizer.OptimizeGraph(config, meta, cluster=cluster)
    finally:
        cluster.Shutdown()
    suffix = "/tmp_var"
    return sorted(node.name[:-len(suffix)] for node in optimized.node
                  if node.op == "TemporaryVariable" and node.name.endswith(suffix))


def _device_properties(dev_type: str, memory: int):
    from tensorflow.core.protobuf import device_properties_pb2

    return device_properties_pb2.DeviceProperties(
        type=dev_type, frequency=1000 if dev_type == "CPU" else 1530, num_cores=2 if dev_type == "CPU" else 80,
        memory_size=memory, bandwidth=900_000_000 if dev_type == "GPU" else 20_000_000,
        l1_cache_size=32 * 1024, l2_cache_size=6 * 1024 * 1024, shared_memory_size_per_multiprocessor=96 * 1024)


# --- executed-op order from TensorFlow's profiler ----------------------------------------------

def _profiled_xspace(run_step):
    """Runs ``run_step()`` under TensorFlow's host profiler; returns its XSpace proto."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp(prefix="lms_tf_profile_")
    options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=3, device_tracer_level=0)
    tf.profiler.experimental.start(logdir, options=options)
    try:
        run_step()
    finally:
        tf.profiler.experimental.stop()
    files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise LMSError(f"TensorFlow's profiler wrote no trace into {logdir}.")
    space = xplane_pb2.XSpace()
    with open(files[0], "rb") as handle:
        space.ParseFromString(handle.read())
    return space


def profile_executed_ops(run_step) -> List[Tuple[str, str, int, int]]:
    """Runs ``run_step()`` under TensorFlow's profiler and returns the ops it executed.

    Returns:
        ``(node_name, op_type, start_ps, end_ps)`` per executed kernel, sorted by start; times
        in picoseconds since the Unix epoch.
    """
    space = _profiled_xspace(run_step)
    # Line timestamps count from the session start, which the "Task Environment" plane records
    # in wall-clock ns: adding it puts events on the clock other tools (Horovod's timeline) use.
    session_start_ns = 0
    for plane in space.planes:
        for stat in plane.stats:
            if plane.stat_metadata[stat.metadata_id].name == "profile_start_time":
                session_start_ns = stat.int64_value or stat.uint64_value
    events = []
    for plane in space.planes:
        metadata = plane.event_metadata
        for line in plane.lines:
            if not line.name.startswith("tf_") and line.name != "python":
                continue
            for event in line.events:
                label = metadata[event.metadata_id].name
                if ":" not in label or label.startswith(("ExecutorState", "ThreadpoolListener")):
                    continue
                node, _, op_type = label.rpartition(":")
                start = (session_start_ns + line.timestamp_ns) * 1000 + event.offset_ps
                events.append((node, op_type, start, start + event.duration_ps))
    events.sort(key=lambda e: e[2])
    return events


# --- allocator trace from TensorFlow's profiler ----------------------------------------------

def profile_allocations(run_step) -> List[Tuple[str, str, str, int, int, int, str]]:
    """Runs ``run_step()`` under TensorFlow's profiler and returns what the allocators handed out.

    The BFC allocator records a ``MemoryAllocation`` / ``MemoryDeallocation`` trace event per
    request while the profiler runs.

    Returns:
        ``(kind, op, region_type, requested_bytes, chunk_bytes, address, shape)`` per event in
        time order; ``kind`` is ``"alloc"`` or ``"free"``; ``op`` and ``region_type``
        (``"output"``, ``"temp"``, ...) are empty on frees.
    """
    space = _profiled_xspace(run_step)
    events = []
    for plane in space.planes:
        event_names, stat_names = plane.event_metadata, plane.stat_metadata
        for line in plane.lines:
            for event in line.events:
                label = event_names[event.metadata_id].name
                if label not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for stat in event.stats:
                    value = stat.str_value or stat.int64_value or stat.uint64_value
                    if stat.ref_value:
                        value = stat_names[stat.ref_value].name
                    stats[stat_names[stat.metadata_id].name] = value
                events.append((line.timestamp_ns * 1000 + event.offset_ps,
                               "alloc" if label == "MemoryAllocation" else "free", str(stats.get("tf_op") or ""),
                               str(stats.get("region_type") or ""), int(stats.get("requested_bytes") or 0),
                               int(stats.get("allocation_bytes") or 0), int(stats.get("addr") or 0),
                               str(stats.get("shape") or "")))
    events.sort(key=lambda e: e[0])
    return [e[1:] for e in events]


def onednn_enabled() -> bool:
    """Whether TensorFlow's CPU kernels are oneDNN's (``TF_ENABLE_ONEDNN_OPTS``; on by default on x86)."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())
