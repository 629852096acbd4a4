"""The shipped examples and the lms-tf command line run end to end."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.pop("TF_DETERMINISTIC_OPS", None)  # set by conftest for the in-process tests only
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.perf_counter() - started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", ["examples/keras_fit.py", "examples/custom_loop.py"])
def test_example_runs_on_cpu_and_swaps(example):
    done, seconds = _run([example], timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = [line for line in done.stdout.splitlines() if line.startswith("lms-tf: swapped")]
    assert summary and not summary[0].startswith("lms-tf: swapped 0 "), done.stdout[-2000:]
    # Quiet: no AutoGraph notice about lms-tf's own code, and the plan's line once per trace.
    assert "AutoGraph" not in done.stderr and "lms_tf/" not in done.stderr, done.stderr[-2000:]


@pytest.mark.timeout(300)
def test_cli_explain_json_reports_a_lower_virtual_gpu_peak():
    done, _ = _run(["-m", "lms_tf.cli", "explain", "--model", "MobileNetV2", "--batch", "8",
                    "--input-shape", "96x96", "--classes", "10", "--json"], timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["swapped_tensors"] > 0 and result["swap_ins"] >= result["swapped_tensors"]
    assert 0 < result["oracle_lms_peak_bytes"] < result["oracle_baseline_peak_bytes"]
    assert "[4/4] simulating" in done.stderr  # progress is shown


@pytest.mark.timeout(120)
def test_cli_reports_bad_input_without_a_traceback():
    done, _ = _run(["-m", "lms_tf.cli", "explain", "--model", "NoSuchNet", "--batch", "2"], timeout=110)
    assert done.returncode == 2
    assert "lms-tf: error: model 'NoSuchNet' is not a keras.applications name" in done.stderr
    assert "Traceback" not in done.stderr
    done, _ = _run(["-m", "lms_tf.cli", "explain", "--model", "resnet50", "--batch", "2", "--swapin-ahead", "0"],
                   timeout=110)
    assert done.returncode == 2 and "argument --swapin-ahead: must be an int >= 1; received '0'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(300)
def test_cli_explain_recompute_only():
    done, _ = _run(["-m", "lms_tf.cli", "explain", "--model", "MobileNetV2", "--batch", "4",
                    "--input-shape", "64x64", "--classes", "10", "--recompute", "sqrt", "--no-swap", "--json"], timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["swapped_tensors"] == 0 and result["recomputed_tensors"] > 0
    assert result["recompute_clones"] >= result["recomputed_tensors"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (["--help"], None),
    (["plan", "--model", "resnet50", "--batch", "0"], "argument --batch: must be an int >= 1; received '0'"),
    (["plan", "--model", "resnet50", "--batch", "-1"], "argument --batch: must be an int >= 1; received '-1'"),
    (["plan", "--model", "resnet50", "--batch", "8", "--budget", "abc"], "argument --budget: budget must be"),
    (["plan", "--model", "resnet50", "--batch", "8", "--budget", "200%"], "budget must be at most 100%"),
    (["plan", "--model", "resnet50", "--batch", "8", "--budget", "0"], "argument --budget: budget must be > 0"),
    (["explain", "--model", "resnet50", "--batch", "8", "--device", "v200"], "argument --device:"),
    (["max-batch", "--model", "resnet50", "--input-shape", "32x64"], "must be HxW with H == W"),
    (["max-params", "--max-width", "64"], "argument --max-width: must be at least 128"),
    (["max-params", "--family", "cnn"], "argument --family: invalid choice: 'cnn'"),
    (["max-params", "--host-budget", "lots"], "argument --host-budget:"),
])
def test_help_and_bad_values_answer_before_tensorflow_is_imported(argv, message):
    """Usage is checked while parsing: exit code 2 and the rule broken, with TensorFlow never imported."""
    script = (f"import sys\nfrom lms_tf.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
              f"    code = e.code\nprint('exit', code, 'tensorflow' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.stdout.strip().splitlines()[-1] == f"exit {0 if message is None else 2} False", done.stderr[-2000:]
    if message is not None:
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.timeout(300)
def test_cli_infeasible_text_says_so_without_a_planned_figure():
    done, _ = _run(["-m", "lms_tf.cli", "plan", "--model", "UNet", "--input-shape", "32x32", "--batch", "2",
                    "--budget", "1KiB"], timeout=280)
    assert done.returncode == 3, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("infeasible: budget 1.0 KiB (1024 bytes) is infeasible"), lines[0]
    assert "no plan fits" in lines[2] and "nan" not in done.stdout
    assert all("planned" not in line for line in lines[2:]), lines[2:]  # no planned figure for a plan that is not
    assert lines[3].startswith("Grappler virtual GPU:") and lines[3].endswith("MiB plain")


@pytest.mark.timeout(60)
def test_help_imports_no_tensorflow():
    """``lms-tf --help`` answers without importing TensorFlow (0.16 s measured here; TensorFlow's
    import alone takes ~5 s). Checked by the modules loaded, not by a clock: a busy CI machine
    makes wall-clock bounds flaky."""
    script = ("import sys\nfrom lms_tf.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
              "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and "max-batch" in done.stdout, done.stderr
    assert done.stdout.splitlines()[-1] == "LOADED []", done.stdout.splitlines()[-1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("verbose", [False, True])
def test_the_cli_shows_only_its_own_lines_unless_verbose(verbose):
    """TensorFlow prints its C++ start-up lines before its log level applies; the CLI captures them
    (``--verbose`` shows them, which is how the check could fail). ``--verbose`` adds lms-tf's debug
    messages, not other libraries' (before, it turned on matplotlib's, h5py's and TensorFlow's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_DETERMINISTIC_OPS")}
    env["PYTHONPATH"] = ROOT
    argv = [sys.executable, "-m", "lms_tf.cli", *(["--verbose"] if verbose else []), "plan", "--model", "UNet",
            "--input-shape", "32x32", "--batch", "2", "--no-oracle"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    foreign = [line for line in done.stderr.splitlines() if line.strip() and " lms_tf " not in line]
    if verbose:
        assert any("oneDNN" in line or "cuda" in line.lower() for line in foreign), done.stderr[-2000:]
        # lms-tf's own debug messages, and no other Python library's (matplotlib, h5py, tensorflow)
        logged = [line.split()[2:4] for line in done.stderr.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
        assert ["lms_tf", "DEBUG"] in logged, done.stderr[-2000:]
        assert [entry for entry in logged if entry[1] == "DEBUG" and entry[0] != "lms_tf"] == [], logged
    else:
        assert foreign == [], foreign


@pytest.mark.timeout(200)
def test_plan_with_weights_on_the_host_counts_no_resident_weights_and_pays_the_fetched_windows():
    out = {}
    for weights in ("device", "host"):
        done, _ = _run(["-m", "lms_tf.cli", "plan", "--model", "UNet", "--input-shape", "32x32", "--batch", "2",
                        "--weights", weights, "--json"], timeout=190)
        assert done.returncode == 0, done.stderr[-3000:]
        out[weights] = json.loads(done.stdout)
    device, host = out["device"], out["host"]
    assert device["offloaded_weight_bytes"] == 0 and host["weights"] == "host"
    # Every weight the layers read moves off the device, and so does what only the update reads (SGD's
    # learning rate, 4 bytes); the optimizer's step counter (an int64 the step also reads) stays.
    assert host["offloaded_weight_bytes"] > 0.99 * device["resident_bytes"]
    assert host["resident_bytes"] == device["resident_bytes"] - host["offloaded_weight_bytes"] - 4 == 8
    assert host["host_peak_bytes"] >= host["offloaded_weight_bytes"] + 4
    # The step's own peak now holds the fetched copies, each only for its window.
    assert device["planned_peak_bytes"] < host["planned_peak_bytes"] \
        < device["planned_peak_bytes"] + host["offloaded_weight_bytes"]
    # Grappler judged the rewritten step (its fetches placed as TensorFlow places them).
    assert host["oracle_planned_peak_bytes"] is not None


@pytest.mark.timeout(300)
def test_plan_hybrid_plans_one_rank_with_its_share_of_the_sharded_layers():
    """``--hybrid 2``: VGG16's fc1 and fc2 (8 and 64 MiB at 32x32) are sharded across two ranks;
    one rank's resident variables drop by half of them (and of their optimizer slots), and the
    plan is made on that rank's step, its collectives stood in for by local ops."""
    out = {}
    for hybrid in ([], ["--hybrid", "2", "--min-param-bytes", "4MiB"]):
        done, _ = _run(["-m", "lms_tf.cli", "plan", "--model", "vgg16", "--input-shape", "32x32", "--classes", "10",
                        "--batch", "4", "--no-oracle", "--json", *hybrid], timeout=280)
        assert done.returncode == 0, done.stderr[-3000:]
        out[bool(hybrid)] = json.loads(done.stdout)
    whole, rank = out[False], out[True]
    assert whole["sharded_layers"] == [] and rank["sharded_layers"] == ["fc1", "fc2"] and rank["hybrid"] == 2
    fc_bytes = (512 * 4096 + 4096 + 4096 * 4096 + 4096) * 4
    assert whole["resident_bytes"] - rank["resident_bytes"] >= fc_bytes // 2
    assert rank["feasible"] and rank["planned_peak_bytes"] < whole["planned_peak_bytes"]
