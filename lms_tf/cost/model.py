"""Per-op time on a :class:`~lms_tf.cost.DeviceSpec`: a roofline over FLOPs and bytes moved.

Each op of the IR falls in a class (convolution, matmul, normalisation, elementwise,
reduction, pooling, other) with a FLOP count from its shapes; its time is
``max(flops / peak_flops, bytes / memory_bandwidth) + launch_overhead``. Copies between
host and device take ``bytes / link_bandwidth`` in their direction. :meth:`CostModel.calibrate`
scales each class by what a profile of real steps measured.

Examples:
    >>> from lms_tf.cost.devices import get_device_spec
    >>> model = CostModel(get_device_spec("v100-16gb-pcie3"))
    >>> round(model.transfer_time(12 * 10**9, "device_to_host"), 3)
    1.0
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Dict, Iterable, Mapping, Optional, Tuple

from lms_tf.core.ir import GraphIR, OpInfo
from lms_tf.core.op_kinds import CONV_TYPES, FREE_TYPES, MATMUL_TYPES, NORM_TYPES, POOL_TYPES, REDUCTION_TYPES
from lms_tf.cost.devices import DeviceSpec

#: FLOPs per output element of non-matmul classes (a documented rough figure, refined by calibration).
FLOPS_PER_ELEMENT = {"norm": 8.0, "elementwise": 1.0, "reduction": 1.0, "pool": 9.0, "other": 1.0}


def op_class(op_type: str) -> str:
    """The cost class of an op type.

    Examples:
        >>> op_class("Conv2DBackpropFilter"), op_class("Relu"), op_class("Identity")
        ('conv', 'elementwise', 'free')
    """
    if op_type in CONV_TYPES:
        return "conv"
    if op_type in MATMUL_TYPES:
        return "matmul"
    if op_type in NORM_TYPES:
        return "norm"
    if op_type in REDUCTION_TYPES:
        return "reduction"
    if op_type in POOL_TYPES:
        return "pool"
    if op_type in FREE_TYPES:
        return "free"
    return "elementwise"


def _count(shape) -> int:
    if shape is None or any(d is None for d in shape):
        return 0
    return math.prod(shape)


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What one op computes and moves.

    Attributes:
        flops: Floating-point operations.
        bytes: Bytes read and written in device memory.
        kind: Cost class (``conv``, ``matmul``, ``norm``, ``elementwise``, ``reduction``, ``pool``, ``free``).
        dtype: dtype of its main output.

    Examples:
        >>> OpCost(10.0, 8, "elementwise", "float32").kind
        'elementwise'
    """

    flops: float
    bytes: int
    kind: str
    dtype: str


def op_cost(ir: GraphIR, op: OpInfo) -> OpCost:
    """FLOPs and bytes of one op of the IR, from its tensors' shapes.

    Convolutions count ``2 * output_elements * kernel_h * kernel_w * in_channels``
    (the backprops the same, from the output gradient); matmuls ``2 * m * n * k`` with
    ``k`` recovered from the operand sizes, so transposes need no attributes.

    Examples:
        >>> from lms_tf.core.ir import GraphIR, OpInfo, Phase, TensorInfo
        >>> t = {"a:0": TensorInfo("a:0", "float32", (64, 32), 8192, "a", ("m",)),
        ...      "b:0": TensorInfo("b:0", "float32", (32, 16), 2048, "b", ("m",)),
        ...      "m:0": TensorInfo("m:0", "float32", (64, 16), 4096, "m", ())}
        >>> m = OpInfo("m", "MatMul", 2, Phase.FORWARD, "", ("a:0", "b:0"), (), ("m:0",))
        >>> op_cost(GraphIR((m,), t, frozenset(), {}), m).flops == 2 * 64 * 16 * 32
        True
    """
    kind = op_class(op.type)
    inputs = [ir.tensors[t] for t in op.inputs]
    outputs = [ir.tensors[t] for t in op.outputs]
    dtype = outputs[0].dtype if outputs else "float32"
    moved = sum(t.nbytes or 0 for t in inputs + outputs
                if t.dtype not in ("resource", "variant", "string"))
    if kind == "free":
        return OpCost(0.0, 0, kind, dtype)
    flops = 0.0
    if kind == "conv":
        if op.type in ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter"):
            kernel, grad = outputs[0].shape, inputs[2].shape
        elif op.type in ("Conv2DBackpropInput", "Conv3DBackpropInputV2", "DepthwiseConv2dNativeBackpropInput"):
            kernel, grad = inputs[1].shape, inputs[2].shape
        else:
            kernel, grad = inputs[1].shape, outputs[0].shape
        if kernel and grad:
            window = _count(kernel[:-2])
            if op.type.startswith("Depthwise"):
                flops = 2.0 * _count(grad) * window
            else:
                flops = 2.0 * _count(grad) * window * (kernel[-2] or 0)
    elif kind == "matmul" and len(inputs) >= 2:
        a, b, out = _count(inputs[0].shape), _count(inputs[1].shape), _count(outputs[0].shape)
        if out:
            batch = _count(outputs[0].shape[:-2]) or 1
            k = math.sqrt(a * b / out / batch) if a and b else 0.0
            flops = 2.0 * out * k
    else:
        elements = max([_count(t.shape) for t in inputs + outputs if t.shape is not None] or [0])
        flops = FLOPS_PER_ELEMENT.get(kind, 1.0) * elements
    return OpCost(flops, moved, kind, dtype)


