"""``LMSCallback``: runs the swap pass on the trace of ``model.fit``'s train step.

Keras builds the train function before ``on_train_begin``; the callback wraps the
model's ``train_step`` (the pass runs right after it inside the trace) and rebuilds
the train function. ``evaluate``, ``predict`` and ``save`` are untouched, and
everything is restored in ``on_train_end``.

Example:
    >>> import lms_tf
    >>> callback = lms_tf.LMSCallback(swapin_ahead=4)
"""

from __future__ import annotations

import logging
from typing import List, Optional

import tensorflow as tf

from lms_tf import _compat
from lms_tf.errors import LMSOptionError
from lms_tf.options import LMSOptions
from lms_tf.pipeline import no_accelerator_message, resolve_device, rewrite_traced_step, warn_once
from lms_tf.planner import Plan

logger = logging.getLogger("lms_tf")
_API = "LMSCallback"


class LMSCallback(_compat.keras_module().callbacks.Callback):
    """Keras callback that makes ``model.fit`` train with the lms-tf swap pass.

    Args:
        **options: lms-tf options (see :class:`~lms_tf.LMSOptions`), keyword-only:
            ``device``, ``host``, ``swapout_threshold``, ``swapin_ahead``,
            ``swapin_groupby``, ``min_swap_bytes``, ``exclude``, ``batch_size``
            (by default read from ``fit``).

    Attributes:
        options: The validated options.
        plan: The plan of the latest trace of the train step (None before training).
        plans: Every plan made, one per trace.

    Raises:
        LMSOptionError: Unknown or invalid options (at construction), or
            ``run_eagerly=True`` (when training begins).

    Example:
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

        Example:
            >>> LMSCallback().plan is None
            True
        """
        return self.plans[-1] if self.plans else None

    def on_train_begin(self, logs=None):
        model = self.model
        if getattr(model, "run_eagerly", False) or tf.config.functions_run_eagerly():
            raise LMSOptionError(
                f"{_API}: the model runs eagerly (run_eagerly=True), so there is no traced train step to "
                f"rewrite. Compile with run_eagerly=False (the default) to use lms-tf.")
        if resolve_device(self.options) is None:
            warn_once(f"no-accelerator:{_API}", no_accelerator_message(_API))
            return
        jit_was = _compat.get_jit_compile(model)
        if jit_was:
            warn_once(f"jit:{id(model)}",
                      f"{_API}: turning jit_compile off for training: XLA ignores host placement and control "
                      f"edges, so the swap pass would have no effect. evaluate/predict keep their setting.")
            _compat.set_jit_compile(model, False)
        batch_size = self.options.batch_size or _compat.fit_batch_size()
        original_step = model.train_step
        options = self.options

        def train_step(data):
            outputs = original_step(data)
            aliases = _compat.layer_scope_aliases(model, _compat.current_graph())
            self.plans.append(rewrite_traced_step(options, api=_API, batch_size=batch_size, scope_aliases=aliases))
            return outputs

        train_step = tf.autograph.experimental.do_not_convert(train_step)
        model.train_step = train_step
        self._restore = (original_step, jit_was)
        model.make_train_function(force=True)

    def on_train_end(self, logs=None):
        if self._restore is None:
            return
        original_step, jit_was = self._restore
        self._restore = None
        model = self.model
        if "train_step" in model.__dict__:
            del model.__dict__["train_step"]
        if jit_was:
            _compat.set_jit_compile(model, jit_was)
        # The next fit() must not reuse the rewritten function unless LMS is asked for again.
        model.train_function = None
        if self.plan is not None:
            logger.info(self.plan.one_line())
