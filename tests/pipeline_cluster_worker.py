"""Task 0 of a pipeline cluster: connects to the stage processes and trains the zoo's models as
pipelines across them, beside single-device gradient accumulation in this process.

    python tests/pipeline_cluster_worker.py host:port,host:port,... name,schedule,stages ...
    lms-tf launch --stages K -- python tests/pipeline_cluster_worker.py - name,schedule,stages ...

Prints one ``RESULT <json>`` line: per case, whether the losses and every weight are identical,
and the devices the stages' kernels ran on. ``--memory`` and ``--calibration`` are the
measurements of ``benchmarks/pipeline_memory.py`` (see :func:`memory` and :func:`calibration`).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import lms_tf  # noqa: E402
from lms_tf.tf.pipeline_step import PipelineStep  # noqa: E402
from tests import test_pipeline_execution as cases  # noqa: E402


def connect(workers):
    """``-``: the addresses ``lms-tf launch`` put in ``LMS_TF_WORKERS``."""
    return lms_tf.connect_stages(None if workers == "-" else workers, timeout=60)


def main(workers, specs):
    """Each spec is ``name,schedule,stages[,swap]``; with ``swap``, every stage swaps to
    ``/CPU:1`` of its own process (the stage servers have two logical CPUs)."""
    devices = connect(workers)
    rows = []
    for spec in specs:
        name, schedule, stages, *swap = spec.split(",")
        made = {}

        def pipelined(model, schedule=schedule, stages=int(stages), swap=swap == ["swap"]):
            step = PipelineStep(model, cases.contiguous(model, stages), microbatches=cases.MICROBATCHES,
                                schedule=schedule, devices=devices[:stages], swap=swap,
                                host="/CPU:1" if swap else None, min_swap_bytes=0)
            made["step"] = step

            def call(x, y):
                made["args"] = (x, y)
                return step(x, y)
            return call

        plain, piped, reference, model = cases.train_both(cases.MODELS[name], pipelined)
        same = len(reference.weights) == len(model.weights) and all(
            np.array_equal(a.numpy(), b.numpy()) for a, b in zip(reference.weights, model.weights))
        rows.append({"case": spec, "losses_equal": plain == piped, "trains": len(set(plain)) > 1,
                     "weights_equal": same, "devices": devices[:int(stages)]})
        if swap:
            rows[-1].update(swaps(made["step"], made["args"]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(rows), flush=True)


def swaps(step, args):
    """Where each stage's swaps went: the hosts, each plan's count, and the swap-outs counted by
    where they run, where the tensor they copy was made, where their swap-ins run and where those
    swap-ins' readers run."""
    import collections

    graph = step.get_concrete_function(*args).graph

    def kind(op):
        return op.get_attr("_lms") if "_lms" in op.node_def.attr else None

    placements = collections.Counter()
    for out in (op for op in graph.get_operations() if kind(op) == b"swap_out"):
        swap_ins = [c for c in out.outputs[0].consumers() if kind(c) == b"swap_in"]
        placements[json.dumps([out.device, out.inputs[0].op.device, sorted({c.device for c in swap_ins}),
                               sorted({r.device for c in swap_ins for d in c.outputs[0].consumers()
                                       for r in d.outputs[0].consumers()})])] += 1
    return {"hosts": {str(k): h for k, h in step.hosts.items()}, "swapped": [len(p.swapped) for p in step.plans],
            "swap_placements": [json.loads(key) + [count] for key, count in sorted(placements.items())]}


