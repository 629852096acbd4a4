"""Pipeline stages in separate processes, on TensorFlow's own distributed runtime.

Each stage is one task of a ``worker`` job: task 0 is the process that builds and runs the step
(it serves task 0 itself once connected), and every other task is a process running
:func:`serve_stage` (``lms-tf stage-server``). :func:`connect_stages` connects the building
process to the cluster and returns one device per stage for
:class:`~lms_tf.tf.pipeline_step.PipelineStep`; TensorFlow then places each stage's ops on its
task and sends activations and gradients between the tasks itself. Each process has its own
allocator, so each stage's memory is its own process's.

Examples:
    >>> stage_devices(["localhost:2222", "localhost:2223"])
    ['/job:worker/replica:0/task:0/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:0']
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import Callable, List, Optional, Sequence

from lms_tf.core.errors import LMSError, LMSOptionError

logger = logging.getLogger("lms_tf")

#: The job every stage's task belongs to.
JOB = "worker"
#: Where ``connect_stages()`` finds the stage addresses when given none (``lms-tf launch`` sets it).
WORKERS_VARIABLE = "LMS_TF_WORKERS"
#: Where ``connect_stages()`` finds how many logical CPUs each process has (``lms-tf launch --logical-cpus``).
LOGICAL_CPUS_VARIABLE = "LMS_TF_LOGICAL_CPUS"


def check_workers(workers: Sequence[str]) -> List[str]:
    """Checks the ``host:port`` list of the stage processes (task 0 first).

    Raises:
        LMSOptionError: An address that is not ``host:port`` with a port in 1-65535, a repeated
            address, or fewer than one.

    Examples:
        >>> check_workers("localhost:2222, localhost:2223")
        ['localhost:2222', 'localhost:2223']
    """
    if isinstance(workers, str):
        workers = [w.strip() for w in workers.split(",") if w.strip()]
    workers = list(workers)
    if not workers:
        raise LMSOptionError("a pipeline cluster needs at least one worker address (host:port, task 0 first).")
    for address in workers:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LMSOptionError(f"worker address {address!r} is not host:port (e.g. localhost:2222).")
    repeated = sorted({w for w in workers if workers.count(w) > 1})
    if repeated:
        raise LMSOptionError(f"worker address(es) {', '.join(repeated)} appear more than once: one process per stage.")
    return workers


def stage_devices(workers: Sequence[str], device_type: str = "CPU") -> List[str]:
    """The device of each stage's task, in stage order.

    Examples:
        >>> stage_devices(["a:1"], device_type="GPU")
        ['/job:worker/replica:0/task:0/device:GPU:0']
    """
    return [f"/job:{JOB}/replica:0/task:{k}/device:{device_type}:0" for k in range(len(check_workers(workers)))]


def _cluster(workers: Sequence[str]):
    import tensorflow as tf

    return tf.train.ClusterSpec({JOB: list(workers)})


def check_logical_cpus(count) -> int:
    """Checks a number of logical CPU devices per process (1: the CPU as it is).

    Raises:
        LMSOptionError: Not a whole number of at least 1.

    Examples:
        >>> check_logical_cpus(2)
        2
        >>> check_logical_cpus("two")
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: logical CPUs must be a whole number of at least 1 (2 lets a stage on CPU:0 swap to CPU:1 on a machine without GPUs); received 'two'.
    """
    try:
        number = int(count)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(count, bool) or str(number) != str(count).strip():
        raise LMSOptionError(f"logical CPUs must be a whole number of at least 1 (2 lets a stage on CPU:0 swap to "
                             f"CPU:1 on a machine without GPUs); received {count!r}.")
    return number


def _trace_path(directory: str, index: int, until_stdin_closes: bool) -> str:
    """Where stage ``index`` writes its allocator trace, checked before the server starts.

    Examples:
        >>> _trace_path("/tmp", 1, until_stdin_closes=False)
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: stage-server --memory-trace /tmp needs --until-stdin-closes: the trace is written when the stage stops, and without it the stage serves until it is killed.
    """
    if not until_stdin_closes:
        raise LMSOptionError(f"stage-server --memory-trace {directory} needs --until-stdin-closes: the trace is "
                             f"written when the stage stops, and without it the stage serves until it is killed.")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise LMSOptionError(f"stage-server --memory-trace {directory}: cannot create that directory ({err}); "
                             f"give a directory this process can write.") from None
    if not os.access(directory, os.W_OK):
        raise LMSOptionError(f"stage-server --memory-trace {directory}: the directory is not writable; give one "
                             f"this process can write.")
    return os.path.join(directory, f"stage{index}.json")


def _write_memory_trace(serve: Callable[[], None], path: str, index: int) -> None:
    """Runs ``serve`` under TensorFlow's profiler, then writes the allocator's events to ``path``
    and logs the largest buffers live at the traced peak."""
    import dataclasses
    import json

    from lms_tf.tf.diagnostics import allocation_trace, live_at_allocator_peak

    events = allocation_trace(serve)
    with open(path, "w") as out:
        json.dump([dataclasses.asdict(e) for e in events], out)
    if not events:
        logger.warning("pipeline stage %d: the memory trace in %s is empty: TensorFlow's allocator recorded no "
                       "request. On a CPU it records them only with TF_CPU_ALLOCATOR_USE_BFC=true set before the "
                       "stage starts.", index, path)
        return
    peak, live = live_at_allocator_peak(events)
    largest = sorted(live, key=lambda e: -e.chunk_bytes)[:8]
    logger.info("pipeline stage %d: memory trace of %d allocator events in %s; traced peak %d bytes, largest "
                "live: %s", index, len(events), path, peak,
                "; ".join(f"{e.op or '(received or untraced)'} {e.region_type} {e.shape} {e.chunk_bytes}"
                          for e in largest))


def serve_stage(workers: Sequence[str], index: int, *, until_stdin_closes: bool = False,
                logical_cpus: int = 1, memory_trace: Optional[str] = None) -> None:
    """Runs the server of stage ``index`` (``index >= 1``; task 0 is the process that runs the
    step) until the process is stopped, or with ``until_stdin_closes`` until its standard input
    closes: how ``lms-tf launch`` ties a stage to itself, also over ssh (the remote command's
    input closes with the connection), and even when the launcher is killed.

    Args:
        workers: Every stage process's ``host:port``, task 0 first.
        index: This stage's task.
        until_stdin_closes: Stop when standard input closes.
        logical_cpus: CPU devices the server has (``CPU:0`` to ``CPU:<n-1>``, one allocator
            between them): with 2, a stage on ``CPU:0`` can swap to ``CPU:1`` on a machine
            without GPUs, which checks the rewrite across processes (no bytes move).
        memory_trace: A directory: the server records every request to its allocator under
            TensorFlow's profiler over its life, writes them to ``stage<index>.json`` there
            when it stops (one :class:`~lms_tf.tf.diagnostics.AllocationEvent` per entry), and
            logs the largest buffers live at its peak. Needs ``until_stdin_closes`` (the stage
            must stop for the trace to be written) and, on a CPU, ``TF_CPU_ALLOCATOR_USE_BFC=true``
            (without it the CPU allocator records nothing).

    Raises:
        LMSOptionError: Bad addresses, an index that is not one of the other tasks, a bad
            ``logical_cpus``, or a ``memory_trace`` that cannot be written or has no end.

    Examples:
        >>> serve_stage(["localhost:2222", "localhost:2223"], 0)
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: stage-server --index must be 1-1 (task 0 is the process that builds and runs the step, and serves itself); got 0.
    """
    workers = check_workers(workers)
    if len(workers) < 2:
        raise LMSOptionError(f"stage-server serves stage 1 and up of a pipeline of two or more; --workers names "
                             f"one ({workers[0]}), the training script's own.")
    if not 1 <= index < len(workers):
        raise LMSOptionError(f"stage-server --index must be 1-{len(workers) - 1} (task 0 is the process that builds "
                             f"and runs the step, and serves itself); got {index}.")
    logical_cpus = check_logical_cpus(logical_cpus)
    if memory_trace is not None:
        memory_trace = _trace_path(memory_trace, index, until_stdin_closes)
    import tensorflow as tf

    # A server builds its devices from its own configuration, not from this process's logical
    # device settings: the CPU count is asked for there.
    config = tf.compat.v1.ConfigProto(device_count={"CPU": logical_cpus}) if logical_cpus > 1 else None
    server = tf.distribute.Server(_cluster(workers), job_name=JOB, task_index=index, protocol="grpc", config=config)
    logger.info("pipeline stage %d of %d serving at %s", index, len(workers), workers[index])
    if not until_stdin_closes:
        server.join()
        return
    from lms_tf.tf.memory import default_device

    device = default_device()
    try:  # the peak reported at the end is the steps', not the server's start-up
        tf.config.experimental.reset_memory_stats(device)
    except ValueError:
        pass

    def serve_until_stdin_closes():
        while sys.stdin.buffer.read1(4096):
            pass

    if memory_trace is None:
        serve_until_stdin_closes()
    else:
        _write_memory_trace(serve_until_stdin_closes, memory_trace, index)
    try:  # the stage's own allocator (on a CPU, TensorFlow keeps statistics with TF_CPU_ALLOCATOR_USE_BFC=true)
        memory = tf.config.experimental.get_memory_info(device)
        logger.info("pipeline stage %d: allocator peak %d bytes, %d in use", index, memory["peak"], memory["current"])
    except ValueError:
        pass
    logger.info("pipeline stage %d: standard input closed, stopping", index)
    # TensorFlow's Python server has no stop: leave at once.
    logging.shutdown()
    os._exit(0)


def wait_for_workers(workers: Sequence[str], timeout: float) -> None:
    """Waits until every other task's address accepts a connection, at most ``timeout`` seconds.

    Raises:
        LMSError: A task does not answer in time (named, with how to start it).

    Examples:
        >>> wait_for_workers(["localhost:1"], timeout=1.0)   # task 0 is this process: nothing to wait for
    """
    deadline = time.monotonic() + timeout
    for k, address in enumerate(workers[1:], start=1):
        host, _, port = address.rpartition(":")
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    break
            except OSError as err:
                if time.monotonic() >= deadline:
                    raise LMSError(
                        f"pipeline stage {k} at {address} did not answer within {timeout:.0f} s ({err}). Start it "
                        f"first: lms-tf stage-server --workers {','.join(workers)} --index {k}") from None
                time.sleep(0.2)


def _split_cpu(tf, count: int) -> None:
    """Gives this process ``count`` logical CPUs, unless it already has as many."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) >= count:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:
        raise LMSOptionError(f"connect_stages(logical_cpus={count}): TensorFlow already started in this process with "
                             f"{len(tf.config.list_logical_devices('CPU'))} CPU device(s), and logical devices can "
                             f"only be made before it starts. Call connect_stages() before any TensorFlow op, or "
                             f"split the CPU yourself first (tf.config.set_logical_device_configuration).") from None


