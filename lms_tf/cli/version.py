"""``lms-tf version``: the versions of lms-tf, TensorFlow and Keras.

Examples:
    >>> from lms_tf.cli import main
    >>> main(["version"])  # doctest: +ELLIPSIS
    lms-tf ...
    0
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``version``.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> build_parser().parse_args(["version"]).command
        'version'
    """
    return subparsers.add_parser("version", help="print lms-tf, TensorFlow and Keras versions")


def run(args) -> int:
    """Prints ``lms-tf X, TensorFlow Y, Keras Z``.

    Examples:
        >>> run(None)  # doctest: +ELLIPSIS
        lms-tf ...
        0
    """
    import tensorflow as tf

    import lms_tf
    from lms_tf import _compat

    print(f"lms-tf {lms_tf.__version__}, TensorFlow {tf.__version__}, Keras {_compat.keras_module().__version__}")
    return 0
