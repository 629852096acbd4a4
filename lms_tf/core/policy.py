"""Policy values: what the planner is asked to do, parsed and checked in one place.

A :class:`Policies` value holds the memory budget (bytes, a fraction of the plain step's peak,
or ``"auto"``), the swap rule (TFLMS's threshold, prefetch distance, grouping and minimum size),
the recompute policy (``"cheap"``, ``"sqrt"``, ``"auto"`` or named layers) and the exclusions.
The planner takes it with an IR and returns a :class:`~lms_tf.core.plan.Plan`; the front-ends'
keyword checker (:class:`lms_tf.LMSOptions`) builds it. Byte sizes and budgets are parsed here
for every front-end and the command line alike.

Examples:
    >>> policies = Policies(budget=parse_budget("25%"), recompute="auto")
    >>> policies.budget, resolve_budget(policies.budget, baseline_peak_bytes=400, memory_bytes=2**34,
    ...                                  device_name="v100", resident=0)
    (0.25, 100)
    >>> Policies.from_dict(policies.to_dict()) == policies
    True
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Tuple, Union

from lms_tf.core.errors import InfeasibleBudgetError, LMSOptionError, infeasible
from lms_tf.core.ir import canonical_device, device_kind_and_index

#: Recompute policies by name (a tuple of layer names / op-name patterns is the other kind).
RECOMPUTE_POLICIES = ("auto", "cheap", "sqrt")

#: Units a byte size may be written in, decimal and binary.
BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

#: ``budget="auto"`` leaves this fraction of device memory free (CUDA context, cuDNN
#: workspaces, allocator fragmentation), and at least :data:`SAFETY_MARGIN_MIN_BYTES`.
SAFETY_MARGIN_FRACTION = 0.10
SAFETY_MARGIN_MIN_BYTES = 512 * 2**20

Budget = Union[None, int, float, str]
Recompute = Union[bool, str, Tuple[str, ...]]


def describe(value: Any) -> str:
    """A value and its type, for error messages.

    Examples:
        >>> describe("12 gigs")
        "'12 gigs' (str)"
    """
    return f"{value!r} ({type(value).__name__})"


def parse_bytes(value: Any) -> Optional[int]:
    """A positive byte count from an int or text such as ``"12GiB"``, ``"500MB"`` or ``"1024"``; None if it is not one.

    Examples:
        >>> parse_bytes("1.5KiB"), parse_bytes(10), parse_bytes("ten"), parse_bytes(0)
        (1536, 10, None, None)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip().replace(" ", "")
    try:
        for unit in sorted(BYTE_UNITS, key=len, reverse=True):
            if text.endswith(unit) and len(text) > len(unit):
                count = float(text[: -len(unit)])
                return int(count * BYTE_UNITS[unit]) if count > 0 else None
        return int(text) if text.isdigit() and int(text) > 0 else None
    except ValueError:
        return None


