"""Pipeline stages in separate processes on TensorFlow's distributed runtime (localhost).

Task 0 is a fresh process running ``tests/pipeline_cluster_worker.py`` (connecting changes the
process's TensorFlow context, so it is not this one); tasks 1 and up are ``lms-tf stage-server``
processes. Every process is stopped at the end of each test, whatever happens.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from lms_tf.core.errors import LMSError, LMSOptionError
from lms_tf.tf.pipeline_cluster import check_workers, stage_devices, wait_for_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_DETERMINISTIC_OPS="1", TF_ENABLE_ONEDNN_OPTS="0")


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return [f"localhost:{p}" for p in ports]


@contextlib.contextmanager
def stage_servers(workers):
    """``lms-tf stage-server`` for tasks 1 and up; stopped on exit."""
    servers = [subprocess.Popen([sys.executable, "-m", "lms_tf.cli", "stage-server", "--workers", ",".join(workers),
                                 "--index", str(k)], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for k in range(1, len(workers))]
    try:
        yield servers
    finally:
        for server in servers:
            server.kill()
            server.wait(timeout=30)


def result_of(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.timeout(600)
def test_stages_in_three_processes_train_exactly_as_one_device():
    workers = free_ports(3)
    cases = ["resnet_style,1f1b,3", "attention_block,gpipe,3", "sequential_cnn,gpipe,2"]
    with stage_servers(workers):
        done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "pipeline_cluster_worker.py"),
                               ",".join(workers), *cases], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = result_of(done.stdout)
    assert [r["case"] for r in rows] == cases
    for row in rows:
        assert row["losses_equal"] and row["weights_equal"] and row["trains"], row
        assert all(d.startswith(f"/job:worker/replica:0/task:{k}/") for k, d in enumerate(row["devices"])), row


@pytest.mark.timeout(300)
def test_a_stage_process_that_dies_fails_the_next_step_in_bounded_time():
    workers = free_ports(2)
    with stage_servers(workers) as servers:
        task0 = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "pipeline_cluster_worker.py"),
                                  ",".join(workers), "--after-a-stage-dies"], cwd=ROOT, env=ENV,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert task0.stdout.readline().strip() == "READY", task0.stderr.read()[-3000:]
            servers[0].send_signal(signal.SIGKILL)
            servers[0].wait(timeout=30)
            out, err = task0.communicate("go\n", timeout=180)
        finally:
            task0.kill()
    result = result_of(out)
    # Measured: UnavailableError after 0.02 s (the connection to the dead task is refused).
    assert result["error"] is not None and result["seconds"] < 120, (result, err[-2000:])


def test_a_stage_that_does_not_answer_is_named_within_the_timeout():
    (address,) = free_ports(1)  # nobody listens there
    started = time.monotonic()
    with pytest.raises(LMSError, match=r"stage 1 at .* did not answer within 2 s.*lms-tf stage-server --workers"):
        wait_for_workers(["localhost:1", address], timeout=2)
    assert time.monotonic() - started < 10


def test_a_memory_trace_that_cannot_be_written_is_refused_before_the_server_starts(tmp_path):
    from lms_tf.tf.pipeline_cluster import serve_stage

    workers = ["localhost:1", "localhost:2"]
    with pytest.raises(LMSOptionError, match="--memory-trace .* needs --until-stdin-closes"):
        serve_stage(workers, 1, memory_trace=str(tmp_path))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(LMSOptionError, match="cannot create that directory.*give a directory this process can write"):
        serve_stage(workers, 1, until_stdin_closes=True, memory_trace=str(blocker / "traces"))
    assert not (blocker.parent / "traces").exists()


def test_bad_cluster_addresses_are_refused():
    with pytest.raises(LMSOptionError, match="not host:port"):
        check_workers("localhost")
    with pytest.raises(LMSOptionError, match="more than once"):
        check_workers(["a:1", "a:1"])
    with pytest.raises(LMSOptionError, match="at least one"):
        check_workers([])
    assert stage_devices("h:1,h:2,h:3")[2] == "/job:worker/replica:0/task:2/device:CPU:0"
    out = subprocess.run([sys.executable, "-m", "lms_tf.cli", "stage-server", "--workers", "a:1,b:2", "--index", "5"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--index must be 1-1" in out.stderr, out.stderr[-1000:]


WORKER = os.path.join(ROOT, "tests", "pipeline_cluster_worker.py")


def launched_pids(stderr_lines):
    """Stage -> pid, from ``lms-tf launch``'s log lines."""
    return {int(m.group(1)): int(m.group(2)) for m in
            (re.search(r"lms-tf launch: stage (\d+) \(pid (\d+)\)", line) for line in stderr_lines) if m}


