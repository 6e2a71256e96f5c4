"""Standalone training of one fixed sub-Transformer through the one loop (:mod:`trainers.engine`).

``nas fidelity`` retrains sub-Transformers from scratch with it and the fine-tune stage trains extracted
sub-Transformers on from their inherited weights. It repeats ``train.*`` for one arch: the same batches
(``max_tokens``, ``accumulate``, the data order of ``train.seed``), Adam with the inverse-square-root schedule,
label smoothing, gradient clipping, drop-branch, width dropout and precision; only the sandwich rule is gone
(one arch per step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nas.data import PreparedData, TokenBatcher
from nas.model.supernet import SuperTransformer
from nas.precision import autocast_for, resolve_precision, training_device
from nas.space.arch import Arch
from nas.space import SweepSpec
from trainers.average import SNAPSHOTS, prune_snapshots, save_snapshot
from trainers.engine import LoopHooks, StepResult, run_loop, save_checkpoint
from trainers.optim import make_optimizer, make_scheduler
from trainers.stages.standalone import StandaloneTraining

__all__ = ["train_standalone", "CHECKPOINT"]

CHECKPOINT = "checkpoint.pt"
"""The resumable state of a standalone run in its ``checkpoint_dir``."""


def train_standalone(model: SuperTransformer, arch: Arch, spec: SweepSpec, data: PreparedData, steps: int, *,
                     device: torch.device | str = "cpu",
                     on_step: Callable[[int, float], None] | None = None,
                     lr: float | None = None, warmup_steps: int | None = None,
                     eval_every: int | None = None, on_eval: Callable[[int], None] | None = None,
                     checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None,
                     keep_last: int = 0) -> dict[str, float]:
    """Train ``model`` (a standalone model of ``arch``, or one extracted with inherited weights) for ``steps``
    optimizer steps as ``train.*`` trains the supernet, with ``arch`` alone in each step
    (:class:`~trainers.stages.StandaloneTraining`); leaves it in eval mode.

    With ``checkpoint_dir`` the run is resumable as :func:`trainers.train_supernet` is: every
    ``checkpoint_every`` steps (and after the last) ``checkpoint.pt`` holds the model, the optimizer, the schedule,
    torch's RNG state (dropout, drop-branch) and the data position (epoch, batch), written atomically; a call that
    finds it continues from there, so a killed run rerun ends with the weights of an uninterrupted one. Beside each
    checkpoint a weights-only snapshot ``snapshots/step_XXXXXXXX.safetensors`` is written and the newest
    ``keep_last`` are kept (checkpoint averaging, :func:`trainers.average.average_snapshots`).

    Args:
        on_step: called after each step with (step, label-smoothed loss per target token).
        lr: peak learning rate (default ``train.lr``).
        warmup_steps: linear warm-up steps of the inverse-square-root schedule (default ``train.warmup_steps``;
            0: the peak rate from the first step, no decay).
        eval_every: call ``on_eval`` every this many steps and after the last one (None: never).
        on_eval: called with the step number, the model in eval mode and no autograd (put back in training mode
            afterwards).
        checkpoint_dir: folder of ``checkpoint.pt`` and ``snapshots/`` (None: no checkpoint, no resume).
        checkpoint_every: steps between checkpoints (default ``train.checkpoint_every``).
        keep_last: snapshots kept (0: none).

    Returns:
        ``train_loss`` (label-smoothed cross-entropy per target token, nats, mean of the last 50 steps) and
        ``train_seconds`` (training time of this call and of the calls it resumed).

    Raises:
        FloatingPointError: a non-finite gradient norm (names the step and the arch).
    """
    tr = spec.train
    settings = training_device(device)  # CUDA: TF32, fused Adam, pinned batches, no host sync per step
    device = settings.device
    model.to(device).train()
    optimizer = make_optimizer(model, tr.lr if lr is None else lr, tr.weight_decay, fused=settings.fused_adam)
    peak = tr.lr if lr is None else lr
    scheduler = make_scheduler(optimizer, tr.warmup_steps if warmup_steps is None else warmup_steps,
                               init_ratio=min(tr.warmup_init_lr / peak, 1.0))
    batcher = TokenBatcher(data.corpus("train"), tr.max_tokens, shuffle=True, seed=tr.seed)  # memory-mapped ids
    stage = StandaloneTraining(arch, spec, autocast_for(resolve_precision(tr.precision, device), device))
    state: dict[str, Any] = {"step": 0, "epoch": 0, "position": 0, "corpus": "train", "losses": [],
                             "elapsed_s": 0.0}
    folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
    every = checkpoint_every or tr.checkpoint_every
    if folder is not None and (folder / CHECKPOINT).is_file():
        ckpt = torch.load(folder / CHECKPOINT, weights_only=True, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["torch_rng"].cpu())
        state = dict(ckpt["state"])
    losses: list = list(state["losses"])
    clock = [time.perf_counter()]  # when state["elapsed_s"] was last brought up to date

    def checkpoint() -> None:
        state["losses"] = [float(loss) for loss in losses[-50:]]
        now = time.perf_counter()
        state["elapsed_s"] += now - clock[0]
        clock[0] = now
        if keep_last > 0:  # snapshot first: a kill before the checkpoint re-creates it on resume
            save_snapshot(model.state_dict(), folder / SNAPSHOTS, state["step"], model.config())
            prune_snapshots(folder / SNAPSHOTS, keep_last)
        save_checkpoint(folder / CHECKPOINT, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                              "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                                              "state": state})

    def after_step(result: StepResult) -> None:
        step = result.step
        losses.append(result.output.widest)
        if on_step is not None:
            on_step(step, float(result.output.widest))
        if on_eval is not None and eval_every and (step % eval_every == 0 or step == steps):
            model.eval()
            with torch.no_grad():
                on_eval(step)
            model.train()
        if folder is not None and (step % every == 0 or step == steps):
            checkpoint()

    hooks = LoopHooks(stage_at=lambda step: (stage, None), corpus_at=lambda step: "train",
                      batcher=lambda corpus: batcher, after_step=after_step,
                      describe=lambda step: f"standalone step {step} of {arch.summary()}",
                      reads_at=lambda step: on_step is not None or (folder is not None and (
                          step % every == 0 or step == steps)) or bool(
                          on_eval is not None and eval_every and (step % eval_every == 0 or step == steps)))
    run_loop(model, optimizer, scheduler, state, hooks, steps=steps, accumulate=tr.accumulate,
             clip_norm=tr.clip_norm, device=settings)
    tail = [float(loss) for loss in losses[-50:]]  # waits for the device: train_seconds counts all of its work
    seconds = state["elapsed_s"] + time.perf_counter() - clock[0]
    model.eval()
    return {"train_loss": sum(tail) / max(len(tail), 1), "train_seconds": seconds}
