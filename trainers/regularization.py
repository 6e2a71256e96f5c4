"""The regularisation of one forward pass in training: MAT's drop-branch rate and the width-dependent dropout.

:func:`step_regularization` decides it (the only place); :func:`regularized` applies it around the
forward pass (the only call site is :func:`trainers.stages.sandwich_step`). Today the model reads the
rates from its state (``model.drop_branch``, every ``nn.Dropout.p``), so :func:`regularized` sets them
for the duration of the forward and restores them after; once the model takes the rates as a forward
argument, that call site passes ``reg`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch
from nas.space import SweepSpec
from trainers.distill import dropout_rate, width_dropout_rate

__all__ = ["Regularization", "drop_branch_at", "step_regularization", "regularized"]


@dataclass(frozen=True)
class Regularization:
    """What one training forward pass drops."""

    drop_branch: float
    """MAT's drop-branch rate rho (Fan et al., "Multi-branch Attentive Transformer", eq. 5-7), in [0, 1)."""
    dropout: float | None
    """Rate of every ``nn.Dropout`` (Scalable Transformers sec. 4.1, by the sub-Transformer's model width);
    None: the model's configured rates."""


def drop_branch_at(rho: float, warmup: int, step: int) -> float:
    """MAT's drop-branch rate rho (eq. 5-7) at 0-based optimizer step ``step``: ``rho * step / warmup``
    during the first ``warmup`` steps, then ``rho`` (``warmup`` 0: ``rho`` throughout)."""
    return rho if warmup <= 0 or step >= warmup else rho * step / warmup


def step_regularization(spec: SweepSpec, step: int, arch: Arch) -> Regularization:
    """The regularisation of ``arch``'s forward pass at 0-based optimizer step ``step``: ``train.drop_branch``
    on the ``train.drop_branch_warmup`` schedule (:func:`drop_branch_at`) and the ``train.width_dropout`` rate of
    the arch's model width (``supernet.model_dim`` when the arch has none).

    Raises:
        ValueError: ``train.width_dropout`` has no rate for the arch's model width.
    """
    tr = spec.train
    return Regularization(drop_branch=drop_branch_at(tr.drop_branch, tr.drop_branch_warmup, step),
                          dropout=width_dropout_rate(tr.width_dropout, arch.model_width or spec.supernet.model_dim))


@contextmanager
def regularized(model: SuperTransformer, reg: Regularization) -> Iterator[None]:
    """Within the block ``model`` trains with ``reg``'s rates; its own rates come back after (also on error)."""
    saved = model.drop_branch
    model.drop_branch = reg.drop_branch
    try:
        with dropout_rate(model, reg.dropout):
            yield
    finally:
        model.drop_branch = saved
