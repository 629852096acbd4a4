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

            for variable in optimizer.variables:
                inner = getattr(variable, "_value", variable)  # the TensorFlow variable under a Keras 3 one
                if "iteration" not in variable.name and "learning_rate" not in variable.name \
                        and variables_off_device([inner], host) and isinstance(inner, tf.Variable):
                    current = _compat.current_graph()
                    _compat.move_variable_in_place(inner, host, current if _compat.is_function_graph(current) else None)
        from lms_tf import _compat

        graph = _compat.current_graph()
        before = len(graph.get_operations())
        with tf.device(host):
            result = update(grads, variables)
        if _compat.is_function_graph(graph):
            keep_regrouped_on_device(graph, graph.get_operations()[before:], grads)
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


def keep_regrouped_on_device(graph, update_ops, grads) -> List[str]:
    """Puts back on the gradients' device the update ops TensorFlow's Grappler regroups with the
    ops that compute a gradient, and has them read the gradient itself (not the ``IdentityN``
    the optimizer wraps the gradients in); returns their names.

    On one device, Grappler's arithmetic optimizer regroups a chain of products across the end of
    the gradient: a BatchNormalization scale's gradient ``(dy * rsqrt) * learning_rate`` runs as
    ``(learning_rate * dy) * rsqrt``. Across two devices it cannot, so with the update on the host
    the product was rounded differently from the plain step (a last-bit difference, found on a
    CPU where the plain step's values hit it). Which ops it regroups is read off an offline run of
    Grappler's default pipeline on the step as traced so far, all on one device: an update op
    that reads a value of the gradient's computation other than the gradient, or whose value a
    gradient op reads, is regrouped. Those ops hold a gradient-sized product, so the device holds
    nothing more than the gradient it replaces.

    Examples:
        >>> keep_regrouped_on_device(tf.Graph(), [], [])
        []
    """
    from lms_tf import _compat
    from lms_tf.tf.rewrite.serialize import grappler_fetches

    updates = {op.name: op for op in update_ops}
    if not updates:
        return []
    sources = {t.op.name: t.op for t in grads if t is not None}
    virtual = "/job:localhost/replica:0/task:0/device:CPU:0"
    graph_def = graph.as_graph_def()
    for node in graph_def.node:
        node.device = virtual
    optimized = {node.name: node for node in _compat.grappler_default_optimized(
        graph_def, grappler_fetches(graph), (virtual, "CPU", 2**30)).node}
    original = {op.name: {t.op.name for t in op.inputs} for op in graph.get_operations()}

    def reads(name: str) -> set:
        return {i.lstrip("^").split(":")[0] for i in optimized[name].input if not i.startswith("^")}

    regrouped = set()
    for name in updates:
        if name in optimized and any(r not in updates and r not in original[name] for r in reads(name)):
            regrouped.add(name)
    for name in original:
        if name not in updates and name in optimized:
            regrouped |= {r for r in reads(name) - original[name] if r in updates}
    # Variable reads stay with their variable (TensorFlow colocates them); what they read is copied.
    moved = []
    for name in sorted(regrouped):
        op = updates[name]
        if op.type in ("ReadVariableOp", "VarHandleOp") or any(t.dtype == tf.resource for t in op.inputs):
            continue
        for index, tensor in enumerate(op.inputs):
            if tensor.op.type == "IdentityN" and tensor.op.name in updates:
                _compat.update_input(op, index, tensor.op.inputs[tensor.value_index])
        device = next((t.op.device for t in op.inputs if t.op.name in sources or t.op.name not in updates), "")
        _compat.set_device(op, device)
        moved.append(name)
    if moved:
        logger.debug("optimizer on the host: %d update ops Grappler regroups with a gradient stay on the device: %s",
                     len(moved), moved[:5])
    return moved
