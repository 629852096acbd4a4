"""Plans as files: made by the CLI, saved, loaded, edited and applied through both front-ends with ``plan=``.

A plan applied from its file must rewrite the step exactly as planning in place does (same inserted
ops, same numbers), an edit must take effect, and a plan for another step must be refused before
anything is rewritten.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core.plan import Decision, Plan
from lms_tf.keras.step_hooks import add_step_hook, remove_step_hook
from lms_tf.tf.workloads import build_model, synthetic_batch, train_step
from tests import zoo
from tests.helpers import LossRecorder, assert_same_numbers, graph_probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(image_size=32, classes=10)
BATCH, STEPS, SPEC, BUDGET = 4, 3, "v100-16gb-pcie3", "50%"


def _cli_plan(tmp_path, step: str) -> str:
    out = str(tmp_path / f"{step}.json")
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, "-m", "lms_tf.cli", "plan", "--model", "mobilenetv2", "--input-shape", "32x32",
         "--classes", "10", "--batch", str(BATCH), "--budget", BUDGET, "--device", SPEC, "--step", step,
         "--no-oracle", "--json", "--out", out], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["plan_file"] == out
    return out


def _batches(model):
    return [synthetic_batch(model, BATCH, seed=i) for i in range(STEPS)]


def _inserted(graph) -> list:
    """Every op the rewrite inserted, with what it reads and waits for, and who reads it."""
    rows = []
    for op in graph.get_operations():
        kind = _compat.string_attr(op, "_lms")
        if kind:
            rows.append((kind, op.name, op.type, tuple(t.name for t in op.inputs),
                         tuple(sorted(c.name for c in op.control_inputs)),
                         tuple(sorted(c.name for t in op.outputs for c in t.consumers()))))
    return sorted(rows)


def _fresh_model():
    """The model as a fresh process builds it: Keras numbers unnamed layers per process, and a plan
    names tensors by their layers, so the names must be the ones the CLI's process gave them."""
    zoo.reseed(0)
    return build_model("MobileNetV2", **MODEL)


def _custom_loop(plain=False, **lms):
    model = _fresh_model()
    fn = tf.function(train_step(model)) if plain else lms_tf.function(train_step(model), device="/CPU:0",
                                                                       host="/CPU:1", **lms)
    batches = _batches(model)
    losses = [float(fn(x, y)) for x, y in batches]
    graph = fn.get_concrete_function(*batches[0]).graph
    return losses, [np.array(w) for w in model.get_weights()], getattr(fn, "plan", None), graph


def _fit(**lms):
    model = _fresh_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy())
    x = np.concatenate([b[0].numpy() for b in _batches(model)])
    y = np.concatenate([b[1].numpy() for b in _batches(model)])
    facts, recorder = {}, LossRecorder()
    probe = graph_probe(facts)
    add_step_hook(model, probe)
    callback = lms_tf.LMSCallback(device="/CPU:0", host="/CPU:1", **lms)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder, callback])
    finally:
        remove_step_hook(model, probe)
    return recorder.losses, [np.array(w) for w in model.get_weights()], callback.plan, facts["graph"]


@pytest.mark.timeout(600)
def test_a_cli_plan_applied_by_lms_tf_function_rewrites_and_trains_as_planning_in_place(tmp_path):
    path = _cli_plan(tmp_path, "custom")
    in_place = _custom_loop(budget=BUDGET, device_spec=SPEC)
    from_file = _custom_loop(plan=path)
    assert in_place[2].swapped or in_place[2].recomputed
    # the same decisions, the same inserted ops, the same numbers (exactly)
    assert Plan.from_json(open(path).read()).decisions == in_place[2].decisions
    assert from_file[2].decisions == in_place[2].decisions
    assert _inserted(from_file[3]) == _inserted(in_place[3]) != []
    assert_same_numbers(in_place, from_file)
    assert_same_numbers(_custom_loop(plain=True), from_file)


@pytest.mark.timeout(600)
def test_a_cli_plan_for_fit_applied_by_lms_callback_rewrites_and_trains_as_planning_in_place(tmp_path):
    path = _cli_plan(tmp_path, "fit")
    in_place = _fit(budget=BUDGET, device_spec=SPEC)
    from_file = _fit(plan=path)
    assert in_place[2].swapped or in_place[2].recomputed
    assert from_file[2].decisions == in_place[2].decisions
    assert _inserted(from_file[3]) == _inserted(in_place[3]) != []
    assert_same_numbers(in_place, from_file)


