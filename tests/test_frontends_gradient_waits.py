"""Weight fetches that wait for a weight gradient to reach the host (``after_gradients``).

With the weights on the host, each weight gradient is copied to the host, where the update runs.
A fetch that waits for a gradient holds its window back until those bytes have left the device,
so the backward pass does not run ahead while a large gradient is still on it. The planner adds
such waits when a gradient still being copied out sits at the peak (tests/test_planner_weight_fetches.py);
here every backward fetch that can is made to wait for the gradient completed last before its
window, through the front-ends' own planning, and the step must train exactly as the plain one,
with each wait in the graph and in the executed order. On logical CPUs the copies move no bytes,
but the executor orders them as on a GPU.
"""

import dataclasses

import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError, RewriteError
from lms_tf.core.ir import same_device
from lms_tf.core.op_kinds import TO_HOST_PREFIX
from lms_tf.core.plan import Plan, SwapIn
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner.timing import waitable_gradient
from lms_tf.simulate import gradients_crossing_as, simulate, update_products_on_device
from lms_tf.tf import driver
from lms_tf.tf.diagnostics import executed_ops, find_executed
from lms_tf.tf.rewrite import LMS_ATTR
from tests import zoo
from lms_tf.keras.step_hooks import add_step_hook
from tests.helpers import BATCH, assert_same_numbers, custom_loop, fit_steps, graph_probe, lms_function
from tests.test_frontends_weights import HOST, decoder_lm

V100 = CostModel(get_device_spec("v100-16gb-pcie3"))


def with_waits(ir, plan: Plan) -> Plan:
    """``plan`` with every fetch that starts after a weight gradient was complete (in the simulated
    step) waiting for the one completed last before it. A window that starts after a gradient's
    producer ended cannot be one that gradient depends on, so no wait makes a cycle."""
    sim = simulate(ir, plan, cost=V100)
    completed = set()
    on_device = update_products_on_device(ir)
    for name in sim.op_intervals:
        if name.startswith(TO_HOST_PREFIX):
            # what crosses is the gradient or a product of it made on the device (SGD's)
            for gradient in gradients_crossing_as(ir, name[len(TO_HOST_PREFIX):], on_device):
                if waitable_gradient(ir, gradient, plan.host):   # the planner's rule (not a tied weight's first contribution)
                    completed.add((sim.op_intervals[ir.tensors[gradient].producer][1], gradient))
    completed = sorted(completed)
    weights = []
    for weight in plan.weights:
        fetches = []
        for fetch in weight.fetches:
            starts = [sim.op_intervals[c][0] for c in fetch.consumers if c in sim.op_intervals]
            before = [g for end, g in completed if starts and end <= min(starts)]
            fetches.append(dataclasses.replace(fetch, after_gradients=tuple(before[-1:])))
        weights.append(dataclasses.replace(weight, fetches=tuple(fetches)))
    return dataclasses.replace(plan, weights=tuple(weights))


@pytest.fixture
def waiting_plans(monkeypatch):
    """The front-ends plan as usual, then every fetch that can waits for a gradient."""
    planned = driver._make_plan
    monkeypatch.setattr(driver, "_make_plan",
                        lambda ir, request, aliases, **kwargs: with_waits(ir, planned(ir, request, aliases, **kwargs)))


def _waits(plan):
    return [(w.variable, f) for w in plan.offloaded_weights for f in w.fetches if f.after_gradients]


