"""Scalable Transformers' word-level self-distillation losses (sec. 3.3), for stages 2 and 3 and in-place
distillation.

Li et al., "Scalable Transformers for Neural Machine Translation", sec. 3.3:

* stage 1, ``joint`` (eq. 4): ``L_1 = L_ce(T_max(S); G) + sum_T L_ce(T(S); G)``;
* stage 2, ``word_distill`` (the L_2 loss of sec. 3.3, annealed by eq. 5):
  ``L_2 = L_ce(T_max(S); G) + lambda_2 sum_T L_ce(T(S); G) + (1 - lambda_2) sum_T L_ce(T(S); T_max(S))``,
  where ``T_max(S)`` is the widest sub-Transformer's word distribution of the same step, a constant
  target (no gradient flows into the widest through the last term);
* stage 3, ``seq_distill`` (eq. 6): the same loss with the widest's beam-search translations
  (:mod:`trainers.distill_targets`) in place of G, the widest trained on them alone, lambda_3 fixed (0.1).

The losses are pure functions on logits ``[b, t, V]``, summed over non-pad target tokens like
:func:`nas.model.losses.label_smoothed_nll` (the loop divides by the token count). Which stage a step is in
and its lambda: :mod:`trainers.stage_plan`.
"""

from __future__ import annotations

import torch

from nas.model.losses import smoothed_nll_of

__all__ = ["soft_cross_entropy", "word_distill_loss", "teacher_probs"]


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
