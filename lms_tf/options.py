"""The front-ends' keyword checker: every option of ``LMSCallback`` and ``lms_tf.function``, checked
when constructed, and the :class:`~lms_tf.core.policy.Policies` value the planner is given.

Examples:
    >>> from lms_tf.options import LMSOptions
    >>> LMSOptions(host="/CPU:0", swapin_ahead=2).swapin_ahead
    2
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Mapping, Optional, Tuple, Union

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.plan import Plan
from lms_tf.core.policy import (
    DEFAULT_BUCKET_BYTES,
    Policies,
    check_bucket_bytes,
    check_int,
    describe,
    parse_budget,
    parse_exclude,
    parse_host_budget,
    parse_recompute,
    parse_weights,
)

#: Where ``average_on`` may put the gradient average (see :class:`LMSOptions`).
AVERAGE_PLACES = ("auto", "device", "host")

_UNSET = object()  # bucket_bytes not given: its default, and no complaint without horovod=True

_DEVICE_TYPES = ("CPU", "GPU", "TPU")


def _check_device(name: str, value: Any) -> str:
    """Returns the device string in canonical form (``/device:GPU:0``)."""
    if not isinstance(value, str) or not value.strip():
        raise LMSOptionError(
            f"{name} must be a device string such as '/GPU:0' or '/CPU:0'; received {describe(value)}."
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


def _load_plan(value: Any) -> Optional[Plan]:
    """A plan from a Plan or the path of its JSON, read now so a bad file fails before any tracing."""
    if value is None or isinstance(value, Plan):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise LMSOptionError(f"plan must be an lms_tf.Plan or the path of its JSON file; received {describe(value)}.")
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise LMSOptionError(f"plan={str(value)!r} cannot be read ({err.strerror}); pass the path of a JSON file "
                             f"that `lms-tf plan ... --out` or Plan.to_json() wrote.") from None
    return Plan.from_json(text)


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
            types, see ``lms_tf.core.op_kinds.CHEAP_OP_TYPES``), ``"sqrt"`` (keep every
            ceil(sqrt(n))-th activation as a checkpoint and recompute the rest, Chen et
            al. 2016), or a list of layer names / op-name patterns to recompute.
        optimizer_on_host: Keep the optimizer's slot variables (e.g. Adam's two moments)
            and its update ops on ``host`` (KARMA, ZeRO-Offload): gradients travel to the
            host, the update runs there, and only the new weights come back. The optimizer
            must not have been built before the first traced step (its slots would already
            live on the device; a warning says so).
        weights: ``"device"`` (default: the variables stay resident on the device) or ``"host"``
            (KARMA, ZeRO-Offload): the model's variables and the optimizer's live in host memory,
            each is copied to the device just before each window of ops that read it (its forward
            layer, its gradient ops) and freed after, and the optimizer update runs on the host
            (``optimizer_on_host`` is implied). The variables are moved to ``host`` before the
            first traced step.
        average_on: With Horovod and the update on the host (``optimizer_on_host`` or weights on
            the host): where the gradients are averaged across ranks. ``"device"``: before they
            move to the host; ``"host"``: after they moved; ``"auto"`` (default): where the cost
            model of ``device_spec`` says it costs less (:meth:`lms_tf.cost.CostModel.gradient_averaging`:
            on PCIe cards the devices' allreduce crosses the link the copies use; NVLink does not).
            Without a device spec to compare (no GPU and no ``device_spec``) ``"auto"`` averages
            on the device, and says so in the log.
        host_budget: Host memory this process's planned step may hold at once (bytes or
            ``"64GiB"``): weights and optimizer slots on the host, swapped tensors, gradients
            copied out, the update's temporaries there. A plan that needs more raises :class:`lms_tf.HostBudgetError` naming both
            figures. None (default): the machine's physical memory; with several processes on
            one machine (Horovod ranks), pass each its share.
        horovod: Only for :func:`lms_tf.function`: average every gradient across Horovod
            ranks between the gradient and the optimizer update (pipelined in buckets, see
            :mod:`lms_tf.horovod`) and broadcast the variables from rank 0 before the first
            step. ``model.fit`` uses :class:`lms_tf.keras.DistributedCallback` instead.
        bucket_bytes: With ``horovod=True``: bytes of gradients per allreduce, in the order the
            backward pass makes them (4 MiB by default); ``None`` for one allreduce after the whole
            backward pass. The same argument as ``DistributedCallback(bucket_bytes=...)``.
        budget: Device memory the step's tensors may use; the planner then decides KEEP /
            SWAP / RECOMPUTE per tensor so the simulated peak fits at the least predicted
            slowdown. Bytes, ``"12GiB"``, ``"25%"`` (of the plain step's simulated peak) or
            ``"auto"`` (device memory minus resident variables and a safety margin).
            ``swapout_threshold`` is then the planner's business and ignored.
        device_spec: The device the planner models: a preset name (``lms_tf.cost.PRESETS``,
            e.g. ``"v100-16gb-pcie3"``), ``"auto"`` (the visible GPU; the default) or an
            :class:`lms_tf.cost.DeviceSpec`.
        plan: A plan to apply instead of planning: a :class:`~lms_tf.Plan` or the path of its JSON
            (``lms-tf plan ... --out plan.json``, or ``Plan.to_json()``), possibly edited. It is
            checked against the traced step; a plan made for another step is an error.
        serialize: Run the step's compute ops one at a time
            in the simulator's order (control edges; TFLMS's "serialization"), so the real
            peak follows the simulated one. It costs inter-op parallelism. lms-tf uses it to
            check its simulator on a CPU (:mod:`lms_tf.tf.rewrite.serialize`).

    With a ``budget``, ``recompute`` left unset means ``"auto"`` (the planner may recompute),
    ``recompute=False`` means swap only, and a list of names forces those layers to be
    recomputed; ``exclude`` names layers the planner must keep.

    Examples:
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
    bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES
    budget: Union[None, int, float, str] = None
    device_spec: Any = None
    serialize: bool = False
    plan: Optional[Plan] = None
    weights: str = "device"
    host_budget: Optional[int] = None
    average_on: str = "auto"

    def __init__(self, *, device=None, host="/CPU:0", swapout_threshold=32, swapin_ahead=8,
                 swapin_groupby=4, min_swap_bytes=64 * 1024, exclude=(), batch_size=None, swap=True,
                 recompute=None, optimizer_on_host=False, horovod=False, bucket_bytes=_UNSET, budget=None, device_spec=None,
                 serialize=False, plan=None, weights="device", host_budget=None, average_on="auto"):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass init
        set_("device", None if device is None else _check_device("device", device))
        set_("host", _check_device("host", host))
        set_("swapout_threshold", check_int("swapout_threshold", swapout_threshold, 1))
        set_("swapin_ahead", check_int("swapin_ahead", swapin_ahead, 1))
        set_("swapin_groupby", check_int("swapin_groupby", swapin_groupby, 0))
        set_("min_swap_bytes", check_int("min_swap_bytes", min_swap_bytes, 0))
        set_("exclude", parse_exclude(exclude))
        if batch_size is not None:
            check_int("batch_size", batch_size, 1)
        set_("batch_size", batch_size)
        if not isinstance(swap, bool):
            raise LMSOptionError(f"swap must be True or False; received {describe(swap)}.")
        set_("swap", swap)
        set_("budget", parse_budget(budget))
        set_("host_budget", parse_host_budget(host_budget))
        recompute = parse_recompute(recompute if recompute is not None else ("auto" if self.budget else False))
        if recompute == "auto" and self.budget is None:
            set_("budget", "auto")
        set_("recompute", recompute)
        if self.host_budget is not None and self.budget is None:
            raise LMSOptionError(
                f"host_budget={host_budget!r} is checked by the budget planner, and no budget was given (the TFLMS "
                f"rule predicts no memory). Pass budget= too, e.g. budget='auto'.")
        if device_spec is not None and device_spec != "auto":
            from lms_tf.cost.devices import get_device_spec

            device_spec = get_device_spec(device_spec)
            from lms_tf.cost.devices import PRESETS

            device_spec = device_spec.name if device_spec.name in PRESETS else device_spec
        set_("device_spec", device_spec)
        for name, value in (("optimizer_on_host", optimizer_on_host), ("horovod", horovod),
                            ("serialize", serialize)):
            if not isinstance(value, bool):
                raise LMSOptionError(f"{name} must be True or False; received {describe(value)}.")
            set_(name, value)
        if bucket_bytes is not _UNSET and not horovod:
            raise LMSOptionError(
                f"bucket_bytes={bucket_bytes!r} sizes the gradient allreduces of horovod=True, which is not set. "
                f"Pass horovod=True with it (lms_tf.function), or for model.fit give it to "
                f"lms_tf.keras.DistributedCallback(bucket_bytes=...).")
        set_("bucket_bytes", DEFAULT_BUCKET_BYTES if bucket_bytes is _UNSET
             else check_bucket_bytes(bucket_bytes))
        set_("plan", _load_plan(plan))
        set_("weights", parse_weights(weights))
        if self.plan is not None and budget is not None:
            raise LMSOptionError(
                f"plan= and budget={budget!r} both decide what to move; pass one. A plan made with a budget "
                f"already holds its decisions (`lms-tf plan --budget ... --out plan.json`).")
        if self.weights == "auto" and self.budget is None and self.plan is None:
            raise LMSOptionError("weights='auto' lets the budget planner choose which variables live on the host, "
                                 "so it needs a budget; received budget=None. Pass budget= (bytes, '25%' or 'auto'), "
                                 "or weights='host' to put every variable on the host.")
        if average_on not in AVERAGE_PLACES:
            raise LMSOptionError(f"average_on must be one of {', '.join(map(repr, AVERAGE_PLACES))}; received "
                                 f"{describe(average_on)}.")
        if average_on == "host" and not optimizer_on_host and self.weights == "device":
            raise LMSOptionError(
                "average_on='host' averages the gradients after they move to the host, and they move there only "
                "when the optimizer update runs there; received optimizer_on_host=False and weights='device'. "
                "Pass optimizer_on_host=True or weights='host' with it, or leave average_on='auto'.")
        set_("average_on", average_on)
        if not swap and not self.recompute and not optimizer_on_host and not horovod and not serialize \
                and self.plan is None and self.weights == "device":
            raise LMSOptionError(
                "swap=False and recompute=False leave nothing to do; pass recompute='sqrt' or 'cheap' "
                "(or a list of layer names) to recompute, optimizer_on_host=True, serialize=True, or "
                "leave swap=True.")
        if (self.swap or optimizer_on_host or self.weights != "device") and self.device is not None \
                and self.device == self.host:
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

        Examples:
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

    @property
    def policies(self) -> Policies:
        """What these options ask the planner to do, as a :class:`~lms_tf.core.policy.Policies` value.

        Examples:
            >>> LMSOptions(budget="25%").policies.budget
            0.25
        """
        return Policies(host=self.host, swap=self.swap, swapout_threshold=self.swapout_threshold,
                        swapin_ahead=self.swapin_ahead, swapin_groupby=self.swapin_groupby,
                        min_swap_bytes=self.min_swap_bytes, recompute=self.recompute, exclude=self.exclude,
                        budget=self.budget, weights=self.weights, host_budget=self.host_budget)

    def rewrite_request(self, device: str, *, batch_size: Optional[int] = None):
        """What the driver is asked to do for a step traced on ``device``
        (a :class:`lms_tf.tf.driver.RewriteRequest`).

        Examples:
            >>> LMSOptions(budget="25%").rewrite_request("/device:GPU:0").policies.budget
            0.25
        """
        from lms_tf.tf.driver import RewriteRequest  # Local import: options stay cheap to import.

        return RewriteRequest(self.policies, device=device, device_spec=self.device_spec,
                              serialize=self.serialize, batch_size=self.batch_size or batch_size, plan=self.plan)

    def to_dict(self) -> dict:
        """Returns the options as a plain dict (JSON-serialisable).

        Examples:
            >>> LMSOptions().to_dict()["host"]
            '/device:CPU:0'
        """
        out = {f.name: (list(v) if isinstance(v, tuple) else v)
               for f in dataclasses.fields(self) if f.name != "plan" for v in [getattr(self, f.name)]}
        out["plan"] = None if self.plan is None else self.plan.to_dict()
        if out["device_spec"] is not None and not isinstance(out["device_spec"], str):
            out["device_spec"] = out["device_spec"].name
        return out
