"""The one driver of the TensorFlow side: trace -> IR -> plan (or a given plan, checked) -> rewrite.

Every front-end calls :func:`rewrite_traced_step` inside the step being traced, with a
:class:`RewriteRequest` built from its options.

Examples:
    >>> from lms_tf.tf.driver import resolve_device
    >>> resolve_device("/CPU:0")
    '/device:CPU:0'
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import InfeasibleBudgetError, LMSError, LMSOptionError, UnknownSizeError, warn_once
from lms_tf.core.ir import GraphIR, Phase, same_device
from lms_tf.core.plan import Decision, Plan
from lms_tf.core.policy import Policies, format_bytes
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.planner import make_budget_plan, make_plan
from lms_tf.simulate import check_clone_fetches, check_sliced_op, simulate, without_unsound_clone_fetches
from lms_tf.tf.diagnostics import CPU_GRAPPLER_MEMORY_BYTES
from lms_tf.tf.rewrite import apply_plan, apply_plans
from lms_tf.tf.rewrite.recompute import simulator_name
from lms_tf.tf.rewrite.serialize import (SerializeReport, grappler_rewritten_ops, onednn_may_fuse, serialize_chains,
                                         serialize_step)
from lms_tf.tf.trace import build_ir

logger = logging.getLogger("lms_tf")


@dataclasses.dataclass(frozen=True)
class RewriteRequest:
    """What a front-end asks of the driver for one traced step.

    Attributes:
        policies: What the planner is asked to do.
        device: The accelerator whose memory is managed (a full device name).
        device_spec: The device the planner and simulator model: a preset name, a
            :class:`~lms_tf.cost.DeviceSpec`, or None/``"auto"`` (the visible GPU).
        serialize: Also chain the step's compute ops in the simulated order.
        batch_size: Size to give a batch dimension the trace leaves unknown.
        plan: A plan to apply instead of planning (checked against the traced step first).

    Examples:
        >>> RewriteRequest(Policies(), device="/device:GPU:0").serialize
        False
    """

    policies: Policies
    device: str
    device_spec: Any = None
    serialize: bool = False
    batch_size: Optional[int] = None
    plan: Optional[Plan] = None

    def cost_model(self) -> CostModel:
        """The cost model of :attr:`device_spec`.

        Examples:
            >>> RewriteRequest(Policies(), "/device:GPU:0", device_spec="v100-16gb-pcie3").cost_model().device.name
            'v100-16gb-pcie3'
        """
        return CostModel(get_device_spec(self.device_spec or "auto"))


def check_visible(device: str, *, role: str, api: str) -> str:
    """``device`` if TensorFlow can see it, else the library's error listing the devices it can see.

    Args:
        device: A device string (``/GPU:0``, ``/device:CPU:1``).
        role: What the device is for, for the message (``device`` or ``host``).
        api: The front-end's name, for the message.

    Examples:
        >>> check_visible("/CPU:0", role="host", api="doc")
        '/device:CPU:0'
        >>> check_visible("/GPU:7", role="device", api="doc")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: doc: device='/GPU:7' names no device TensorFlow can see; visible: /device:CPU:0, ...
    """
    wanted = tf.DeviceSpec.from_string(device)
    if not is_visible(device):
        names = visible_device_names()
        raise LMSOptionError(
            f"{api}: {role}={device!r} names no device TensorFlow can see; visible: {', '.join(names)}. "
            f"Name one of them (on a machine without a GPU, split the CPU into two logical devices and pass "
            f"device='/CPU:0', host='/CPU:1').")
    return wanted.replace(job=None, replica=None, task=None).to_string()


def visible_device_names() -> List[str]:
    """This process's logical devices, without job, replica and task.

    Examples:
        >>> "/device:CPU:0" in visible_device_names()
        True
    """
    return [tf.DeviceSpec.from_string(d.name).replace(job=None, replica=None, task=None).to_string()
            for d in tf.config.list_logical_devices()]


def is_visible(device: str) -> bool:
    """Whether ``device`` (type and index; job, replica and task ignored) is one of this process's
    logical devices.

    Examples:
        >>> is_visible("/CPU:0"), is_visible("/GPU:7")
        (True, False)
    """
    wanted = tf.DeviceSpec.from_string(device)
    return any((d.device_type or "").upper() == (wanted.device_type or "").upper()
               and (d.device_index or 0) == (wanted.device_index or 0)
               for d in map(tf.DeviceSpec.from_string, (v.name for v in tf.config.list_logical_devices())))


def resolve_device(device: Optional[str], *, api: str = "lms-tf") -> Optional[str]:
    """The accelerator to manage: ``device`` if given (and visible), else the first GPU, else None.

    Raises:
        LMSOptionError: ``device`` names no device TensorFlow can see.

    Examples:
        >>> resolve_device("/CPU:1")
        '/device:CPU:1'
    """
    if device is not None:
        return check_visible(device, role="device", api=api)
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return tf.DeviceSpec.from_string(gpus[0].name).replace(job=None, replica=None, task=None).to_string()
    return None


def no_accelerator_message(api: str) -> str:
    """The warning given when there is no GPU and no explicit ``device=``.

    Examples:
        >>> "untouched" in no_accelerator_message("lms_tf.function")
        True
    """
    return (f"{api}: no GPU is visible and no device= was given, so the training step is left untouched "
            f"(nothing to swap from). Pass device='/GPU:0' on a GPU machine, or device='/CPU:0', "
            f"host='/CPU:1' with two logical CPUs to exercise the pass on a CPU.")


# The tf.function graphs whose trace created variables (see creates_variables).
_VARIABLE_CREATING_TRACES: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


@tf.autograph.experimental.do_not_convert
def call_step_for_rewrite(serialize: bool, step, *args, **kwargs):
    """Calls the step being traced, noting whether it creates variables (:func:`creates_variables`).

    With ``serialize=True`` the step runs inside TensorFlow's automatic control dependencies,
    added now: the order the pass imposes must respect the edges TF adds between stateful ops,
    which would otherwise come when the trace ends and close a cycle.

    Examples:
        >>> call_step_for_rewrite(False, lambda x: x + 1, 1)
        2
    """
    graph = _compat.current_graph()

    def note_creation(next_creator, **kwargs):
        if _compat.is_function_graph(graph):
            _VARIABLE_CREATING_TRACES.add(graph)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(note_creation):
        if not serialize:
            return step(*args, **kwargs)
        with _compat.automatic_control_dependencies() as mark_as_return:
            return mark_as_return(step(*args, **kwargs))


def creates_variables(graph: tf.Graph) -> bool:
    """Whether the step traced in ``graph`` (through :func:`call_step_for_rewrite`) created variables.

    A step that builds its optimizer's slots (or a lazy layer, a metric) is traced twice on its
    first call: this trace, which creates them, and then the step without creations. The first
    one holds each new variable's initialization (a conditional assign that TensorFlow orders
    before the variable's reads), and it runs only when TensorFlow cannot lift those
    initializations out of it, once; every step runs the second. So a budget is judged on the
    second trace: the first is planned as close to the budget as it gets.

    Examples:
        >>> import tensorflow as tf
        >>> made = []
        >>> @tf.function
        ... def step():
        ...     out = call_step_for_rewrite(False, lambda: tf.Variable(1.0) if not made else None)
        ...     made.append(creates_variables(_compat.current_graph()))
        >>> step()
        >>> made
        [True, False]
    """
    return graph in _VARIABLE_CREATING_TRACES


def check_plan_matches(plan: Plan, ir: GraphIR, *, api: str) -> None:
    """Raises the library's error naming the first way a given plan does not fit the traced step.

    Every tensor a decision names must exist with the same shape, and every op it names (swap-in
    triggers and consumers, recompute gates, clones and consumers, orderings, sliced ops) must
    exist; a sliced op must be one the plan can slice (:func:`~lms_tf.simulate.lower.check_sliced_op`),
    and a clone's fetch must wait for a clone before its readers (:func:`~lms_tf.simulate.lower.check_clone_fetches`).

    Examples:
        >>> from lms_tf.core import make_ir
        >>> from lms_tf.core.plan import Decision, TensorDecision
        >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (2,))])])
        >>> bad = Plan((TensorDecision("y:0", "", (2,), 8, Decision.KEEP, "", 1, ()),), "d", "h", {}, {})
        >>> check_plan_matches(bad, ir, api="doc")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSOptionError: doc(plan=...): the plan does not match the traced step: tensor 'y:0' ...
    """
    def mismatch(what: str) -> LMSOptionError:
        return LMSOptionError(
            f"{api}(plan=...): the plan does not match the traced step: {what}. A plan holds for the step it "
            f"was made for (same model, input shapes and optimizer); make it again for this one "
            f"(`lms-tf plan ... --out plan.json`) or drop plan= to plan in place.")

    ops = {op.name for op in ir.ops}
    for d in plan.decisions:
        info = ir.tensors.get(d.tensor)
        if info is None:
            raise mismatch(f"tensor {d.tensor!r} ({d.decision.value}) is not in it")
        if d.shape is not None and info.shape is not None and tuple(d.shape) != tuple(info.shape):
            raise mismatch(f"tensor {d.tensor!r} has shape {tuple(info.shape)} here, {tuple(d.shape)} in the plan")
        named = [*(s.trigger for s in d.swap_ins), *(c for s in d.swap_ins for c in s.consumers),
                 *d.recompute_ops, *d.consumers, *([d.gate] if d.gate else []),
                 *([d.swap_out_before] if d.swap_out_before else [])]
        missing = next((n for n in named if n not in ops), None)
        if missing is not None:
            raise mismatch(f"op {missing!r}, named by the decision for {d.tensor!r}, is not in it")
    for ordering in plan.orderings:
        missing = next((n for n in (*ordering.waiters, *ordering.after) if n not in ops), None)
        if missing is not None:
            raise mismatch(f"op {missing!r} of an ordering is not in it")
    for weight in plan.offloaded_weights:
        named = [n for f in weight.fetches for n in ((f.trigger,) if f.trigger else ()) + f.consumers]
        missing = next((n for n in named if n not in ops), None)
        if missing is not None:
            raise mismatch(f"op {missing!r}, named by a fetch of {weight.variable!r}, is not in it")
        gradient = next((g for f in weight.fetches for g in f.after_gradients if g not in ir.tensors), None)
        if gradient is not None:
            raise mismatch(f"gradient {gradient!r}, which a fetch of {weight.variable!r} waits for, is not in it")
        missing = next((n for pair in weight.clone_fetches_after for n in pair if n not in ops), None)
        if missing is not None:
            raise mismatch(f"op {missing!r}, named by {weight.variable!r}'s clone_fetches_after, is not in it")
    decisions = {d.tensor: d for d in plan.decisions}
    for sliced in plan.sliced:
        missing = next((n for n in (sliced.op, sliced.trigger) if n not in ops), None)
        if missing is not None:
            raise mismatch(f"op {missing!r}, named by the sliced entry for {sliced.op!r}, is not in it")
        check_sliced_op(ir, sliced, decisions)  # the library's error, saying what to edit
    check_clone_fetches(ir, plan)


def rewrite_traced_step(request: RewriteRequest, *, api: str,
                        input_shapes: Optional[Mapping[str, Sequence[Optional[int]]]] = None,
                        scope_aliases: Optional[Mapping[str, str]] = None,
                        irs: Optional[list] = None, outputs=None) -> Optional[Plan]:
    """Plans (or checks the given plan) and applies it to the ``tf.function`` graph being traced now.

    Call it inside the traced body, after the gradients and the update were built. It plans once;
    with ``serialize=True`` it then chains the compute ops in the order the simulator replayed the plan.

    Args:
        request: What to do (:class:`RewriteRequest`).
        api: Front-end name for messages.
        input_shapes: Concrete shapes of the function's input placeholders, by op name.
        scope_aliases: Keras layer name -> its name scope in this trace (for ``exclude``).
        irs: If given, the IR of the step before the rewrite is appended to it (to simulate the plan).
        outputs: What the step returned (any nest; its tensors are what the function will return):
            which ops Grappler will fuse or regroup, read off a run of it, depends on what the
            runtime keeps.

    Returns:
        The plan applied, or None when the step's sizes depend on a dimension nothing resolved
        (a batch dimension the trace leaves unknown and no batch size was given or found): the
        trace is then left untouched, with a warning saying why and what to pass.

    Raises:
        LMSError: Not inside a ``tf.function`` trace (eager execution), or the pass failed.
        LMSOptionError: A given plan does not match the traced step.

    Examples:
        >>> request = RewriteRequest(Policies(host="/CPU:1"), "/device:CPU:0")
        >>> rewrite_traced_step(request, api="doc")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSError: doc: the step runs eagerly...
    """
    graph = _traced_graph(api)
    returned = None if outputs is None else [t for t in tf.nest.flatten(outputs)
                                             if isinstance(t, tf.Tensor) and t.graph is graph]
    ir = build_ir(graph, input_shapes=input_shapes, batch_size=request.batch_size, outputs=returned)
    on_host = frozenset(op.name for op in ir.ops if same_device(op.device, request.policies.host))
    if on_host:  # the update traced on the host (optimizer_on_host, weights="host"): host memory
        ir = dataclasses.replace(ir, host_placed=on_host)
    if request.plan is None and request.policies.weights != "device":
        # A weight fetch's gate reads its trigger: on an op Grappler folds into another (an inner
        # op of a fused or regrouped group) that extra reader would stop the rewrite and change
        # the numbers.
        ir = dataclasses.replace(ir, grappler_rewritten=grappler_rewritten_ops(
            graph, request.device, _grappler_memory_bytes(request), outputs=returned, removed_only=True))
    if irs is not None:
        irs.append(ir)
    if request.plan is not None:
        check_plan_matches(request.plan, ir, api=api)
        plan = request.plan
    else:
        try:
            plan = _make_plan(ir, request, scope_aliases, api=api, first_trace=creates_variables(graph))
        except UnknownSizeError as err:
            warn_once(f"unknown-size:{api}:{err.shape}", unknown_size_message(api, err))
            return None
    if plan.policies.get("weights") == "auto":
        move_planned_weights(graph, plan, api=api)
    plan = check_weights_on_host(graph, plan, api=api)
    report = apply_plan(graph, ir, plan)
    _log_once(f"{plan.one_line()} (inserted {report.inserted})")
    if request.serialize:
        # Only ops whose kernel Grappler changes stay off the chain: one whose shape input it just
        # folded to a constant (it knows the step's input shapes) runs as it would, and is chained.
        report = serialize_step(graph, simulated_ranks(graph, ir, plan, request.cost_model()), request.device,
                                _grappler_memory_bytes(request), outputs=returned)
        logger.info("serialized graph %s in the simulated order (%d control edges; %d gates hold ops Grappler rewrites)",
                    graph.name, report.edges, report.gates)
        if report.gates_undone:  # as before gates existed: informative, not a warning
            logger.info("%s: serialize=True holds the ops Grappler rewrites at their place in the chain, except "
                        "where Grappler, run on the held step, ran another kernel or read operands in another "
                        "order (%s): those run as soon as their inputs are ready, so the numbers stay the same.",
                        api, ", ".join(report.gates_undone))
    return plan


def _traced_graph(api: str) -> tf.Graph:
    """The ``tf.function`` graph being traced now, or the library's error when the step runs eagerly."""
    graph = _compat.current_graph()
    if not _compat.is_function_graph(graph):
        raise LMSError(
            f"{api}: the step runs eagerly (received a {type(graph).__name__}, not a tf.function graph), so "
            f"there is no graph to rewrite. Remove run_eagerly=True from compile() and do not call "
            f"tf.config.run_functions_eagerly(True).")
    return graph


