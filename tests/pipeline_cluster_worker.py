"""Task 0 of a pipeline cluster: connects to the stage processes and trains the zoo's models as
pipelines across them, beside single-device gradient accumulation in this process.

    python tests/pipeline_cluster_worker.py host:port,host:port,... name,schedule,stages ...
    lms-tf launch --stages K -- python tests/pipeline_cluster_worker.py - name,schedule,stages ...

Prints one ``RESULT <json>`` line: per case, whether the losses and every weight are identical,
and the devices the stages' kernels ran on.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.tf.pipeline_step import PipelineStep  # noqa: E402
from tests import test_pipeline_execution as cases  # noqa: E402


def connect(workers):
    """``-``: the addresses ``lms-tf launch`` put in ``LMS_TF_WORKERS``."""
    return lms_tf.connect_stages(None if workers == "-" else workers, timeout=60)


def main(workers, specs):
    devices = connect(workers)
    rows = []
    for spec in specs:
        name, schedule, stages = spec.split(",")
        made = {}

        def pipelined(model, schedule=schedule, stages=int(stages)):
            made["step"] = PipelineStep(model, cases.contiguous(model, stages), microbatches=cases.MICROBATCHES,
                                        schedule=schedule, devices=devices[:stages])
            return made["step"]

        plain, piped, reference, model = cases.train_both(cases.MODELS[name], pipelined)
        same = len(reference.weights) == len(model.weights) and all(
            np.array_equal(a.numpy(), b.numpy()) for a, b in zip(reference.weights, model.weights))
        rows.append({"case": spec, "losses_equal": plain == piped, "trains": len(set(plain)) > 1,
                     "weights_equal": same, "devices": devices[:int(stages)]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(rows), flush=True)


def after_a_stage_dies(workers):
    """Trains one step across the stages, says ``READY``, waits for a line on stdin (the test
    stops a stage process meanwhile), then times the next step: it must fail, not hang."""
    import time

    import tensorflow as tf

    devices = connect(workers)
    model, (x, y) = cases.MODELS["sequential_cnn"]()
    step = PipelineStep(model, cases.contiguous(model, len(devices)), microbatches=2, devices=devices)
    x, y = tf.constant(x[:8]), tf.constant(y[:8])
    float(step(x, y))
    print("READY", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    try:
        float(step(x, y))
        error = None
    except Exception as err:  # noqa: BLE001 - the type is what the test reads
        error = type(err).__name__
    print("RESULT " + json.dumps({"error": error, "seconds": time.monotonic() - started}), flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "--after-a-stage-dies":
        after_a_stage_dies(sys.argv[1])
    else:
        main(sys.argv[1], sys.argv[2:])
