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
      and a fifth of the plain process's (whose peak holds all 200 MiB). The tensors of a traced
      step peak where the simulator says (22.35 MiB against 22.39: within 5% is asked). The
      allocator's chunks hold more, and by step: 24-32 MiB in one process, where the weights
      received from the host land in whichever free chunk is there when they arrive (a 4 MiB
      weight in a 7 MiB chunk, which the allocator does not split), after a history the model
      does not have (the variables were made in this process, then moved). The model of this
      allocator replaying the plan reads 23.7 MiB: the median step is 1.24-1.25 of it (it was
      0.95-1.02 while the trace took half of Adam's update for forward ops, which the replay ran
      on the device); asked: at least the replay, at most 1.35 of it;
    * the host process holds the variables and slots, every gradient it received and the update's
      temporaries. Its peak between the marks, in the tensors' own bytes, lies between the plan's
      ``host_peak_bytes`` (every variable's update started as its gradient arrives, as on a host
      with a thread for each: the most the update can hold, what ``host_budget=`` is checked
      against; 259.5 MiB) and the replay with the host running one variable's update at a time
      (208.4 MiB). This host process has two threads: measured 208-228 MiB, 0.80-0.88 of the first
      (asked: at most it) and 1.00-1.10 of the second (asked: at least 0.95 of it). Before the
      trace took in TensorFlow's automatic control edges, half of Adam's update ran on the device in
      the replay and the prediction read 224.5 MiB.
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
    tensors = host["traced_requested_peak"] / host["simulated_peak_bytes"]
    assert 0.95 <= tensors <= 1.05, (host["traced_requested_peak"] / MiB, host["simulated_peak_bytes"] / MiB)
    median = sorted(device_peaks)[len(device_peaks) // 2]
    assert 1.0 <= median / host["allocator_peak_bytes"] <= 1.35, (
        [p / MiB for p in device_peaks], host["allocator_peak_bytes"] / MiB)

    host_peak, at_first_mark = host_window_peak(events)
    # Between steps the host holds the variables and slots, and a few small tensors the runtime
    # keeps there (scalars of the update, received constants: 40 KB measured), nothing of the step.
    assert 0 <= at_first_mark - host["resident_host_bytes"] < 256 * 1024, (at_first_mark, host["resident_host_bytes"])
    assert 0.95 * host["host_peak_one_at_a_time_bytes"] <= host_peak <= host["host_peak_bytes"], (
        host_peak / MiB, host["host_peak_one_at_a_time_bytes"] / MiB, host["host_peak_bytes"] / MiB)
