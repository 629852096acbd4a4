"""Steps traced with an unknown batch dimension: ``tf.data`` pipelines with a partial last batch.

``Dataset.batch(n)`` without ``drop_remainder`` gives the train step a ``None`` batch dimension.
lms-tf reads ``n`` from the pipeline and plans for it; the same rewritten step then also runs
the shorter last batch, so the numbers must be the plain fit's, bit for bit.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core import errors as lms_errors
from lms_tf.core.errors import LMSWarning
from tests import zoo
from tests.helpers import CPU_LMS, LossRecorder, assert_same_numbers, keras_train_step

BATCH = 10  # the zoo's 24 samples give batches of 10, 10 and 4
OPTIONS = {
    "swap": dict(CPU_LMS, min_swap_bytes=1024, swapout_threshold=1),
    "recompute": dict(device="/CPU:0", swap=False, recompute="sqrt"),
    # 85%: with its update ordered as TensorFlow orders it (RMSprop reads a slot after writing it),
    # the inception net's least plan needs 81% of its plain peak.
    "budget": dict(CPU_LMS, budget="85%", device_spec="v100-16gb-pcie3"),
}


def _dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(1)


def fit_dataset(builder, callbacks=(), epochs=2, optimizer=None, make_dataset=_dataset):
    model, (x, y) = builder()
    if optimizer is not None:  # RMSprop's square root shows a last-bit change quickly
        model.compile(optimizer=optimizer(), loss=model.loss)
    recorder = LossRecorder()
    model.fit(make_dataset(x, y, BATCH), epochs=epochs, verbose=0, callbacks=[recorder, *callbacks])
    return recorder.losses, [np.array(w) for w in model.get_weights()], model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(OPTIONS))
@pytest.mark.parametrize("name", ["sequential_cnn", "resnet_style", "inception_style", "subclassed"])
def test_fit_on_a_dataset_with_a_partial_last_batch_equals_the_plain_fit(name, mode):
    builder = zoo.FIT_ZOO[name]
    plain = fit_dataset(builder, optimizer=keras.optimizers.RMSprop)
    callback = lms_tf.LMSCallback(**OPTIONS[mode])
    with warnings.catch_warnings():
        warnings.simplefilter("error", LMSWarning)  # planned, not left untouched
        rewritten = fit_dataset(builder, callbacks=[callback], optimizer=keras.optimizers.RMSprop)
    assert len(plain[0]) == 6  # 2 epochs x (10 + 10 + 4)
    plan = callback.plan
    assert plan is not None and (plan.swapped or plan.recomputed), lms_tf.explain(callback)
    # Planned for the pipeline's batch of 10, the largest it yields: the input's size says so.
    model, (x, _) = builder()
    sample_bytes = int(np.prod(x.shape[1:])) * 4
    sizes = [d.nbytes for d in plan.decisions if d.nbytes]
    assert sizes and max(sizes) >= BATCH * sample_bytes // 4, (max(sizes), sample_bytes)
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(300)
def test_the_pipeline_batch_is_read_from_the_dataset_not_its_first_element():
    for pipeline, expected in [
        (lambda d: d.batch(7), 7),
        (lambda d: d.shuffle(8, seed=1).batch(5).map(lambda a, b: (a * 2.0, b)).prefetch(2), 5),
        (lambda d: d.batch(3, num_parallel_calls=2, deterministic=True), 3),
        (lambda d: d.padded_batch(4), 4),
        (lambda d: d.batch(2).unbatch().batch(6).cache(), 6),
        (lambda d: d.batch(4).unbatch(), None),  # per-example again: no batch size to read
        (lambda d: d, None),
    ]:
        data = tf.data.Dataset.from_tensor_slices((tf.zeros((20, 3)), tf.zeros((20,))))
        assert _compat.dataset_batch_size(pipeline(data)) == expected


@pytest.mark.timeout(300)
def test_a_batch_size_nothing_can_read_leaves_the_step_untouched_with_a_warning():
    def generated(x, y, batch):
        def batches():
            for start in range(0, len(x), batch):
                yield x[start:start + batch], y[start:start + batch]
        spec = (tf.TensorSpec((None,) + x.shape[1:], tf.float32), tf.TensorSpec((None,), tf.int32))
        return tf.data.Dataset.from_generator(batches, output_signature=spec)

    plain = fit_dataset(zoo.sequential_cnn, make_dataset=generated)
    lms_errors._warned.clear()  # "once" is per process; start this test from a clean slate
    callback = lms_tf.LMSCallback(**OPTIONS["swap"])
    with pytest.warns(LMSWarning, match=r"has shape \(None, .* no batch size .* left untouched.*batch_size="):
        rewritten = fit_dataset(zoo.sequential_cnn, callbacks=[callback], make_dataset=generated)
    assert callback.plan is None
    assert_same_numbers(plain, rewritten)
    # The explicit override plans it, and still trains to the same numbers.
    callback = lms_tf.LMSCallback(batch_size=BATCH, **OPTIONS["swap"])
    overridden = fit_dataset(zoo.sequential_cnn, callbacks=[callback], make_dataset=generated)
    assert callback.plan is not None and callback.plan.swapped
    assert_same_numbers(plain, overridden)


@pytest.mark.timeout(300)
def test_a_generalised_trace_of_lms_tf_function_is_planned_for_the_largest_batch():
    model, (x, y) = zoo.sequential_cnn()
    fn = lms_tf.function(keras_train_step(model), reduce_retracing=True, **OPTIONS["swap"])
    for size in (10, 4):  # the second, shorter batch makes TensorFlow retrace with a None batch dimension
        fn(tf.constant(x[:size]), tf.constant(y[:size]))
    generalised_inputs = fn.get_concrete_function(tf.constant(x[:4]), tf.constant(y[:4])).structured_input_signature
    assert generalised_inputs[0][0].shape.as_list()[0] is None
    first, generalised = fn.plans[0], fn.plans[-1]
    assert generalised is not None
    assert sum(d.nbytes for d in generalised.swapped) == sum(d.nbytes for d in first.swapped) > 0
