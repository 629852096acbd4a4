"""mCAP's calibration of the partition's memory model on the real allocator (``calibrate=True``).

The core (no TensorFlow): a calibrated profile counts every stage with the real fixed part and
bytes per micro-batch, weights untouched. On this CPU's allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``,
set by conftest): the two real runs, the model and its optimizer left as they were, the linear
extrapolation checked against a third real run it was not read from, and bad input refused
before the model is traced.
"""

import os
import random
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf.core.errors import LMSError, LMSOptionError
from lms_tf.pipeline import PipelineProfile, partition_layers, stage_peak
from lms_tf.pipeline.calibration import Calibration
from lms_tf.pipeline.partition import _Window
from tests.test_pipeline_partition import random_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _by_hand(profile, calibration, lo, hi, flight):
    """A stage's calibrated peak counted from the uncalibrated profile: weights as they are, every
    kept tensor scaled, the offset added to the largest working set."""
    window = _Window.over(profile, lo, hi)
    params, _, work, _, _, _, _, _ = window.now()
    kept = {name: nbytes for layer in profile.layers[lo:hi] for name, nbytes in layer.saved}
    scaled = sum(round(nbytes * calibration.activation_scale) for nbytes in kept.values())
    worked = max(max(0, layer.work_bytes + calibration.fixed_offset_bytes) for layer in profile.layers[lo:hi])
    return int(params * (2 + profile.slot_bytes_per_param_byte)) + flight * scaled + worked


def test_a_calibrated_profile_counts_every_stage_with_the_real_figures():
    rng = random.Random(3)
    exact = 0
    for trial in range(300):
        profile = random_profile(rng, rng.randrange(2, 12))
        n = len(profile.layers)
        one, two = (stage_peak(profile, 0, n, f) for f in (1, 2))
        real_one = int(one * rng.uniform(0.8, 1.3))
        real_two = real_one + int((two - one) * rng.uniform(0.6, 1.6))
        calibration = Calibration.from_profile(profile, (real_one, real_two))
        calibrated = calibration.apply(profile)
        assert [layer.params for layer in calibrated.layers] == [layer.params for layer in profile.layers]
        # a working set does not go below zero: an offset larger than every layer's leaves the
        # stage counted above the real figure (the safe side), never below
        clipped = calibration.fixed_offset_bytes + max(layer.work_bytes for layer in profile.layers) < 0
        for flight in (1, 2, 5):
            # rounding each tensor's scaled bytes: at most one byte per kept tensor per micro-batch
            slack = flight * sum(len(layer.saved) for layer in profile.layers)
            difference = stage_peak(calibrated, 0, n, flight) - calibration.extrapolate(flight)
            assert -slack <= difference and (clipped or difference <= slack), (trial, difference)
            exact += not clipped
        lo = rng.randrange(n)
        hi = rng.randrange(lo + 1, n + 1)
        flight = rng.randrange(1, 5)
        assert stage_peak(calibrated, lo, hi, flight) == _by_hand(profile, calibration, lo, hi, flight), trial
    assert exact > 300   # most trials reproduce the real figures to the rounding


def test_the_cut_moves_with_the_calibration():
    """Activations twice as large as predicted, beside weights that are not: the first stage, which
    holds the most micro-batches, gives up a layer to the weight-heavy last stage."""
    profile = PipelineProfile.chain([100] * 8, [10] * 6 + [300] * 2)
    n = len(profile.layers)
    one, two = (stage_peak(profile, 0, n, f) for f in (1, 2))
    doubled = Calibration.from_profile(profile, (one + (two - one), one + 3 * (two - one)))
    assert (doubled.activation_scale, doubled.fixed_offset_bytes) == (2.0, 0)
    assert partition_layers(profile, stages=2, microbatches=4).bounds == [(0, 6), (6, 8)]
    assert partition_layers(doubled.apply(profile), stages=2, microbatches=4).bounds == [(0, 5), (5, 8)]


def test_weights_too_heavy_to_resolve_calibrate_the_fixed_part_only():
    profile = PipelineProfile.chain([10] * 4, [1000] * 4)   # 8000 of weights, 40 a micro-batch
    calibration = Calibration.from_profile(profile, (8300, 8250))
    assert not calibration.resolves_activations
    assert calibration.activation_scale == 1.0
    assert calibration.fixed_offset_bytes == round((8300 - 8040 + 8250 - 8080) / 2)


