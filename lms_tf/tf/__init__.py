"""The TensorFlow side: trace a step into the IR, rewrite it by a plan, and the driver that does both.

Everything under this package imports TensorFlow; the planning core below it does not. Private
TensorFlow and Keras APIs are reached only through :mod:`lms_tf._compat`.

Examples:
    >>> from lms_tf.tf.trace import build_ir
    >>> from lms_tf.tf.rewrite import apply_plan
"""
