"""Pipeline partitioning on real Keras models: every family profiled whole (every layer, every weight),
skips and branches cut and counted where they are read, optimal on a real profile, the CLI and the
API's bad input."""

import dataclasses
import json
import subprocess
import sys
import time

import keras
import pytest
import tensorflow as tf

import lms_tf
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.pipeline import evaluate, exhaustive_partition, partition_layers
from lms_tf.tf.pipeline import trace_profile
from lms_tf.tf.workloads import build_model
from tests import zoo

COST = CostModel(get_device_spec("v100-16gb-pcie3"))


def weight_bytes(model) -> int:
    return sum(int(w.numpy().nbytes) for w in model.weights)


@pytest.mark.parametrize("family", ["sequential_cnn", "resnet_style", "inception_style", "text_embedding",
                                    "stacked_recurrent", "shared_multi_input_residual"])
def test_every_layer_and_every_weight_is_in_the_profile(family):
    model, _ = getattr(zoo, family)()
    profile = trace_profile(model, microbatch=4, cost=COST)
    names = [layer.name for layer in profile.layers]
    with_ops = [layer.name for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    assert sorted(names) == sorted(with_ops), (family, set(with_ops) ^ set(names))
    assert sum(layer.param_bytes for layer in profile.layers) == weight_bytes(model)
    assert profile.slot_bytes_per_param_byte == pytest.approx(1.0, abs=0.05)  # the zoo's SGD has momentum
    # Forward order is a topological order of the layer graph: each layer after those it reads.
    position = {name: i for i, name in enumerate(names)}
    for layer in model.layers:
        for node in getattr(layer, "_inbound_nodes", []):
            for parent in getattr(node, "parent_nodes", []):
                source = parent.operation.name
                if source in position and layer.name in position:
                    assert position[source] < position[layer.name], (source, layer.name)
    assert all(l.forward_s > 0 and l.backward_s >= 0 for l in profile.layers if l.param_bytes)


def test_subclassed_model_needs_and_takes_its_input_shape():
    model, _ = zoo.subclassed()
    with pytest.raises(lms_tf.LMSOptionError, match="pass input_shape="):
        trace_profile(model, microbatch=4, cost=COST)
    profile = trace_profile(model, microbatch=4, cost=COST, input_shape=(24, 24, 3))
    assert sum(layer.param_bytes for layer in profile.layers) == weight_bytes(model)
    p = lms_tf.partition(model, stages=2, microbatches=2, batch_size=8, input_shape=(24, 24, 3))
    assert sum(len(s.layers) for s in p.stages) == len(profile.layers)


def test_a_skip_cut_by_a_boundary_is_sent_to_the_later_stage_and_counted_there():
    inputs = keras.Input((64,))
    a = keras.layers.Dense(64, activation="relu", name="a")(inputs)
    b = keras.layers.Dense(64, activation="relu", name="b")(a)
    c = keras.layers.Dense(64, activation="relu", name="c")(b)
    added = keras.layers.Add(name="skip_add")([a, c])  # a skips over b and c
    outputs = keras.layers.Dense(4, activation="softmax", name="head")(added)
    model = keras.Model(inputs, outputs, name="skipnet")
    profile = trace_profile(model, microbatch=8, cost=COST)
    names = [layer.name for layer in profile.layers]
    assert names == ["a", "b", "c", "skip_add", "head"]
    add = profile.layers[names.index("skip_add")]
    produced_by = {t: names[i] for t, _, i in add.inputs}
    assert sorted(produced_by.values()) == ["a", "c"]  # both the skip and the main path arrive
    labels = 8 * 4  # the loss, in the last stage, reads the step's int32 labels: they are sent there too
    # Cut after b: the second stage receives a's output (the skip) and b's (the main path).
    cut = evaluate(profile, [2, 5], microbatches=2)
    assert cut.stages[1].received_bytes == 2 * 8 * 64 * 4 + labels
    # Cut after a: only one tensor crosses, though two readers use it (b and the add).
    assert evaluate(profile, [1, 5], microbatches=2).stages[1].received_bytes == 8 * 64 * 4 + labels


def test_partition_of_a_real_profile_is_optimal():
    model = keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(32 * (1 + i % 3), activation="relu",
                                                                        name=f"d{i}") for i in range(7)]
                             + [keras.layers.Dense(4, activation="softmax", name="head")], name="mlp8")
    profile = trace_profile(model, microbatch=16, cost=COST)
    for stages in (2, 3, 4):
        for schedule in ("1f1b", "gpipe"):
            best, _ = exhaustive_partition(profile, stages=stages, microbatches=4, schedule=schedule)
            found = partition_layers(profile, stages=stages, microbatches=4, schedule=schedule)
            assert found.max_stage_peak_bytes == best, (stages, schedule)


