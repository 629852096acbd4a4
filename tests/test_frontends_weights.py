"""Weights on the host (``weights="host"``): numbers, structure and errors.

Each variable lives on the host device (a second logical CPU here) and each window of device ops
that read it reads a gated host copy instead. On logical CPUs the copy moves no bytes, so these
tests prove the numbers and the graph; memory is the simulator's and Grappler's business.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.keras.step_hooks import add_step_hook
from lms_tf.tf.diagnostics import executed_ops, find_executed, virtual_gpu_peak, virtual_gpu_peak_report
from lms_tf.tf.rewrite import LMS_ATTR
from lms_tf.tf.variables import variable_device
from tests import zoo
from tests.helpers import (BATCH, CPU_LMS, ancestors, assert_same_numbers, custom_loop, fit_steps, graph_probe, keras_train_step,
                           lms_function)

SMALL = dict(CPU_LMS, swapout_threshold=4, min_swap_bytes=1024, swapin_ahead=2)
HOST = dict(SMALL, weights="host")
FAMILIES = ["sequential_cnn", "resnet_style", "inception_style", "subclassed", "text_embedding",
            "shared_multi_input_residual", "lstm"]


def decoder_lm(vocab=64, width=32, heads=2, length=12):
    """A decoder-only Transformer block: Embedding whose matrix is also the output projection
    (tied), causal MultiHeadAttention, LayerNorm, an MLP."""
    zoo.reseed()
    tokens = keras.Input((length,), dtype="int32")
    embed = keras.layers.Embedding(vocab, width)
    h = embed(tokens)
    a = keras.layers.MultiHeadAttention(heads, width // heads)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(h + a)
    m = keras.layers.Dense(2 * width, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(m))
    logits = keras.layers.Lambda(lambda t: keras.ops.matmul(t, keras.ops.transpose(embed.embeddings)))(h)
    logits = keras.layers.Lambda(lambda t: t[:, -1, :])(logits)
    model = keras.Model(tokens, logits)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(3)
    x = rng.integers(0, vocab, size=(3 * BATCH, length)).astype("int32")
    return model, (x, rng.integers(0, vocab, size=(3 * BATCH,)))


BUILDERS = {**{name: zoo.FIT_ZOO[name] for name in FAMILIES}, "decoder_lm": decoder_lm}


def _on_host(model) -> bool:
    return all(variable_device(v).endswith("CPU:1") for v in model.variables)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fit_with_weights_on_the_host_equals_plain_fit(name):
    plain = fit_steps(BUILDERS[name])
    callback = lms_tf.LMSCallback(**HOST)
    rewritten = fit_steps(BUILDERS[name], callbacks=[callback])
    plan = callback.plan
    assert plan is not None and plan.offloaded_weights, lms_tf.explain(callback)
    assert _on_host(rewritten[2]) and all(variable_device(v).endswith("CPU:1") for v in rewritten[2].optimizer.variables)
    # Every variable the forward or backward pass reads is fetched at least once per window.
    assert plan.num_weight_fetches >= len(plan.offloaded_weights)
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["resnet_style", "lstm", "decoder_lm"])
def test_custom_loop_with_weights_on_the_host_equals_plain(name):
    plain = custom_loop(BUILDERS[name], tf.function)
    trained = {}

    def prepare(model, optimizer):
        trained["model"] = model
        lms_tf.place_weights(model, optimizer, host="/CPU:1")

    rewritten = custom_loop(BUILDERS[name], lms_function(**HOST), prepare=prepare)
    plan = rewritten[2].plan
    # Every trainable variable read outside a loop is fetched: the tied embedding's too (its other
    # read, the gather, runs where the variable lives). The LSTM cell's variables are read only
    # inside its loop, which runs where they live: Keras's one probing step of the cell outside the
    # loop (to learn its output shapes) feeds nothing, and TensorFlow prunes it, with any fetch for it.
    model = trained["model"]
    in_loop_only = [v for layer in model.layers if isinstance(layer, keras.layers.RNN) for v in layer.trainable_weights]
    assert (name == "lstm") == bool(in_loop_only)
    assert len(plan.offloaded_weights) >= len(model.trainable_variables) - len(in_loop_only), lms_tf.explain(rewritten[2])
    assert not any("lstm_cell" in read for w in plan.offloaded_weights for read in w.reads)  # none fetched for the probe
    assert _on_host(trained["model"])
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(120)
def test_weights_on_the_host_without_moving_them_is_a_clear_error():
    model, (x, y) = zoo.sequential_cnn()
    step = _mlp_step(model, keras.optimizers.SGD(0.05))   # any step: the variables were never moved
    with pytest.raises(lms_tf.LMSOptionError, match=r"none of the .* variables the step reads lives on the host .*lms_tf\.place_weights"):
        lms_tf.function(step, **HOST)(tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))
    assert all(variable_device(v).endswith("CPU:0") for v in model.variables)  # untouched


@pytest.mark.timeout(300)
def test_swap_recompute_and_weights_on_the_host_together_equal_plain():
    plain = fit_steps(zoo.resnet_style)
    callback = lms_tf.LMSCallback(**HOST, recompute="cheap")
    rewritten = fit_steps(zoo.resnet_style, callbacks=[callback])
    assert callback.plan.recomputed and callback.plan.swapped and callback.plan.offloaded_weights
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["resnet_style", "shared_multi_input_residual", "decoder_lm"])
def test_every_device_read_of_a_weight_on_the_host_is_a_gated_fetch(name):
    facts = {}
    callback = lms_tf.LMSCallback(**HOST)
    model, (x, y) = BUILDERS[name]()
    add_step_hook(model, graph_probe(facts))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback])
    graph, plan = facts["graph"], callback.plan
    fetches = [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "weight_fetch"]
    clone_fetches = [op for op in fetches if "recompute_weight_fetch" in op.name]
    # As many copies as the plan's windows (shared weights: one per window, not one per reader).
    assert len(fetches) - len(clone_fetches) == plan.num_weight_fetches
    for op in fetches:
        assert op.device.endswith("CPU:1"), op.device
        fetch = _window_of(plan, op)
        gates = [c for c in op.control_inputs if _compat.string_attr(c, LMS_ATTR) == "swap_gate"]
        assert bool(gates) == bool(fetch.trigger), (op.name, fetch)
    for weight in plan.offloaded_weights:
        for read in weight.reads:
            readers = graph.get_tensor_by_name(read).consumers()
            # Only fetches (and host ops of the update) read the variable itself.
            assert all(_compat.string_attr(r, LMS_ATTR) == "weight_fetch" or r.name not in _device_ops(plan)
                       for r in readers), [r.name for r in readers]
    assert len({w.variable for w in plan.offloaded_weights}) == len(plan.offloaded_weights)  # one entry per variable


def _device_ops(plan):
    return {c for w in plan.offloaded_weights for f in w.fetches for c in f.consumers}


def _window_of(plan, op):
    i, j = (int(k) for k in op.name.rsplit("weight_fetch_", 1)[1].split("_")[:2])
    return plan.offloaded_weights[i].fetches[j]


def test_weights_option_is_checked():
    with pytest.raises(lms_tf.LMSOptionError, match=r"weights must be 'device', 'host' or 'auto'; received 'gpu'"):
        lms_tf.LMSCallback(weights="gpu")


def _wide_mlp():
    """Weights dominate: six 1024-wide Dense layers (4 MiB each) at batch 16.

    Seeded only, not ``zoo.reseed``: no test compares two of its builds' numbers, and with Keras's
    session cleared first the executed-order test of gradient copies failed 2 of 15 runs on
    TensorFlow 2.20 (0 of 15 without; why is not known)."""
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(1024, activation="relu") for _ in range(6)]
                            + [keras.layers.Dense(10)])


def _mlp_step(model, optimizer):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                                               from_logits=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return step


def _mlp_data():
    rng = np.random.default_rng(5)
    return tf.constant(rng.random((16, 512), dtype=np.float32)), tf.constant(rng.integers(0, 10, 16))


def _mlp_on_host(**options):
    model, optimizer = _wide_mlp(), keras.optimizers.SGD(0.01)
    lms_tf.place_weights(model, optimizer, host="/CPU:1")
    return lms_tf.function(_mlp_step(model, optimizer), **CPU_LMS, weights="host", swap=False, **options)


@pytest.mark.timeout(240)
def test_executed_order_each_weight_arrives_after_its_trigger_and_before_its_readers():
    """TensorFlow's profiler: each fetch's host->device transfer (the ``_Send`` named after it)
    starts after its trigger ended and before any op of its window starts."""
    x, y = _mlp_data()
    fn = _mlp_on_host(swapin_ahead=1)
    fn(x, y)
    events = executed_ops(lambda: fn(x, y))
    graph = fn.get_concrete_function(x, y).graph
    sends = [e for e in events if e.type == "_Send"]
    triggered = read_after = 0
    for op in graph.get_operations():
        if _compat.string_attr(op, LMS_ATTR) != "weight_fetch":
            continue
        transfer = min((e for e in sends if e.node.rsplit("/_", 1)[0].endswith(op.name)), key=lambda e: e.start_ps)
        if op.control_inputs:
            trigger = find_executed(events, op.control_inputs[0].inputs[0].op.inputs[0].op.name)
            assert trigger is not None and transfer.start_ps >= trigger.end_ps, op.name
            triggered += 1
        for reader in op.outputs[0].consumers():
            # A MatMul fused with its BiasAdd and Relu runs under the last one's name.
            ran = next(filter(None, (find_executed(events, name) for name in _fusion_chain(reader))), None)
            assert ran is not None, f"no run of {reader.name} (or what it is fused into) in the profile"
            assert ran.start_ps >= transfer.start_ps, (op.name, reader.name)
            read_after += 1
    plan = fn.plan
    assert triggered == sum(1 for w in plan.offloaded_weights for f in w.fetches if f.trigger) >= 10
    assert read_after >= plan.num_weight_fetches


@pytest.mark.timeout(240)
def test_executed_order_each_weight_gradient_leaves_the_device_as_soon_as_it_is_complete():
    """TensorFlow's profiler: each weight gradient leaves for the host (the ``_Send`` named after
    what it sends: the gradient, or its product with the learning rate, which stays on the device
    as in the plain step) as soon as it is complete: the way out (the product, else the copy)
    starts after that gradient op ends, depends on no weight gradient completed after it, and
    starts while the backward pass still runs; the copy follows the product. Gradients are not
    held until the backward pass ends. (On logical CPUs the copy moves no bytes, but the executor
    orders it as on a GPU.)

    The way out is judged by when it starts, not by when the copy starts: under load (CI's second
    worker) the 4 MiB product itself has been seen to take 1.5 ms instead of 0.1 while the first
    layer's small kernel gradient ran on the other thread, and so finished first, although the
    product had started 12 us after its gradient."""
    x, y = _mlp_data()
    fn = _mlp_on_host(swapin_ahead=1)
    fn(x, y)
    events = executed_ops(lambda: fn(x, y))
    graph = fn.get_concrete_function(x, y).graph
    copies, gradient_of = [], {}   # gradient_of: executed node -> traced gradient op
    for send in (e for e in events if e.type == "_Send"):
        sent = send.node.rsplit("/_", 1)[0]
        op = next((o for o in graph.get_operations() if sent.endswith(o.name)), None)
        # the gradient op itself, or the one the product sent reads
        gradient = next((t.op.name for t in (op.inputs if op is not None else ()) if "gradient_tape/" in t.op.name),
                        sent[sent.index("gradient_tape/"):] if "gradient_tape/" in sent else None)
        if gradient is None:
            continue  # a weight fetch (host -> device), not a gradient
        producer = find_executed(events, gradient)
        assert producer is not None, f"no run of {gradient} in the profile"
        gradient_of[producer.node] = gradient
        product = find_executed(events, op.name) if op is not None and op.name != gradient else None
        if product is not None:
            assert product.start_ps >= producer.end_ps and send.start_ps >= product.end_ps, (producer.node, op.name)
        copies.append((producer, product or send, send))
    kernels = [copy for copy in copies if copy[0].type == "MatMul"]
    assert len(kernels) == 7, [p.node for p, _, _ in copies]   # one per Dense kernel
    assert sum(1 for _, way_out, send in kernels if way_out is not send) == 7   # SGD sends each product
    for producer, way_out, send in copies:
        assert send.start_ps >= way_out.start_ps >= producer.end_ps, producer.node
    kernels.sort(key=lambda copy: copy[0].end_ps)
    backward_end = kernels[-1][0].end_ps
    for position, (producer, way_out, _) in enumerate(kernels):
        # Nothing in the graph makes a way out wait for a weight gradient completed after its own:
        # its ancestors hold only the gradients before it.
        later = {gradient_of[following.node] for following, _, _ in kernels[position + 1:]}
        ancestors = _ancestor_names(graph, way_out.node)
        assert gradient_of[producer.node] in ancestors and not later & ancestors, producer.node
        # And it runs while the backward pass still runs, not once it has ended. (Not "before the
        # next gradient completes": the two are independent ops the executor may run in either
        # order; under load the next one has been seen to finish 0.16 ms before a product started.)
        if position < len(kernels) - 1:
            assert way_out.start_ps < backward_end, (producer.node, way_out.node)


def _ancestor_names(graph, node_name):
    """Names of every op ``node_name``'s traced op depends on, through data and control edges."""
    return {parent.name for parent in ancestors(next(o for o in graph.get_operations() if node_name.endswith(o.name)))}


