"""The one training loop: batches -> stage step -> all-reduce -> clip -> Adam -> AutoShuffle renormalisation
-> schedule, used by :func:`trainers.train_supernet` (sandwich rule in stages, checkpoints, data-parallel) and
:func:`trainers.train_standalone` (one fixed arch: ``nas fidelity``, the fine-tune stage).

What differs between them is passed in: the :class:`~trainers.stages.Stage` of each step, the corpus of each
step (stage 3 trains on other targets), and :class:`LoopHooks` called after each step (logging, evaluation,
checkpoints). The position in the data (``epoch``, ``position`` in batches, ``corpus``) and the step count live
in the caller's ``state`` dict, which a checkpoint stores, so a resumed run takes the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nas.data import TokenBatcher
from nas.model.supernet import SuperTransformer
from trainers.distributed import all_reduce_dict, all_reduce_grads, shard
from trainers.optim import batch_groups
from trainers.stages.base import Stage, StepInfo, StepOutput

__all__ = ["StepResult", "LoopHooks", "run_loop", "optimizer_step"]


@dataclass(frozen=True)
class StepResult:
    """One finished optimizer step, as the hooks see it."""

    step: int
    """Optimizer steps done, this one included (1-based number of this step)."""
    output: StepOutput
    """Its per-token losses (summed over the data-parallel ranks)."""
    grad_norm: float
    """Total gradient norm before clipping."""
    ntokens: int
    """Its target tokens (all ranks)."""
    position: Any
    """The :class:`~trainers.distill.StagePosition` it trained in (None in standalone training)."""


@dataclass(frozen=True)
class LoopHooks:
    """What the loop asks its caller."""

    stage_at: Callable[[int], tuple[Stage, Any]]
    """0-based step -> (its stage, its position passed on as :attr:`StepInfo.position`)."""
    corpus_at: Callable[[int], str]
    """0-based step -> the name of the corpus it trains on (a change starts that corpus at epoch 0)."""
    batcher: Callable[[str], TokenBatcher]
    """Corpus name -> its batcher (may prepare it first: stage 3 writes its targets)."""
    after_step: Callable[[StepResult], None]
    """Called after every optimizer step, the state already advanced."""
    describe: Callable[[int], str] = lambda step: f"step {step}"
    """Names a 1-based step in the non-finite-gradient error."""


def optimizer_step(model: SuperTransformer, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, clip_norm: float, where: str) -> float:
    """Clip the accumulated gradients to ``clip_norm`` (total 2-norm), step Adam, renormalise MUTE's AutoShuffle
    matrices (eq. 17-18) and step the schedule; returns the norm before clipping.

    Raises:
        FloatingPointError: a non-finite gradient norm (names ``where``); nothing is stepped then.
    """
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm at {where}; lower train.lr")
    optimizer.step()
    model.renormalize_autoshuffle_()  # MUTE eq. 17-18
    scheduler.step()
    return grad_norm


def run_loop(model: SuperTransformer, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any], hooks: LoopHooks, *,
             steps: int, accumulate: int, clip_norm: float, device: torch.device, rank: int = 0,
             world: int = 1) -> None:
    """Train until ``state["step"] == steps``.

    Each optimizer step takes ``accumulate`` consecutive batches of the step's corpus, this rank's rows of
    them (``rank::world``), zeroes the gradients, runs the step's :class:`~trainers.stages.Stage`, sums the
    gradients and losses over the ranks (``world`` > 1), then :func:`optimizer_step`. Epochs follow each other
    (``state["epoch"]``, ``state["position"]`` in batches), and a step whose corpus differs from the current
    one starts that corpus at epoch 0.

    Args:
        state: ``step``, ``epoch``, ``position``, ``corpus``; advanced in place (the caller checkpoints it).

    Raises:
        FloatingPointError: a non-finite gradient norm.
    """
    while state["step"] < steps:
        corpus = hooks.corpus_at(state["step"])
        if state["corpus"] != corpus:  # a stage with other targets starts: its own epochs
            state.update(corpus=corpus, epoch=0, position=0)
        batcher = hooks.batcher(corpus)
        for group in batch_groups(batcher.batches(state["epoch"], start=state["position"]), accumulate):
            if hooks.corpus_at(state["step"]) != corpus:
                break
            stage, position = hooks.stage_at(state["step"])
            ntokens = sum(b.ntokens for b in group)
            shards = [s.to(device) for s in (shard(b, rank, world) for b in group) if s is not None]
            optimizer.zero_grad(set_to_none=True)
            out = stage.step(model, shards, StepInfo(state["step"], ntokens, position))
            if world > 1:
                all_reduce_grads(model)
                out = StepOutput(**all_reduce_dict(out.to_dict(), device))
            grad_norm = optimizer_step(model, optimizer, scheduler, clip_norm, hooks.describe(state["step"] + 1))
            state["step"] += 1
            state["position"] += len(group)
            hooks.after_step(StepResult(state["step"], out, grad_norm, ntokens, position))
            if state["step"] >= steps:
                break
        else:
            state["epoch"] += 1
            state["position"] = 0
