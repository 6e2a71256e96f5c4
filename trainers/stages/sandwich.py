"""The forward and backward pass every stage shares: a list of sub-Transformers on the same batches, the
first one optionally the teacher of the others (Scalable Transformers sec. 3.3, eq. 4-6; the sandwich rule of
slimmable networks, Yu & Huang 2019, "Universally Slimmable Networks", sec. 3.2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from nas.data import Batch
from nas.model.losses import label_smoothed_nll, linear_label_smoothed_nll
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch
from nas.space import SweepSpec
from trainers.distill_losses import teacher_probs, word_distill_loss
from trainers.regularization_schedule import step_regularization
from trainers.stages.base import SandwichArchs, StepOutput

__all__ = ["SandwichArchs", "sandwich_step"]


def sandwich_step(model: SuperTransformer, batches: Sequence[Batch], archs: Sequence[Arch], lam: float | None,
                  spec: SweepSpec, autocast: AbstractContextManager, ntokens: int, *, step: int = 0,
                  penalty: bool = True, rates: Callable[[Arch], float | None] | None = None) -> StepOutput:
    """Forward and backward of ``archs`` on each of ``batches`` (``archs[0]`` the widest, ``archs[1]`` the
    narrowest, then the sampled ones; or one arch alone); gradients accumulate in ``model``, the caller steps.

    ``lam`` None: every sub-Transformer on the batch's targets (Scalable Transformers eq. 4). Otherwise
    stage 2 (sec. 3.3 L_2 with ``lam`` = lambda_2) or 3 (eq. 6 with ``lam`` = lambda_3, the batch's targets
    being the widest's beam-search translations): the widest on the targets, each other one on
    ``lam * targets + (1 - lam) * the widest's distribution``, the widest's logits ``[b, t, V]`` of this batch
    computed once and reused, detached. Every loss is divided by ``ntokens``, the target tokens of the whole
    step (all accumulated batches, all data-parallel ranks), so the gradient is the step's per-token mean.
    Each forward pass runs under :func:`~trainers.regularization_schedule.step_regularization` of ``step`` (0-based
    optimizer step) and its arch, with ``rates(arch)`` as its dropout when given (``train.dropout_range``,
    :attr:`~trainers.stages.StageContext.rates`); with ``lam`` given, every arch but the first is a student
    (``train.student_dropout: zero`` runs it without dropout). ``penalty``: add MUTE's eq. 20 term (once per step:
    on the first batch).
    The losses returned are 0-dim float64 tensors on the model's device (read them with ``float``): nothing
    here waits for the device.

    Raises:
        ValueError: ``train.width_dropout`` has no rate for an arch's model width; ``lam`` outside [0, 1].
    """
    tr = spec.train
    out: dict[str, float | torch.Tensor] = dict.fromkeys(("widest", "nll", "narrowest", "sampled", "distill"), 0.0)
    regs = [step_regularization(model, spec, step, arch, None if rates is None else rates(arch),
                                student=i > 0 and lam is not None) for i, arch in enumerate(archs)]
    for b, batch in enumerate(batches):
        teacher = None
        for i, (arch, reg) in enumerate(zip(archs, regs)):
            if lam is None:  # no teacher: the loss fused with the output layer, no [b, t, V] logits held
                with autocast:
                    hidden = model(batch.src, batch.tgt_in, arch, reg=reg, features=True)  # [b, t, E]
                    loss, nll = linear_label_smoothed_nll(hidden, _tied_weight(model), batch.tgt_out,
                                                          tr.label_smoothing)
                objective = loss / ntokens
            else:
                with autocast:
                    logits = model(batch.src, batch.tgt_in, arch, reg=reg)  # [b, t, V]
                if i == 0:
                    loss, nll = label_smoothed_nll(logits, batch.tgt_out, tr.label_smoothing)
                    objective = loss / ntokens
                    teacher = teacher_probs(logits)  # one softmax for all students
                else:
                    objective, loss, soft = word_distill_loss(logits, teacher, batch.tgt_out, lam,
                                                              tr.label_smoothing, probs=True)
                    objective = objective / ntokens
                    out["distill"] += _per_token(soft, ntokens)
            if i == 0:
                out["nll"] += _per_token(nll, ntokens)
                if penalty and b == 0 and tr.autoshuffle_penalty > 0:  # MUTE eq. 20: + lambda * sum_k L_p^k
                    objective = objective + tr.autoshuffle_penalty * model.autoshuffle_penalty()
            objective.backward()
            out["widest" if i == 0 else "narrowest" if i == 1 else "sampled"] += _per_token(loss, ntokens)
    return StepOutput(**out)


def _tied_weight(model: torch.nn.Module) -> torch.Tensor:
    """The tied output layer's weight ``[V, E]`` of ``model`` or of the supernet a data-parallel wrapper holds."""
    return getattr(model, "module", model).embed.weight


def _per_token(loss: torch.Tensor, ntokens: int) -> torch.Tensor:
    """A summed loss per target token, float64 on the loss's device: no host synchronisation (the loop reads it
    at log steps), and the same value as Python's ``float(loss) / ntokens`` had."""
    return loss.detach().double() / ntokens
