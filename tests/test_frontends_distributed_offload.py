"""optimizer_on_host, and the in-process parts of the Horovod integration (one rank).

The two-rank behaviour (averaging, broadcast, pipelining, failure) is in test_frontends_horovod.py.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf.core.errors import LMSError, LMSOptionError, LMSWarning
from lms_tf.horovod import allreduce_gradients, backward_order, bucket_by_bytes
from lms_tf.keras import DistributedCallback
from lms_tf.keras.step_hooks import add_step_hook
from lms_tf.tf.diagnostics import virtual_gpu_peak
from lms_tf.tf.variables import variable_bytes_by_device
from tests import zoo
from tests.helpers import (
    CPU_LMS,
    assert_same_numbers,
    custom_loop,
    fit_steps,
    graph_probe,
    keras_train_step,
    lms_function,
    numbers_epochs,
)

HOST = "/job:localhost/replica:0/task:0/device:CPU:1"
DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
OFFLOAD_ZOO = ["sequential_cnn", "resnet_style", "subclassed", "shared_multi_input_residual"]


# --- optimizer_on_host --------------------------------------------------------------------------

@pytest.mark.parametrize("name", OFFLOAD_ZOO)
def test_optimizer_on_host_numbers_equal_the_plain_fit(name):
    builder = zoo.FIT_ZOO[name]
    plain = fit_steps(builder)
    offloaded = fit_steps(builder, callbacks=[lms_tf.LMSCallback(**CPU_LMS, swap=False, optimizer_on_host=True)])
    assert_same_numbers(plain, offloaded)


def test_optimizer_on_host_with_swap_and_recompute_numbers_equal():
    plain = fit_steps(zoo.resnet_style)
    both = fit_steps(zoo.resnet_style, callbacks=[lms_tf.LMSCallback(**CPU_LMS, min_swap_bytes=0, recompute="cheap",
                                                                    optimizer_on_host=True)])
    assert_same_numbers(plain, both)
    slots = [v for v in both[2].optimizer.variables if "momentum" in v.path]
    assert set(variable_bytes_by_device(slots)) == {HOST}


def test_optimizer_on_host_moves_every_slot_byte_to_the_host():
    _, _, plain_model = fit_steps(zoo.resnet_style)
    _, _, model = fit_steps(zoo.resnet_style, callbacks=[lms_tf.LMSCallback(**CPU_LMS, swap=False,
                                                                           optimizer_on_host=True)])
    model_bytes = sum(variable_bytes_by_device(model.variables).values())
    trainable_bytes = sum(variable_bytes_by_device(model.trainable_variables).values())
    plain = variable_bytes_by_device(plain_model.variables + plain_model.optimizer.variables)
    offloaded = variable_bytes_by_device(model.variables + model.optimizer.variables)
    # SGD with momentum: one slot per trainable variable, the size of the model's trainable weights.
    assert plain == {DEVICE: model_bytes + trainable_bytes + 8 + 4}  # + iteration (int64), learning_rate
    assert offloaded == {DEVICE: model_bytes + 8 + 4, HOST: trainable_bytes}


def test_optimizer_on_host_places_the_update_arithmetic_on_the_host():
    """SGD with momentum: per weight, the momentum's update (``m * 0.9 - g * lr``, which reads
    the slot) runs on the host; the gradient's product with the learning rate stays on the
    device, reading the gradient itself, as Grappler regroups it with the gradient's own
    products in the plain step (the numbers tests check the rounding is the plain step's)."""
    model, (x, y) = zoo.sequential_cnn()
    facts = {}
    add_step_hook(model, graph_probe(facts))
    model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0,
              callbacks=[lms_tf.LMSCallback(**CPU_LMS, swap=False, optimizer_on_host=True)])
    prefix = model.optimizer.name + "/"
    update_math = [op for op in facts["graph"].get_operations()
                   if op.name.startswith(prefix) and op.type in ("Mul", "Sub", "AddV2")]
    on_host = [op for op in update_math if op.device == "/device:CPU:1"]
    on_device = [op for op in update_math if op.device != "/device:CPU:1"]
    assert len(on_host) == 2 * len(model.trainable_variables), [op.name for op in on_host]
    assert len(on_device) == len(model.trainable_variables) and all(op.type == "Mul" for op in on_device)
    for op in on_device:   # the gradient itself and the learning rate, nothing from a slot
        assert any(not t.op.name.startswith(prefix) for t in op.inputs), [t.name for t in op.inputs]
        assert all(t.shape.rank == 0 for t in op.inputs if t.op.name.startswith(prefix)), op.name