def all_launched(lines, stages, seconds=30):
    """Stage -> pid once the launcher has logged every stage (its stderr is read by a thread)."""
    deadline = time.monotonic() + seconds
    while len(launched_pids(lines)) < stages and time.monotonic() < deadline:
        time.sleep(0.05)
    return launched_pids(lines)


def running(pid):
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.1)
    return not any(running(p) for p in pids)


@pytest.mark.timeout(600)
def test_launch_runs_every_stage_and_leaves_no_process_behind():
    done = subprocess.run([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", "3", "--", sys.executable, WORKER,
                           "-", "sequential_cnn,1f1b,3"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = result_of(done.stdout)
    assert row["losses_equal"] and row["weights_equal"] and row["trains"], row
    assert all(d.startswith(f"/job:worker/replica:0/task:{k}/") for k, d in enumerate(row["devices"])), row
    pids = launched_pids(done.stderr.splitlines())
    assert sorted(pids) == [0, 1, 2] and gone_within(pids.values(), 10), pids


@pytest.mark.timeout(600)
def test_each_stage_swaps_to_its_own_process_and_trains_exactly_as_one_device():
    """``lms-tf launch --logical-cpus 2``: every process (task 0 through ``connect_stages``) has
    CPU:0 and CPU:1, each stage runs on CPU:0 and swaps to its own CPU:1. No bytes move between
    two logical CPUs (one allocator): this checks the rewrite across processes, not swap memory."""
    cases = ["resnet_style,1f1b,3,swap", "attention_block,gpipe,3,swap"]
    done = subprocess.run([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", "3", "--logical-cpus", "2", "--",
                           sys.executable, WORKER, "-", *cases], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = result_of(done.stdout)
    assert [r["case"] for r in rows] == cases
    for row in rows:
        assert row["losses_equal"] and row["weights_equal"] and row["trains"], row["case"]
        task = [f"/job:worker/replica:0/task:{k}/device:CPU:" for k in range(3)]
        assert row["hosts"] == {str(k): task[k] + "1" for k in range(3)}, row["hosts"]
        assert len(row["swapped"]) == 3 and all(row["swapped"]), row["swapped"]
        # Each swap-out runs on its stage's host, copies a tensor its stage made, and comes back
        # through a swap-in on that host read only on that stage's device.
        placements = row["swap_placements"]
        assert sum(count for *_, count in placements) == sum(row["swapped"]), placements
        for out, source, swap_ins, readers, count in placements:
            k = int(re.search(r"task:(\d+)", out).group(1))
            assert (out, source, swap_ins, readers) == (task[k] + "1", task[k] + "0", [task[k] + "1"], [task[k] + "0"])
        assert {int(re.search(r"task:(\d+)", p[0]).group(1)) for p in placements} == {0, 1, 2}, placements


@pytest.mark.timeout(300)
def test_launch_stops_the_others_when_a_stage_dies():
    launcher = subprocess.Popen([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", "3", "--stop-timeout", "5",
                                 "--", sys.executable, WORKER, "-", "--after-a-stage-dies"], cwd=ROOT, env=ENV,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        assert launcher.stdout.readline().strip() == "READY", "".join(lines)[-3000:]  # one step ran on 3 processes
        pids = all_launched(lines, 3)
        assert sorted(pids) == [0, 1, 2], lines
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        code = launcher.wait(timeout=60)
        stopped_in = time.monotonic() - started
    finally:
        launcher.kill()
    reader.join(timeout=10)
    assert code == 1, "".join(lines)[-3000:]
    # Measured: 0.16 s (the next poll sees stage 1 gone; the others stop on SIGTERM).
    assert stopped_in < 30, stopped_in
    assert gone_within([pids[0], pids[2]], 10), pids
    assert any(re.search(r"stage 1 \(pid \d+, localhost:\d+\) exited", line) for line in lines), lines


def test_launch_and_connect_refuse_a_missing_command_or_cluster(monkeypatch):
    out = subprocess.run([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", "2"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs the training command after --" in out.stderr, out.stderr
    from lms_tf.cli.launch import launch
    with pytest.raises(LMSOptionError, match="names 1 host.*for 2 stages"):
        launch(["true"], 2, hosts=["a"])
    monkeypatch.delenv("LMS_TF_WORKERS", raising=False)
    from lms_tf.tf.pipeline_cluster import connect_stages
    with pytest.raises(LMSOptionError, match="LMS_TF_WORKERS is not set.*lms-tf launch"):
        connect_stages()


@pytest.mark.timeout(300)
def test_a_killed_launcher_leaves_no_process_behind():
    """SIGKILL gives the launcher no chance to stop anyone: the stage servers stop because their
    input pipe closes, the training command because Linux sends it SIGTERM when its parent dies."""
    launcher = subprocess.Popen([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", "3", "--", sys.executable,
                                 "-c", "import time; print('READY', flush=True); time.sleep(600)"], cwd=ROOT, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        assert launcher.stdout.readline().strip() == "READY", "".join(lines)[-3000:]
        pids = all_launched(lines, 3)
        assert sorted(pids) == [0, 1, 2] and all(running(p) for p in pids.values()), pids
        launcher.kill()
        launcher.wait(timeout=30)
        assert gone_within(pids.values(), 60), {k: running(p) for k, p in pids.items()}
    finally:
        launcher.kill()


@pytest.mark.timeout(600)
def test_launch_starts_the_stages_of_other_hosts_over_ssh(tmp_path):
    """``--hosts``: stages 1 and up through ``ssh HOST 'cd DIR && exec PYTHON -m lms_tf.cli
    stage-server ...'``. A stand-in ssh first on PATH runs that command here and logs how it
    was called; the cluster then trains as with local stages."""
    calls = tmp_path / "ssh_calls"
    fake = tmp_path / "ssh"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
while [ "${{1:0:1}}" = "-" ]; do shift 2; done   # -o X, -p N
shift                                           # the host
exec bash -c "$1"
""")
    fake.chmod(0o755)
    env = dict(ENV, PATH=f"{tmp_path}:{ENV['PATH']}")
    done = subprocess.run([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", "3",
                           "--hosts", "localhost,localhost,localhost", "--ssh-port", "12345", "--",
                           sys.executable, WORKER, "-", "sequential_cnn,gpipe,3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = result_of(done.stdout)
    assert row["losses_equal"] and row["weights_equal"] and row["trains"], row
    made = calls.read_text().splitlines()
    assert len(made) == 2 and all(c.startswith("-o BatchMode=yes -p 12345 localhost cd ") for c in made), made
    # the two stages start concurrently: their calls reach the log in either order
    assert sorted(re.search(r"--index (\d+)", c).group(1) for c in made) == ["1", "2"], made
    assert gone_within(launched_pids(done.stderr.splitlines()).values(), 30)


def memory_run(spec, launch_flags=()):
    """One training under ``lms-tf launch`` in the worker's ``--memory`` mode: its result, with each
    stage's real peak (task 0's own figure, the stage servers' logged ones)."""
    stages = int(spec.split(",")[2])
    done = subprocess.run([sys.executable, "-m", "lms_tf.cli", "launch", "--stages", str(stages), *launch_flags, "--",
                           sys.executable, WORKER, "-", "--memory", spec], cwd=ROOT,
                          env=dict(ENV, TF_CPU_ALLOCATOR_USE_BFC="true"), capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    result = result_of(done.stdout)
    real = {0: result["task0_peak"]}
    for m in re.finditer(r"pipeline stage (\d+): allocator peak (\d+) bytes", done.stderr):
        real[int(m.group(1))] = int(m.group(2))
    assert sorted(real) == list(range(stages)), done.stderr[-3000:]
    assert len(set(result["losses"])) > 1
    return result, [real[k] for k in range(stages)]


@pytest.mark.timeout(900)
def test_each_stage_process_peaks_near_its_predicted_memory():
    """One process per stage, each with its own allocator and its stage's weights and Adam slots
    (place_stages): a 1024-wide, 7-layer MLP at batch 256, cut in three by lms_tf.partition (1F1B,
    4 micro-batches), serialized. Each stage server reads its allocator's peak
    (TF_CPU_ALLOCATOR_USE_BFC=true) and logs it when it stops; task 0 measures its own over one
    step and adds its stage's resident weights and slots. A process's peak moves between runs (when
    received tensors land decides where the allocator puts them), so each stage's median of five
    runs is held to the issue's target against lms-tf's simulator on the built step
    (PipelineStep.predicted_peaks): within 10%. Against the partition's per-layer model, made before
    any step exists, the spread the benchmark measured (docs/benchmarks/partition.md). Measured:
    task 0 1.085-1.094 (its peak falls in the optimizer update, which serialization leaves free),
    the stage servers 0.93-1.03."""
    runs = [memory_run("wide_mlp,1f1b,3,4,serialize") for _ in range(5)]
    result = runs[0][0]
    median = [sorted(real[k] for _, real in runs)[2] for k in range(3)]
    by_simulator = [median[k] / result["simulated"][k] for k in range(3)]
    by_model = [median[k] / result["predicted"][k] for k in range(3)]
    assert all(0.9 <= r <= 1.1 for r in by_simulator), (by_simulator, [real for _, real in runs], result)
    assert all(0.95 <= r <= 1.2 for r in by_model), (by_model, [real for _, real in runs], result)


@pytest.mark.timeout(600)
def test_a_stage_process_holds_what_it_sends_through_its_next_op(tmp_path):
    """Behaviour of the replay's send rule (test_pipeline_execution has its numbers): the held-out
    wide CNN cut in three (1F1B, 4 micro-batches, serialized) under ``lms-tf launch
    --memory-trace``. Each stage server's allocator, traced under TensorFlow's profiler over its
    life, peaks where its own statistics say (the trace sees every request). At the middle stage's
    peak, its filter gradient's scratch is live beside the input gradient of the same micro-batch,
    which the stage sent to stage 0 just before: TensorFlow's gRPC worker still holds it. The
    simulator, which holds a sent tensor through the stage's next op, predicts that stage within
    the issue's 10% (measured 1.00-1.03; 1.08 when a send freed its tensor at once)."""
    import json

    from lms_tf.tf.diagnostics import AllocationEvent, live_at_allocator_peak

    result, real = memory_run("wide_cnn,1f1b,3,4,serialize", ["--memory-trace", str(tmp_path)])
    assert result["layers"][1] == ["conv_2"], result["layers"]
    for k in (1, 2):
        events = [AllocationEvent(**e) for e in json.loads((tmp_path / f"stage{k}.json").read_text())]
        peak, live = live_at_allocator_peak(events)
        assert peak == real[k], (k, peak, real)
        if k == 1:
            scratch = [e for e in live if e.region_type == "temp" and e.op.endswith("Conv2DBackpropFilter")]
            assert len(scratch) == 1, [(e.op, e.region_type, e.chunk_bytes) for e in live]
            microbatch = scratch[0].op.split("/")[1]  # gradient_tape/microbatch<m>/conv_2_1/...
            sent = [e for e in live if e.op == f"gradient_tape/{microbatch}/conv_2_1/convolution/Conv2DBackpropInput"]
            assert sent and sent[0].shape == "[16,32,32,64]", [(e.op, e.chunk_bytes) for e in live]
    assert 0.9 <= real[1] / result["simulated"][1] <= 1.1, (real, result["simulated"])


@pytest.mark.timeout(900)
def test_recomputing_stages_lower_each_stage_process_real_peak_as_predicted():
    """One process per stage, each with its own allocator: the activation-heavy CNN cut in two
    (GPipe, 4 micro-batches, serialized), trained with every stage keeping all it computes and
    again with every stage keeping only what it receives and running its forward pass again
    (PipelineStep(recompute=)). Each stage process's real peak drops (measured 0.62x and 0.64x),
    the numbers do not change, and the medians of three runs are within the issue's 10% of
    lms-tf's simulator replaying the built step (measured 0.99 and 1.03). Against the per-layer
    figure the partition uses (recompute_peak), the spread the benchmark reports (1.11 and 1.02
    here; docs/benchmarks/partition.md)."""
    kept = [memory_run("wide_cnn,gpipe,2,4,serialize") for _ in range(3)]
    again = [memory_run("wide_cnn,gpipe,2,4,serialize,recompute") for _ in range(3)]
    assert all(result["losses"] == kept[0][0]["losses"] for result, _ in kept + again)
    assert again[0][0]["recompute_stages"] == [0, 1] and kept[0][0]["recompute_stages"] == []
    median = lambda runs: [sorted(real[k] for _, real in runs)[1] for k in range(2)]
    before, after = median(kept), median(again)
    assert all(a < 0.75 * b for a, b in zip(after, before)), (before, after)
    result = again[0][0]
    by_simulator = [after[k] / result["simulated"][k] for k in range(2)]
    by_model = [after[k] / result["predicted"][k] for k in range(2)]
    assert all(0.9 <= r <= 1.1 for r in by_simulator), (by_simulator, [real for _, real in again], result)
    assert all(0.95 <= r <= 1.25 for r in by_model), (by_model, [real for _, real in again], result)
