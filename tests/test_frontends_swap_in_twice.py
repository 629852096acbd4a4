"""Swapped tensors brought back twice around an op (the planner's ``swap_in_twice``), rewritten.

Every swapped tensor that has backward readers on both sides of an op is swapped in twice around
it (the first swap-in's readers, then that op, which waits for them, then the second swap-in),
on the front-ends' own plans, and the step must train exactly as the plain one, with both
copies and the wait in the graph and in the executed order. On logical CPUs the copies move no
bytes, but the executor orders them as on a GPU. The planner's side: tests/test_planner_swap_in_twice.py.
"""

import dataclasses

import pytest
import tensorflow as tf

from lms_tf import _compat
from lms_tf.core.policy import Policies
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.timing import Tools, assemble, ops_between_readers, split_swap_ins
from lms_tf.tf import driver
from lms_tf.tf.diagnostics import executed_ops, find_executed
from lms_tf.tf.rewrite import LMS_ATTR
from tests import zoo
from tests.helpers import CPU_LMS, assert_same_numbers, custom_loop, first_batch, lms_function

OPTIONS = dict(CPU_LMS, budget="85%", recompute=False, device_spec="v100-16gb-pcie3", min_swap_bytes=0)


def swapped_in_twice(ir, plan, request):
    """``plan`` with every swapped tensor that has readers on both sides of an op swapped in twice
    around the first such op."""
    step = PlanningStep.build(ir, Policies.from_dict(plan.policies), device=request.device,
                              cost=request.cost_model())
    split = {}
    for decision in plan.swapped:
        between = ops_between_readers(step, decision.tensor)
        if between:
            split[decision.tensor] = between[0]
    twice = assemble(step, {d.tensor for d in plan.swapped}, {}, Tools(), plan.orderings, weights=plan.weights,
                     split=split)
    return dataclasses.replace(plan, decisions=twice.decisions, orderings=twice.orderings)


@pytest.fixture
def twice_plans(monkeypatch):
    planned = driver._make_plan
    monkeypatch.setattr(driver, "_make_plan", lambda ir, request, aliases, **kwargs: swapped_in_twice(
        ir, planned(ir, request, aliases, **kwargs), request))


@pytest.mark.timeout(300)
def test_a_custom_loop_with_tensors_swapped_in_twice_equals_plain_and_runs_in_that_order(twice_plans):
    """A hand-written step on a stack of convolutions: each layer's input is read by its filter
    gradient and by the previous layer's ``ReluGrad``, with the input gradient between them."""
    plain = custom_loop(zoo.sequential_cnn, tf.function)
    rewritten = custom_loop(zoo.sequential_cnn, lms_function(**OPTIONS))
    assert_same_numbers(plain, rewritten)
    fn = rewritten[2]
    plan = fn.plan
    split = split_swap_ins(plan)
    assert len(split) >= 2, plan.summary()
    xb, yb = first_batch(zoo.sequential_cnn)
    graph = fn.get_concrete_function(xb, yb).graph
    # Structure: two swap-ins of each such tensor, the second triggered by the op, which waits
    # (through an ordering barrier) for the first swap-in's readers.
    swap_ins = {op.name for op in graph.get_operations() if _compat.string_attr(op, LMS_ATTR) == "swap_in"}
    events = executed_ops(lambda: fn(xb, yb))
    checked = 0
    for i, decision in enumerate(plan.swapped):
        if decision.tensor not in split:
            continue
        op = split[decision.tensor]
        first, second = decision.swap_ins
        assert {f"lms_tf/swap_in_{i}_0", f"lms_tf/swap_in_{i}_1"} <= swap_ins, (i, decision.tensor)
        assert second.trigger == op
        barriers = [c for c in graph.get_operation_by_name(op).control_inputs
                    if _compat.string_attr(c, LMS_ATTR) == "order"]
        assert any({a.name for a in b.control_inputs} >= set(first.consumers) for b in barriers), op
        # Executed order: the first copy's readers end before the op starts; the second copy
        # leaves the host after the op ended, and before its readers start.
        ran = {name: find_executed(events, name) for name in (op,) + first.consumers + second.consumers}
        sends = [e for e in events if e.node.startswith(f"lms_tf/swap_in_{i}_1/") and e.type == "_Send"]
        assert sends, decision.tensor
        if ran[op] is not None:
            for reader in first.consumers:
                if ran[reader] is not None:
                    assert ran[reader].end_ps <= ran[op].start_ps, (reader, op)
            assert ran[op].end_ps <= sends[0].start_ps, (op, decision.tensor)
            checked += 1
        for reader in second.consumers:
            if ran[reader] is not None:
                assert sends[0].start_ps <= ran[reader].start_ps, (reader, decision.tensor)
    assert checked >= 2, checked