def rewrite_traced_stages(requests: Sequence[RewriteRequest], *, api: str,
                          refine: Optional[Callable[[int, GraphIR, Plan], Plan]] = None) -> List[Plan]:
    """Plans each pipeline stage's device with its own request and applies the plans together.

    A pipeline step is one traced graph whose stages run on different devices; the rewrite can
    run once per graph, so each request (one per stage, its ``device`` the stage's) is planned
    on the same IR, keeps the decisions for tensors its own device produces (an op placed
    nowhere, such as the split of the batch, belongs to no stage), and the swaps of all of them
    are inserted in one rewrite, each stage's to its own request's host (in a cluster, a device
    of the stage's own process). Each plan is the TFLMS rule's, kept to what the stage does
    alone (:func:`stage_plan`); ``refine`` lets the caller plan a stage again, as
    ``PipelineStep(budget=)`` does with lms-tf's budget planner on a view of the stage alone.

    Args:
        requests: One per stage that swaps (``policies.budget`` None, ``recompute`` False,
            ``weights="device"``).
        api: Front-end name for messages.
        refine: Called with each request's index, the step's IR and that stage's plan; returns
            the plan to apply instead (a pipeline holds each stage to its budget with it): its
            swaps and recomputes are applied.

    Returns:
        Each request's plan, restricted to its stage's tensors (refined, if asked).

    Raises:
        LMSError: Not inside a ``tf.function`` trace.

    Examples:
        >>> rewrite_traced_stages([], api="doc")
        []
    """
    if not requests:
        return []
    graph = _traced_graph(api)
    ir = build_ir(graph, batch_size=requests[0].batch_size)
    plans = [stage_plan(make_plan(ir, request.policies, device=request.device), ir, request.device)
             for request in requests]
    if refine is not None:
        plans = [refine(i, ir, plan) for i, plan in enumerate(plans)]
    # Each stage's swaps (and recomputes, when a budget planned them) go to its own host (across
    # processes, its own process's).
    report = apply_plans(graph, ir, [dataclasses.replace(plan, decisions=tuple(
        d for d in plan.decisions if d.decision is not Decision.KEEP)) for plan in plans])
    _log_once(f"{api}: {len(plans)} stage(s) planned: " + "; ".join(p.one_line() for p in plans)
              + f" (inserted {report.inserted})")
    return plans


