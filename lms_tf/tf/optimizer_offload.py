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

import logging
from typing import Callable, List

import tensorflow as tf

from lms_tf.core.errors import warn_once
from lms_tf.tf.variables import variable_bytes_by_device, variable_device

logger = logging.getLogger("lms_tf")

# Nested under a gradient-averaging hook (order 0): average on the device, update on the host.
HOST_UPDATE_ORDER = 1


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
    is sent to the host is the product instead of the gradient (Adam sends the gradient and its
    square). Everything that reads a slot stays on the host.

    Examples:
        >>> keep_gradient_products_on_device([], [])
        []
    """
    from lms_tf import _compat

    updates = {op.name for op in update_ops}
    gradient_ops = {t.op.name for t in grads if t is not None}
    derived_from_slot, from_gradient, moved = set(), set(), []
    for op in update_ops:   # in creation order: an op's inputs come before it
        sources = [t.op.inputs[t.value_index] if t.op.type == "IdentityN" and t.op.name in updates else t
                   for t in op.inputs]
        # A read of a variable that is not a scalar hyperparameter reads a slot (or a weight).
        if (op.type == "ReadVariableOp" and op.outputs[0].shape.rank != 0) or any(
                t.op.name in derived_from_slot for t in op.inputs):
            derived_from_slot.add(op.name)
            continue
        if op.type == "IdentityN" or any(t.dtype == tf.resource for t in op.inputs) or not any(
                t.op.name in gradient_ops or t.op.name in from_gradient for t in sources):
            continue
        from_gradient.add(op.name)
        for index, (tensor, source) in enumerate(zip(op.inputs, sources)):
            if source is not tensor:
                _compat.update_input(op, index, source)
        _compat.set_device(op, next(t.op.device for t in sources if t.op.name in gradient_ops | from_gradient))
        moved.append(op.name)
    if moved:
        logger.debug("optimizer on the host: %d update ops that read only gradients stay on the device: %s",
                     len(moved), moved[:5])
    return moved
