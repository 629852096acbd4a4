"""Exception and warning types raised by lms-tf, and :func:`warn_once`.

Every error the library raises derives from :class:`LMSError`, so callers can
catch one type. Messages say what was wrong, what was received and how to fix it.

Examples:
    >>> import lms_tf
    >>> try:
    ...     lms_tf.LMSOptions(swapin_ahead=-1)
    ... except lms_tf.LMSError as err:
    ...     print(type(err).__name__)
    LMSOptionError
"""

import os
import sys
import warnings


class LMSError(Exception):
    """Base class of every error raised by lms-tf.

    Examples:
        >>> issubclass(LMSOptionError, LMSError)
        True
    """

    # AutoGraph re-raises an error from traced code as the same type only when the type's
    # __init__ is Exception's (else it becomes a StagingError); LMSOptionError would inherit
    # ValueError's, so the subclasses inherit this one and users can still catch our types.
    __init__ = Exception.__init__


class LMSOptionError(LMSError, ValueError):
    """An option has the wrong type or value, or names something that does not exist.

    Examples:
        >>> import lms_tf
        >>> lms_tf.LMSOptions(min_swap_bytes="big")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: min_swap_bytes must be an int >= 0; received 'big' (str)...
    """


class GraphAnalysisError(LMSError):
    """The traced graph cannot be analysed (for example an unresolvable tensor size).

    Examples:
        >>> issubclass(GraphAnalysisError, LMSError)
        True
    """


class UnknownSizeError(GraphAnalysisError):
    """A tensor's size depends on a dimension the trace leaves unknown and nothing resolved.

    The front-ends catch it and leave that trace untouched with a warning; ``tensor`` and
    ``shape`` name the first tensor that could not be sized.

    Examples:
        >>> issubclass(UnknownSizeError, GraphAnalysisError)
        True
    """

    def __init__(self, message: str, tensor: str = "", shape=None):
        super().__init__(message)
        self.tensor, self.shape = tensor, shape


class RewriteError(LMSError):
    """A rewrite precondition or postcondition failed; the graph is left unusable for LMS.

    Examples:
        >>> issubclass(RewriteError, LMSError)
        True
    """


class PlanCycleError(LMSError):
    """A plan's added waits (gates, orderings, waits for copies out) make ops wait for each other.

    The simulator raises it when a replay cannot run every op; the planner discards such
    candidates, so a user sees it only for a hand-made plan.

    Examples:
        >>> issubclass(PlanCycleError, LMSError)
        True
    """


class LMSWarning(UserWarning):
    """Warning category for cases where lms-tf leaves a step untouched or changes a setting.

    Examples:
        >>> import warnings
        >>> warnings.simplefilter("ignore", LMSWarning)
    """


class _Figure:
    """A figure an error carries (a budget, a least) that survives AutoGraph's re-raise.

    AutoGraph re-raises an error from a traced step as a new error of the same type made from
    the message alone, raised while the original is handled: the original is the copy's
    ``__context__``. A figure not set on the copy is read from there.

    Examples:
        >>> class Sample(LMSError):
        ...     figure = _Figure(0)
        >>> try:
        ...     try:
        ...         original = Sample("first"); original.figure = 5; raise original
        ...     except Sample:
        ...         raise Sample("copy")
        ... except Sample as err:
        ...     print(err, err.figure)
        copy 5
    """

    def __init__(self, default):
        self.default = default

    def __set_name__(self, owner, name):
        self.key = f"_figure_{name}"

    def __get__(self, err, owner=None):
        if err is None:
            return self
        seen = err
        while isinstance(seen, type(err)):
            if self.key in vars(seen):
                return vars(seen)[self.key]
            seen = seen.__context__
        return self.default

    def __set__(self, err, value):
        vars(err)[self.key] = value


