"""The graph IR as plain data: ops in execution order tagged forward/backward/update, tensors with sizes.

Built from a traced step by :func:`lms_tf.tf.trace.build_ir`; nothing here refers to TensorFlow, so
the cost model, simulator and planner run on it without TensorFlow (and tests build small IRs by
hand with :func:`make_ir`).

Examples:
    >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (4, 8))]),
    ...               dict(name="relu", type="Relu", inputs=["x:0"], outputs=[("relu:0", (4, 8))])])
    >>> ir.tensors["relu:0"].nbytes, ir.op("relu").phase.value
    (128, 'forward')
"""

from __future__ import annotations

import dataclasses
import enum
import re
from fractions import Fraction
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, TypeVar

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.op_kinds import ALIAS_TYPES

_GRADIENT_SCOPE = re.compile(r"^(gradient_tape|gradients)(_\d+)?$")
_T = TypeVar("_T")
_MISSING = object()  # GraphIR.memo: a key not computed yet (None is a value)


class Phase(str, enum.Enum):
    """Which part of the training step an op belongs to.

    Examples:
        >>> Phase("backward") is Phase.BACKWARD
        True
    """

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the graph.

    Attributes:
        name: TensorFlow name, e.g. ``"conv2d/Relu:0"``.
        dtype: dtype name, e.g. ``"float32"``.
        shape: Dimensions after resolution; ``None`` entries are still unknown; ``None``
            when even the rank is unknown.
        nbytes: Size in bytes, or ``None`` when a dimension is unknown or the dtype
            has no fixed size (resource, variant, string). A ``While`` loop's TensorList
            accumulator (the per-iteration values its gradient loop reads) is the exception:
            it is described by its elements, ``dtype`` the element dtype and ``shape``
            ``(iterations, *element_shape)``, when both are known statically (``nbytes`` 0 when
            the elements are reads of a variable: they share its buffer).
        producer: Name of the op that produces it.
        consumers: Names of the ops that read it (data edges), in execution order.

    Examples:
        >>> TensorInfo("a:0", "float32", (2, 3), 24, "a", ()).nbytes
        24
    """

    name: str
    dtype: str
    shape: Optional[Tuple[Optional[int], ...]]
    nbytes: Optional[int]
    producer: str
    consumers: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One op of the graph.

    Attributes:
        name: Op name.
        type: Op type, e.g. ``"Conv2D"``.
        index: Position in the execution order.
        phase: forward, backward or update.
        device: Requested device string (often empty: the placer decides).
        inputs: Input tensor names.
        control_inputs: Names of ops with a control edge into this op.
        outputs: Output tensor names.
        stateful: Whether TensorFlow declares the op stateful (variable access,
            random ops with hidden state, I/O): such ops are never recomputed.
        reads_state_only: A functional op (``While``, ``If``) that is stateful only because its
            functions read variables: it may be recomputed while nothing writes those variables.
        inner_kernels: Kernels a loop runs per call (its body's times its trip count; 0 when
            unknown or not a loop): each costs a launch, which dominates a small recurrent step.
        passes_through: For arithmetic TensorFlow's graph optimizer removes (``x * 1``,
            ``x + 0``: its readers then read ``x``), the position of the input passed on; else None.

    Examples:
        >>> OpInfo("a", "Relu", 0, Phase.FORWARD, "", (), (), ("a:0",)).type
        'Relu'
    """

    name: str
    type: str
    index: int
    phase: Phase
    device: str
    inputs: Tuple[str, ...]
    control_inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    stateful: bool = False
    reads_state_only: bool = False
    inner_kernels: int = 0
    passes_through: Optional[int] = None

    @property
    def is_alias(self) -> bool:
        """Whether the op's outputs are buffers of its inputs, so it runs no kernel the memory sees:
        an alias type (:data:`~lms_tf.core.op_kinds.ALIAS_TYPES`: ``Identity``, ``Reshape``, ...)
        or arithmetic the graph optimizer removes (:attr:`passes_through`).

        Examples:
            >>> OpInfo("r", "Reshape", 0, Phase.FORWARD, "", ("x:0",), (), ("r:0",)).is_alias
            True
            >>> OpInfo("m", "Mul", 0, Phase.FORWARD, "", ("one:0", "x:0"), (), ("m:0",), passes_through=1).is_alias
            True
        """
        return self.type in ALIAS_TYPES or self.passes_through is not None


