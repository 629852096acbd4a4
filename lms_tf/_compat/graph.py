"""Private TensorFlow graph APIs: editing a graph while it is traced, op attributes, shape inference.

Examples:
    >>> from lms_tf._compat import graph
    >>> graph.check_private_apis()  # raises LMSError if this TF lacks an API lms-tf needs
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from lms_tf.core.errors import LMSError


def check_private_apis() -> None:
    """Raises LMSError naming each private API this TensorFlow no longer provides.

    Examples:
        >>> check_private_apis()
    """
    missing = [name for name in ("_update_input", "_add_control_input", "_set_attr", "_get_attr_type", "_set_device")
               if not hasattr(tf.Operation, name)]
    from tensorflow.python.framework import auto_control_deps, func_graph  # noqa: F401 - import is the check

    missing += [f"auto_control_deps.{name}" for name in ("_get_resource_inputs", "ResourceType", "op_is_stateful",
                                                          "MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS")
                if not hasattr(auto_control_deps, name)]
    if missing:
        raise LMSError(
            f"TensorFlow {tf.__version__} lacks {', '.join(missing)} (tf.Operation's methods, unless named), which lms-tf uses to "
            f"rewrite graphs. Install a tested version (see README) or report the TF version."
        )


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """Re-points input ``index`` of ``op`` to ``tensor`` (in place, during tracing).

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        >>> update_input(c.op, 0, b); [t.name for t in c.op.inputs]
        ['b:0']
    """
    op._update_input(index, tensor)  # pylint: disable=protected-access


def set_device(op: tf.Operation, device: str) -> None:
    """Places ``op`` on ``device`` (in place, during tracing).

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a = tf.constant(1.0, name="a")
        >>> set_device(a.op, "/device:CPU:0"); a.op.device
        '/device:CPU:0'
    """
    op._set_device(device)  # pylint: disable=protected-access


@contextlib.contextmanager
def automatic_control_dependencies():
    """Adds ``tf.function``'s automatic control edges between the stateful ops created in the
    block when it ends, instead of when the trace ends. Yields ``mark_as_return``, which must
    wrap the block's results.

    Examples:
        >>> import tensorflow as tf
        >>> @tf.function
        ... def step(v):
        ...     with automatic_control_dependencies() as mark_as_return:
        ...         return mark_as_return(v * 2.0)
        >>> float(step(tf.constant(3.0)))
        6.0
    """
    from tensorflow.python.framework import auto_control_deps

    with auto_control_deps.AutomaticControlDependencies() as deps:
        yield lambda structure: tf.nest.map_structure(
            lambda t: deps.mark_as_return(t) if isinstance(t, tf.Tensor) else t, structure)


def automatic_control_edges(ops) -> Dict[str, List[str]]:
    """The control edges ``tf.function``'s automatic control dependencies add between ``ops`` (in
    creation order) when a trace ends, by their rules and with TensorFlow's own view of which
    resources an op reads and which it writes: an op using a resource waits for its last write;
    a write also waits for every read since; stateful ops that touch no resource run one after
    another. Ops marked to run independently get none. Collective ops' manager scopes and
    TF1-style control-flow contexts are left out: a traced step has neither outside a loop body.

    A step's graph has these edges only after its trace ends, so a pass that reads the graph
    while it is traced (lms-tf's) must add them itself to see the order TensorFlow will run.

    Returns:
        Op name -> names of the ops it will wait for (only ops that get an edge).

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     v = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], name="v")
        ...     w = tf.raw_ops.AssignVariableOp(resource=v, value=1.0, name="write")
        ...     r = tf.raw_ops.ReadVariableOp(resource=v, dtype=tf.float32, name="read")
        ...     w2 = tf.raw_ops.AssignAddVariableOp(resource=v, value=r, name="write2")
        >>> automatic_control_edges(g.get_operations())
        {'read': ['write'], 'write2': ['read', 'write']}
    """
    from tensorflow.python.framework import auto_control_deps
    from tensorflow.python.framework import ops as tf_ops

    edges: Dict[str, set] = {}
    last_write: Dict[int, tf.Operation] = {}
    reads_since: Dict[int, List[tf.Operation]] = {}
    last_stateful: Optional[tf.Operation] = None
    for op in ops:
        if (op.type in auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS
                or "_independent_side_effects" in op.node_def.attr):
            continue
        waits: set = set()
        touched = set()
        for tensor, kind in auto_control_deps._get_resource_inputs(op):  # pylint: disable=protected-access
            key = tf_ops.tensor_id(tensor)
            if key in touched:
                continue
            touched.add(key)
            if key in last_write:
                waits.add(last_write[key].name)
            if kind == auto_control_deps.ResourceType.READ_ONLY:
                reads_since.setdefault(key, []).append(op)
            else:
                waits.update(read.name for read in reads_since.pop(key, ()))
                last_write[key] = op
        if not touched and auto_control_deps.op_is_stateful(op):
            if last_stateful is not None:
                waits.add(last_stateful.name)
            last_stateful = op
        waits.discard(op.name)
        if waits:
            edges[op.name] = waits
    return {name: sorted(waits) for name, waits in edges.items()}


def add_control_input(op: tf.Operation, control: tf.Operation) -> None:
    """Adds the control edge ``control -> op``.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        >>> add_control_input(c.op, b.op); [op.name for op in c.op.control_inputs]
        ['b']
    """
    op._add_control_input(control)  # pylint: disable=protected-access


def remove_control_input(op: tf.Operation, control: tf.Operation) -> None:
    """Removes the control edge ``control -> op`` (the others stay).

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        >>> add_control_input(c.op, a.op); add_control_input(c.op, b.op); remove_control_input(c.op, a.op)
        >>> [op.name for op in c.op.control_inputs]
        ['b']
    """
    keep = [other for other in op.control_inputs if other is not control]
    op._remove_all_control_inputs()  # pylint: disable=protected-access
    op._add_control_inputs(keep)  # pylint: disable=protected-access


def set_string_attr(op: tf.Operation, name: str, value: str) -> None:
    """Sets a string attribute such as ``_lms`` on ``op``.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        >>> set_string_attr(c.op, "_lms", "swap_in"); string_attr(c.op, "_lms")
        'swap_in'
    """
    op._set_attr(name, attr_value_pb2.AttrValue(s=value.encode()))  # pylint: disable=protected-access


def set_bool_attr(op: tf.Operation, name: str, value: bool) -> None:
    """Sets a boolean attribute such as ``_grappler_do_not_remove`` on ``op``.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        >>> set_bool_attr(c.op, "_grappler_do_not_remove", True); c.op.get_attr("_grappler_do_not_remove")
        True
    """
    op._set_attr(name, attr_value_pb2.AttrValue(b=value))  # pylint: disable=protected-access


def set_int_attr(op: tf.Operation, name: str, value: int) -> None:
    """Sets an integer attribute such as ``_lms_serial`` on ``op``.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        >>> set_int_attr(c.op, "_lms_serial", 7); c.op.get_attr("_lms_serial")
        7
    """
    op._set_attr(name, attr_value_pb2.AttrValue(i=value))  # pylint: disable=protected-access


def string_attr(op: tf.Operation, name: str) -> Optional[str]:
    """Returns the string attribute ``name`` of ``op``, or None when absent.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        >>> string_attr(c.op, "_lms") is None   # not set
        True
    """
    try:
        value = op.get_attr(name)
    except ValueError:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def clone_op(graph: tf.Graph, op: tf.Operation, inputs: List[tf.Tensor], name: str,
             device: Optional[str] = None) -> tf.Operation:
    """Creates a copy of ``op`` (same type and attributes, on the same device or on ``device``) reading ``inputs``.

    The copy has no control inputs; colocation constraints of the original are dropped.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a, b = tf.constant(1.0, name="a"), tf.constant(2.0, name="b")
        ...     c = tf.identity(a, name="c")
        ...     d = tf.square(a, name="d")
        ...     clone = clone_op(g, d.op, [b], name="d_clone")
        >>> clone.name, [t.name for t in clone.inputs]
        ('d_clone', ['b:0'])
    """
    attrs = {key: value for key, value in op.node_def.attr.items() if key != "_class"}
    with graph.device(op.device if device is None else device):
        return graph._create_op_internal(  # pylint: disable=protected-access
            op.type, inputs, dtypes=[out.dtype for out in op.outputs], name=name, attrs=attrs, op_def=op.op_def)


def is_function_graph(graph: tf.Graph) -> bool:
    """Whether ``graph`` is a ``FuncGraph`` (the graph of a ``tf.function`` being traced).

    Examples:
        >>> import tensorflow as tf
        >>> graph = tf.function(lambda x: x + 1.0).get_concrete_function(tf.TensorSpec(())).graph
        >>> is_function_graph(graph), is_function_graph(tf.Graph())
        (True, False)
    """
    from tensorflow.python.framework import func_graph

    return isinstance(graph, func_graph.FuncGraph)


def is_dead_end(op: tf.Operation) -> bool:
    """Whether nothing reads ``op``: no consumer of an output and no control edge out of it.
    (``tf.Operation`` exposes its outgoing control edges only privately.)

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a = tf.constant(1.0, name="a")
        ...     b = tf.negative(a, name="b")
        >>> is_dead_end(a.op), is_dead_end(b.op)
        (False, True)
    """
    return not any(t.consumers() for t in op.outputs) and not op._control_outputs


def control_outputs(op: tf.Operation) -> List[tf.Operation]:
    """The ops that have a control edge from ``op`` (``tf.Operation`` keeps them privately).

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a = tf.constant(1.0, name="a")
        ...     with tf.control_dependencies([a]):
        ...         b = tf.constant(2.0, name="b")
        >>> [op.name for op in control_outputs(a.op)]
        ['b']
    """
    return list(op._control_outputs)  # pylint: disable=protected-access


def current_graph() -> tf.Graph:
    """The graph ops are being added to: the FuncGraph while a ``tf.function`` traces.

    Examples:
        >>> import tensorflow as tf
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     print(current_graph() is g)
        True
    """
    return tf.compat.v1.get_default_graph()


def infer_shapes_with_inputs(graph: tf.Graph, tensor_shapes: Dict[str, tf.TensorShape]
                             ) -> Dict[str, tf.TensorShape]:
    """Re-runs TensorFlow's shape inference with concrete shapes for some tensors.

    The graph is exported and imported into a scratch graph in which the tensors named in
    ``tensor_shapes`` (placeholders, iterator outputs) are replaced by placeholders of those
    shapes; TensorFlow infers every other op's shape again while importing.

    Returns:
        Tensor name -> inferred shape, for every tensor of the graph.

    Examples:
        >>> import tensorflow as tf
        >>> graph = tf.function(lambda x: x * 2.0).get_concrete_function(tf.TensorSpec((None, 3))).graph
        >>> shapes = infer_shapes_with_inputs(graph, {graph.inputs[0].name: tf.TensorShape((5, 3))})
        >>> shapes[graph.outputs[0].name].as_list()
        [5, 3]
    """
    graph_def = graph.as_graph_def()
    # An imported graph loses its resource handles' shape data, so variable reads come back with an
    # unknown shape and every shape downstream of a weight degrades: feed the reads' traced shapes too.
    known = dict(tensor_shapes)
    for op in graph.get_operations():
        if op.type == "ReadVariableOp" and op.outputs[0].shape.is_fully_defined():
            known.setdefault(op.outputs[0].name, op.outputs[0].shape)
    scratch = tf.Graph()
    with scratch.as_default():
        input_map = {}
        for i, (name, shape) in enumerate(sorted(known.items())):
            dtype = graph.get_tensor_by_name(name).dtype
            input_map[name] = tf.compat.v1.placeholder(dtype, shape=shape, name=f"lms_input_{i}")
        tf.graph_util.import_graph_def(graph_def, input_map=input_map, name="s")
    shapes = {}
    for op in scratch.get_operations():
        if op.name.startswith("s/"):
            for out in op.outputs:
                shapes[out.name[2:]] = out.shape
    return shapes


def function_def(graph: tf.Graph, name: str):
    """The ``FunctionDef`` of function ``name`` registered in ``graph`` (or an outer graph), or None.

    Examples:
        >>> import tensorflow as tf
        >>> f = tf.function(lambda x: tf.while_loop(lambda i: i < 3, lambda i: i + 1, [x]))
        >>> g = f.get_concrete_function(tf.constant(0)).graph
        >>> loop = [op for op in g.get_operations() if "While" in op.type][0]
        >>> function_def(g, loop.get_attr("body").name).signature.name == loop.get_attr("body").name
        True
    """
    while graph is not None:
        found = graph._get_function(name)  # pylint: disable=protected-access
        if found is not None:
            for attribute in ("cached_definition", "definition"):
                definition = getattr(found, attribute, None)
                if definition is not None:
                    return definition
            return None
        graph = getattr(graph, "outer_graph", None)
    return None


def function_body_graph_def(graph: tf.Graph):
    """``graph``'s GraphDef as the runtime sees a function's body, as far as Grappler's shape
    inference goes: each variable's placeholder is an ``_Arg`` carrying the variable's dtype and
    shape (``_handle_dtypes``, ``_handle_shapes``), and each data placeholder of known rank a
    ``PlaceholderWithDefault`` of its shape.

    Grappler reads a variable's shape off those attributes of the ``_Arg`` only: run offline on
    the traced GraphDef, where a variable is a plain resource placeholder, it sees every
    ``ReadVariableOp`` as of unknown shape, and skips rewrites the runtime makes. The arithmetic
    optimizer regroups a gradient's product with a scalar learning rate only when it knows the
    rate is a scalar; the remapper fuses a bias only when it knows the bias's length.

    A data input is not fed at run time: it is a function argument of known shape. Offline,
    Grappler's item builder takes every ``Placeholder`` for a feed, and its shape inference gives a
    feed no shape at all (a feed may have any), as it did an ``_Arg`` with ``_output_shapes``
    (TensorFlow 2.21). Every activation was then of unknown rank offline, and the arithmetic
    optimizer's regrouping of an addition tree (``AddOpsRewrite``, which needs the shapes: a
    LayerNorm's ``x * scale + offset`` parts) was missing from the offline result while the
    runtime made it. A ``PlaceholderWithDefault`` is not a feed and has its ``shape``; its default
    (a ``Fill`` of zeros) is never evaluated as a value of the step.

    Examples:
        >>> import tensorflow as tf
        >>> v = tf.Variable(tf.ones((3,)))
        >>> g = tf.function(lambda x: x * v).get_concrete_function(tf.ones((3,))).graph
        >>> [(n.op, n.attr["_handle_shapes"].list.shape[0].dim[0].size)
        ...  for n in function_body_graph_def(g).node if n.op == "_Arg"]
        [('_Arg', 3)]
        >>> [(n.name, n.op) for n in function_body_graph_def(g).node if n.name == "x"]
        [('x', 'PlaceholderWithDefault')]
    """
    from tensorflow.python.ops import handle_data_util

    graph_def = graph.as_graph_def()
    index = 0
    defaults = []
    for node in graph_def.node:
        if node.op != "Placeholder":
            continue
        if node.attr["dtype"].type != tf.resource.as_datatype_enum:
            defaults += _shaped_default(node)
            continue
        data = handle_data_util.get_resource_handle_data(graph.get_operation_by_name(node.name).outputs[0])
        if data is None or not data.is_set or not data.shape_and_type:
            continue  # unknown to the runtime too
        node.op = "_Arg"
        node.ClearField("attr")
        node.attr["T"].type = tf.resource.as_datatype_enum
        node.attr["index"].i = index
        index += 1
        node.attr["_handle_dtypes"].list.type.extend(entry.dtype for entry in data.shape_and_type)
        node.attr["_handle_shapes"].list.shape.extend(entry.shape for entry in data.shape_and_type)
    graph_def.node.extend(defaults)
    return graph_def


def _shaped_default(node) -> list:
    """Turns data placeholder ``node`` into a ``PlaceholderWithDefault`` of its shape, and returns
    the nodes of its default (zeros), or leaves it a ``Placeholder`` when its rank is unknown (as
    the runtime's argument's is). With a dimension unknown (a batch of any size) the default's
    sizes are themselves a placeholder: a default of a made-up size would let Grappler fold the
    step's shapes to that size, which the runtime cannot."""
    shape, dtype = tf.TensorShape(node.attr["shape"].shape), tf.as_dtype(node.attr["dtype"].type)
    if shape.rank is None or not dtype.is_numpy_compatible:
        return []
    zero_value = b"" if dtype == tf.string else dtype.as_numpy_dtype(0)
    if shape.is_fully_defined():
        dims = tf.compat.v1.NodeDef(name=f"{node.name}/lms_default_shape", op="Const")
        dims.attr["dtype"].type = tf.int64.as_datatype_enum
        dims.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(shape.as_list(), tf.int64))
    else:
        dims = tf.compat.v1.NodeDef(name=f"{node.name}/lms_default_shape", op="Placeholder")
        dims.attr["dtype"].type = tf.int64.as_datatype_enum
        dims.attr["shape"].shape.CopyFrom(tf.TensorShape([shape.rank]).as_proto())
    zero = tf.compat.v1.NodeDef(name=f"{node.name}/lms_default_zero", op="Const")
    zero.attr["dtype"].type = dtype.as_datatype_enum
    zero.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(zero_value, dtype))
    fill = tf.compat.v1.NodeDef(name=f"{node.name}/lms_default", op="Fill", input=[dims.name, zero.name])
    fill.attr["T"].type = dtype.as_datatype_enum
    fill.attr["index_type"].type = tf.int64.as_datatype_enum
    node.op = "PlaceholderWithDefault"
    node.input.append(fill.name)
    return [dims, zero, fill]


