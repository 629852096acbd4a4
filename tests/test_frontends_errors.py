"""Errors say what was wrong and how to fix it; front-ends leave what they must untouched."""

import logging
import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf.core import errors as lms_errors
from lms_tf.core.errors import LMSError, LMSOptionError, LMSWarning
from lms_tf.tf.rewrite import count_lms_ops
from tests import zoo
from tests.helpers import CPU_LMS, assert_same_numbers, custom_loop, fit_steps, lms_function
from tests.test_frontends_numbers import SMALL


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(swapin_ahead=0), "swapin_ahead must be an int >= 1; received 0"),
    (dict(swapin_ahead=2.5), "received 2.5 (float)"),
    (dict(swapout_threshold="10"), "swapout_threshold must be an int >= 1; received '10' (str)"),
    (dict(min_swap_bytes=-1), "min_swap_bytes must be an int >= 0"),
    (dict(swapin_groupby=True), "swapin_groupby must be an int"),
    (dict(device="GPU0"), "device='GPU0'"),
    (dict(host=3), "host must be a device string"),
    (dict(device="/CPU:1", host="/CPU:1"), "device and host are the same device"),
    (dict(exclude=[1, 2]), "exclude must be a list of layer names"),
    (dict(batch_size=0), "batch_size must be an int >= 1"),
    (dict(swapin_ahaed=2), "unknown option 'swapin_ahaed'. Did you mean 'swapin_ahead'?"),
    (dict(bucket_bytes=1024), "bucket_bytes=1024 sizes the gradient allreduces of horovod=True, which is not set"),
    (dict(bucket_bytes=None), "bucket_bytes=None sizes the gradient allreduces of horovod=True, which is not set"),
])
@pytest.mark.parametrize("front_end", ["callback", "function"])
def test_bad_options_raise_at_construction(kwargs, fragment, front_end):
    with pytest.raises(LMSOptionError) as info:
        if front_end == "callback":
            lms_tf.LMSCallback(**kwargs)
        else:
            lms_tf.function(lambda x: x, **kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, LMSError)


@pytest.mark.parametrize("bad", [0, 2.5, True, "4MiB"])
def test_a_bad_bucket_size_is_refused(bad):
    with pytest.raises(LMSOptionError, match=r"bucket_bytes must be None or an int >= 1 \(bytes per gradient bucket\)"):
        lms_tf.function(lambda x: x, horovod=True, bucket_bytes=bad)


def test_jit_compile_true_is_refused_by_the_function():
    with pytest.raises(LMSOptionError, match="jit_compile=True"):
        lms_tf.function(lambda x: x, jit_compile=True)


@pytest.mark.timeout(120)
def test_run_eagerly_is_refused_by_the_callback():
    model, (x, y) = zoo.sequential_cnn(run_eagerly=True)
    with pytest.raises(LMSOptionError, match="run_eagerly=True"):
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0, callbacks=[lms_tf.LMSCallback(**CPU_LMS)])


@pytest.mark.timeout(120)
def test_functions_run_eagerly_is_refused_by_the_function():
    fn = lms_tf.function(lambda x: x * 2.0, **CPU_LMS)
    tf.config.run_functions_eagerly(True)
    try:
        with pytest.raises(LMSError, match="runs eagerly"):
            fn(tf.constant(1.0))
    finally:
        tf.config.run_functions_eagerly(False)


@pytest.mark.timeout(120)
def test_unknown_exclude_name_is_an_error_naming_known_layers():
    callback = lms_tf.LMSCallback(exclude=["no_such_layer"], **SMALL)
    with pytest.raises(LMSOptionError) as info:
        fit_steps(zoo.sequential_cnn, callbacks=[callback])
    assert "'no_such_layer' is not a layer name" in str(info.value) and "conv0_1" in str(info.value)
    with pytest.raises(LMSOptionError, match="matches no op"):
        fit_steps(zoo.sequential_cnn, callbacks=[lms_tf.LMSCallback(exclude=["*/nothing_*"], **SMALL)])


