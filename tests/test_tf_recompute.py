"""Recompute pass: numbers, structure, executed order and real CPU-allocator memory."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import lms_tf
from lms_tf import _compat
from lms_tf.core.errors import LMSOptionError
from lms_tf.core.op_kinds import FREE_TYPES
from lms_tf.tf.diagnostics import executed_ops, find_executed
from lms_tf.tf.rewrite import LMS_ATTR, count_lms_ops
from tests import zoo
from tests.helpers import (CPU_LMS, NUMBERS_STEPS, assert_same_numbers, custom_loop, device_readers, fit_steps,
                           lms_function)

RECOMPUTE_ONLY = dict(device="/CPU:0", swap=False)
SWAP_AND_RECOMPUTE = dict(CPU_LMS, swapout_threshold=4, min_swap_bytes=1024, recompute="sqrt")
# Grappler optimises a cloned subgraph on its own, which can change the last bit of a
# BatchNorm statistic; with Grappler off the recomputed step is bit-identical (see below).
RTOL = 0.0


#: Zoo models where "cheap" finds nothing to recompute: each cheap op's output (a ReLU, a dropout
#: mask, the loss's log-softmax) is an articulation tensor (a checkpoint) or is read by the very
#: first ops of the backward pass, before any backward op that could gate a clone has run. (The
#: plans once recomputed the loss's tensors behind gradient ops TensorFlow prunes: gated by an op
#: that never runs otherwise, and saving nothing.)
CHEAP_FINDS_NOTHING = {"dropout_mlp", "sequential_cnn", "text_embedding"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["sqrt", "cheap"])
@pytest.mark.parametrize("name", sorted(zoo.FIT_ZOO))
def test_recompute_only_fit_equals_plain(name, policy):
    builder = zoo.FIT_ZOO[name]
    plain = fit_steps(builder)
    callback = lms_tf.LMSCallback(recompute=policy, **RECOMPUTE_ONLY)
    rewritten = fit_steps(builder, callbacks=[callback])
    assert not callback.plan.swapped, lms_tf.explain(callback)
    if policy == "cheap" and name in CHEAP_FINDS_NOTHING:
        assert not callback.plan.recomputed, lms_tf.explain(callback)
    else:
        assert callback.plan.recomputed, lms_tf.explain(callback)
    assert_same_numbers(plain, rewritten, rtol=RTOL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["resnet_style", "shared_multi_input_residual", "dropout_mlp", "inception_style"])
def test_swap_and_recompute_fit_equals_plain(name):
    builder = zoo.FIT_ZOO[name]
    plain = fit_steps(builder)
    callback = lms_tf.LMSCallback(**SWAP_AND_RECOMPUTE)
    rewritten = fit_steps(builder, callbacks=[callback])
    assert callback.plan.recomputed and callback.plan.swapped, lms_tf.explain(callback)
    assert_same_numbers(plain, rewritten, rtol=RTOL)


@pytest.mark.timeout(240)
def test_recompute_is_bit_identical_without_grappler():
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        plain = fit_steps(zoo.resnet_style)
        callback = lms_tf.LMSCallback(recompute="sqrt", **RECOMPUTE_ONLY)
        rewritten = fit_steps(zoo.resnet_style, callbacks=[callback])
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
    assert callback.plan.recomputed
    assert_same_numbers(plain, rewritten)


@pytest.mark.timeout(240)
def test_custom_loops_with_recompute():
    for kwargs in (dict(), dict(use_tf_gradients=True)):
        plain = custom_loop(zoo.resnet_style, tf.function, **kwargs)
        rewritten = custom_loop(zoo.resnet_style, lms_function(recompute="sqrt", **RECOMPUTE_ONLY), **kwargs)
        assert rewritten[2].plan.recomputed
        assert_same_numbers(plain, rewritten, rtol=RTOL)


def residual_mlp(blocks=8, width=128):
    """Dense + ReLU residual blocks with tanh after each add: Grappler's remapper fuses every
    MatMul + BiasAdd (+ ReLU), so a recomputed clone it did not fuse would change the numbers."""
    zoo.reseed(0)
    inputs = keras.Input((64,))
    x = keras.layers.Dense(width, activation="relu")(inputs)
    for _ in range(blocks):
        y = keras.layers.Dense(width, activation="relu")(x)
        x = keras.layers.Activation("tanh")(keras.layers.Add()([x, keras.layers.Dense(width)(y)]))
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("options", [RECOMPUTE_ONLY, SWAP_AND_RECOMPUTE], ids=["recompute", "swap+recompute"])
def test_recompute_is_bit_identical_under_the_default_grappler_remapper(options):
    from lms_tf.tf.workloads import synthetic_batch, train_step

    def run(decorate):
        model = residual_mlp()
        x, y = synthetic_batch(model, 32)
        step = decorate(train_step(model, keras.optimizers.SGD(0.1)))
        return [float(step(x, y)) for _ in range(NUMBERS_STEPS)], [w.numpy() for w in model.weights], step

    assert tf.config.optimizer.get_experimental_options().get("remapping", True)  # Grappler's default
    plain = run(tf.function)
    rewritten = run(lms_function(**{**options, "recompute": "sqrt"}))
    assert len(rewritten[2].plan.recomputed) >= 8, lms_tf.explain(rewritten[2])
    assert_same_numbers(plain, rewritten)


def _traced(builder, **options):
    _, _, fn = custom_loop(builder, lms_function(**options), steps=1)
    model_batch = builder()[1]
    x = model_batch[0]
    specs = (tuple(tf.TensorSpec((zoo.BATCH,) + a.shape[1:]) for a in x) if isinstance(x, tuple)
             else tf.TensorSpec((zoo.BATCH,) + x.shape[1:], tf.as_dtype(x.dtype)))
    return fn, fn.get_concrete_function(specs, tf.TensorSpec((zoo.BATCH,), tf.int32)).graph


@pytest.mark.timeout(240)
def test_clones_match_the_plan_and_are_gated():
    fn, graph = _traced(zoo.resnet_style, recompute="sqrt", **RECOMPUTE_ONLY)
    plan = fn.plan
    counts = count_lms_ops(graph)
    assert counts["recompute"] == plan.num_recompute_clones > 0
    clones = [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "recompute"]
    gates = {d.gate for d in plan.recomputed}
    for clone in clones:
        assert not clone.op_def.is_stateful, f"stateful op {clone.name} was cloned"
        # No control input on a clone: Grappler's remapper would then not fuse it as it fuses the original.
        assert not clone.control_inputs, clone.name
        cloned_inputs = [t for t in clone.inputs if _compat.string_attr(t.op, LMS_ATTR) == "recompute"]
        if not cloned_inputs:  # a region root reads a gate Identity that waits for a backward op
            gated = [t.op for t in clone.inputs if _compat.string_attr(t.op, LMS_ATTR) == "recompute_gate"]
            assert len(gated) == 1 and gated[0].type == "Identity", clone.name
            assert [c.name for c in gated[0].control_inputs] and all(c.name in gates for c in gated[0].control_inputs)
    for decision in plan.recomputed:
        assert decision.recompute_ops and decision.gate.startswith("gradient_tape/")
        for consumer in decision.consumers:
            reads = [t for t in graph.get_operation_by_name(consumer).inputs]
            assert not any(t.name == decision.tensor for t in reads)
            assert any(_compat.string_attr(t.op, LMS_ATTR) == "recompute" for t in reads)


@pytest.mark.timeout(240)
def test_dropout_outputs_are_recomputed_from_the_forward_mask_never_a_new_draw():
    fn, graph = _traced(zoo.dropout_mlp, recompute=["*/stateless_dropout/SelectV2"], **RECOMPUTE_ONLY)
    clones = [op for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "recompute"]
    assert not any(op.op_def.is_stateful or "Random" in op.type for op in clones)
    dropout_clones = [op for op in clones if op.type == "SelectV2" and "stateless_dropout" in op.name]
    assert dropout_clones, lms_tf.explain(fn)
    for clone in dropout_clones:
        mask = clone.inputs[0]
        if _compat.string_attr(mask.op, LMS_ATTR) == "recompute_gate":  # a region root reads through its gate
            mask = mask.op.inputs[0]
        assert mask.op.type == "GreaterEqual" and _compat.string_attr(mask.op, LMS_ATTR) is None
        ancestors, frontier = set(), [mask.op]
        while frontier:
            op = frontier.pop()
            if op.name not in ancestors:
                ancestors.add(op.name)
                frontier.extend(t.op for t in op.inputs)
        draws = [n for n in ancestors if graph.get_operation_by_name(n).type == "StatelessRandomUniformV2"]
        assert draws and not any(_compat.string_attr(graph.get_operation_by_name(n), LMS_ATTR) for n in draws)  # the forward draw itself
    masks = [d for d in fn.plan.decisions if d.tensor.endswith("GreaterEqual:0")]
    assert masks and all(d.decision is lms_tf.Decision.KEEP for d in masks)


@pytest.mark.timeout(240)
def test_swapped_checkpoints_are_read_back_through_a_gated_swap_in():
    fn, graph = _traced(zoo.resnet_style, **SWAP_AND_RECOMPUTE)
    readers = [op for op in graph.get_operations()
               if _compat.string_attr(op, LMS_ATTR) == "swap_in" and "recompute_swap_in" in op.name]
    assert readers, lms_tf.explain(fn)
    for swap_in in readers:
        assert any(_compat.string_attr(c, LMS_ATTR) == "recompute" for c in device_readers(swap_in))
        (gate,) = swap_in.control_inputs
        assert _compat.string_attr(gate, LMS_ATTR) == "swap_gate"


def deep_residual(blocks=16, size=32, channels=32):
    zoo.reseed(0)
    inputs = keras.Input((size, size, 3))
    x = keras.layers.Conv2D(channels, 3, padding="same")(inputs)
    for _ in range(blocks):
        y = keras.layers.Conv2D(channels, 3, padding="same")(x)
        y = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(y))
        y = keras.layers.BatchNormalization()(keras.layers.Conv2D(channels, 3, padding="same")(y))
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, y]))
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs)


def _deep_step(model):
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            step.logits_op = logits.op.name
            loss = loss_fn(y, logits)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return step


@pytest.fixture(scope="module")
def deep_batch():
    rng = np.random.RandomState(0)
    return tf.constant(rng.rand(16, 32, 32, 3).astype("float32")), tf.constant(rng.randint(0, 10, 16))


@pytest.mark.timeout(300)
def test_sqrt_recompute_lowers_the_real_cpu_allocator_peak(deep_batch):
    x, y = deep_batch
    peaks = {}
    for name, decorate in (("plain", tf.function),
                           ("sqrt", lambda f: lms_tf.function(f, recompute="sqrt", **RECOMPUTE_ONLY))):
        fn = decorate(_deep_step(deep_residual()))
        fn(x, y).numpy()
        fn(x, y).numpy()
        runs = []
        for _ in range(5):
            with lms_tf.measure_peak_memory("CPU:0", settle_seconds=0.3) as memory:
                fn(x, y).numpy()
            runs.append(memory.peak_bytes)
        peaks[name] = sorted(runs)
    # The plain step of this net has a depth-independent part of about 65-70 MiB (73/76/90 MiB
    # peak at 4/8/16 blocks) that recompute cannot remove. TensorFlow runs ready ops in parallel,
    # so one step's peak moves with the order they ran in: measured plain 160-165 MiB, sqrt 80-108
    # MiB alone (86/104/104 in one process, 108 in a whole-suite run), up to 0.66 of plain. With
    # another test process busy on the same two cores the executor's order spreads further: one
    # sqrt step reached 129 MiB (0.78 of plain) while the others stayed at 107-115. In another
    # whole-suite run three of five sqrt steps read 121.5 MiB and the plain steps 162-170: 0.75 of
    # the lowest plain step, 0.72 of the median one. So the typical (median) sqrt step must stay
    # under 0.75 of the typical plain step, and every one under 0.85 of the lowest; a step that
    # recomputed nothing reads 1.0 and fails both.
    plain_low, plain_median = min(peaks["plain"]), peaks["plain"][len(peaks["plain"]) // 2]
    shown = {k: [v / 2**20 for v in runs] for k, runs in peaks.items()}
    assert peaks["sqrt"][len(peaks["sqrt"]) // 2] < 0.75 * plain_median, shown
    assert max(peaks["sqrt"]) < 0.85 * plain_low, shown


def _assert_clones_ran_in_order(plan, graph, events, logits_op):
    """Every traced clone a backward consumer reads ran after the forward pass and its gate, and
    before that consumer. The events come from a run without Grappler, so every op runs as itself,
    but TensorFlow's profiler does not trace every kernel (cheap ones such as a Select or a Reshape
    run inline): a gate that is such an alias is judged by the op it aliases, and at least 80% of
    the (clone, consumer) pairs must be seen; the failure lists the ones that were not. Returns how
    many pairs were checked."""
    logits = find_executed(events, logits_op)
    assert logits is not None, f"{logits_op} is not in the profile"
    checked, unseen = 0, []
    for decision in plan.recomputed:
        gate_op = graph.get_operation_by_name(decision.gate)
        while find_executed(events, gate_op.name) is None and gate_op.type in FREE_TYPES and gate_op.inputs:
            gate_op = gate_op.inputs[0].op  # an alias gate (a Reshape) runs inline, untraced: its input ran before it
        gate = find_executed(events, gate_op.name)
        for consumer_name in decision.consumers:
            consumer = graph.get_operation_by_name(consumer_name)
            clone_ops = [t.op for t in consumer.inputs if _compat.string_attr(t.op, LMS_ATTR) == "recompute"]
            assert clone_ops, f"{consumer_name} does not read a clone"
            clone, ran = find_executed(events, clone_ops[0].name), find_executed(events, consumer_name)
            if clone is None or gate is None or ran is None:
                unseen.append((clone_ops[0].name if clone is None else None, decision.gate if gate is None else None,
                               consumer_name if ran is None else None))
                continue
            assert clone.start_ps > logits.end_ps, "a clone ran during the forward pass"
            assert clone.start_ps >= gate.end_ps, "a clone ran before its gate"
            assert ran.start_ps >= clone.end_ps, "a consumer ran before its clone"
            checked += 1
    assert checked >= 0.8 * (checked + len(unseen)), f"only {checked} pairs seen; not in the profile: {unseen}"
    return checked


def _executed_without_grappler(fn, x, y):
    # Grappler's arithmetic optimizer rewrites e.g. Mul(x, Rsqrt(v)) under the same node names, so
    # names stop identifying the graph lms-tf built; run exactly that graph to read its order.
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        fn(x, y).numpy()
        return executed_ops(lambda: fn(x, y).numpy())
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})


@pytest.mark.timeout(300)
def test_executed_order_clones_run_in_backward_after_gate_before_consumer(deep_batch):
    x, y = deep_batch[0][:, :16, :16], deep_batch[1]
    fn = lms_tf.function(_deep_step(deep_residual(blocks=4, size=16)), recompute="sqrt", **RECOMPUTE_ONLY)
    events = _executed_without_grappler(fn, x, y)
    graph = fn.get_concrete_function(x, y).graph
    checked = _assert_clones_ran_in_order(fn.plan, graph, events, fn.python_function.logits_op)
    assert checked >= len(fn.plan.recomputed) // 2, (checked, len(fn.plan.recomputed))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("gate_choice", ["shared", "own"])
def test_executed_order_of_a_checkpoint_recomputed_from_the_one_before(deep_batch, gate_choice):
    """Behaviour of recursive recompute: TensorFlow ran the recomputed checkpoint's clone after the
    forward pass and its gate and before its backward readers, and so every other clone."""
    x, y = deep_batch[0][:, :16, :16], deep_batch[1]
    facts = {}
    step = _deep_step(deep_residual(blocks=4, size=16))
    fn = _recursive_plan_step(step, gate_choice, facts)
    events = _executed_without_grappler(fn, x, y)
    plan, checkpoint = facts["plan"], facts["checkpoint"]
    decision = next(d for d in plan.recomputed if d.tensor == checkpoint)
    only = dataclasses.replace(plan, decisions=(decision,))
    assert _assert_clones_ran_in_order(only, facts["graph"], events, step.logits_op) >= 1, \
        f"no clone of {checkpoint} was seen running"
    checked = _assert_clones_ran_in_order(plan, facts["graph"], events, step.logits_op)
    assert checked >= len(plan.recomputed) // 2, (checked, len(plan.recomputed))


@pytest.mark.parametrize("value", ["everything", 3, [], [""]])
def test_bad_recompute_values_are_refused(value):
    with pytest.raises(LMSOptionError, match="recompute must be False, 'auto', 'cheap', 'sqrt'"):
        lms_tf.LMSCallback(recompute=value)


def test_nothing_to_do_is_refused():
    with pytest.raises(LMSOptionError, match="swap=False and recompute=False leave nothing to do"):
        lms_tf.function(lambda x: x, swap=False)


def _recursive_plan_step(step, gate_choice, facts):
    """Wraps a step: after tracing it, recomputes one sqrt checkpoint too (``also_recompute``),
    behind the shared or its own gate, and applies that plan."""
    from lms_tf.options import LMSOptions
    from lms_tf.planner.candidates import collect_candidates
    from lms_tf.planner.recompute import checkpoint_gates
    from lms_tf.planner.tflms import make_plan
    from lms_tf.tf.rewrite import apply_plan
    from lms_tf.tf.trace import build_ir

    def traced(xb, yb):
        loss = step(xb, yb)
        graph = _compat.current_graph()
        ir = build_ir(graph)
        options = LMSOptions(recompute="sqrt", **RECOMPUTE_ONLY).policies
        found = collect_candidates(ir, options, device="/device:CPU:0")
        base = make_plan(ir, options, device="/device:CPU:0", candidates=found)
        region_inputs = {t for d in base.recomputed for op in d.recompute_ops for t in ir.op(op).inputs}
        checkpoints = [d for d in base.decisions if d.decision is lms_tf.Decision.KEEP and d.tensor in region_inputs
                       and d.tensor in found.eligible and checkpoint_gates(ir, found, d.tensor, base.recomputed)]
        checkpoint = checkpoints[len(checkpoints) // 2].tensor
        gates = checkpoint_gates(ir, found, checkpoint, base.recomputed)
        gate = gates[0] if gate_choice == "shared" else gates[-1]
        plan = make_plan(ir, options, device="/device:CPU:0", candidates=found, also_recompute={checkpoint: gate})
        facts.update(ir=ir, base=base, plan=plan, checkpoint=checkpoint, gates=gates, gate=gate, graph=graph)
        apply_plan(graph, ir, plan)
        return loss
    return tf.function(traced)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("gate_choice", ["shared", "own"])
def test_a_checkpoint_recomputed_from_the_one_before_trains_to_the_plain_numbers(gate_choice):
    """Recursive recompute (``make_plan(also_recompute=)``), as the budget planner uses it in place
    of a swap that stalls the clones: numbers equal the plain step (bit for bit with Grappler
    off); the checkpoint's region now
    reaches back past it to the checkpoint before; its backward readers read its clone, which runs
    behind the chosen gate; the regions that read it clone its producer instead of reading it."""
    from lms_tf.tf.rewrite.recompute import CLONE_GATE_ATTR, CLONE_OF_ATTR

    facts = {}
    plain = custom_loop(zoo.resnet_style, tf.function)
    rewritten = custom_loop(zoo.resnet_style, lambda step: _recursive_plan_step(step, gate_choice, facts))
    assert_same_numbers(plain, rewritten, rtol=RTOL)
    # With Grappler off (it optimises cloned subgraphs on their own), bit for bit.
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        exact = custom_loop(zoo.resnet_style, tf.function), \
            custom_loop(zoo.resnet_style, lambda step: _recursive_plan_step(step, gate_choice, {}))
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
    assert_same_numbers(*exact)

    ir, base, plan, checkpoint, graph = (facts[k] for k in ("ir", "base", "plan", "checkpoint", "graph"))
    gates = facts["gates"]
    assert len(gates) == 2 and ir.op(gates[0]).index < ir.op(gates[1]).index, gates  # shared, then own
    decision = next(d for d in plan.decisions if d.tensor == checkpoint)
    assert decision.decision is lms_tf.Decision.RECOMPUTE and decision.gate == facts["gate"]
    assert "checkpoint" in decision.reason
    producer = ir.tensors[checkpoint].producer
    assert decision.recompute_ops[-1] == producer and len(decision.recompute_ops) > 1
    readers = [d for d in plan.recomputed if d.tensor != checkpoint and producer in d.recompute_ops]
    before = [d for d in base.recomputed if any(checkpoint in ir.op(op).inputs for op in d.recompute_ops)]
    assert readers and {d.tensor for d in readers} == {d.tensor for d in before}
    # Each reading region now also clones ops from before the checkpoint.
    for d in readers:
        assert len(d.recompute_ops) > len(next(b for b in before if b.tensor == d.tensor).recompute_ops)
    clones = {(_compat.string_attr(op, CLONE_OF_ATTR), _compat.string_attr(op, CLONE_GATE_ATTR)): op
              for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "recompute"}
    assert (producer, facts["gate"]) in clones
    for consumer in decision.consumers:
        reads = graph.get_operation_by_name(consumer).inputs
        assert not any(t.name == checkpoint for t in reads)
        assert any(t.op is clones[(producer, facts["gate"])] for t in reads)
    if gate_choice == "own":  # the regions clone it again behind their own gates
        assert all((producer, d.gate) in clones for d in readers)
    else:
        assert {d.gate for d in readers} >= {facts["gate"]}


def test_bad_also_recompute_entries_are_refused():
    from lms_tf.options import LMSOptions
    from lms_tf.planner.candidates import collect_candidates
    from lms_tf.planner.recompute import checkpoint_gates
    from lms_tf.planner.tflms import make_plan
    from lms_tf.tf.trace import build_ir
    from lms_tf.tf.workloads import train_step

    model, (x, _) = zoo.resnet_style()
    graph = tf.function(train_step(model)).get_concrete_function(
        tf.TensorSpec((zoo.BATCH,) + x.shape[1:]), tf.TensorSpec((zoo.BATCH,), tf.int32)).graph
    ir = build_ir(graph)
    options = LMSOptions(recompute="sqrt", **RECOMPUTE_ONLY).policies
    found = collect_candidates(ir, options, device="/device:CPU:0")
    base = make_plan(ir, options, device="/device:CPU:0", candidates=found)
    kept = next(d.tensor for d in base.decisions if d.decision is lms_tf.Decision.KEEP and d.tensor in found.eligible
                and checkpoint_gates(ir, found, d.tensor, base.recomputed))
    not_movable = next(iter(found.kept))
    with pytest.raises(LMSOptionError, match="cannot be recomputed"):
        make_plan(ir, options, device="/device:CPU:0", also_recompute={not_movable: found.gates[0].name})
    last_gate = found.gates[-1].name  # runs after every backward reader of a checkpoint
    with pytest.raises(LMSOptionError, match="checkpoint_gates"):
        make_plan(ir, options, device="/device:CPU:0", also_recompute={kept: last_gate})
    gate = checkpoint_gates(ir, found, kept, base.recomputed)[-1]
    plan = make_plan(ir, options, device="/device:CPU:0", also_recompute={kept: gate})
    assert next(d for d in plan.decisions if d.tensor == kept).decision is lms_tf.Decision.RECOMPUTE