def _adam_step_concrete(decorate):
    """The traced custom-loop Adam step of resnet_style (the optimizer's slots created in it)."""
    model, (x, y) = zoo.resnet_style()
    optimizer = keras.optimizers.Adam()
    concrete = decorate(keras_train_step(model, optimizer)).get_concrete_function(tf.constant(x[:zoo.BATCH]), tf.constant(y[:zoo.BATCH]))
    return concrete, (model, optimizer)  # the function holds its variables weakly


def test_grappler_oracle_shows_adam_slots_leave_the_gpu():
    plain, (model, _optimizer) = _adam_step_concrete(tf.function)
    offloaded, _alive = _adam_step_concrete(lms_function(**CPU_LMS, swap=False, optimizer_on_host=True))
    slot_bytes = 2 * sum(variable_bytes_by_device(model.trainable_variables).values())  # Adam: m and v
    before = virtual_gpu_peak(plain, host=CPU_LMS["host"], include_variables=True)
    after = virtual_gpu_peak(offloaded, host=CPU_LMS["host"], include_variables=True)
    transient_before = virtual_gpu_peak(plain, host=CPU_LMS["host"])
    transient_after = virtual_gpu_peak(offloaded, host=CPU_LMS["host"])
    assert before - after == slot_bytes + (transient_before - transient_after), (before, after, slot_bytes)
    assert transient_after <= transient_before  # the update's temporaries moved too, nothing grew
    assert after < before - 0.9 * slot_bytes


def test_optimizer_on_host_in_a_custom_loop_numbers_equal():
    plain = custom_loop(zoo.resnet_style, tf.function)
    offloaded = custom_loop(zoo.resnet_style, lms_function(**CPU_LMS, swap=False, optimizer_on_host=True))
    assert_same_numbers(plain, offloaded)


def test_optimizer_built_before_the_step_warns_and_still_trains_correctly():
    plain = fit_steps(zoo.sequential_cnn)
    model, (x, y) = zoo.sequential_cnn()
    model.optimizer.build(model.trainable_variables)  # slots now exist on the device
    with pytest.warns(LMSWarning, match="slot variables of optimizer .* are not on /device:CPU:1 .*built before"):
        model.fit(x, y, batch_size=zoo.BATCH, epochs=numbers_epochs(x), shuffle=False, verbose=0,
                  callbacks=[lms_tf.LMSCallback(**CPU_LMS, swap=False, optimizer_on_host=True)])
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in model.get_weights()]),
                                  np.concatenate([w.ravel() for w in plain[1]]))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(optimizer_on_host="yes"), "optimizer_on_host must be True or False"),
    (dict(horovod=1), "horovod must be True or False"),
    (dict(device="/CPU:1", host="/CPU:1", swap=False, optimizer_on_host=True), "same device"),
    (dict(swap=False), "leave nothing to do"),
])
def test_bad_distributed_options_raise(kwargs, fragment):
    with pytest.raises(LMSOptionError, match=fragment):
        lms_tf.function(lambda x: x, **kwargs)


# --- Horovod, one rank ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fragment", [
    (dict(root_rank=-1), "root_rank must be an int >= 0; received -1"),
    (dict(root_rank=1), "root_rank=1 but the job has 1 rank"),
    (dict(bucket_bytes=0), "bucket_bytes must be None or an int >= 1"),
    (dict(bucket_bytes=True), "received True"),
    (dict(average_metrics="yes"), "average_metrics must be True or False"),
])
def test_distributed_callback_rejects_bad_arguments(kwargs, fragment):
    with pytest.raises(LMSOptionError, match=fragment):
        DistributedCallback(**kwargs)


def test_lms_callback_points_fit_users_to_distributed_callback():
    model, (x, y) = zoo.sequential_cnn()
    with pytest.raises(LMSOptionError, match="add lms_tf.keras.DistributedCallback"):
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0, callbacks=[lms_tf.LMSCallback(horovod=True)])


