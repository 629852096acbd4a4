"""``lms-tf max-params``: the widest decoder each way trains, checked against real traces."""

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from lms_tf.cli.max_params import HEAD_SIZE, SAMPLE_WIDTHS, WAYS, largest_models, way_probe
from lms_tf.cli.workload import trace_decoder_widths
from lms_tf.core.ir import ScaledIR
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.tf.workloads import decoder_lm_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(depth=2, seq_len=64, batch=2, vocab=512, head_size=HEAD_SIZE)
MiB = 2**20


def _traced_apart(widths):
    """:func:`trace_decoder_widths` in a child process. At the widest answers the traced step's
    weights and Adam slots are real variables of several GB, and the BFC allocator the suite runs
    the CPU with keeps what it took until the process ends: traced here, they stayed in the pytest
    worker (10.7 GB) beside later tests that start processes of their own."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(trace_decoder_widths, widths, **SHAPE).result()


def _small_device(memory_bytes, host_bytes):
    """A V100 NVLink with less memory, so the answers are widths a test can trace for real."""
    spec = get_device_spec("v100-32gb-nvlink2")
    return CostModel(dataclasses.replace(spec, name="small", memory_bytes=memory_bytes, host_memory_bytes=host_bytes))


@pytest.mark.timeout(900)
def test_each_answer_fits_and_the_next_width_does_not_when_traced_for_real():
    """For every way, the answer found on the arithmetic sizes (ScaledIR) is checked on real
    traces: the decoder traced at the answer fits, traced one head wider does not. The ways
    rank as they must: with the slots on the host at least as wide as plain, activations
    planned at least as wide as plain, weights and activations the widest (and by a margin:
    the weights are most of this step's memory)."""
    cost = _small_device(1536 * MiB, 64 * 2**30)
    scaled = ScaledIR.fit(trace_decoder_widths(SAMPLE_WIDTHS, **SHAPE))
    found = largest_models(scaled.at, cost, depth=SHAPE["depth"], vocab=SHAPE["vocab"], max_width=8192,
                           device="/device:GPU:0", host="/device:CPU:0", host_budget=64 * 2**30, progress=False)
    for way in WAYS:
        width = found[way]["width"]
        assert width >= SAMPLE_WIDTHS[0], (way, found[way])
        assert found[way]["params"] == decoder_lm_params(width, SHAPE["depth"], SHAPE["vocab"])
        real = _traced_apart((width, width + HEAD_SIZE))
        probe = way_probe(real.__getitem__, way, cost, device="/device:GPU:0", host="/device:CPU:0",
                          host_budget=64 * 2**30)
        step = width // HEAD_SIZE - 1
        assert probe(step).fits and not probe(step + 1).fits, (way, width)
    params = {way: found[way]["params"] for way in WAYS}
    assert params["optimizer_on_host"] > params["plain"] and params["activations_planned"] >= params["plain"]
    assert params["weights_and_activations"] > 1.5 * max(params[w] for w in WAYS[:3]), params
    best = found["weights_and_activations"]
    assert best["predicted_overhead"] >= 1.0 and best["overhead_vs_link_lower_bound"] >= 1.0
    assert best["host_bytes"] <= 64 * 2**30


@pytest.mark.timeout(900)
def test_a_small_host_budget_caps_weights_on_the_host_by_the_host_memory_they_need():
    """With the host allowed little more than the plain answer's variables, weights on the host
    stop where their host memory runs out, not where the device does: the answer's host memory is
    within the budget, and one head wider it is not."""
    cost = _small_device(1536 * MiB, None)
    scaled = ScaledIR.fit(trace_decoder_widths(SAMPLE_WIDTHS, **SHAPE))
    roomy = largest_models(scaled.at, cost, depth=SHAPE["depth"], vocab=SHAPE["vocab"], max_width=8192,
                           device="/device:GPU:0", host="/device:CPU:0", host_budget=64 * 2**30, progress=False)
    budget = roomy["weights_and_activations"]["host_bytes"] // 2
    tight = largest_models(scaled.at, cost, depth=SHAPE["depth"], vocab=SHAPE["vocab"], max_width=8192,
                           device="/device:GPU:0", host="/device:CPU:0", host_budget=budget, progress=False)
    best = tight["weights_and_activations"]
    assert 0 < best["width"] < roomy["weights_and_activations"]["width"] and best["host_bytes"] <= budget
    wider = way_probe(scaled.at, "weights_and_activations", cost, device="/device:GPU:0", host="/device:CPU:0",
                      host_budget=budget)(best["width"] // HEAD_SIZE)
    assert not wider.fits and wider.budget_bytes ** 2 <= budget < (wider.budget_bytes + 1) ** 2


@pytest.mark.timeout(900)
def test_the_command_prints_the_four_answers_as_json():
    env = dict(os.environ, PYTHONPATH=ROOT)
    argv = [sys.executable, "-m", "lms_tf.cli", "max-params", "--device", "v100-16gb-pcie3", "--depth", "2",
            "--seq-len", "64", "--vocab", "512", "--json"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("params_plain", "params_optimizer_on_host", "params_activations_planned",
                "params_weights_and_activations", "predicted_overhead"):
        assert key in result, key
    assert result["host_budget_bytes"] == get_device_spec("v100-16gb-pcie3").host_memory_bytes
    assert 0 < result["params_plain"] < result["params_weights_and_activations"]
    assert all(result[f"width_{way}"] < 65536 for way in WAYS)  # answers, not the cap (--max-width)
    assert result["ratio"] == round(result["params_weights_and_activations"] / result["params_plain"], 2)
    for way in WAYS:
        assert result[f"params_{way}"] == decoder_lm_params(result[f"width_{way}"], 2, 512)