def _non_positive_number(value: Any) -> bool:
    """Whether ``value`` reads as a number of bytes (with or without a unit) that is zero or negative."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value <= 0
    if not isinstance(value, str):
        return False
    text = value.strip().replace(" ", "")
    for unit in sorted(BYTE_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            text = text[: -len(unit)]
            break
    try:
        return float(text) <= 0
    except ValueError:
        return False


def format_bytes(nbytes: int) -> str:
    """A byte count in the largest binary unit that keeps it at 1 or more.

    Examples:
        >>> format_bytes(512), format_bytes(4 * 2**20), format_bytes(int(1.5 * 2**30))
        ('512 B', '4.0 MiB', '1.50 GiB')
    """
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    if nbytes >= 2**10:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes} B"


def parse_budget(value: Any) -> Budget:
    """Validates a memory budget: bytes, ``"12GiB"``-style text, ``"25%"`` of the plain peak, or ``"auto"``.

    Returns:
        None (no budget), an int (bytes), a float in (0, 1] (fraction of the plain step's
        simulated peak) or ``"auto"`` (device memory minus resident variables and a margin).

    Raises:
        LMSOptionError: The value is none of these; the message names the rule it broke.

    Examples:
        >>> parse_budget("12GiB"), parse_budget("25%"), parse_budget(1024), parse_budget("auto")
        (12884901888, 0.25, 1024, 'auto')
        >>> parse_budget("200%")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: budget must be at most 100% of the plain step's peak; received '200%' (str)...
    """
    if value is None or value == "auto":
        return value
    text = value.strip().replace(" ", "") if isinstance(value, str) else None
    if text is not None and text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = None
        if percent is not None and 0 < percent <= 100:
            return percent / 100.0
        if percent is not None:
            rule = "at most 100%" if percent > 100 else "> 0%"
            raise LMSOptionError(f"budget must be {rule} of the plain step's peak; received {describe(value)}. "
                                 f"Pass a percentage in (0, 100], e.g. budget='50%'.")
    nbytes = parse_bytes(value)
    if nbytes is not None:
        return nbytes
    if _non_positive_number(value):
        raise LMSOptionError(f"budget must be > 0; received {describe(value)}. Pass a size such as '12GiB', a "
                             f"percentage such as '50%', or 'auto'.")
    raise LMSOptionError(
        f"budget must be a positive number of bytes, a size like '12GiB' or '500MB', a percentage of the plain "
        f"step's peak like '25%' (0-100], or 'auto' (device memory minus weights, optimizer slots, the batch "
        f"and a safety margin); received {describe(value)}.")


def safety_margin_bytes(memory_bytes: int) -> int:
    """What ``budget="auto"`` leaves free on a device of ``memory_bytes``: the CUDA context,
    cuDNN/cuBLAS workspaces and allocator fragmentation (:data:`SAFETY_MARGIN_FRACTION`, at least
    :data:`SAFETY_MARGIN_MIN_BYTES`).

    Examples:
        >>> safety_margin_bytes(100 * 2**30) == int(SAFETY_MARGIN_FRACTION * 100 * 2**30)
        True
    """
    return max(SAFETY_MARGIN_MIN_BYTES, int(SAFETY_MARGIN_FRACTION * memory_bytes))


def resolve_budget(budget: Budget, *, baseline_peak_bytes: int, memory_bytes: int, device_name: str,
                   resident: int) -> int:
    """Turns a parsed budget (:func:`parse_budget`) into bytes.

    Args:
        budget: Bytes, a fraction of the plain peak, or ``"auto"``.
        baseline_peak_bytes: Simulated peak of the plain step.
        memory_bytes: The device's memory (for ``"auto"``).
        device_name: The device's name, for messages.
        resident: Bytes on the device for the whole step besides its tensors: the variables resident
            there (weights, optimizer slots) and the step's inputs (its batch).

    Raises:
        InfeasibleBudgetError: ``"auto"`` and the variables alone do not fit the device.

    Examples:
        >>> resolve_budget(0.25, baseline_peak_bytes=400, memory_bytes=2**34, device_name="v100", resident=0)
        100
    """
    if isinstance(budget, float):
        return int(budget * baseline_peak_bytes)
    if budget == "auto":
        margin = safety_margin_bytes(memory_bytes)
        available = memory_bytes - resident - margin
        if available <= 0:
            raise infeasible(
                f"budget='auto': the step's variables and inputs ({resident / 2**30:.2f} GiB) plus the safety margin "
                f"({margin / 2**30:.2f} GiB) do not fit {device_name} ({memory_bytes / 2**30:.2f} GiB). Use a "
                f"larger device, optimizer_on_host=True, or a smaller model.", 0, resident + margin)
        return available
    return int(budget)


#: Where ``weights=`` may put the variables: all on the device, all on the host, or each where
#: the budget planner puts it.
WEIGHT_PLACES = ("device", "host", "auto")


def parse_weights(value: Any) -> str:
    """Checks ``weights=``: ``"device"`` (variables resident), ``"host"`` (fetched per window) or
    ``"auto"`` (the budget planner chooses per variable).

    Examples:
        >>> parse_weights("auto")
        'auto'
        >>> parse_weights("cpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: weights must be 'device', 'host' or 'auto'; received 'cpu' (str)...
    """
    if value not in WEIGHT_PLACES:
        raise LMSOptionError(f"weights must be 'device', 'host' or 'auto'; received {describe(value)}. 'host' "
                             f"keeps the variables in host memory and copies each to the device just before the "
                             f"layers that read it; 'auto' moves only the variables the budget planner needs "
                             f"moved; 'device' (the default) keeps them on the device.")
    return value


def parse_recompute(value: Any) -> Recompute:
    """Validates a recompute policy: False, ``"auto"``, ``"cheap"``, ``"sqrt"`` or layer names / op patterns.

    Examples:
        >>> parse_recompute("sqrt"), parse_recompute(["conv2d_3", "*/block2_*"]), parse_recompute(None)
        ('sqrt', ('conv2d_3', '*/block2_*'), False)
    """
    if value is False or value is None:
        return False
    if isinstance(value, str) and value in RECOMPUTE_POLICIES:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise LMSOptionError(
        f"recompute must be False, 'auto', 'cheap', 'sqrt' or a non-empty list of layer names / op-name "
        f"patterns; received {describe(value)}. Example: recompute='sqrt' or recompute=['conv2d_3', '*/block2_*'].")


def parse_exclude(value: Any) -> Tuple[str, ...]:
    """Validates exclusions: layer names or op-name glob patterns whose tensors stay on the device.

    Examples:
        >>> parse_exclude("dense"), parse_exclude(["conv2d_1", "*/attention/*"])
        (('dense',), ('conv2d_1', '*/attention/*'))
    """
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(e, str) and e for e in value):
        raise LMSOptionError(
            f"exclude must be a list of layer names or op-name patterns (non-empty strings); "
            f"received {describe(value)}. Example: exclude=['conv2d_1', '*/attention/*'].")
    return tuple(value)


def check_int(name: str, value: Any, minimum: int) -> int:
    """An int of at least ``minimum``, or the library's error naming the rule.

    Examples:
        >>> check_int("swapin_ahead", 2, 1)
        2
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LMSOptionError(f"{name} must be an int >= {minimum}; received {describe(value)}. "
                             f"Pass for example {name}={max(minimum, 1)}.")
    return value


#: Bytes of gradients averaged by one allreduce in the data-parallel exchange (pipelined buckets).
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


def check_bucket_bytes(value: Any, api: str = "") -> Optional[int]:
    """A gradient bucket size in bytes (an int >= 1), or None for one allreduce after the whole backward pass.

    Examples:
        >>> check_bucket_bytes(1024, "DistributedCallback"), check_bucket_bytes(None, "DistributedCallback")
        (1024, None)
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise LMSOptionError(f"{api + ': ' if api else ''}bucket_bytes must be None or an int >= 1 (bytes per gradient bucket); "
                             f"received {describe(value)}. Example: bucket_bytes=4 * 1024 * 1024.")
    return value


def parse_host_budget(value: Any) -> Optional[int]:
    """Validates ``host_budget``: None (the machine's physical memory) or a positive size.

    Examples:
        >>> parse_host_budget("2GiB"), parse_host_budget(None)
        (2147483648, None)
        >>> parse_host_budget("lots")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: host_budget must be a positive size such as '64GiB' or a number of bytes...
    """
    if value is None:
        return None
    nbytes = parse_bytes(value)
    if nbytes is None:
        raise LMSOptionError(f"host_budget must be a positive size such as '64GiB' or a number of bytes (or None for "
                             f"the machine's physical memory); received {describe(value)}. With several processes "
                             f"on one machine (Horovod ranks, pipeline stages), pass each its share.")
    return nbytes


def machine_memory_bytes() -> Optional[int]:
    """This machine's physical memory, None where the OS does not say.

    Examples:
        >>> machine_memory_bytes() > 0
        True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@dataclasses.dataclass(frozen=True)
class Policies:
    """What the planner is asked to do with one step, checked when built.

    Args:
        host: Where swapped tensors live (a device string).
        swap: Whether the planner may swap at all.
        swapout_threshold: The TFLMS swap rule (without a budget): swap a forward tensor only if
            its first backward reader runs at least this many ops after its producer.
        swapin_ahead: A swap-in starts this many backward ops before its first reader.
        swapin_groupby: Backward readers within this many ops share one swap-in.
        min_swap_bytes: Tensors smaller than this are never swapped.
        recompute: ``False``, ``"cheap"``, ``"sqrt"``, ``"auto"`` (the budget planner picks) or
            layer names / op-name patterns to recompute.
        exclude: Layer names or op-name patterns whose tensors are never moved.
        budget: None (the TFLMS rule), bytes, a fraction of the plain peak, or ``"auto"``.
        weights: Where the variables live: ``"device"`` (resident, the default), ``"host"``
            (each device read is a copy fetched just before its window of readers) or ``"auto"``
            (needs a ``budget``: the optimizer's slots on the host, and each weight on the host
            only when the budget needs it, the fewest link seconds first).
        host_budget: Host memory one process's step may hold (bytes or ``"64GiB"``-style text):
            weights and slots on the host, swapped tensors, gradients copied out. None: the
            machine's physical memory (:func:`machine_memory_bytes`).

    Examples:
        >>> Policies(budget=0.5, recompute="auto").replace(swap=False).swap
        False
        >>> Policies(swapin_ahead=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: swapin_ahead must be an int >= 1; received 0 (int)...
    """

    host: str = "/device:CPU:0"
    swap: bool = True
    swapout_threshold: int = 32
    swapin_ahead: int = 8
    swapin_groupby: int = 4
    min_swap_bytes: int = 64 * 1024
    recompute: Recompute = False
    exclude: Tuple[str, ...] = ()
    budget: Budget = None
    weights: str = "device"
    host_budget: Optional[int] = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        if not isinstance(self.host, str) or not device_kind_and_index(self.host)[0]:
            raise LMSOptionError(f"host must be a device string such as '/CPU:0'; received {describe(self.host)}.")
        set_("host", canonical_device(self.host))
        if not isinstance(self.swap, bool):
            raise LMSOptionError(f"swap must be True or False; received {describe(self.swap)}.")
        check_int("swapout_threshold", self.swapout_threshold, 1)
        check_int("swapin_ahead", self.swapin_ahead, 1)
        check_int("swapin_groupby", self.swapin_groupby, 0)
        check_int("min_swap_bytes", self.min_swap_bytes, 0)
        set_("recompute", parse_recompute(self.recompute))
        set_("weights", parse_weights(self.weights))
        set_("host_budget", parse_host_budget(self.host_budget))
        set_("exclude", parse_exclude(self.exclude))
        # A fraction in (0, 1] is a budget parse_budget already turned "25%" into (a plan file keeps it so).
        if not (isinstance(self.budget, float) and 0 < self.budget <= 1):
            set_("budget", parse_budget(self.budget))

    def replace(self, **changes) -> "Policies":
        """A copy with some fields changed (and checked again).

        Examples:
            >>> Policies().replace(recompute="sqrt").recompute
            'sqrt'
        """
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The policies as plain JSON-serialisable data.

        Examples:
            >>> Policies(exclude=("dense",)).to_dict()["exclude"]
            ['dense']
        """
        return {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Policies":
        """Policies from :meth:`to_dict`'s data; unknown keys are an error.

        Examples:
            >>> Policies.from_dict({"recompute": ["conv2d"]}).recompute
            ('conv2d',)
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LMSOptionError(f"unknown policy fields {unknown}; known: {sorted(known)}.")
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()})


__all__ = ["BYTE_UNITS", "Budget", "InfeasibleBudgetError", "Policies", "RECOMPUTE_POLICIES", "check_int",
           "describe", "machine_memory_bytes", "parse_budget", "parse_bytes", "parse_exclude", "parse_host_budget",
           "parse_recompute", "resolve_budget"]
