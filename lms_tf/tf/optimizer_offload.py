"""``optimizer_on_host``: the optimizer's slots and update ops live on the host (KARMA, ZeRO-Offload).

The optimizer update is traced under ``tf.device(host)``. Keras creates the slot variables
lazily, inside the first traced update, and a variable created there keeps the innermost
device scope, so the slots (Adam's ``m`` and ``v``: twice the model's size) are allocated in
host memory and the update arithmetic runs on the host. Ops that read or write a model
variable stay with the variable (TensorFlow's placer colocates resource ops with their
resource), so per step the gradients travel to the host and the new weight values travel
back: two model-sized copies, no slot bytes on the device.

Examples:
    >>> from lms_tf.tf.optimizer_offload import host_update_hook
    >>> hook = host_update_hook("/CPU:1", api="lms_tf.function")
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, List, Optional

import tensorflow as tf

from lms_tf.core.errors import warn_once
from lms_tf.core.op_kinds import update_products_of_gradients
from lms_tf.cost import CostModel, detect_device_spec, get_device_spec
from lms_tf.tf.optimizer_hooks import intercept_optimizer_updates
from lms_tf.tf.variables import variable_bytes_by_device, variable_device

logger = logging.getLogger("lms_tf")

# Nested under a gradient-averaging hook (order 0): average on the device, update on the host.
HOST_UPDATE_ORDER = 1


@dataclasses.dataclass(frozen=True)
class UpdatePlacement:
    """Where a traced step's optimizer update runs (``host``) and where a Horovod average of its
    gradients goes (``average_on``: ``"device"``, ``"host"`` or ``"auto"``, decided by the cost
    model of ``device_spec``: a preset name, a :class:`~lms_tf.cost.DeviceSpec`, or None /
    ``"auto"`` for the visible GPU's preset).

    Examples:
        >>> placement = UpdatePlacement("/CPU:0", "auto", "v100-16gb-pcie3")
        >>> placement.averaging_device(2**30, ranks=4)
        '/CPU:0'
        >>> UpdatePlacement("/CPU:0", "device").averaging_device(2**30, ranks=4) is None
        True
    """

    host: str
    average_on: str = "auto"
    device_spec: Any = None

    def cost_model(self) -> Optional[CostModel]:
        """The cost model ``"auto"`` decides by: ``device_spec``'s, else the visible GPU's; None
        without either (a CPU-only machine, where the device and the host are both host memory).

        Examples:
            >>> UpdatePlacement("/CPU:0", device_spec="gh200-96gb-c2c").cost_model().device.name
            'gh200-96gb-c2c'
        """
        if self.device_spec not in (None, "auto"):
            return CostModel(get_device_spec(self.device_spec))
        if not tf.config.list_physical_devices("GPU"):
            return None
        return CostModel(detect_device_spec())

    def averaging_device(self, nbytes: int, ranks: int) -> Optional[str]:
        """The device to average ``nbytes`` of gradients across ``ranks`` on: ``host``, or None for
        where the gradients are (the device). ``"auto"`` asks the cost model, and logs its answer.

        Examples:
            >>> UpdatePlacement("/CPU:0", "auto", "gh200-96gb-c2c").averaging_device(2**30, ranks=4) is None
            True
            >>> UpdatePlacement("/CPU:0", "host").averaging_device(2**30, ranks=4)
            '/CPU:0'
        """
        if self.average_on != "auto":
            return self.host if self.average_on == "host" else None
        model = self.cost_model()
        if model is None:
            _log_averaging(f"lms-tf: averaging gradients on the device, before they move to the host "
                           f"({self.host}) for the update: no GPU and no device_spec to compare the costs")
            return None
        cost = model.gradient_averaging(nbytes, ranks)
        where = self.host if cost.cheaper == "host" else None
        host_s = "unknown" if cost.host_s is None else f"{cost.host_s * 1e3:.2f} ms"
        _log_averaging(f"lms-tf: averaging {nbytes / 2**20:.1f} MiB of gradients across {ranks} ranks on the "
                       f"{cost.cheaper}{'' if where is None else f' ({where})'}: {model.device.name} predicts "
                       f"{cost.device_s * 1e3:.2f} ms on the devices, {host_s} on the host")
        return where


_logged_averaging = set()


def _log_averaging(message: str) -> None:
    """Logs a decision once: Keras traces a step twice, and each trace decides the same."""
    if message not in _logged_averaging:
        _logged_averaging.add(message)
        logger.info("%s", message)


_PLACEMENTS: List[UpdatePlacement] = []


@contextlib.contextmanager
def update_placement(placement: UpdatePlacement) -> Iterator[UpdatePlacement]:
    """Makes ``placement`` the one :func:`current_update_placement` returns while the step is traced.

    Examples:
        >>> with update_placement(UpdatePlacement("/CPU:0", "host")):
        ...     current_update_placement().average_on
        'host'
        >>> current_update_placement() is None
        True
    """
    _PLACEMENTS.append(placement)
    try:
        yield placement
    finally:
        _PLACEMENTS.pop()


def current_update_placement() -> Optional[UpdatePlacement]:
    """The placement of the update being traced (the innermost :func:`update_placement`), or None
    when the update stays on the device.

    Examples:
        >>> current_update_placement() is None
        True
    """
    return _PLACEMENTS[-1] if _PLACEMENTS else None


def _slots(optimizer) -> list:
    """The optimizer's per-weight state (its step counter and learning rate are not slots)."""
    return [v for v in optimizer.variables if "iteration" not in v.name and "learning_rate" not in v.name]


def variables_off_device(variables, device: str) -> List[str]:
    """Names of ``variables`` that are not placed on ``device`` (compared as DeviceSpecs).

    Examples:
        >>> v = tf.Variable(1.0)
        >>> variables_off_device([v], v.device)
        []
    """
    wanted = tf.DeviceSpec.from_string(device)
    off = []
    for variable in variables:
        spec = tf.DeviceSpec.from_string(variable_device(variable))
        if (spec.device_type or "").upper() != (wanted.device_type or "").upper() or \
                (spec.device_index or 0) != (wanted.device_index or 0):
            off.append(getattr(variable, "path", None) or variable.name)
    return off


def host_update_hook(host: str, api: str, move_slots: bool = False) -> Callable:
    """An optimizer-update hook (see ``intercept_optimizer_updates``) that updates on ``host``.

    Args:
        host: The host device, e.g. ``"/CPU:0"``.
        api: The front-end's name, for the warning about an optimizer built too early.
        move_slots: Move the slots of an optimizer built before the step was traced to the host
            (``weights="auto"``, whose plans count them there) instead of warning.

    Returns:
        ``hook(optimizer, grads, variables, update)``.

    Examples:
        >>> hook = host_update_hook("/CPU:0", api="LMSCallback")
        >>> callable(hook)
        True
    """
    def hook(optimizer, grads, variables, update):
        from lms_tf import _compat

        built_before = bool(getattr(optimizer, "built", False)) and bool(optimizer.variables)
        if built_before and move_slots:
            for variable in optimizer.variables:
                inner = getattr(variable, "_value", variable)  # the TensorFlow variable under a Keras 3 one
                if "iteration" not in variable.name and "learning_rate" not in variable.name \
                        and variables_off_device([inner], host) and isinstance(inner, tf.Variable):
                    current = _compat.current_graph()
                    _compat.move_variable_in_place(inner, host, current if _compat.is_function_graph(current) else None)
        graph = _compat.current_graph()
        before = len(graph.get_operations())
        with tf.device(host):
            result = update(grads, variables)
        if _compat.is_function_graph(graph):
            keep_gradient_products_on_device(graph.get_operations()[before:], grads)
        slots = _slots(optimizer)
        off_host = variables_off_device(slots, host)
        if off_host:
            why = ("it was built before this step was traced" if built_before
                   else "Keras placed them outside the host scope")
            warn_once(f"optimizer-on-host:{id(optimizer)}",
                      f"{api}: optimizer_on_host=True, but {len(off_host)} of {len(slots)} slot variables of "
                      f"optimizer {optimizer.name!r} are not on {host} ({why}; e.g. {off_host[0]!r}). The "
                      f"update ops run on the host; the slots stay where they are. Create the optimizer afresh "
                      f"(compile again) before the first step so lms-tf can create its slots on the host.")
        else:
            logger.info("%s: optimizer %r: %d slot variables (%.1f MiB) and the update ops on %s",
                        api, optimizer.name, len(slots), sum(variable_bytes_by_device(slots).values()) / 2**20,
                        host)
        return result
    return hook


@contextlib.contextmanager
def update_on_host(host: str, *, api: str, move_slots: bool = False, average_on: str = "auto",
                   device_spec: Any = None) -> Iterator[UpdatePlacement]:
    """While a step is traced: its optimizer update runs on ``host`` (:func:`host_update_hook`),
    and a Horovod average of its gradients, traced around it, reads where to go from the
    :class:`UpdatePlacement` this makes current. What both front-ends enter for an update on
    the host.

    Args:
        host: The host device, e.g. ``"/CPU:0"``.
        api: The front-end's name, for warnings.
        move_slots: As for :func:`host_update_hook`.
        average_on: ``"device"``, ``"host"`` or ``"auto"`` (see :class:`UpdatePlacement`).
        device_spec: The preset or spec ``"auto"`` decides by.

    Yields:
        The current :class:`UpdatePlacement`.

    Examples:
        >>> with update_on_host("/CPU:0", api="lms_tf.function", average_on="host") as placement:
        ...     current_update_placement() is placement
        True
    """
    hook = host_update_hook(host, api=api, move_slots=move_slots)
    with intercept_optimizer_updates(hook, order=HOST_UPDATE_ORDER), \
            update_placement(UpdatePlacement(host, average_on, device_spec)) as placement:
        yield placement


def keep_gradient_products_on_device(update_ops, grads) -> List[str]:
    """Puts back on the gradients' device the update ops that compute from the gradients alone
    (and the optimizer's hyperparameters), not from a slot, and has them read each gradient
    itself rather than the ``IdentityN`` the optimizer wraps the gradients in; returns their names.

    On one device, TensorFlow's Grappler regroups chains of products across the end of a
    gradient: a BatchNormalization scale's gradient times the learning rate,
    ``(dy * rsqrt) * lr``, runs as ``(lr * dy) * rsqrt``. Across two devices it cannot, so with
    those products on the host the step rounded differently from the plain one (a last-bit
    difference, on a CPU whose values hit it). With the products on the device the device runs
    what it runs in the plain step, and they hold no more than the gradient they replace: what
    is sent to the host is the product instead of the gradient. Functions of a gradient that
    Grappler rewrites with nothing around them (Adam's square:
    :data:`~lms_tf.core.op_kinds.UPDATE_FUNCTIONS_RUN_ON_HOST`) run on the host, from the gradient
    it receives for the update anyway: one copy, not two. Everything that reads a slot stays on
    the host.

    Examples:
        >>> keep_gradient_products_on_device([], [])
        []
    """
    from lms_tf import _compat

    updates = {op.name for op in update_ops}
    gradient_ops = {t.op.name for t in grads if t is not None}
    # Each input as the gradient it forwards when it is an output of the optimizer's IdentityN.
    sources = {op.name: [t.op.inputs[t.value_index] if t.op.type == "IdentityN" and t.op.name in updates else t
                         for t in op.inputs] for op in update_ops}
    moved = update_products_of_gradients(
        [(op.name, op.type, [t.op.name for t in sources[op.name]],
          op.type == "ReadVariableOp" and op.outputs[0].shape.rank != 0,  # a slot's or a weight's read
          any(t.dtype == tf.resource for t in op.inputs)) for op in update_ops], gradient_ops)
    from_gradient, by_name = gradient_ops | set(moved), {op.name: op for op in update_ops}
    for name in moved:
        op = by_name[name]
        for index, (tensor, source) in enumerate(zip(op.inputs, sources[name])):
            if source is not tensor:
                _compat.update_input(op, index, source)
        _compat.set_device(op, next(t.op.device for t in sources[name] if t.op.name in from_gradient))
    if moved:
        logger.debug("optimizer on the host: %d update ops that read only gradients stay on the device: %s",
                     len(moved), moved[:5])
    return moved
