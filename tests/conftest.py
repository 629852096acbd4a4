"""Test set-up: two logical CPUs stand in for accelerator (/CPU:0) and host (/CPU:1)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Real allocator peaks on the CPU need the BFC allocator (lms_tf.measure_peak_memory).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])

import pytest  # noqa: E402

#: Options every test uses so that swaps cross a real device boundary on a CPU-only machine.
CPU_LMS = dict(device="/CPU:0", host="/CPU:1")


@pytest.fixture
def cpu_lms():
    return dict(CPU_LMS)
