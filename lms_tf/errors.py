"""Exception and warning types raised by lms-tf.

Every error the library raises derives from :class:`LMSError`, so callers can
catch one type. Messages say what was wrong, what was received and how to fix it.

Example:
    >>> import lms_tf
    >>> try:
    ...     lms_tf.LMSOptions(swapin_ahead=-1)
    ... except lms_tf.LMSError as err:
    ...     print(type(err).__name__)
    LMSOptionError
"""


class LMSError(Exception):
    """Base class of every error raised by lms-tf.

    Example:
        >>> issubclass(LMSOptionError, LMSError)
        True
    """

    # AutoGraph re-raises an error from traced code as the same type only when the type's
    # __init__ is Exception's (else it becomes a StagingError); LMSOptionError would inherit
    # ValueError's, so the subclasses inherit this one and users can still catch our types.
    __init__ = Exception.__init__


class LMSOptionError(LMSError, ValueError):
    """An option has the wrong type or value, or names something that does not exist.

    Example:
        >>> import lms_tf
        >>> lms_tf.LMSOptions(min_swap_bytes="big")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.errors.LMSOptionError: min_swap_bytes must be an int >= 0; received 'big' (str)...
    """


class GraphAnalysisError(LMSError):
    """The traced graph cannot be analysed (for example an unresolvable tensor size).

    Example:
        >>> issubclass(GraphAnalysisError, LMSError)
        True
    """


class RewriteError(LMSError):
    """A rewrite precondition or postcondition failed; the graph is left unusable for LMS.

    Example:
        >>> issubclass(RewriteError, LMSError)
        True
    """


class PlanCycleError(LMSError):
    """A plan's added waits (gates, orderings, waits for copies out) make ops wait for each other.

    The simulator raises it when a replay cannot run every op; the planner discards such
    candidates, so a user sees it only for a hand-made plan.

    Example:
        >>> issubclass(PlanCycleError, LMSError)
        True
    """


class LMSWarning(UserWarning):
    """Warning category for cases where lms-tf leaves a step untouched or changes a setting.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("ignore", LMSWarning)
    """
