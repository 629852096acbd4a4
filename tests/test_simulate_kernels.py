"""The simulator's kernel-library memory rules (``simulate(kernels=)``) against TensorFlow's kernels.

A convolution on a GPU holds cuDNN's workspace while it runs; the simulator counts scratch the
size of its largest operand (``"cudnn"``, also used for TensorFlow's Eigen CPU kernels). oneDNN,
TensorFlow's default CPU kernels on x86, takes no convolution scratch from TensorFlow's allocator,
but its max pool writes a workspace output, one byte per element, that the pool's gradient reads
(``"onednn"``). The known answers are checked on a hand-built step, and the rule itself against
the allocation trace of TensorFlow's real CPU allocator with oneDNN on (a subprocess: oneDNN and
the BFC allocator are chosen when TensorFlow starts).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.plan import Decision
from lms_tf.core.policy import Policies
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_plan
from lms_tf.simulate import simulate
from lms_tf.simulate.lower import POOL_WORKSPACE
from lms_tf.tf.trace import build_ir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V100 = CostModel(get_device_spec("v100-16gb-pcie3"))
POOL_ELEMENTS = 4 * 16 * 16 * 16  # the pool output [4, 16, 16, 16]

STEP = """
kernels = [tf.Variable(tf.random.stateless_normal(shape, seed=(1, i)))
           for i, shape in enumerate([(3, 3, 8, 16), (3, 3, 16, 16), (3, 3, 16, 16)])]

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        h = tf.nn.relu(tf.nn.conv2d(x, kernels[0], 1, "SAME"))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        for kernel in kernels[1:]:
            h = tf.nn.relu(tf.nn.conv2d(h, kernel, 1, "SAME"))
        loss = tf.reduce_sum(h * h)
    return tape.gradient(loss, kernels)

x = tf.random.stateless_normal((4, 32, 32, 8), seed=(3, 4))
"""


@pytest.fixture(scope="module")
def conv_pool_ir():
    scope = {"tf": tf}
    exec(STEP, scope)
    return build_ir(scope["step"].get_concrete_function(scope["x"]).graph)


def _only(ir, op_type):
    (op,) = [op for op in ir.ops if op.type == op_type]
    return op


def _events(sim):
    return [(event, key) for event, key, _ in sim.allocations]


def test_onednn_keeps_a_pool_workspace_until_the_gradient_and_takes_no_convolution_scratch(conv_pool_ir):
    ir = conv_pool_ir
    pool, pool_grad = _only(ir, "MaxPool"), _only(ir, "MaxPoolGrad")
    workspace = pool.outputs[0] + POOL_WORKSPACE
    cudnn = simulate(ir, cost=V100, log_allocations=True)
    onednn = simulate(ir, cost=V100, log_allocations=True, kernels="onednn")
    cudnn_allocs = {key: nbytes for event, key, nbytes in cudnn.allocations if event == "alloc"}
    onednn_allocs = {key: nbytes for event, key, nbytes in onednn.allocations if event == "alloc"}

    # cuDNN: convolution scratch the size of the largest operand, no pool workspace.
    conv_scratch = {key: nbytes for key, nbytes in cudnn_allocs.items() if key.startswith("workspace/")}
    first_conv = next(op for op in ir.ops if op.type == "Conv2D")
    assert conv_scratch["workspace/" + first_conv.name] == 4 * 32 * 32 * 8 * 4  # its largest input
    assert workspace not in cudnn_allocs
    # oneDNN: no convolution scratch; the pool's workspace, one byte per output element, is
    # allocated with the pool and freed after its gradient ran.
    assert not any(key.startswith("workspace/") for key in onednn_allocs)
    assert onednn_allocs[workspace] == POOL_ELEMENTS
    events = _events(onednn)
    assert events.index(("alloc", pool.outputs[0])) < events.index(("alloc", workspace))
    assert events.index(("alloc", pool_grad.outputs[0])) < events.index(("free", workspace))
    # Eigen's kernels are modelled like cuDNN's, except its filter gradients' fixed-size im2col
    # buffers (checked against TensorFlow's trace below).
    eigen = simulate(ir, cost=V100, log_allocations=True, kernels="eigen")
    eigen_scratch = {key: nbytes for event, key, nbytes in eigen.allocations if event == "alloc"
                     and key.startswith("workspace/")}
    for key, nbytes in conv_scratch.items():
        if ir.op(key[len("workspace/"):]).type == "Conv2DBackpropFilter":
            assert eigen_scratch[key] > nbytes, key
        else:
            assert eigen_scratch[key] == nbytes, key


def test_a_swapped_pool_output_leaves_its_workspace_for_the_gradient(conv_pool_ir):
    ir = conv_pool_ir
    pool, pool_grad = _only(ir, "MaxPool"), _only(ir, "MaxPoolGrad")
    plan = make_plan(ir, Policies(host="/CPU:1", min_swap_bytes=1, swapout_threshold=1),
                     device="/device:CPU:0")
    decision = {d.tensor: d for d in plan.decisions}[pool.outputs[0]]
    assert decision.decision is Decision.SWAP and pool_grad.name in decision.swap_ins[0].consumers
    sim = simulate(ir, plan, cost=V100, log_allocations=True, kernels="onednn")
    events = _events(sim)
    workspace = pool.outputs[0] + POOL_WORKSPACE
    assert events.index(("free", pool.outputs[0])) < events.index(("free", workspace))  # the pool output left
    assert events.index(("alloc", pool_grad.outputs[0])) < events.index(("free", workspace))


def test_an_unknown_kernel_library_is_an_error(conv_pool_ir):
    with pytest.raises(LMSOptionError, match=r"kernels=.*'cudnn', 'eigen', 'onednn'.*got 'cuda'"):
        simulate(conv_pool_ir, cost=V100, kernels="cuda")


REAL_HEAD = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import tensorflow as tf
    sys.path.insert(0, {root!r})
    from lms_tf.tf.diagnostics import allocation_trace, cpu_kernel_library
""")
REAL_TAIL = textwrap.dedent("""
    step(x)
    events = allocation_trace(lambda: step(x)[0].numpy())
    print("RESULT " + json.dumps({"kernels": cpu_kernel_library(),
                                  "events": [[e.kind, e.op, e.region_type, e.requested_bytes, e.address, e.shape]
                                             for e in events]}))
""")