def _fusion_chain(op):
    """``op``, then its only reader, and so on (at most three ops: MatMul, BiasAdd, Relu)."""
    chain = [op.name]
    for _ in range(2):
        readers = op.outputs[0].consumers() if op.outputs else []
        if len(readers) != 1:
            break
        op = readers[0]
        chain.append(op.name)
    return chain


@pytest.mark.timeout(240)
def test_grappler_virtual_gpu_holds_the_fetched_windows_not_every_weight():
    """Grappler's virtual GPU, told the variable shapes: the plain step holds every weight (and
    its read) for the whole step; with the weights on the host it holds the fetched windows only.
    Grappler's scheduler starts a copy as soon as its host side may run, so it keeps more windows
    at once than the executor does (the order test above): an upper bound, not the simulator's figure."""
    x, y = _mlp_data()
    model, optimizer = _wide_mlp(), keras.optimizers.SGD(0.01)
    plain = tf.function(_mlp_step(model, optimizer))
    plain(x, y)
    fn = _mlp_on_host(swapin_ahead=1)
    fn(x, y)
    weight_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    before = virtual_gpu_peak(plain.get_concrete_function(x, y), include_variables=True, variable_shapes=True)
    after = virtual_gpu_peak(fn.get_concrete_function(x, y), include_variables=True, variable_shapes=True)
    largest = 1024 * 1024 * 4
    assert before >= weight_bytes  # every weight resident
    assert largest <= after < 0.35 * before, (before / 2**20, after / 2**20)


