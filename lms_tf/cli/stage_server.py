"""``lms-tf stage-server``: one pipeline stage's process on TensorFlow's distributed runtime.

Start one per stage except the first, on the machines given, then run the training script
(task 0), which connects with ``lms_tf.connect_stages`` and builds ``lms_tf.PipelineStep`` on
the devices it returns.

Examples:
    >>> from lms_tf.cli import build_parser
    >>> build_parser().parse_args(["stage-server", "--workers", "a:1,b:2", "--index", "1"]).index
    1
"""

from __future__ import annotations

import argparse

from lms_tf.cli import args as cli_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``stage-server`` and its flags.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> build_parser().parse_args(["stage-server", "--workers", "a:1,b:2", "--index", "1"]).workers
        'a:1,b:2'
    """
    server = subparsers.add_parser("stage-server", help="serve one pipeline stage (task 1 and up) until stopped")
    server.add_argument("--workers", required=True,
                        help="every stage process's host:port, comma-separated, task 0 (the training script) first")
    server.add_argument("--index", type=int, required=True, help="this stage's task (1 and up)")
    server.add_argument("--until-stdin-closes", action="store_true",
                        help="stop when standard input closes (lms-tf launch uses it, also over ssh)")
    cli_args.add_logical_cpus_argument(server)
    cli_args.add_memory_trace_argument(server)
    return server


def run(args) -> int:
    """Serves the stage until the process is stopped.

    Examples:
        >>> run(argparse.Namespace(workers="localhost:2222", index=1, until_stdin_closes=False, logical_cpus=1,
        ...                        memory_trace=None))
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: stage-server serves stage 1 and up of a pipeline of two or more; --workers names one (localhost:2222), the training script's own.
    """
    from lms_tf.tf.pipeline_cluster import serve_stage

    serve_stage(args.workers, args.index, until_stdin_closes=args.until_stdin_closes, logical_cpus=args.logical_cpus,
                memory_trace=args.memory_trace)
    return 0
