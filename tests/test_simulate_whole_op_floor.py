"""The least device memory of any plan that runs each op whole (``whole_op_floor``): no plan the
planner makes goes below it, and a budget under it is refused naming the op."""

import re

import pytest
import tensorflow as tf

from lms_tf.core.errors import InfeasibleBudgetError
from lms_tf.core.ir import make_ir
from lms_tf.core.policy import Policies, format_bytes
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.planner.weights import plan_weights
from lms_tf.simulate import resident_bytes, simulate, whole_op_floor
from lms_tf.tf.trace import build_ir
from lms_tf.tf.workloads import train_step
from tests import zoo

V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
MiB = 2**20
FAMILIES = ["resnet_style", "inception_style", "text_embedding", "lstm_model", "shared_multi_input_residual"]


def _step_ir(family):
    model, data = getattr(zoo, family)()
    x, y = data[0] if isinstance(data, list) else data
    fn = tf.function(train_step(model))
    first = tf.nest.map_structure(lambda t: t[:zoo.BATCH], (x, y))
    return build_ir(fn.get_concrete_function(*first).graph)


def _least(ir, policies):
    """The smallest budget the planner reaches (its error's figure for a budget of one byte)."""
    with pytest.raises(InfeasibleBudgetError) as info:
        make_budget_plan(ir, policies.replace(budget=1), device="/device:GPU:0", cost=V100)
    return info.value


@pytest.mark.parametrize("family", FAMILIES)
def test_no_plan_goes_below_the_largest_op(family):
    ir = _step_ir(family)
    floor = whole_op_floor(ir)
    assert floor is not None and floor.nbytes > 0
    # the plain step, and the lowest plan with the weights resident and with them on the host,
    # each with the variables the device still holds
    assert simulate(ir, cost=V100).peak_bytes + resident_bytes(ir) >= floor.nbytes
    on_device = Policies(host="/CPU:1", recompute="auto", budget="auto")
    err = _least(ir, on_device)
    assert err.smallest_feasible_bytes + resident_bytes(ir) >= floor.nbytes
    assert repr(floor.op) in str(err) and floor.op_type in str(err)
    on_host = on_device.replace(weights="host")
    moved = {w.variable for w in plan_weights(ir, on_host)}
    assert moved
    assert _least(ir, on_host).smallest_feasible_bytes + resident_bytes(ir, moved) >= floor.nbytes


def _conv_backward_ir():
    """A convolution's backward pass whose input gradient needs the image, the gradient it reads,
    the one it writes and cuDNN's workspace (the largest operand) at once: 4 x 8 MiB."""
    image = (8, 64, 64, 64)   # float32: 8 MiB
    return make_ir([
        dict(name="x", type="Placeholder", outputs=[("x:0", image)]),
        dict(name="w", type="Placeholder", outputs=[("w:0", (3, 3, 64, 64))]),
        dict(name="y", type="Conv2D", inputs=["x:0", "w:0"], outputs=[("y:0", image)]),
        dict(name="r", type="Relu", inputs=["y:0"], outputs=[("r:0", image)]),
        dict(name="loss", type="Sum", inputs=["r:0"], outputs=[("loss:0", (1,))]),
        dict(name="dr", type="OnesLike", phase="backward", inputs=["r:0"], outputs=[("dr:0", image)]),
        dict(name="dy", type="ReluGrad", phase="backward", inputs=["dr:0", "r:0"], outputs=[("dy:0", image)]),
        dict(name="sizes", type="Const", phase="backward", outputs=[("sizes:0", (4,))]),
        dict(name="dx", type="Conv2DBackpropInput", phase="backward", inputs=["sizes:0", "w:0", "dy:0"],
             outputs=[("dx:0", image)]),
        dict(name="dw", type="Conv2DBackpropFilter", phase="backward", inputs=["x:0", "sizes:0", "dy:0"],
             outputs=[("dw:0", (3, 3, 64, 64))]),
    ], function_inputs=["x", "w"])


