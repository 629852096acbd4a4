"""TensorFlow's profiler, read through its private trace format: executed ops and allocations.

Examples:
    >>> from lms_tf._compat import profiler
    >>> isinstance(profiler.onednn_enabled(), bool)
    True
"""

from __future__ import annotations

import glob
import os
import tempfile
from typing import List, Tuple

import tensorflow as tf

from lms_tf.core.errors import LMSError


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

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(tf.matmul(x, x)))
        >>> _ = f(tf.ones((8, 8)))
        >>> nodes = [event[0] for event in profile_executed_ops(lambda: f(tf.ones((8, 8))))]
        >>> nodes.index("MatMul") < nodes.index("Relu")
        True
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


def profile_allocations(run_step) -> List[Tuple[str, str, str, int, int, int, str]]:
    """Runs ``run_step()`` under TensorFlow's profiler and returns what the allocators handed out.

    The BFC allocator records a ``MemoryAllocation`` / ``MemoryDeallocation`` trace event per
    request while the profiler runs.

    Returns:
        ``(kind, op, region_type, requested_bytes, chunk_bytes, address, shape)`` per event in
        time order; ``kind`` is ``"alloc"`` or ``"free"``; ``op`` and ``region_type``
        (``"output"``, ``"temp"``, ...) are empty on frees.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.nn.relu(x) * 2.0)
        >>> _ = f(tf.ones((64, 64)))
        >>> events = profile_allocations(lambda: f(tf.ones((64, 64))))
        >>> isinstance(events, list)
        True
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
    """Whether TensorFlow's CPU kernels are oneDNN's (``TF_ENABLE_ONEDNN_OPTS``; on by default on x86).

    Examples:
        >>> onednn_enabled() in (True, False)
        True
    """
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())
