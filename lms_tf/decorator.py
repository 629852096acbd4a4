"""The decorator front-end, ``lms_tf.function``: a drop-in for ``tf.function`` that runs the swap pass on every trace.

Examples:
    >>> import tensorflow as tf, lms_tf
    >>> w = tf.Variable(tf.ones((8, 8)))
    >>> @lms_tf.function(device="/CPU:0", host="/CPU:1", min_swap_bytes=0)
    ... def train_step(x):
    ...     with tf.GradientTape() as tape:
    ...         loss = tf.reduce_sum(tf.nn.relu(x @ w))
    ...     w.assign_sub(0.1 * tape.gradient(loss, w))
    ...     return loss
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from lms_tf.core.errors import LMSOptionError, warn_once
from lms_tf.core.plan import Plan
from lms_tf.options import LMSOptions
from lms_tf.tf.driver import (
    call_step_for_rewrite,
    check_visible,
    no_accelerator_message,
    resolve_device,
    rewrite_traced_step,
)
from lms_tf.tf.optimizer_hooks import intercept_optimizer_updates
from lms_tf.tf.optimizer_offload import update_on_host

_call_shapes = threading.local()
_API = "lms_tf.function"


def _concrete_shapes(structure) -> List[Optional[tuple]]:
    shapes = []
    for leaf in tf.nest.flatten(structure, expand_composites=False):
        if isinstance(leaf, (tf.Tensor, np.ndarray)) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            try:
                shapes.append(tuple(tf.TensorShape(leaf.shape).as_list()))
            except (TypeError, ValueError):
                shapes.append(None)
        else:
            shapes.append(None)
    return shapes


def _largest(shape: Optional[tuple], other: Optional[tuple]) -> Optional[tuple]:
    """Dimension-wise maximum of two concrete shapes of the same rank (``shape`` if they cannot be compared)."""
    if shape is None or other is None or len(shape) != len(other) or None in shape or None in other:
        return shape
    return tuple(max(a, b) for a, b in zip(shape, other))


class LMSFunction:
    """A ``tf.function`` whose traces are rewritten by the lms-tf swap pass.

    Built by :func:`function`; call it exactly like the ``tf.function`` it wraps.

    Attributes:
        options: The validated :class:`~lms_tf.LMSOptions`.
        plans: One plan per trace, oldest first (None entries: step left untouched).
        pass_seconds: Time the pass (analyse, plan, rewrite) took on each trace.
        plain_irs: The IR of each trace before it was rewritten (``lms_tf.planner.simulate(ir, plan)``).

    Examples:
        >>> import lms_tf
        >>> f = lms_tf.function(lambda x: x * 2.0, device="/CPU:0", host="/CPU:1")
        >>> float(f(tf.constant(2.0))), f.plan.decisions
        (4.0, ())
    """

    def __init__(self, python_function: Callable, options: LMSOptions, tf_function_kwargs: Dict[str, Any]):
        self.python_function = python_function
        self.options = options
        self.plans: List[Optional[Plan]] = []
        self.plain_irs: list = []  # IR of each trace before its rewrite (what the plan refers to)
        self.pass_seconds: List[float] = []
        self._tf_function_kwargs = tf_function_kwargs
        self._bound: "weakref.WeakKeyDictionary[Any, LMSFunction]" = weakref.WeakKeyDictionary()
        self._broadcast_ids: set = set()
        self._broadcast_keepalive: list = []  # ids stay unique while the variables are referenced
        self._largest_shapes: Dict[tuple, Optional[tuple]] = {}  # (leaf, leaves) -> largest shape called with
        functools.update_wrapper(self, python_function)

        @functools.wraps(python_function)
        def traced(*args, **kwargs):
            updates = [0]
            with self._optimizer_hooks(updates):
                result = call_step_for_rewrite(self.options.serialize, python_function, *args, **kwargs)
            if self.options.horovod and updates[0] == 0:
                raise LMSOptionError(
                    f"lms_tf.function(horovod=True): {getattr(python_function, '__name__', 'the step')} updated no "
                    f"variables through a Keras optimizer (optimizer.apply / apply_gradients), so there is no "
                    f"point between the gradients and the update to average them across ranks. Use a Keras "
                    f"optimizer, or drop horovod=True and call hvd.allreduce on the gradients yourself.")
            self._after_trace(args, kwargs, result)
            return result

        self._tf_function = tf.function(traced, **tf_function_kwargs)

    def _optimizer_hooks(self, updates: List[int]) -> contextlib.ExitStack:
        """Hooks on the optimizer update while tracing: Horovod averaging, host placement."""
        stack = contextlib.ExitStack()
        if self.options.horovod:
            from lms_tf.horovod import ALLREDUCE_ORDER, gradient_allreduce_hook

            stack.enter_context(intercept_optimizer_updates(
                gradient_allreduce_hook(self.options.bucket_bytes, updates), order=ALLREDUCE_ORDER))
        managed = resolve_device(self.options.device, api=_API) is not None
        if self.options.weights == "host" and managed:
            from lms_tf.tf.variables import variables_created_on

            stack.enter_context(variables_created_on(self.options.host))  # slots, lazily built layers
        on_host = self.options.optimizer_on_host or self.options.weights != "device"
        if on_host and managed:
            stack.enter_context(update_on_host(
                self.options.host, api=_API, move_slots=self.options.weights == "auto",
                average_on=self.options.average_on, device_spec=self.options.device_spec))
        return stack

    def _broadcast_new_variables(self, args, kwargs) -> None:
        """horovod=True: before a trace first runs, its variables take the root rank's values."""
        from lms_tf.horovod import broadcast_variables

        concrete = self._with_call_shapes(self._tf_function.get_concrete_function, args, kwargs)
        # Ranks must list the variables in the same order; concrete.variables comes from an
        # identity set (process-specific order), the trace's capture order is the same everywhere.
        position = {id(handle): i for i, handle in enumerate(concrete.captured_inputs)}
        ordered = sorted(concrete.variables, key=lambda v: position.get(id(v.handle), len(position)))
        fresh = [v for v in ordered if id(v) not in self._broadcast_ids]
        if fresh:
            broadcast_variables(fresh, root_rank=0)
            self._broadcast_ids.update(id(v) for v in fresh)
            self._broadcast_keepalive.extend(fresh)

    @tf.autograph.experimental.do_not_convert
    def _after_trace(self, args, kwargs, result) -> None:
        symbolic = tf.nest.flatten((args, kwargs))
        concrete = getattr(_call_shapes, "stack", [None])[-1]
        if concrete is not None:
            # A trace that generalised a dimension (reduce_retracing, or a shorter last batch) serves
            # every call of this structure: plan it for the largest shape called with so far.
            concrete = [_largest(shape, self._largest_shapes.get((i, len(concrete))))
                        for i, shape in enumerate(concrete)]
        input_shapes = {}
        if not tf.executing_eagerly() and concrete is not None and len(concrete) == len(symbolic):
            for sym, shape in zip(symbolic, concrete):
                if (isinstance(sym, tf.Tensor) and shape is not None and sym.op.type == "Placeholder"
                        and not sym.shape.is_fully_defined() and sym.shape.is_compatible_with(shape)):
                    input_shapes[sym.op.name] = shape
        device = resolve_device(self.options.device, api=_API)
        if device is not None:
            check_visible(self.options.host, role="host", api=_API)
        if device is None:
            warn_once(f"no-accelerator:{_API}", no_accelerator_message(_API))
            self.plans.append(None)
            return
        started = time.perf_counter()
        self.plans.append(rewrite_traced_step(self.options.rewrite_request(device), api=_API,
                                              input_shapes=input_shapes, irs=self.plain_irs, outputs=result))
        self.pass_seconds.append(time.perf_counter() - started)

    @property
    def plan(self) -> Optional[Plan]:
        """The plan of the latest trace (None before the first trace or when left untouched).

        Examples:
            >>> import lms_tf
            >>> lms_tf.function(lambda x: x, device="/CPU:0", host="/CPU:1").plan is None
            True
        """
        return self.plans[-1] if self.plans else None

    def _with_call_shapes(self, method, args, kwargs):
        stack = getattr(_call_shapes, "stack", None)
        if stack is None:
            stack = _call_shapes.stack = []
        shapes = _concrete_shapes((args, kwargs))
        for i, shape in enumerate(shapes):
            key = (i, len(shapes))
            self._largest_shapes[key] = _largest(shape, self._largest_shapes.get(key))
        stack.append(shapes)
        try:
            return method(*args, **kwargs)
        finally:
            stack.pop()

    def __call__(self, *args, **kwargs):
        if self.options.horovod:
            self._broadcast_new_variables(args, kwargs)
        return self._with_call_shapes(self._tf_function, args, kwargs)

    def get_concrete_function(self, *args, **kwargs):
        """Traces (if needed) and returns the rewritten ``ConcreteFunction``, as ``tf.function`` does.

        Examples:
            >>> import lms_tf
            >>> f = lms_tf.function(lambda x: x + 1.0, device="/CPU:0", host="/CPU:1")
            >>> f.get_concrete_function(tf.TensorSpec((2,))).structured_outputs.shape
            TensorShape([2])
        """
        return self._with_call_shapes(self._tf_function.get_concrete_function, args, kwargs)

    def experimental_get_tracing_count(self) -> int:
        """Number of traces so far (each one was rewritten).

        Examples:
            >>> import lms_tf
            >>> lms_tf.function(lambda x: x, device="/CPU:0", host="/CPU:1").experimental_get_tracing_count()
            0
        """
        return self._tf_function.experimental_get_tracing_count()

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        bound = self._bound.get(instance)
        if bound is None:
            bound = LMSFunction(self.python_function.__get__(instance, owner), self.options,
                                self._tf_function_kwargs)
            self._bound[instance] = bound
        return bound

    def __repr__(self) -> str:
        return f"<lms_tf.function {getattr(self.python_function, '__name__', '?')} traces={len(self.plans)}>"


