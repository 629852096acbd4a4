"""Per-layer memory and time of a training step, read off its IR: what pipeline partitioning balances.

No profiling run: every figure comes from the traced step's IR (tensor sizes) and the cost model
(op times), at the micro-batch size the step was traced at. A layer is a top-level name scope of
the model (a Keras layer); the step's ops are grouped into layers and the layers kept in the
order their first forward op runs (a topological order of the layer graph, branches included).

Per layer:

* ``params``: the variables its forward ops read, ``(handle, bytes)``; a weight shared by two
  layers is listed by both, and a stage holding both counts it once.
* ``saved``: the forward tensors its backward ops read, ``(tensor, bytes)``, whichever layer
  produced them: a skip connection read by a later layer's backward is kept by that layer (and,
  once cut, by the stage it falls in). A stage keeps one copy of each per micro-batch in flight.
* ``work_bytes``: the largest transient set of one of its ops (inputs from other layers that it
  does not keep, plus outputs; gradients flowing through its backward ops), plus the scratch
  its kernel takes from the allocator while it runs (a convolution's cuDNN workspace; on a CPU
  without oneDNN, Eigen's ~30 MiB im2col buffer of a filter gradient), as the simulator counts it.
* ``pinned``: those of its ``saved`` tensors lms-tf's planner may not move off the device (the
  step's own inputs, a constant factor Grappler folds into a backward op, a value two identical
  backward ops read: see :func:`lms_tf.planner.candidates.collect_candidates`). A stage that swaps
  keeps these for every micro-batch in flight.
* ``inputs``: the forward tensors it reads from earlier layers, ``(tensor, bytes, producer
  layer index)``: what a pipeline cut before it sends forward (and its gradient back).
* ``forward_s`` / ``backward_s``: predicted compute time per micro-batch; ``update_s``: the
  optimizer's update, once per step.

Examples:
    >>> from lms_tf.core.examples import chain_ir
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> profile = profile_layers(chain_ir(), CostModel(get_device_spec("v100-16gb-pcie3")))
    >>> [layer.name for layer in profile.layers]
    ['a', 'b', 'c', 'loss']
    >>> [sum(b for _, b in layer.saved) // 2**20 for layer in profile.layers]
    [4, 4, 0, 4]
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import GraphIR, Phase, layer_of
from lms_tf.core.policy import Policies
from lms_tf.cost.model import CostModel
from lms_tf.planner.candidates import collect_candidates
from lms_tf.simulate import kernel_scratch_bytes, resident_buffers

#: Op types whose outputs are the variables themselves, not activations.
_VARIABLE_READS = frozenset({"ReadVariableOp", "ResourceGather"})
#: Op types that produce no memory worth balancing (constants, shapes, the step's inputs).
_NO_MEMORY = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank", "Placeholder", "NoOp"})
#: Updates that write a variable through its handle (the optimizer's last op on a weight).
_VARIABLE_WRITES = frozenset({"AssignSubVariableOp", "AssignAddVariableOp", "AssignVariableOp",
                              "ResourceApplyGradientDescent", "ResourceApplyAdam", "ResourceApplyKerasMomentum"})


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """What one layer costs per micro-batch (see the module docstring for each field).

    Examples:
        >>> LayerProfile("dense", params=(("w", 64),), saved=(("x:0", 32),), work_bytes=96).param_bytes
        64
    """

    name: str
    params: Tuple[Tuple[str, int], ...] = ()
    saved: Tuple[Tuple[str, int], ...] = ()
    work_bytes: int = 0
    inputs: Tuple[Tuple[str, int, int], ...] = ()
    forward_s: float = 0.0
    backward_s: float = 0.0
    update_s: float = 0.0
    pinned: Tuple[str, ...] = ()

    @property
    def param_bytes(self) -> int:
        """Bytes of the variables the layer reads.

        Examples:
            >>> LayerProfile("d", params=(("w", 8), ("b", 4))).param_bytes
            12
        """
        return sum(nbytes for _, nbytes in self.params)


@dataclasses.dataclass(frozen=True)
class PipelineProfile:
    """The layers of one step in order, and what the optimizer keeps per weight byte.

    Attributes:
        layers: One :class:`LayerProfile` per layer, in forward order.
        slot_bytes_per_param_byte: Optimizer state per byte of weights (plain SGD 0, momentum 1,
            Adam 2): the step's variables other than the layers' weights, over the weights.
        microbatch: The batch size the step was traced at (one micro-batch), if known.

    Examples:
        >>> PipelineProfile((LayerProfile("a"),), 2.0).slot_bytes_per_param_byte
        2.0
    """

    layers: Tuple[LayerProfile, ...]
    slot_bytes_per_param_byte: float = 0.0
    microbatch: Optional[int] = None

    @classmethod
    def chain(cls, activation_bytes: Sequence[int], param_bytes: Sequence[int] = (), *, work_bytes: int = 0,
              seconds: float = 1e-3, slot_bytes_per_param_byte: float = 0.0) -> "PipelineProfile":
        """A chain of layers of known sizes: layer ``i`` keeps ``activation_bytes[i]`` per micro-batch
        (its input, sent to it by layer ``i - 1``) and holds ``param_bytes[i]`` of weights. For
        examples, tests and what-if questions.

        Examples:
            >>> p = PipelineProfile.chain([100, 200], [10, 20])
            >>> [(l.name, l.param_bytes, l.saved) for l in p.layers]
            [('layer0', 10, (('layer0:in', 100),)), ('layer1', 20, (('layer1:in', 200),))]
        """
        params = list(param_bytes) or [0] * len(activation_bytes)
        layers = []
        for i, (act, par) in enumerate(zip(activation_bytes, params)):
            inputs = ((f"layer{i}:in", act, i - 1),) if i else ()
            layers.append(LayerProfile(
                f"layer{i}", params=((f"layer{i}/w", par),) if par else (), saved=((f"layer{i}:in", act),),
                work_bytes=work_bytes, inputs=inputs, forward_s=seconds, backward_s=2 * seconds))
        return cls(tuple(layers), slot_bytes_per_param_byte)


def _model_scope(ir: GraphIR, layer_scopes: Optional[Mapping[str, str]] = None) -> str:
    """The name scope the model's ops sit under: the one holding the most ops of the given layer
    scopes; without those, where most forward variable reads are (an optimizer's reads can
    outnumber them: with layer scopes they do not count), else most forward ops named
    ``model/layer/op``; empty when ops carry no such scope."""
    scopes_of_layers = set((layer_scopes or {}).values())
    wanted_rules = [lambda op: op.name.split("/")[1] in scopes_of_layers] if scopes_of_layers else []
    wanted_rules += [lambda op: op.type in _VARIABLE_READS, lambda op: op.name.count("/") >= 2]
    for wanted in wanted_rules:
        scopes = Counter(op.name.split("/")[0] for op in ir.ops
                         if op.phase is Phase.FORWARD and "/" in op.name and wanted(op))
        if scopes:
            return scopes.most_common(1)[0][0]
    return ""


def layer_keys(ir: GraphIR, layer_scopes: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Each op's layer: its name scope under the model's, by layer name, for the ops that have one.

    Args:
        ir: The step's IR.
        layer_scopes: Layer name -> its name scope in the trace (Keras uniquifies scopes,
            ``conv1`` -> ``conv1_1``); without it, the scopes themselves name the layers.

    Examples:
        >>> from lms_tf.core import make_ir
        >>> ir = make_ir([dict(name="m/d/MatMul", type="MatMul", outputs=[("m/d/MatMul:0", (2,))])])
        >>> layer_keys(ir, {"d": "d"})
        {'m/d/MatMul': 'd'}
    """
    model = _model_scope(ir, layer_scopes)
    by_scope = {scope: name for name, scope in (layer_scopes or {}).items()}
    keys: Dict[str, str] = {}
    for op in ir.ops:
        parts = layer_of(op.name).split("/")  # its name scopes, gradient scopes left out
        if len(parts) < 2 and not (model == "" and parts[0]):
            continue
        if model and parts[0] != model:
            continue
        scope = parts[1] if model else parts[0]
        if layer_scopes is None:
            keys[op.name] = scope
        elif scope in by_scope:
            keys[op.name] = by_scope[scope]
    if not model and not keys:  # ops named by layer alone (hand-made IRs): each op is its layer
        keys = {op.name: op.name for op in ir.ops if op.phase is Phase.FORWARD and op.type not in _NO_MEMORY}
    return keys