def _simulated_and_grappler_peaks(fn, x, y):
    """The simulator's device peak of ``fn``'s plan, and Grappler's (told the variable shapes, each
    buffer counted once: an elementwise kernel writing into its input, an alias of a live tensor)."""
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.simulate import simulate

    simulated = simulate(fn.plain_irs[-1], fn.plan, cost=CostModel(get_device_spec("v100-16gb-pcie3"))).peak_bytes
    report = virtual_gpu_peak_report(fn.get_concrete_function(x, y), variable_shapes=True)
    return simulated, report.step_peak_bytes


@pytest.mark.timeout(300)
def test_grappler_virtual_gpu_agrees_with_the_simulator_on_serialized_weights_plans():
    """With the weights on the host and the step serialized (``serialize=True``: the simulator's
    order), Grappler's virtual GPU and the simulator give the same device peak within 10%: the wide
    MLP (SGD) 0.99 and the GPT-style decoder (Adam, a tied embedding, 64 MiB budget) 0.95 here.

    Two causes of disagreement were found on the way and fixed. The serialize pass left every bias
    gradient and its kernel gradient off the chain, for oneDNN's fusion, even where oneDNN is off
    or the device is not a CPU: the MLP's kernel gradients then ran beside the previous weight's
    update (12.3 MiB in Grappler against 8.4). And the oracle counted Keras's unread
    ``IdentityN`` of the gradients as a reader, so it saw no learning-rate product written into
    its gradient's buffer (4 MiB counted twice). In TensorFlow's own order Grappler's scheduler
    keeps the decoder's kernel gradients until the update runs (52 MiB against 22 for the decoder
    of the four-times-the-budget test below): that order is not the simulator's, and is judged
    above as an upper bound only. That decoder, serialized, reads 1.12, outside this bound: Grappler's
    peak is in the backward pass, with two of Adam's squared gradients (made on the device for the
    host's update) live beside a kernel gradient; the simulator frees each when its copy to the
    host ends. Not analysed further (docs/limits.md)."""
    x, y = _mlp_data()
    fn = _mlp_on_host(swapin_ahead=1, serialize=True, device_spec="v100-16gb-pcie3")
    fn(x, y)
    simulated, grappler = _simulated_and_grappler_peaks(fn, x, y)
    assert 0.9 <= grappler / simulated <= 1.1, (grappler / 2**20, simulated / 2**20)
    _, _, fn, (x, y), _ = _gpt_style_run(True, steps=1, serialize=True)
    simulated, grappler = _simulated_and_grappler_peaks(fn, x, y)
    assert 0.9 <= grappler / simulated <= 1.1, (grappler / 2**20, simulated / 2**20)


