"""The serialization step: the step's ops run one at a time, in an order given by rank.

TFLMS called this serialization. Here the order is the simulator's, so the step really
runs in the order its memory was predicted for. This does two things:

- On a CPU, it validates the simulator's memory rules without the executor's scheduling
  noise. TensorFlow's CPU executor picks among ready ops differently from one process to
  the next.
- On a GPU, it makes the simulated peak hold.

What it inserts: a control edge between consecutive ranked ops, in a topological order of the
graph that follows the ranks where the graph allows it. Unranked ops (alias ops, swap copies)
keep their own edges only, so copies still overlap compute.

Only ops that read the step's inputs are chained, directly or through other ops. The step's
inputs are its non-resource placeholders. The ops left free are constants, variable reads,
and what is computed from them alone. Variables created in the first trace (optimizer slots)
have their initializers lifted out of the graph after the trace, and a control input from
the step would make that impossible.

An ``IdentityN`` waits for all of its inputs, and Grappler prunes it. Before the chain is
added, its readers are re-pointed to its inputs, so that a rank order that never waited for
it stays feasible. The values are unchanged.

Example:
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     a = tf.compat.v1.placeholder(tf.float32, name="a")
    ...     b = tf.negative(a, name="b")
    ...     c = tf.sqrt(a, name="c")
    >>> impose_order(g, {"c": 0, "b": 1})
    1
    >>> [op.name for op in g.get_operation_by_name("b").control_inputs]
    ['c']
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Mapping

import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.errors import RewriteError

SERIAL_ATTR = "_lms_serial"  # an op's position in the chain


def bypass_identity_n(graph: tf.Graph) -> int:
    """Re-points every reader of an ``IdentityN`` output to the matching input.

    Returns:
        How many inputs were re-pointed.

    Example:
        >>> bypass_identity_n(tf.Graph())
        0
    """
    moved = 0
    for op in graph.get_operations():
        if op.type != "IdentityN":
            continue
        for position, output in enumerate(op.outputs):
            for reader in list(output.consumers()):
                for index, tensor in enumerate(reader.inputs):
                    if tensor is output:
                        _compat.update_input(reader, index, op.inputs[position])
                        moved += 1
    return moved


def ranked_topological_order(graph: tf.Graph, rank: Mapping[str, float]) -> List[str]:
    """A topological order of ``graph``'s ops (data and control edges).

    Among ready ops, an unranked one goes first (in creation order), then the lowest rank.

    Raises:
        RewriteError: The graph has a cycle.

    Example:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     a = tf.constant(1.0, name="a")
        ...     b, c = tf.negative(a, name="b"), tf.sqrt(a, name="c")
        >>> ranked_topological_order(g, {"b": 1, "c": 0})
        ['a', 'c', 'b']
    """
    ops = graph.get_operations()
    created = {op.name: i for i, op in enumerate(ops)}
    waiting: Dict[str, int] = {}
    readers: Dict[str, List[str]] = {op.name: [] for op in ops}
    for op in ops:
        preds = {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs}
        waiting[op.name] = len(preds)
        for pred in preds:
            readers[pred].append(op.name)

    def key(name: str):
        return (name in rank, rank.get(name, 0.0), created[name], name)

    ready = [key(name) for name, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: List[str] = []
    while ready:
        name = heapq.heappop(ready)[-1]
        order.append(name)
        for reader in readers[name]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, key(reader))
    if len(order) < len(ops):
        stuck = [name for name, count in waiting.items() if count > 0][:5]
        raise RewriteError(f"graph {getattr(graph, 'name', '')!r} has a cycle through {stuck}; "
                           f"it cannot be serialized.")
    return order


def serial_chain(graph: tf.Graph) -> List[tf.Operation]:
    """The ops :func:`impose_order` chained, in chain order (empty for a graph it did not touch).

    Example:
        >>> serial_chain(tf.Graph())
        []
    """
    chained = [op for op in graph.get_operations() if SERIAL_ATTR in op.node_def.attr]
    return sorted(chained, key=lambda op: op.get_attr(SERIAL_ATTR))


def impose_order(graph: tf.Graph, rank: Mapping[str, float]) -> int:
    """Chains the ranked ops of ``graph`` with control edges, in rank order where the graph allows.

    Must run while ``graph`` is being traced, after the automatic control dependencies of
    its stateful ops exist. Otherwise the ones TensorFlow adds when the trace ends can close
    a cycle.

    Args:
        graph: The graph to serialize, in place.
        rank: Op name -> rank; lower runs first.

    Returns:
        The number of control edges added. Each chained op carries its position in the
        ``_lms_serial`` attribute.

    Example:
        >>> g = tf.Graph()
        >>> with g.as_default():
        ...     x = tf.compat.v1.placeholder(tf.float32, name="x")
        ...     y, z = tf.square(x, name="y"), tf.exp(x, name="z")
        >>> impose_order(g, {"y": 1, "z": 0}), [op.name for op in g.get_operation_by_name("y").control_inputs]
        (1, ['z'])
    """
    bypass_identity_n(graph)
    order = ranked_topological_order(graph, rank)
    reads_inputs = set()
    for name in order:
        op = graph.get_operation_by_name(name)
        if (op.type == "Placeholder" and op.outputs[0].dtype != tf.resource
                or any(t.op.name in reads_inputs for t in op.inputs)):
            reads_inputs.add(name)
    chain = [graph.get_operation_by_name(name) for name in order if name in rank and name in reads_inputs]
    for position, op in enumerate(chain):
        _compat.set_int_attr(op, SERIAL_ATTR, position)
    added = 0
    for before, after in zip(chain, chain[1:]):
        if before not in after.control_inputs:
            _compat.add_control_input(after, before)
            added += 1
    return added
