"""A partitioned Keras model trained as a pipeline in one process: each stage on its own device,
micro-batches run in the GPipe or 1F1B order, gradients accumulated over the micro-batches.

The model's layer graph is cut into stages that run the model's own layer calls, in the order
the model's ``call`` runs them. A stage's inputs are every tensor an earlier stage (or the model's input) produces that
one of its layers reads, so a skip connection that crosses a boundary goes straight to the stage
that reads it. Each stage's forward pass of a micro-batch records its own tape; its backward pass
takes the gradients of its outputs from the later stages that read them and hands on the
gradients of its inputs. Each stage's tasks are chained in the schedule's order
(:mod:`lms_tf.pipeline.schedule`) through kept Identities, so the graph itself enforces GPipe or
1F1B on the executor, whatever order it would pick. Ops are named as on one device where names
decide how gradients are summed (see :class:`PipelineStep`).

:func:`accumulation_step` is the single-device step with gradient accumulation over the same
micro-batches: the pipelined step computes the same ops on the same values and accumulates in
the same order, so with op determinism on their losses and weights are bit-identical.

Examples:
    >>> import keras, numpy as np, lms_tf
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"),
    ...                           keras.layers.Dense(4, name="b")], name="two")
    >>> step = PipelineStep(model, [["a"], ["b"]], microbatches=2, devices=["/CPU:0", "/CPU:1"])
    >>> float(step(np.ones((4, 8), "float32"), np.zeros((4,), "int32"))) > 0
    True
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import InfeasibleBudgetError, LMSOptionError, infeasible, warn_once
from lms_tf.core.ir import GraphIR, canonical_device, same_device
from lms_tf.core.plan import Decision, Plan, Predictions
from lms_tf.core.policy import Policies, describe, format_bytes, parse_bytes
from lms_tf.cost import CostModel, get_device_spec
from lms_tf.pipeline.schedule import FORWARD, run_order, stage_tasks
from lms_tf.planner import make_budget_plan
from lms_tf.simulate import simulate, tensorflow_cpu_allocator
from lms_tf.tf.diagnostics import CPU_GRAPPLER_MEMORY_BYTES, cpu_kernel_library
from lms_tf.tf.driver import RewriteRequest, call_step_for_rewrite, check_visible, creates_variables, is_visible, \
    resolve_device, rewrite_traced_stages, serialize_stages, stage_plan, visible_device_names
from lms_tf.tf.rewrite.common import LMS_ATTR, mark
from lms_tf.tf.rewrite.serialize import bypass_identity_n, grappler_rewritten_ops
from lms_tf.tf.trace import build_ir
from lms_tf.tf.variables import variable_bytes_by_device, variable_device

logger = logging.getLogger("lms_tf")

#: The device whose cost model times the replay of :meth:`PipelineStep.predicted_peaks` (the
#: memory it predicts does not depend on it).
_TIMING_PRESET = "v100-16gb-pcie3"
#: How many budgets (in the planner's own count, from a stage's plain peak to the least the
#: planner reaches) a stage is planned for before it is reported infeasible: see
#: :meth:`PipelineStep._fit_replay`.
_LADDER_RUNGS = 8

#: The op attribute naming the task a pipeline gate belongs to (``stage<k>_<F|B><m>``).
TASK_ATTR = "_lms_task"


class StageModel:
    """One stage of a split model: the model's own layer calls it runs, and which graph tensors it
    reads and hands on.

    A stage runs the model's layer calls (Keras nodes) in the order the whole model's ``call``
    runs them, so its ops are recorded in the same relative order as on one device and a tape
    sums a tensor's gradients in the same order.

    Attributes:
        index: Position in the pipeline, from 0.
        layers: Names of the model's layers it runs.
        inputs: Keys of the tensors it reads (the model's input first, if it reads it).
        outputs: Keys of the tensors it produces that later stages read (the model's outputs for the last).

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a"),
        ...                           keras.layers.Dense(2, name="b")])
        >>> [s.layers for s in split_stages(model, [["a"], ["b"]])]
        [('a',), ('b',)]
    """

    def __init__(self, index: int, layers: Tuple[str, ...], graph, nodes: list, inputs: list, outputs: list):
        self.index, self.layers = index, layers
        self._graph, self._nodes, self._inputs, self._outputs = graph, nodes, inputs, outputs
        self.inputs = tuple(_tensor_key(t) for t in inputs)
        self.outputs = tuple(_tensor_key(t) for t in outputs)

    def __call__(self, inputs: Sequence[tf.Tensor], training: bool = True) -> List[tf.Tensor]:
        """Runs the stage's layer calls on ``inputs`` (one per key in :attr:`inputs`); returns
        one tensor per key in :attr:`outputs`."""
        values = {id(symbolic): value for symbolic, value in zip(self._inputs, inputs)}
        for node in self._nodes:
            _compat.call_node(self._graph, node, values, training)
        return [values[id(symbolic)] for symbolic in self._outputs]

    def __repr__(self) -> str:
        return f"StageModel({self.index}, layers={list(self.layers)}, inputs={list(self.inputs)}, outputs={list(self.outputs)})"


def _tensor_key(tensor) -> str:
    history = tensor._keras_history
    return f"{history.operation.name}:{history.node_index}:{history.tensor_index}"


def split_stages(model, stage_layers: Sequence[Sequence[str]]) -> List[StageModel]:
    """Cuts a Sequential or Functional model into stages that run its own layer calls.

    Args:
        model: A built Sequential or Functional Keras model (its layers each called once).
        stage_layers: Each stage's layer names, in model order (e.g. a
            :class:`~lms_tf.pipeline.Partition`'s ``[s.layers for s in p.stages]``).

    Returns:
        The stages, first to last.

    Raises:
        LMSOptionError: A subclassed model, a layer named twice, missing or unknown, a layer
            called more than once (shared), or a stage reading a later stage's output.

    Examples:
        >>> import keras
        >>> x = keras.Input((4,))
        >>> a = keras.layers.Dense(4, name="a")(x)
        >>> b = keras.layers.Dense(4, name="b")(a)
        >>> out = keras.layers.Dense(2, name="out")(keras.layers.Add(name="skip")([a, b]))
        >>> stages = split_stages(keras.Model(x, out), [["a"], ["b", "skip", "out"]])
        >>> stages[1].inputs   # the skip's input from stage 0 is sent straight to stage 1
        ('a:0:0',)
    """
    graph = _compat.functional_graph(model)
    if graph is None:
        raise LMSOptionError(f"pipeline execution cuts a model's layer graph, and {model.name!r} is subclassed (its "
                             f"layers are called from Python code, not a graph). Build it as a Sequential or "
                             f"Functional model, or partition it for prediction only (lms_tf.partition).")
    nodes = _compat.nodes_in_call_order(graph)
    layers = {}
    for node in nodes:
        layers.setdefault(node.operation.name, []).append(node)
    stage_of: Dict[str, int] = {}
    for k, names in enumerate(stage_layers):
        for name in names:
            if name in stage_of:
                raise LMSOptionError(f"layer {name!r} is in stages {stage_of[name]} and {k}; each layer belongs to "
                                     f"one stage.")
            if name not in layers:
                raise LMSOptionError(f"stage {k} names layer {name!r}, which {model.name!r} does not have; its layers "
                                     f"are {', '.join(map(repr, list(layers)[:8]))}{', ...' if len(layers) > 8 else ''}.")
            stage_of[name] = k
    missing = [name for name in layers if name not in stage_of]
    if missing:
        raise LMSOptionError(f"no stage runs layer(s) {', '.join(map(repr, missing[:5]))} of {model.name!r}: "
                             f"give every layer to a stage (lms_tf.partition does).")
    shared = [name for name, calls in layers.items() if len(calls) > 1]
    if shared:
        raise LMSOptionError(f"layer(s) {', '.join(map(repr, shared[:5]))} of {model.name!r} are called more than "
                             f"once (shared); pipeline execution needs each layer called once.")
    tensors: Dict[int, object] = {id(t): t for t in graph.inputs}
    produced_by: Dict[int, int] = {id(t): -1 for t in graph.inputs}  # -1: the model's input
    readers: Dict[int, List[int]] = {}
    for node in nodes:
        k = stage_of[node.operation.name]
        for t in node.outputs:
            produced_by[id(t)], tensors[id(t)] = k, t
        for t in node.input_tensors:
            readers.setdefault(id(t), []).append(k)
    for tid, stages in readers.items():
        if produced_by[tid] > min(stages):
            raise LMSOptionError(f"stage {min(stages)} reads a tensor stage {produced_by[tid]} produces: stages must "
                                 f"follow the model's order.")
    last = len(stage_layers) - 1
    if any(produced_by[id(t)] != last for t in graph.outputs):
        raise LMSOptionError(f"the last stage must produce the model's outputs; stage {last} runs "
                             f"{', '.join(map(repr, stage_layers[last]))}.")
    model_inputs = [id(t) for t in graph.inputs]
    result = []
    for k, names in enumerate(stage_layers):
        read = [tid for tid, stages in readers.items() if k in stages and produced_by[tid] != k]
        inputs = [tid for tid in model_inputs if tid in read or k == 0] + sorted(
            (tid for tid in read if tid not in model_inputs), key=lambda tid: _tensor_key(tensors[tid]))
        outputs = ([id(t) for t in graph.outputs] if k == last else
                   [tid for tid, stages in readers.items() if produced_by[tid] == k and max(stages) > k])
        result.append(StageModel(k, tuple(names), graph, [n for n in nodes if stage_of[n.operation.name] == k],
                                 [tensors[t] for t in inputs], [tensors[t] for t in outputs]))
    return result


def place_stages(model, stages, devices: Sequence[str]):
    """A copy of ``model`` whose stage-k layers keep their weights on ``devices[k]``: each stage's
    weights, and the optimizer slots Keras places beside them, live where the stage runs (with
    one process per stage, in that process's memory) instead of where the model was built. The
    copy has the same weights and, if ``model`` is compiled, the same loss and a new optimizer of
    the same configuration. ``model`` is not changed.

    Args:
        model: A built Sequential or Functional Keras model.
        stages: A :class:`~lms_tf.pipeline.Partition` or each stage's layer names.
        devices: One device per stage.

    Returns:
        The placed copy, for ``PipelineStep(copy, stages, devices=devices)``.

    Raises:
        LMSOptionError: Bad stages (see :func:`split_stages`) or not one device per stage.

    Examples:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a"),
        ...                           keras.layers.Dense(2, name="b")])
        >>> placed = place_stages(model, [["a"], ["b"]], ["/CPU:0", "/CPU:1"])
        >>> placed.get_layer("b").kernel.value.device.endswith("CPU:1")
        True
    """
    stage_layers = _stage_layers(model, stages, devices)
    split_stages(model, stage_layers)  # the same checks as the pipeline's
    device_of = {name: devices[k] for k, names in enumerate(stage_layers) for name in names}

    def clone(layer):
        copy = layer.__class__.from_config(layer.get_config())
        # (``x + h`` on Keras tensors makes an operation, not a layer: it holds no weights to place)
        if layer.name in device_of and isinstance(layer, keras.layers.Layer):
            with tf.device(device_of[layer.name]):
                copy.build_from_config(layer.get_build_config())
            copy.set_weights(layer.get_weights())
        return copy

    placed = keras.models.clone_model(model, clone_function=clone)
    if getattr(model, "optimizer", None) is not None and getattr(model, "loss", None) is not None:
        placed.compile(optimizer=model.optimizer.__class__.from_config(model.optimizer.get_config()), loss=model.loss)
        # Built now, eagerly: Keras places each slot beside its weight then, but not when the
        # first update builds the optimizer inside the traced step (the slots land on the default device).
        placed.optimizer.build(placed.trainable_variables)
    return placed


def _is_partition(stages) -> bool:
    return hasattr(stages, "stages") and hasattr(stages, "schedule")


def _stage_layers(model, stages, devices: Sequence[str]) -> List[List[str]]:
    """Each stage's layer names, from a Partition (its unprofiled layers added) or given lists,
    checked against one device per stage."""
    stage_layers = (_with_unprofiled_layers(model, [list(s.layers) for s in stages.stages])
                    if _is_partition(stages) else [list(s) for s in stages])
    if isinstance(devices, str) or len(devices) != len(stage_layers):
        raise LMSOptionError(f"devices= needs one device per stage ({len(stage_layers)}); got {devices!r}.")
    return stage_layers


def _with_unprofiled_layers(model, stage_layers: List[List[str]]) -> List[List[str]]:
    """A partition's stages, with the layers it does not name added: a partition lists the layers
    that put ops in the traced step, so a layer with none (a linear ``Activation``) joins the
    stage of the layer called before it (the first stage if none was)."""
    graph = _compat.functional_graph(model)
    if graph is None:
        return stage_layers
    stage_of = {name: k for k, names in enumerate(stage_layers) for name in names}
    result = [list(names) for names in stage_layers]
    current, added = 0, []
    for node in _compat.nodes_in_call_order(graph):
        name = node.operation.name
        if name in stage_of:
            current = stage_of[name]
        elif name not in added:
            result[current].append(name)
            added.append(name)
    if added:
        logger.info("pipeline: %d layer(s) with no ops in the traced step (%s) run in the stage of the layer "
                    "before them", len(added), ", ".join(added[:5]))
    return result


def _loss_and_optimizer(model, loss, optimizer):
    loss = loss if loss is not None else getattr(model, "loss", None)
    loss_fn = keras.losses.get(loss) if loss is not None else keras.losses.SparseCategoricalCrossentropy()
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    return loss_fn, optimizer if optimizer is not None else keras.optimizers.SGD()


def _split(x, microbatches: int, what: str):
    batch = x.shape[0]
    if batch is not None and batch % microbatches:
        raise LMSOptionError(f"the {what} batch of {batch} does not split into {microbatches} equal micro-batches: "
                             f"use a batch size divisible by {microbatches}.")
    return tf.split(x, microbatches)


def microbatch_scope(index: int, microbatches: int) -> str:
    """The name scope of micro-batch ``index``'s forward pass, zero-padded so names sort in
    micro-batch order: Grappler's arithmetic optimizer collapses a chain of additions into one
    ``AddN`` and sorts its inputs by name, so with ``microbatch10`` before ``microbatch2`` the
    accumulated gradients would be summed in another order (and round differently).

    Examples:
        >>> [microbatch_scope(m, 12) for m in (0, 2, 10)]
        ['microbatch00', 'microbatch02', 'microbatch10']
    """
    return f"microbatch{index:0{len(str(microbatches - 1))}d}"


def _accumulate(accumulated: Optional[list], grads: list) -> list:
    """Adds one micro-batch's gradients to the running sums (one helper for the pipelined and the
    single-device step, so both add in the same order). An embedding's gradient arrives as
    ``IndexedSlices`` and is summed densely: the accumulator is dense, as a weight is."""
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return grads if accumulated is None else [a + g for a, g in zip(accumulated, grads)]


def _mean_of(accumulated: List[tf.Tensor], microbatches: int) -> List[tf.Tensor]:
    """The accumulated gradients averaged over the micro-batches (one helper, so the pipelined and
    the single-device step round the same way)."""
    return [g / microbatches for g in accumulated]


def accumulation_step(model, microbatches: int, *, loss=None, optimizer=None):
    """The single-device training step with gradient accumulation: the reference a pipelined step equals.

    Each micro-batch's loss (the loss's own reduction over the micro-batch) is differentiated on
    its own; the gradients are summed in micro-batch order, averaged, and applied once.

    Args:
        model: A built Keras model.
        microbatches: Micro-batches per step.
        loss: A Keras loss (default: the model's compiled loss, else sparse categorical cross-entropy).
        optimizer: A Keras optimizer (default: the model's, else SGD).

    Returns:
        A ``tf.function`` ``step(x, y) -> mean loss over the micro-batches``.

    Examples:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        >>> step = accumulation_step(model, 2)
        >>> float(step(np.ones((4, 8), "float32"), np.zeros((4,), "int32"))) > 0
        True
    """
    loss_fn, optimizer = _loss_and_optimizer(model, loss, optimizer)

    @tf.function(autograph=False)
    def step(x, y):
        splits = [_split(t, microbatches, "input") for t in tf.nest.flatten(x)]  # a model may take several
        ys = _split(y, microbatches, "label")
        accumulated, losses, previous = None, [], []
        for m in range(microbatches):
            # One micro-batch after the other (its input waits until the sums so far are
            # computed): one micro-batch's activations at a time, and the sums stay a chain that
            # Grappler cannot collapse into an AddN, which adds in another order past 8 terms.
            label = f"accumulate_{m}"
            x_m = tf.nest.pack_sequence_as(x, _gated([parts[m] for parts in splits], previous, label))
            with tf.name_scope(microbatch_scope(m, microbatches)), tf.GradientTape() as tape:
                value = loss_fn(ys[m], model(x_m, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            accumulated = _accumulate(accumulated, grads)
            previous = _done(list(accumulated), label)
            losses.append(value)
        optimizer.apply_gradients(zip(_mean_of(accumulated, microbatches), model.trainable_variables))
        return tf.add_n(losses) / microbatches

    return step


class PipelineStep:
    """A model's training step run as a pipeline of stages on their devices, in one process.

    Args:
        model: A built Sequential or Functional Keras model.
        stages: A :class:`~lms_tf.pipeline.Partition` (its stages' layers, schedule and
            micro-batches are used), or a list of each stage's layer names.
        microbatches: Micro-batches per step (taken from the partition when one is given).
        schedule: ``"1f1b"`` or ``"gpipe"`` (taken from the partition when one is given).
        devices: One TensorFlow device per stage (logical CPUs work: ``["/CPU:0", "/CPU:1"]``).
        loss: A Keras loss (default: the model's compiled loss, else sparse categorical cross-entropy).
        optimizer: A Keras optimizer (default: the model's, else SGD).
        swap: Which stages swap activations to ``host`` with lms-tf: ``False`` (none), ``True``
            (the stages the partition says swap, ``host_bytes > 0``; every stage when cut by
            hand), or a list of stage indices. Each such stage gets its own lms-tf plan (the
            TFLMS rule: a tensor its backward pass reads after ``swapout_threshold`` ops or more
            goes to the host and comes back, gated, before its reader), all applied in one
            rewrite of the traced step.
        budget: Holds each swapping stage to a memory budget instead of swapping every tensor
            the TFLMS rule finds: bytes or a size (``"12GiB"``) for every swapping stage, or a
            list with one entry per stage (None: that stage swaps by the rule alone), or
            ``"partition"``: with a :class:`~lms_tf.pipeline.Partition`, the limit it cut each
            swapping stage for (the stage's device memory, or the partition's budget where
            lower), so a stage swaps what the built step needs to fit it. lms-tf's budget planner
            then plans each such stage on its own (the other stages' ops run elsewhere; what it
            receives arrives when sent), as it plans a single-device step: per tensor, what to
            swap (each copy timed against the link of the stage's ``device_spec``) and, with a
            recompute policy, what to recompute, at the least predicted slowdown. The stage's
            replay (counted as :meth:`predicted_peaks` does) judges the plans made for a ladder of
            budgets in the planner's own count, and the one that moves least and fits is
            taken. A stage that fits
            without a plan keeps everything. The simulator copies a swapped tensor out and back
            as a GPU stage would; between logical CPUs TensorFlow hands over the same buffer, so
            there the built step's real peak (and :meth:`predicted_peaks`, which replays the
            built step) does not drop. Each such plan's ``budget_bytes`` and ``predictions``
            (the stage's replayed peak without a plan and with its plan, weights and slots
            included; the planner's predicted step time) say what was chosen.
        host: Where swapped tensors live (needed when a stage swaps): a device of this process,
            or with stages in a cluster, a device type and index (``"/CPU:0"``) naming that
            device in each stage's own process, so each stage swaps to its own host memory.
        min_swap_bytes: Tensors smaller than this are never swapped.
        recompute: Which stages keep only the tensors they receive for each micro-batch and run
            their forward pass again at the start of its backward task (GPipe's
            re-materialization), instead of keeping what the backward pass reads: ``False``
            (none), ``True`` (the stages the partition says recompute; every stage when cut by
            hand), or a list of stage indices. Or one of lms-tf's recompute policies
            (``"auto"``, ``"cheap"`` or ``"sqrt"``, as in :class:`~lms_tf.LMSCallback`):
            then no stage runs again as a whole, and the budget planner may recompute single
            tensors inside each stage held to a ``budget``. The second pass computes the same values, so the
            numbers do not change; its variable updates are dropped (a BatchNormalization's
            moving statistics move once). A stage whose forward pass draws random numbers
            (dropout, noise) keeps its activations instead, with a warning.
        serialize: Run each stage's ops one at a time in the schedule's order (control edges on
            each stage's device; stages still run side by side), so a stage's memory follows the
            order its prediction counts instead of the executor's choice among ready ops: for
            checking the partition's per-stage figures on real allocators. The numbers do not
            change.
        device_spec: The device preset (or :class:`~lms_tf.cost.DeviceSpec`) whose cost model
            the budget planner plans each budgeted stage for, or a list with one per stage.
            Default: the device the partition cut the stage for, else ``"v100-16gb-pcie3"``.

    Attributes:
        stages: The :class:`StageModel` of each stage.
        tasks: Each stage's tasks in the order it runs them.
        swap_stages: The stages that swap.
        recompute_stages: The stages that run their forward pass again (after the first call,
            without any that turned out to draw random numbers).
        hosts: Each swapping stage's host (a full device name in a cluster), by stage.
        plans: After the first call, each swapping stage's plan (in ``swap_stages`` order).
        budgets: Each budgeted stage's budget in bytes, by stage.

    Raises:
        LMSOptionError: Bad stages (see :func:`split_stages`), a device count that is not one per
            stage, a device TensorFlow does not have, or a schedule that is unknown.

    Examples:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"),
        ...                           keras.layers.Dense(4, name="b")])
        >>> step = PipelineStep(model, [["a"], ["b"]], microbatches=4, schedule="gpipe", devices=["/CPU:0", "/CPU:1"])
        >>> [" ".join(map(str, t)) for t in step.tasks]
        ['F0 F1 F2 F3 B0 B1 B2 B3', 'F0 F1 F2 F3 B0 B1 B2 B3']
    """

    def __init__(self, model, stages, *, microbatches: Optional[int] = None, schedule: Optional[str] = None,
                 devices: Sequence[str], loss=None, optimizer=None, swap=False, host: Optional[str] = None,
                 min_swap_bytes: int = 64 * 1024, serialize: bool = False, budget=None, recompute=False,
                 device_spec=None):
        stage_layers = _stage_layers(model, stages, devices)
        self.swap_stages = _chosen_stages(swap, stages, len(stage_layers), "swap")
        # A recompute policy ('auto', ...) is for the budget planner inside each budgeted stage;
        # True or stage indices re-run whole stages.
        self._tensor_recompute = recompute if isinstance(recompute, str) else None
        self.recompute_stages = [] if self._tensor_recompute else _chosen_stages(
            recompute, stages, len(stage_layers), "recompute")
        if swap is True and not self.swap_stages:
            logger.info("PipelineStep(swap=True): the partition swaps no stage (every stage fits its device), so "
                        "nothing is swapped")
        self.plans: List = []
        if _is_partition(stages):
            microbatches = stages.microbatches if microbatches is None else microbatches
            schedule = stages.schedule if schedule is None else schedule
        microbatches = 1 if microbatches is None else microbatches
        schedule = schedule or "1f1b"
        for device in devices:  # a cluster task's device (a job named) is checked when connecting
            if not _in_cluster(device) and not is_visible(device):
                raise LMSOptionError(f"device {device!r} is not one of this process's devices "
                                     f"({', '.join(sorted(visible_device_names()))}); on a CPU, make logical devices "
                                     f"with tf.config.set_logical_device_configuration before TensorFlow starts.")
        self.hosts: Dict[int, str] = _stage_hosts(host, devices, self.swap_stages) if self.swap_stages else {}
        self.budgets: Dict[int, int] = _stage_budgets(_partition_budgets(budget, stages, self.swap_stages),
                                                      self.swap_stages, len(stage_layers))
        if self._tensor_recompute is not None:
            Policies(recompute=self._tensor_recompute)  # the library's error for a policy it does not know
            if not self.budgets:
                raise LMSOptionError(f"recompute={self._tensor_recompute!r} lets lms-tf's budget planner recompute "
                                     f"tensors inside stages held to a budget, but no stage has one; pass budget= "
                                     f"with swap=True, or recompute=True (or stage indices) to run whole stages' "
                                     f"forward passes again.")
        self._presets = _stage_presets(device_spec, stages, len(stage_layers))
        self._min_swap_bytes = min_swap_bytes
        self.tasks = stage_tasks(schedule, len(stage_layers), microbatches)
        self.order = run_order(self.tasks)
        self.stages = split_stages(model, stage_layers)
        self._graph = _compat.functional_graph(model)
        # By name, every operation a stage runs: layers, and the operations Keras makes of ``x + y``
        # on its tensors (which ``model.get_layer`` does not know).
        self._operations = {node.operation.name: node.operation for node in _compat.nodes_in_call_order(self._graph)}
        self._input_keys = [_tensor_key(t) for t in self._graph.inputs]
        self.model, self.devices, self.microbatches, self.schedule = model, list(devices), microbatches, schedule
        self.loss_fn, self.optimizer = _loss_and_optimizer(model, loss, optimizer)
        self.serialize = bool(serialize)
        self._running_sums: List[str] = []  # set when traced: each weight's running sums (see _schedule_ranks)
        # Python loops over a static schedule; serialized, inside the automatic control
        # dependencies, which the chain must respect.
        self._step = tf.function(lambda x, y: call_step_for_rewrite(self.serialize, self._run, x, y), autograph=False)

    def __call__(self, x, y):
        """Runs one pipelined training step; returns the mean loss over the micro-batches.

        ``x`` is what the model takes: a tensor, or for a model with several inputs a list (in the
        model's input order) or a dict by input name."""
        return self._step(x, y)

    def get_concrete_function(self, x, y):
        """The traced step (for inspecting the ops and control edges it runs).

        Examples:
            >>> PipelineStep.get_concrete_function.__name__
            'get_concrete_function'
        """
        return self._step.get_concrete_function(x, y)

    def predicted_peaks(self, x, y, *, allocator: bool = True) -> List[int]:
        """Each stage's predicted peak bytes in its own process, by lms-tf's simulator replaying
        this traced step (with its serialization, if any) once per stage.

        For stage ``k``, the ops placed on its device count, and so do the tensors it receives
        from other stages (its process holds a copy, from when they are sent to their last
        use); ops with no device run where the step is called, counted for stage 0. The stage's
        weights and optimizer slots (resident before the step) are added. This predicts the
        step as it is built, where the partition's per-layer model predicts a cut before any step
        exists: the two are compared in ``docs/benchmarks/partition.md``. A swap in the built
        step is replayed as TensorFlow runs it between logical CPUs (the host gets the same
        buffer), so a swapping stage shows no saving here; what its plan saves on a GPU stage is
        in its plan's ``predictions`` (with ``budget=``).

        Args:
            x: A batch of inputs (only its shapes matter).
            y: A batch of labels.
            allocator: Replay the allocations through a model of TensorFlow's CPU allocator
                (``TF_CPU_ALLOCATOR_USE_BFC=true``, which counts whole chunks); False sums tensor
                bytes instead.

        Returns:
            One figure per stage, first to last.

        Examples:
            >>> import keras, numpy as np
            >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="a"),
            ...                           keras.layers.Dense(4, name="b")])
            >>> step = PipelineStep(model, [["a"], ["b"]], microbatches=2, devices=["/CPU:0", "/CPU:1"])
            >>> x, y = np.ones((4, 8), "float32"), np.zeros((4,), "int32")
            >>> [peak > 0 for peak in step.predicted_peaks(x, y)]
            [True, True]
        """
        graph = self._step.get_concrete_function(x, y).graph
        ir = build_ir(graph)
        return [self._stage_replay(graph, ir, k)(allocator=allocator) for k in range(len(self.devices))]

    def _stage_replay(self, graph, ir, k: int) -> Callable[..., int]:
        """A function giving stage ``k``'s predicted peak bytes in its own process (see
        :meth:`predicted_peaks`), with a plan over ``ir`` replayed as well if given: what the
        stage holds is worked out once, and each plan tried replays it again."""
        return self._stage_view(graph, ir, k)[1]

    def _stage_view(self, graph, ir, k: int) -> Tuple[GraphIR, Callable[..., int], FrozenSet[str]]:
        """Stage ``k`` as its own process sees the step: the IR with every op the process does not
        hold placed elsewhere, the replay of :meth:`_stage_replay` (which adds the stage's
        weights and slots, resident before the step), and the ops placed nowhere that run with
        the stage."""
        device = self.devices[k]
        device_of = {op.name: op.device for op in graph.get_operations()}
        resident = sum(nbytes for where, nbytes in variable_bytes_by_device(
            list(self.model.weights) + list(self.optimizer.variables)).items() if same_device(where, device))
        cost = CostModel(get_device_spec(_TIMING_PRESET))
        # Among ready ops, the one ranked first: the order serialization chains each stage in
        # (the update, left out of the chain, replayed one weight after another).
        created = _schedule_ranks(graph, self._running_sums)
        # The IdentityN the update's readers were re-pointed around reads nothing anyone needs:
        # TensorFlow prunes it, so it receives nothing.
        pruned = {op.name for op in graph.get_operations()
                  if op.type == "IdentityN" and not any(t.consumers() for t in op.outputs)}
        mine = {op.name for op in ir.ops if op.name not in pruned and _stage_of(op, ir, device_of, self.devices) == k}
        received = {ir.tensors[t].producer for op in ir.ops if op.name in mine for t in op.inputs}
        stage_ir = _sent_when_made(dataclasses.replace(ir, host_placed=frozenset(
            op.name for op in ir.ops if op.name not in mine and op.name not in received)), mine)
        created = _sends_overlap_next_op(stage_ir, created, mine)
        cpu = _on_cpu(device)

        def peak(plan: Optional[Plan] = None, allocator: bool = True) -> int:
            modelled = allocator and cpu
            simulation = simulate(stage_ir, plan, cost=cost, top=1, priority=created,
                                  allocator=tensorflow_cpu_allocator() if modelled else None,
                                  kernels=cpu_kernel_library() if cpu else "cudnn")
            return (simulation.allocator_peak_bytes if modelled else simulation.peak_bytes) + resident

        return stage_ir, peak, frozenset(op for op in mine if not device_of.get(op))

    def _hold_to_budget(self, k: int, ir, rule: Plan) -> Plan:
        """Stage ``k`` planned by lms-tf's budget planner to fit its budget, or the library's error
        naming the least the stage reaches.

        The planner sees the stage alone (:meth:`_stage_view`: the other stages' ops run
        elsewhere, what the stage receives arrives when it is sent) and chooses, per tensor, what
        to swap (each copy timed against the link of the stage's device preset) and, with a
        recompute policy, what to recompute, at the least predicted slowdown. Its own simulation
        counts differently from the stage's replay (its order among ready ops, the allocator of
        the device preset, no weights): so the replay judges each plan (:meth:`_fit_replay`).
        """
        budget = self.budgets.get(k)
        if budget is None:
            return rule
        graph = _compat.current_graph()
        stage_ir, replay, unplaced = self._stage_view(graph, ir, k)
        device = _full_device(self.devices[k])
        cost = CostModel(self._presets[k])
        # A swap-in's gate reads its trigger: on an op Grappler folds into another (an inner op of
        # a fused or regrouped group, such as a GELU's gradient) that extra reader would stop the
        # rewrite, and the numbers would change. The planner gates on other ops. Given what the
        # step returns, the offline run prunes the dead ends the runtime prunes: a gate reading
        # one would keep alive a kernel the runtime otherwise never runs.
        cpu = _on_cpu(device)
        # An op whose shape input Grappler only folded to its constant (the offline run knows the
        # stage's input shapes) runs the same kernel on the same values: a gate may read it.
        stage_ir = dataclasses.replace(stage_ir, grappler_rewritten=grappler_rewritten_ops(
            graph, device, CPU_GRAPPLER_MEMORY_BYTES if cpu else cost.device.memory_bytes, outputs=self._returned,
            folded_shapes_unchanged=True))
        plain = replay()
        unplanned = dataclasses.replace(rule, decisions=tuple(
            d if d.decision is Decision.KEEP else d.kept("kept: the stage fits its budget without swapping it")
            for d in rule.decisions))
        plan, reached = unplanned, plain
        if plain > budget:
            plan, reached = self._fit_replay(k, ir, stage_ir, replay, budget, device, cost, unplaced) or (
                unplanned, plain)
            if reached > budget and creates_variables(graph):
                # The trace that creates the optimizer's variables runs at most once (only if
                # TensorFlow cannot lift their initializers out of it): the budget is held on
                # the next trace, which every step runs; this one gets its closest plan.
                logger.info("PipelineStep: stage %d of the step's first trace (which creates variables) reaches %s "
                            "at least, more than its budget %s: given its closest plan; the budget is held on the "
                            "next trace", k, format_bytes(min(plain, reached)), format_bytes(budget))
            elif reached > budget:
                ways = "swapping or recomputing" if self._tensor_recompute else "swapping"
                hint = "" if self._tensor_recompute else ", let it recompute tensors too (recompute='auto')"
                least = min(plain, reached)
                how = (f"with its closest plan, {plan.one_line()}; {format_bytes(plain)} without one"
                       if reached < plain else "without a plan: no plan the planner finds lowers it")
                raise infeasible(
                    f"PipelineStep(budget=...): stage {k} does not fit {format_bytes(budget)}: lms-tf's budget planner "
                    f"finds no plan {ways} its tensors that lms-tf's simulator replays within it (weights and slots "
                    f"included). The least it reaches is {format_bytes(least)} ({how}). Give stage {k} at least "
                    f"{format_bytes(least)}, cut the model into more stages{hint}, or use fewer micro-batches in "
                    f"flight.", budget, least)
        logger.info("PipelineStep: stage %d planned for %s: %s; replayed peak %s (%s without it)", k,
                    format_bytes(budget), plan.one_line(), format_bytes(reached), format_bytes(plain))
        predictions = plan.predictions if plan.predictions is not None else Predictions()
        return dataclasses.replace(plan, budget_bytes=budget, device_spec=f"pipeline stage {k} ({self._presets[k].name})",
                                   predictions=dataclasses.replace(predictions, baseline_peak_bytes=plain,
                                                                   planned_peak_bytes=reached, feasible=reached <= budget))

    def _fit_replay(self, k: int, ir, stage_ir, replay, budget: int, device: str, cost: CostModel,
                    unplaced: FrozenSet[str]) -> Optional[Tuple[Plan, int]]:
        """The budget planner's plan for stage ``k`` with the least predicted slowdown whose replay
        fits ``budget``: the plan and its replayed peak, or the plan that replayed lowest when
        none fits (None when the planner finds no plan at all).

        The planner counts the stage its own way (its order among ready ops, the allocator of the
        device preset, no weights), so it is asked for a ladder of budgets in its own count, from
        the stage's plain peak down to the least it can reach, and each plan is replayed. The
        ladder does not depend on ``budget``: the least the error names is a budget that is met.
        A higher rung moves less, so the first rung whose replay fits is taken.
        """
        tried: Dict[int, object] = {}   # target -> its plan, or the planner's error (rungs often repeat the floor)

        def plan_for(target: int) -> Plan:
            if target not in tried:
                try:
                    tried[target] = stage_plan(self._budget_plan(stage_ir, k, target, device, cost), ir, device,
                                               unplaced)
                except InfeasibleBudgetError as err:
                    tried[target] = err
            if isinstance(tried[target], InfeasibleBudgetError):
                raise tried[target]
            return tried[target]

        top = self._budget_plan(stage_ir, k, 1 << 62, device, cost).predictions.baseline_peak_bytes
        try:
            plan_for(1)
            floor = 1
        except InfeasibleBudgetError as err:
            floor = err.smallest_feasible_bytes
        best: Optional[Tuple[Plan, int]] = None
        for rung in range(_LADDER_RUNGS - 1, -1, -1):
            target = floor + (top - floor) * rung // _LADDER_RUNGS
            try:
                plan = plan_for(target)
            except InfeasibleBudgetError as err:  # its least is "about": aim at what it says instead
                try:
                    plan = plan_for(err.smallest_feasible_bytes)
                except InfeasibleBudgetError:
                    continue
            reached = replay(plan)
            if best is None or reached < best[1]:
                best = (plan, reached)
            if reached <= budget:
                return plan, reached
        return best

    def _budget_plan(self, stage_ir, k: int, target: int, device: str, cost: CostModel) -> Plan:
        """lms-tf's budget planner on stage ``k``'s view, its activations held to ``target`` bytes."""
        policies = Policies(budget=max(target, 1), host=self.hosts[k], min_swap_bytes=self._min_swap_bytes,
                            recompute=self._tensor_recompute or False)
        return make_budget_plan(stage_ir, policies, device=device, cost=cost)

    def _forward_again(self, k: int, m: int, inputs, labels, previous, label, recorded, scopes: Dict[int, str]):
        """Stage ``k``'s forward pass of micro-batch ``m`` run again from its inputs, under a new
        tape, when its backward task starts (GPipe's re-materialization): the tape, inputs,
        outputs and loss (last stage) its backward pass takes, or ``recorded`` (the first pass's)
        when the stage cannot run again to the same numbers. ``scopes`` holds each micro-batch's
        scope for the second passes, entered again by its full name as the forward passes' is.

        The second pass waits for the stage's previous task through the same kept Identities as
        every task, and runs in ``rematerialized/microbatch<m>/`` (one scope for every stage; not
        ``recompute/``, which names lms-tf's recompute clones to the simulator): its gradient ops sort among
        themselves by name as the first pass's would (Grappler orders an AddN's inputs by name).
        Its variable updates are dropped (Keras's ``StatelessScope``), so a BatchNormalization's
        moving statistics move once per micro-batch. A pass that draws random numbers (dropout,
        noise) would draw others the second time: the stage then keeps its activations instead,
        with a warning."""
        stage = self.stages[k]
        input_keys = set(self._input_keys)
        with tf.name_scope(scopes.get(m, f"rematerialized/{microbatch_scope(m, self.microbatches)}")) as scope_name:
            scopes.setdefault(m, scope_name)  # every stage's second pass of micro-batch m in one scope
            with tf.GradientTape() as tape:
                again = _gated(list(inputs), previous[k], label)
                tape.watch([t for key, t in zip(stage.inputs, again) if key not in input_keys])

                def run():
                    outputs = stage(again, training=True)
                    loss = (self.loss_fn(labels, outputs[0] if len(outputs) == 1 else outputs)
                            if k == len(self.stages) - 1 else None)
                    return outputs, loss

                (outputs, loss), drew = _compat.run_again_without_updates(
                    run, [op for op in map(self._operations.get, stage.layers) if isinstance(op, keras.layers.Layer)])
        if drew is None:
            return tape, again, outputs, loss
        self.recompute_stages.remove(k)
        warn_once(f"pipeline-recompute-random-{id(self)}-{k}",
                  f"PipelineStep(recompute=...): stage {k} keeps its activations instead of running its forward pass "
                  f"again: {drew} draws random numbers, and a second pass would draw others (the numbers would "
                  f"change). The step trains as without recompute on that stage; recompute only stages without "
                  f"dropout or noise layers (recompute=[...]).")
        return recorded

    def _run(self, x, y):
        input_keys = set(self._input_keys)
        splits = [_split(t, self.microbatches, "input") for t in _compat.flat_model_inputs(self._graph, x)]
        ys = _split(y, self.microbatches, "label")
        last = len(self.stages) - 1
        values: List[Dict[str, tf.Tensor]] = [{key: parts[m] for key, parts in zip(self._input_keys, splits)}
                                              for m in range(self.microbatches)]
        grads_in: List[Dict[str, List[tf.Tensor]]] = [{} for _ in range(self.microbatches)]
        tapes: Dict[Tuple[int, int], Tuple[tf.GradientTape, list, list]] = {}
        losses: Dict[int, tf.Tensor] = {}
        previous: List[list] = [[] for _ in self.stages]  # each stage's last task's done op: the next one waits
        variables = [[v for name in stage.layers for v in getattr(self._operations[name], "trainable_variables", ())]
                     for stage in self.stages]
        accumulated: List[Optional[list]] = [None for _ in self.stages]
        self._running_sums = []
        scopes: Dict[int, str] = {}
        recompute_scopes: Dict[int, str] = {}
        for task in self.order:
            stage, m = self.stages[task.stage], task.microbatch
            label = f"stage{task.stage}_{task}"
            # Names decide sums: Grappler orders an AddN's inputs by name, and the tape names the
            # sums of a tensor's gradients after the scope it runs in. So every stage's forward
            # pass of micro-batch m runs in one shared scope (its gradient ops are then named
            # gradient_tape/microbatch<m>/<layer>/..., ordered by layer as on one device), and a
            # backward pass runs at the top, as one device's does.
            if task.kind == FORWARD:
                scope = tf.name_scope(scopes.get(m, microbatch_scope(m, self.microbatches)))
            else:
                scope = contextlib.nullcontext()
            with tf.device(self.devices[task.stage]), scope as scope_name:
                if task.kind == FORWARD:
                    scopes.setdefault(m, scope_name)  # "microbatch<m>/": entered again as it is
                if task.kind == FORWARD:
                    with tf.GradientTape() as tape:
                        inputs = _gated([values[m][key] for key in stage.inputs], previous[task.stage], label)
                        tape.watch([t for key, t in zip(stage.inputs, inputs) if key not in input_keys])
                        outputs = stage(inputs, training=True)
                        if task.stage == last:
                            losses[m] = self.loss_fn(ys[m], outputs[0] if len(outputs) == 1 else outputs)
                    for key, value in zip(stage.outputs, outputs):
                        values[m][key] = value
                    tapes[(task.stage, m)] = (tape, inputs, outputs)
                    previous[task.stage] = _done([], label, sent=outputs + ([losses[m]] if task.stage == last else []))
                else:
                    tape, inputs, outputs = tapes.pop((task.stage, m))
                    loss = losses.get(m)
                    if task.stage in self.recompute_stages:
                        tape, inputs, outputs, loss = self._forward_again(
                            task.stage, m, inputs, ys[m], previous, label, (tape, inputs, outputs, loss),
                            recompute_scopes)
                    sources = [t for key, t in zip(stage.inputs, inputs) if key not in input_keys]
                    source_keys = [key for key in stage.inputs if key not in input_keys]
                    if task.stage == last:  # the seed TensorFlow would use, gated like the others
                        target, seeds = [loss], [tf.ones_like(loss)]
                    else:
                        target = outputs
                        seeds = [_summed(grads_in[m].get(key), out) for key, out in zip(stage.outputs, outputs)]
                    grads = tape.gradient(target, sources + variables[task.stage],
                                          output_gradients=_gated(seeds, previous[task.stage], label),
                                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    for key, g in zip(source_keys, grads[:len(sources)]):
                        grads_in[m].setdefault(key, []).append(g)
                    weight_grads = grads[len(sources):]
                    first = accumulated[task.stage] is None
                    accumulated[task.stage] = _accumulate(accumulated[task.stage], weight_grads)
                    if not first:
                        self._running_sums += [t.op.name for t in accumulated[task.stage]]
                    previous[task.stage] = _done(list(accumulated[task.stage]), label, sent=grads[:len(sources)])
        # One update for all stages' weights, in the model's order: the optimizer counts one
        # iteration per step (Adam's bias correction reads it), as the single-device step does.
        # Each weight's share of it (the mean of its gradients, the optimizer's arithmetic) runs
        # where the weight and its gradients are: unplaced, it would run on the default device,
        # and every stage's gradients would travel to stage 0 and be updated there.
        by_variable = {id(v): g for stage_vars, grads in zip(variables, accumulated) for v, g in zip(stage_vars, grads or ())}
        weights = self.model.trainable_variables
        graph = _compat.current_graph()
        update_starts = len(graph.get_operations())
        # The mean goes beside the weight, where the update's first product runs: Grappler folds
        # the two on one device (constant push-down), and only folds ops on the same device.
        means = []
        for v in weights:
            with tf.device(variable_device(v)):
                means += _mean_of([by_variable[id(v)]], self.microbatches)
        with _compat.place_with_inputs(graph):
            self.optimizer.apply_gradients(zip(means, weights))
        # Keras passes all gradients through one IdentityN (its default strategy's all-reduce),
        # which Grappler prunes on one device. Across devices it would stay: every stage's update
        # would wait for all stages' gradients, and the fold above would not happen (the update
        # would round differently). Its readers read its inputs instead.
        bypass_identity_n(graph)
        mean = tf.add_n([losses[m] for m in range(self.microbatches)]) / self.microbatches
        # What the step returns: the runtime keeps it and the stateful ops and prunes every other
        # dead end, so the offline Grappler runs that find the ops it rewrites are given it.
        self._returned = [mean]
        if self.swap_stages:
            self.plans = rewrite_traced_stages(
                [RewriteRequest(Policies(host=self.hosts[k], min_swap_bytes=self._min_swap_bytes),
                                _full_device(self.devices[k])) for k in self.swap_stages],
                api="PipelineStep",
                refine=(lambda i, ir, plan: self._hold_to_budget(self.swap_stages[i], ir, plan)) if self.budgets
                else None)
        if self.serialize:
            # The update is left free: a control edge on its first product would stop the fold
            # above (the numbers would change). It runs after every task anyway.
            serialize_stages(self.devices, _schedule_ranks(graph, self._running_sums),
                             leave_free=[op.name for op in graph.get_operations()[update_starts:]], api="PipelineStep",
                             outputs=self._returned)
        return mean


def _stage_of(op, ir, device_of: Dict[str, str], devices: Sequence[str]) -> int:
    """The stage whose process runs ``op``: the one whose device it is placed on. An op placed
    nowhere (a variable's read, colocated with the variable; the split of the batch) runs with
    its readers when they are all one stage's, else where the step is called (stage 0)."""
    def stage_on(device: str) -> Optional[int]:
        return next((k for k, d in enumerate(devices) if device and same_device(device, d)), None)

    placed = stage_on(device_of.get(op.name, ""))
    if placed is not None:
        return placed
    readers = {device_of.get(c, "") for t in op.outputs for c in ir.tensors[t].consumers}
    by_readers = stage_on(readers.pop()) if len(readers) == 1 else None
    return 0 if by_readers is None else by_readers


def _sent_when_made(ir, mine) -> "GraphIR":
    """``ir`` with every tensor of the stage (ops ``mine``) that another stage reads handed to a
    send op of its own, ranked right after the tensor's producer, and the other stages' readers
    reading the send's output instead: across processes TensorFlow sends a tensor as soon as it
    is made (the receiving task's receive waits from the step's start), so the sending stage
    frees it then, unless its own ops still read it. The sends are host-placed (their outputs are
    the other process's memory)."""
    ops, tensors, renamed, sends = [], dict(ir.tensors), {}, set()
    for op in ir.ops:
        ops.append(op)
        if op.name not in mine:
            continue
        for t in op.outputs:
            info = ir.tensors[t]
            away = tuple(c for c in info.consumers if c not in mine)
            if not away:
                continue
            send = f"lms_tf_stage_send/{t.replace(':', '_')}"
            sent = f"{send}:0"
            ops.append(dataclasses.replace(op, name=send, type="_Send", inputs=(t,), control_inputs=(), outputs=(sent,),
                                           stateful=False, inner_kernels=0))
            tensors[sent] = dataclasses.replace(info, name=sent, producer=send, consumers=away)
            tensors[t] = dataclasses.replace(info, consumers=tuple(c for c in info.consumers if c in mine) + (send,))
            sends.add(send)
            for reader in away:
                renamed.setdefault(reader, {})[t] = sent
    if not sends:
        return ir
    ops = [dataclasses.replace(o, index=i, inputs=tuple(renamed.get(o.name, {}).get(t, t) for t in o.inputs))
           for i, o in enumerate(ops)]
    return dataclasses.replace(ir, ops=tuple(ops), tensors=tensors, host_placed=ir.host_placed | sends)


def _sends_overlap_next_op(stage_ir, ranks: Dict[str, float], mine) -> Dict[str, float]:
    """``ranks`` with each send of :func:`_sent_when_made` ranked right after the sending stage's
    next op (its first op ranked after the sent tensor's producer), so the stage holds the sent
    tensor while that op runs. TensorFlow's gRPC worker writes a large tensor to the other process
    from the sender's own buffer and releases it when the write is done, which the stage's next op
    overlaps: a stage process measured holding its last sent input gradient through the filter
    gradient that follows it, at that op's peak (``docs/pipeline.md``)."""
    own = sorted(ranks[name] for name in mine if name in ranks)
    ranked = dict(ranks)
    for op in stage_ir.ops:
        if op.type != "_Send":  # a traced step has none of its own: TensorFlow adds them when it partitions
            continue
        made = ranks.get(stage_ir.tensors[op.inputs[0]].producer)
        if made is None:
            continue
        after = bisect.bisect_right(own, made)
        if after < len(own):
            ranked[op.name] = own[after] + 1e-6
    return ranked


def _schedule_ranks(graph, running_sums: Sequence[str]) -> Dict[str, float]:
    """Op name -> rank in the order a stage runs: the order the step created its ops (the
    schedule's), except that each running sum of a weight's gradient comes right after that
    gradient. The tape builds a stage's every weight gradient of a micro-batch before the sums
    are added, so in creation order a stage would hold its weights' gradients twice over; summed
    at once, the previous sum is freed as each gradient arrives.

    Examples:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     grad = tf.negative(b, name="grad")
        ...     other = tf.square(b, name="other")
        ...     total = tf.add(a, grad, name="sum")
        >>> sorted(_schedule_ranks(g, ["sum"]).items(), key=lambda kv: kv[1])[2:]
        [('grad', 2.0), ('sum', 2.5), ('other', 3.0)]
    """
    rank = {op.name: float(i) for i, op in enumerate(graph.get_operations())}
    for name in running_sums:  # in creation order: a sum's previous sum is ranked already
        op = graph.get_operation_by_name(name)
        rank[name] = max(rank[t.op.name] for t in op.inputs) + 0.5
    # lms-tf's swap ops are created after the whole step, but TensorFlow runs each as soon as it
    # is ready (a copy out right after its tensor is made, a copy in right after its gate):
    # ranked by creation they would wait behind every compute op.
    for op in graph.get_operations():
        if LMS_ATTR in op.node_def.attr:
            waits_for = [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs]
            rank[op.name] = max((rank[n] for n in waits_for), default=rank[op.name]) + 0.25
    return rank


def _in_cluster(device: str) -> bool:
    """Whether ``device`` is a cluster task's (it names a job), not one of this process's own."""
    return tf.DeviceSpec.from_string(device).job is not None


def _full_device(device: str) -> str:
    """A stage's device for the driver: a cluster task's as it is (its task tells the stages
    apart), one of this process's checked and canonical."""
    return device if _in_cluster(device) else resolve_device(device, api="PipelineStep")


def _same_task(a: str, b: str) -> bool:
    """Whether two cluster devices belong to one process (same job, replica and task)."""
    sa, sb = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (sa.job, sa.replica or 0, sa.task or 0) == (sb.job, sb.replica or 0, sb.task or 0)


def _stage_hosts(host: Optional[str], devices: Sequence[str], swap_stages: Sequence[int]) -> Dict[int, str]:
    """Each swapping stage's host: ``host`` itself in one process; in a cluster, the device
    ``host`` names (a type and index) in the stage's own process, so each stage swaps to its own
    host memory.

    Raises:
        LMSOptionError: No host, a host with a job or task in a cluster, a host no process has, or
            a host that is the stage's own device (swapping there would move nothing).
    """
    if host is None:
        raise LMSOptionError(f"swap: stages {list(swap_stages)} swap activations, so host= must name where they "
                             f"go (a device such as '/CPU:0'); received host=None.")
    cluster = any(_in_cluster(d) for d in devices)
    if not cluster:
        hosts = {k: check_visible(host, role="host", api="PipelineStep") for k in swap_stages}
    else:
        wanted = tf.DeviceSpec.from_string(host)
        if wanted.job is not None or wanted.task is not None or wanted.replica is not None:
            raise LMSOptionError(f"swap: in a cluster each stage swaps to a device of its own process, so host= "
                                 f"names a device type and index only (such as '/CPU:0'); received host={host!r}.")
        known = [d.name for d in tf.config.list_logical_devices()]
        hosts = {}
        for k in swap_stages:
            stage = tf.DeviceSpec.from_string(devices[k])
            hosts[k] = stage.replace(device_type=wanted.device_type, device_index=wanted.device_index or 0).to_string()
            if not any(_same_task(name, hosts[k]) and same_device(name, hosts[k]) for name in known):
                mine = [n for n in known if _same_task(n, devices[k])]
                has = (f"it has {', '.join(mine)}" if mine else
                       "none of its devices is known here: connect with lms_tf.connect_stages() first")
                raise LMSOptionError(
                    f"swap: stage {k}'s process has no {canonical_device(host)} ({has}). "
                    f"Name one of its devices; on CPU-only stage servers, give each process two logical CPUs "
                    f"(lms-tf launch --logical-cpus 2) and pass host='/CPU:1'.")
    for k, stage_host in hosts.items():
        if same_device(stage_host, devices[k]):
            raise LMSOptionError(
                f"swap: stage {k} runs on {devices[k]}, the host= it would swap to ({host!r}), so swapping would move "
                f"nothing. Name another device: the CPU of a GPU stage, or on a CPU a second logical device "
                f"(host='/CPU:1' with two logical CPUs).")
    return hosts


def _on_cpu(device: str) -> bool:
    """Whether ``device`` is a CPU (a device named without a type counts as one, as TensorFlow places it)."""
    return (tf.DeviceSpec.from_string(device).device_type or "CPU").upper() == "CPU"


def _partition_budgets(budget, stages, swap_stages: Sequence[int]):
    """``budget="partition"`` as one entry per stage: for each swapping stage, the limit the
    partition cut it for (its device's memory, or the partition's budget where that is lower);
    None for the others. Any other ``budget`` (or no stage swapping) as it is.

    Raises:
        LMSOptionError: ``"partition"`` with stages cut by hand, or with a partition that had no
            device and no budget to cut for.
    """
    if not (isinstance(budget, str) and budget == "partition") or not swap_stages:
        return budget
    if not _is_partition(stages):
        raise LMSOptionError("budget='partition' holds each stage to the limit lms_tf.partition cut it for, but the "
                             "stages were cut by hand; pass the Partition itself as stages, or the budgets in bytes.")
    limits = [min([c for c in (s.capacity_bytes, stages.budget_bytes) if c is not None], default=None)
              for s in stages.stages]
    if all(limit is None for limit in limits):
        raise LMSOptionError("budget='partition': the partition was cut with no devices and no budget, so it has no "
                             "limit to hold a stage to; partition with devices= or budget=, or pass budgets in bytes.")
    return [limit if k in swap_stages else None for k, limit in enumerate(limits)]


def _stage_budgets(budget, swap_stages: Sequence[int], count: int) -> Dict[int, int]:
    """Each budgeted stage's budget in bytes, by stage: ``budget`` (see :class:`PipelineStep`) checked.

    Raises:
        LMSOptionError: A budget with no stage swapping, a list that is not one entry per stage,
            an entry that is not a size, or one given to a stage that does not swap.
    """
    if budget is None:
        return {}
    if not swap_stages:
        raise LMSOptionError(f"budget= holds swapping stages to a memory budget, but no stage swaps; pass swap=True "
                             f"(or a list of stages) with it, or drop budget=. Received budget={budget!r}.")
    listed = isinstance(budget, (list, tuple))
    if listed and len(budget) != count:
        raise LMSOptionError(f"budget= as a list needs one entry per stage ({count}, None for a stage swapping by "
                             f"the rule alone); received {len(budget)}: {budget!r}.")
    budgets = {}
    for k, entry in enumerate(budget if listed else [budget] * count):
        if entry is None or (not listed and k not in swap_stages):
            continue
        nbytes = parse_bytes(entry)
        if nbytes is None or isinstance(entry, bool):
            raise LMSOptionError(f"budget= for stage {k} must be bytes or a size such as '12GiB'; received "
                                 f"{describe(entry)}.")
        if k not in swap_stages:
            raise LMSOptionError(f"budget= gives stage {k} {format_bytes(nbytes)}, but stage {k} does not swap "
                                 f"(swapping stages: {list(swap_stages)}); give it None, or let it swap.")
        budgets[k] = nbytes
    return budgets


def _stage_presets(device_spec, stages, count: int) -> list:
    """Each stage's device preset for the budget planner's cost model: ``device_spec`` (one for
    every stage, or a list with one per stage), else the device the partition cut the stage for,
    else :data:`_TIMING_PRESET`.

    Raises:
        LMSOptionError: An unknown preset, or a list that is not one per stage.
    """
    if isinstance(device_spec, (list, tuple)):
        if len(device_spec) != count:
            raise LMSOptionError(f"device_spec= as a list needs one preset per stage ({count}); received "
                                 f"{len(device_spec)}: {device_spec!r}.")
        return [get_device_spec(spec) for spec in device_spec]
    if device_spec is not None:
        return [get_device_spec(device_spec)] * count
    cut_for = [s.device for s in stages.stages] if _is_partition(stages) else [None] * count
    return [get_device_spec(spec or _TIMING_PRESET) for spec in cut_for]


def _chosen_stages(chosen, stages, count: int, what: str) -> List[int]:
    """The stages ``chosen`` names for ``what`` (``"swap"`` or ``"recompute"``): True is the stages
    the partition says do it (``host_bytes > 0``, ``recompute``), or every stage of a hand cut of
    ``count``; False none; else a list of stage indices."""
    if chosen is False or chosen is None:
        return []
    if chosen is True:
        if not _is_partition(stages):
            return list(range(count))
        return [s.index for s in stages.stages if (s.host_bytes if what == "swap" else s.recompute)]
    if isinstance(chosen, (list, tuple)) and all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < count
                                                 for k in chosen):
        return sorted(set(chosen))
    policies = " or a recompute policy for the budget planner ('auto', 'cheap', 'sqrt')" if what == "recompute" else ""
    raise LMSOptionError(f"{what} must be True, False, a list of stage indices (0 to {count - 1}){policies}; "
                         f"received {describe(chosen)}.")


def _done(results: List[tf.Tensor], task: str, sent: Sequence[tf.Tensor] = ()) -> List[tf.Operation]:
    """One op, ``<task>_done``, that runs when every result of a task is computed: what the
    stage's next task waits for (on the same device).

    ``sent`` (what the task hands to other stages, and the loss) is waited for through
    Identities, not by a control edge from the op that makes it: Grappler's arithmetic optimizer
    leaves an op that drives a control edge as it is (it would not regroup a LayerNorm's
    ``x * inv + (beta - mean * inv)`` rooted there), and in the single-device step nothing waits
    on these tensors, so an edge on them would round differently. ``results`` (the running sums
    of gradients) are waited for directly, as the single-device step waits for its own."""
    watched = list(results)
    for t in sent:
        with tf.name_scope(t.op.name + "/"):
            watched.append(tf.identity(t, name="pipeline_sent"))
    with tf.control_dependencies(watched):
        return [tf.no_op(name=f"{task}_done")]


def _gated(tensors: List[tf.Tensor], after: List[tf.Operation], task: str) -> List[tf.Tensor]:
    """``tensors`` through Identities that wait for ``after`` (the stage's previous task): the
    schedule's order on a stage. The control edge goes into a kept Identity, never into the
    stage's own ops: Grappler's remapper does not fuse an op with a control input (MatMul +
    BiasAdd + activation), and an unfused op rounds differently from the single-device step.
    Each Identity is named after the tensor it passes on (so an AddN sorts it where it sorts
    that tensor) and carries its task in ``_lms_task``."""
    if not after:
        return list(tensors)
    gated = []
    with tf.control_dependencies(after):
        for t in tensors:
            with tf.name_scope(t.op.name + "/"):
                gated.append(tf.identity(t, name="pipeline_gate"))
    for t in gated:
        mark(t.op, "pipeline_gate")
        _compat.set_string_attr(t.op, TASK_ATTR, task)
    return gated


def _summed(contributions: Optional[List[tf.Tensor]], like: tf.Tensor) -> tf.Tensor:
    """A stage output's gradient: the sum of what the later stages reading it sent back (zero if none)."""
    if not contributions:
        return tf.zeros_like(like)
    return contributions[0] if len(contributions) == 1 else tf.add_n(contributions)