@pytest.mark.timeout(120)
def test_exclude_keeps_the_layer_and_numbers_stay_equal():
    plain = fit_steps(zoo.sequential_cnn)
    callback = lms_tf.LMSCallback(exclude=["conv1"], **SMALL)
    rewritten = fit_steps(zoo.sequential_cnn, callbacks=[callback])
    conv1 = [d for d in callback.plan.decisions if "/conv1_1/" in d.tensor]
    assert any(d.reason == "excluded by 'conv1'" for d in conv1)
    assert not any(d.decision is lms_tf.Decision.SWAP for d in conv1)
    assert any("/conv2_1/" in d.tensor for d in callback.plan.swapped)
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(120)
def test_unresolvable_batch_dimension_leaves_the_trace_untouched_with_a_warning_naming_the_tensor():
    w = tf.Variable(tf.ones((64, 64)))

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for _ in range(6):
                h = tf.nn.relu(h @ w)
            loss = tf.reduce_sum(h)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        return loss

    fn = lms_tf.function(step, min_swap_bytes=1, swapout_threshold=2, **CPU_LMS)
    lms_errors._warned.clear()  # "once" is per process
    with pytest.warns(LMSWarning, match=r"tensor 'Relu.*has shape \(None, 64\).*left untouched.*batch_size="):
        fn.get_concrete_function(tf.TensorSpec((None, 64)))
    assert fn.plans == [None]  # the trace is left as TensorFlow built it
    # The same step resolves the batch dimension from a concrete call ...
    sized = lms_tf.function(step, min_swap_bytes=1, swapout_threshold=2,
                            input_signature=[tf.TensorSpec((None, 64))], **CPU_LMS)
    sized(tf.ones((16, 64)))
    assert sized.plan.swapped and sized.plan.swapped[0].shape == (16, 64)
    # ... or from batch_size=.
    explicit = lms_tf.function(step, min_swap_bytes=1, swapout_threshold=2, batch_size=4, **CPU_LMS)
    explicit.get_concrete_function(tf.TensorSpec((None, 64)))
    assert explicit.plan.swapped[0].nbytes == 4 * 64 * 4


@pytest.mark.timeout(120)
def test_no_accelerator_leaves_the_step_untouched_and_warns_once(caplog):
    assert not tf.config.list_logical_devices("GPU")
    lms_errors._warned.clear()  # "once" is per process; start this test from a clean slate
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="lms_tf"):
        warnings.simplefilter("always")
        plain = custom_loop(zoo.sequential_cnn, tf.function)
        untouched = custom_loop(zoo.sequential_cnn, lms_function())
        custom_loop(zoo.sequential_cnn, lms_function())
    fn = untouched[2]
    assert fn.plan is None
    assert count_lms_ops(fn.get_concrete_function(tf.TensorSpec((zoo.BATCH, 24, 24, 3)),
                                                  tf.TensorSpec((zoo.BATCH,), tf.int32)).graph) == {}
    messages = [str(w.message) for w in caught if issubclass(w.category, LMSWarning)]
    assert len([m for m in messages if "lms_tf.function: no GPU" in m]) == 1, messages
    assert "left untouched" in messages[0] and "device='/CPU:0', host='/CPU:1'" in messages[0]
    # One message, once: not also a log line; and it quotes the line that called the step (the
    # test's loop), not lms-tf's, Keras's or TensorFlow's code.
    assert not [r for r in caplog.records if "no GPU" in r.getMessage()]
    (warning,) = [w for w in caught if issubclass(w.category, LMSWarning) and "no GPU" in str(w.message)]
    assert os.path.dirname(warning.filename) == os.path.dirname(os.path.abspath(__file__)), warning.filename
    assert_same_numbers(plain, untouched)


@pytest.mark.timeout(180)
def test_callback_turns_jit_off_for_training_and_restores_the_model():
    model, (x, y) = zoo.sequential_cnn()
    # Keras resolves jit_compile to False on a CPU-only machine; set what it resolves to on a GPU.
    model._jit_compile = True
    callback = lms_tf.LMSCallback(**SMALL)
    with pytest.warns(LMSWarning, match="turning jit_compile off"):
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0, callbacks=[callback])
    assert callback.plan is not None and callback.plan.swapped
    assert model.jit_compile is True
    assert "train_step" not in model.__dict__ and model.train_function is None


