"""Stage 1 of Scalable Transformers, ``joint`` (sec. 3.3 eq. 4): every sub-Transformer of the sandwich learns
from the ground truth, label-smoothed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nas.data import Batch
from nas.model.supernet import SuperTransformer
from trainers.stages.base import StageContext, StepInfo, StepOutput
from trainers.stages.sandwich import sandwich_step

__all__ = ["JointTraining"]


@dataclass(frozen=True)
class JointTraining:
    """``L_1 = L_ce(T_max(S); G) + sum_T L_ce(T(S); G)`` over the widest, the narrowest and ``train.sandwich_k``
    sampled sub-Transformers (eq. 4)."""

    context: StageContext

    def step(self, model: SuperTransformer, batches: Sequence[Batch], step: StepInfo) -> StepOutput:
        """See :meth:`trainers.stages.Stage.step`."""
        c = self.context
        return sandwich_step(model, batches, c.archs.draw(step.step), None, c.spec, c.autocast, step.ntokens,
                             step=step.step, penalty=c.penalty)
