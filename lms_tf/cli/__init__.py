"""The ``lms-tf`` command line: one module per subcommand, the same flag names for the same things.

``version``, ``explain``, ``plan`` and ``max-batch`` share ``--model``, ``--input-shape``,
``--classes``, ``--batch`` and ``--device`` (a device preset) (:mod:`lms_tf.cli.args`). Every value
is checked while the command line is parsed, before TensorFlow is imported or a model built.
Exit codes: 0 done, 2 bad usage or an lms-tf error, 3 an infeasible budget (``plan``).

Example:
    >>> build_parser().parse_args(["plan", "--model", "resnet50", "--batch", "8"]).model
    'resnet50'
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from lms_tf.cli import explain, max_batch, plan, version

logger = logging.getLogger("lms_tf")
SUBCOMMANDS = {"version": version, "explain": explain, "plan": plan, "max-batch": max_batch}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lms-tf``.

    Example:
        >>> build_parser().prog
        'lms-tf'
    """
    parser = argparse.ArgumentParser(prog="lms-tf", description="Large Model Support for TensorFlow / Keras 3.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``lms-tf`` console script.

    Example:
        >>> main(["version"])  # doctest: +ELLIPSIS
        lms-tf ...
        0
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from lms_tf.core.errors import LMSError

    try:
        return SUBCOMMANDS[args.command].run(args)
    except LMSError as err:
        print(f"lms-tf: error: {err}", file=sys.stderr)
        return 2