def stage_plan(plan: Plan, ir: GraphIR, device: str, unplaced: Collection[str] = ()) -> Plan:
    """``plan`` restricted to what one pipeline stage (the ops placed on ``device``) does alone.

    In a pipeline step the stages' forward and backward ops interleave, so a planner working by
    position or by time also offers a tensor sent to the next stage, or one read in another
    stage's backward pass. Moving it would make another stage read this stage's host (across
    processes, another task's memory), so it is kept instead: a decision stays only when its
    tensor is the stage's, its readers are the stage's backward ops, and the forward op made to
    wait for its copy out and the ops a recompute clones are the stage's (or, for a clone, an op
    placed nowhere that runs with the stage). Orderings over other stages' ops are dropped alike.
    A trigger may be another stage's op: the swap-in then also waits for that op, through a data
    edge (across processes, a send between the tasks), which cannot hang.

    Args:
        plan: A plan made over the whole step's IR (or a stage's view of it).
        ir: That IR.
        device: The stage's device.
        unplaced: Ops placed nowhere that run with the stage (the split of its micro-batches):
            a recompute may clone them too.

    Returns:
        The plan with every other decision kept and those orderings dropped.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.planner import make_plan
        >>> ir = chain_ir()   # one stage, every op on GPU:0
        >>> ir = dataclasses.replace(ir, ops=tuple(dataclasses.replace(op, device="/device:GPU:0") for op in ir.ops))
        >>> plan = make_plan(ir, Policies(host="/CPU:0", min_swap_bytes=0, swapout_threshold=1), device="/device:GPU:0")
        >>> len(stage_plan(plan, ir, "/device:GPU:0").swapped) == len(plan.swapped) > 0
        True
        >>> stage_plan(plan, ir, "/device:GPU:1").swapped
        ()
    """
    device_of = {op.name: op.device for op in ir.ops}

    def own(op_name: str) -> bool:
        return same_device(device_of.get(op_name, ""), device)


    def backward(op_name: str) -> bool:
        return own(op_name) and ir.op(op_name).phase is Phase.BACKWARD

    def alone(d) -> bool:
        if d.decision is Decision.KEEP:
            return True
        readers = [c for s in d.swap_ins for c in s.consumers] + list(d.consumers)
        return (own(ir.tensors[d.tensor].producer) and all(map(backward, readers))
                and (d.swap_out_before is None or own(d.swap_out_before))
                and all(own(op) or op in unplaced for op in d.recompute_ops))

    # A plan made over a stage's view can name tensors only the view has (its sends to other
    # stages' processes): they are not the stage's to move.
    decisions = tuple(d if alone(d) else d.kept("kept: it is read in another stage, or its plan would hold or clone "
                                                 "an op there") for d in plan.decisions
                      if d.tensor in ir.tensors and own(ir.tensors[d.tensor].producer))
    orderings = tuple(o for o in plan.orderings if all(map(own, o.waiters + o.after)))
    # A weight's fetch for clones waits for an earlier clone only while both are still recomputed.
    return without_unsound_clone_fetches(ir, dataclasses.replace(plan, decisions=decisions, orderings=orderings))