def layer_of(op_name: str) -> str:
    """The layer (name-scope path) an op belongs to, without gradient scopes.

    Examples:
        >>> layer_of("gradient_tape/sequential/conv2d/Relu/ReluGrad")
        'sequential/conv2d/Relu'
        >>> layer_of("sequential/conv2d/Relu")
        'sequential/conv2d'
    """
    parts = [p for p in op_name.split("/")[:-1] if not _GRADIENT_SCOPE.match(p)]
    return "/".join(parts)


def is_gradient_scoped(op_name: str) -> bool:
    """Whether an op name lies under a ``gradient_tape/`` or ``gradients/`` name scope.

    Examples:
        >>> is_gradient_scoped("train/gradient_tape/dense/MatMul"), is_gradient_scoped("dense/MatMul")
        (True, False)
    """
    return any(_GRADIENT_SCOPE.match(part) for part in op_name.split("/")[:-1])


@dataclasses.dataclass(frozen=True)
class GraphIR:
    """Immutable view of a traced training step.

    Attributes:
        ops: Ops in a deterministic execution order (topological, ties broken by creation).
        tensors: Tensor name -> TensorInfo.
        function_inputs: Names of the ops that are the function's inputs (placeholders).
        resolved_dims: How unknown dimensions were resolved, e.g. ``{"data:0": (32, 224, 224, 3)}``.
        data_dependent: Ops computed from the batch (function inputs that are not
            resources, iterator outputs), not only from constants and variables.
        grappler_rewritten: Ops TensorFlow's default graph optimizer fuses, folds or regroups
            in this step (found by the TensorFlow side when it matters; empty when not looked
            for). A new reader of one of them, or of an op they read, can stop that rewrite
            and change the rounding, so the planner gates nothing on them.
        host_placed: Ops the step places on the host device itself (the optimizer update under
            ``optimizer_on_host`` or ``weights="host"``): their outputs are host memory, not the
            device's (set by the TensorFlow side; empty when nothing is).
        compiled_scratch: Calls of functions XLA compiles (op name -> bytes of the temporaries
            XLA's own buffer plan takes from TensorFlow's allocator while the call runs), as
            compiled for devices of type :attr:`compiled_for`.
        compiled_for: ``"CPU"`` or ``"GPU"``: the device type ``compiled_scratch`` holds for
            (XLA's plan differs between them); empty when the step calls nothing compiled.

    Examples:
        >>> ir = GraphIR(ops=(), tensors={}, function_inputs=frozenset(), resolved_dims={})
        >>> len(ir.ops)
        0
    """

    ops: Tuple[OpInfo, ...]
    tensors: Mapping[str, TensorInfo]
    function_inputs: FrozenSet[str]
    resolved_dims: Mapping[str, Tuple[Optional[int], ...]]
    data_dependent: FrozenSet[str] = frozenset()
    grappler_rewritten: FrozenSet[str] = frozenset()
    host_placed: FrozenSet[str] = frozenset()
    compiled_scratch: Mapping[str, int] = dataclasses.field(default_factory=dict)
    compiled_for: str = ""

    def __post_init__(self):
        object.__setattr__(self, "_by_name", {op.name: op for op in self.ops})

    def op(self, name: str) -> OpInfo:
        """Returns the op called ``name``.

        Examples:
            >>> GraphIR((), {}, frozenset(), {}).op("missing")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            KeyError: 'missing'
        """
        return self._by_name[name]  # type: ignore[attr-defined]

    def has_op(self, name: str) -> bool:
        """Whether the step has an op called ``name`` (a simulator's copy or clone is not one).

        Examples:
            >>> GraphIR((), {}, frozenset(), {}).has_op("missing")
            False
        """
        return name in self._by_name  # type: ignore[attr-defined]

    def ops_in(self, phase: Phase) -> List[OpInfo]:
        """Ops of one phase, in execution order.

        Examples:
            >>> GraphIR((), {}, frozenset(), {}).ops_in(Phase.BACKWARD)
            []
        """
        return [op for op in self.ops if op.phase is phase]

    def memo(self, key: str, compute: Callable[[], _T]) -> _T:
        """``compute()``, computed once per IR and kept on it under ``key``.

        The IR never changes, so whatever is a function of it alone can be kept with it: a
        planner simulates one step hundreds of times (a large decoder's budget search lowers it
        about 200 times), and these derived views would otherwise be rebuilt for each. Keep only
        values no caller changes (tuples, frozensets, mappings nobody writes to).

        Examples:
            >>> ir = GraphIR((), {}, frozenset(), {})
            >>> ir.memo("answer", lambda: 42), ir.memo("answer", lambda: 0)
            (42, 42)
        """
        cached = self.__dict__.get(key, _MISSING)
        if cached is _MISSING:
            cached = compute()
            object.__setattr__(self, key, cached)
        return cached

    def phase_counts(self) -> Dict[str, int]:
        """Number of ops per phase.

        Examples:
            >>> GraphIR((), {}, frozenset(), {}).phase_counts()
            {'forward': 0, 'backward': 0, 'update': 0}
        """
        def count():  # planners stamp it on every plan they assemble
            counts = {p.value: 0 for p in Phase}
            for op in self.ops:
                counts[op.phase.value] += 1
            return tuple(counts.items())

        return dict(self.memo("_phase_counts", count))




_DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
                "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1, "complex64": 8,
                "complex128": 16}


def make_ir(ops: Sequence[Mapping[str, Any]], *, data_dependent: Optional[Sequence[str]] = None,
            function_inputs: Sequence[str] = ()) -> GraphIR:
    """Builds a small IR from keyword descriptions of its ops, in execution order (for tests and examples).

    Each op is a dict with ``name`` and ``type`` and optionally ``phase`` (``"forward"``, the
    default, ``"backward"`` or ``"update"``), ``inputs`` (tensor names), ``control_inputs``,
    ``outputs`` (``(name, shape)`` pairs, or ``(name, shape, dtype)``; dtype ``"float32"`` by
    default), ``device`` and ``stateful``. Consumers are derived from the inputs.

    Args:
        ops: The ops, in execution order.
        data_dependent: Ops computed from the batch (default: every op).
        function_inputs: Ops that are the step's inputs.

    Returns:
        The GraphIR.

    Examples:
        >>> ir = make_ir([dict(name="a", type="Const", outputs=[("a:0", (2,))]),
        ...               dict(name="g", type="Neg", phase="backward", inputs=["a:0"], outputs=[("g:0", (2,))])])
        >>> ir.tensors["a:0"].consumers, ir.phase_counts()
        (('g',), {'forward': 1, 'backward': 1, 'update': 0})
    """
    consumers: Dict[str, List[str]] = {}
    for spec in ops:
        for t in spec.get("inputs", ()):
            consumers.setdefault(t, []).append(spec["name"])
    infos: List[OpInfo] = []
    tensors: Dict[str, TensorInfo] = {}
    for index, spec in enumerate(ops):
        outputs = []
        for out in spec.get("outputs", ()):
            name, shape, dtype = (tuple(out) + ("float32",))[:3]
            shape = None if shape is None else tuple(shape)
            nbytes = None
            if shape is not None and all(d is not None for d in shape) and dtype in _DTYPE_SIZES:
                nbytes = _DTYPE_SIZES[dtype]
                for d in shape:
                    nbytes *= d
            tensors[name] = TensorInfo(name, dtype, shape, nbytes, spec["name"], tuple(consumers.get(name, ())))
            outputs.append(name)
        infos.append(OpInfo(name=spec["name"], type=spec["type"], index=index,
                            phase=Phase(spec.get("phase", "forward")), device=spec.get("device", ""),
                            inputs=tuple(spec.get("inputs", ())),
                            control_inputs=tuple(spec.get("control_inputs", ())),
                            outputs=tuple(outputs), stateful=bool(spec.get("stateful", False)),
                            reads_state_only=bool(spec.get("reads_state_only", False)),
                            inner_kernels=int(spec.get("inner_kernels", 0))))
    dependent = frozenset(data_dependent if data_dependent is not None else (op.name for op in infos))
    return GraphIR(ops=tuple(infos), tensors=tensors, function_inputs=frozenset(function_inputs),
                   resolved_dims={}, data_dependent=dependent)


_DEVICE = re.compile(r"/?(?:device:)?([A-Za-z_]+):(\d+)$")


def canonical_device(device: str) -> str:
    """A device string in TensorFlow's canonical form (``/device:CPU:1``), keeping any job/task prefix.

    Examples:
        >>> canonical_device("/CPU:1"), canonical_device("gpu:0"), canonical_device("/job:w/task:1/GPU:2")
        ('/device:CPU:1', '/device:GPU:0', '/job:w/task:1/device:GPU:2')
    """
    match = _DEVICE.search(device.strip())
    if not match:
        return device
    prefix = device.strip()[:match.start()].rstrip("/")
    return f"{prefix}/device:{match.group(1).upper()}:{int(match.group(2))}"


