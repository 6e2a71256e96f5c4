"""Proximal initialization (MAT, Fan et al., sec. 3.3): start every branch from one trained branch."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

__all__ = ["proximal_initialize", "load_proximal_source"]

_BRANCH_AXIS = 2
"""Attention parameters are ``[units, paths, branches, ...]``: the branch axis is 2."""


def load_proximal_source(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights of a single-branch model written by nas (``supernet.safetensors`` or ``model.safetensors``).

    Raises:
        FileNotFoundError: the file does not exist (names it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"proximal-initialization checkpoint not found: {path}; fix train.proximal_init")
    return load_file(str(path))


@torch.no_grad()
def proximal_initialize(model: nn.Module, source: dict[str, torch.Tensor]) -> list[str]:
    """Copy ``source`` into ``model``, giving every attention branch the source's branch 0.

    Each tensor of the same name is copied into the leading block of the model's tensor
    (both may differ in width); for attention weights (``*attn.w_in``, ``b_in``, ``w_out``,
    ``b_out``) branch 0 of the source is repeated over all the model's branches, as MAT
    initializes each branch from a pre-trained one-branch Transformer. Returns the names set.
    """
    done = []
    params = dict(model.named_parameters())
    for name, src in source.items():
        dst = params.get(name)
        if dst is None or dst.dim() != src.dim():
            continue
        if "attn." in name and name.rsplit(".", 1)[-1] in ("w_in", "b_in", "w_out", "b_out"):
            src = src.narrow(_BRANCH_AXIS, 0, 1).expand(*src.shape[:_BRANCH_AXIS], dst.size(_BRANCH_AXIS),
                                                         *src.shape[_BRANCH_AXIS + 1:])
        block = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, src.shape))
        dst[block] = src[block].to(dst.dtype)
        done.append(name)
    return done
