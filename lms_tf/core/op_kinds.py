"""Every TensorFlow op type (and dtype) the IR, cost model, simulator and planner treat specially.

One table, so a new op type is taught to lms-tf in one place. Each set says what the op does
that matters to memory or time; the modules that use a set name it from here.

Examples:
    >>> from lms_tf.core import op_kinds
    >>> "Relu" in op_kinds.CHEAP_OP_TYPES, "MaxPool" in op_kinds.NEVER_CLONED_TYPES
    (True, True)
    >>> op_kinds.recompute_clone_name("gradient_tape/dense/MatMul", "dense/Relu")
    'recompute/gradient_tape/dense/MatMul/dense/Relu'
"""

from __future__ import annotations

from typing import Callable, Collection, List, Sequence, Tuple, TypeVar

T = TypeVar("T")

# --- Structure of a traced step -------------------------------------------------------------

#: Ops that bring a batch into the step from inside the graph (tf-keras, input pipelines in the step).
DATA_SOURCE_OP_TYPES = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue", "MultiDeviceIteratorGetNextFromShard",
})

#: Functional loops. A forward loop's TensorList accumulators (the per-iteration values its
#: gradient loop reads) are planned like other activations: swapped, or the loop recomputed.
WHILE_OP_TYPES = frozenset({"While", "StatelessWhile"})
#: Ops that make the empty TensorList a loop accumulates into (input 1: how many elements).
LIST_CONSTRUCTOR_TYPES = frozenset({"EmptyTensorList", "TensorListReserve"})

#: Control-flow ops: values entering or leaving them are never swapped (their bodies are functions),
#: except a forward loop's accumulators (:data:`WHILE_OP_TYPES`).
CONTROL_FLOW_OP_TYPES = frozenset({
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "Enter", "Exit", "Switch", "Merge", "NextIteration", "LoopCond", "RefEnter", "RefExit",
    "RefSwitch", "RefMerge",
})

#: Stateful op types that only read state: a function whose stateful ops are all of these computes
#: the same values when run again, as long as nothing writes the variables in between.
STATE_READ_TYPES = frozenset({"ReadVariableOp", "VariableShape", "VarIsInitializedOp"})

#: Reads of variables: their outputs are the variable's own buffer, never swapped or cloned.
VARIABLE_READ_TYPES = frozenset({"ReadVariableOp", "VarHandleOp", "VariableV2", "ResourceGather",
                                 "VarIsInitializedOp", "_ReadVariablesOp"})

#: dtypes that live in host memory on a GPU (int32) or have no fixed size: never swapped or recomputed.
HOST_DTYPES = frozenset({"int32", "string", "resource", "variant"})

#: dtypes with no fixed byte size: a tensor of these has no ``nbytes``.
UNSIZED_DTYPES = frozenset({"resource", "variant", "string"})

#: Op types that mark a layer's compute, used to list layer names in error messages.
LAYER_OP_TYPES = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMulV2", "Einsum",
                            "BiasAdd", "FusedBatchNormV3", "ResourceGather", "GatherV2", "Relu"})

#: Readers of a tensor's shape only. They run as soon as the tensor exists (with an unknown batch
#: dimension the gradient asks for it early) and do not keep its value alive afterwards, so they
#: stay on the original tensor and do not count as backward consumers.
METADATA_READER_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})

# --- What the planner may move ---------------------------------------------------------------

#: Op types whose outputs ``recompute="cheap"`` recomputes: activations, elementwise math,
#: normalisation arithmetic, pooling, concatenation and layout ops. Cheap in FLOPs per byte,
#: so recomputing them costs little time for the memory it frees.
CHEAP_OP_TYPES = frozenset({
    # activations
    "Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Tanh", "Softplus", "Softsign", "LeakyRelu", "Gelu",
    "Softmax", "LogSoftmax",
    # elementwise
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum", "Minimum", "Neg", "Square",
    "SquaredDifference", "Sqrt", "Rsqrt", "Exp", "Log", "Abs", "BiasAdd", "Cast", "Identity", "AddN",
    "Select", "SelectV2", "Erf",
    # normalisation (fused kernel and the reductions of unfused batch/layer norm)
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "Mean",
    # pooling
    "MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D",
    # concat and layout
    "ConcatV2", "Reshape", "Squeeze", "ExpandDims", "Transpose", "Pad", "StridedSlice", "Slice",
    "Tile", "BroadcastTo",
})

