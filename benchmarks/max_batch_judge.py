"""Judges the plan ``lms-tf max-batch`` answers with, outside the simulator: ResNet-50 224² at
``BATCH`` on v100-16gb-pcie3, traced and rewritten by ``lms_tf.function(budget="auto")`` and run
on Grappler's virtual V100 told the variable shapes, once in TensorFlow's own order and once
serialized (``serialize=True``: the compute ops chained in the simulator's order).

Grappler's step peak (each in-place input/output pair and alias counted once, the variables'
reads left to the resident variables) counts the batch, which the simulator leaves to the
resident memory; so it is held against the room the device leaves the step and its batch: the
device's memory less the variables and the safety margin (the plan's budget plus the batch).

Prints one ``RESULT <json>`` line. Run by ``benchmarks/max_batch.py`` in a process of its own
(the host must be a second logical CPU before TensorFlow starts).

    .venv/bin/python benchmarks/max_batch_judge.py 762
"""

import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.cost import get_device_spec  # noqa: E402
from lms_tf.simulate import input_bytes  # noqa: E402
from lms_tf.tf.diagnostics import virtual_gpu_peak_report  # noqa: E402
from lms_tf.tf.workloads import build_model, train_step  # noqa: E402

DEVICE = "v100-16gb-pcie3"


def judged(batch: int, serialize: bool) -> dict:
    """The plan at ``batch`` and Grappler's figures for it, in one order."""
    keras.utils.set_random_seed(0)
    model = build_model("ResNet50", image_size=224, classes=1000)
    spec = get_device_spec(DEVICE)
    # The plan is for a V100 server: its host memory, not this machine's, bounds what it may hold there.
    fn = lms_tf.function(train_step(model), device="/CPU:0", host="/CPU:1", budget="auto", device_spec=spec,
                         host_budget=spec.host_memory_bytes, serialize=serialize)
    concrete = fn.get_concrete_function(tf.TensorSpec((batch, 224, 224, 3)), tf.TensorSpec((batch,), tf.int32))
    # Told twice the memory, so that an overflow is measured rather than refused.
    report = virtual_gpu_peak_report(concrete, gpu_memory_bytes=2 * spec.memory_bytes, variable_shapes=True)
    inputs = input_bytes(fn.plain_irs[-1])
    return {"serialize": serialize, "budget": fn.plan.budget_bytes, "inputs": inputs,
            "room": fn.plan.budget_bytes + inputs, "simulated": fn.plan.predictions.planned_peak_bytes,
            "oracle_step_peak": report.step_peak_bytes, "oracle_raw_peak": report.peak_bytes}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("lms_tf").setLevel(logging.WARNING)
    batch = int(sys.argv[1])
    print("RESULT " + json.dumps([judged(batch, serialize) for serialize in (False, True)]))


if __name__ == "__main__":
    main()
