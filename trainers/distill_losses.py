"""Scalable Transformers' training stages: the stage plan, word-level self-distillation, width-dependent dropout.

Li et al., "Scalable Transformers for Neural Machine Translation", sec. 3.3 and 4.1:

* stage 1, ``joint`` (eq. 4): ``L_1 = L_ce(T_max(S); G) + sum_T L_ce(T(S); G)``;
* stage 2, ``word_distill`` (the L_2 loss of sec. 3.3, annealed by eq. 5):
  ``L_2 = L_ce(T_max(S); G) + lambda_2 sum_T L_ce(T(S); G) + (1 - lambda_2) sum_T L_ce(T(S); T_max(S))``,
  where ``T_max(S)`` is the widest sub-Transformer's word distribution of the same step, a constant
  target (no gradient flows into the widest through the last term);
* stage 3, ``seq_distill`` (eq. 6): the same loss with the widest's beam-search translations
  (:mod:`trainers.distill_targets`) in place of G, the widest trained on them alone, lambda_3 fixed (0.1);
* dropout rates that grow with the model width (sec. 4.1, appendix B Table 5).

The losses are pure functions on logits ``[b, t, V]``, summed over non-pad target tokens like
:func:`nas.model.losses.label_smoothed_nll` (the loop divides by the token count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from nas.model.losses import label_smoothed_nll, smoothed_nll_of
from nas.space import JointStage, SeqDistillStage, WordDistillStage

__all__ = ["StagePosition", "stage_at", "anneal_lambda", "soft_cross_entropy", "word_distill_loss",
           "width_dropout_rate", "check_width_dropout", "STAGE_NUMBERS", "teacher_probs"]

Stage = JointStage | WordDistillStage | SeqDistillStage
STAGE_NUMBERS = {"joint": 1, "word_distill": 2, "seq_distill": 3}
"""The paper's number of each stage (reported as the ``stage`` metric)."""


@dataclass(frozen=True)
class StagePosition:
    """Where a global optimizer step falls in ``train.stages``."""
    index: int
    """Position in ``train.stages`` (0-based)."""
    stage: Stage
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


def stage_at(stages: Sequence[Stage], step: int) -> StagePosition:
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


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor,
                       pad_id: int = 0) -> torch.Tensor:
    """``L_ce(T(S); T_max(S))`` of sec. 3.3: cross-entropy of a sub-Transformer's word distribution against
    the widest's, ``-sum_v softmax(teacher)_v log softmax(logits)_v``, summed over non-pad tokens (nats).

    The teacher is detached: no gradient reaches ``teacher_logits``. (It equals KL(teacher || student) plus
    the teacher's entropy, a constant for the student, so the gradients are those of the KL.)

    Args:
        logits: the sub-Transformer's ``[b, t, V]``.
        teacher_logits: the widest's ``[b, t, V]`` on the same batch.
        target: ``[b, t]`` ground-truth ids; only used to mask ``pad_id`` positions.
    Returns:
        float32 scalar.
    """
    teacher = torch.softmax(teacher_logits.detach().float(), dim=-1)  # [b, t, V]
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # [b, t, V]
    ce = -(teacher * lprobs).sum(-1)  # [b, t]
    return ce[target.ne(pad_id)].sum()


def word_distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor, lambda_2: float,
                      epsilon: float, pad_id: int = 0, *, probs: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sub-Transformer's term of the stage-2 loss (sec. 3.3, L_2; lambda_2 from eq. 5):
    ``lambda_2 * L_ce(T(S); G) + (1 - lambda_2) * L_ce(T(S); T_max(S))``.

    The ground-truth term is label-smoothed with ``epsilon`` as in stage 1 (appendix A); the
    distillation term is :func:`soft_cross_entropy` (teacher detached). With ``lambda_2 = 1`` the
    result is exactly the stage-1 loss.

    Args:
        logits: the sub-Transformer's ``[b, t, V]``.
        teacher_logits: the widest sub-Transformer's ``[b, t, V]`` of the same step; with ``probs``, its
            word distribution already computed (:func:`teacher_probs`), so that the students of a batch share
            one softmax.
        target: ``[b, t]`` ground-truth ids; ``pad_id`` positions are ignored.
        lambda_2: weight of the ground truth, in [0, 1].
        epsilon: label smoothing of the ground-truth term.
    Returns:
        (objective, label-smoothed CE against the ground truth, soft CE against the widest), each summed
        over non-pad tokens (nats), float32 scalars.
    Raises:
        ValueError: ``lambda_2`` outside [0, 1].
    """
    if not 0.0 <= lambda_2 <= 1.0:
        raise ValueError(f"lambda_2={lambda_2} is outside [0, 1]")
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # [b, t, V], once for both terms
    hard, _ = smoothed_nll_of(lprobs, target, epsilon, pad_id)
    teacher = teacher_logits.detach() if probs else teacher_probs(teacher_logits)  # [b, t, V]
    ce = -(teacher * lprobs).sum(-1)  # [b, t]
    soft = ce.masked_fill(target.eq(pad_id), 0.0).sum()
    return lambda_2 * hard + (1.0 - lambda_2) * soft, hard, soft


def teacher_probs(teacher_logits: torch.Tensor) -> torch.Tensor:
    """The widest's word distribution ``softmax(teacher_logits)`` ``[b, t, V]``, float32, detached: computed once
    per batch and passed to :func:`word_distill_loss` (``probs=True``) for every student."""
    return torch.softmax(teacher_logits.detach().float(), dim=-1)


def width_dropout_rate(width_dropout: dict[int, float] | None, model_width: int) -> float | None:
    """The ``train.width_dropout`` rate of a sub-Transformer of ``model_width`` channels; None when unset.

    Raises:
        ValueError: ``model_width`` has no rate.
    """
    if width_dropout is None:
        return None
    if model_width not in width_dropout:
        raise ValueError(f"train.width_dropout has no rate for model width {model_width}; "
                         f"add `{model_width}: <rate>` (it has {sorted(width_dropout)})")
    return width_dropout[model_width]


def check_width_dropout(width_dropout: dict[int, float] | None, model_widths: Iterable[int]) -> None:
    """Raise ValueError naming ``train.width_dropout`` unless it has a rate for every model width of the space."""
    if width_dropout is None:
        return
    missing = sorted(set(model_widths) - set(width_dropout))
    if missing:
        raise ValueError(f"train.width_dropout has no rate for model width(s) {missing} of this space "
                         f"(space.model_width.values, else supernet.model_dim); add them, e.g. `{missing[0]}: 0.1`")