#: Op types never cloned, whatever the policy: on CPUs, oneDNN's layout pass pairs each
#: ``MaxPoolGrad``/``LRNGrad`` with the workspace output of the forward op that produced its
#: ``orig_output``, so a clone there takes part in the rewrite; together with an early gate this
#: made VGG16's recompute step cyclic at run time ("N nodes in a cycle"). Pooling is cheap to keep.
NEVER_CLONED_TYPES = frozenset({"MaxPool", "MaxPoolV2", "MaxPool3D", "LRN"})

#: Backward ops never used as gates or swap-in triggers: oneDNN fuses ``BiasAddGrad`` into the
#: ``Conv2DBackpropFilter``/``MatMul`` next to it on CPUs; if that partner reads a tensor the gate
#: releases, the fused node would wait for itself (seen with VGG16: "N nodes in a cycle").
FUSABLE_GATE_TYPES = frozenset({"BiasAddGrad"})
#: The ops such a gate is fused into (they read the same incoming gradient).
FUSABLE_GATE_PARTNER_TYPES = frozenset({"Conv2DBackpropFilter", "MatMul"})

#: Families of ops that Grappler's constant folding treats as one associative, commutative tree
#: (``ConstantPushDown``): ``c * x`` read by a ``*`` of the backward pass is regrouped with it, which
#: changes the rounding. A swapped or recomputed ``c * x`` hides it from that rewrite.
CONSTANT_PUSHDOWN_FAMILIES = (frozenset({"Mul", "RealDiv", "Div"}), frozenset({"Add", "AddV2", "Sub"}))
#: Ops Grappler's arithmetic optimizer regroups as chains and trees (``AddOpsRewrite``,
#: ``MinimizeBroadcasts``, ``HoistCommonFactorOutOfAggregation``), which changes the rounding.
#: It regroups only through ops whose output has one reader: a gate that reads one of them
#: (an extra reader) stops a regrouping the plain step gets. Seen on a decoder's GELU gradient
#: (a backward ``Mul`` read by a ``Mul``): Adam's first update differed from the plain step's.
REGROUPED_ARITHMETIC_TYPES = frozenset({"Mul", "RealDiv", "Div", "Add", "AddV2", "AddN", "Sub"})
#: Constant producers in a traced step.
CONSTANT_TYPES = frozenset({"Const", "HostConst"})

# --- Memory rules of TensorFlow's executor and kernels (the simulator) ------------------------

#: Ops whose outputs share their input's buffer. ``TensorListFromTensor`` splits a tensor into
#: a list of slices that share its buffer: the tensor lives as long as the list (a loop's input
#: sequence, or the gradient of its output sequence read by the gradient loop).
ALIAS_TYPES = frozenset({"Identity", "IdentityN", "StopGradient", "Snapshot", "Reshape", "Squeeze", "ExpandDims",
                         "EnsureShape", "PreventGradient", "TensorListFromTensor"})
#: Ops whose outputs are resident or live outside the step's transient memory.
RESIDENT_TYPES = frozenset({"ReadVariableOp", "Const", "VarHandleOp", "Placeholder", "_Arg", "HostConst"})
#: Elementwise kernels that write into an input buffer nobody else reads.
FORWARDING_TYPES = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Tanh", "Softplus", "Softsign", "LeakyRelu", "Neg", "Square",
    "Sqrt", "Rsqrt", "Exp", "Log", "Abs", "Add", "AddV2", "Sub", "Mul", "RealDiv", "DivNoNan", "Maximum",
    "Minimum", "BiasAdd", "SquaredDifference", "AddN", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad",
    "SigmoidGrad", "TanhGrad", "SoftplusGrad", "LeakyReluGrad", "RsqrtGrad", "SqrtGrad", "Erf", "Reciprocal",
    "OnesLike", "ZerosLike", "Select", "SelectV2", "Pow", "FloorDiv", "Floor", "Round", "Sign", "Cos", "Sin",
})
#: Ops whose data inputs Grappler sorts by name (``IsCommutative``: the OpDef flag, plus ``Add``).
#: The order matters for memory: an elementwise kernel writes into the first input it may reuse.
COMMUTATIVE_TYPES = frozenset({"Add", "AddV2", "AddN", "AccumulateNV2", "Mul", "SquaredDifference", "Equal",
                               "NotEqual", "ApproximateEqual", "LogicalAnd", "LogicalOr", "BitwiseAnd",
                               "BitwiseOr", "BitwiseXor"})