def profile_layers(ir: GraphIR, cost: CostModel, *, layer_scopes: Optional[Mapping[str, str]] = None,
                   microbatch: Optional[int] = None, kernels: str = "cudnn") -> PipelineProfile:
    """Groups the step's ops into layers and measures each layer's memory and time (no run).

    Ops outside every layer go where they run: the loss (forward ops after the model) with the
    last layer, a backward op with the layer whose backward reads its output (a gradient sum
    with the layer it feeds), an update with the layer whose variable it writes, the rest of
    the optimizer's ops spread over the layers by weight bytes.

    Args:
        ir: The step's IR, traced at one micro-batch.
        cost: The cost model of the device planned for (op times).
        layer_scopes: Layer name -> name scope in the trace (``lms_tf._compat`` reads it off a
            Keras model); without it, scopes under the model's are the layers.
        microbatch: The batch size the step was traced at, recorded in the profile.
        kernels: The kernel library whose scratch each op's working set includes (see
            :data:`lms_tf.simulate.KERNEL_LIBRARIES`): ``"cudnn"`` on a GPU, ``"eigen"`` or
            ``"onednn"`` on a CPU.

    Returns:
        The :class:`PipelineProfile`.

    Raises:
        LMSOptionError: No op of the step could be placed in a layer.

    Examples:
        >>> from lms_tf.core.examples import chain_ir
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> p = profile_layers(chain_ir(), CostModel(get_device_spec("v100-16gb-pcie3")))
        >>> [(l.name, [t for t, _, _ in l.inputs]) for l in p.layers]
        [('a', []), ('b', ['a:0']), ('c', ['b:0']), ('loss', ['c:0'])]
    """
    keys = layer_keys(ir, layer_scopes)
    order: List[str] = []
    for op in ir.ops:
        if op.phase is Phase.FORWARD and op.name in keys and keys[op.name] not in order:
            order.append(keys[op.name])
    if not order:
        raise LMSOptionError("cannot partition this step: none of its forward ops lies in a layer's name scope "
                             f"(first ops: {[op.name for op in ir.ops[:3]]}). Pass a Keras model, or name the ops "
                             "model/layer/op.")
    index = {name: i for i, name in enumerate(order)}
    last = order[-1]
    producer_layer: Dict[str, str] = {}
    layer_of_op: Dict[str, str] = {}
    # Forward: in a layer's scope, else with the layer before it (the loss, after the model,
    # with the last layer; the step's inputs with the first).
    current = order[0]
    for op in ir.ops:
        if op.phase is Phase.FORWARD:
            current = keys.get(op.name, current)
            layer_of_op[op.name] = current
    # Handles read in the forward pass belong to the layer reading them.
    handle_layer: Dict[str, str] = {}
    params: Dict[str, Dict[str, int]] = defaultdict(dict)
    for op in ir.ops:
        # Only reads inside a layer's scope are its weights (an optimizer's step counter read at
        # the top level is optimizer state).
        if op.phase is Phase.FORWARD and op.type in _VARIABLE_READS and op.inputs and op.name in keys:
            layer = layer_of_op[op.name]
            nbytes = ir.tensors[op.outputs[0]].nbytes or 0 if op.type == "ReadVariableOp" else 0
            handle_layer.setdefault(op.inputs[0], layer)
            if nbytes:
                params[layer][op.inputs[0]] = max(params[layer].get(op.inputs[0], 0), nbytes)
    # Backward: in a layer's scope; else with the latest layer whose forward tensors it reads
    # (the gradient of that layer's output); else with the layer whose backward reads its output
    # (a gradient sum goes with the layer it feeds); else with the last layer.
    for op in reversed([op for op in ir.ops if op.phase is Phase.BACKWARD]):
        if op.name in keys:
            layer_of_op[op.name] = keys[op.name]
            continue
        sources = [layer_of_op[ir.tensors[t].producer] for t in op.inputs
                   if ir.op(ir.tensors[t].producer).phase is Phase.FORWARD
                   and ir.op(ir.tensors[t].producer).type not in _NO_MEMORY | _VARIABLE_READS]
        readers = [layer_of_op[c] for t in op.outputs for c in ir.tensors[t].consumers if c in layer_of_op
                   and ir.op(c).phase is Phase.BACKWARD]
        candidates = sources or readers
        layer_of_op[op.name] = max(candidates, key=index.__getitem__) if candidates else last
    for op in ir.ops:
        for t in op.outputs:
            producer_layer[t] = layer_of_op.get(op.name, "")
    forward_s: Dict[str, float] = defaultdict(float)
    backward_s: Dict[str, float] = defaultdict(float)
    saved: Dict[str, Dict[str, int]] = defaultdict(dict)
    inputs: Dict[str, Dict[str, Tuple[int, int]]] = defaultdict(dict)
    work: Dict[str, int] = defaultdict(int)
    # Activations: forward outputs other than variable reads, constants and shapes; the step's
    # data inputs too (the first stage keeps its input micro-batches for its weight gradients).
    forward_tensors = {t for op in ir.ops if op.phase is Phase.FORWARD and op.type not in _VARIABLE_READS
                       and (op.type not in _NO_MEMORY or op.name in ir.function_inputs) for t in op.outputs
                       if ir.tensors[t].dtype not in ("resource", "variant") and ir.tensors[t].nbytes}
    for op in ir.ops:
        layer = layer_of_op.get(op.name)
        if layer is None:
            continue
        seconds = cost.op_time(ir, op)
        if op.phase is Phase.FORWARD:
            forward_s[layer] += seconds
            kept_elsewhere = 0
            for t in op.inputs:
                nbytes = ir.tensors[t].nbytes or 0
                source = producer_layer.get(t, "")
                if t in forward_tensors and source and source != layer and nbytes:
                    inputs[layer][t] = (nbytes, index[source])
                    kept_elsewhere += nbytes
            out = sum(ir.tensors[t].nbytes or 0 for t in op.outputs) if op.type not in _VARIABLE_READS else 0
            work[layer] = max(work[layer], kept_elsewhere + out + kernel_scratch_bytes(ir, op, kernels))
        else:
            backward_s[layer] += seconds
            transient = 0
            for t in op.inputs:
                nbytes = ir.tensors[t].nbytes or 0
                if t in forward_tensors:
                    saved[layer][t] = nbytes
                elif ir.op(ir.tensors[t].producer).type not in _VARIABLE_READS:
                    transient += nbytes
            work[layer] = max(work[layer], transient + sum(ir.tensors[t].nbytes or 0 for t in op.outputs)
                              + kernel_scratch_bytes(ir, op, kernels))
    # Updates: an op writing a layer's variable goes with that layer; the optimizer's shared
    # arithmetic (step counters, learning-rate schedules) is spread by weight bytes.
    update_s: Dict[str, float] = defaultdict(float)
    shared = 0.0
    for op in ir.ops_in(Phase.UPDATE):
        layer = handle_layer.get(op.inputs[0]) if op.type in _VARIABLE_WRITES and op.inputs else None
        if layer is None:
            shared += cost.op_time(ir, op)
        else:
            update_s[layer] += cost.op_time(ir, op)
    # What the planner keeps on the device whatever the budget ("/device:GPU:0": ops traced
    # without a device run on the accelerator).
    unmovable = set(collect_candidates(ir, Policies(), device="/device:GPU:0").kept)
    weight_bytes = {name: sum(params[name].values()) for name in order}
    total_weights = sum(weight_bytes.values())
    layer_handles = {h for name in order for h in params[name]}
    slots = sum(nbytes for handle, nbytes in resident_buffers(ir) if handle not in layer_handles)
    layers = tuple(LayerProfile(
        name, params=tuple(sorted(params[name].items())), saved=tuple(sorted(saved[name].items())),
        work_bytes=work[name], inputs=tuple(sorted((t, b, i) for t, (b, i) in inputs[name].items())),
        forward_s=forward_s[name], backward_s=backward_s[name],
        update_s=update_s[name] + (shared * weight_bytes[name] / total_weights if total_weights else
                                   shared / len(order)),
        pinned=tuple(sorted(t for t in saved[name] if t in unmovable)))
        for name in order)
    return PipelineProfile(layers, slots / total_weights if total_weights else 0.0, microbatch)
