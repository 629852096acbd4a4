"""Memory and time simulator: replays a step, with or without a plan, on a device.

The step is replayed as TensorFlow's executor runs it on an accelerator: one compute
stream that runs ops in the order they become ready (first ready, first run; ties in
graph order), and one copy stream per direction for swap-outs and swap-ins. Memory follows
TensorFlow's rules:

* an op's outputs are allocated when it starts; a buffer is freed when its last reader
  ends (Identity, IdentityN, StopGradient, Reshape, Squeeze and ExpandDims alias their
  input: Grappler removes identities, and the others share the buffer);
* elementwise kernels reuse an input buffer of the same size that nobody else will read
  (``forward_input_or_allocate_output``), so ``Relu(BiasAdd(...))`` allocates once;
* convolution kernels hold scratch memory about the size of their largest operand while
  they run (cuDNN's workspace on a GPU, im2col buffers of TensorFlow's Eigen kernels on the
  CPU); with ``kernels="onednn"`` (TensorFlow's default CPU kernels on x86) they take none
  from TensorFlow's allocator, but a max pool whose gradient is taken keeps a one-byte-per-
  element workspace from its forward run until that gradient ends;
* variables, constants and the step's inputs are resident (not counted); an update of a
  variable while one of its reads is still pending copies the variable first
  (TensorFlow's copy-on-write), which is counted;
* with a plan, a swapped tensor leaves the device when its swap-out copy ends (and its
  forward readers are done), and a forward op told to wait for that copy starts after it;
  its swap-in is allocated when the copy back starts, right after its trigger op, and
  consumers wait for the copy to end; recompute clones run after their gate and hold their
  outputs until their backward readers end; a plan's orderings hold backward ops back until
  other backward ops ended.

``peak_bytes`` sums the live tensors. TensorFlow's allocator holds whole chunks, which can be
larger: ``simulate(..., allocator=tensorflow_gpu_allocator(...))`` replays the same allocations
through a model of it (:mod:`lms_tf.simulate.allocator`) into ``allocator_peak_bytes``, after
what the pool served before the first step (:func:`pool_history`).

Two rules of TensorFlow's executor decide which buffers are reused and freed when:

* Grappler sorts a commutative op's inputs by name, and an elementwise kernel writes into the
  first input nobody else reads (a gradient sum at a residual connection keeps the buffer of
  the branch whose name sorts first); a kernel's inputs are released in input order;
* Grappler's memory optimizer turns some sums of three or more gradients into additions into
  a temporary variable (``accumulated_sums``): such a sum takes a buffer of its own.

Examples:
    >>> import tensorflow as tf
    >>> from lms_tf.tf.trace import build_ir
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> @tf.function
    ... def f(x):
    ...     return tf.reduce_sum(tf.nn.relu(x * 2.0) + 1.0)
    >>> ir = build_ir(f.get_concrete_function(tf.ones((1024, 256))).graph)
    >>> sim = simulate(ir, cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    >>> sim.peak_bytes // 2**10   # KiB: one 1 MiB buffer, reused in place by Relu and Add (+ the 4-byte sum)
    1024
"""


from __future__ import annotations

from typing import Dict, Iterable, Iterator, Mapping, Optional

from lms_tf.core.errors import LMSOptionError
from lms_tf.core.ir import GraphIR
from lms_tf.core.plan import Plan
from lms_tf.cost.model import CostModel
from lms_tf.simulate.allocator import BFCAllocatorModel
from lms_tf.simulate.lower import lower
from lms_tf.simulate.replay import HOST_UPDATE_ORDERS, Simulation, replay