def op_is_stateful(op_type: str) -> bool:
    """Whether TensorFlow registers ``op_type`` as stateful (True for a type it does not know).

    Examples:
        >>> op_is_stateful("ReadVariableOp"), op_is_stateful("Relu")
        (True, False)
    """
    from tensorflow.python.framework import op_def_registry

    op_def = op_def_registry.get(op_type)
    return True if op_def is None else bool(op_def.is_stateful)


def traced_variables(graph: tf.Graph) -> List[tf.Variable]:
    """The variables a ``tf.function`` being traced has read so far (its ``variables`` are set only
    when the trace ends).

    Examples:
        >>> v = tf.Variable(1.0)
        >>> @tf.function
        ... def f():
        ...     seen.extend(traced_variables(tf.compat.v1.get_default_graph()))
        ...     return v + 1.0
        >>> seen = []
        >>> _ = f.get_concrete_function(); seen == [] or seen[0] is v
        True
    """
    watched = list(getattr(graph, "_watched_variables", ()))  # pylint: disable=protected-access
    return watched + [v for v in getattr(graph, "variables", ()) if all(v is not w for w in watched)]


#: The parts of a ``ResourceVariable`` that name its resource; :func:`move_variable_in_place` swaps them.
_RESOURCE_ATTRS = ("_handle", "_cached_value", "_graph_element", "_initializer_op", "_is_initialized_op")


