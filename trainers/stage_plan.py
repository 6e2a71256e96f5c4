"""Scalable Transformers' stage plan: the stage a global optimizer step falls in, and its lambda (eq. 5-6).

Li et al., "Scalable Transformers for Neural Machine Translation", sec. 3.3, train in three stages, in order
(``train.stages``): ``joint`` (stage 1, eq. 4), ``word_distill`` (stage 2, the ground truth's weight lambda_2
annealed by eq. 5) and ``seq_distill`` (stage 3, eq. 6, lambda_3 fixed). The position in the plan follows from
the global step alone, so a resumed run continues in the same stage at the same j. The stages' losses are in
:mod:`trainers.distill_losses`, their steps in :mod:`trainers.stages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from nas.space import JointStage, SeqDistillStage, WordDistillStage

__all__ = ["StageSpec", "StagePosition", "stage_at", "anneal_lambda", "STAGE_NUMBERS"]

StageSpec = JointStage | WordDistillStage | SeqDistillStage
"""One entry of ``train.stages`` (the schema's model of it)."""
STAGE_NUMBERS = {"joint": 1, "word_distill": 2, "seq_distill": 3}
"""The paper's number of each stage (reported as the ``stage`` metric)."""


@dataclass(frozen=True)
class StagePosition:
    """Where a global optimizer step falls in ``train.stages``."""
    index: int
    """Position in ``train.stages`` (0-based)."""
    stage: StageSpec
    step: int
    """j: steps of this stage already done before this one (0 at the stage's first step)."""

    @property
    def number(self) -> int:
        """The paper's stage number: 1 joint, 2 word_distill, 3 seq_distill."""
        return STAGE_NUMBERS[self.stage.name]

    @property
    def is_last_step(self) -> bool:
        return self.step == self.stage.steps - 1

    @property
    def lambda_2(self) -> float | None:
        """The ground-truth weight lambda_2 of this step (eq. 5) in a word_distill stage; None in a joint stage."""
        if not isinstance(self.stage, WordDistillStage):
            return None
        s = self.stage
        t_j = s.steps // 2 if s.lambda_steps is None else s.lambda_steps  # the paper gives no t_j
        return anneal_lambda(self.step, s.lambda_start, s.lambda_end, t_j)

    @property
    def distill_lambda(self) -> float | None:
        """The weight of the targets for the sub-Transformers: lambda_2 (eq. 5) in a word_distill stage,
        lambda_3 (eq. 6) in a seq_distill stage; None in a joint stage (no distillation)."""
        if isinstance(self.stage, SeqDistillStage):
            return self.stage.lambda_3
        return self.lambda_2


def stage_at(stages: Sequence[StageSpec], step: int) -> StagePosition:
    """The stage of global optimizer step ``step`` (0-based: the number of steps already done).

    Derived from the step alone, so a resumed run continues in the same stage at the same j.

    Raises:
        ValueError: ``step`` is negative or at/after the end of the last stage.
    """
    start = 0
    for index, stage in enumerate(stages):
        if 0 <= step < start + stage.steps:
            return StagePosition(index, stage, step - start)
        start += stage.steps
    raise ValueError(f"step {step} is outside train.stages, which add up to {start} steps")


def anneal_lambda(step: int, start: float, end: float, steps: int) -> float:
    """lambda_2 at step j of a word_distill stage: linear from ``start`` (j = 0) to ``end`` (j >= ``steps``).

    Eq. 5 is the case ``start=1, end=0.5, steps=t_j``: ``1 - 0.5 j / t_j`` for ``j < t_j``, then 0.5.
    ``steps=0`` gives ``end`` throughout.
    """
    if step >= steps:
        return end
    return start + (end - start) * step / steps