def simulate(ir: GraphIR, plan: Optional[Plan] = None, *, cost: CostModel, top: Optional[int] = 8,
             priority: Optional[Dict[str, float]] = None,
             op_times: Optional[Mapping[str, float]] = None, log_allocations: bool = False,
             allocator: Optional[BFCAllocatorModel] = None, tie_seed: Optional[int] = None,
             kernels: str = "cudnn", accumulated_sums: Iterable[str] = (),
             host_update: str = "all_at_once") -> Simulation:
    """Replays the step (rewritten by ``plan``, if given) and reports memory and time.

    Args:
        ir: The step's IR (of the plain, un-rewritten step).
        plan: A plan for this IR, or None for the plain step.
        cost: Op and transfer times on the target device.
        top: How many of the largest live buffers to report at the peak (None: all).
        priority: Op name -> rank; among ready ops the lowest rank runs first (e.g. the start
            times of a profiled real step, to replay the order TensorFlow really used).
        op_times: Op name -> predicted seconds, when already computed with ``cost`` (planners
            simulate one step many times).
        log_allocations: Record :attr:`Simulation.allocations`.
        allocator: A fresh model of TensorFlow's allocator (e.g. :func:`tensorflow_cpu_allocator`)
            to replay the step's allocations through: fills :attr:`Simulation.allocator_peak_bytes`.
        tie_seed: For ops with more than :data:`EDGE_SET_INLINE` successors, queue the ops
            their end makes ready in a random order drawn from this seed instead of graph
            order, as TensorFlow's executor does in another process (its order for those comes
            from a hash set of pointers): the spread of the peak over a few seeds is how much
            the prediction depends on it.
        kernels: The kernel library whose scratch memory to model (:data:`KERNEL_LIBRARIES`):
            ``"cudnn"`` on a GPU; on the CPU ``"onednn"`` (TensorFlow's default on x86) or
            ``"eigen"`` (with ``TF_ENABLE_ONEDNN_OPTS=0``).
        accumulated_sums: ``AddN`` ops that Grappler's memory optimizer turns into additions
            into a temporary variable (:func:`lms_tf.tf.diagnostics.grappler_accumulated_sums`):
            their sum takes a buffer of its own instead of writing into an input.
        host_update: With the optimizer update on the host, how the host runs it:
            ``"all_at_once"`` (default; each variable's update starts as its gradient arrives, as on
            a host with a thread for each: the most host memory the update can hold, what
            ``host_peak_bytes`` and ``host_budget=`` count) or ``"one_variable_at_a_time"`` (one
            update finished before the next starts, as on a host with one thread: the least).

    Returns:
        A :class:`Simulation`.

    Raises:
        LMSOptionError: ``kernels`` is not one of :data:`KERNEL_LIBRARIES`, or ``host_update`` not one of
            :data:`HOST_UPDATE_ORDERS`.

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> simulate(GraphIR((), {}, frozenset(), {}), cost=CostModel(get_device_spec("a100-40gb-pcie4"))).peak_bytes
        0
    """
    if host_update not in HOST_UPDATE_ORDERS:
        raise LMSOptionError(f"simulate(host_update=) takes one of {HOST_UPDATE_ORDERS}, got {host_update!r}.")
    return replay(lower(ir, plan, cost, op_times, kernels, frozenset(accumulated_sums)), top=top, priority=priority,
                   log_allocations=log_allocations, allocator=allocator, tie_seed=tie_seed, host_update=host_update)


def simulate_tie_orders(ir: GraphIR, plan: Optional[Plan], seeds: Iterable[int], *, cost: CostModel,
                        op_times: Optional[Mapping[str, float]] = None) -> Iterator[Simulation]:
    """:func:`simulate` with ``tie_seed`` set to each of ``seeds`` in turn, allocations logged
    (the step is built once: planners check one plan in several tie orders).

    Examples:
        >>> from lms_tf.core.ir import GraphIR
        >>> from lms_tf.cost import CostModel, get_device_spec
        >>> [s.peak_bytes for s in simulate_tie_orders(GraphIR((), {}, frozenset(), {}), None, [0, 1],
        ...                                            cost=CostModel(get_device_spec("a100-40gb-pcie4")))]
        [0, 0]
    """
    builder = lower(ir, plan, cost, op_times)
    for seed in seeds:
        yield replay(builder, top=1, priority=None, log_allocations=True, allocator=None, tie_seed=seed)
