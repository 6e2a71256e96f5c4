"""The optimizer side of every training loop: Adam, the inverse-square-root schedule, batch grouping.

One place for what the supernet (:func:`trainers.train_supernet`), standalone retraining
(:func:`trainers.train_standalone`, ``nas fidelity``) and the fine-tune stage share: Adam with
``betas=(0.9, 0.98)``, ``eps=1e-8`` and the warm-up/inverse-square-root learning-rate schedule of
Vaswani et al. 2017 ("Attention Is All You Need", sec. 5.3, eq. 3), and the grouping of consecutive
batches into one optimizer step (gradient accumulation).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch

__all__ = ["inverse_sqrt_lr", "make_optimizer", "make_scheduler", "batch_groups"]

T = TypeVar("T")


def inverse_sqrt_lr(warmup_steps: int, init_ratio: float = 0.0) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1 over ``warmup_steps``, then ``sqrt(warmup/step)`` (Vaswani et al.
    2017, sec. 5.3 eq. 3, normalised to 1 at the end of the warm-up).

    With ``init_ratio`` r (the first step's rate over the peak, fairseq's ``warmup_init_lr / lr``) the warm-up
    is ``r + (1 - r) * step / warmup_steps``, fairseq's ``inverse_sqrt`` scheduler (our ``step`` 0, the first update,
    is fairseq's ``num_updates`` 0, so the first update runs at ``warmup_init_lr``); r = 0 keeps the warm-up from
    ``1 / warmup_steps`` at the first step.

    Raises:
        ZeroDivisionError: ``warmup_steps`` is 0 when the factor is first called (use
            :func:`make_scheduler`, which maps 0 to a constant rate).
    """
    def factor(step: int) -> float:
        if init_ratio > 0.0 and step < warmup_steps:
            return init_ratio + (1.0 - init_ratio) * step / warmup_steps
        step = max(step, 1)
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))
    return factor


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, *, fused: bool = False) -> torch.optim.Adam:
    """Adam over all of ``model``'s parameters with the Transformer's ``betas=(0.9, 0.98)``, ``eps=1e-8``.

    Args:
        lr: peak learning rate (the schedule multiplies it).
        weight_decay: L2 penalty (Adam's coupled form).
        fused: one fused kernel for all parameters (``DeviceSettings.fused_adam``: CUDA); else PyTorch's
            default (foreach) implementation.
    """
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=weight_decay,
                            fused=True if fused else None)


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int,
                   stage_steps: Sequence[int] = (), *, init_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """The inverse-square-root schedule of :func:`inverse_sqrt_lr` over ``warmup_steps`` optimizer steps;
    ``warmup_steps`` 0: the peak rate throughout (no warm-up, no decay).

    With ``stage_steps`` (the optimizer steps of each training stage, in order), the warm-up and the peak
    restart at every stage's first step, as in Scalable Transformers App. A (each of the three stages has
    its own warm-up, Table 4): the factor follows the step within the stage. The factor is a function of
    the global step alone, so a resumed run continues on the same schedule. ``init_ratio``: the warm-up's start
    over the peak (:func:`inverse_sqrt_lr`; ``train.warmup_init_lr / train.lr``).
    """
    base = inverse_sqrt_lr(warmup_steps, init_ratio) if warmup_steps > 0 else (lambda step: 1.0)
    starts = list(itertools.accumulate(stage_steps, initial=0))[:-1]  # each stage's first global step

    def factor(step: int) -> float:
        start = max((s for s in starts if s <= step), default=0)
        return base(step - start)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def batch_groups(batches: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` batches, one optimizer step each (the last one may be shorter)."""
    group: list[T] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group