def _assert_waits_in_graph(graph, plan):
    """Each waiting fetch has a host -> host control input from a host Identity that received its
    gradient (or the products of it the device computes for the update), and what the update
    reads on the host is that identity, never the device tensor itself."""
    host = plan.host
    on_host = [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "gradient_on_host"]
    assert on_host
    for op in on_host:
        received = op.inputs[0]
        assert same_device(op.device, host) and not same_device(received.op.device, host), op.name
        assert not any(same_device(c.device, host) for c in received.consumers() if c is not op), op.name
        assert any(same_device(c.device, host) for t in op.outputs for c in t.consumers()), op.name
    waiting = 0
    for variable, fetch in _waits(plan):
        fetch_ops = {t.op for c in fetch.consumers for t in graph.get_operation_by_name(c).inputs
                     if _compat.string_attr(t.op, LMS_ATTR) == "weight_fetch"}
        assert len(fetch_ops) == 1, (variable, fetch_ops)
        (fetch_op,) = fetch_ops
        controls = [c for c in fetch_op.control_inputs if _compat.string_attr(c, LMS_ATTR) == "gradient_on_host"]
        assert controls and all(same_device(c.device, host) for c in controls), fetch_op.name
        # what each control received is the planned gradient, or computed on the device from it alone
        (gradient,) = fetch.after_gradients
        for control in controls:
            assert _derived_from(control.inputs[0], gradient), (control.inputs[0].name, gradient)
        waiting += 1
    return waiting


