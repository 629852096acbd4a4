"""The ``lms-tf`` command line: one module per subcommand, the same flag names for the same things.

``version``, ``explain``, ``plan`` and ``max-batch`` share ``--model``, ``--input-shape``,
``--classes``, ``--batch`` and ``--device`` (a device preset) (:mod:`lms_tf.cli.args`). Every value
is checked while the command line is parsed, before TensorFlow is imported or a model built.
Exit codes: 0 done, 2 bad usage or an lms-tf error, 3 an infeasible budget (``plan``).

Examples:
    >>> build_parser().parse_args(["plan", "--model", "resnet50", "--batch", "8"]).model
    'resnet50'
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from lms_tf.cli import explain, launch, max_batch, max_params, partition, plan, stage_server, version

logger = logging.getLogger("lms_tf")
SUBCOMMANDS = {"version": version, "explain": explain, "plan": plan, "max-batch": max_batch,
               "max-params": max_params,
               "partition": partition, "stage-server": stage_server, "launch": launch}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lms-tf``.

    Examples:
        >>> build_parser().prog
        'lms-tf'
    """
    parser = argparse.ArgumentParser(prog="lms-tf", description="Large Model Support for TensorFlow / Keras 3.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show TensorFlow's own C++ log lines and lms-tf's debug messages")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``lms-tf`` console script.

    Examples:
        >>> main(["version"])  # doctest: +ELLIPSIS
        lms-tf ...
        0
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.verbose:  # lms-tf's own debug messages, not every library's (matplotlib, h5py, TensorFlow's Python)
        logging.getLogger("lms_tf").setLevel(logging.DEBUG)
    from lms_tf.core.errors import LMSError

    try:
        if not args.verbose and getattr(SUBCOMMANDS[args.command], "USES_TENSORFLOW", True):
            import_tensorflow_quietly()
        return SUBCOMMANDS[args.command].run(args)
    except LMSError as err:
        print(f"lms-tf: error: {err}", file=sys.stderr)
        return 2


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow and finds its devices with the process's stderr (file descriptor 2)
    captured, so its C++ start-up lines (the oneDNN and CUDA notices, printed before its log
    settings apply, so ``TF_CPP_MIN_LOG_LEVEL`` does not hide them) do not bury the command's
    output. If the import fails, what it printed is written out before the error propagates.

    Examples:
        >>> import_tensorflow_quietly()
        >>> import sys; "tensorflow" in sys.modules
        True
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