#: Ops that update a variable (input 0 is its handle) in place.
VARIABLE_UPDATE_PREFIXES = ("Assign", "ResourceApply", "ResourceScatter", "ResourceSparseApply")

#: Collective communication across processes (Horovod's ops, TensorFlow's own collectives).
#: They wait for every rank, so nothing may be ordered behind them on one rank's compute chain.
COLLECTIVE_OP_PREFIXES = ("Horovod", "Collective", "Nccl")


#: Conversions and views through which a value known when the step starts stays known then.
HYPERPARAMETER_VIEW_TYPES = frozenset({"Cast", "Identity"})


def is_hyperparameter(tensor: T, producer: Callable[[T], Tuple[str, Sequence[T]]]) -> bool:
    """Whether ``tensor`` is known when the step starts: made by a resident producer (a variable's
    value such as the learning rate, a constant, a step input) or by a cast or identity of such
    values. It is what a product of a weight gradient made for the optimizer update may read
    besides the gradient and still be complete as soon as the gradient is (any other input, a
    sparse gradient's indices or another gradient, can be complete later). The planner (which
    gradients a weight fetch may wait for) and the rewrite (which products cross to the host)
    both follow this one rule, each over its own graph: ``producer`` maps a tensor to its
    producer's ``(type, inputs)``.

    Examples:
        >>> graph = {"lr": ("ReadVariableOp", ()), "lr32": ("Cast", ("lr",)), "g": ("MatMul", ("a", "b"))}
        >>> is_hyperparameter("lr32", graph.__getitem__), is_hyperparameter("g", graph.__getitem__)
        (True, False)
    """
    op_type, inputs = producer(tensor)
    if op_type in RESIDENT_TYPES:
        return True
    return op_type in HYPERPARAMETER_VIEW_TYPES and bool(inputs) and all(is_hyperparameter(t, producer) for t in inputs)


#: Elementwise functions of one tensor that an optimizer update applies to a weight gradient and
#: that Grappler rewrites with nothing around them (it regroups chains of products and sums, and
#: pushes constants down them, not through these). Run on the host, from the gradient the update
#: sends there anyway, they give the plain step's bits and save a copy: Adam sent each gradient and
#: its square.
UPDATE_FUNCTIONS_RUN_ON_HOST = frozenset({"Square", "Abs"})


def update_products_of_gradients(update_ops: Sequence[Tuple[str, str, Sequence[str], bool, bool]],
                                 gradient_ops: Collection[str]) -> List[str]:
    """The optimizer update's ops that compute from the weight gradients (and scalar
    hyperparameters) alone, not from a slot or a weight: SGD's learning rate times the gradient.
    With the update on the host these stay on the device, so the device runs what it runs in the
    plain step (Grappler regroups a product chain across the end of a gradient only on one
    device). The functions of :data:`UPDATE_FUNCTIONS_RUN_ON_HOST` (Adam's square) do not: they
    run on the host, with what reads them. The rewrite (over TensorFlow's graph) and the simulator
    (over the IR) both follow this one rule.

    Args:
        update_ops: The update's ops in execution order, each ``(name, type, producers, reads_state,
            reads_resource)``: the ops its inputs come from (an ``IdentityN`` the optimizer wraps
            the gradients in seen through to the gradient), whether it reads a variable that is
            not a scalar (a slot or a weight), and whether it takes a resource.
        gradient_ops: The ops that make the weight gradients.

    Returns:
        Their names, in order.

    Examples:
        >>> update_products_of_gradients([("lr", "ReadVariableOp", ["lr_handle"], False, True),
        ...                               ("step", "Mul", ["grad", "lr"], False, False),
        ...                               ("square", "Square", ["grad"], False, False),
        ...                               ("m", "ReadVariableOp", ["slot"], True, True),
        ...                               ("moment", "Sub", ["square", "m"], False, False)], {"grad"})
        ['step']
    """
    from_state, from_gradient, found = set(), set(), []
    for name, op_type, producers, reads_state, reads_resource in update_ops:
        if reads_state or any(p in from_state for p in producers):
            from_state.add(name)
            continue
        if (op_type == "IdentityN" or op_type in UPDATE_FUNCTIONS_RUN_ON_HOST or reads_resource
                or not any(p in gradient_ops or p in from_gradient for p in producers)):
            continue
        from_gradient.add(name)
        found.append(name)
    return found


