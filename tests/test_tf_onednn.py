"""oneDNN's CPU graph rewrites (on by default on CPUs with AVX512-VNNI/BF16) with rewritten steps.

The rest of the suite runs with ``TF_ENABLE_ONEDNN_OPTS=0`` (machine-independent numbers). Here a
subprocess turns it on and trains VGG16 (MaxPool, Conv2D+BiasAdd, fused by oneDNN with their
gradients) with recompute, swap + recompute, and swap. Before gates had to descend from the
deepest forward op, recompute="sqrt" on this model failed at run time with "82 nodes in a
cycle" once oneDNN rewrote the graph (an early gate, a cloned MaxPool whose gradient oneDNN
pairs with its workspace, and a BiasAddGrad gate oneDNN fuses into Conv2DBackpropFilter).
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.experimental.enable_op_determinism()
    sys.path.insert(0, {root!r})
    import lms_tf
    from lms_tf.tf.workloads import build_model, synthetic_batch, train_step
    from tests.test_tf_recompute import residual_mlp

    def run(name, decorate):
        keras.utils.set_random_seed(0)
        if name == "VGG16":
            model, steps, batch = build_model("VGG16", image_size=64, classes=100), 3, 2
        else:
            model, steps, batch = residual_mlp(), 8, 32
        x, y = synthetic_batch(model, batch)
        step = decorate(train_step(model, keras.optimizers.SGD(0.1 if name == "residual_mlp" else 0.01)))
        return [float(step(x, y)) for _ in range(steps)], [w.numpy() for w in model.weights], step

    for name in ("VGG16", "residual_mlp"):
        plain_losses, plain_weights, _ = run(name, tf.function)
        for options in (dict(device="/CPU:0", swap=False, recompute="sqrt"),
                        dict(device="/CPU:0", host="/CPU:1", recompute="sqrt", min_swap_bytes=1, swapout_threshold=1),
                        dict(device="/CPU:0", host="/CPU:1", min_swap_bytes=1, swapout_threshold=1)):
            losses, weights, step = run(name, lambda f: lms_tf.function(f, **options))
            assert losses == plain_losses, (name, options, losses, plain_losses)
            assert all(np.array_equal(a, b) for a, b in zip(weights, plain_weights)), (name, options)
            assert step.plan.recomputed or step.plan.swapped
            print("OK", name, options, len(step.plan.recomputed), len(step.plan.swapped))
""")


@pytest.mark.timeout(600)
def test_rewritten_vgg_steps_run_with_onednn_rewrites_on():
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT)], capture_output=True, text=True,
                         timeout=580, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("OK") == 6, out.stdout