def device_kind_and_index(device: str) -> Tuple[str, int]:
    """The device type (upper case) and index a device string names, ignoring job/replica/task.

    Examples:
        >>> device_kind_and_index("/job:localhost/replica:0/task:0/device:GPU:1"), device_kind_and_index("/gpu:0")
        (('GPU', 1), ('GPU', 0))
    """
    match = _DEVICE.search(device.strip())
    if not match:
        return ("", 0)
    return match.group(1).upper(), int(match.group(2))


_DEVICE_PART = re.compile(r"/(job|replica|task):([^/]+)", re.IGNORECASE)


def same_device(a: str, b: str) -> bool:
    """Whether device strings ``a`` and ``b`` name the same device. A part either leaves out (job,
    replica, task, index) matches any, so ``/CPU:1`` is this process's CPU:1 whatever its job,
    while two tasks of a cluster (each with its own CPU:0) differ. An empty string names no device.

    Examples:
        >>> same_device("/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/task:1/CPU:0")
        True
        >>> same_device("/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/task:2/device:CPU:0")
        False
        >>> same_device("/job:localhost/replica:0/task:0/device:GPU:1", "/gpu:1"), same_device("", "/CPU:0")
        (True, False)
    """
    if not a or not b:
        return False
    if device_kind_and_index(a) != device_kind_and_index(b):
        return False
    parts_a = {k.lower(): v for k, v in _DEVICE_PART.findall(a)}
    parts_b = {k.lower(): v for k, v in _DEVICE_PART.findall(b)}
    return all(parts_a[k] == parts_b[k] for k in parts_a.keys() & parts_b.keys())


#: A size as a function of the batch: ``(per_sample, fixed)`` for ``per_sample * batch + fixed``.
Linear = Tuple[int, int]


def _same_compiled_scratch(irs) -> bool:
    """Whether XLA's temporaries (:attr:`GraphIR.compiled_scratch`) are the same in every IR: the
    sized IRs keep the first one's."""
    return len({(ir.compiled_for, tuple(sorted(ir.compiled_scratch.items()))) for ir in irs}) <= 1


def _linear(at_a: Optional[int], at_b: Optional[int], a: int, b: int) -> Optional[Linear]:
    """The integer line through ``(a, at_a)`` and ``(b, at_b)``, or None (unknown, or not a line
    with integer coefficients)."""
    if at_a is None or at_b is None or (at_b - at_a) % (b - a):
        return None
    per_sample = (at_b - at_a) // (b - a)
    return per_sample, at_a - per_sample * a


