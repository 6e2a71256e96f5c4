"""Stage 3 of Scalable Transformers, ``seq_distill`` (sec. 3.3 eq. 6): the widest's beam-search translations
(:mod:`trainers.distill_targets`, which the loop prepares as this stage's corpus) replace the ground truth; the
widest learns from them alone, the others with weight lambda_3 and from the widest's word distribution."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nas.data import Batch
from nas.model.supernet import SuperTransformer
from nas.space import SeqDistillStage
from trainers.stages.base import StageContext, StepInfo, StepOutput
from trainers.stages.sandwich import sandwich_step

__all__ = ["SequenceDistillation"]


@dataclass(frozen=True)
class SequenceDistillation:
    """Eq. 6: the stage-2 loss on the widest's translations, lambda_3 fixed (``train.stages[i].lambda_3``)."""

    context: StageContext

    def step(self, model: SuperTransformer, batches: Sequence[Batch], step: StepInfo) -> StepOutput:
        """See :meth:`trainers.stages.Stage.step`; ``batches`` hold the widest's translations as targets.

        Raises:
            ValueError: ``step.position`` is not in a seq_distill stage.
        """
        stage = step.position.stage if step.position is not None else None
        if not isinstance(stage, SeqDistillStage):
            raise ValueError(f"step {step.step}: sequence distillation needs a position in a seq_distill stage, "
                             f"got {step.position}")
        c = self.context
        return sandwich_step(model, batches, c.archs.draw(step.step), stage.lambda_3, c.spec, c.autocast, step.ntokens,
                             step=step.step, penalty=c.penalty, rates=c.rates)