@dataclasses.dataclass(frozen=True)
class AveragingCost:
    """Seconds a gradient average costs on the devices and on the host (:meth:`CostModel.gradient_averaging`).

    Args:
        device_s: On the devices, before the gradients move to the host.
        host_s: On the host, after they moved (None: the device spec gives no host bandwidth).

    Examples:
        >>> AveragingCost(device_s=0.2, host_s=0.1).cheaper
        'host'
        >>> AveragingCost(device_s=0.2, host_s=None).cheaper
        'device'
    """

    device_s: float
    host_s: Optional[float]

    @property
    def cheaper(self) -> str:
        """``"host"`` when averaging there costs less, else ``"device"`` (ties and unknowns stay on the device)."""
        return "host" if self.host_s is not None and self.host_s < self.device_s else "device"


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Roofline op times and link transfer times on one device.

    Args:
        device: The device.
        scale: Per cost class, a factor measured times / predicted times (from :meth:`calibrate`).

    Examples:
        >>> from lms_tf.cost.devices import get_device_spec
        >>> CostModel(get_device_spec("h100-80gb-pcie5")).transfer_time(50 * 10**9, "host_to_device")
        1.0
    """

    device: DeviceSpec
    scale: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def time_of(self, cost: OpCost) -> float:
        """Predicted seconds of an op with this cost.

        Examples:
            >>> from lms_tf.cost.devices import get_device_spec
            >>> m = CostModel(get_device_spec("v100-16gb-pcie3"))
            >>> m.time_of(OpCost(0.0, 0, "free", "float32"))
            0.0
        """
        if cost.kind == "free":
            return 0.0
        matmul = cost.kind in ("conv", "matmul")
        compute = cost.flops / self.device.flops(cost.dtype, matmul=matmul)
        memory = cost.bytes / self.device.memory_bytes_per_s
        return (max(compute, memory) + self.device.launch_overhead_s) * self.scale.get(cost.kind, 1.0)

    def op_time(self, ir: GraphIR, op: OpInfo) -> float:
        """Predicted seconds of one op of the IR.

        Examples:
            >>> from lms_tf.core.ir import GraphIR, OpInfo, Phase
            >>> from lms_tf.cost.devices import get_device_spec
            >>> op = OpInfo("n", "NoOp", 0, Phase.FORWARD, "", (), (), ())
            >>> CostModel(get_device_spec("v100-16gb-pcie3")).op_time(GraphIR((op,), {}, frozenset(), {}), op)
            0.0
        """
        # A loop runs its body's kernels once per step: their launches, which the loop's own
        # cost (a pass over the values it accumulates) does not include.
        launches = op.inner_kernels * self.device.launch_overhead_s * self.scale.get("elementwise", 1.0)
        return self.time_of(op_cost(ir, op)) + launches

    def host_op_time(self, ir: GraphIR, op: OpInfo) -> float:
        """Predicted seconds of one op run on the host (the optimizer update with weights on the
        host): the bytes it reads and writes over the host's memory bandwidth, since an update
        does a few flops per byte. Zero when the device spec gives no host bandwidth.

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> from lms_tf.cost.devices import get_device_spec
            >>> ir = chain_ir()   # g1 reads two 4 MiB tensors and writes one
            >>> round(CostModel(get_device_spec("gh200-96gb-c2c")).host_op_time(ir, ir.op("g1")) * 1e6)
            28
        """
        bandwidth = self.device.host_memory_bytes_per_s
        if not bandwidth:
            return 0.0
        tensors = ir.tensors
        nbytes = sum(tensors[t].nbytes or 0 for t in (*op.inputs, *op.outputs) if t in tensors)
        return nbytes / bandwidth

    def gradient_averaging(self, nbytes: int, ranks: int) -> "AveragingCost":
        """What averaging ``nbytes`` of gradients across ``ranks`` devices of one machine costs on
        the devices (before the gradients move to the host, where the update runs) and on the
        host (after they moved). The move itself is the same either way and is not counted.

        A ring allreduce sends and receives ``2 (ranks - 1) / ranks`` of the bytes on each rank.
        On the devices that runs at :attr:`DeviceSpec.peer_bytes_per_s`; when that traffic crosses
        the host link (PCIe cards), it also holds up, for as long, the swap and weight copies that
        link carries, which is counted once more. On the host, each rank reduces its share in host
        memory (two reads and a write per byte), and the ranks share the host's memory bandwidth.

        Args:
            nbytes: Bytes of the gradients averaged.
            ranks: Ranks on the machine, each with its own device.

        Returns:
            An :class:`AveragingCost` (``host_s`` is None when the spec gives no host bandwidth).

        Examples:
            >>> from lms_tf.cost.devices import get_device_spec
            >>> pcie = CostModel(get_device_spec("v100-16gb-pcie3")).gradient_averaging(10**9, 2)
            >>> round(pcie.device_s, 3), round(pcie.host_s, 3), pcie.cheaper
            (0.167, 0.04, 'host')
            >>> CostModel(get_device_spec("v100-32gb-nvlink2")).gradient_averaging(10**9, 2).cheaper
            'device'
        """
        spec = self.device
        ring = 2 * (ranks - 1) / ranks * nbytes
        link = min(spec.host_to_device_bytes_per_s, spec.device_to_host_bytes_per_s)
        device_s = ring / (spec.peer_bytes_per_s or link)
        if spec.peer_over_host_link:
            device_s += ring / link
        host_s = None
        if spec.host_memory_bytes_per_s:
            host_s = 3 * ring * ranks / spec.host_memory_bytes_per_s
        return AveragingCost(device_s=device_s, host_s=host_s)

    def transfer_time(self, nbytes: int, direction: str) -> float:
        """Seconds to copy ``nbytes`` over the host link (``"device_to_host"`` or ``"host_to_device"``).

        Examples:
            >>> from lms_tf.cost.devices import get_device_spec
            >>> CostModel(get_device_spec("v100-32gb-nvlink2")).transfer_time(75 * 10**9, "host_to_device")
            1.0
        """
        bandwidth = (self.device.device_to_host_bytes_per_s if direction == "device_to_host"
                     else self.device.host_to_device_bytes_per_s)
        return nbytes / bandwidth

    def calibrate(self, ir: GraphIR, measured_seconds: Mapping[str, float]) -> "CostModel":
        """A copy scaled per cost class by measured op times (median of measured / predicted).

        Args:
            ir: The IR the measurements are of.
            measured_seconds: Op name -> measured seconds (e.g. from
                :func:`lms_tf.tf.diagnostics.executed_ops` of a few real steps on the target device).

        Examples:
            >>> from lms_tf.core.ir import GraphIR, OpInfo, Phase, TensorInfo
            >>> from lms_tf.cost.devices import get_device_spec
            >>> t = {"r:0": TensorInfo("r:0", "float32", (1024,), 4096, "r", ())}
            >>> r = OpInfo("r", "Relu", 0, Phase.FORWARD, "", (), (), ("r:0",))
            >>> ir = GraphIR((r,), t, frozenset(), {})
            >>> base = CostModel(get_device_spec("v100-16gb-pcie3"))
            >>> slow = base.calibrate(ir, {"r": 3 * base.op_time(ir, r)})
            >>> round(slow.scale["elementwise"], 6)
            3.0
        """
        return self.calibrate_many([(ir, measured_seconds)])

    def calibrate_many(self, measurements: Iterable[Tuple[GraphIR, Mapping[str, float]]]) -> "CostModel":
        """:meth:`calibrate` on the measured ops of several steps together (e.g. other models).

        Examples:
            >>> from lms_tf.core.examples import chain_ir
            >>> from lms_tf.cost.devices import get_device_spec
            >>> ir = chain_ir()
            >>> base = CostModel(get_device_spec("v100-16gb-pcie3"))
            >>> a = ir.op("a")   # an Exp: an elementwise op
            >>> both = base.calibrate_many([(ir, {"a": 2 * base.op_time(ir, a)}), (ir, {"a": 4 * base.op_time(ir, a)})])
            >>> round(both.scale["elementwise"], 6)
            3.0
        """
        ratios: Dict[str, list] = collections.defaultdict(list)
        unscaled = CostModel(self.device)
        for ir, measured_seconds in measurements:
            for op in ir.ops:
                seconds = measured_seconds.get(op.name)
                predicted = unscaled.op_time(ir, op)
                if seconds is not None and predicted > 0:
                    ratios[op_class(op.type)].append(seconds / predicted)
        scale = dict(self.scale)
        scale.update({kind: statistics.median(values) for kind, values in ratios.items()})
        return CostModel(self.device, scale)


def step_compute_time(ir: GraphIR, model: CostModel, ops: Optional[Iterable[OpInfo]] = None) -> Tuple[float, int]:
    """Total predicted compute seconds of ``ops`` (default: every op) and their FLOPs.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> from lms_tf.cost.devices import get_device_spec
        >>> step_compute_time(GraphIR((), {}, frozenset(), {}), CostModel(get_device_spec("v100-16gb-pcie3")))
        (0.0, 0)
    """
    seconds, flops = 0.0, 0
    for op in (ir.ops if ops is None else ops):
        cost = op_cost(ir, op)
        seconds += model.time_of(cost)
        flops += int(cost.flops)
    return seconds, flops