@pytest.mark.timeout(180)
def test_evaluate_predict_and_save_are_untouched(tmp_path):
    model, (x, y) = zoo.resnet_style()
    callback = lms_tf.LMSCallback(**SMALL)
    model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0, callbacks=[callback])
    assert callback.plan.swapped
    traces = len(callback.plans)
    loss = model.evaluate(x, y, batch_size=zoo.BATCH, verbose=0)
    predictions = model.predict(x, batch_size=zoo.BATCH, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    np.testing.assert_array_equal(restored.predict(x, batch_size=zoo.BATCH, verbose=0), predictions)
    assert np.isfinite(loss)
    # A later fit without the callback trains the plain step.
    model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0)
    assert len(callback.plans) == traces, "evaluate, predict and a plain fit must not run the pass"


@pytest.mark.timeout(120)
def test_explain_prints_the_plan_and_refuses_untraced_objects():
    _, _, fn = custom_loop(zoo.sequential_cnn, lms_function(**SMALL), steps=1)
    text = lms_tf.explain(fn)
    assert text.splitlines()[0] == fn.plan.one_line()
    assert "trigger -> consumers" in text and "gradient_tape/" in text
    assert lms_tf.LMSCallback().plan is None
    with pytest.raises(LMSError, match="has no plan yet"):
        lms_tf.explain(lms_tf.function(lambda x: x, **CPU_LMS))
    with pytest.raises(LMSError, match="takes an lms_tf.function"):
        lms_tf.explain(42)
    data = fn.plan.to_dict()
    assert data["totals"]["num_swapped"] == len(fn.plan.swapped) and data["decisions"][0]["decision"] in ("keep", "swap")


@pytest.mark.timeout(120)
def test_method_decoration_binds_per_instance():
    class Trainer:
        def __init__(self):
            self.w = tf.Variable(tf.ones((32, 32)))

        @lms_tf.function(min_swap_bytes=1, swapout_threshold=2, **CPU_LMS)
        def step(self, x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.nn.relu(tf.nn.relu(x @ self.w) @ self.w))
            self.w.assign_sub(0.001 * tape.gradient(loss, self.w))
            return loss

    a, b = Trainer(), Trainer()
    assert float(a.step(tf.ones((8, 32)))) == float(b.step(tf.ones((8, 32))))
    assert a.step is a.step and a.step is not b.step and a.step.plan is not None


@pytest.mark.timeout(120)
def test_callback_without_accelerator_leaves_fit_untouched_and_warns():
    lms_errors._warned.clear()  # "once" is per process; start this test from a clean slate
    plain = fit_steps(zoo.sequential_cnn)
    callback = lms_tf.LMSCallback()
    with pytest.warns(LMSWarning, match="LMSCallback: no GPU is visible"):
        untouched = fit_steps(zoo.sequential_cnn, callbacks=[callback])
    assert callback.plan is None and "train_step" not in untouched[2].__dict__
    assert_same_numbers(plain, untouched)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices, named", [(dict(device="/GPU:7", host="/CPU:1"), "device='/device:GPU:7'"),
                                            (dict(device="/CPU:0", host="/CPU:5"), "host='/device:CPU:5'")])
def test_a_device_tensorflow_cannot_see_is_refused_listing_the_visible_ones(devices, named):
    """A typo in device= or host= must not plan and train silently on nothing."""
    rule = re.escape(named) + r" names no device TensorFlow can see; visible: /device:CPU:0, /device:CPU:1"
    model, (x, y) = zoo.sequential_cnn()
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(LMSOptionError, match=rule):
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0, callbacks=[lms_tf.LMSCallback(**devices)])
    assert "train_step" not in model.__dict__  # nothing was wrapped, nothing trained
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    with pytest.raises(LMSOptionError, match=rule):
        lms_tf.function(lambda v: v * 2.0, **devices)(tf.constant(1.0))


@pytest.mark.timeout(120)
def test_a_fit_logs_its_plan_once(caplog):
    from lms_tf.tf import driver

    driver._last_logged[0] = ""  # noqa: SLF001 - a clean slate: "once" compares with the last line logged
    callback = lms_tf.LMSCallback(**SMALL)
    with caplog.at_level(logging.INFO, logger="lms_tf"):
        fit_steps(zoo.sequential_cnn, callbacks=[callback])  # Keras traces the step twice
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lms-tf: swapped")]
    assert len(lines) == 1 and callback.plan.one_line() in lines[0], lines
