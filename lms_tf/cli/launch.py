"""``lms-tf launch``: a pipeline's processes, started together and stopped together.

Starts ``lms-tf stage-server`` for stages 1 to K-1 (on free local ports, or over ssh on the
``--hosts`` given), then the training command (task 0) with ``LMS_TF_WORKERS`` set to every
stage's address, which ``lms_tf.connect_stages()`` reads. It then watches them all: when the
training command ends, the stage servers are stopped and its exit code is returned; when a stage
process dies first, the launcher names it, stops the training command and the other stages (they
would otherwise serve, or wait, forever) and exits with 1. A stage server is stopped by closing
its standard input, a pipe from the launcher (over ssh, the connection's end closes it); the
training command by ``SIGTERM``; ``SIGKILL`` follows after ``--stop-timeout`` seconds. As a stage
server stops whenever that pipe closes, none outlives a launcher that is itself killed (on Linux,
neither does the training command). It does not import TensorFlow.

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
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from lms_tf.cli import args as cli_args
from lms_tf.core.errors import LMSOptionError
# Names only: that module imports TensorFlow lazily.
from lms_tf.tf.pipeline_cluster import LOGICAL_CPUS_VARIABLE, WORKERS_VARIABLE

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
    launch.add_argument("--hosts", type=lambda text: [h.strip() for h in text.split(",") if h.strip()],
                        help="one host per stage, comma-separated, this machine first: stages 1 and up are started "
                             "over ssh (passwordless, lms-tf installed at the same path)")
    launch.add_argument("--ssh-port", type=cli_args.positive_int, help="ssh port of the other hosts")
    cli_args.add_logical_cpus_argument(launch)
    cli_args.add_memory_trace_argument(launch)
    launch.add_argument("--stop-timeout", type=float, default=10.0,
                        help="seconds a process has to stop (its input closed, or SIGTERM) before SIGKILL")
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


def _stops_with_this_process() -> None:
    """In a child, before it runs: ask Linux to send it SIGTERM when the launcher dies (killed
    included), so a training command is not left running on its own. Elsewhere, nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(processes: Sequence[subprocess.Popen], timeout: float) -> None:
    """Stops every running process: a stage server by closing its input, any other by SIGTERM;
    SIGKILL to those still running after ``timeout``."""
    running = [p for p in processes if p.poll() is None]
    for p in running:
        if p.stdin is not None:
            p.stdin.close()
        else:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stage_command(workers: Sequence[str], index: int, *, remote: bool, ssh_port: Optional[int] = None,
                  logical_cpus: int = 1, memory_trace: Optional[str] = None) -> List[str]:
    """The command that starts stage ``index``: here, or over ssh on its host, in this directory
    with this Python; it stops when its standard input closes (the launcher, or the connection).

    Examples:
        >>> stage_command(["a:1", "b:2"], 1, remote=True, ssh_port=12345)[:6]
        ['ssh', '-o', 'BatchMode=yes', '-p', '12345', 'b']
    """
    serve = [sys.executable, "-m", "lms_tf.cli", "stage-server", "--workers", ",".join(workers), "--index",
             str(index), "--until-stdin-closes", "--logical-cpus", str(logical_cpus)]
    if memory_trace is not None:
        serve += ["--memory-trace", memory_trace]
    if not remote:
        return serve
    host = workers[index].rpartition(":")[0]
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", "-o", "BatchMode=yes", *port, host,
            f"cd {shlex.quote(os.getcwd())} && exec {' '.join(map(shlex.quote, serve))}"]


def launch(command: Sequence[str], stages: int, *, host: str = "localhost", hosts: Optional[Sequence[str]] = None,
           ssh_port: Optional[int] = None, stop_timeout: float = 10.0, poll_seconds: float = 0.2,
           logical_cpus: int = 1, memory_trace: Optional[str] = None) -> int:
    """Runs ``command`` as task 0 of a ``stages``-stage pipeline with its stage servers; returns its exit code.

    Args:
        command: The training command and its arguments.
        stages: K; K-1 ``lms-tf stage-server`` processes are started.
        host: The address every process listens on (without ``hosts``).
        hosts: One host per stage, this machine first; stages 1 and up are started over ssh.
        ssh_port: The other hosts' ssh port.
        stop_timeout: Seconds a process has to stop (its input closed, or SIGTERM) before SIGKILL.
        poll_seconds: How often the processes are checked.
        logical_cpus: CPU devices each stage process has; the training command reads it from
            ``LMS_TF_LOGICAL_CPUS`` (``connect_stages()`` does).
        memory_trace: A directory each stage server writes its allocator trace to
            (``stage<k>.json``, see ``lms-tf stage-server --memory-trace``); task 0, the
            training command, is not traced (wrap its step in
            :func:`lms_tf.tf.diagnostics.allocation_trace`).

    Returns:
        The training command's exit code, or :data:`STAGE_DIED` if a stage process ended first.

    Raises:
        LMSOptionError: No command was given, or ``hosts`` does not name one host per stage.

    Examples:
        >>> launch([sys.executable, "-c", "import os, sys; sys.exit(len(os.environ['LMS_TF_WORKERS'].split(',')))"], 1)
        1
    """
    if not command:
        raise LMSOptionError("lms-tf launch needs the training command after --, e.g. "
                             "lms-tf launch --stages 2 -- python train.py")
    if hosts is not None and len(hosts) != stages:
        raise LMSOptionError(f"lms-tf launch --hosts names {len(hosts)} host(s) ({','.join(hosts)}) for {stages} "
                             f"stages: give one host per stage, this machine first.")
    workers = free_addresses(host, stages)
    if hosts is not None:  # the same free port numbers, on each stage's host
        workers = [f"{h}:{w.rpartition(':')[2]}" for h, w in zip(hosts, workers)]
    env = dict(os.environ, **{WORKERS_VARIABLE: ",".join(workers), LOGICAL_CPUS_VARIABLE: str(logical_cpus)})
    servers: List[subprocess.Popen] = []
    trainer: Optional[subprocess.Popen] = None
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k in range(1, stages):
            # Each stage reads a pipe from the launcher and stops when it closes, however the
            # launcher ends (killed included) and wherever the stage runs.
            servers.append(subprocess.Popen(stage_command(workers, k, remote=hosts is not None, ssh_port=ssh_port,
                                                          logical_cpus=logical_cpus, memory_trace=memory_trace),
                                            env=env, stdin=subprocess.PIPE))
            logger.info("lms-tf launch: stage %d (pid %d) serving at %s", k, servers[-1].pid, workers[k])
        trainer = subprocess.Popen(list(command), env=env, preexec_fn=_stops_with_this_process)
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
        >>> run(argparse.Namespace(training_command=["--"], stages=2, host="localhost", hosts=None, ssh_port=None,
        ...                        stop_timeout=1.0, logical_cpus=1, memory_trace=None))
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: lms-tf launch needs the training command after --, e.g. lms-tf launch --stages 2 -- python train.py
    """
    command = list(args.training_command)
    if command[:1] == ["--"]:
        command = command[1:]
    return launch(command, args.stages, host=args.host, hosts=args.hosts, ssh_port=args.ssh_port,
                  stop_timeout=args.stop_timeout, logical_cpus=args.logical_cpus,
                  memory_trace=args.memory_trace)
