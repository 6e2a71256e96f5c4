"""Training losses: label-smoothed cross-entropy from logits (:func:`label_smoothed_nll`, :func:`smoothed_nll_of`)
and the same loss fused with the tied output layer (:func:`linear_label_smoothed_nll`), which never holds the
``[b, t, V]`` logits."""

from __future__ import annotations

import torch

__all__ = ["label_smoothed_nll", "smoothed_nll_of", "linear_label_smoothed_nll", "FUSED_CHUNK"]

FUSED_CHUNK = 512
"""Target tokens per chunk of :func:`linear_label_smoothed_nll`: a chunk's ``[512, V]`` float32 logits (12 MB at
V = 6,000) stay in a CPU's last-level cache between the passes over them."""


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


def linear_label_smoothed_nll(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, epsilon: float,
                              pad_id: int = 0, *, chunk: int = FUSED_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`label_smoothed_nll` of the logits ``hidden @ weight.T`` (the tied output layer), computed a chunk of
    target tokens at a time, its gradients with it: the ``[b, t, V]`` logits are never held.

    For each token, with ``z`` its logits, ``lse = log sum_j exp z_j`` and ``y`` its target, the loss is
    ``(1 - eps) (lse - z_y) + eps (lse - mean_j z_j)`` (Szegedy et al. 2016, smoothing uniform over the V words, as
    :func:`label_smoothed_nll`), and its gradient ``softmax(z) - (1 - eps) onehot(y) - eps / V``; padding
    contributes nothing. The forward pass computes these per chunk and keeps only ``d loss / d hidden [N, E]`` and
    ``d loss / d weight [V, E]``; the backward pass scales them by the loss's incoming gradient. Against the
    unfused path (``F.linear``, ``log_softmax``, :func:`smoothed_nll_of`) this skips about six passes over the
    ``[N, V]`` logits (``benchmarks/bench_sandwich_step.py --variant unfused_loss`` times the step without it) and their memory (100 MB a
    4,096-token batch at V = 6,000, per sub-Transformer of a sandwich step). Under autocast the matrix products run
    in its dtype and everything else in float32, as the unfused path does.

    Args:
        hidden: ``[..., E]``, what the output layer multiplies.
        weight: ``[V, E]`` (the tied word embedding).
        target: ``[...]`` ids, ``hidden``'s leading shape; ``pad_id`` positions are ignored.
        epsilon: smoothing mass spread uniformly over the vocabulary.
        pad_id: the padding id.
        chunk: target tokens per chunk (memory ``chunk x V`` floats).

    Returns:
        (smoothed loss, plain NLL), both summed over non-pad tokens (nats), float32 scalars; only the first carries
        a gradient (the NLL is for logging).

    Raises:
        ValueError: ``chunk`` below 1, or ``target``'s shape not ``hidden``'s without its last dimension.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target {tuple(target.shape)} must be hidden {tuple(hidden.shape)} without its last "
                         f"dimension")
    args = (hidden.reshape(-1, hidden.size(-1)), weight, target.reshape(-1), float(epsilon), int(pad_id), int(chunk))
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearLabelSmoothedNLL.apply(*args)
    loss, nll, _, _ = _chunked(*args, grads=False)  # scoring (level 1, validation loss): no gradient to compute
    return loss, nll


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int,
             chunk: int, *, grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The loss, the NLL and (``grads``) ``d loss / d hidden [N, E]`` and ``d loss / d weight [V, E]`` (float32) of
    ``hidden [N, E]`` and ``target [N]``, a chunk of tokens at a time (:func:`linear_label_smoothed_nll`)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    vocab = weight.size(0)
    with torch.autocast(device, enabled=False), torch.no_grad():
        w = weight.detach().to(dtype)  # [V, E]
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        losses, nlls = [], []
        for start in range(0, hidden.size(0), chunk):
            h = hidden[start:start + chunk].detach().to(dtype)  # [n, E]
            y = target[start:start + chunk].unsqueeze(-1)  # [n, 1]
            keep = y.ne(pad_id).float()  # [n, 1]
            z = (h @ w.t()).float()  # [n, V] logits
            mean = z.mean(-1, keepdim=True)
            z_y = z.gather(-1, y)
            top = z.amax(-1, keepdim=True)
            z.sub_(top).exp_()  # exp(z - max)
            total = z.sum(-1, keepdim=True)
            lse = top + total.log()
            nll = (lse - z_y) * keep  # [n, 1]
            losses.append(((1.0 - epsilon) * nll + epsilon * (lse - mean) * keep).sum())
            nlls.append(nll.sum())
            if grads:
                z.mul_(keep / total).sub_(keep * (epsilon / vocab))  # softmax - eps / V on kept rows
                z.scatter_add_(-1, y, keep * -(1.0 - epsilon))  # - (1 - eps) onehot(y)
                g = z.to(dtype)
                grad_hidden[start:start + chunk] = (g @ w).float()
                grad_weight += (g.t() @ h).float()
        zero = hidden.new_zeros((), dtype=torch.float32)
        loss = torch.stack(losses).sum() if losses else zero
        nll_sum = torch.stack(nlls).sum() if nlls else zero.clone()
    return loss, nll_sum, grad_hidden, grad_weight


class _LinearLabelSmoothedNLL(torch.autograd.Function):
    """:func:`linear_label_smoothed_nll`'s autograd function (``hidden [N, E]``, ``target [N]``)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon, pad_id, chunk):
        loss, nll_sum, grad_hidden, grad_weight = _chunked(hidden, weight, target, epsilon, pad_id, chunk, grads=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return ((grad_hidden * grad_loss).to(hidden_dtype), (grad_weight * grad_loss).to(weight_dtype),
                None, None, None, None)
