"""``nas.space.params.arch_params``, the torch-free parameter count of a sub-Transformer, against the real
model: ``count_params(extract(supernet, arch))`` of tiny supernets built by ``nas.builders.build_supernet``."""

from __future__ import annotations

import random

import pytest
import torch

from nas.builders import build_supernet
from nas.model.supernet import SuperTransformer, count_params, extract
from nas.space.arch import Arch, StackArch
from nas.space.params import ModelSizes, arch_params
from nas.space.space import SearchSpace
from nas.space import parse_spec

VOCAB = 37


def _spec(space: dict, **supernet):
    return parse_spec({
        "name": "t",
        "data": {"train": {"src": "a.en", "tgt": "a.de"}, "valid": {"src": "b.en", "tgt": "b.de"}},
        "supernet": {"model_dim": 16, "heads": 2, "encoder_layers": 2, "decoder_layers": 2, "ffn_width": 32,
                     "max_positions": 16, **supernet},
        "space": space,
    })


SPACES = {
    "mat": (dict(branches=2), {"encoder_layers": {"values": [1, 2]}, "width": {"values": [8, 16], "per_layer": True},
                               "ffn_width": {"values": [16, 32], "per_layer": True},
                               "branches": {"values": [1, 2], "per_layer": True}}),
    "paths_units": (dict(paths=3, more_features=True, units=2),  # relative positions: 16 by default with units
                    {"paths": {"values": [1, 2, 3], "per_layer": True}, "units": {"values": [1, 2], "per_layer": True},
                     "unit_dependency": {"values": ["sequential", "independent"], "per_layer": True,
                                        "when": {"units": [2]}}}),
    "prime": (dict(kernels=[3, 7], head_dim=4, relative_positions=2),
              {"layout": {"values": ["sequential", "prime"], "per_layer": True},
               "width": {"values": [8, 16], "per_layer": True},
               "kernels": {"values": [[], [3], [3, 7]], "per_layer": True, "when": {"layout": "prime"}}}),
    "type1": (dict(), {"model_width": {"values": [8, 16]}, "width": {"tie": "model_width"},
                       "ffn_width": {"tie": "model_width", "scale": 2}, "decoder_layers": {"values": [1, 2]}}),
}


def _archs(space: SearchSpace, n: int = 6) -> list[Arch]:
    rng = random.Random(0)
    ends = [space.narrowest(), space.widest(), space.middle()]
    ends += [space.widest(layout) for layout in space.layouts[1:]]
    return ends + [space.sample(rng) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(SPACES))
def test_the_count_of_an_arch_equals_its_extracted_model_s(name):
    supernet_kw, space_kw = SPACES[name]
    spec = _spec(space_kw, **supernet_kw)
    space = SearchSpace.from_spec(spec)
    torch.manual_seed(0)
    supernet = build_supernet(spec, VOCAB)
    embedding = VOCAB * supernet.embed_dim
    with_embedding = ModelSizes.from_config(supernet.config(), with_embedding=True)
    for arch in _archs(space):
        expected = count_params(extract(supernet, arch))
        assert arch_params(arch, with_embedding) == expected, arch.summary()
        assert space.params(arch) == expected - embedding, arch.summary()  # the space counts without it


def test_the_count_follows_a_fixed_head_count_where_the_head_width_is_not_fixed():
    """``head_dim=None`` (models saved before it existed): the relative tables are ``width / heads`` wide."""
    stack = StackArch(width=(8, 16), ffn_width=(8, 32), units=(2, 1))
    maxima = Arch(StackArch(width=(16, 16), ffn_width=(32, 32), units=(2, 2)), stack)
    supernet = SuperTransformer(VOCAB, 16, 2, maxima, relative_positions=3, max_positions=16)
    sizes = ModelSizes.from_config(supernet.config(), with_embedding=True)
    for arch in (Arch(stack, stack), maxima):
        assert arch_params(arch, sizes) == count_params(extract(supernet, arch))
