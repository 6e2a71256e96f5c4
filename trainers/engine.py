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
from pathlib import Path
from typing import Any

import torch

from nas import faults
from nas.data import TokenBatcher
from nas.atomic import atomic_path
from nas.model.supernet import SuperTransformer
from nas.precision import DeviceSettings, device_settings
from trainers.distributed import all_reduce_dict, all_reduce_grads, shard
from trainers.optim import batch_groups
from trainers.stages.base import Stage, StepInfo, StepOutput

__all__ = ["StepResult", "LoopHooks", "run_loop", "optimizer_step", "save_checkpoint"]


@dataclass(frozen=True)
class StepResult:
    """One finished optimizer step, as the hooks see it."""

    step: int
    """Optimizer steps done, this one included (1-based number of this step)."""
    output: StepOutput
    """Its per-token losses (summed over the data-parallel ranks)."""
    grad_norm: torch.Tensor
    """Total gradient norm before clipping (0-dim, on the training device: ``float`` it where it is logged)."""
    ntokens: int
    """Its target tokens (all ranks)."""
    position: Any
    """The :class:`~trainers.stage_plan.StagePosition` it trained in (None in standalone training)."""


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
    reads_at: Callable[[int], bool] = lambda step: True
    """1-based step -> whether ``after_step`` reads values there (logs, evaluates, checkpoints): with deferred
    checks (CUDA) the gradient norms are checked before such a step's hooks only."""


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a training checkpoint (``torch.save`` of ``state``) through a temporary file and ``os.replace``, so a
    kill leaves the previous checkpoint whole.

    Raises:
        OSError: the disk is full (ENOSPC) or the folder is not writable.
    """
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # a file object: a full disk raises OSError(ENOSPC), not a bare RuntimeError
            torch.save(state, f)
        faults.kill_point("checkpoint_write")  # tests only: a kill with the new file written, not yet renamed


def optimizer_step(model: SuperTransformer, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, clip_norm: float, where: str,
                   check: bool = True) -> torch.Tensor:
    """Clip the accumulated gradients to ``clip_norm`` (total 2-norm; 0: no clipping, the norm is still computed), step Adam, renormalise MUTE's AutoShuffle
    matrices (eq. 17-18) and step the schedule; returns the norm before clipping (a 0-dim tensor on the
    parameters' device).

    Args:
        check: read the norm and refuse a non-finite one before stepping (a host synchronisation); False
            (``DeviceSettings.deferred_checks``): the caller checks the norms later, the step is taken.

    Raises:
        FloatingPointError: ``check`` and a non-finite gradient norm (names ``where``); nothing is stepped then.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm if clip_norm > 0 else math.inf)
    if check and not math.isfinite(float(grad_norm)):
        raise FloatingPointError(f"non-finite gradient norm at {where}; lower train.lr")
    optimizer.step()
    model.renormalize_autoshuffle_()  # MUTE eq. 17-18
    scheduler.step()
    return grad_norm


def run_loop(model: SuperTransformer, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any], hooks: LoopHooks, *,
             steps: int, accumulate: int, clip_norm: float, device: torch.device | DeviceSettings, rank: int = 0,
             world: int = 1) -> None:
    """Train until ``state["step"] == steps``.

    Each optimizer step takes ``accumulate`` consecutive batches of the step's corpus, this rank's rows of
    them (``rank::world``), zeroes the gradients, runs the step's :class:`~trainers.stages.Stage`, sums the
    gradients and losses over the ranks (``world`` > 1), then :func:`optimizer_step`. Epochs follow each other
    (``state["epoch"]``, ``state["position"]`` in batches), and a step whose corpus differs from the current
    one starts that corpus at epoch 0.

    With ``device``'s :attr:`~nas.precision.DeviceSettings.deferred_checks` (CUDA), nothing in a step waits
    for the device: the batches are pinned and copied asynchronously, the losses and the gradient norm stay
    on the device, and the norms are checked only before a step where ``hooks.reads_at`` says the caller
    reads values (log, evaluation and checkpoint steps): a non-finite norm since the last check raises there,
    before that step's hooks run, so no checkpoint holds its weights. Otherwise each norm is checked before
    its optimizer step.

    Args:
        state: ``step``, ``epoch``, ``position``, ``corpus``; advanced in place (the caller checkpoints it).
        device: the training device, or its :class:`~nas.precision.DeviceSettings` (a bare device gets
            :func:`~nas.precision.device_settings`'s).

    Raises:
        FloatingPointError: a non-finite gradient norm.
    """
    settings = device if isinstance(device, DeviceSettings) else device_settings(device)
    device = settings.device
    unchecked: list[torch.Tensor] = []  # norms of the steps taken since the last check (deferred checks)
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
            shards = [s.to(device, settings.pin_memory) for s in (shard(b, rank, world) for b in group)
                      if s is not None]
            optimizer.zero_grad(set_to_none=True)
            out = stage.step(model, shards, StepInfo(state["step"], ntokens, position))
            if world > 1:
                all_reduce_grads(model)
                out = StepOutput(**all_reduce_dict(out.to_dict(), device))
            number = state["step"] + 1
            where = hooks.describe(number)
            if settings.deferred_checks:
                grad_norm = optimizer_step(model, optimizer, scheduler, clip_norm, where, check=False)
                unchecked.append(grad_norm)
                if hooks.reads_at(number):
                    _check_norms(unchecked, number, hooks.describe)
                    unchecked = []
            else:
                grad_norm = optimizer_step(model, optimizer, scheduler, clip_norm, where)
            state["step"] = number
            state["position"] += len(group)
            hooks.after_step(StepResult(state["step"], out, grad_norm, ntokens, position))
            if state["step"] >= steps:
                break
        else:
            state["epoch"] += 1
            state["position"] = 0
    if unchecked:
        _check_norms(unchecked, state["step"], hooks.describe)


def _check_norms(norms: list[torch.Tensor], last: int, describe: Callable[[int], str]) -> None:
    """Raise FloatingPointError if a gradient norm of steps ``last - len(norms) + 1 .. last`` is not finite (one
    host synchronisation for all of them)."""
    finite = torch.isfinite(torch.stack(norms))
    if bool(finite.all()):
        return
    first = last - len(norms) + 1 + int((~finite).nonzero()[0])
    raise FloatingPointError(f"non-finite gradient norm at {describe(first)} (found at {describe(last)}: on CUDA "
                             f"the norms are read at log, evaluation and checkpoint steps only); lower train.lr")