def move_planned_weights(graph: tf.Graph, plan: Plan, *, api: str) -> int:
    """``weights="auto"``: moves each variable the plan puts on the host and the step being traced
    reads from the device, and each the plan keeps on the device that an earlier trace moved to the
    host back, and points the trace at the moved variables. The plan is made from the traced step,
    so this happens while it is traced; the variable objects stay the same (Keras's and the
    optimizer's references hold). Returns how many moved.

    Examples:
        >>> move_planned_weights(tf.Graph(), Plan((), "/device:CPU:0", "/device:CPU:1", {}, {}), api="doc")
        0
    """
    by_placeholder = {internal.name: external for external, internal in getattr(graph, "captures", ())}
    by_handle = {id(v.handle): v for v in _compat.traced_variables(graph)}
    moved, nbytes, back = [], 0, []
    for weight in plan.weights:
        variable = by_handle.get(id(by_placeholder.get(weight.variable)))
        if variable is None:
            continue  # not a captured variable of this trace: check_weights_on_host names it
        to_host = weight.decision is Decision.SWAP
        if same_device(variable.device, plan.host) == to_host:
            continue
        _compat.move_variable_in_place(variable, plan.host if to_host else plan.device, graph)
        if to_host:
            moved.append(variable.name)
            nbytes += weight.nbytes or 0
        else:
            back.append(variable.name)
    if moved or back:
        logger.info("%s(weights='auto'): the plan moved %d of %d variables (%.1f MiB) to %s%s, e.g. %s; functions "
                    "traced before that read them must be traced again", api, len(moved), len(plan.weights),
                    nbytes / 2**20, plan.host, f" and {len(back)} back to {plan.device}" if back else "",
                    ", ".join((moved + back)[:3]))
    return len(moved) + len(back)