def test_the_memory_rule_beats_the_baselines_on_resnet50():
    profile = trace_profile(build_model("ResNet50", image_size=64, classes=10), microbatch=4, cost=COST)
    results = {rule: partition_layers(profile, stages=4, microbatches=8, rule=rule).max_stage_peak_bytes
               for rule in ("memory", "parameters", "uniform")}
    assert results["memory"] < results["uniform"] < results["parameters"], results


def test_api_checks_its_arguments_before_tracing():
    model = build_model("UNet", image_size=32, classes=2)
    started = time.perf_counter()
    for kwargs, message in [(dict(stages=0), "stages must be a positive int"),
                            (dict(schedule="zigzag"), "schedule must be one of"),
                            (dict(batch_size=10), "does not split into 4 equal micro-batches"),
                            (dict(devices=["v100-16gb-pcie3"]), "one preset per stage"),
                            (dict(devices="no-such-gpu"), "no-such-gpu")]:
        arguments = dict(stages=2, microbatches=4, batch_size=8) | kwargs
        with pytest.raises(lms_tf.LMSOptionError, match=message):
            lms_tf.partition(model, **arguments)
    assert time.perf_counter() - started < 1.0  # nothing was traced
    with pytest.raises(lms_tf.LMSOptionError, match="more than the model's"):
        lms_tf.partition(model, stages=500, microbatches=1, batch_size=2)
    with pytest.raises(lms_tf.InfeasibleBudgetError, match="smallest largest-stage peak any cut reaches"):
        lms_tf.partition(model, stages=2, microbatches=4, batch_size=8, budget="1KiB")


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lms_tf.cli", "partition", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_json_plot_and_exit_codes(tmp_path):
    png = tmp_path / "stages.png"
    done = run_cli("--model", "unet", "--input-shape", "32x32", "--batch", "8", "--stages", "3", "--microbatches", "4",
                   "--device", "v100-16gb-pcie3,h100-80gb-pcie5,v100-16gb-pcie3", "--json", "--plot", str(png))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert [s["device"] for s in result["stages"]] == ["v100-16gb-pcie3", "h100-80gb-pcie5", "v100-16gb-pcie3"]
    assert {"ideal_peak_bytes", "max_stage_peak_bytes", "predicted_step_time_s", "feasible"} <= set(result)
    assert all(s["layers"] and s["predicted_peak_bytes"] > 0 for s in result["stages"])
    assert set(result["compare"]) == {"parameters", "uniform"} and png.stat().st_size > 10_000
    infeasible = run_cli("--model", "unet", "--input-shape", "32x32", "--batch", "8", "--stages", "2",
                         "--microbatches", "4", "--budget", "1KiB")
    assert infeasible.returncode == 3 and "smallest largest-stage peak" in infeasible.stdout
    for bad, message in [(["--stages", "0"], "must be an int >= 1"), (["--device", "nope"], "nope"),
                         (["--schedule", "zigzag"], "invalid choice")]:
        args = ["--model", "unet", "--batch", "8", "--stages", "2", "--microbatches", "4"] + bad
        started = time.perf_counter()
        done = run_cli(*args)
        assert done.returncode == 2 and message in done.stderr, (bad, done.stderr[-500:])
        assert time.perf_counter() - started < 5  # refused while parsing, before TensorFlow is imported


def test_adam_slots_are_counted_and_its_variable_reads_are_not_a_layer():
    """Adam's forward-phase reads of its own variables outnumber the model's (ResNet-152: 2,488 against 932):
    the model's scope is still found, and its slots count twice the weights."""
    model = build_model("ResNet50", image_size=32, classes=10)
    profile = trace_profile(model, microbatch=2, cost=COST, optimizer=keras.optimizers.Adam())
    assert sum(layer.param_bytes for layer in profile.layers) == weight_bytes(model)
    # Adam keeps two slots per trainable weight; BatchNormalization's moving statistics have none.
    trainable = sum(int(w.numpy().nbytes) for w in model.trainable_weights)
    assert profile.slot_bytes_per_param_byte == pytest.approx(2 * trainable / weight_bytes(model), rel=0.01)


