""":class:`Batch`, the padded ``int64`` tensors of ``b`` sentence pairs that a training or scoring step reads.

Made by :meth:`nas.data.TokenCorpus.collate` (and :func:`nas.data.collate`); torch is imported only where a batch
is made, so the encoding worker processes start without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Batch"]


@dataclass
class Batch:
    """A padded batch of ``b`` sentence pairs.

    Attributes:
        src: ``[b, s]`` int64, source ids + EOS, right-padded with ``PAD_ID``.
        tgt_in: ``[b, t]`` int64, BOS + target ids (decoder input), padded.
        tgt_out: ``[b, t]`` int64, target ids + EOS (labels), padded.
        ntokens: number of non-pad label tokens, ``(tgt_out != PAD_ID).sum()``.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    ntokens: int

    def to(self, device: torch.device | str, pin_memory: bool = False) -> Batch:
        """Return a copy with all tensors on ``device``; ``pin_memory`` (CUDA): through page-locked memory, so the
        copy is asynchronous (``non_blocking``) and the host does not wait for it."""
        tensors = (self.src, self.tgt_in, self.tgt_out)
        if pin_memory:
            tensors = tuple(t.pin_memory() for t in tensors)
        src, tgt_in, tgt_out = (t.to(device, non_blocking=pin_memory) for t in tensors)
        return Batch(src, tgt_in, tgt_out, self.ntokens)
