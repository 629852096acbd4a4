"""Weights on a host that is a process of its own: real device and host memory, measured apart.

On logical CPUs the device and the host share one allocator, and a weight's fetch moves no bytes
(``tests/test_frontends_weights.py`` proves numbers and structure there). Here the host is task 1
of a TensorFlow cluster on localhost (an ``lms-tf stage-server``), the "device" is task 0 (a fresh
``tests/weights_cluster_worker.py``): each has its own allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``
keeps its statistics), and every fetch and every gradient's copy out crosses TensorFlow's runtime
between them, as it would cross a GPU's link. Times are not measured: loopback gRPC is no link.
"""

import numpy as np
import pytest

from lms_tf.tf.pipeline_cluster import stage_devices
from tests.weights_cluster_worker import host_window_peak, run_on_two_processes, run_plain

MiB = 2**20


@pytest.mark.timeout(900)
def test_weights_in_a_host_process_train_exactly_and_each_process_holds_what_the_simulator_says(tmp_path):
    """The issue's 4x decoder (200 MiB of weights, gradients and Adam's moments, a 50 MiB budget).

    Numbers: ten steps' losses and every weight equal the plain step's, trained alone in its own
    process. Structure: every variable and slot lives on task 1. Memory, steps 3 to 10:

    * the device process holds the plan, not the model: each step's real peak is under the budget
      and a fifth of the plain process's (whose peak holds all 200 MiB); the median step is within
      10% of the simulator's replay of the plan through a model of this allocator (steps move by
      about 10% either way, as received tensors land in other chunks; measured 0.83-1.09 a step,
      the median 0.95-1.02);
    * the host process holds the variables and slots, every gradient it received and the update's
      temporaries. Its peak between the marks, in the tensors' own bytes, is at most the plan's
      ``host_peak_bytes`` (which holds every gradient to the step's end, whatever order the host's
      update ops run in: here all of them had arrived at the peak) and within 10% of it (measured
      0.95-0.97). Before the update's temporaries were counted the prediction was 200.4 MiB
      against 212-218 measured.
    """
    plain, plain_weights = run_plain(tmp_path)
    host, host_weights, events, workers = run_on_two_processes(tmp_path)

    assert host["losses"] == plain["losses"] and len(set(plain["losses"])) > 1
    assert len(host_weights.files) == len(plain_weights.files) > 0
    assert all(np.array_equal(plain_weights[k], host_weights[k]) for k in plain_weights.files)
    assert host["variable_devices"] == [stage_devices(workers)[1]]
    assert host["offloaded"] > 0 and host["fetches"] >= host["offloaded"]

    device_peaks, plain_peaks = host["peaks"], plain["peaks"]
    assert max(device_peaks) <= host["budget_bytes"], (device_peaks, host["budget_bytes"])
    assert max(device_peaks) < min(plain_peaks) / 5, (device_peaks, plain_peaks)
    assert min(plain_peaks) >= plain["state_bytes"] * 0.75  # weights and both moments at least
    median = sorted(device_peaks)[len(device_peaks) // 2]
    assert 0.9 <= median / host["allocator_peak_bytes"] <= 1.1, (
        [p / MiB for p in device_peaks], host["allocator_peak_bytes"] / MiB)

    host_peak, at_first_mark = host_window_peak(events)
    # Between steps the host holds the variables and slots, and a few small tensors the runtime
    # keeps there (scalars of the update, received constants: 40 KB measured), nothing of the step.
    assert 0 <= at_first_mark - host["resident_host_bytes"] < 256 * 1024, (at_first_mark, host["resident_host_bytes"])
    assert 0.9 <= host_peak / host["host_peak_bytes"] <= 1.0, (host_peak / MiB, host["host_peak_bytes"] / MiB)