def _derived_from(tensor, gradient: str, hops: int = 4) -> bool:
    """Whether ``tensor`` is ``gradient`` or computed from it within ``hops`` ops (views, products)."""
    if tensor.name == gradient:
        return True
    return hops > 0 and any(_derived_from(t, gradient, hops - 1) for t in tensor.op.inputs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sequential_cnn", "resnet_style", "decoder_lm"])
def test_fit_with_fetches_waiting_for_gradients_equals_plain_fit(name, waiting_plans):
    """SGD with momentum (the CNN: the product with the learning rate is made on the device and
    sent), BatchNormalization (ResNet-style), Adam with a tied embedding (the decoder: the gradient
    is sent, and the host squares it)."""
    builder = decoder_lm if name == "decoder_lm" else zoo.FIT_ZOO[name]
    plain = fit_steps(builder)
    facts = {}

    def probed():
        model, data = builder()
        add_step_hook(model, graph_probe(facts))
        return model, data

    callback = lms_tf.LMSCallback(**HOST)
    rewritten = fit_steps(probed, callbacks=[callback])
    plan = callback.plan
    assert len(_waits(plan)) >= 2, lms_tf.explain(callback)
    assert _assert_waits_in_graph(facts["graph"], plan) == len(_waits(plan))
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(300)
def test_custom_loop_with_fetches_waiting_for_gradients_equals_plain_and_runs_in_that_order(waiting_plans):
    """A hand-written step (SGD with momentum); TensorFlow's profiler: each waiting fetch's copy
    starts after its gradient's copy to the host ended."""
    plain = custom_loop(zoo.sequential_cnn, tf.function)
    trained = {}

    def builder():
        model, data = zoo.sequential_cnn()
        trained["data"] = data
        return model, data

    rewritten = custom_loop(builder, lms_function(**HOST),
                            prepare=lambda model, optimizer: lms_tf.place_weights(model, optimizer, host="/CPU:1"))
    assert_same_numbers(plain, rewritten)
    fn = rewritten[2]
    plan = fn.plan
    x, y = trained["data"]
    xb, yb = tf.constant(x[:BATCH]), tf.constant(y[:BATCH])
    graph = fn.get_concrete_function(xb, yb).graph
    waiting = _assert_waits_in_graph(graph, plan)
    assert waiting >= 2
    events = executed_ops(lambda: fn(xb, yb))
    # The profiler records the copies between the logical devices (``_Send``, named after what
    # they send), not the host identities: a waiting fetch's copy to the device starts only after
    # the copy of each tensor its gradient's identity received has started, and after the kernel
    # that made that tensor ended. Start, not end: in one process a ``_Send`` hands its tensor to
    # the waiting ``_Recv`` inside its own kernel, and what waited for it starts on another thread
    # before the ``_Send``'s span is recorded as ended (CI saw 0.36 ms of overlap on two cores).
    sends = {}
    for e in events:
        if e.type == "_Send":
            sends.setdefault(e.node.rsplit("/_", 1)[0], []).append(e)
    checked = made_seen = 0
    for variable, fetch in _waits(plan):
        fetch_op = next(t.op for c in fetch.consumers for t in graph.get_operation_by_name(c).inputs
                        if _compat.string_attr(t.op, LMS_ATTR) == "weight_fetch")
        assert fetch_op.name in sends, f"no copy of {fetch_op.name} in the profile"
        copied = min(e.start_ps for e in sends[fetch_op.name])
        for control in fetch_op.control_inputs:
            if _compat.string_attr(control, LMS_ATTR) != "gradient_on_host":
                continue
            source = control.inputs[0].op.name
            assert source in sends, f"no copy of {source} to the host in the profile"
            assert copied >= min(e.start_ps for e in sends[source]), (fetch_op.name, source)
            made = find_executed(events, source)
            if made is not None:   # an op the executor ran inline leaves no kernel in the trace
                assert copied >= made.end_ps, (fetch_op.name, source)
                made_seen += 1
            checked += 1
    assert checked >= waiting and made_seen >= 1, (checked, made_seen, waiting)


def test_a_plan_whose_fetch_waits_for_a_tensor_the_step_does_not_have_is_refused():
    """``plan=`` checks what a fetch waits for against the traced step before rewriting it."""
    ir = _tiny_ir()
    plan = _tiny_plan(after=("no_such_gradient:0",))
    with pytest.raises(LMSOptionError, match="no_such_gradient:0.*is not in it"):
        driver.check_plan_matches(plan, ir, api="lms_tf.function")


def test_a_fetch_waiting_for_a_tensor_the_update_does_not_read_on_the_host_is_refused():
    """The simulator and the rewrite both name the tensor and say what after_gradients may hold."""
    from lms_tf.tf.rewrite.weights import gradient_on_host
    graph = tf.Graph()
    with graph.as_default():
        tf.ones((2, 2), name="activation")
    with pytest.raises(RewriteError, match="'activation:0'.*nothing on the host reads it"):
        gradient_on_host(graph, "activation:0", "/CPU:1", frozenset(), {}, {})
    with pytest.raises(LMSOptionError, match="waits for 'x:0' to reach the host"):
        simulate(_tiny_ir(), _tiny_plan(after=("x:0",)), cost=V100)


def test_after_gradients_on_an_activation_swap_in_is_refused_before_rewriting():
    from lms_tf.core.plan import Decision, TensorDecision
    from lms_tf.tf.rewrite import apply_plan
    from lms_tf.tf.trace import build_ir
    graph = tf.Graph()
    with graph.as_default():
        tf.ones((2, 2), name="x")
    swapped = TensorDecision("x:0", "", (2, 2), 16, Decision.SWAP, "", 1, (SwapIn("x", ("x",), ("x:0",)),))
    plan = Plan((swapped,), "/device:CPU:0", "/device:CPU:1", {}, {})
    with pytest.raises(RewriteError, match="only a weight fetch may have"):
        apply_plan(graph, build_ir(graph), plan)
    assert not any(_compat.string_attr(op, LMS_ATTR) for op in graph.get_operations())  # nothing inserted


def test_after_gradients_survive_the_plan_file_and_show_in_the_summary():
    plan = _tiny_plan(after=("gw:0",))
    again = Plan.from_json(plan.to_json())
    assert again.weights == plan.weights and again.num_gradient_waits == 1
    assert "after 1 gradient reached the host" in plan.summary()
    assert "1 of the fetches after a gradient reached the host" in plan.one_line()
    assert plan.to_dict()["totals"]["num_gradient_waits"] == 1


def _tiny_ir():
    from lms_tf.core.examples import weighted_chain_ir
    return weighted_chain_ir()


def _tiny_plan(after):
    from lms_tf.core.plan import Decision, WeightDecision
    weight = WeightDecision("w2:0", ("rw2:0",), (256, 256), 256 * 256 * 4, Decision.SWAP, "weights='host'",
                            (SwapIn("", ("m2",)), SwapIn("loss", ("gx2",), after)))
    return Plan((), "/device:GPU:0", "/device:CPU:1", {"weights": "host"}, {}, weights=(weight,))