@pytest.mark.timeout(600)
def test_an_edited_plan_applies_with_the_edit(tmp_path):
    path = _cli_plan(tmp_path, "custom")
    data = json.load(open(path))
    swapped = [d for d in data["decisions"] if d["decision"] == "swap"]
    assert len(swapped) >= 2
    edited_tensor = swapped[0]["tensor"]
    swapped[0].update(decision="keep", swap_ins=[], swap_out_before=None, reason="kept by hand")
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))

    original = _custom_loop(plan=path)
    changed = _custom_loop(plan=str(edited))
    assert changed[2].decisions != original[2].decisions
    kept = next(d for d in changed[2].decisions if d.tensor == edited_tensor)
    assert kept.decision is Decision.KEEP and kept.reason == "kept by hand"
    # the graph: the edited tensor has no copy out any more; every other swap is still there
    copied_out = lambda graph: {op.inputs[0].name for op in graph.get_operations()  # noqa: E731
                                if _compat.string_attr(op, "_lms") == "swap_out"}
    assert edited_tensor in copied_out(original[3])
    assert copied_out(changed[3]) == copied_out(original[3]) - {edited_tensor}
    assert_same_numbers(original, changed)


@pytest.mark.timeout(600)
def test_a_plan_for_another_step_is_refused_naming_the_first_mismatch(tmp_path):
    path = _cli_plan(tmp_path, "custom")
    model, (x, y) = zoo.sequential_cnn()
    fn = lms_tf.function(train_step(model), device="/CPU:0", host="/CPU:1", plan=path)
    first = r"plan does not match the traced step: tensor 'x:0' has shape \(8, 24, 24, 3\) here, \(4, 32, 32, 3\) in the plan"
    with pytest.raises(lms_tf.LMSOptionError, match=first):
        fn(tf.constant(x[:zoo.BATCH]), tf.constant(y[:zoo.BATCH]))
    # nothing was rewritten or run: the model's weights are the ones it was built with
    fresh, _ = zoo.sequential_cnn()
    for a, b in zip(model.get_weights(), fresh.get_weights()):
        assert np.array_equal(a, b)


def test_a_plan_file_of_another_schema_or_none_at_all_is_refused(tmp_path):
    wrong = tmp_path / "old.json"
    wrong.write_text(json.dumps({"schema_version": 0, "decisions": []}))
    with pytest.raises(lms_tf.LMSOptionError, match="schema version 1: found schema_version=0"):
        lms_tf.LMSCallback(plan=str(wrong))
    with pytest.raises(lms_tf.LMSOptionError, match="cannot be read"):
        lms_tf.function(lambda x: x, plan=str(tmp_path / "missing.json"))
    with pytest.raises(lms_tf.LMSOptionError, match="plan= and budget="):
        lms_tf.LMSCallback(plan=Plan((), "d", "h", {}, {}), budget="50%")


def test_plan_json_round_trips_every_field():
    from lms_tf.core.plan import Ordering, Predictions, SwapIn, TensorDecision

    decisions = (
        TensorDecision("a:0", "l", (2, 3), 24, Decision.SWAP, "swap", 40, (SwapIn("g1", ("c1", "c2")),),
                       swap_out_before="f2"),
        TensorDecision("b:0", "l", (2,), 8, Decision.RECOMPUTE, "recompute (sqrt)", 9, (),
                       recompute_ops=("r1", "r2"), gate="g0", consumers=("c3",)),
        TensorDecision("c:0", "", None, None, Decision.KEEP, "function input", 1, ()),
    )
    plan = Plan(decisions, "/device:GPU:0", "/device:CPU:0", {"budget": 0.25}, {"forward": 3}, budget_bytes=99,
                device_spec="v100-16gb-pcie3", orderings=(Ordering(("w",), ("a1", "a2"), "why"),),
                predictions=Predictions(10, 5, 6, 1.0, 1.5, True, bytes_to_host=24, bytes_to_device=48))
    assert Plan.from_json(plan.to_json()) == plan
