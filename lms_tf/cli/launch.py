"""``lms-tf launch``: a pipeline's processes on this machine, started together and stopped together.

Starts ``lms-tf stage-server`` for stages 1 to K-1 on free local ports, then the training
command (task 0) with ``LMS_TF_WORKERS`` set to every stage's address, which
``lms_tf.connect_stages()`` reads. It then watches them all: when the training command ends, the
stage servers are stopped and its exit code is returned; when a stage process dies first, the
launcher names it and stops the training command and the other stages (they would otherwise
serve, or wait, forever), and exits with 1. Stopping is ``SIGTERM``, then ``SIGKILL`` after
``--stop-timeout`` seconds. It does not import TensorFlow. Across machines, start
``lms-tf stage-server`` on each host instead (``docs/pipeline.md``).

Examples:
    >>> from lms_tf.cli import build_parser
    >>> args = build_parser().parse_args(["launch", "--stages", "3", "--", "python", "train.py"])
    >>> args.stages, args.training_command[-2:]
    (3, ['python', 'train.py'])
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from lms_tf.cli import args as cli_args
from lms_tf.core.errors import LMSOptionError
from lms_tf.tf.pipeline_cluster import WORKERS_VARIABLE  # a name only: that module imports TensorFlow lazily

logger = logging.getLogger("lms_tf")
#: Exit code when a stage process died before the training command ended.
STAGE_DIED = 1
#: This command needs no TensorFlow in the launcher's own process.
USES_TENSORFLOW = False


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``launch`` and its flags.

    Examples:
        >>> from lms_tf.cli import build_parser
        >>> build_parser().parse_args(["launch", "--stages", "2", "--", "python", "t.py"]).stop_timeout
        10.0
    """
    launch = subparsers.add_parser("launch", help="run a training command with its pipeline stage servers on this "
                                                  "machine, all stopped together")
    launch.add_argument("--stages", type=cli_args.positive_int, required=True,
                        help="number of stages K: the training command is stage 0, K-1 stage servers are started")
    launch.add_argument("--host", default="localhost", help="the address every process listens on (default: localhost)")
    launch.add_argument("--stop-timeout", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping a process")
    launch.add_argument("training_command", nargs=argparse.REMAINDER,
                        help="the training command (task 0), after --")
    return launch


def free_addresses(host: str, count: int) -> List[str]:
    """``count`` distinct ``host:port`` addresses whose ports are free now.

    Examples:
        >>> len(set(free_addresses("localhost", 3)))
        3
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [f"{host}:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _stop(processes: Sequence[subprocess.Popen], timeout: float) -> None:
    """SIGTERM to every running process, then SIGKILL to those still running after ``timeout``."""
    running = [p for p in processes if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + timeout
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(command: Sequence[str], stages: int, *, host: str = "localhost", stop_timeout: float = 10.0,
           poll_seconds: float = 0.2) -> int:
    """Runs ``command`` as task 0 of a ``stages``-stage pipeline with its stage servers; returns its exit code.

    Args:
        command: The training command and its arguments.
        stages: K; K-1 ``lms-tf stage-server`` processes are started.
        host: The address every process listens on.
        stop_timeout: Seconds between SIGTERM and SIGKILL.
        poll_seconds: How often the processes are checked.

    Returns:
        The training command's exit code, or :data:`STAGE_DIED` if a stage process ended first.

    Raises:
        LMSOptionError: No command was given.

    Examples:
        >>> launch([sys.executable, "-c", "import os, sys; sys.exit(len(os.environ['LMS_TF_WORKERS'].split(',')))"], 1)
        1
    """
    if not command:
        raise LMSOptionError("lms-tf launch needs the training command after --, e.g. "
                             "lms-tf launch --stages 2 -- python train.py")
    workers = free_addresses(host, stages)
    env = dict(os.environ, **{WORKERS_VARIABLE: ",".join(workers)})
    servers: List[subprocess.Popen] = []
    trainer: Optional[subprocess.Popen] = None
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k in range(1, stages):
            servers.append(subprocess.Popen([sys.executable, "-m", "lms_tf.cli", "stage-server", "--workers",
                                             ",".join(workers), "--index", str(k)], env=env))
            logger.info("lms-tf launch: stage %d (pid %d) serving at %s", k, servers[-1].pid, workers[k])
        trainer = subprocess.Popen(list(command), env=env)
        logger.info("lms-tf launch: stage 0 (pid %d) at %s runs: %s", trainer.pid, workers[0], " ".join(command))
        while not interrupted:
            code = trainer.poll()
            if code is not None:
                _stop(servers, stop_timeout)
                logger.info("lms-tf launch: the training command exited with %d; stage servers stopped", code)
                return code
            dead = next(((k, s) for k, s in enumerate(servers, start=1) if s.poll() is not None), None)
            if dead is not None:
                k, server = dead
                logger.error("lms-tf launch: stage %d (pid %d, %s) exited with code %d before the training command "
                             "ended; stopping the training command and the other stages", k, server.pid,
                             workers[k], server.returncode)
                _stop([trainer] + servers, stop_timeout)
                return STAGE_DIED
            time.sleep(poll_seconds)
        logger.error("lms-tf launch: stopped by signal %d; stopping every stage", interrupted[0])
        _stop(([trainer] if trainer else []) + servers, stop_timeout)
        return 128 + interrupted[0]
    finally:
        _stop(([trainer] if trainer else []) + servers, stop_timeout)  # whatever happened, nothing is left behind
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(args) -> int:
    """Runs ``lms-tf launch``.

    Examples:
        >>> run(argparse.Namespace(training_command=["--"], stages=2, host="localhost", stop_timeout=1.0))
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: lms-tf launch needs the training command after --, e.g. lms-tf launch --stages 2 -- python train.py
    """
    command = list(args.training_command)
    if command[:1] == ["--"]:
        command = command[1:]
    return launch(command, args.stages, host=args.host, stop_timeout=args.stop_timeout)