def connect_stages(workers: Optional[Sequence[str]] = None, *, timeout: float = 60.0,
                   device_type: str = "CPU", logical_cpus: Optional[int] = None) -> List[str]:
    """Connects this process (task 0) to the stage processes; returns each stage's device.

    Args:
        workers: Every stage process's ``host:port``, task 0 (this process) first. Default: the
            ``LMS_TF_WORKERS`` environment variable, which ``lms-tf launch`` sets.
        timeout: Seconds to wait for the other tasks to answer.
        device_type: ``"CPU"`` or ``"GPU"``: the device of each task a stage runs on.
        logical_cpus: Split this process's CPU into this many logical devices first, as the
            stage servers were (``lms-tf stage-server --logical-cpus``). Default: the
            ``LMS_TF_LOGICAL_CPUS`` environment variable (``lms-tf launch --logical-cpus`` sets
            it), else the CPU as it is. A split this process already made is kept if it has at
            least as many.

    Returns:
        One device name per stage, for ``PipelineStep(..., devices=...)``.

    Raises:
        LMSOptionError: Bad addresses or ``logical_cpus``, or logical CPUs asked for after
            TensorFlow started without them.
        LMSError: A task that does not answer within ``timeout``.

    Examples:
        >>> connect_stages("nonsense")
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: worker address 'nonsense' is not host:port (e.g. localhost:2222).
    """
    if workers is None:
        workers = os.environ.get(WORKERS_VARIABLE)
        if not workers:
            raise LMSOptionError(f"connect_stages() was given no workers and {WORKERS_VARIABLE} is not set: pass "
                                 f"the stage addresses (task 0 first), or run the script under "
                                 f"lms-tf launch --stages K -- python your_script.py")
    workers = check_workers(workers)
    if logical_cpus is None:
        logical_cpus = os.environ.get(LOGICAL_CPUS_VARIABLE) or 1
    logical_cpus = check_logical_cpus(logical_cpus)
    wait_for_workers(workers, timeout)
    import tensorflow as tf

    if logical_cpus > 1:
        _split_cpu(tf, logical_cpus)

    tf.config.experimental_connect_to_cluster(_cluster(workers), job_name=JOB, task_index=0, protocol="grpc")
    logger.info("connected to %d pipeline stage processes", len(workers))
    return stage_devices(workers, device_type)