def function(func: Optional[Callable] = None, *, input_signature=None, autograph: bool = True,
             reduce_retracing: bool = False, jit_compile: Optional[bool] = None, **options):
    """Like ``tf.function``, and every trace is rewritten to swap activations to the host.

    Usable bare (``@lms_tf.function``) or configured (``@lms_tf.function(swapin_ahead=2)``).
    The function must build the forward pass, the gradients and (usually) the update.

    Args:
        func: The Python training step.
        input_signature: As for ``tf.function``.
        autograph: As for ``tf.function``.
        reduce_retracing: As for ``tf.function``.
        jit_compile: Must not be True: XLA ignores host placement and control edges.
        **options: lms-tf options (see :class:`~lms_tf.LMSOptions`): ``device``, ``host``,
            ``swapout_threshold``, ``swapin_ahead``, ``swapin_groupby``, ``min_swap_bytes``,
            ``exclude``, ``batch_size``, ``swap``, ``recompute``, ``optimizer_on_host``, ``weights``
            (``"host"``: the variables live on the host, moved there first by
            :func:`lms_tf.place_weights`, and are fetched per window of readers),
            ``horovod`` (data-parallel: average the gradients across Horovod ranks before
            the optimizer update, broadcast the variables from rank 0 before a trace first runs),
            ``bucket_bytes`` (with ``horovod``: bytes of gradients per allreduce; None for one),
            ``serialize`` (run the compute ops one at a time in the simulator's order).

    Returns:
        An :class:`LMSFunction`, or a decorator when ``func`` is None.

    Raises:
        LMSOptionError: Unknown or invalid options, or ``jit_compile=True``.

    Examples:
        >>> import tensorflow as tf, lms_tf
        >>> model = tf.keras.Sequential([tf.keras.layers.Dense(4)])
        >>> @lms_tf.function(device="/CPU:0", host="/CPU:1")
        ... def step(x):
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_mean(model(x) ** 2)
        ...     grads = tape.gradient(loss, model.trainable_variables)
        ...     return loss
        >>> float(step(tf.zeros((2, 3))))
        0.0
    """
    if jit_compile:
        raise LMSOptionError(
            "lms_tf.function received jit_compile=True: XLA ignores host placement and control edges, so "
            "the swap pass would have no effect. Pass jit_compile=False (or leave it unset).")
    lms_options = LMSOptions.from_kwargs(options, api="lms_tf.function")
    tf_kwargs = dict(input_signature=input_signature, autograph=autograph, reduce_retracing=reduce_retracing,
                     jit_compile=False if jit_compile is not None else None)

    def decorate(f: Callable) -> LMSFunction:
        if not callable(f):
            raise LMSOptionError(f"lms_tf.function expects a callable; received {f!r} ({type(f).__name__}).")
        return LMSFunction(f, lms_options, tf_kwargs)

    return decorate if func is None else decorate(func)
