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
        built_before = bool(getattr(optimizer, "built", False)) and bool(optimizer.variables)
        if built_before and move_slots:
            from lms_tf import _compat

            graph = _compat.current_graph()
            for variable in optimizer.variables:
                inner = getattr(variable, "_value", variable)  # the TensorFlow variable under a Keras 3 one
                if "iteration" not in variable.name and "learning_rate" not in variable.name \
                        and variables_off_device([inner], host) and isinstance(inner, tf.Variable):
                    _compat.move_variable_in_place(inner, host, graph if _compat.is_function_graph(graph) else None)
        with tf.device(host):
            result = update(grads, variables)
        slots = [v for v in optimizer.variables if "iteration" not in v.name and "learning_rate" not in v.name]
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
