"""Recompute bases: the recompute-only plans the budget search starts from, cheapest first.

Examples:
    >>> from lms_tf.core import Policies, make_ir
    >>> from lms_tf.cost import CostModel, get_device_spec
    >>> step = PlanningStep.build(make_ir([]), Policies(), device="/device:GPU:0",
    ...                           cost=CostModel(get_device_spec("v100-16gb-pcie3")))
    >>> recompute_bases(step)
    ([('none', {})], {})
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Tuple

from lms_tf.core.plan import TensorDecision
from lms_tf.planner.recompute import articulation_count
from lms_tf.planner.step import PlanningStep
from lms_tf.planner.tflms import make_plan

#: A base's label -> the recompute policy and segment count it was made with.
BasePolicies = Dict[str, Tuple[str, Optional[int]]]


def recompute_bases(step: PlanningStep) -> Tuple[List[Tuple[str, Dict[str, TensorDecision]]], BasePolicies]:
    """Recompute-only starting points, cheapest first: none, "cheap", "sqrt" with several
    segment counts (segments share one gate each, so every op is recomputed at most once),
    or exactly the layers the user named; and the policy each base label was made with.

    Examples:
        >>> recompute_bases.__name__
        'recompute_bases'
    """
    policy = step.policies.recompute
    base_policies: BasePolicies = {}
    if not policy:
        return [("none", {})], base_policies
    if isinstance(policy, tuple):
        return [("named", recompute_only(step, policy))], base_policies
    bases = [("none", {})] if policy == "auto" else []
    if policy in ("auto", "cheap"):
        bases.append(("cheap", recompute_only(step, "cheap")))
        base_policies["cheap"] = ("cheap", None)
    if policy in ("auto", "sqrt"):
        n = articulation_count(step.ir)
        # More segments than sqrt(n) keep more checkpoints but shorter recomputed segments; on
        # the zoo the lowest peaks came from 1.5-2.5x sqrt(n) (a CNN's early segments are large).
        counts = sorted({max(1, round(n ** 0.5 * f)) for f in (1.5, 2.5)})
        for segments in counts if policy == "auto" else [None]:
            label = f"sqrt/{segments or 'default'}"
            bases.append((label, recompute_only(step, "sqrt", segments)))
            base_policies[label] = ("sqrt", segments)
    return bases, base_policies


def recompute_only(step: PlanningStep, policy, segments: Optional[int] = None,
                   also: Optional[Mapping[str, str]] = None) -> Dict[str, TensorDecision]:
    """The RECOMPUTE decisions of ``policy`` alone (no swaps, no budget), with ``also`` checkpoints
    recomputed from the ones before them.

    Examples:
        >>> recompute_only.__name__
        'recompute_only'
    """
    policies = dataclasses.replace(step.policies, swap=False, recompute=policy, budget=None)
    plan = make_plan(step.ir, policies, device=step.device, scope_aliases=step.scope_aliases,
                     sqrt_segments=segments, candidates=step.found, also_recompute=also)
    return {d.tensor: d for d in plan.recomputed}


def compute_floor(step: PlanningStep, recomputed: Mapping[str, TensorDecision]) -> float:
    """Least step time of any plan on this recompute base: the plain step's compute plus its
    clones' (one compute stream; swaps and orderings only add waits).

    Examples:
        >>> compute_floor.__name__
        'compute_floor'
    """
    clones = {(name, d.gate) for d in recomputed.values() for name in d.recompute_ops}
    return step.baseline.compute_time_s + sum(step.op_times[name] for name, _ in clones)