@pytest.mark.timeout(300)
def test_mixed_precision_weights_on_the_host_equal_plain():
    """``mixed_bfloat16``: each kernel is cast to bfloat16 before its layer; the cast reads the fetch."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        plain = fit_steps(zoo.sequential_cnn)
        callback = lms_tf.LMSCallback(**HOST)
        rewritten = fit_steps(zoo.sequential_cnn, callbacks=[callback])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    kernels = [v for v in rewritten[2].trainable_variables if v.path.endswith("kernel")]
    fetched = {r for w in callback.plan.offloaded_weights for r in w.reads}
    assert len(callback.plan.offloaded_weights) >= len(rewritten[2].trainable_variables) >= len(kernels) > 0
    assert any("Cast" in r for r in fetched), sorted(fetched)[:5]
    assert_same_numbers(plain, rewritten)


def test_host_memory_is_what_the_host_holds_over_the_replayed_step():
    """The simulator's host peak against the same step's copies summed by hand: each swapped
    tensor from its copy out's start to its last copy back's end (a sweep over those intervals),
    and with weights on the host, the weights plus every gradient copied out for the update."""
    from lms_tf.core.examples import chain_ir, weighted_chain_ir
    from lms_tf.core.plan import Decision, Plan, SwapIn, TensorDecision
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.planner import make_budget_plan
    from lms_tf.simulate import simulate
    from lms_tf.simulate.lower import TO_HOST_STREAM, lower

    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    ir = chain_ir()
    MiB = 2**20
    plan = Plan(tuple(TensorDecision(t, "", (MiB,), 4 * MiB, Decision.SWAP, "swap", 6, (SwapIn(trigger, (reader,)),))
                      for t, trigger, reader in (("a:0", "g2", "g1"), ("b:0", "g3", "g2"))),
                "/device:GPU:0", "/device:CPU:0", {}, {})
    sim = simulate(ir, plan, cost=cost)
    events = lower(ir, plan, cost).ops
    changes = []
    for out in (e for e in events if e.stream == TO_HOST_STREAM):
        key = out.writes[0][0]
        back = [e.name for e in events if key in e.reads]
        start, end = sim.op_intervals[out.name][0], max(sim.op_intervals[name][1] for name in back)
        nbytes = sum(ir.tensors[r].nbytes for r in out.reads)
        changes += [(start, 1, nbytes), (end, 0, -nbytes)]  # at one instant, frees before allocations
    held = peak = 0
    for _, _, delta in sorted(changes):
        held += delta
        peak = max(peak, held)
    assert sim.host_peak_bytes == peak == 8 * MiB  # both copies out start before either comes back

    weighted = weighted_chain_ir()
    host_plan = make_budget_plan(weighted, lms_tf.core.Policies(budget="auto", weights="host"),
                                 device="/device:GPU:0", cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    weights = sum(w.nbytes for w in host_plan.offloaded_weights)
    gradients = sum(ir_t.nbytes for ir_t in weighted.tensors.values() if ir_t.name.startswith("gw"))
    assert weights == 2 * 256 * 1024 and gradients == weights
    assert host_plan.predictions.host_peak_bytes == weights + gradients
    assert "host memory at most 1.00 MiB" in host_plan.one_line()


@pytest.mark.timeout(120)
def test_a_host_budget_the_plan_exceeds_is_a_clear_error_and_nothing_runs():
    """The wide MLP's weights alone (about 21 MiB) are more than a 1 MiB host budget: the error
    names both figures before the step runs (and before the planner searches: no plan can hold
    less than the variables), and the weights are the initial ones."""
    model, optimizer = _wide_mlp(), keras.optimizers.SGD(0.01)
    lms_tf.place_weights(model, optimizer, host="/CPU:1")
    before = [np.array(v) for v in model.weights]
    step = lms_tf.function(_mlp_step(model, optimizer), **CPU_LMS, weights="host", swap=False, budget="auto",
                           device_spec="v100-16gb-pcie3", host_budget="1MiB")
    with pytest.raises(lms_tf.HostBudgetError,
                       match=r"weights='host' keeps .* of weights and optimizer slots in host memory for the whole "
                             r"step, .*more than host_budget: 1\.0 MiB \(1048576 bytes\)\. Pass a larger host_budget") as err:
        step(*_mlp_data())
    # (AutoGraph re-raises the error from its message alone, so the figures are read from the text.)
    needed = int(re.search(r"keeps [0-9.]+ MiB \((\d+) bytes\)", str(err.value)).group(1))
    assert needed >= sum(np.array(v).nbytes for v in model.weights) > 2**20
    for old, now in zip(before, model.weights):
        np.testing.assert_array_equal(old, np.array(now))


def test_host_budget_is_checked():
    with pytest.raises(lms_tf.LMSOptionError, match=r"host_budget must be a positive size .* received 'lots'"):
        lms_tf.LMSCallback(budget="auto", host_budget="lots")
    with pytest.raises(lms_tf.LMSOptionError, match=r"host_budget='8GiB' is checked by the budget planner.*budget="):
        lms_tf.LMSCallback(weights="host", host_budget="8GiB")


@pytest.mark.timeout(120)
def test_with_weights_on_the_host_the_optimizer_slots_are_host_memory_not_device_memory():
    """A decoder trained with Adam, its variables placed on the host: the planner counts none of
    them resident on the device (the weights are fetched per window, Adam's moments and step
    count live where the update runs; what it counts resident is the batch alone), and the host
    peak holds every one of them."""
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.planner import make_budget_plan
    from lms_tf.planner.step import PlanningStep
    from lms_tf.simulate import host_resident, input_bytes
    from lms_tf.tf.trace import build_ir

    model, (x, y) = decoder_lm()
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    lms_tf.place_weights(model, optimizer, host="/CPU:1")
    step = tf.function(keras_train_step(model, optimizer))
    ir = build_ir(step.get_concrete_function(tf.constant(x[:BATCH]), tf.constant(y[:BATCH])).graph)
    policies = lms_tf.core.Policies(host="/CPU:1", budget="auto", weights="host")
    cost = CostModel(get_device_spec("v100-16gb-pcie3"))
    plan = make_budget_plan(ir, policies, device="/device:CPU:0", cost=cost)
    batch = input_bytes(ir)
    assert batch == x[:BATCH].nbytes + y[:BATCH].nbytes > 0
    assert PlanningStep.build(ir, policies, device="/device:CPU:0", cost=cost).resident == batch
    on_host = sum(nbytes for _, nbytes in host_resident(ir, {w.variable for w in plan.offloaded_weights}))
    slots = sum(np.array(v).nbytes for v in optimizer.variables if "moment" in v.path or "velocity" in v.path)
    weights = sum(np.array(v).nbytes for v in model.trainable_variables)
    assert plan.offloaded_weight_bytes == weights and slots == 2 * weights
    assert on_host >= weights + slots and plan.predictions.host_peak_bytes >= on_host


def test_the_update_on_the_host_runs_on_the_host_stream_timed_by_host_memory_bandwidth():
    """With weights on the host, each update op is an event on the host stream: it starts only
    after the gradient it reads has been copied out, its time is its bytes over the host's memory
    bandwidth, and the step ends no earlier than the last of them. A host with no bandwidth
    given times them at zero (what the simulator did before it modelled the host)."""
    import dataclasses

    from lms_tf.core.examples import weighted_chain_ir
    from lms_tf.core.ir import Phase
    from lms_tf.cost import CostModel, get_device_spec
    from lms_tf.planner import make_budget_plan
    from lms_tf.simulate import simulate
    from lms_tf.simulate.lower import HOST_COMPUTE_STREAM, TO_HOST_STREAM, lower

    ir = weighted_chain_ir()
    spec = get_device_spec("v100-16gb-pcie3")
    cost = CostModel(spec)
    plan = make_budget_plan(ir, lms_tf.core.Policies(budget="auto", weights="host"), device="/device:GPU:0", cost=cost)
    events = lower(ir, plan, cost).ops
    host_events = [e for e in events if e.stream == HOST_COMPUTE_STREAM]
    update_ops = [op for op in ir.ops if op.phase is Phase.UPDATE]
    assert {e.name for e in host_events} == {op.name for op in update_ops} and update_ops
    sim = simulate(ir, plan, cost=cost)
    copies_out = {e.name: sim.op_intervals[e.name] for e in events if e.stream == TO_HOST_STREAM}
    for event in host_events:
        op = ir.op(event.name)
        moved = sum(ir.tensors[t].nbytes or 0 for t in (*op.inputs, *op.outputs))
        assert event.duration == pytest.approx(moved / spec.host_memory_bytes_per_s)
        start, end = sim.op_intervals[event.name]
        gradients_in = [copies_out[f"to_host/{t}"][1] for t in op.inputs if f"to_host/{t}" in copies_out]
        assert all(start >= arrived for arrived in gradients_in)
        assert sim.step_time_s >= end
    assert any(e.duration > 0 for e in host_events)
    # Every copy's bytes leave the in-flight count when it ends (a weight fetch's too: its host
    # side is the variable, whose handle has no size).
    assert sim.timeline[-1][2] == sim.timeline[-1][3] == 0 and max(t[3] for t in sim.timeline) > 0
    untimed = CostModel(dataclasses.replace(spec, host_memory_bytes_per_s=None))
    assert all(e.duration == 0 for e in lower(ir, plan, untimed).ops if e.stream == HOST_COMPUTE_STREAM)
    assert simulate(ir, plan, cost=untimed).step_time_s <= sim.step_time_s


def _gpt_style_run(lms: bool, steps: int = 10, width=256, seq_len=64, vocab=2048, batch=2, budget="64MiB", **options):
    """``lms_tf.tf.workloads.decoder_lm`` (pre-norm blocks, MultiHeadAttention's EinsumDense
    projections, GELU, a tied embedding; 4 blocks) trained with Keras's default Adam in a custom loop."""
    from lms_tf.tf.workloads import decoder_lm, train_step

    zoo.reseed(0)
    model = decoder_lm(width=width, depth=4, seq_len=seq_len, vocab=vocab)
    optimizer = keras.optimizers.Adam()
    step = train_step(model, optimizer)  # the workloads' step: sparse cross-entropy, tape, update

    if lms:
        optimizer.build(model.trainable_variables)
        lms_tf.place_weights(model, optimizer, host="/CPU:1")
        fn = lms_tf.function(step, **CPU_LMS, weights="host", budget=budget, device_spec="v100-16gb-pcie3", **options)
    else:
        fn = tf.function(step)
    tokens = np.random.default_rng(0).integers(0, vocab, size=(3 * batch, seq_len + 1)).astype("int32")
    batches = [(tf.constant(tokens[batch * i:batch * (i + 1), :-1]), tf.constant(tokens[batch * i:batch * (i + 1), 1:]))
               for i in range(3)]
    losses = [float(fn(*batches[i % 3])) for i in range(steps)]
    return losses, [np.array(w) for w in model.get_weights()], fn, batches[0], model


