"""``LMSCallback``: runs the swap pass on the trace of ``model.fit``'s train step.

Keras builds the train function before ``on_train_begin``; the callback wraps the
model's ``train_step`` (the pass runs right after it inside the trace) and rebuilds
the train function. ``evaluate``, ``predict`` and ``save`` are untouched, and
everything is restored in ``on_train_end``.

Examples:
    >>> import lms_tf
    >>> callback = lms_tf.LMSCallback(swapin_ahead=4)
"""

from __future__ import annotations

import contextlib
import logging
from typing import List, Optional

from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError, warn_once
from lms_tf.core.plan import Plan
from lms_tf.keras.step_hooks import add_step_hook, check_traceable, detach, turn_jit_off
from lms_tf.options import LMSOptions
from lms_tf.tf.driver import (
    call_step_for_rewrite,
    check_visible,
    no_accelerator_message,
    resolve_device,
    rewrite_traced_step,
)
from lms_tf.tf.optimizer_offload import update_on_host
from lms_tf.tf.variables import place_weights, variables_created_on

logger = logging.getLogger("lms_tf")
_API = "LMSCallback"


class LMSCallback(_compat.keras_module().callbacks.Callback):
    """Keras callback that makes ``model.fit`` train with the lms-tf swap pass.

    Args:
        **options: lms-tf options (see :class:`~lms_tf.LMSOptions`), keyword-only:
            ``device``, ``host``, ``swapout_threshold``, ``swapin_ahead``,
            ``swapin_groupby``, ``min_swap_bytes``, ``exclude``, ``batch_size``
            (by default read from ``fit``), ``swap``, ``recompute``, ``optimizer_on_host``,
            ``budget``, ``device_spec``, ``serialize``.
            Data-parallel training adds :class:`lms_tf.keras.DistributedCallback`
            to the same ``callbacks`` list, in either order.

    Attributes:
        options: The validated options.
        plan: The plan of the latest trace of the train step (None before training).
        plans: Every plan made, one per trace.

    Raises:
        LMSOptionError: Unknown or invalid options (at construction), or
            ``run_eagerly=True`` (when training begins).

    Examples:
        >>> import numpy as np, keras, lms_tf
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        >>> model.compile("sgd", "mse")
        >>> cb = lms_tf.LMSCallback(device="/CPU:0", host="/CPU:1", min_swap_bytes=0)
        >>> _ = model.fit(np.ones((8, 8)), np.ones((8, 4)), epochs=1, verbose=0, callbacks=[cb])
        >>> cb.plan is not None
        True
    """

    def __init__(self, **options):
        super().__init__()
        self.options = LMSOptions.from_kwargs(options, api=_API)
        self.plans: List[Optional[Plan]] = []
        self._restore = None

    @property
    def plan(self) -> Optional[Plan]:
        """The plan of the latest trace, or None.

        Examples:
            >>> LMSCallback().plan is None
            True
        """
        return self.plans[-1] if self.plans else None

    def on_train_begin(self, logs=None):
        """Wraps the model's train step so each trace is planned and rewritten, and rebuilds the train function.

        Examples:
            >>> import keras
            >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            >>> model.compile("sgd", "mse")
            >>> callback = LMSCallback(device="/CPU:0", host="/CPU:1")
            >>> callback.set_model(model); callback.on_train_begin()
            >>> "train_step" in model.__dict__   # wrapped until on_train_end
            True
            >>> callback.on_train_end(); "train_step" in model.__dict__
            False
        """
        model = self.model
        check_traceable(model, _API)
        if self.options.horovod:
            raise LMSOptionError(
                f"{_API}(horovod=True): for model.fit, add lms_tf.keras.DistributedCallback() to the callbacks "
                f"beside LMSCallback (it also broadcasts the variables and averages the metrics); horovod=True "
                f"is the option of lms_tf.function for custom loops.")
        device = resolve_device(self.options.device, api=_API)
        if device is not None:
            check_visible(self.options.host, role="host", api=_API)
        if device is None:
            warn_once(f"no-accelerator:{_API}", no_accelerator_message(_API))
            return
        jit_was = turn_jit_off(model, _API, "XLA ignores host placement and control edges, so the swap pass "
                                            "would have no effect")
        options = self.options
        request = options.rewrite_request(device, batch_size=_compat.fit_batch_size())
        if options.weights == "host":
            moved = place_weights(model, getattr(model, "optimizer", None), options.host)
            logger.info("%s(weights='host'): %d variables of %r moved to %s; each is copied to the device per "
                        "window of the layers that read it", _API, moved, model.name, options.host)
        if options.weights == "auto":
            # The plan, made while the first step is traced, moves the variables it puts on the
            # host then; functions traced before (evaluate, predict) would read the old copies.
            for cached in ("test_function", "predict_function"):
                if getattr(model, cached, None) is not None:
                    setattr(model, cached, None)
            # Slots built now, on the host, are variables; built by the first traced step, their
            # initial values would be tensors of that step, which its plan would count.
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None and not getattr(optimizer, "built", True) and model.built:
                with variables_created_on(options.host):
                    optimizer.build(model.trainable_variables)
        on_host = options.optimizer_on_host or options.weights != "device"

        def lms_hook(step):
            def train_step(data):
                hooks = contextlib.ExitStack()
                if on_host:  # DistributedCallback's averaging reads where, whichever callback comes first
                    hooks.enter_context(update_on_host(
                        options.host, api=_API, move_slots=options.weights == "auto",
                        average_on=options.average_on, device_spec=options.device_spec))
                if options.weights == "host":  # what the first trace creates (lazy layers, metrics) too
                    hooks.enter_context(variables_created_on(options.host))
                with hooks:
                    outputs = call_step_for_rewrite(options.serialize, step, data)
                aliases = _compat.layer_scope_aliases(model, _compat.current_graph())
                self.plans.append(rewrite_traced_step(request, api=_API, scope_aliases=aliases, outputs=outputs))
                return outputs
            return train_step

        self._restore = (lms_hook, jit_was)
        add_step_hook(model, lms_hook)

    def on_train_end(self, logs=None):
        """Restores the model's own train step (the plan was logged when the step was traced).

        Examples:
            >>> import keras
            >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            >>> model.compile("sgd", "mse")
            >>> callback = LMSCallback(device="/CPU:0", host="/CPU:1")
            >>> callback.set_model(model); callback.on_train_begin(); callback.on_train_end()
            >>> model.train_function is None   # the next fit traces the plain step
            True
        """
        restore, self._restore = self._restore, None
        if restore is None:
            return
        detach(self.model, restore)
