"""Doctests of the library run with logical CPUs as the tests do (at least two)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Real allocator peaks on the CPU need the BFC allocator (lms_tf.measure_peak_memory).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# oneDNN's CPU graph rewrites are on or off by CPU model (on with AVX512-VNNI/BF16): its fusions
# differ between a plain and a rewritten graph in the last bit and rename kernels, so the suite
# runs without them for machine-independent numbers; tests/test_onednn.py covers them on purpose.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
# With no arguments pytest may load tests/conftest.py (three logical CPUs, for the pipeline tests)
# before this file: keep a split that is already configured.
if len(tf.config.get_logical_device_configuration(_cpus[0]) or []) < 2:
    try:
        tf.config.set_logical_device_configuration(
            _cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    except RuntimeError:  # already initialised
        pass

collect_ignore = ["setup.py", "examples", "benchmarks", "scripts", "tests/legacy_keras_script.py",
                  "tests/allocator_worker.py", "tests/pipeline_cluster_worker.py",
                  # imported for its doctests it would split the CPU into two logical devices
                  "tests/horovod_worker.py", "tests/hybrid_worker.py"]


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctests_draw_seeded(request):
    """With TF_DETERMINISTIC_OPS=1 (tests/conftest.py), random ops without a seed are an error; a
    doctest that builds a model must not depend on a test having set one before it ran."""
    if type(request.node).__name__ == "DoctestItem":
        tf.random.set_seed(0)
