"""Shared by the latency tests: a small spec whose space varies every feature group, and a tiny untrained supernet
(the fixed workload's latency does not depend on the weights)."""

from __future__ import annotations

import torch

from nas.model.supernet import SuperTransformer
from nas.space import parse_spec
from nas.space.space import SearchSpace

MODEL_DIM = 32

# Per-layer widths, depths, paths/kernels under a layout condition: every feature group varies.
SPACE = {
    "encoder_layers": {"values": [1, 2, 3]},
    "decoder_layers": {"values": [1, 2]},
    "width": {"values": [8, 16, 32], "per_layer": True},
    "ffn_width": {"values": [16, 32, 64], "per_layer": True},
    "branches": {"values": [1, 2], "per_layer": True},
    "layout": {"values": ["sequential", "prime"], "per_layer": True},
    "paths": {"values": [1, 2], "per_layer": True, "when": {"layout": "sequential"}},
    "kernels": {"values": [[], [3]], "per_layer": True, "when": {"layout": "prime"}},
}


def tiny_space(space: dict = SPACE, **supernet) -> tuple[SearchSpace, object]:
    """(space, spec) of a model_dim-32 supernet with ``space`` (default :data:`SPACE`), ``supernet`` keys overriding."""
    raw = {
        "name": "t",
        "data": {"train": {"src": "a.en", "tgt": "a.de"}, "valid": {"src": "b.en", "tgt": "b.de"}},
        "supernet": {"model_dim": MODEL_DIM, "heads": 2, "head_dim": 8, "encoder_layers": 3, "decoder_layers": 2,
                     "kernels": [3], **supernet},
        "space": space,
    }
    spec = parse_spec(raw)
    return SearchSpace.from_spec(spec), spec


def tiny_supernet(seed: int) -> tuple[SearchSpace, SuperTransformer]:
    """A small space (1-2 encoder layers, no Prime) and an untrained supernet for it, seeded, in eval mode."""
    torch.manual_seed(seed)
    space, spec = tiny_space({"encoder_layers": {"values": [1, 2]}, "width": {"values": [16, 32], "per_layer": True},
                              "ffn_width": {"values": [32, 64]}}, encoder_layers=2, decoder_layers=1, kernels=[])
    return space, SuperTransformer(100, MODEL_DIM, 2, space.supernet_maxima(spec), max_positions=64).eval()


def deep_and_shallow():
    """A tiny untrained supernet whose widest arch (2+3 layers) is about twice as slow as its narrowest (1+1)."""
    from nas.model.supernet import SuperTransformer

    torch.manual_seed(0)
    space, spec = tiny_space({"encoder_layers": {"values": [1, 2]}, "decoder_layers": {"values": [1, 3]},
                              "width": {"values": [16, 32], "per_layer": True}, "ffn_width": {"values": [32, 64]}},
                             encoder_layers=2, decoder_layers=3, kernels=[])
    return space, SuperTransformer(100, MODEL_DIM, 2, space.supernet_maxima(spec), max_positions=64).eval()