@pytest.mark.timeout(600)
def test_a_gpt_style_decoder_with_adam_and_a_budget_equals_plain():
    """Found on this model, not the zoo's: gates on ops Grappler regroups (a LayerNorm's add tree,
    a GELU gradient's products) or folds (a kernel gradient fused with its bias gradient), and a
    swapped ``dy * scale`` two LayerNorm gradient ops share, each changed Adam's updates in the
    last bits. Ten steps are now bit-identical. The attention's kernels, which Keras reshapes
    before its einsum, are fetched again for the backward pass, through a reshape made on the
    host, instead of holding the forward copy."""
    plain = _gpt_style_run(False)
    rewritten = _gpt_style_run(True)
    assert_same_numbers(plain, rewritten)
    plan, graph = rewritten[2].plan, rewritten[2].get_concrete_function(
        tf.TensorSpec((2, 64), tf.int32), tf.TensorSpec((2, 64), tf.int32)).graph
    views = [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "weight_view"]
    reshaped = [w for w in plan.offloaded_weights if not w.reads[0].endswith("ReadVariableOp:0")]
    assert len(views) == len(reshaped)
    assert all(op.type == "Reshape" and op.device.endswith("CPU:1") for op in views)
    kernels = [w for w in reshaped if "attention" in w.variable]
    assert len(kernels) == 4 * 4  # query, key, value and output projections per block
    # Forward, then backward, each its own copy (a LayerNorm's beta, read forward only, has one).
    assert all(len(w.fetches) >= 2 for w in kernels), [(w.variable, len(w.fetches)) for w in kernels]


