"""The regularisation schedule of training: the rates of one forward pass at one optimizer step (MAT's drop-branch
rate and its warm-up, the width-dependent dropout of Scalable Transformers sec. 4.1, the ``train.dropout_range``
dropout, and ``train.student_dropout``: BigNAS's students without dropout).

:func:`step_regularization` decides it (the only place) and returns the model's
:class:`~nas.model.Regularization`, which the stage passes to the forward call
(``model(src, tgt_in, arch, reg=...)``; the only call site is :func:`trainers.stages.sandwich_step`).
Nothing is set on the model.
"""

from __future__ import annotations

from typing import Iterable

from nas.model.regularization import Regularization
from nas.model.supernet import SuperTransformer
from nas.space import SweepSpec
from nas.space.arch import Arch

__all__ = ["Regularization", "drop_branch_at", "step_regularization", "width_dropout_rate", "check_width_dropout"]


def drop_branch_at(rho: float, warmup: int, step: int) -> float:
    """MAT's drop-branch rate rho (eq. 5-7) at 0-based optimizer step ``step``: ``rho * step / warmup``
    during the first ``warmup`` steps, then ``rho`` (``warmup`` 0: ``rho`` throughout)."""
    return rho if warmup <= 0 or step >= warmup else rho * step / warmup


def step_regularization(model: SuperTransformer, spec: SweepSpec, step: int, arch: Arch,
                        rate: float | None = None, *, student: bool = False) -> Regularization:
    """The regularisation of ``arch``'s forward pass at 0-based optimizer step ``step``: the model's configured
    rates with ``train.drop_branch`` on the ``train.drop_branch_warmup`` schedule (:func:`drop_branch_at`) and the
    ``train.width_dropout`` rate of the arch's model width (``supernet.model_dim`` when the arch has none;
    Scalable Transformers sec. 4.1), when the YAML gives one.

    ``student``: ``arch`` learns from the step's teacher (every sub-Transformer of a distilling step but the
    first). With ``train.student_dropout: zero`` a student runs with dropout, attention dropout and drop-branch
    all 0 (BigNAS sec. 3.1 regularises only the biggest child; AttentiveNAS ``train_attentive_nas.py`` sets
    ``set_dropout_rate(0, 0, ...)`` for every child after the largest); with ``keep`` (default) it is ignored.

    ``rate``: the arch's ``train.dropout_range`` dropout (:attr:`~trainers.stages.StageContext.rates`),
    which replaces the dropout, and scales drop-branch by ``rate / max`` (the widest keeps ``train.drop_branch``,
    the narrowest gets ``drop_branch * min / max``). Scalable Transformers scales dropout only; MAT has one rho
    for one model. Drop-branch is scaled too because it regularises the same way (it drops whole branches and
    FFNs), and a small sub-Transformer that needs no dropout needs no drop-branch either.

    Raises:
        ValueError: ``train.width_dropout`` has no rate for the arch's model width.
    """
    tr = spec.train
    if student and tr.student_dropout == "zero":
        return model.regularization(dropout=0.0, attention_dropout=0.0, drop_branch=0.0)
    rho = drop_branch_at(spec.drop_branch, tr.drop_branch_warmup, step)
    if rate is not None:
        high = tr.dropout_range[1] if tr.dropout_range is not None else 0.0
        return model.regularization(drop_branch=rho * rate / high if high > 0 else 0.0, dropout=rate)
    rate = width_dropout_rate(tr.width_dropout, arch.model_width or spec.supernet.model_dim)
    return model.regularization(drop_branch=rho, **({} if rate is None else {"dropout": rate}))


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
