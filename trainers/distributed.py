"""Data-parallel helpers of the training loop (``torch.distributed``; all no-ops in a single process).

Every rank takes rows ``rank::world`` of each batch, normalises its loss by the global batch's target
tokens and the loop sums the gradients over the ranks, so an optimizer step equals the single-process
step on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nas.data import Batch

__all__ = ["dist_info", "shard", "all_reduce_grads", "all_reduce_dict", "broadcast", "param_sums"]


def dist_info() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without ``torch.distributed``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(batch: Batch, rank: int, world: int) -> Batch | None:
    """Rows ``rank::world`` of a batch (same padded width ``[b / world, s]``); None when this rank gets no row."""
    if world == 1:
        return batch
    rows = slice(rank, None, world)
    tgt_out = batch.tgt_out[rows]
    if tgt_out.size(0) == 0:
        return None
    return Batch(batch.src[rows], batch.tgt_in[rows], tgt_out, int(tgt_out.ne(0).sum()))


def all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over the ranks (one flat all-reduce; missing gradients count as 0)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # [sum of numel]
    torch.distributed.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def all_reduce_dict(values: dict[str, float | torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Sum a dict of floats or 0-dim tensors over the ranks (same keys everywhere; float64): 0-dim tensors on
    ``device``, not read back to the host."""
    keys = sorted(values)
    t = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=device) for k in keys])
    torch.distributed.all_reduce(t)
    return dict(zip(keys, t.unbind(0)))


def broadcast(compute: Callable[[], dict[str, float]], main: bool) -> dict[str, float]:
    """``compute()`` on rank 0, its result on every rank (no collective without ``torch.distributed``)."""
    _, world = dist_info()
    if world == 1:
        return compute()
    box = [compute() if main else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def param_sums(model: torch.nn.Module) -> dict[str, float]:
    """float64 sum of all parameters and of their squares (equal on every data-parallel rank in sync)."""
    with torch.no_grad():
        params = [p.detach().double() for p in model.parameters()]
        return {"param_sum": float(sum(p.sum() for p in params)), "param_sq": float(sum(p.square().sum() for p in params))}