def _real_trace(onednn: bool):
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1" if onednn else "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", REAL_HEAD.format(root=ROOT) + STEP + REAL_TAIL],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(300)
def test_the_onednn_rules_are_what_tensorflows_cpu_allocator_saw(conv_pool_ir):
    real = _real_trace(onednn=True)
    assert real["kernels"] == "onednn"
    events = real["events"]
    allocs = [(i, op, region, nbytes, address) for i, (kind, op, region, nbytes, address, _) in enumerate(events)
              if kind == "alloc"]
    # The pool allocated its output and a second buffer of one byte per element ...
    pool_outputs = [(i, nbytes, address) for i, op, region, nbytes, address in allocs
                    if op.endswith("MaxPool2d") and region == "output"]
    assert [nbytes for _, nbytes, _ in pool_outputs] == [POOL_ELEMENTS * 4, POOL_ELEMENTS]
    index, _, address = pool_outputs[1]
    # ... which stayed allocated until after the pool's gradient allocated its output,
    grad = next(i for i, op, region, _, _ in allocs if op.endswith("MaxPoolGrad") and region == "output")
    freed = next(i for i, (kind, _, _, _, a, _) in enumerate(events) if kind == "free" and a == address and i > index)
    assert index < grad < freed
    # and no convolution took scratch of an operand's size from TensorFlow's allocator.
    conv_temps = [nbytes for _, op, region, nbytes, _ in allocs if region == "temp" and "Conv2D" in op]
    assert all(nbytes < 64 * 1024 for nbytes in conv_temps), conv_temps
    # The simulator's oneDNN log has the same pool buffers and no convolution scratch.
    sim = simulate(conv_pool_ir, cost=V100, log_allocations=True, kernels="onednn")
    pool = _only(conv_pool_ir, "MaxPool")
    simulated = {key: nbytes for event, key, nbytes in sim.allocations if event == "alloc"}
    assert [simulated[pool.outputs[0]], simulated[pool.outputs[0] + POOL_WORKSPACE]] == \
        [nbytes for _, nbytes, _ in pool_outputs]
    assert not any(key.startswith("workspace/") for key in simulated)


@pytest.mark.timeout(300)
def test_eigens_filter_gradient_scratch_is_what_tensorflows_cpu_allocator_saw(conv_pool_ir):
    """TensorFlow's CPU filter gradient sizes its im2col buffer for a 30 MiB working set, not by
    the batch: far more than the step's tensors here (batch 4, 32x32, 8-16 channels)."""
    from lms_tf.simulate.lower import _eigen_workspace

    real = _real_trace(onednn=False)
    assert real["kernels"] == "eigen"
    temps = sorted(nbytes for kind, op, region, nbytes, _, _ in real["events"]
                   if kind == "alloc" and region == "temp" and "Conv2DBackpropFilter" in op)
    predicted = sorted(_eigen_workspace(conv_pool_ir, op) for op in conv_pool_ir.ops
                       if op.type == "Conv2DBackpropFilter")
    assert len(predicted) == 3 and temps == predicted, (temps, predicted)
    assert min(predicted) > 20 * 2**20


@pytest.mark.timeout(300)
def test_without_onednn_the_pool_writes_no_workspace():
    real = _real_trace(onednn=False)
    assert real["kernels"] == "eigen"
    pool_outputs = [nbytes for kind, op, region, nbytes, _, _ in real["events"]
                    if kind == "alloc" and op.endswith("MaxPool2d") and region == "output"]
    assert pool_outputs == [POOL_ELEMENTS * 4]
