"""Standalone training of one fixed sub-Transformer (``nas fidelity``'s retraining from scratch, the fine-tune
stage from inherited weights): the sandwich rule without the sandwich, one arch per step on the ground truth."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from nas.data import Batch
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch
from nas.space import SweepSpec
from trainers.stages.base import StepInfo, StepOutput
from trainers.stages.sandwich import sandwich_step

__all__ = ["StandaloneTraining"]


@dataclass(frozen=True)
class StandaloneTraining:
    """``arch`` alone on the ground truth, label-smoothed, with the supernet's regularisation
    (Scalable Transformers eq. 4 with one sub-Transformer); ``StepOutput.widest`` is its loss."""

    arch: Arch
    spec: SweepSpec
    autocast: AbstractContextManager

    def step(self, model: SuperTransformer, batches: Sequence[Batch], step: StepInfo) -> StepOutput:
        """See :meth:`trainers.stages.Stage.step`."""
        return sandwich_step(model, batches, [self.arch], None, self.spec, self.autocast, step.ntokens,
                             step=step.step)