@pytest.mark.timeout(900)
def test_a_decoder_whose_weights_gradients_and_slots_are_four_times_the_budget_trains_with_equal_numbers():
    """The issue's CPU run: a 13M-parameter decoder (width 512, 4 blocks) whose weights,
    gradients and Adam's two moments (16 bytes a parameter, 200 MiB) are four times the budget
    (50 MiB) is planned within it by the simulator, trains ten steps bit-identically to the plain
    step, and Grappler's virtual GPU, told the variable shapes, holds a small part of what it holds
    for the plain step. Grappler's figure is an upper bound (its scheduler starts each copy as
    soon as the host side may run): it is reported, and held to a fifth of the plain step's.
    Before the update's ops on the host were left out of device memory, no such budget was
    found feasible (the plain step looked like 102 MiB)."""
    from lms_tf.tf.workloads import decoder_lm_params

    shape = dict(width=512, seq_len=32, vocab=1024, batch=1)
    state = 16 * decoder_lm_params(512, 4, 1024)
    budget = state // 4
    plain = _gpt_style_run(False, **shape)
    rewritten = _gpt_style_run(True, budget=budget, **shape)
    assert_same_numbers(plain, rewritten)
    plan = rewritten[2].plan
    assert plan.budget_bytes == budget and plan.predictions.planned_peak_bytes <= budget
    x, y = rewritten[3]
    planned = virtual_gpu_peak(rewritten[2].get_concrete_function(x, y), include_variables=True, variable_shapes=True)
    baseline = virtual_gpu_peak(plain[2].get_concrete_function(x, y), include_variables=True, variable_shapes=True)
    assert planned < baseline / 5, (planned / 2**20, baseline / 2**20, budget / 2**20)