def check_weights_on_host(graph: tf.Graph, plan: Plan, *, api: str) -> Plan:
    """The plan, with only the fetches of variables that live on the host.

    When none of them does, the variables were not moved (a custom loop without
    :func:`lms_tf.place_weights`): the library's error says so. A few that do not (created in the
    first traced step, such as a compiled metric's or a lazily built layer's) stay on the device:
    their decisions become KEEP and a warning names them.

    Raises:
        LMSOptionError: No variable the plan fetches lives on the host.

    Examples:
        >>> g = tf.Graph()
        >>> check_weights_on_host(g, Plan((), "/device:CPU:0", "/device:CPU:1", {}, {}), api="doc").weights
        ()
    """
    if not plan.offloaded_weights:
        return plan
    device_of = {internal.name: getattr(external, "device", "") for external, internal in getattr(graph, "captures", ())}

    def where(weight) -> str:
        return device_of.get(weight.variable) or "an unknown device"

    def on_host(weight) -> bool:
        return same_device(device_of.get(weight.variable, ""), plan.host)

    off = [w for w in plan.offloaded_weights if not on_host(w)]
    if not off:
        return plan
    if len(off) == len(plan.offloaded_weights):
        raise LMSOptionError(
            f"{api}(weights='host'): none of the {len(off)} variables the step reads lives on the host {plan.host} "
            f"(e.g. {off[0].variable} on {where(off[0])}). Move them before the first step: "
            f"lms_tf.place_weights(model, optimizer, host={plan.host!r}) (LMSCallback does it for model.fit).")
    names = ", ".join(f"{w.variable} on {where(w)}" for w in off[:3])
    warn_once(f"weights-off-host:{api}:{graph.name}",
              f"{api}(weights='host'): {len(off)} of {len(plan.offloaded_weights)} variables the step reads were "
              f"created after the others moved to the host (in the first traced step: a compiled metric's, a layer "
              f"built lazily), so they stay on the device: {names}{', ...' if len(off) > 3 else ''}. Build the "
              f"model (and compile its metrics) before training, or call lms_tf.place_weights again, to move them.")
    kept = {w.variable for w in off}
    return dataclasses.replace(plan, weights=tuple(
        dataclasses.replace(w, decision=Decision.KEEP, fetches=(), reason=f"lives on {where(w)}, not on the host")
        if w.variable in kept else w for w in plan.weights))


