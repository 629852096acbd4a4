"""The install scripts build the same way whatever the shell puts first on PATH, and the package builds quietly."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_CMAKE_4 = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "cmake version 4.4.5"; exit 0; fi
echo "CMake Error: Compatibility with CMake < 3.5 has been removed from CMake." >&2
exit 1
"""


@pytest.mark.timeout(300)
def test_horovod_build_uses_its_pinned_cmake_not_the_first_on_path(tmp_path):
    """PyPI's CMake 4 first on PATH (an activated venv that has it) must not be what builds Horovod."""
    (tmp_path / "cmake").write_text(FAKE_CMAKE_4)
    (tmp_path / "cmake").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "scripts/install_horovod.sh", "--print-build-tools", sys.executable],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    cmake = re.search(r"^cmake=(.*)$", done.stdout, re.M).group(1)
    assert os.path.dirname(cmake) == os.path.dirname(sys.executable), done.stdout
    assert re.search(r"^cmake version 3\.31\.\d+$", done.stdout, re.M), done.stdout


def test_build_tools_are_pinned_and_the_build_is_told_which_cmake():
    script = open(os.path.join(ROOT, "scripts", "install_horovod.sh")).read()
    tools = re.search(r"^BUILD_TOOLS=\((.*)\)$", script, re.M).group(1)
    assert '"cmake==3.' in tools and '"setuptools==' in tools and '"wheel==' in tools
    assert 'HOROVOD_CMAKE="$CMAKE_BIN"' in script
    # The test command and the image install through one script, with the venv first on PATH.
    install = open(os.path.join(ROOT, "scripts", "install.sh")).read()
    assert 'PATH="$PWD/$VENV/bin:$PATH" bash scripts/install_horovod.sh "$VENV/bin/python"' in install
    assert 'VENV="${LMS_TF_VENV:-.venv}"' in install
    assert "bash scripts/install.sh" in open(os.path.join(ROOT, "scripts", "test.sh")).read()
    assert "RUN bash scripts/docker_install.sh" in open(os.path.join(ROOT, "Dockerfile")).read()
    assert "bash scripts/install.sh" in open(os.path.join(ROOT, "scripts", "docker_install.sh")).read()


@pytest.mark.timeout(300)
def test_the_package_builds_without_setuptools_warnings(tmp_path):
    """A user's ``pip install`` shows no warnings from our metadata (setuptools deprecated the
    license classifiers in favour of the SPDX ``license`` field)."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-w", str(tmp_path), "-v"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    warned = [line for line in (done.stdout + done.stderr).splitlines()
              if "Warning" in line and "byte-compiling is disabled" not in line]
    assert warned == [], warned


def _pins(name: str) -> dict:
    with open(os.path.join(ROOT, "constraints", f"{name}.txt"), encoding="utf-8") as f:
        return dict(line.strip().split("==") for line in f if "==" in line and not line.startswith("#"))


def test_setup_py_allows_exactly_the_tested_pairs_and_this_suite_runs_on_one():
    """setup.py's ranges run from the oldest tested pair to the newest (scripts/test.sh runs the
    suite on the newest, the tests of the TensorFlow side and front-ends on both), and the TensorFlow / Keras this suite runs on are one of those pairs."""
    import importlib.metadata

    import keras
    import tensorflow as tf

    oldest, latest = _pins("oldest"), _pins("latest")
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        setup_py = f.read()
    for package, variable in (("tensorflow", "TENSORFLOW"), ("keras", "KERAS"), ("tf-keras", "TF_KERAS")):
        spec = re.search(rf'^{variable} = "([^"]+)"', setup_py, re.M).group(1)
        low, high = oldest[package], latest[package]
        assert spec == (f"{package}=={high}" if low == high else f"{package}>={low},<={high}"), (spec, low, high)
    running = {"tensorflow": tf.__version__, "keras": keras.__version__,
               "tf-keras": importlib.metadata.version("tf-keras")}
    assert running in (oldest, latest), running
