"""Archs and weights shared by the ONNX and the AOT-compiled decoder tests (``test_onnx.py``, ``test_aot.py``)."""

from __future__ import annotations

import torch

from nas.model import SuperTransformer
from nas.space.arch import Arch, StackArch

PLAIN = Arch(StackArch((32, 32), (64, 64)), StackArch((32, 32), (64, 64)))
# (b) branches, paths and units in both stacks; (c) a decoder Prime layer with kernels (causal conv cache);
# (d) HAT's arbitrary encoder-decoder attention: decoder layer 0 attends to both encoder layers.
MIXED = Arch(StackArch((32, 32), (64, 64), (2, 1), (2, 1), (), (), (2, 1), (), ("sequential", "independent")),
             StackArch((32, 16), (64, 32), (2, 2), (2, 1), ("sequential", "prime"), ((), (3, 5)), (2, 1),
                       (), ("sequential", "independent"), (2, 1)))
MIXED_MAXIMA = Arch(StackArch((32, 32), (64, 64), (2, 2), (2, 2), (), (), (2, 2)),
                    StackArch((32, 32), (64, 64), (2, 2), (2, 2), ("sequential", "sequential+prime"), ((), (3, 5)),
                              (2, 2), encoder_attention=(2, 2)))


def varied(model: SuperTransformer) -> SuperTransformer:
    """Add N(0, 0.3) noise to every weight: a fresh model's greedy output repeats one token,
    which would hide a misplaced cache row; this one varies with position and source."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()