class InfeasibleBudgetError(LMSOptionError):
    """No plan fits the budget; the message names the smallest budget that fits.

    Attributes:
        budget_bytes: The budget asked for.
        smallest_feasible_bytes: The simulated peak with every movable tensor moved.

    Examples:
        >>> from lms_tf.core.errors import infeasible
        >>> err = infeasible("too small", 10, 20)
        >>> err.smallest_feasible_bytes
        20
    """

    # No __init__ of its own: AutoGraph re-raises only exceptions with Exception's __init__ as
    # themselves (see LMSError); the figures are set by :func:`infeasible` and read through the
    # re-raised copy (_Figure).
    budget_bytes = _Figure(0)
    smallest_feasible_bytes = _Figure(0)


def infeasible(message: str, budget_bytes: int, smallest_feasible_bytes: int) -> InfeasibleBudgetError:
    """An :class:`InfeasibleBudgetError` carrying the budget asked for and the smallest that fits.

    Examples:
        >>> infeasible("no plan fits", 10, 20).budget_bytes
        10
    """
    err = InfeasibleBudgetError(message)
    err.budget_bytes, err.smallest_feasible_bytes = budget_bytes, smallest_feasible_bytes
    return err


class HostBudgetError(InfeasibleBudgetError):
    """The plan fits the device but needs more host memory than the process may use
    (``host_budget=``, by default the machine's physical memory); the message names both.

    Attributes:
        host_budget_bytes: The host memory the process may use.
        host_needed_bytes: What the planned step holds on the host at its peak.

    Examples:
        >>> err = host_budget_error("too much", 10, 20)
        >>> isinstance(err, InfeasibleBudgetError), err.host_needed_bytes
        (True, 20)
    """

    host_budget_bytes = _Figure(0)
    host_needed_bytes = _Figure(0)


def host_budget_error(message: str, host_budget_bytes: int, host_needed_bytes: int) -> HostBudgetError:
    """A :class:`HostBudgetError` carrying both figures (no device figure: the device budget is met).

    Examples:
        >>> host_budget_error("no room", 10, 20).smallest_feasible_bytes is None
        True
    """
    err = HostBudgetError(message)
    err.host_budget_bytes, err.host_needed_bytes = host_budget_bytes, host_needed_bytes
    err.budget_bytes, err.smallest_feasible_bytes = None, None
    return err


_warned = set()


def warn_once(key: str, message: str) -> None:
    """Issues an :class:`LMSWarning` once per process for ``key``, pointing at the user's line.

    Only a warning, not also a log line: one message, once. ``logging.captureWarnings(True)``
    sends it to the logs instead.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_once("doc-example", "shown once")
        ...     warn_once("doc-example", "shown once")
        >>> [str(w.message) for w in caught]
        ['shown once']
    """
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, LMSWarning, stacklevel=_user_stacklevel())


#: Packages whose frames a warning skips to reach the line that called into them.
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # lms_tf/
_FRAMEWORK_MARKERS = (os.sep + "keras" + os.sep, os.sep + "tensorflow" + os.sep, os.sep + "tf_keras" + os.sep,
                      os.sep + "absl" + os.sep, os.sep + "horovod" + os.sep,
                      "__autograph_generated_file")  # AutoGraph's copy of a function being traced


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside lms-tf, Keras and TensorFlow (the user's
    ``model.fit`` or step call), so a warning quotes the user's line, not a library's."""
    frame, level = sys._getframe(2), 2  # the caller of warn_once is level 2
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_LIBRARY_DIRS) and not any(m in filename for m in _FRAMEWORK_MARKERS) \
                and not filename.startswith("<frozen"):
            return level
        frame, level = frame.f_back, level + 1
    return 2


# Tracebacks and reprs name the types where users import them from (``lms_tf.LMSOptionError``).
for _type in (LMSError, LMSOptionError, GraphAnalysisError, RewriteError, PlanCycleError, LMSWarning,
              InfeasibleBudgetError):
    _type.__module__ = "lms_tf"
del _type