def test_the_largest_op_counts_its_operands_its_output_and_its_workspace():
    ir = _conv_backward_ir()
    kernel, sizes = 3 * 3 * 64 * 64 * 4, 16
    # The input gradient holds the kernel, the gradient it reads, the one it writes and a workspace
    # of the largest operand; the forward convolution reads no sizes, so it holds 16 bytes less, and
    # the filter gradient (the image, the gradient, its output and a workspace) as much: the first stays.
    floor = whole_op_floor(ir)
    assert (floor.op, floor.op_type, floor.nbytes) == ("dx", "Conv2DBackpropInput", 3 * 8 * MiB + kernel + sizes)
    # CPU kernels without scratch: the two gradients' operands
    assert whole_op_floor(ir, kernels="onednn").nbytes == 2 * 8 * MiB + kernel + sizes
    # an elementwise kernel that writes into an input of its output's size is counted once
    relu = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (MiB,))]),
                    dict(name="r", type="Relu", inputs=["x:0"], outputs=[("r:0", (MiB,))]),
                    dict(name="m", type="MatMul", inputs=["r:0", "r:0"], outputs=[("m:0", (1,))])])
    assert whole_op_floor(relu) == whole_op_floor(relu, kernels="onednn")
    assert whole_op_floor(relu).nbytes == 4 * MiB + 4   # the MatMul reads r once, and writes 4 bytes


def test_a_budget_below_the_largest_op_is_refused_naming_it():
    ir = _conv_backward_ir()
    floor = whole_op_floor(ir)
    with pytest.raises(InfeasibleBudgetError, match=re.escape(f"'dx' (Conv2DBackpropInput), holds "
                                                              f"{format_bytes(floor.nbytes)} while it runs")):
        make_budget_plan(ir, Policies(host="/CPU:1", recompute="auto", budget=floor.nbytes // 2),
                         device="/device:GPU:0", cost=V100)


def test_a_cudnn_workspace_cap_is_counted_where_the_process_sets_it(monkeypatch):
    """``TF_CUDNN_WORKSPACE_LIMIT_IN_MB`` caps what the simulator counts for a convolution's
    workspace (the presets read it; a DeviceSpec takes it as a field), in the floor, the replay
    and the budget error; a value TensorFlow would not read is refused."""
    import dataclasses

    from lms_tf.core.errors import LMSOptionError
    from lms_tf.cost.devices import WORKSPACE_LIMIT_VARIABLE

    ir = _conv_backward_ir()
    kernel, sizes = 3 * 3 * 64 * 64 * 4, 16
    monkeypatch.delenv(WORKSPACE_LIMIT_VARIABLE, raising=False)
    assert get_device_spec("v100-16gb-pcie3").cudnn_workspace_limit_bytes is None
    uncapped = simulate(ir, cost=V100)
    monkeypatch.setenv(WORKSPACE_LIMIT_VARIABLE, "2")
    spec = get_device_spec("v100-16gb-pcie3")
    assert spec.cudnn_workspace_limit_bytes == 2 * MiB
    assert spec == dataclasses.replace(V100.device, cudnn_workspace_limit_bytes=2 * MiB)
    capped = simulate(ir, cost=CostModel(spec))
    assert uncapped.peak_bytes - capped.peak_bytes == 6 * MiB, (uncapped.peak_bytes, capped.peak_bytes)
    floor = whole_op_floor(ir, cudnn_workspace_limit=2 * MiB)
    assert floor.nbytes == 2 * 8 * MiB + 2 * MiB + kernel + sizes
    with pytest.raises(InfeasibleBudgetError) as info:
        make_budget_plan(ir, Policies(host="/CPU:1", recompute="auto", budget=floor.nbytes // 2),
                         device="/device:GPU:0", cost=CostModel(spec))
    assert format_bytes(floor.nbytes) in str(info.value) and WORKSPACE_LIMIT_VARIABLE not in str(info.value)
    with pytest.raises(InfeasibleBudgetError, match=WORKSPACE_LIMIT_VARIABLE):  # uncapped: the hint
        make_budget_plan(ir, Policies(host="/CPU:1", recompute="auto", budget=floor.nbytes // 2),
                         device="/device:GPU:0", cost=V100)
    monkeypatch.setenv(WORKSPACE_LIMIT_VARIABLE, "2GB")
    with pytest.raises(LMSOptionError, match="whole number of MiB.*'2GB'"):
        get_device_spec("v100-16gb-pcie3")