def _grappler_memory_bytes(request: "RewriteRequest") -> int:
    """The memory TensorFlow's runtime tells Grappler the step's device has: a CPU's fixed 256 MiB,
    a GPU's capacity (which decides whether its memory optimizer acts)."""
    if (tf.DeviceSpec.from_string(request.device).device_type or "CPU") == "CPU":
        return CPU_GRAPPLER_MEMORY_BYTES
    return request.cost_model().device.memory_bytes


_last_logged = [""]


def _log_once(message: str) -> None:
    """Logs a plan's line unless it is the line logged last: Keras traces a train step twice
    (once more when the optimizer creates its variables), and each trace plans the same."""
    if message != _last_logged[0]:
        _last_logged[0] = message
        logger.info("%s", message)


def _make_plan(ir: GraphIR, request: RewriteRequest, scope_aliases, *, api: str, first_trace: bool) -> Plan:
    """The plan for the traced step; ``first_trace``: the trace that creates variables (:func:`creates_variables`)."""
    if request.policies.budget is None:
        return make_plan(ir, request.policies, device=request.device, scope_aliases=scope_aliases)
    try:
        return make_budget_plan(ir, request.policies, device=request.device, cost=request.cost_model(),
                                scope_aliases=scope_aliases)
    except InfeasibleBudgetError as err:
        if not first_trace:
            raise
        asked, least = err.budget_bytes, err.smallest_feasible_bytes
    # The budget is judged on the step's next trace, which runs every step; this one runs at
    # most once and gets its closest plan. (A least is the simulated peak with everything
    # movable moved; a second ask can name a slightly different one.)
    logger.info("%s: the step's first trace (which creates variables, and runs only if TensorFlow cannot lift "
                "their initializers out of it) needs at least %s, more than the budget %s: planned for that; "
                "the budget is held on the next trace, which every step runs", api, format_bytes(least),
                format_bytes(asked))
    for attempt in range(3):
        try:
            return make_budget_plan(ir, dataclasses.replace(request.policies, budget=least), device=request.device,
                                    cost=request.cost_model(), scope_aliases=scope_aliases)
        except InfeasibleBudgetError as err:
            if attempt == 2:
                raise
            least = max(least + 1, err.smallest_feasible_bytes)


