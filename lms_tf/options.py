"""User options of the swap pass, validated when they are constructed.

Example:
    >>> from lms_tf.options import LMSOptions
    >>> LMSOptions(host="/CPU:0", swapin_ahead=2).swapin_ahead
    2
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Optional, Tuple, Union

from lms_tf.errors import LMSOptionError

_DEVICE_TYPES = ("CPU", "GPU", "TPU")


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LMSOptionError(
            f"{name} must be an int >= {minimum}; received {_describe(value)}. "
            f"Pass for example {name}={max(minimum, 1)}."
        )
    return value


def _check_device(name: str, value: Any) -> str:
    """Returns the device string in canonical form (``/device:GPU:0``)."""
    if not isinstance(value, str) or not value.strip():
        raise LMSOptionError(
            f"{name} must be a device string such as '/GPU:0' or '/CPU:0'; received {_describe(value)}."
        )
    import tensorflow as tf  # Local import: options must stay cheap to import.

    try:
        spec = tf.DeviceSpec.from_string(value)
    except (ValueError, TypeError) as err:
        raise LMSOptionError(
            f"{name}={value!r} is not a TensorFlow device string ({err}); use e.g. '/GPU:0' or '/CPU:1'."
        ) from None
    if spec.device_type is None or spec.device_type.upper() not in _DEVICE_TYPES:
        raise LMSOptionError(
            f"{name}={value!r} names no device type; use '/GPU:<index>' or '/CPU:<index>'."
        )
    spec = spec.replace(device_type=spec.device_type.upper(), device_index=spec.device_index or 0)
    return spec.to_string()


RECOMPUTE_POLICIES = ("auto", "cheap", "sqrt")

_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _check_recompute(value: Any):
    if value is False or value is None:
        return False
    if isinstance(value, str) and value in RECOMPUTE_POLICIES:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise LMSOptionError(
        f"recompute must be False, 'auto', 'cheap', 'sqrt' or a non-empty list of layer names / op-name "
        f"patterns; received {_describe(value)}. Example: recompute='sqrt' or recompute=['conv2d_3', '*/block2_*'].")


def _preset_names():
    from lms_tf.cost.devices import PRESETS

    return PRESETS


def parse_budget(value: Any) -> Union[None, int, float, str]:
    """Validates a memory budget: bytes, ``"12GiB"``-style text, ``"25%"`` of the plain peak, or ``"auto"``.

    Returns:
        None (no budget), an int (bytes), a float in (0, 1] (fraction of the plain step's
        simulated peak) or ``"auto"`` (device memory minus resident variables and a margin).

    Raises:
        LMSOptionError: The value is none of these.

    Example:
        >>> parse_budget("12GiB"), parse_budget("25%"), parse_budget(1024), parse_budget("auto")
        (12884901888, 0.25, 1024, 'auto')
        >>> parse_budget("12 gigs")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.errors.LMSOptionError: budget must be ...
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        try:
            if text.endswith("%"):
                percent = float(text[:-1])
                if 0 < percent <= 100:
                    return percent / 100.0
            else:
                for unit in sorted(_BYTE_UNITS, key=len, reverse=True):
                    if text.endswith(unit) and float(text[: -len(unit)]) > 0:
                        return int(float(text[: -len(unit)]) * _BYTE_UNITS[unit])
                if text.isdigit() and int(text) > 0:
                    return int(text)
        except ValueError:
            pass
    raise LMSOptionError(
        f"budget must be a positive number of bytes, a size like '12GiB' or '500MB', a percentage of the plain "
        f"step's peak like '25%' (0-100], or 'auto' (device memory minus weights, optimizer slots and a safety "
        f"margin); received {_describe(value)}.")