def move_variable_in_place(variable: tf.Variable, device: str, graph: Optional[tf.Graph] = None) -> None:
    """Moves ``variable`` to ``device`` keeping the Python object: a new resource there takes its
    value, and the object (so every Keras variable, optimizer index and tape that holds it) now
    names that resource. ``weights="auto"`` decides where a variable lives while the step is
    traced, after the step has read it: ``graph`` (the trace) is re-pointed from the old handle to
    the new one. Other functions traced before keep the old resource: they must be traced again.

    Examples:
        >>> v = tf.Variable([1.0, 2.0])
        >>> move_variable_in_place(v, "/CPU:0")
        >>> v.device.endswith("CPU:0"), v.numpy().tolist()
        (True, [1.0, 2.0])
    """
    old_handle = variable.handle
    with tf.init_scope(), tf.device(device):
        moved = tf.Variable(variable.read_value(), dtype=variable.dtype, trainable=variable.trainable,
                            name=variable.name.split(":")[0], aggregation=variable.aggregation,
                            synchronization=variable.synchronization)
    missing = [attr for attr in _RESOURCE_ATTRS if not hasattr(variable, attr)]
    if missing:
        raise LMSError(f"TensorFlow {tf.__version__}'s ResourceVariable lacks {missing}, which lms-tf swaps to "
                       f"move a variable to the host (weights='auto'). Use weights='host' with "
                       f"lms_tf.place_weights, or a tested TensorFlow (see README).")
    for attr in _RESOURCE_ATTRS:
        setattr(variable, attr, getattr(moved, attr))
    if graph is not None:
        captures = graph._function_captures  # pylint: disable=protected-access
        pairs = list(graph.captures)
        if any(external is old_handle for external, _ in pairs):
            captures.reset_captures([variable.handle if external is old_handle else external for external, _ in pairs],
                                    [internal for _, internal in pairs])


