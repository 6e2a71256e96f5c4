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
    sampled sub-Transformers (eq. 4).

    With ``train.inplace_distill`` (BigNAS sec. 3.1, "in-place distillation"; OFA's progressive shrinking
    distils the same way) the students learn from the widest's word distribution from the first step:
    ``L = L_ce(T_max(S); G) + sum_T [lambda L_ce(T(S); G) + (1 - lambda) L_ce(T(S); T_max(S))]`` with
    lambda = ``train.distill_lambda`` (BigNAS: 0), the widest being the first sub-Transformer of the step (the
    widest of the step's layout) and its logits of the same forward pass the detached teacher
    (:func:`~trainers.stages.sandwich_step`): no forward pass is added. BigNAS distils CNN class posteriors;
    here, as in Scalable Transformers' L_2 (sec. 3.3), it is the per-token word distribution.
    """

    context: StageContext

    def step(self, model: SuperTransformer, batches: Sequence[Batch], step: StepInfo) -> StepOutput:
        """See :meth:`trainers.stages.Stage.step`."""
        c = self.context
        tr = c.spec.train
        lam = tr.distill_lambda if tr.inplace_distill else None
        return sandwich_step(model, batches, c.archs.draw(step.step), lam, c.spec, c.autocast, step.ntokens,
                             step=step.step, penalty=c.penalty, rates=c.rates)
