"""Weights on a host that is another process: trains the 4x decoder, plain here or with its
variables in a second process of a TensorFlow cluster, and measures each process's real memory.

    python tests/weights_cluster_worker.py plain OUT.npz
    python tests/weights_cluster_worker.py host OUT.npz host:port,host:port
    python tests/weights_cluster_worker.py host-serialized OUT.npz host:port,host:port

``plain``: this process alone trains ``decoder_lm`` (width 512, 4 blocks, Adam; 200 MiB of weights,
gradients and slots) for :data:`STEPS` steps. ``host``: this process is task 0 (the "device") and
task 1, an ``lms-tf stage-server``, is the host: the variables and Adam's slots are placed there,
and ``lms_tf.function(weights="host", budget=state / 4)`` fetches each weight over TensorFlow's
runtime, as a GPU would over its link (``host-serialized``: with ``serialize=True``). The two processes have their own allocators, so the device's
and the host's memory are measured apart, and a fetch or a gradient's copy out moves real bytes.

Prints one ``RESULT <json>`` line (losses, each step's allocator peak here, and the simulator's
figures for the plan) and saves the final weights to ``OUT.npz``. Around the steps it measures, the
host allocates one tensor of :data:`MARK_BYTES` on the host: :func:`host_window_peak` finds those
marks in the host's allocator trace and reads the host's peak between them.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import lms_tf  # noqa: E402

WIDTH, DEPTH, SEQ_LEN, VOCAB, BATCH, STEPS = 512, 4, 32, 1024, 1, 10
#: Steps before the measured ones: the first traces and plans, the second settles the allocator.
WARM_STEPS = 2
#: Each process's environment: deterministic kernels, Eigen's (as the tests), and the BFC allocator
#: on the CPU, which keeps the statistics and the trace the measurements read.
MEASURED_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_DETERMINISTIC_OPS="1", TF_ENABLE_ONEDNN_OPTS="0",
                    TF_CPU_ALLOCATOR_USE_BFC="true")
#: A request size no step makes (an odd number of floats): the marks around the measured steps.
MARK_BYTES = 123457 * 4


def host_window_peak(events, field: str = "requested_bytes"):
    """The host's peak between its two marks, from its allocator trace (every request since the
    server started, :class:`~lms_tf.tf.diagnostics.AllocationEvent` as dicts), and what it held at
    the first mark. ``field``: ``"requested_bytes"`` (the tensors' bytes, as the simulator counts)
    or ``"chunk_bytes"`` (what the allocator reserved for them).

    Examples:
        >>> alloc = lambda n, a: dict(kind="alloc", requested_bytes=n, chunk_bytes=n, address=a)
        >>> free = lambda n, a: dict(kind="free", requested_bytes=n, chunk_bytes=n, address=a)
        >>> host_window_peak([alloc(8, 1), alloc(MARK_BYTES, 2), alloc(4, 3), free(4, 3), alloc(MARK_BYTES, 4)])
        (12, 8)
    """
    marks = [i for i, e in enumerate(events) if e["kind"] == "alloc" and e["requested_bytes"] == MARK_BYTES]
    if len(marks) != 2:
        raise AssertionError(f"the host's trace has {len(marks)} marks, not 2: it does not cover the measured steps")
    live, in_use, peak, at_first = {}, 0, 0, None
    for i, event in enumerate(events):
        if i == marks[0]:
            at_first = in_use
        if event["kind"] == "alloc":
            if event["requested_bytes"] == MARK_BYTES:
                continue
            live[event["address"]] = event[field]
            in_use += event[field]
        elif event["address"] in live:
            in_use -= live.pop(event["address"])
        if marks[0] <= i < marks[1]:
            peak = max(peak, in_use)
    return peak, at_first


def run_plain(directory):
    """The plain step trained alone in a fresh process: its ``RESULT`` and its final weights."""
    import pathlib
    import subprocess

    from tests.test_pipeline_cluster import ROOT, result_of

    out = pathlib.Path(directory) / "plain.npz"
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "plain", str(out)], cwd=ROOT, env=MEASURED_ENV,
                          capture_output=True, text=True, timeout=240)
    if done.returncode:
        raise AssertionError(done.stderr[-3000:])
    return result_of(done.stdout), np.load(out)


def run_on_two_processes(directory, mode: str = "host"):
    """The step with its weights in a stage server's process: this module as task 0 in a fresh
    process, an ``lms-tf stage-server`` as task 1 recording its allocator's every request until
    its input closes (``--memory-trace``); ``mode`` is ``"host"`` or ``"host-serialized"``. Returns task 0's ``RESULT``, its final weights, the
    host's trace and the two addresses; both processes are stopped whatever happens."""
    import pathlib
    import subprocess

    from tests.test_pipeline_cluster import ROOT, free_ports, result_of

    directory = pathlib.Path(directory)
    workers = free_ports(2)
    server = subprocess.Popen([sys.executable, "-m", "lms_tf.cli", "stage-server", "--workers", ",".join(workers),
                               "--index", "1", "--until-stdin-closes", "--memory-trace", str(directory)],
                              cwd=ROOT, env=MEASURED_ENV, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), mode, str(directory / "host.npz"),
                               ",".join(workers)], cwd=ROOT, env=MEASURED_ENV, capture_output=True, text=True,
                              timeout=300)
        server.stdin.close()
        server_log = server.stderr.read()
        server.wait(timeout=120)
    finally:
        server.kill()
    if done.returncode or server.returncode:
        raise AssertionError(done.stderr[-3000:] + server_log[-3000:])
    with open(directory / "stage1.json") as trace:
        events = json.load(trace)
    return result_of(done.stdout), np.load(directory / "host.npz"), events, workers