@dataclasses.dataclass(frozen=True)
class LMSOptions:
    """Options of the lms-tf swap pass (TFLMS semantics), checked at construction.

    Args:
        device: The accelerator whose memory is managed, e.g. ``"/GPU:0"``. ``None``
            means the first GPU; with no GPU the step is left untouched (a warning says so).
        host: Where swapped tensors live, ``"/CPU:0"`` by default.
        swapout_threshold: Swap a forward tensor only if its first backward consumer
            runs at least this many ops after its producer in execution order.
        swapin_ahead: The swap-in is triggered this many backward ops before the
            first consumer, so the copy back overlaps the ops in between.
        swapin_groupby: Backward consumers of one tensor that lie within this many
            ops of each other share one swap-in.
        min_swap_bytes: Tensors smaller than this are never swapped.
        exclude: Layer names (e.g. ``"conv2d_1"``) or op-name glob patterns
            (e.g. ``"*/attention/*"``) whose tensors are never swapped. An entry
            that matches nothing in the traced step is an error.
        batch_size: Size of a batch dimension that the traced step leaves unknown
            (``None`` in the input signature). Only needed when lms-tf cannot
            resolve it from the traced inputs itself.
        swap: Whether to swap at all. ``swap=False`` with a ``recompute`` policy
            recomputes only, which also works when the only device is the CPU
            (``device="/CPU:0"``).
        recompute: ``False`` (default), ``"cheap"`` (recompute outputs of cheap op
            types, see ``lms_tf.planner.CHEAP_OP_TYPES``), ``"sqrt"`` (keep every
            ceil(sqrt(n))-th activation as a checkpoint and recompute the rest, Chen et
            al. 2016), or a list of layer names / op-name patterns to recompute.
        optimizer_on_host: Keep the optimizer's slot variables (e.g. Adam's two moments)
            and its update ops on ``host`` (KARMA, ZeRO-Offload): gradients travel to the
            host, the update runs there, and only the new weights come back. The optimizer
            must not have been built before the first traced step (its slots would already
            live on the device; a warning says so).
        horovod: Only for :func:`lms_tf.function`: average every gradient across Horovod
            ranks between the gradient and the optimizer update (pipelined in buckets, see
            :mod:`lms_tf.horovod`) and broadcast the variables from rank 0 before the first
            step. ``model.fit`` uses :class:`lms_tf.horovod.DistributedCallback` instead.
        budget: Device memory the step's tensors may use; the planner then decides KEEP /
            SWAP / RECOMPUTE per tensor so the simulated peak fits at the least predicted
            slowdown. Bytes, ``"12GiB"``, ``"25%"`` (of the plain step's simulated peak) or
            ``"auto"`` (device memory minus resident variables and a safety margin).
            ``swapout_threshold`` is then the planner's business and ignored.
        device_spec: The device the planner models: a preset name (``lms_tf.cost.PRESETS``,
            e.g. ``"v100-16gb-pcie3"``), ``"auto"`` (the visible GPU; the default) or an
            :class:`lms_tf.cost.DeviceSpec`.
        serialize: Run the step's compute ops one at a time
            in the simulator's order (control edges; TFLMS's "serialization"), so the real
            peak follows the simulated one. It costs inter-op parallelism. lms-tf uses it to
            check its simulator on a CPU (:mod:`lms_tf.rewrite.serialize`).

    With a ``budget``, ``recompute`` left unset means ``"auto"`` (the planner may recompute),
    ``recompute=False`` means swap only, and a list of names forces those layers to be
    recomputed; ``exclude`` names layers the planner must keep.

    Example:
        >>> opts = LMSOptions(device="/GPU:0", swapin_ahead=2, exclude=("dense",))
        >>> opts.device, opts.exclude
        ('/device:GPU:0', ('dense',))
    """

    device: Optional[str] = None
    host: str = "/CPU:0"
    swapout_threshold: int = 32
    swapin_ahead: int = 8
    swapin_groupby: int = 4
    min_swap_bytes: int = 64 * 1024
    exclude: Tuple[str, ...] = ()
    batch_size: Optional[int] = None
    swap: bool = True
    recompute: Union[bool, str, Tuple[str, ...]] = False
    optimizer_on_host: bool = False
    horovod: bool = False
    budget: Union[None, int, float, str] = None
    device_spec: Any = None
    serialize: bool = False

    def __init__(self, *, device=None, host="/CPU:0", swapout_threshold=32, swapin_ahead=8,
                 swapin_groupby=4, min_swap_bytes=64 * 1024, exclude=(), batch_size=None, swap=True,
                 recompute=None, optimizer_on_host=False, horovod=False, budget=None, device_spec=None,
                 serialize=False):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass init
        set_("device", None if device is None else _check_device("device", device))
        set_("host", _check_device("host", host))
        set_("swapout_threshold", _check_int("swapout_threshold", swapout_threshold, 1))
        set_("swapin_ahead", _check_int("swapin_ahead", swapin_ahead, 1))
        set_("swapin_groupby", _check_int("swapin_groupby", swapin_groupby, 0))
        set_("min_swap_bytes", _check_int("min_swap_bytes", min_swap_bytes, 0))
        if isinstance(exclude, str):
            exclude = (exclude,)
        if not isinstance(exclude, (list, tuple, set, frozenset)) or not all(
            isinstance(e, str) and e for e in exclude
        ):
            raise LMSOptionError(
                f"exclude must be a list of layer names or op-name patterns (non-empty strings); "
                f"received {_describe(exclude)}. Example: exclude=['conv2d_1', '*/attention/*']."
            )
        set_("exclude", tuple(exclude))
        if batch_size is not None:
            _check_int("batch_size", batch_size, 1)
        set_("batch_size", batch_size)
        if not isinstance(swap, bool):
            raise LMSOptionError(f"swap must be True or False; received {_describe(swap)}.")
        set_("swap", swap)
        set_("budget", parse_budget(budget))
        recompute = _check_recompute(recompute if recompute is not None else ("auto" if self.budget else False))
        if recompute == "auto" and self.budget is None:
            set_("budget", "auto")
        set_("recompute", recompute)
        if device_spec is not None and device_spec != "auto":
            from lms_tf.cost.devices import get_device_spec

            device_spec = get_device_spec(device_spec)
            device_spec = device_spec.name if device_spec.name in _preset_names() else device_spec
        set_("device_spec", device_spec)
        for name, value in (("optimizer_on_host", optimizer_on_host), ("horovod", horovod),
                            ("serialize", serialize)):
            if not isinstance(value, bool):
                raise LMSOptionError(f"{name} must be True or False; received {_describe(value)}.")
            set_(name, value)
        if not swap and not self.recompute and not optimizer_on_host and not horovod and not serialize:
            raise LMSOptionError(
                "swap=False and recompute=False leave nothing to do; pass recompute='sqrt' or 'cheap' "
                "(or a list of layer names) to recompute, optimizer_on_host=True, serialize=True, or "
                "leave swap=True.")
        if (self.swap or optimizer_on_host) and self.device is not None and self.device == self.host:
            raise LMSOptionError(
                f"device and host are the same device ({self.device}); swapping to the device "
                f"itself saves nothing. Use host='/CPU:0' (default) with device='/GPU:0'."
            )

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], api: str) -> "LMSOptions":
        """Builds options from keyword arguments, rejecting unknown names with a suggestion.

        Args:
            kwargs: Keyword arguments given to a front-end.
            api: The front-end's name, used in error messages.

        Returns:
            The validated options.

        Raises:
            LMSOptionError: An unknown keyword or a bad value.

        Example:
            >>> LMSOptions.from_kwargs({"swapin_ahead": 3}, api="LMSCallback").swapin_ahead
            3
        """
        known = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise LMSOptionError(
                    f"{api} got an unknown option {key!r}.{hint} Valid options: {', '.join(known)}."
                )
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """Returns the options as a plain dict (JSON-serialisable).

        Example:
            >>> LMSOptions().to_dict()["host"]
            '/device:CPU:0'
        """
        out = {f.name: (list(v) if isinstance(v, tuple) else v)
               for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}
        if out["device_spec"] is not None and not isinstance(out["device_spec"], str):
            out["device_spec"] = out["device_spec"].name
        return out
