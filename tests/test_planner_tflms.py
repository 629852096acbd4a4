"""The default plan's semantics on a hand-built step whose structure is known."""

import dataclasses

import pytest
import tensorflow as tf

from lms_tf.core.ir import Phase
from lms_tf.core.plan import Decision
from lms_tf.core.policy import Policies
from lms_tf.planner import make_plan
from lms_tf.planner.candidates import backward_gates
from lms_tf.tf.trace import build_ir

DEVICE = "/device:CPU:0"


@pytest.fixture(scope="module")
def chain_ir():
    """Eight matmul+relu layers: relu outputs are read by the backward pass in reverse order."""
    weights = [tf.Variable(tf.ones((64, 64)) * 0.01) for _ in range(8)]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.nn.relu(h @ w)
            loss = tf.reduce_sum(h)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.1 * g)
        return loss

    return build_ir(step.get_concrete_function(tf.ones((128, 64))).graph)


def _options(**kw):
    return Policies(host="/CPU:1", **{"min_swap_bytes": 1, **kw})


def test_threshold_selects_tensors_by_distance_to_first_backward_consumer(chain_ir):
    plan = make_plan(chain_ir, _options(swapout_threshold=1), device=DEVICE)
    relu = [d for d in plan.decisions if d.tensor.startswith("Relu")]
    # The last activation's first backward reader is the first gradient op: nothing can trigger it.
    assert len(relu) == 8 and all(d.decision is Decision.SWAP for d in relu[:-1])
    assert relu[-1].reason.startswith("no backward op runs before its first backward consumer")
    relu = relu[:-1]
    distances = sorted(d.distance for d in relu)
    cut = distances[4]
    plan = make_plan(chain_ir, _options(swapout_threshold=cut), device=DEVICE)
    for d in plan.decisions:
        if d.tensor.startswith("Relu") and d.tensor != "Relu_7:0":
            assert (d.decision is Decision.SWAP) == (d.distance >= cut), d


def test_swapin_ahead_countsbackward_gates_before_the_first_consumer(chain_ir):
    gates = backward_gates(chain_ir)
    positions = [g.index for g in gates]
    for ahead in (1, 3):
        plan = make_plan(chain_ir, _options(swapout_threshold=1, swapin_ahead=ahead), device=DEVICE)
        for d in plan.swapped:
            for swap in d.swap_ins:
                first = min(chain_ir.op(c).index for c in swap.consumers)
                before = [p for p in positions if p < first]
                assert chain_ir.op(swap.trigger).index == before[max(0, len(before) - ahead)]
                assert chain_ir.op(swap.trigger).phase is Phase.BACKWARD


def test_swapin_groupby_merges_nearby_consumers(chain_ir):
    separate = make_plan(chain_ir, _options(swapout_threshold=1, swapin_groupby=0), device=DEVICE)
    merged = make_plan(chain_ir, _options(swapout_threshold=1, swapin_groupby=1000), device=DEVICE)
    assert all(len(d.swap_ins) == 1 for d in merged.swapped)
    assert separate.num_swap_ins > merged.num_swap_ins
    for d in separate.swapped:
        consumers = [c for s in d.swap_ins for c in s.consumers]
        assert len(consumers) == len(set(consumers)) == len(d.swap_ins)


def test_min_swap_bytes_keeps_small_tensors(chain_ir):
    plan = make_plan(chain_ir, _options(swapout_threshold=1, min_swap_bytes=128 * 64 * 4 + 1), device=DEVICE)
    assert not plan.swapped
    assert plan.kept_reasons()["smaller than min_swap_bytes"] >= 8


def test_ops_placed_elsewhere_are_not_swapped(chain_ir):
    plan = make_plan(chain_ir, _options(swapout_threshold=1), device="/device:GPU:0")
    assert plan.swapped, "ops without a requested device are placed on the accelerator"


def test_plan_is_printable_data(chain_ir):
    plan = make_plan(chain_ir, _options(swapout_threshold=1), device=DEVICE)
    text = plan.summary()
    assert "Relu:0" in text and "MiB" in text
    data = plan.to_dict()
    assert data["totals"]["num_swap_ins"] == plan.num_swap_ins and data["policies"]["host"] == "/device:CPU:1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decisions = ()  # frozen


def test_no_gate_is_an_op_grappler_rewrites_or_an_op_run_off_the_device(chain_ir):
    """A gate's reader on an op Grappler folds into another would stop that rewrite (and change the
    numbers); an op run off the device (another pipeline stage's, the update on the host) would
    tie the swap-in to another device's progress. Both are left out of the gates, and the plans
    trigger on the others."""
    import dataclasses

    gates = [g.name for g in backward_gates(chain_ir)]
    assert len(gates) > 4
    folded, elsewhere = frozenset(gates[1::3]), frozenset(gates[2::3])
    ir = dataclasses.replace(chain_ir, grappler_rewritten=folded, host_placed=elsewhere)
    left = [g.name for g in backward_gates(ir)]
    assert left == [g for g in gates if g not in folded | elsewhere]
    plan = make_plan(ir, _options(swapout_threshold=1), device=DEVICE)
    triggers = {s.trigger for d in plan.swapped for s in d.swap_ins}
    assert triggers and not triggers & (folded | elsewhere), triggers


@pytest.mark.parametrize("option", ["exclude", "recompute"])
def test_a_layer_list_that_names_nothing_is_refused_naming_its_option(chain_ir, option):
    """``recompute=[...]`` and ``exclude=[...]`` take the same entries; the error says which was wrong."""
    from lms_tf.core.errors import LMSOptionError
    with pytest.raises(LMSOptionError, match=rf"^{option} entry 'no_such_layer' is not a layer name"):
        make_plan(chain_ir, _options(**{option: ["no_such_layer"]}), device=DEVICE)
    with pytest.raises(LMSOptionError, match=rf"^{option} pattern '\*/nothing\*' matches no op"):
        make_plan(chain_ir, _options(**{option: ["*/nothing*"]}), device=DEVICE)