def test_horovod_step_without_an_optimizer_update_is_an_error():
    variable = tf.Variable(1.0)

    @lms_tf.function(horovod=True, **CPU_LMS)
    def step(x):
        with tf.GradientTape() as tape:
            loss = variable * x
        variable.assign_sub(0.1 * tape.gradient(loss, variable))  # no optimizer: nothing to average at
        return loss

    with pytest.raises(LMSOptionError, match="updated no variables through a Keras optimizer"):
        step(tf.constant(2.0))


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_distributed_callback_detects_a_train_step_without_optimizer(steps_per_execution):
    """The check runs after the first call of the train function, whatever step number Keras reports
    for it (with steps_per_execution=3 the first call ends at step 2)."""
    zoo.reseed(0)
    class ManualUpdate(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x) - y))
            for var, grad in zip(self.trainable_variables, tape.gradient(loss, self.trainable_variables)):
                var.assign_sub(0.01 * grad)
            return {"loss": loss}

    inputs = keras.Input((4,))
    model = ManualUpdate(inputs, keras.layers.Dense(2)(inputs))
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    with pytest.raises(LMSError, match="updated no variables through a Keras optimizer"):
        model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=2, epochs=1, verbose=0,
                  callbacks=[DistributedCallback()])


def test_distributed_callback_refuses_eager_models():
    model, (x, y) = zoo.sequential_cnn(run_eagerly=True)
    with pytest.raises(LMSOptionError, match="runs eagerly"):
        model.fit(x, y, batch_size=zoo.BATCH, epochs=1, verbose=0, callbacks=[DistributedCallback()])


@pytest.mark.parametrize("lms_first", [True, False])
def test_one_rank_distributed_fit_is_bit_identical_and_leaves_the_model_clean(lms_first):
    """With one rank the average is the gradient itself: lms-tf beside the averaging changes no
    number of the same averaged fit without it, and after fit the model's own train_step is back
    (the next fit traces the plain step). Against the plain fit (no allreduce) the numbers agree
    to float32 rounding, not bit for bit: on one device Grappler regroups the update's product
    with the learning rate into the gradient's own products (a BatchNormalization scale's
    ``(dy * rsqrt) * lr`` runs as ``(lr * dy) * rsqrt``), and the allreduce between them, there
    in any Horovod step, stops that. Over 12 steps of momentum SGD those last bits grow to a few
    units in the last place of the weights (measured: 1.8e-7 on a weight of 0.03, 1.2e-7 on one
    of 5e-7), so the plain fit is compared by its losses."""
    plain = fit_steps(zoo.resnet_style)
    averaged = fit_steps(zoo.resnet_style, callbacks=[DistributedCallback(bucket_bytes=1)])
    callbacks = [lms_tf.LMSCallback(**CPU_LMS, min_swap_bytes=0), DistributedCallback(bucket_bytes=1)]
    distributed = fit_steps(zoo.resnet_style, callbacks=callbacks if lms_first else callbacks[::-1])
    assert_same_numbers(averaged, distributed)
    np.testing.assert_allclose(plain[0], distributed[0], rtol=1e-6)
    model = distributed[2]
    assert "train_step" not in model.__dict__ and model.train_function is None


def test_backward_order_follows_gradient_creation_in_a_trace():
    dense_a, dense_b = keras.layers.Dense(3), keras.layers.Dense(2)
    model = keras.Sequential([keras.Input((4,)), dense_a, dense_b])
    seen = {}

    @tf.function
    def grads_order(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)  # [a.kernel, a.bias, b.kernel, b.bias]
        seen["order"] = backward_order(grads)
        return loss

    grads_order(tf.ones((2, 4)))
    order = seen["order"]
    assert sorted(order) == [0, 1, 2, 3]
    assert max(order.index(2), order.index(3)) < min(order.index(0), order.index(1)), order  # b before a


def test_bucket_by_bytes_fills_in_order_and_isolates_oversized_tensors():
    assert bucket_by_bytes([3, 2, 1, 0], [10, 100, 10, 10], bucket_bytes=25) == [[3, 2], [1], [0]]
    assert bucket_by_bytes([1, 0], [4, 4], bucket_bytes=None) == [[1, 0]]
    assert bucket_by_bytes([], [], bucket_bytes=8) == []


def test_allreduce_keeps_sparse_and_missing_gradients_in_place():
    dense = tf.constant([1.0, 2.0])
    sparse = tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([0]), tf.constant([3, 2]))
    averaged = allreduce_gradients([dense, None, sparse], bucket_bytes=4)
    np.testing.assert_array_equal(averaged[0].numpy(), [1.0, 2.0])
    assert averaged[1] is None
    assert isinstance(averaged[2], tf.IndexedSlices)
    np.testing.assert_array_equal(tf.convert_to_tensor(averaged[2]).numpy(), [[1, 1], [0, 0], [0, 0]])