def test_a_stage_over_its_budget_swaps_its_waiting_microbatches_on_a_real_model():
    """U-Net (skips crossing stages), GPipe with 4 micro-batches in flight on every stage: under a
    budget below the best cut without swapping, the stages that do not fit swap just what is over
    the budget to the host; ``--no-swap`` reports it does not fit."""
    model = build_model("UNet", image_size=32, classes=2)
    # The CLI's default device: the same kernel scratch (cuDNN's) on both sides.
    arguments = dict(stages=2, microbatches=4, batch_size=8, schedule="gpipe", devices="v100-16gb-pcie3")
    plain = lms_tf.partition(model, **arguments)
    with pytest.raises(lms_tf.InfeasibleBudgetError, match=r"reaches with swapping is") as caught:
        lms_tf.partition(model, **arguments, budget=1)
    least = caught.value.smallest_feasible_bytes
    assert least < plain.max_stage_peak_bytes
    budget = (least + plain.max_stage_peak_bytes) // 2
    with pytest.raises(lms_tf.InfeasibleBudgetError, match=r"reaches is"):
        lms_tf.partition(model, **arguments, budget=budget, swap=False)
    swapped = lms_tf.partition(model, **arguments, budget=budget)
    assert swapped.feasible and swapped.max_stage_peak_bytes <= budget
    assert any(s.host_bytes for s in swapped.stages)
    for s in swapped.stages:
        assert s.host_bytes == 0 or s.predicted_peak_bytes == budget
        assert s.swapped_bytes_per_microbatch == s.host_bytes // s.in_flight
    cli = ["--model", "unet", "--input-shape", "32x32", "--classes", "2", "--batch", "8", "--stages", "2",
           "--microbatches", "4", "--schedule", "gpipe", "--budget", str(budget), "--json"]
    done = run_cli(*cli)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["feasible"] and result["swap"] and result["host_bytes"] == swapped.to_dict()["host_bytes"] > 0
    refused = run_cli(*cli, "--no-swap")
    assert refused.returncode == 3 and '"feasible": false' in refused.stdout
    short = run_cli(*cli, "--host-budget", "1KiB")   # what the swapping stage puts on the host does not fit
    assert short.returncode == 3, short.stderr[-2000:]
    assert json.loads(short.stdout)["host_needed_bytes"] == max(s.host_bytes for s in swapped.stages)


