"""The layering holds: imports point one way (import-linter), and the planning core runs without TensorFlow."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def _lint_imports(root: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.run([LINT_IMPORTS, "--config", os.path.join(root, ".importlinter"), "--no-cache"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_imports_follow_the_layers():
    done = _lint_imports(ROOT)
    assert done.returncode == 0 and "1 kept, 0 broken" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.timeout(150)
def test_an_import_against_the_layers_breaks_the_contract(tmp_path):
    """The contract is not vacuous: the core importing the TensorFlow side is reported."""
    shutil.copytree(os.path.join(ROOT, "lms_tf"), tmp_path / "lms_tf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, ".importlinter"), tmp_path / ".importlinter")
    with open(tmp_path / "lms_tf" / "core" / "plan.py", "a") as f:
        f.write("\nfrom lms_tf.tf import driver  # noqa: E402,F401 - deliberately against the layers\n")
    done = _lint_imports(str(tmp_path))
    assert done.returncode != 0 and "BROKEN" in done.stdout
    assert "lms_tf.core.plan -> lms_tf.tf.driver" in done.stdout, done.stdout[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("package", ["lms_tf.core", "lms_tf.cost", "lms_tf.simulate", "lms_tf.planner", "lms_tf.pipeline"])
def test_planning_layers_import_no_tensorflow(package):
    script = textwrap.dedent(f"""
        import sys

        class NoTensorFlow:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tensorflow", "keras", "tf_keras"):
                    raise ImportError(f"{{name}} imported by the planning layers")

        sys.meta_path.insert(0, NoTensorFlow())
        import {package}
        from lms_tf.core import Policies, make_ir
        from lms_tf.cost import CostModel, get_device_spec
        from lms_tf.planner import make_budget_plan
        ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (1024, 1024))])])
        plan = make_budget_plan(ir, Policies(budget="1GiB"), device="/device:GPU:0",
                                cost=CostModel(get_device_spec("v100-16gb-pcie3")))
        assert plan.predictions.feasible
        print("no tensorflow:", sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no tensorflow: []" in done.stdout
