"""The plan plot: rendered, with each of its parts present where a reader looks for it."""

import matplotlib
import pytest
import tensorflow as tf

from lms_tf.cli.plots import timeline_figure
from lms_tf.core import Policies
from lms_tf.core.errors import InfeasibleBudgetError
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan
from lms_tf.simulate import simulate
from lms_tf.tf.trace import trace_step_ir
from tests import zoo
from tests.helpers import keras_train_step

matplotlib.use("Agg")
COST = CostModel(get_device_spec("v100-16gb-pcie3"))


@pytest.fixture(scope="module")
def resnet_ir():
    model, (x, y) = zoo.resnet_style()
    return trace_step_ir(keras_train_step(model), tf.constant(x[:8]), tf.constant(y[:8]))


def _plan(ir, **policies):
    return make_budget_plan(ir, Policies(host="/CPU:1", **policies), device="/device:CPU:0", cost=COST)


def _labels(axes):
    return [text.get_text() for text in axes.get_legend().get_texts()]


def _band_height(axes, label_start):
    (band,) = [c for c in axes.collections if c.get_label().startswith(label_start)]
    return max(vertex[1] for path in band.get_paths() for vertex in path.vertices)


@pytest.mark.parametrize("policies, band", [(dict(budget="40%"), "swapped back in"),
                                            (dict(budget="60%", swap=False, recompute="auto"), "recomputed")])
def test_the_plot_shows_swapped_and_recomputed_bytes_and_the_backward_boundary(resnet_ir, policies, band):
    plan = _plan(resnet_ir, **policies)
    baseline, planned = simulate(resnet_ir, cost=COST), simulate(resnet_ir, plan, cost=COST)
    fig = timeline_figure(baseline, planned, plan.budget_bytes, title="resnet_style")
    memory, traffic = fig.axes
    labels = _labels(memory)
    assert [label.split(" (")[0] for label in labels] == ["plain", "lms-tf plan", "recomputed", "swapped back in",
                                                          f"budget {plan.budget_bytes / 2**20:.0f} MiB"]
    # The band of what the plan holds recomputed or swapped in is drawn, and lies under the curve.
    assert _band_height(memory, band) > 0
    assert _band_height(memory, "swapped back in") <= planned.peak_bytes / 2**20
    # The forward | backward boundary: a line in both panels where the forward pass ended.
    assert 0 < planned.backward_start_s < planned.step_time_s
    for axes in (memory, traffic):
        assert any(line.get_linestyle() == "-." and line.get_xdata()[0] == planned.backward_start_s * 1e3
                   for line in axes.lines)
    # The legends sit right of the axes: no curve is under them.
    fig.canvas.draw()
    for axes in (memory, traffic):
        assert axes.get_legend().get_window_extent().x0 >= axes.get_window_extent().x1
    assert [t.get_text() for t in memory.texts] == ["forward | backward"]  # nothing says "infeasible"


def test_an_infeasible_plot_says_so_and_draws_the_smallest_feasible_budget(resnet_ir, tmp_path):
    with pytest.raises(InfeasibleBudgetError) as info:
        _plan(resnet_ir, budget="5%")
    err = info.value
    fig = timeline_figure(simulate(resnet_ir, cost=COST), None, err.budget_bytes, title="resnet_style",
                          smallest_feasible_bytes=err.smallest_feasible_bytes)
    memory = fig.axes[0]
    assert memory.get_title().endswith("infeasible")
    assert [t.get_text() for t in memory.texts] == ["infeasible: no plan fits this budget", "forward | backward"]
    assert f"smallest feasible budget {err.smallest_feasible_bytes / 2**20:.0f} MiB" in _labels(memory)
    assert any(line.get_linestyle() == ":" and line.get_ydata()[0] == err.smallest_feasible_bytes / 2**20
               for line in memory.lines)