def is_collective(op_type: str) -> bool:
    """Whether ops of ``op_type`` exchange data with other processes (and wait for them).

    Examples:
        >>> is_collective("HorovodGroupedAllreduce"), is_collective("CollectiveReduceV2"), is_collective("MatMul")
        (True, True, False)
    """
    return op_type.startswith(COLLECTIVE_OP_PREFIXES)


#: Kernels that hold scratch memory while they run (the simulator's convolution workspace).
WORKSPACE_TYPES = frozenset({"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
                             "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "DepthwiseConv2dNative",
                             "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"})
MAXPOOL_TYPES = frozenset({"MaxPool", "MaxPoolV2", "MaxPool3D"})
MAXPOOL_GRAD_TYPES = frozenset({"MaxPoolGrad", "MaxPoolGradV2", "MaxPool3DGrad"})

#: Kernels a plan may run a slice of the batch at a time (:class:`~lms_tf.core.plan.SlicedOp`),
#: and which of their inputs are sliced with the batch (the others are read whole). Each image's
#: gradient of a max pool is made from that image's input, pool output and output gradient alone
#: (no sum crosses images, and the kernel does not change with the batch size), so the slices,
#: put back together in order, hold the values the whole op computes. Convolutions are not here:
#: cuDNN picks an algorithm per shape, so a slice may round differently, and a filter gradient
#: sums over the batch.
BATCH_SLICED_INPUTS = {"MaxPoolGrad": (0, 1, 2), "MaxPoolGradV2": (0, 1, 2), "MaxPool3DGrad": (0, 1, 2)}

# --- Cost classes (the cost model) ------------------------------------------------------------

CONV_TYPES = frozenset({"Conv2D", "Conv3D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3DBackpropInputV2",
                        "Conv3DBackpropFilterV2", "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                        "DepthwiseConv2dNativeBackpropFilter", "_FusedConv2D"})
MATMUL_TYPES = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "_FusedMatMul"})
NORM_TYPES = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGrad",
                        "FusedBatchNormGradV2", "FusedBatchNormGradV3", "_FusedBatchNormEx"})
REDUCTION_TYPES = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "ArgMax", "ArgMin", "BiasAddGrad", "L2Loss",
                             "SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"})
POOL_TYPES = frozenset({"MaxPool", "AvgPool", "MaxPoolGrad", "AvgPoolGrad", "MaxPool3D", "AvgPool3D",
                        "MaxPoolGradV2", "MaxPool3DGrad", "AvgPool3DGrad"})
#: Ops that cost nothing on the device: they alias a buffer or only describe shapes.
FREE_TYPES = frozenset({"Identity", "IdentityN", "StopGradient", "Snapshot", "Reshape", "Squeeze", "ExpandDims",
                        "Const", "ReadVariableOp", "VarHandleOp", "Placeholder", "NoOp", "Shape", "ShapeN", "Size",
                        "Rank", "BroadcastGradientArgs", "_Arg", "_Retval"})

# --- Names lms-tf gives what it adds ---------------------------------------------------------

#: Prefix of the simulator's key of a swapped tensor's copy back on the device.
SWAP_IN_PREFIX = "swap_in/"
#: Prefix of the simulator's key of a device tensor's copy to the host that the optimizer update
#: reads there (a weight gradient, with the update on the host).
TO_HOST_PREFIX = "to_host/"
#: Prefix of every recompute clone's name in the simulator (see :func:`recompute_clone_name`).
RECOMPUTE_PREFIX = "recompute/"


def recompute_clone_name(gate: str, name: str) -> str:
    """The name of the clone of forward op (or tensor) ``name`` that recompute gate ``gate`` runs.

    The simulator names its clone events so, and the rewriter maps the ops it clones back to the
    same names, so a simulated order can be imposed on a rewritten graph.

    Examples:
        >>> recompute_clone_name("gradient_tape/conv/ReluGrad", "conv/Relu:0")
        'recompute/gradient_tape/conv/ReluGrad/conv/Relu:0'
    """
    return f"{RECOMPUTE_PREFIX}{gate}/{name}"