def test_two_runs_that_do_not_grow_where_the_model_says_they_should_are_refused():
    with pytest.raises(LMSError, match="not above the one with one"):
        Calibration((500, 480), (300, 600))


def _conv_model(name="calibrated_cnn"):
    keras.utils.set_random_seed(4)
    layers = [keras.Input((32, 32, 3))] + [keras.layers.Conv2D(32, 3, padding="same", activation="relu",
                                                               name=f"conv_{i}") for i in range(4)]
    model = keras.Sequential(layers + [keras.layers.GlobalAveragePooling2D(name="pool"),
                                       keras.layers.Dense(10, name="head")], name=name)
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_calibrate_reads_the_real_allocator_leaves_the_model_alone_and_extrapolates_to_a_third_run(caplog):
    model = _conv_model()
    weights = [w.copy() for w in model.get_weights()]
    microbatch = 16
    with caplog.at_level("INFO", logger="lms_tf"):
        partition = lms_tf.partition(model, stages=2, microbatches=4, batch_size=4 * microbatch, calibrate=True)
    calibration = partition.calibration
    assert calibration is not None and calibration.device == "CPU:0" and calibration.resolves_activations
    assert sum("calibration: calibrated_cnn as one stage" in r.getMessage() for r in caplog.records) == 2
    # (both runs are real: the second holds one more micro-batch of activations, at least three of
    # the four convolutions' 2 MiB outputs)
    assert calibration.measured[1] - calibration.measured[0] > 3 * microbatch * 32 * 32 * 32 * 4
    # the user's model and optimizer did not train
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    assert int(model.optimizer.iterations.numpy()) == 0
    # the partition's stages are counted with the calibrated profile
    assert partition.to_dict()["calibration"]["measured_peak_bytes"] == list(calibration.measured)
    assert "calibrated on CPU:0" in str(partition)
    # mCAP's linear extrapolation against a run it was not read from: four micro-batches in flight.
    # Within 10% (the per-stage target): the allocator's chunks move a peak by a few MiB
    # from run to run, a few percent of this one.
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.tf.pipeline import local_kernel_library, trace_profile, whole_model_peak

    profile = trace_profile(model, microbatch=microbatch, cost=CostModel(get_device_spec("v100-16gb-pcie3")),
                            kernels=local_kernel_library())
    real = whole_model_peak(model, profile, microbatch=microbatch, microbatches=4)
    assert abs(calibration.extrapolate(4) - real) / real < 0.10, (calibration.extrapolate(4), real)


def test_calibrate_refuses_what_it_cannot_measure_before_tracing(monkeypatch):
    traced = []
    import lms_tf.tf.pipeline as tf_pipeline

    monkeypatch.setattr(tf_pipeline, "trace_profile", lambda *a, **k: traced.append(1))

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    sub = Subclassed()
    sub(tf.zeros((1, 8)))
    with pytest.raises(LMSOptionError, match="Sequential or Functional"):
        lms_tf.partition(sub, stages=1, microbatches=2, batch_size=4, input_shape=(8,), calibrate=True)
    with pytest.raises(LMSOptionError, match="no GPU"):
        lms_tf.partition(_conv_model(), stages=2, microbatches=2, batch_size=4, devices="v100-16gb-pcie3",
                         calibrate=True)
    with pytest.raises(LMSOptionError, match="calibrate must be True or False; received"):
        lms_tf.partition(_conv_model(), stages=2, microbatches=2, batch_size=4, calibrate="yes")
    assert not traced


def test_calibrate_without_allocator_statistics_says_how_to_turn_them_on():
    code = ("import keras, lms_tf\n"
            "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name='a'), keras.layers.Dense(2, name='b')])\n"
            "try:\n"
            "    lms_tf.partition(m, stages=2, microbatches=2, batch_size=4, calibrate=True)\n"
            "except lms_tf.LMSError as err:\n"
            "    print('ERROR', err)\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(env, TF_CPP_MIN_LOG_LEVEL="3"),
                          capture_output=True, text=True, timeout=240)
    assert "ERROR" in done.stdout and "TF_CPU_ALLOCATOR_USE_BFC=true" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "traced" not in done.stderr   # refused before tracing


def test_the_cli_calibrates_only_for_the_gpu_it_partitions_for(capsys):
    from lms_tf.cli import main

    code = main(["partition", "--model", "unet", "--batch", "8", "--stages", "2", "--microbatches", "2", "--calibrate"])
    assert code != 0
    assert "no GPU" in capsys.readouterr().err