def unknown_size_message(api: str, err: UnknownSizeError) -> str:
    """The warning for a trace left untouched because a tensor could not be sized.

    Examples:
        >>> err = UnknownSizeError("...", tensor="dense/Relu:0", shape=(None, 8))
        >>> print(unknown_size_message("LMSCallback", err))  # doctest: +ELLIPSIS
        LMSCallback: tensor 'dense/Relu:0' has shape (None, 8) ... left untouched ...
    """
    return (f"{api}: tensor {err.tensor!r} has shape {tuple(err.shape)} in the traced step and lms-tf found "
            f"no batch size to plan with, so this trace is left untouched (it trains as without lms-tf). "
            f"Pass batch_size=<largest batch> to {api}, or batch a tf.data pipeline with Dataset.batch(n) "
            f"as its last batching step (lms-tf reads n from it).")


def simulated_ranks(graph: tf.Graph, ir: GraphIR, plan: Plan, cost: CostModel) -> Dict[str, float]:
    """Graph op name -> its start rank in the simulation of ``plan`` (compute ops only).

    Swap copies run on their own streams and are left out, so they still overlap compute.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.constant(2.0, name="x")
        ...     y = tf.square(x, name="y")
        >>> plan = Plan((), "/device:CPU:0", "/device:CPU:1", {}, {"forward": 1})
        >>> simulated_ranks(g, build_ir(g), plan, CostModel(get_device_spec("a100-40gb-pcie4")))
        {'x': 0.0, 'y': 1.0}
    """
    sim = simulate(ir, plan, cost=cost, top=1)
    # Later ops win: a sliced op's concatenation, made after it, takes its simulator name.
    graph_name = {simulator_name(graph, op.name): op.name for op in graph.get_operations()}
    names = (graph_name.get(name) for name in sim.op_intervals)
    return {name: float(i) for i, name in enumerate(n for n in names if n is not None)}