def test_no_warning_when_everything_is_in_order():
    with warnings.catch_warnings():
        warnings.simplefilter("error", LMSWarning)
        fit_steps(zoo.sequential_cnn, callbacks=[lms_tf.LMSCallback(**CPU_LMS, swap=False, optimizer_on_host=True),
                                                 DistributedCallback()])


# --- Horovod with the update on the host: average before or after the move ----------------------

def _placed(device: str) -> str:
    """An op's device in full; an op traced without one runs on the step's (the placer's default)."""
    if not device:
        return DEVICE
    spec = tf.DeviceSpec.from_string(device)
    return f"/job:localhost/replica:0/task:0/device:{spec.device_type}:{spec.device_index}"


def _allreduce_placement(step) -> list:
    """For each gradient allreduce of ``step``'s graph: its device, and for each of its inputs the
    type and device of the op that makes it and of that op's first input."""
    model, (x, y) = zoo.resnet_style()
    graph = step.get_concrete_function(tf.constant(x[:zoo.BATCH]), tf.constant(y[:zoo.BATCH])).graph
    return [(_placed(op.device), [(t.op.type, _placed(t.op.device), _placed(t.op.inputs[0].op.device))
                                  for t in op.inputs])
            for op in graph.get_operations() if op.type.startswith("HorovodGroupedAllreduce")]


@pytest.mark.parametrize("average_on, device_spec, where", [
    ("device", None, DEVICE),
    ("host", None, HOST),
    # The cost model's choice: on PCIe cards the devices' allreduce crosses the link the copies
    # use (v100-16gb-pcie3: averaging on the host is cheaper); NVLink does not (v100-32gb-nvlink2).
    ("auto", "v100-16gb-pcie3", HOST),
    ("auto", "v100-32gb-nvlink2", DEVICE),
    # No GPU and no device spec: nothing to compare, the average stays where the gradients are.
    ("auto", None, DEVICE),
])
def test_gradients_are_averaged_where_the_cost_model_says(average_on, device_spec, where, monkeypatch):
    """With the update on the host, each bucket's allreduce runs on the device (before the move)
    or on the host (after it: each gradient is first copied there as soon as it is complete), as
    asked or as the cost model decides; the numbers are those of averaging on the device.

    One rank has nothing to average (both places cost nothing), so the cost model is asked as
    for a job of 4 ranks: the hook sees ``size() == 4``, while the allreduces run on the one."""
    import lms_tf.horovod as lms_horovod

    real = lms_horovod.horovod_tensorflow()

    class FourRanks:
        def __getattr__(self, name):
            return getattr(real, name)

        def size(self):
            return 4

    monkeypatch.setattr(lms_horovod, "horovod_tensorflow", FourRanks)
    options = dict(**CPU_LMS, swap=False, optimizer_on_host=True, horovod=True, bucket_bytes=1)
    on_device = custom_loop(zoo.resnet_style, lms_function(**options, average_on="device"))
    got = custom_loop(zoo.resnet_style, lms_function(**options, average_on=average_on, device_spec=device_spec))
    assert_same_numbers(on_device, got)
    placement = _allreduce_placement(got[2])
    assert len(placement) > 5  # one allreduce a bucket, one bucket a gradient
    for device, inputs in placement:
        assert device == where, placement
        for op_type, op_device, source_device in inputs:
            if where == HOST:  # a copy on the host of a gradient made on the device
                assert (op_type, op_device, source_device) == ("Identity", HOST, DEVICE), inputs
            else:
                assert op_device == DEVICE, inputs


def test_average_on_is_checked_before_tracing():
    with pytest.raises(LMSOptionError, match="average_on must be one of 'auto', 'device', 'host'; received 'gpu'"):
        lms_tf.function(lambda x: x, **CPU_LMS, horovod=True, average_on="gpu")
    with pytest.raises(LMSOptionError, match="average_on='host' averages the gradients after they move to the host"):
        lms_tf.function(lambda x: x, **CPU_LMS, horovod=True, average_on="host")
    with pytest.raises(LMSOptionError, match="average_on='host'"):
        lms_tf.LMSCallback(**CPU_LMS, average_on="host")
