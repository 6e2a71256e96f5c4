"""The logging window: the supernet's per-step losses summed between two reports, reported as means."""

from __future__ import annotations

import time

import torch

from trainers.stages.base import StepOutput

__all__ = ["LossWindow", "format_duration", "timing_text"]

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


def format_duration(seconds: float) -> str:
    """``seconds`` as a log shows it: ``45s``, ``7m12s``, ``1h03m`` (negative counts as 0)."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def timing_text(elapsed_s: float, done: int, total: int) -> str:
    """The time part of a step line, as fairseq's and Hugging Face's trainers print it: ``7m12s, ETA 26m`` after
    ``done`` of ``total`` steps in ``elapsed_s`` seconds, the remaining ``total - done`` steps at the mean rate so
    far (minutes from 1 minute on, else seconds; ``ETA 0s`` at the end). ``done`` 0: no estimate (``ETA ?``)."""
    if done <= 0:
        return f"{format_duration(elapsed_s)}, ETA ?"
    eta = elapsed_s / done * max(total - done, 0)
    return f"{format_duration(elapsed_s)}, ETA {f'{round(eta / 60)}m' if eta >= 60 else format_duration(eta)}"