def serialize_stages(devices: Sequence[str], rank: Mapping[str, float], *, leave_free: Collection[str] = (),
                     api: str, outputs: Optional[Sequence[tf.Tensor]] = None) -> SerializeReport:
    """Chains each pipeline stage's ops on its own device, one at a time, in ``rank`` order (the
    schedule's), for the ``tf.function`` graph being traced now.

    What ``serialize=True`` is to one device, for a pipeline: each stage's memory then follows
    one order, the one the per-layer model counts, instead of the executor's choice among ready
    ops. Stages still run side by side: only ops on one device are chained together. As on one
    device (:func:`~lms_tf.tf.rewrite.serialize.serialize_step`), the ops Grappler fuses or
    regroups take no control edge (it would change their kernel, and the numbers): each is held
    at its place in its stage's chain by gates instead.

    Must run inside :func:`call_step_for_rewrite` with ``serialize=True``, at the end of the
    traced body.

    Args:
        devices: Each stage's device.
        rank: Op name -> rank; lower runs first (ops it leaves out are not chained).
        leave_free: Ops neither chained nor held (they run when ready): see :class:`PipelineStep`
            for which and why.
        api: Front-end name for messages.
        outputs: The tensors the step returns, for the offline Grappler run that finds the ops
            left free (see :func:`~lms_tf.tf.rewrite.serialize.grappler_rewritten_ops`).

    Returns:
        What was chained and held (:class:`~lms_tf.tf.rewrite.serialize.SerializeReport`).

    Raises:
        LMSError: Not inside a ``tf.function`` trace.

    Examples:
        >>> serialize_stages(["/CPU:0"], {}, api="doc")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lms_tf.LMSError: doc: the step runs eagerly...
    """
    graph = _traced_graph(api)
    ops, left_free = graph.get_operations(), frozenset(leave_free)
    # Each stage's ops Grappler rewrites stay in its ranks: off the chain, held at their place by
    # gates (as serialize=True holds them on one device); the ops left free are neither.
    chains = [({op.name: rank[op.name] for op in ops
                if op.name in rank and same_device(op.device, device) and op.name not in left_free},
               onednn_may_fuse(device)) for device in devices]
    report = serialize_chains(graph, chains, devices[0], CPU_GRAPPLER_MEMORY_BYTES, outputs=outputs,
                              leave_free=left_free, free_through_control=False)
    logger.info("serialized the pipeline's %d stages in the schedule's order (%d control edges; %d gates hold ops "
                "Grappler rewrites)", len(devices), report.edges, report.gates)
    if report.gates_undone:
        logger.info("%s: serialize=True holds the ops Grappler rewrites at their place in each stage's chain, except "
                    "where a gate would change a kernel (left to run when ready): %s", api, ", ".join(report.gates_undone))
    return report