class BatchSizedIR:
    """One traced step's IR at any batch size, from its IRs at two sizes: every tensor dimension
    (and byte size) that changes with the batch changes linearly in it, so two sizes fix it.

    Tracing once with an unknown batch and sizing the graph again per batch (TensorFlow's shape
    inference) takes about a second on ResNet-50; this rebuilds the sizes by arithmetic. It is
    exact for the graphs it accepts: :meth:`fit` checks the lines against a third size and gives
    None when any size is not linear (a dimension computed from the batch in another way), so
    the caller sizes each batch with TensorFlow instead.

    Examples:
        >>> def ir(batch):   # a 4-feature input and its 2x-wider Relu
        ...     return make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (batch, 4))]),
        ...                     dict(name="r", type="Relu", inputs=["x:0"], outputs=[("r:0", (batch, 8))])])
        >>> sized = BatchSizedIR.fit({2: ir(2), 3: ir(3), 5: ir(5)})
        >>> sized.at(1000).tensors["r:0"].nbytes == ir(1000).tensors["r:0"].nbytes == 32000
        True
    """

    def __init__(self, template: GraphIR, shapes: Mapping[str, Optional[Tuple[Optional[Linear], ...]]],
                 nbytes: Mapping[str, Optional[Linear]], resolved: Mapping[str, Tuple[Optional[Linear], ...]]):
        self.template, self.shapes, self.nbytes, self.resolved = template, shapes, nbytes, resolved

    @classmethod
    def fit(cls, samples: Mapping[int, GraphIR]) -> Optional["BatchSizedIR"]:
        """The sizes of ``samples`` (batch size -> the same step's IR at it, three sizes or more)
        as lines in the batch, checked against every sample; None when they are not.

        Examples:
            >>> def ir(batch):   # a dimension that is the square of the batch is not a line
            ...     return make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (batch * batch,))])])
            >>> BatchSizedIR.fit({2: ir(2), 3: ir(3), 5: ir(5)}) is None
            True
        """
        if len(samples) < 3:
            raise LMSOptionError(f"BatchSizedIR.fit needs the IR at three batch sizes or more (two fix the lines, the "
                             f"others check them); received {sorted(samples)}")
        (a, ir_a), (b, ir_b) = sorted(samples.items())[:2]
        if [op.name for op in ir_a.ops] != [op.name for op in ir_b.ops] or ir_a.tensors.keys() != ir_b.tensors.keys():
            return None
        if not _same_compiled_scratch(samples.values()):
            return None  # XLA's temporaries change with the batch: no line is assumed for them
        shapes: Dict[str, Optional[Tuple[Optional[Linear], ...]]] = {}
        nbytes: Dict[str, Optional[Linear]] = {}
        for name, ta in ir_a.tensors.items():
            tb = ir_b.tensors[name]
            if (ta.shape is None) != (tb.shape is None) or (ta.shape is not None and len(ta.shape) != len(tb.shape)):
                return None
            shapes[name] = None if ta.shape is None else tuple(_linear(x, y, a, b) for x, y in zip(ta.shape, tb.shape))
            nbytes[name] = _linear(ta.nbytes, tb.nbytes, a, b)
        resolved = {name: tuple(_linear(x, y, a, b) for x, y in zip(dims, ir_b.resolved_dims.get(name, ())))
                    for name, dims in ir_a.resolved_dims.items()}
        sized = cls(ir_a, shapes, nbytes, resolved)
        for batch, ir in samples.items():
            if sized._sizes(batch) != (ir.tensors, ir.resolved_dims):
                return None  # a size is not linear in the batch (or the byte count is not)
        return sized

    def _sizes(self, batch: int) -> Tuple[Dict[str, TensorInfo], Dict[str, Tuple[Optional[int], ...]]]:
        def at(line: Optional[Linear]) -> Optional[int]:
            return None if line is None else line[0] * batch + line[1]

        tensors = {}
        for name, info in self.template.tensors.items():
            shape = self.shapes[name]
            tensors[name] = dataclasses.replace(info, shape=None if shape is None else tuple(map(at, shape)),
                                                nbytes=at(self.nbytes[name]))
        return tensors, {name: tuple(map(at, dims)) for name, dims in self.resolved.items()}

    def at(self, batch: int) -> GraphIR:
        """The step's IR at ``batch``.

        Examples:
            >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (2, 3))])])
            >>> BatchSizedIR(ir, {"x:0": ((1, 0), (0, 3))}, {"x:0": (12, 0)}, {}).at(7).tensors["x:0"].shape
            (7, 3)
        """
        tensors, resolved = self._sizes(batch)
        return dataclasses.replace(self.template, tensors=tensors, resolved_dims=resolved)


Polynomial = Tuple[Fraction, ...]  # coefficients, the constant first


def _polynomial(points: Sequence[Tuple[int, Optional[int]]]) -> Optional[Polynomial]:
    """The polynomial of degree ``len(points) - 1`` through ``points`` (exact, in fractions), or
    None when a value is unknown."""
    if any(y is None for _, y in points):
        return None
    n = len(points)
    coefficients = [Fraction(0)] * n
    for i, (xi, yi) in enumerate(points):
        # yi times the Lagrange basis polynomial of xi, expanded
        basis, scale = [Fraction(1)], Fraction(yi)
        for j, (xj, _) in enumerate(points):
            if j != i:
                basis = [Fraction(0)] + basis  # times x
                for k in range(len(basis) - 1):
                    basis[k] -= xj * basis[k + 1]
                scale /= xi - xj
        for k, c in enumerate(basis):
            coefficients[k] += scale * c
    while len(coefficients) > 1 and coefficients[-1] == 0:
        coefficients.pop()
    return tuple(coefficients)


def _evaluate(polynomial: Optional[Polynomial], x: int) -> Optional[int]:
    if polynomial is None:
        return None
    value = sum(c * x**k for k, c in enumerate(polynomial))
    return int(value) if value.denominator == 1 else None


