"""The logging window: the supernet's per-step losses summed between two reports, reported as means."""

from __future__ import annotations

import time

import torch

from trainers.stages.base import StepOutput

__all__ = ["LossWindow"]

_KEYS = ("widest", "nll", "narrowest", "sampled", "distill")


class LossWindow:
    """Sums of :class:`~trainers.stages.StepOutput` losses, target tokens and steps since the last report."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Empty the window and restart its clock."""
        self.sums = dict.fromkeys(_KEYS, 0.0)
        self.tokens = 0
        self.steps = 0
        self.t0 = time.perf_counter()

    def add(self, out: StepOutput, ntokens: int) -> None:
        """Add one step's per-token losses and its ``ntokens`` target tokens (all ranks); tensors are summed on
        their device (read in :meth:`metrics`)."""
        for key, value in out.to_dict().items():
            self.sums[key] += value
        self.tokens += ntokens
        self.steps += 1

    def metrics(self, optimizer: torch.optim.Optimizer, grad_norm: float | torch.Tensor, *, sampled: int,
                distilled: int) -> dict[str, float]:
        """Per-step means over the window, then :meth:`reset`.

        Returns ``train_loss`` (= ``loss_widest``), ``train_nll``, ``loss_widest``, ``loss_narrowest`` (nats per
        target token), ``tokens_per_s``, ``lr``, ``grad_norm``, ``window_s`` (seconds since the last report),
        and ``loss_sampled`` (mean over ``sampled`` sub-Transformers per step) / ``loss_distill`` (over
        ``distilled`` students per step) when those are non-zero.
        """
        s = {key: float(value) for key, value in self.sums.items()}  # the host waits for the device here only
        grad_norm = float(grad_norm)
        seconds = time.perf_counter() - self.t0
        n = max(self.steps, 1)
        metrics = {"train_loss": s["widest"] / n, "train_nll": s["nll"] / n,
                   "loss_widest": s["widest"] / n, "loss_narrowest": s["narrowest"] / n,
                   "tokens_per_s": self.tokens / max(seconds, 1e-9), "lr": optimizer.param_groups[0]["lr"],
                   "grad_norm": grad_norm, "window_s": seconds}
        if sampled:
            metrics["loss_sampled"] = s["sampled"] / (n * sampled)
        if distilled:
            metrics["loss_distill"] = s["distill"] / (n * distilled)
        self.reset()
        return metrics
