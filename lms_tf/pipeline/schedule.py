"""The order each pipeline stage runs its micro-batches' forward and backward passes in.

A schedule is data: one tuple of :class:`Task` per stage, in the order that stage runs them.
GPipe runs every forward pass, then every backward pass; 1F1B (PipeDream-Flush) runs ``K - k``
forward passes on stage ``k`` of ``K``, then alternates one backward and one forward, so it
holds at most ``K - k`` micro-batches of activations where GPipe holds all ``M``. Both run each
stage's backward passes in micro-batch order, so gradients accumulate in the same order as a
single device accumulating over the same micro-batches (the sums are then bit-identical).

:func:`run_order` interleaves the stages' task lists into one order that respects the data
dependencies (a forward pass needs the previous stage's forward pass of that micro-batch, a
backward pass needs the next stage's backward pass of it): the order a single process issues
them in, and a check that a schedule cannot deadlock.

Examples:
    >>> [str(t) for t in stage_tasks("1f1b", stages=2, microbatches=3)[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> max_in_flight(stage_tasks("1f1b", stages=2, microbatches=3)[0])
    2
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from lms_tf.core.errors import LMSOptionError
from lms_tf.pipeline.partition import SCHEDULES

FORWARD, BACKWARD = "F", "B"


@dataclasses.dataclass(frozen=True)
class Task:
    """One stage's forward (``"F"``) or backward (``"B"``) pass of one micro-batch.

    Examples:
        >>> str(Task(stage=1, kind="B", microbatch=3))
        'B3'
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def stage_tasks(schedule: str, stages: int, microbatches: int) -> Tuple[Tuple[Task, ...], ...]:
    """Each stage's tasks in the order it runs them.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        stages: Pipeline stages ``K``.
        microbatches: Micro-batches per step ``M``.

    Returns:
        One tuple of tasks per stage.

    Raises:
        LMSOptionError: An unknown schedule, or fewer than one stage or micro-batch.

    Examples:
        >>> [" ".join(map(str, tasks)) for tasks in stage_tasks("gpipe", 2, 2)]
        ['F0 F1 B0 B1', 'F0 F1 B0 B1']
        >>> [" ".join(map(str, tasks)) for tasks in stage_tasks("1f1b", 3, 4)]
        ['F0 F1 F2 B0 F3 B1 B2 B3', 'F0 F1 B0 F2 B1 F3 B2 B3', 'F0 B0 F1 B1 F2 B2 F3 B3']
    """
    if schedule not in SCHEDULES:
        raise LMSOptionError(f"schedule must be 'gpipe' or '1f1b'; got {schedule!r}.")
    if stages < 1 or microbatches < 1:
        raise LMSOptionError(f"a pipeline needs at least one stage and one micro-batch; got stages={stages}, "
                             f"microbatches={microbatches}.")
    result = []
    for k in range(stages):
        forward = [Task(k, FORWARD, m) for m in range(microbatches)]
        backward = [Task(k, BACKWARD, m) for m in range(microbatches)]
        if schedule == "gpipe":
            result.append(tuple(forward + backward))
            continue
        warmup = min(stages - k, microbatches)
        tasks = forward[:warmup]
        for m in range(microbatches):
            tasks.append(backward[m])
            if warmup + m < microbatches:
                tasks.append(forward[warmup + m])
        result.append(tuple(tasks))
    return tuple(result)


def max_in_flight(tasks: Sequence[Task]) -> int:
    """The most micro-batches a stage's task list holds activations for at once (forward passes
    run whose backward pass has not).

    Examples:
        >>> [max_in_flight(t) for t in stage_tasks("1f1b", 4, 8)]
        [4, 3, 2, 1]
    """
    held = most = 0
    for task in tasks:
        held += 1 if task.kind == FORWARD else -1
        most = max(most, held)
    return most


def run_order(per_stage: Sequence[Sequence[Task]]) -> List[Task]:
    """The stages' tasks interleaved in clock ticks: at each tick every stage whose next task's
    inputs are ready runs it. This is the order one process issues them in.

    Raises:
        LMSOptionError: The schedule deadlocks (a task waits for one that waits for it).

    Examples:
        >>> " ".join(f"{t.kind}{t.stage}.{t.microbatch}" for t in run_order(stage_tasks("gpipe", 2, 2)))
        'F0.0 F0.1 F1.0 F1.1 B1.0 B0.0 B1.1 B0.1'
    """
    stages = len(per_stage)
    done = set()
    position = [0] * stages
    order: List[Task] = []

    def ready(task: Task) -> bool:
        if task.kind == FORWARD:
            return task.stage == 0 or (task.stage - 1, FORWARD, task.microbatch) in done
        before = (task.stage, FORWARD, task.microbatch) in done
        return before and (task.stage == stages - 1 or (task.stage + 1, BACKWARD, task.microbatch) in done)

    while any(position[k] < len(per_stage[k]) for k in range(stages)):
        tick = [per_stage[k][position[k]] for k in range(stages)
                if position[k] < len(per_stage[k]) and ready(per_stage[k][position[k]])]
        if not tick:
            stuck = [str(per_stage[k][position[k]]) for k in range(stages) if position[k] < len(per_stage[k])]
            raise LMSOptionError(f"the schedule deadlocks: each stage's next task ({', '.join(stuck)}) waits for "
                                 f"another stage's.")
        for task in tick:
            done.add((task.stage, task.kind, task.microbatch))
            position[task.stage] += 1
        order.extend(tick)
    return order
