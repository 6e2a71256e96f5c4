"""Training losses."""

from __future__ import annotations

import torch

__all__ = ["label_smoothed_nll"]


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Label-smoothed cross-entropy (Szegedy et al. 2016), summed over non-pad tokens.

    Args:
        logits: ``[b, t, V]``.
        target: ``[b, t]`` ids; ``pad_id`` positions are ignored.
        epsilon: smoothing mass spread uniformly over the vocabulary.
    Returns:
        (smoothed loss, plain NLL), both summed over tokens (nats), float32 scalars.
    """
    return smoothed_nll_of(torch.log_softmax(logits.float(), dim=-1), target, epsilon, pad_id)


def smoothed_nll_of(lprobs: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`label_smoothed_nll` from log-probabilities ``lprobs [b, t, V]`` (float32) already computed."""
    mask = target.ne(pad_id)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [b, t]
    smooth = -lprobs.mean(-1)  # [b, t]
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    # masked_fill, not loss[mask]: boolean indexing sizes its output from the data, a host synchronisation on CUDA
    return loss.masked_fill(~mask, 0.0).sum(), nll.masked_fill(~mask, 0.0).sum()