class ScaledIR:
    """One model family's step IR at any value of a scale (the width of a Transformer), from its
    IRs at a few values: every dimension is a polynomial of degree ``dims_degree`` in the scale
    and every byte size one of degree ``bytes_degree`` (a width-``d`` model: dimensions are lines
    in ``d`` - ``d``, ``4 d``, ``d / 64`` heads - and a ``d x 4d`` kernel's bytes a quadratic).

    :meth:`fit` takes ``bytes_degree + 2`` samples or more: the first ``bytes_degree + 1`` fix the
    polynomials, the others check them, so a size that is not such a polynomial gives None.

    Examples:
        >>> def ir(d):   # a d x 4d kernel and a 2 x d activation
        ...     return make_ir([dict(name="w", type="Placeholder", outputs=[("w:0", (d, 4 * d))]),
        ...                     dict(name="x", type="Placeholder", outputs=[("x:0", (2, d))])])
        >>> sized = ScaledIR.fit({8: ir(8), 16: ir(16), 24: ir(24), 32: ir(32)})
        >>> sized.at(1024).tensors["w:0"].nbytes == ir(1024).tensors["w:0"].nbytes == 16 * 1024 * 1024
        True
    """

    def __init__(self, template: GraphIR, shapes, nbytes, resolved):
        self.template, self.shapes, self.nbytes, self.resolved = template, shapes, nbytes, resolved

    @classmethod
    def fit(cls, samples: Mapping[int, GraphIR], dims_degree: int = 1,
            bytes_degree: int = 2) -> Optional["ScaledIR"]:
        """The sizes of ``samples`` (scale -> the same step's IR at it) as polynomials in the
        scale, checked against every sample; None when they are not.

        Examples:
            >>> def ir(d):
            ...     return make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (2 ** d,))])])
            >>> ScaledIR.fit({1: ir(1), 2: ir(2), 3: ir(3), 4: ir(4)}) is None   # not a polynomial
            True
        """
        if len(samples) < bytes_degree + 2:
            raise LMSOptionError(f"ScaledIR.fit needs the IR at {bytes_degree + 2} scales or more (the first "
                                 f"{bytes_degree + 1} fix the sizes, the others check them); received {sorted(samples)}")
        ordered = sorted(samples.items())
        first = ordered[0][1]
        for _, ir in ordered[1:]:
            if [op.name for op in ir.ops] != [op.name for op in first.ops] or ir.tensors.keys() != first.tensors.keys():
                return None
        if not _same_compiled_scratch(samples.values()):
            return None  # XLA's temporaries change with the scale: no polynomial is assumed for them
        dims_at, bytes_at = ordered[:dims_degree + 1], ordered[:bytes_degree + 1]
        shapes, nbytes = {}, {}
        for name, info in first.tensors.items():
            ranks = {None if ir.tensors[name].shape is None else len(ir.tensors[name].shape) for _, ir in ordered}
            if len(ranks) != 1:
                return None
            rank = ranks.pop()
            shapes[name] = None if rank is None else tuple(
                _polynomial([(x, ir.tensors[name].shape[k]) for x, ir in dims_at]) for k in range(rank))
            nbytes[name] = _polynomial([(x, ir.tensors[name].nbytes) for x, ir in bytes_at])
        resolved = {name: tuple(_polynomial([(x, ir.resolved_dims.get(name, ())[k] if k < len(ir.resolved_dims.get(
            name, ())) else None) for x, ir in dims_at]) for k in range(len(dims)))
            for name, dims in first.resolved_dims.items()}
        sized = cls(first, shapes, nbytes, resolved)
        for x, ir in ordered:
            if sized._sizes(x) != (ir.tensors, ir.resolved_dims):
                return None
        return sized

    def _sizes(self, x: int):
        tensors = {}
        for name, info in self.template.tensors.items():
            shape = self.shapes[name]
            tensors[name] = dataclasses.replace(
                info, shape=None if shape is None else tuple(_evaluate(p, x) for p in shape),
                nbytes=_evaluate(self.nbytes[name], x))
        return tensors, {name: tuple(_evaluate(p, x) for p in dims) for name, dims in self.resolved.items()}

    def at(self, x: int) -> GraphIR:
        """The step's IR at scale ``x``.

        Examples:
            >>> ir = make_ir([dict(name="x", type="Placeholder", outputs=[("x:0", (2, 3))])])
            >>> ScaledIR(ir, {"x:0": ((Fraction(2),), (Fraction(0), Fraction(1)))},
            ...          {"x:0": (Fraction(0), Fraction(8))}, {}).at(5).tensors["x:0"].shape
            (2, 5)
        """
        tensors, resolved = self._sizes(x)
        return dataclasses.replace(self.template, tensors=tensors, resolved_dims=resolved)
