"""Benchmark: a decoder whose weights, gradients and Adam slots are 4x the budget, trained on this CPU.

A scaled-down ``decoder_lm`` (width 512, 4 blocks, 1,024 tokens of vocabulary, one sequence of 32
tokens; 13.1M parameters, 200 MiB of weights, gradients and Adam's two moments) is trained for
ten steps twice, side by side in one run: the plain ``tf.function`` step, and
``lms_tf.function(weights="host", budget=state / 4)`` with the variables placed on the host (a
second logical CPU), and a third time serialized (``serialize=True``, the simulator's order). It
reports the budget against the state, the plan's simulated peak, Grappler's virtual-GPU peak of
each step (told the variable shapes; resident variables included), the serialized plan's peak by
the simulator and by Grappler (the step's own tensors, each buffer once), and whether the losses
and weights are bit-identical. On logical CPUs a fetch moves no bytes: no
time or real memory is claimed from that part.

Then the same plan runs, free and serialized, with the host in a process of its own (task 1 of a
TensorFlow cluster on localhost, ``tests/weights_cluster_worker.py``), beside the plain step alone
in another: each process's real allocator peak, steps 3 to 10, against the simulator's figures
for the plan. There every fetch and every gradient's copy out crosses TensorFlow's runtime between
the processes. Times are still not claimed: loopback gRPC is no GPU link.

Command: ``.venv/bin/python benchmarks/weights_cpu_run.py`` (about four minutes; writes
``benchmarks/out/weights_cpu_run.json`` and the table into ``docs/benchmarks/weights.md``).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import lms_tf  # noqa: E402
from benchmarks.publish import OUT, publish  # noqa: E402
from lms_tf.cli.workload import devices  # noqa: E402
from lms_tf.tf.diagnostics import virtual_gpu_peak, virtual_gpu_peak_report  # noqa: E402
from lms_tf.tf.workloads import decoder_lm, decoder_lm_params, train_step  # noqa: E402
from tests.weights_cluster_worker import host_window_peak, run_on_two_processes, run_plain  # noqa: E402

WIDTH, DEPTH, SEQ_LEN, VOCAB, BATCH, STEPS = 512, 4, 32, 1024, 1, 10
MiB = 2**20


def train(budget=None, serialize=False):
    keras.utils.set_random_seed(0)
    model = decoder_lm(width=WIDTH, depth=DEPTH, seq_len=SEQ_LEN, vocab=VOCAB)
    optimizer = keras.optimizers.Adam()
    step = train_step(model, optimizer)

    if budget is None:
        fn = tf.function(step)
    else:
        optimizer.build(model.trainable_variables)
        lms_tf.place_weights(model, optimizer, host="/CPU:1")
        fn = lms_tf.function(step, device="/CPU:0", host="/CPU:1", weights="host", budget=budget,
                             device_spec="v100-16gb-pcie3", serialize=serialize)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(3 * BATCH, SEQ_LEN + 1)).astype("int32")
    batches = [(tf.constant(tokens[BATCH * i:BATCH * (i + 1), :-1]), tf.constant(tokens[BATCH * i:BATCH * (i + 1), 1:]))
               for i in range(3)]
    losses = [float(fn(*batches[i % 3])) for i in range(STEPS)]
    concrete = fn.get_concrete_function(*batches[0])
    if serialize:  # the step's own tensors, each buffer once, as the simulator counts them
        oracle = virtual_gpu_peak_report(concrete, variable_shapes=True).step_peak_bytes
    else:
        oracle = virtual_gpu_peak(concrete, include_variables=True, variable_shapes=True)
    return losses, [np.array(w) for w in model.get_weights()], fn, oracle


def main() -> None:
    devices()
    tf.config.experimental.enable_op_determinism()
    params = decoder_lm_params(WIDTH, DEPTH, VOCAB)
    state = 16 * params
    budget = state // 4
    plain_losses, plain_weights, _, plain_oracle = train()
    losses, weights, fn, oracle = train(budget)
    equal = losses == plain_losses and all(np.array_equal(a, b) for a, b in zip(plain_weights, weights))
    # Serialized (the simulator's order), Grappler judges the same plan in the order it was simulated in.
    serial_losses, serial_weights, serial_fn, serial_oracle = train(budget, serialize=True)
    equal = equal and serial_losses == plain_losses and all(
        np.array_equal(a, b) for a, b in zip(plain_weights, serial_weights))
    serial_sim = serial_fn.plan.predictions.planned_peak_bytes
    plan = fn.plan
    row = dict(params=params, state_bytes=state, budget_bytes=budget, planned_peak_bytes=plan.predictions.planned_peak_bytes,
               baseline_peak_bytes=plan.predictions.baseline_peak_bytes, oracle_plain_bytes=plain_oracle,
               oracle_planned_bytes=oracle, serialized_planned_peak_bytes=serial_sim,
               serialized_oracle_step_bytes=serial_oracle, equal=equal, fetches=plan.num_weight_fetches,
               variables=len(plan.offloaded_weights), losses=losses)
    text = "\n".join([
        f"A decoder of {params / 1e6:.1f}M parameters (width {WIDTH}, {DEPTH} blocks, Adam), trained {STEPS} steps "
        f"on this CPU, plain and with `weights=\"host\"` under a budget of a quarter of its weights, gradients and "
        f"slots:", "",
        "| weights + gradients + slots | budget | simulated peak of the plan (plain step) | Grappler's virtual GPU, "
        "plain / planned (variables included) | serialized: simulated / Grappler (the step's own tensors) | "
        "fetches | losses and weights (free and serialized) |",
        "|---|---|---|---|---|---|---|",
        f"| {state / MiB:.1f} MiB | {budget / MiB:.1f} MiB ({state / budget:.1f}x less) | "
        f"{row['planned_peak_bytes'] / MiB:.1f} MiB ({row['baseline_peak_bytes'] / MiB:.1f} MiB) | "
        f"{plain_oracle / MiB:.1f} / {oracle / MiB:.1f} MiB | {serial_sim / MiB:.1f} / {serial_oracle / MiB:.1f} MiB "
        f"({serial_oracle / serial_sim:.2f}) | {row['fetches']} for {row['variables']} variables | "
        f"{'bit-identical' if equal else 'DIFFERENT'} |"])
    publish("weights-cpu-run", text, page="weights")
    row["two_processes"], processes_text = two_processes()
    publish("weights-two-processes", processes_text, page="weights")
    OUT.mkdir(exist_ok=True)
    with open(OUT / "weights_cpu_run.json", "w") as handle:
        json.dump(row, handle, indent=1)
    print(text + "\n\n" + processes_text)


def two_processes():
    """The plan with its host in a process of its own, free and serialized, beside the plain step
    alone in another process."""
    import tempfile

    rows, lines = [], [
        "The same plan, its host in a process of its own (steps 3-10; real allocator peaks, "
        "`TF_CPU_ALLOCATOR_USE_BFC=true`), beside the plain step alone in a process:", "",
        "| order | plain process, each step | device process, each step (median) | simulator, this allocator | "
        "device vs simulator (median) | device, a traced step's tensors / simulated | "
        "host process: tensors / chunks | host predicted: all at once (`host_peak_bytes`) / one at a time | "
        "host vs predicted (tensors) | "
        "losses and weights |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as directory:
        plain, plain_weights = run_plain(directory)
        for mode, order in (("host", "TensorFlow's own"), ("host-serialized", "serialized")):
            host, host_weights, events, _ = run_on_two_processes(directory, mode)
            equal = plain["losses"] == host["losses"] and all(
                np.array_equal(plain_weights[k], host_weights[k]) for k in plain_weights.files)
            tensors, _ = host_window_peak(events, "requested_bytes")
            chunks, _ = host_window_peak(events, "chunk_bytes")
            device, replayed, predicted = sorted(host["peaks"]), host["allocator_peak_bytes"], host["host_peak_bytes"]
            one_at_a_time = host["host_peak_one_at_a_time_bytes"]
            median = device[len(device) // 2]
            rows.append(dict(order=order, plain_peaks=plain["peaks"], device_peaks=host["peaks"],
                             device_replayed_bytes=replayed, host_tensor_peak_bytes=tensors,
                             host_chunk_peak_bytes=chunks, host_predicted_bytes=predicted,
                             host_predicted_one_at_a_time_bytes=one_at_a_time,
                             device_traced_tensor_peak_bytes=host["traced_requested_peak"],
                             device_simulated_tensor_peak_bytes=host["simulated_peak_bytes"],
                             resident_host_bytes=host["resident_host_bytes"], equal=equal))
            lines.append(
                f"| {order} | {min(plain['peaks']) / MiB:.1f}-{max(plain['peaks']) / MiB:.1f} MiB | "
                f"{device[0] / MiB:.1f}-{device[-1] / MiB:.1f} MiB ({median / MiB:.1f}) | {replayed / MiB:.1f} MiB | "
                f"{device[0] / replayed:.2f}-{device[-1] / replayed:.2f} ({median / replayed:.2f}) | "
                f"{host['traced_requested_peak'] / MiB:.2f} / {host['simulated_peak_bytes'] / MiB:.2f} MiB "
                f"({host['traced_requested_peak'] / host['simulated_peak_bytes']:.2f}) | "
                f"{tensors / MiB:.1f} / {chunks / MiB:.1f} MiB | {predicted / MiB:.1f} / {one_at_a_time / MiB:.1f} MiB | "
                f"{tensors / predicted:.2f} / {tensors / one_at_a_time:.2f} | "
                f"{'bit-identical' if equal else 'DIFFERENT'} |")
    return rows, "\n".join(lines)


if __name__ == "__main__":
    main()
