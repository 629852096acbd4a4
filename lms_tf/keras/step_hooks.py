"""One wrapper around ``model.train_step`` shared by every lms-tf callback of a ``fit``.

``LMSCallback`` (rewrite the trace after the step is built) and
``lms_tf.keras.DistributedCallback`` (average gradients while the step is built) both
need to run code inside the trace of the train step. Each registers a *step hook*,
``hook(step) -> step``, on the model; a single wrapper composes the registered hooks each
time Keras traces the step, so the callbacks compose in either order and each one
removes only itself. When the last hook is removed the model's own ``train_step`` is back
and the traced train function is dropped, so the next ``fit`` traces the plain step.

Examples:
    >>> import keras
    >>> from lms_tf.keras.step_hooks import add_step_hook, remove_step_hook
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> hook = lambda step: step
    >>> add_step_hook(model, hook); remove_step_hook(model, hook)
    >>> "train_step" in model.__dict__
    False
"""

from __future__ import annotations

from typing import Callable, List

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError, warn_once

_HOOKS_ATTR = "_lms_tf_step_hooks"
_ORIGINAL_ATTR = "_lms_tf_own_train_step"
StepHook = Callable[[Callable], Callable]


def _hooks(model) -> List[StepHook]:
    return model.__dict__.setdefault(_HOOKS_ATTR, [])


def add_step_hook(model, hook: StepHook) -> None:
    """Registers ``hook`` to wrap ``model.train_step`` on every trace, and rebuilds the train function.

    Args:
        model: A compiled Keras model.
        hook: ``hook(step) -> step``; called at trace time with the step to wrap.

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> add_step_hook(model, lambda step: step); remove_step_hook(model, None)
    """
    hooks = _hooks(model)
    if not hooks:
        own_step = model.__dict__.get("train_step")
        model.__dict__[_ORIGINAL_ATTR] = own_step
        inner_step = own_step or type(model).train_step.__get__(model)

        def train_step(data):
            step = inner_step
            for registered in model.__dict__.get(_HOOKS_ATTR, []):
                step = registered(step)
            return step(data)

        model.train_step = tf.autograph.experimental.do_not_convert(train_step)
    hooks.append(hook)
    model.train_function = None
    model.make_train_function(force=True)


def remove_step_hook(model, hook) -> None:
    """Unregisters ``hook`` (None: every hook); restores ``train_step`` when none is left.

    Args:
        model: The model given to :func:`add_step_hook`.
        hook: The hook to remove, or None for all of them.

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> remove_step_hook(model, None)  # nothing registered: nothing to do
    """
    hooks = _hooks(model)
    if hook is None:
        hooks.clear()
    elif hook in hooks:
        hooks.remove(hook)
    if not hooks and _HOOKS_ATTR in model.__dict__:
        own_step = model.__dict__.pop(_ORIGINAL_ATTR, None)
        if own_step is None:
            model.__dict__.pop("train_step", None)
        else:
            model.train_step = own_step
        model.__dict__.pop(_HOOKS_ATTR, None)
    # The next fit() must not reuse a train function traced with hooks that are gone.
    model.train_function = None


def check_traceable(model, api: str) -> None:
    """Raises LMSOptionError when ``fit`` would run the step eagerly (nothing is traced).

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse", run_eagerly=True)
        >>> check_traceable(model, "LMSCallback")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: LMSCallback: the model runs eagerly...
    """
    if getattr(model, "run_eagerly", False) or tf.config.functions_run_eagerly():
        raise LMSOptionError(
            f"{api}: the model runs eagerly (run_eagerly=True), so there is no traced train step to "
            f"rewrite. Compile with run_eagerly=False (the default) to use lms-tf.")


def turn_jit_off(model, api: str, why: str) -> bool:
    """Turns the model's ``jit_compile`` off for training, with a warning; returns the old value.

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse", jit_compile=False)
        >>> turn_jit_off(model, "LMSCallback", "XLA ignores host placement")
        False
    """
    jit_was = _compat.get_jit_compile(model)
    if jit_was:
        warn_once(f"jit:{api}:{id(model)}",
                  f"{api}: turning jit_compile off for training: {why}. evaluate/predict keep their setting.")
        _compat.set_jit_compile(model, False)
    return jit_was


def restore_jit(model, jit_was: bool) -> None:
    """Puts back the ``jit_compile`` value :func:`turn_jit_off` returned.

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> restore_jit(model, False)
    """
    if jit_was:
        _compat.set_jit_compile(model, jit_was)


def detach(model, restore) -> None:
    """Undoes what a callback attached in ``on_train_begin``: ``restore`` is ``(hook, jit_was)`` or None.

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> detach(model, None)  # nothing attached: nothing to do
    """
    if restore is None:
        return
    hook, jit_was = restore
    remove_step_hook(model, hook)
    restore_jit(model, jit_was)
