"""Real allocator peak of a piece of work: what a training step really costs in memory.

On a GPU this reads the GPU allocator. On the CPU, TensorFlow keeps allocator statistics
only when its CPU allocator is a BFC allocator: set ``TF_CPU_ALLOCATOR_USE_BFC=true``
before TensorFlow starts (the tests and benchmarks do).

Examples:
    >>> import tensorflow as tf
    >>> with measure_peak_memory("CPU:0") as memory:
    ...     _ = tf.ones((1024, 1024)) * 2.0
    >>> memory.peak_bytes >= 4 * 1024 * 1024
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Iterator, Optional

import tensorflow as tf

from lms_tf.core.errors import LMSError

logger = logging.getLogger("lms_tf")


@dataclasses.dataclass
class PeakMemory:
    """Allocator figures of one measured block.

    Attributes:
        device: The device measured, e.g. ``"GPU:0"``.
        start_bytes: Bytes in use when the block started (weights, optimizer slots, data).
        peak_bytes: Peak bytes in use during the block, above ``start_bytes``.

    Examples:
        >>> PeakMemory("CPU:0", 100, 50).peak_total_bytes
        150
    """

    device: str
    start_bytes: int = 0
    peak_bytes: int = 0

    @property
    def peak_total_bytes(self) -> int:
        """Peak bytes in use including what was resident at the start.

        Examples:
            >>> PeakMemory("CPU:0", 1, 2).peak_total_bytes
            3
        """
        return self.start_bytes + self.peak_bytes


def default_device() -> str:
    """The first GPU if there is one, else ``"CPU:0"``.

    Examples:
        >>> default_device() in ("CPU:0", "GPU:0")
        True
    """
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


@contextlib.contextmanager
def measure_peak_memory(device: Optional[str] = None, settle_seconds: float = 0.0) -> Iterator[PeakMemory]:
    """Measures the allocator peak of the block: resets the peak, runs it, reads the peak.

    Make sure the block's work has finished before it ends (e.g. call ``.numpy()`` on
    the step's result).

    Args:
        device: ``"GPU:0"``, ``"CPU:0"``...; default: first GPU, else the CPU.
        settle_seconds: Wait this long before resetting the peak. A step's result can be
            back before all of its tensors are freed; measuring steps back to back then counts
            the previous step's leftovers (0.3 s settles a ResNet-50 step on a CPU).

    Yields:
        A :class:`PeakMemory`, filled in when the block ends.

    Raises:
        LMSError: The allocator of ``device`` keeps no statistics (on the CPU: the
            ``TF_CPU_ALLOCATOR_USE_BFC=true`` environment variable was not set before
            TensorFlow started).

    Examples:
        >>> with measure_peak_memory() as memory:
        ...     _ = tf.zeros((256, 256)).numpy()
        >>> memory.peak_bytes > 0
        True
        >>> with measure_peak_memory(settle_seconds=0.01) as settled:
        ...     _ = tf.ones((128, 128)).numpy()
        >>> settled.peak_bytes >= 128 * 128 * 4
        True
    """
    device = device or default_device()
    if settle_seconds:
        time.sleep(settle_seconds)
    try:
        tf.config.experimental.reset_memory_stats(device)
        start = tf.config.experimental.get_memory_info(device)["current"]
    except ValueError as err:
        hint = (" On the CPU, TensorFlow keeps allocator statistics only with its BFC allocator: set the "
                "environment variable TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported."
                if device.upper().startswith("CPU") else "")
        raise LMSError(f"cannot measure memory on {device!r}: {err}.{hint}") from None
    result = PeakMemory(device=device, start_bytes=start)
    yield result
    result.peak_bytes = tf.config.experimental.get_memory_info(device)["peak"] - start
