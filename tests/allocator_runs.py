"""Runs ``tests/allocator_worker.py`` in a fresh process and returns its rows.

The worker sets TensorFlow's allocator and thread options when it is imported, so callers
(the tests, ``benchmarks/allocator_validation.py``) start it as a process, never import it. This
module imports no TensorFlow.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_allocator_worker(*args: str, timeout: float) -> list:
    """The worker's result rows for ``args`` (its command line), with oneDNN's kernels on
    (TensorFlow's default on x86) and without ``TF_DETERMINISTIC_OPS``.

    Raises:
        RuntimeError: The worker printed no result; the message ends with its stderr.
    """
    env = {k: v for k, v in os.environ.items() if k != "TF_DETERMINISTIC_OPS"}
    env["TF_ENABLE_ONEDNN_OPTS"] = "1"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "allocator_worker.py"), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"allocator worker {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])