def main(mode: str, out: str, workers: str = "") -> None:
    on_host = mode in ("host", "host-serialized")
    devices = lms_tf.connect_stages(workers, timeout=60) if on_host else None
    import keras
    import tensorflow as tf

    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.simulate import simulate
    from lms_tf.simulate.allocator import tensorflow_cpu_allocator
    from lms_tf.tf.diagnostics import allocation_trace, cpu_kernel_library, requested_peak
    from lms_tf.tf.variables import variable_bytes_by_device, variable_device
    from lms_tf.tf.workloads import decoder_lm, decoder_lm_params, train_step

    keras.utils.set_random_seed(0)
    model = decoder_lm(width=WIDTH, depth=DEPTH, seq_len=SEQ_LEN, vocab=VOCAB)
    optimizer = keras.optimizers.Adam()
    step = train_step(model, optimizer)
    state = 16 * decoder_lm_params(WIDTH, DEPTH, VOCAB)
    if on_host:
        device, host = devices
        optimizer.build(model.trainable_variables)
        lms_tf.place_weights(model, optimizer, host=host)
        fn = lms_tf.function(step, device=device, host=host, weights="host", budget=state // 4,
                             device_spec="v100-16gb-pcie3", serialize=mode == "host-serialized")
    else:
        fn = tf.function(step)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(3 * BATCH, SEQ_LEN + 1)).astype("int32")
    batches = [(tf.constant(tokens[BATCH * i:BATCH * (i + 1), :-1]), tf.constant(tokens[BATCH * i:BATCH * (i + 1), 1:]))
               for i in range(3)]

    def mark():
        if on_host:
            with tf.device(host):
                marker = tf.fill([MARK_BYTES // 4], 1.0)
            marker.numpy()

    losses, peaks, traced = [], [], {}
    for i in range(STEPS):
        if i == WARM_STEPS:
            mark()
        tf.config.experimental.reset_memory_stats("CPU:0")
        if on_host and i == WARM_STEPS - 1:  # the last warm step, traced: the peak of its tensors
            events = allocation_trace(lambda: traced.setdefault("loss", float(fn(*batches[i % 3]))))
            traced["requested_peak"] = requested_peak(events)
            losses.append(traced["loss"])
        else:
            losses.append(float(fn(*batches[i % 3])))
        if i >= WARM_STEPS:  # the whole step's peak here: every op of it has run when the loss is read
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    mark()
    result = dict(mode=mode, losses=losses, peaks=peaks, state_bytes=state,
                  traced_requested_peak=traced.get("requested_peak"))
    if on_host:
        plan = fn.plan
        # The same plan replayed for this process's allocator (TF_CPU_ALLOCATOR_USE_BFC=true counts
        # whole chunks) and CPU kernels: the figure to hold the measured peaks to.
        replayed = simulate(fn.plain_irs[-1], plan, cost=CostModel(get_device_spec("v100-16gb-pcie3")),
                            allocator=tensorflow_cpu_allocator(), kernels=cpu_kernel_library())
        result.update(budget_bytes=plan.budget_bytes, planned_peak_bytes=plan.predictions.planned_peak_bytes,
                      simulated_peak_bytes=replayed.peak_bytes,
                      allocator_peak_bytes=replayed.allocator_peak_bytes,
                      host_peak_bytes=plan.predictions.host_peak_bytes,
                      host_peak_one_at_a_time_bytes=simulate(
                          fn.plain_irs[-1], plan, cost=CostModel(get_device_spec("v100-16gb-pcie3")),
                          host_update="one_variable_at_a_time").host_peak_bytes,
                      resident_host_bytes=variable_bytes_by_device(model.variables + optimizer.variables).get(host, 0),
                      variable_devices=sorted({variable_device(v) for v in model.variables + optimizer.variables}),
                      fetches=plan.num_weight_fetches, offloaded=len(plan.offloaded_weights))
    np.savez(out, *[np.array(w) for w in model.get_weights()])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    # Before TensorFlow starts (main imports it), and only here: the tests import this module too.
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_DETERMINISTIC_OPS", "TF_ENABLE_ONEDNN_OPTS", "TF_CPU_ALLOCATOR_USE_BFC"):
        os.environ.setdefault(name, MEASURED_ENV[name])
    main(*sys.argv[1:])