def test_a_stage_over_its_budget_recomputes_on_a_real_model():
    """U-Net, GPipe, 4 micro-batches: under a budget no cut meets keeping activations, stages
    that keep only what they receive (the skips crossing the cut included) and run their forward
    pass again fit it, each at recompute_peak's figure; the CLI's ``--recompute`` says the same."""
    from lms_tf.pipeline import recompute_peak
    from lms_tf.tf.pipeline import trace_profile
    from lms_tf.cost import CostModel, get_device_spec

    model = build_model("UNet", image_size=32, classes=2)
    arguments = dict(stages=2, microbatches=4, batch_size=8, schedule="gpipe", devices="v100-16gb-pcie3", swap=False)
    plain = lms_tf.partition(model, **arguments)
    with pytest.raises(lms_tf.InfeasibleBudgetError, match=r"reaches with recomputing is") as caught:
        lms_tf.partition(model, **arguments, budget=1, recompute=True)
    least = caught.value.smallest_feasible_bytes
    assert least < plain.max_stage_peak_bytes
    budget = (least + plain.max_stage_peak_bytes) // 2
    with pytest.raises(lms_tf.InfeasibleBudgetError, match=r"or let stages recompute \(recompute=True\)"):
        lms_tf.partition(model, **arguments, budget=budget)
    p = lms_tf.partition(model, **arguments, budget=budget, recompute=True)
    assert p.feasible and p.max_stage_peak_bytes <= budget and any(s.recompute for s in p.stages), p.summary()
    profile = trace_profile(model, microbatch=2, cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    for s, (lo, hi) in zip(p.stages, p.bounds):
        if s.recompute:
            assert s.predicted_peak_bytes == recompute_peak(profile, lo, hi, s.in_flight) and not s.host_bytes
    cli = ["--model", "unet", "--input-shape", "32x32", "--classes", "2", "--batch", "8", "--stages", "2",
           "--microbatches", "4", "--schedule", "gpipe", "--budget", str(budget), "--no-swap", "--json"]
    done = run_cli(*cli, "--recompute")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["feasible"] and result["recompute"]
    assert [s["recompute"] for s in result["stages"]] == [s.recompute for s in p.stages]
    assert run_cli(*cli).returncode == 3


def test_each_layers_working_set_holds_its_kernels_scratch_as_the_simulator_counts_it():
    """A convolution's filter gradient takes scratch from the allocator while it runs: on a CPU
    without oneDNN, Eigen's im2col buffer (about 30 MiB whatever the batch), on a GPU cuDNN's
    workspace (about its largest operand), with oneDNN none. Each layer's working set includes
    what its kernels take, read from the same rule as the simulator's, so the per-layer model no
    longer misses it (it read up to 2.3x under a small convolutional stage's real peak)."""
    from lms_tf.simulate import KERNEL_LIBRARIES, kernel_scratch_bytes
    from lms_tf.tf.trace import trace_step_ir
    from lms_tf.tf.workloads import train_step

    model = keras.Sequential([keras.Input((32, 32, 3))] + [
        keras.layers.Conv2D(64, 3, padding="same", activation="relu", name=f"conv_{i}") for i in range(3)]
        + [keras.layers.GlobalAveragePooling2D(name="pool"), keras.layers.Dense(10, name="head")])
    profiles = {k: trace_profile(model, microbatch=16, cost=COST, kernels=k) for k in KERNEL_LIBRARIES}
    ir = trace_step_ir(train_step(model, None), tf.TensorSpec((16, 32, 32, 3)), tf.TensorSpec((16,), tf.int32))
    layers = {layer.name for layer in model.layers}

    def layer(op):  # Keras numbers a layer's scope again each time the model is traced
        scope = op.name.split("/")[2]
        return scope if scope in layers else scope.rsplit("_", 1)[0]

    filter_grads = {layer(op): op for op in ir.ops if op.type == "Conv2DBackpropFilter"}
    assert sorted(filter_grads) == ["conv_0", "conv_1", "conv_2"], sorted(filter_grads)
    eigen = {name: kernel_scratch_bytes(ir, op, "eigen") for name, op in filter_grads.items()}
    # [12, 1024, 576] float32 for 64 input channels; conv_0's 3 input channels unfold to less.
    assert eigen["conv_1"] == eigen["conv_2"] == 12 * 1024 * 576 * 4 and 0 < eigen["conv_0"] < eigen["conv_1"], eigen
    by_name = {k: {layer.name: layer.work_bytes for layer in p.layers} for k, p in profiles.items()}
    for name, scratch in eigen.items():
        # The filter gradient's output gradient (its input is kept, counted apart) plus its
        # scratch, at least; oneDNN takes none.
        assert by_name["eigen"][name] >= scratch + 16 * 32 * 32 * 64 * 4, (name, by_name)
        assert by_name["onednn"][name] < scratch < by_name["eigen"][name], (name, by_name)
        assert by_name["onednn"][name] < by_name["cudnn"][name] < by_name["eigen"][name], (name, by_name)
    # Layers with no convolution are unchanged by the kernel library.
    assert len({by_name[k]["head"] for k in KERNEL_LIBRARIES}) == 1, by_name
    with pytest.raises(lms_tf.LMSOptionError, match="kernels= must be one of 'cudnn', 'eigen', 'onednn'.*got 'mkl'"):
        trace_profile(model, microbatch=16, cost=COST, kernels="mkl")


def test_the_tensors_the_planner_may_not_move_are_pinned_and_stay_on_a_swapping_stage():
    """A Transformer encoder's profile marks as pinned exactly the kept tensors lms-tf's planner
    refuses to move (a constant factor Grappler regroups with a backward op, a value two identical
    backward ops of a LayerNorm read, integer tensors TensorFlow keeps in host memory), and no
    other: a swapping stage's least peak holds those for every micro-batch in flight, on top of
    what any swapping stage keeps."""
    from lms_tf.core.policy import Policies
    from lms_tf.pipeline import stage_peak
    from lms_tf.planner.candidates import collect_candidates
    from lms_tf.tf.trace import trace_step_ir
    from lms_tf.tf.workloads import synthetic_batch, train_step, transformer_encoder

    model = transformer_encoder(seq_len=16, vocab=100, dim=32, heads=2, blocks=2)
    profile = trace_profile(model, microbatch=2, cost=COST)
    ir = trace_step_ir(train_step(model, keras.optimizers.SGD()), *synthetic_batch(model, 2))
    refused = collect_candidates(ir, Policies(), device="/device:GPU:0").kept
    saved = {t for layer in profile.layers for t, _ in layer.saved}
    pinned = {t for layer in profile.layers for t in layer.pinned}
    # the profile traces the same step again, so tensors are matched by name
    assert pinned == {t for t in saved if t in refused} and pinned, (pinned, sorted(refused))
    reasons = {refused[t].reason.split(" (")[0] for t in pinned}
    assert {"constant factor Grappler regroups with a backward reader",
            "read by two identical backward ops that Grappler merges into one"} <= reasons, reasons
    assert sum(b for layer in profile.layers for t, b in layer.saved if t in pinned) < sum(
        b for layer in profile.layers for _, b in layer.saved)
    n = len(profile.layers)
    unpinned = type(profile)(tuple(dataclasses.replace(layer, pinned=()) for layer in profile.layers),
                             profile.slot_bytes_per_param_byte)
    pinned_bytes = sum({t: b for layer in profile.layers for t, b in layer.saved if t in pinned}.values())
    for flight in (1, 4):
        assert stage_peak(profile, 0, n, flight, swap=True) == min(
            stage_peak(profile, 0, n, flight),
            stage_peak(unpinned, 0, n, flight, swap=True) + flight * pinned_bytes)
