"""Numbers: a rewritten step trains to exactly the same losses and weights as the plain step."""

import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.tf.rewrite import LMS_ATTR
from tests import zoo
from tests.helpers import CPU_LMS, assert_same_numbers, custom_loop, fit_steps, lms_function

# Small thresholds so that the small zoo models really swap.
SMALL = dict(CPU_LMS, swapout_threshold=4, min_swap_bytes=1024, swapin_ahead=2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(zoo.FIT_ZOO))
def test_fit_with_callback_equals_plain_fit(name):
    builder = zoo.FIT_ZOO[name]
    plain = fit_steps(builder)
    callback = lms_tf.LMSCallback(**SMALL)
    rewritten = fit_steps(builder, callbacks=[callback])
    assert callback.plan is not None and len(callback.plan.swapped) >= 2, lms_tf.explain(callback)
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(240)
def test_steps_per_execution_above_one():
    plain = fit_steps(zoo.resnet_style, steps_per_execution=3)
    callback = lms_tf.LMSCallback(**SMALL)
    rewritten = fit_steps(zoo.resnet_style, callbacks=[callback], steps_per_execution=3)
    assert callback.plan is not None and callback.plan.swapped
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["sequential_cnn", "resnet_style", "shared_multi_input_residual", "lstm"])
def test_custom_loop_gradient_tape(name):
    builder = zoo.FIT_ZOO[name]
    plain = custom_loop(builder, tf.function)
    rewritten = custom_loop(builder, lms_function(**SMALL))
    fn = rewritten[2]
    assert fn.plan.swapped, lms_tf.explain(fn)
    # Same retracing as tf.function (Keras optimizers create their slots on the first call).
    assert fn.experimental_get_tracing_count() == plain[2].experimental_get_tracing_count()
    assert len(fn.plans) == fn.experimental_get_tracing_count()
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(240)
def test_custom_loop_tf_gradients():
    plain = custom_loop(zoo.resnet_style, tf.function, use_tf_gradients=True)
    rewritten = custom_loop(zoo.resnet_style, lms_function(**SMALL), use_tf_gradients=True)
    assert rewritten[2].plan.swapped
    assert all(".../gradients/" not in t.tensor for t in rewritten[2].plan.swapped)
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(240)
def test_lstm_loop_bodies_are_untouched_and_only_their_accumulated_lists_move():
    _, _, fn = custom_loop(zoo.lstm_model, lms_function(**SMALL), steps=1)
    graph = fn.get_concrete_function(*_lstm_specs()).graph
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert loops, "the LSTM step must contain a while loop"
    for loop in loops:
        body = graph._functions[loop.get_attr("body").name]  # noqa: SLF001 - read-only inspection
        assert not any(n.name.startswith("lms_tf") or "_lms" in n.attr for n in body.definition.node_def)
    assert fn.plan.swapped, "the dense layers around the LSTM are still swapped"
    control_flow = ("While", "StatelessWhile", "If", "StatelessIf")
    for decision in fn.plan.swapped:
        tensor = graph.get_tensor_by_name(decision.tensor)
        if tensor.op.type in control_flow:
            # a forward loop's accumulated per-step values, read by its gradient loop only
            assert tensor.dtype == tf.variant and tensor.op.inputs[tensor.value_index].op.type == "EmptyTensorList"
            assert all(c.type in control_flow and c.name.startswith("gradient_tape/") for c in tensor.consumers()
                       if _compat.string_attr(c, LMS_ATTR) is None)
        else:
            assert not any(c.type in control_flow for c in tensor.consumers())


def _lstm_specs():
    return tf.TensorSpec((zoo.BATCH, 12, 32)), tf.TensorSpec((zoo.BATCH,), tf.int32)