@contextlib.contextmanager
def place_with_inputs(graph: tf.Graph):
    """While active, an op created in ``graph`` with no device goes where its inputs are: where the
    variable it reads lives (a captured variable's handle carries no device inside the trace, its
    outer resource does), else the device of its largest input that has one (a variable read
    counts as its variable's). Ops with neither (constants) stay unplaced.

    A Keras optimizer's update of many variables in one call (one iteration counted) then runs
    each variable's arithmetic beside that variable, instead of on the function's default device.
    Uses a device function, which only graph-mode ``Graph.device`` accepts.

    Examples:
        >>> with tf.device("/CPU:0"):
        ...     v = tf.Variable(tf.ones((2,)))
        >>> @tf.function
        ... def f():
        ...     with place_with_inputs(tf.compat.v1.get_default_graph()):
        ...         return v * 2.0
        >>> op = next(o for o in f.get_concrete_function().graph.get_operations() if o.type == "Mul")
        >>> op.device.endswith("CPU:0")
        True
    """
    resource_devices: Dict[str, str] = {}

    def resource_device(tensor: tf.Tensor) -> str:
        if tensor.op.name not in resource_devices:
            for external, internal in graph.captures:
                if internal.dtype == tf.resource:
                    resource_devices[internal.op.name] = getattr(external, "device", "") or ""
            resource_devices.setdefault(tensor.op.name, "")  # not captured: scanned once
        return resource_devices.get(tensor.op.name, "") or tensor.op.device

    def placed(tensor: tf.Tensor) -> str:
        if tensor.op.type == "IdentityN":  # passes on many tensors (Keras's all-reduce of every gradient)
            return placed(tensor.op.inputs[tensor.value_index])
        if tensor.dtype == tf.resource:
            return resource_device(tensor)
        if tensor.op.device:
            return tensor.op.device
        # A variable read is made outside every device scope (``colocate_with(ignore_existing)``)
        # and placed beside its variable by the runtime: read that variable's device.
        return next((resource_device(t) for t in tensor.op.inputs if t.dtype == tf.resource), "")

    def size(tensor: tf.Tensor) -> float:
        elements = tensor.shape.num_elements() if tensor.shape.rank is not None else None
        return float("inf") if elements is None else elements

    def device_of(op: tf.Operation) -> str:
        if op.device:
            return op.device
        # The largest input decides: ``learning_rate * gradient`` goes with the gradient, not
        # with the scalar (which would carry the gradient to the learning rate's device).
        candidates = [(size(t), -i, device) for i, t in enumerate(op.inputs) for device in [placed(t)] if device]
        return max(candidates)[2] if candidates else ""

    with graph.device(device_of):
        yield
