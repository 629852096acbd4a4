"""Test set-up: two logical CPUs stand in for accelerator (/CPU:0) and host (/CPU:1); a third
holds the third stage of the pipelined steps (tests/test_pipeline_execution.py)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Real allocator peaks on the CPU need the BFC allocator (lms_tf.measure_peak_memory).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
# oneDNN's CPU graph rewrites are on or off by CPU model (on with AVX512-VNNI/BF16) and rename
# kernels, so the suite runs without them for machine-independent numbers and simulator rules;
# tests/test_tf_onednn.py covers them on purpose.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(3)])

import pytest  # noqa: E402

from tests.helpers import CPU_LMS  # noqa: E402


@pytest.fixture
def cpu_lms():
    """The device and host every rewriting test uses (a fresh dict per test)."""
    return dict(CPU_LMS)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _log_resident_memory(request):
    """With ``LMS_TF_TEST_RSS_LOG=path``, appends each test's process id, resident bytes after it
    and name there. The suite runs the CPU on the BFC allocator, which keeps what it took until
    its process ends: this is how to find the test that left a pytest worker large (a worker that
    grows to half the machine's memory is what the kernel kills beside a test that starts a large
    process of its own)."""
    yield
    log = os.environ.get("LMS_TF_TEST_RSS_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {_resident_bytes()} {request.node.nodeid}\n")
