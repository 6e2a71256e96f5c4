"""Stage 2 of Scalable Transformers, ``word_distill`` (sec. 3.3 L_2, lambda_2 annealed by eq. 5): the
sub-Transformers also learn from the widest's word distribution of the same step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nas.data import Batch
from nas.model.supernet import SuperTransformer
from trainers.stages.base import StageContext, StepInfo, StepOutput
from trainers.stages.sandwich import sandwich_step

__all__ = ["WordDistillation"]


@dataclass(frozen=True)
class WordDistillation:
    """``L_2 = L_ce(T_max(S); G) + lambda_2 sum_T L_ce(T(S); G) + (1 - lambda_2) sum_T L_ce(T(S); T_max(S))``
    with lambda_2 of eq. 5 at the step's position in the stage."""

    context: StageContext

    def step(self, model: SuperTransformer, batches: Sequence[Batch], step: StepInfo) -> StepOutput:
        """See :meth:`trainers.stages.Stage.step`.

        Raises:
            ValueError: ``step.position`` is not in a word_distill stage.
        """
        lam = step.position.lambda_2 if step.position is not None else None
        if lam is None:
            raise ValueError(f"step {step.step}: word distillation needs a position in a word_distill stage, "
                             f"got {step.position}")
        c = self.context
        return sandwich_step(model, batches, c.archs.draw(step.step), lam, c.spec, c.autocast, step.ntokens,
                             step=step.step, penalty=c.penalty, rates=c.rates)
