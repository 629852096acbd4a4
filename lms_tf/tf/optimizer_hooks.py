"""Hooks on Keras optimizer updates: code that runs between a step's gradients and its update.

While a step is traced, :func:`intercept_optimizer_updates` patches the update methods of the Keras
optimizer classes (:func:`lms_tf._compat.keras.optimizer_entry_points`) so every update passes
through the active hooks, nested by order: Horovod averaging, the host placement of
``optimizer_on_host``. The patch is removed when the last hook ends.

Examples:
    >>> from lms_tf.tf.optimizer_hooks import intercept_optimizer_updates
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import List, Tuple

from lms_tf._compat.keras import optimizer_entry_points
from lms_tf.core.errors import LMSError

_intercept_state = threading.local()


def _split_update_args(method: str, args, kwargs):
    """(grads, variables, rebuild) for a call of ``apply(grads, vars)`` or ``apply_gradients(pairs)``."""
    if method == "apply":
        grads = list(args[0] if args else kwargs.pop("grads"))
        variables = args[1] if len(args) > 1 else kwargs.pop("trainable_variables", None)
        rest = args[2:]

        def rebuild(new_grads, new_variables):
            return (new_grads, new_variables) + tuple(rest), kwargs
        return grads, (None if variables is None else list(variables)), rebuild
    pairs = list(args[0] if args else kwargs.pop("grads_and_vars"))
    rest = args[1:]
    grads, variables = [g for g, _ in pairs], [v for _, v in pairs]

    def rebuild(new_grads, new_variables):
        return (list(zip(new_grads, new_variables)),) + tuple(rest), kwargs
    return grads, variables, rebuild


def _run_hooks(optimizer, method, original, args, kwargs):
    grads, variables, rebuild = _split_update_args(method, args, dict(kwargs))
    hooks = [hook for _, _, hook in sorted(_intercept_state.hooks, key=lambda entry: entry[:2])]

    def call(position, new_grads, new_variables):
        if position < len(hooks):
            return hooks[position](optimizer, list(new_grads), new_variables,
                                   lambda g, v: call(position + 1, g, v))
        new_args, new_kwargs = rebuild(list(new_grads), new_variables)
        _intercept_state.depth += 1
        try:
            return original(optimizer, *new_args, **new_kwargs)
        finally:
            _intercept_state.depth -= 1
    return call(0, grads, variables)


def _patched(method, original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if getattr(_intercept_state, "depth", 0) > 0 or not getattr(_intercept_state, "hooks", None):
            return original(self, *args, **kwargs)
        return _run_hooks(self, method, original, args, kwargs)
    wrapper.__lms_tf_original__ = original
    return wrapper


@contextlib.contextmanager
def intercept_optimizer_updates(hook, order: int = 0):
    """While active, every Keras optimizer update in this thread passes through ``hook`` first.

    ``hook(optimizer, grads, variables, update)`` receives the gradients and variables of one
    ``optimizer.apply(...)`` / ``apply_gradients(...)`` call (``variables`` may be None when
    Keras 3's ``apply(grads)`` is called without them) and must call
    ``update(grads, variables)`` to go on, possibly with new gradients or under a device
    scope, and return its result. Active hooks run nested by ascending ``order`` (then by
    entry), so a gradient-averaging hook (order 0) runs outside a placement hook (order 1).
    Only the outermost call of a nested chain (LossScaleOptimizer -> inner optimizer) is
    intercepted. The class-level patch (the step's optimizer is unknown before it runs) is
    installed while any hook is active, i.e. while a step is being traced.

    Examples:
        >>> import keras, tensorflow as tf
        >>> seen = []
        >>> def halve(optimizer, grads, variables, update):
        ...     seen.append(len(grads))
        ...     return update([g * 0.5 for g in grads], variables)
        >>> v = keras.Variable(1.0)
        >>> with intercept_optimizer_updates(halve):
        ...     _ = keras.optimizers.SGD(1.0).apply([tf.constant(1.0)], [v])
        >>> seen, float(v.numpy())   # the update applied half the gradient
        ([1], 0.5)
    """
    if not hasattr(_intercept_state, "hooks"):
        _intercept_state.hooks, _intercept_state.depth, _intercept_state.serial = [], 0, 0
    with _intercept_lock:
        global _patch_users
        if _patch_users == 0:
            entries = optimizer_entry_points()
            if not entries:
                raise LMSError("found no Keras optimizer class to intercept (neither Keras 3 nor tf-keras "
                               "is importable); lms-tf's optimizer options need one of them.")
            for cls, method in entries:
                setattr(cls, method, _patched(method, cls.__dict__[method]))
                _patched_entries.append((cls, method))
        _patch_users += 1
    _intercept_state.serial += 1
    entry = (order, _intercept_state.serial, hook)
    _intercept_state.hooks.append(entry)
    try:
        yield
    finally:
        _intercept_state.hooks.remove(entry)
        with _intercept_lock:
            _patch_users -= 1
            if _patch_users == 0:
                for cls, method in _patched_entries:
                    setattr(cls, method, cls.__dict__[method].__lms_tf_original__)
                _patched_entries.clear()


_intercept_lock = threading.Lock()


_patch_users = 0


_patched_entries: List[Tuple[type, str]] = []