def after_a_stage_dies(workers):
    """Trains one step across the stages, says ``READY``, waits for a line on stdin (the test
    stops a stage process meanwhile), then times the next step: it must fail, not hang."""
    import time

    import tensorflow as tf

    devices = connect(workers)
    model, (x, y) = cases.MODELS["sequential_cnn"]()
    step = PipelineStep(model, cases.contiguous(model, len(devices)), microbatches=2, devices=devices)
    x, y = tf.constant(x[:8]), tf.constant(y[:8])
    float(step(x, y))
    print("READY", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    try:
        float(step(x, y))
        error = None
    except Exception as err:  # noqa: BLE001 - the type is what the test reads
        error = type(err).__name__
    print("RESULT " + json.dumps({"error": error, "seconds": time.monotonic() - started}), flush=True)


def wide_mlp():
    """Large enough that the step's own buffers, not fixed overheads, make a stage's peak."""
    import keras

    from tests import zoo

    zoo.reseed()
    rng = np.random.RandomState(8)
    x, y = rng.rand(256, 1024).astype("float32"), rng.randint(0, 10, 256).astype("int32")
    layers = [keras.Input((1024,))] + [keras.layers.Dense(1024, activation="relu", name=f"dense_{i}") for i in range(6)]
    model = keras.Sequential(layers + [keras.layers.Dense(10, name="head")], name="wide_mlp")
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, (x, y)


def wide_cnn():
    """Activations, not weights, make most of a stage's memory: the other regime from ``wide_mlp``."""
    import keras

    from tests import zoo

    zoo.reseed()
    rng = np.random.RandomState(9)
    x, y = rng.rand(64, 32, 32, 3).astype("float32"), rng.randint(0, 10, 64).astype("int32")
    layers = [keras.Input((32, 32, 3))] + [
        keras.layers.Conv2D(64, 3, padding="same", activation="relu", name=f"conv_{i}") for i in range(6)]
    model = keras.Sequential(layers + [keras.layers.GlobalAveragePooling2D(name="pool"),
                                       keras.layers.Dense(10, name="head")], name="wide_cnn")
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, (x, y)


WIDE = {"wide_mlp": wide_mlp, "wide_cnn": wide_cnn}


def memory(workers, spec):
    """Trains ``name,schedule,stages,microbatches[,serialize][,recompute]`` (a zoo case, ``wide_mlp``
    or ``wide_cnn``) as ``lms_tf.partition`` cuts it, each stage's weights on its own task
    (serialized if asked; with ``recompute``, every stage keeps only what it receives and runs
    its forward pass again); prints each stage's predicted peaks (the partition's per-layer
    model, ``recompute_peak`` for a recomputing stage; lms-tf's simulator on the built step) and
    task 0's allocator peak over one step (the stage servers log theirs)."""
    import tensorflow as tf

    from lms_tf.core.ir import same_device
    from lms_tf.tf.memory import measure_peak_memory
    from lms_tf.tf.variables import variable_bytes_by_device
    from lms_tf.tf.pipeline_step import place_stages

    name, schedule, stages, microbatches, *flags = spec.split(",")
    devices = connect(workers)
    model, (x, y) = WIDE[name]() if name in WIDE else cases.MODELS[name]()
    partition = lms_tf.partition(model, stages=int(stages), microbatches=int(microbatches), batch_size=len(y),
                                 schedule=schedule)
    predicted = [s.predicted_peak_bytes for s in partition.stages]
    recompute = "recompute" in flags
    if recompute:   # the same profile lms_tf.partition cut by
        from lms_tf.cost import CostModel, get_device_spec
        from lms_tf.pipeline import recompute_peak
        from lms_tf.partitioning import DEFAULT_DEVICE
        from lms_tf.tf.pipeline import local_kernel_library, trace_profile

        profile = trace_profile(model, microbatch=len(y) // int(microbatches),
                                cost=CostModel(get_device_spec(DEFAULT_DEVICE)), kernels=local_kernel_library())
        predicted = [recompute_peak(profile, lo, hi, s.in_flight) for s, (lo, hi) in zip(partition.stages,
                                                                                          partition.bounds)]
    placed = place_stages(model, partition, devices)
    del model
    step = PipelineStep(placed, partition, devices=devices, serialize="serialize" in flags,
                        recompute=list(range(int(stages))) if recompute else False)
    x, y = tf.constant(x), tf.constant(y)
    losses = [float(step(x, y)) for _ in range(2)]
    with measure_peak_memory(devices[0], settle_seconds=0.3) as task0:
        losses.append(float(step(x, y)))
    # The peak is measured from what task 0 holds before the step, which is more than stage 0's
    # (the batch, the user's model): add back only the stage's own weights and slots, resident
    # before the step as they are on a stage server.
    resident = variable_bytes_by_device(list(placed.weights) + list(placed.optimizer.variables))
    stage0 = sum(nbytes for device, nbytes in resident.items() if same_device(device, devices[0]))
    print("RESULT " + json.dumps({"predicted": predicted, "recompute_stages": step.recompute_stages,
                                  "simulated": step.predicted_peaks(x, y),
                                  "simulated_tensors": step.predicted_peaks(x, y, allocator=False),
                                  "layers": [list(s.layers) for s in partition.stages],
                                  "task0_peak": task0.peak_bytes + stage0, "task0_step_peak": task0.peak_bytes,
                                  "losses": losses}), flush=True)


def step_times(model, profile, microbatch):
    """One micro-batch's plain step: the profile's step time with the preset's op times and with op
    times calibrated on this CPU (``calibrated_cost``), and the wall clock of a copy's step (median
    of 10 after 3 warm-ups)."""
    import statistics

    import keras
    import tensorflow as tf

    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.partitioning import DEFAULT_DEVICE
    from lms_tf.tf.pipeline import calibrated_cost, local_kernel_library, trace_step
    from lms_tf.tf.workloads import step_specs, train_step

    preset = CostModel(get_device_spec(DEFAULT_DEVICE))
    traced = trace_step(model, microbatch=microbatch, kernels=local_kernel_library())
    scaled = calibrated_cost(model, profile, preset, microbatch=microbatch)
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    step = tf.function(train_step(copy))
    x_spec, y_spec = step_specs(copy, microbatch)
    x, y = tf.zeros(x_spec.shape, x_spec.dtype), tf.zeros(y_spec.shape, y_spec.dtype)
    walls = []
    for i in range(13):
        started = time.perf_counter()
        step(x, y).numpy()
        walls.append(time.perf_counter() - started)

    def seconds(p):
        return sum(layer.forward_s + layer.backward_s + layer.update_s for layer in p.layers)

    return {"preset_s": seconds(traced.profile(preset)), "calibrated_s": seconds(traced.profile(scaled)),
            "wall_s": statistics.median(walls[3:])}


def calibration(spec):
    """``name;schedule,stages,microbatches;...``: mCAP's calibration of ``name`` (``wide_mlp``,
    ``wide_cnn`` or a ``lms_tf.tf.workloads`` model) on this process's allocator, then, as held-out
    checks, the whole model's real peak with 3, 4 and 6 micro-batches in flight; and for each
    case, the partition's cut with each stage counted by the per-layer model and by the calibrated
    one. Prints one RESULT line."""
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.partitioning import DEFAULT_DEVICE
    from lms_tf.pipeline import evaluate, partition_layers, stage_peak
    from lms_tf.tf.pipeline import local_kernel_library, measure_calibration, trace_profile, whole_model_peak
    from lms_tf.tf.workloads import build_model

    name, *cases = spec.split(";")
    if name in WIDE:
        model, (_, y) = WIDE[name]()
        microbatch = len(y) // 4
    else:
        model_name, size, microbatch = name.split(":")
        model, microbatch = build_model(model_name, image_size=int(size), classes=10), int(microbatch)
    profile = trace_profile(model, microbatch=microbatch, cost=CostModel(get_device_spec(DEFAULT_DEVICE)),
                            kernels=local_kernel_library())
    started = time.monotonic()
    calibrated = measure_calibration(model, profile, microbatch=microbatch)
    seconds = time.monotonic() - started
    times = step_times(model, profile, microbatch)
    n = len(profile.layers)
    held_out = [{"in_flight": flight, "real": whole_model_peak(model, profile, microbatch=microbatch, microbatches=flight),
                 "model": stage_peak(profile, 0, n, flight), "calibrated": calibrated.extrapolate(flight),
                 "mcap": calibrated.mcap_extrapolate(flight)}
                for flight in (3, 4, 6)]
    stages = []
    for case in cases:
        schedule, count, microbatches = case.split(",")
        cut = partition_layers(profile, stages=int(count), microbatches=int(microbatches), schedule=schedule)
        again = evaluate(calibrated.apply(profile), [hi for _, hi in cut.bounds], microbatches=int(microbatches),
                         schedule=schedule)
        stages.append({"case": case, "layers": [list(s.layers) for s in cut.stages],
                       "model": [s.predicted_peak_bytes for s in cut.stages],
                       "calibrated": [s.predicted_peak_bytes for s in again.stages]})
    print("RESULT " + json.dumps({"name": model.name, "layers": n, "microbatch": microbatch,
                                  "calibration": calibrated.to_dict(), "seconds": seconds, "held_out": held_out,
                                  "step_times": times,
                                  "stages": stages}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--calibration":
        calibration(sys.argv[2])
        sys.exit(0)
    if sys.argv[2] == "--memory":
        memory(sys.argv[1], sys.argv[3])
        sys.exit(0)
    elif sys.argv[2] == "--after-a-stage-dies":
        after_a_stage_dies(sys.argv[1])
    else:
        main(sys.argv[1], sys.argv[2:])
