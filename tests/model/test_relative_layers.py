"""``relative_layers``: relative position representations (Shaw et al. 2018, eq. 3-6) only in encoder layers
that run MUTE units ("units"), or in every layer ("all", the format before the choice existed).

MUTE (sec. 4) runs its units on relative positions so that a unit's swap or disorder bias changes what it
computes; a layer running one unit has no such bias, so under "units" it runs on absolute positions only
(its tables get no gradient, and an extracted one-unit layer holds none). Old configs, which have
``relative_positions`` but no ``relative_layers``, keep relative positions in every layer.
"""

from __future__ import annotations

import pytest
import torch

from nas.builders import build_supernet, supernet_config
from nas.export.ct2 import ctranslate2_problem
from nas.model import SuperTransformer
from nas.model.layers import EncoderLayer
from nas.model.supernet import count_params, extract
from nas.space import parse_spec
from nas.space.arch import Arch, LayerArch, StackArch
from nas.space.errors import SpecError
from nas.space.params import ModelSizes, arch_params
from tests.conftest import MULTI30K, tiny_spec_dict

V, C, H = 37, 16, 2
MAXIMA = Arch(StackArch((16, 16, 16), (32, 32, 32), units=(2, 2, 1)), StackArch((16,), (32,)))
"""Encoder layers 0 and 1 may run two units, layer 2 only one."""
ARCH = Arch(StackArch((16, 8, 16), (32, 16, 32), units=(1, 2, 1)), StackArch((16,), (32,)))
"""Layer 0 runs one unit (no relative positions under "units"), layer 1 two (relative positions)."""


def _model(relative_layers: str | None, maxima: Arch = MAXIMA, **kw) -> SuperTransformer:
    """A perturbed supernet with k=3 relative positions (``relative_layers`` None: an old config without the key)."""
    torch.manual_seed(0)
    config = SuperTransformer(V, C, H, maxima, head_dim=8, relative_positions=3, **kw).config()
    config.pop("relative_layers")
    model = SuperTransformer.from_config(config if relative_layers is None else
                                         {**config, "relative_layers": relative_layers}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, V, (2, 9), generator=g), torch.randint(4, V, (2, 5), generator=g)
    src[0, -3:] = 0  # padding in one sentence
    return src, tgt


def _rel_grads(model: SuperTransformer, arch: Arch) -> list[float | None]:
    """Per encoder layer: the summed |gradient| of its relative tables after a backward (None: no tables)."""
    model.zero_grad(set_to_none=True)
    src, tgt = _batch()
    model(src, tgt, arch).square().mean().backward()
    attns = [layer.attn for layer in model.encoder]
    return [None if not hasattr(a, "rel_k") else
            sum(0.0 if p.grad is None else p.grad.abs().sum().item() for p in (a.rel_k, a.rel_v)) for a in attns]


def test_under_units_only_a_layer_running_units_uses_its_relative_tables():
    grads = _rel_grads(_model("units"), ARCH)
    assert grads[0] == 0.0 and grads[1] > 0  # built (max units 2) in both; used where the arch runs 2 units
    assert grads[2] is None  # a layer that can run only one unit has none


def test_a_one_unit_call_under_units_is_the_layer_without_relative_tables():
    torch.manual_seed(0)
    with_rel = EncoderLayer(C, H, 16, 32, 1, max_units=2, head_dim=8, relative=3, relative_layers="units").eval()
    plain = EncoderLayer(C, H, 16, 32, 1, max_units=2, head_dim=8).eval()
    missing = plain.load_state_dict(with_rel.state_dict(), strict=False).unexpected_keys
    assert sorted(missing) == ["attn.rel_k", "attn.rel_v"]
    x, dims = torch.randn(2, 7, C), LayerArch(16, 32, 1, 1, "sequential", (), 1)
    with torch.no_grad():
        assert torch.equal(with_rel(x, dims, None), plain(x, dims, None))
        two = dims._replace(units=2)
        assert not torch.allclose(with_rel(x, two, None), plain(x, two, None), atol=1e-4)


def test_an_old_config_without_the_key_keeps_relative_positions_in_every_layer():
    model = _model(None)
    assert model.config()["relative_layers"] == "all"  # recorded from now on
    assert all(g > 0 for g in _rel_grads(model, ARCH))  # used by one-unit layers too
    assert ModelSizes.from_config({k: v for k, v in model.config().items() if k != "relative_layers"}
                                  ).relative_layers == "all"


def test_the_config_round_trips_relative_layers():
    config = _model("units").config()
    assert config["relative_layers"] == "units"
    again = SuperTransformer.from_config(config)
    assert again.relative_layers == "units" and sorted(again.state_dict()) == sorted(_model("units").state_dict())
    with pytest.raises(ValueError, match="relative_layers='some'"):
        SuperTransformer.from_config({**config, "relative_layers": "some"})


PRIME_MAXIMA = Arch(StackArch((16, 16), (32, 32), paths=(2, 1), layout=("sequential+prime", "prime"),
                              kernels=((3,), (3,)), units=(2, 2)), StackArch((16,), (32,)))
PRIME_ARCHS = (Arch(StackArch((16, 8), (32, 16), layout=("prime", "prime"), kernels=((3,), ()), units=(1, 2)),
                    StackArch((8,), (16,))),
               Arch(StackArch((16, 16), (32, 32), paths=(2, 1), layout=("sequential", "prime"), units=(2, 1)),
                    StackArch((16,), (32,))))


@pytest.mark.parametrize("relative_layers", ["units", "all", None])
@pytest.mark.parametrize("share_layouts", [True, False])
def test_an_extracted_arch_has_the_supernet_s_logits_and_its_counted_parameters(relative_layers, share_layouts):
    for maxima, archs in ((MAXIMA, (ARCH, MAXIMA)), (PRIME_MAXIMA, PRIME_ARCHS)):
        model = _model(relative_layers, maxima, share_layouts=share_layouts)
        sizes = ModelSizes.from_config(model.config(), with_embedding=True)
        src, tgt = _batch()
        assert arch_params(maxima, sizes) == count_params(model)
        for arch in archs:
            with torch.no_grad():
                sub = extract(model, arch).eval()
                assert torch.allclose(sub(src, tgt, arch), model(src, tgt, arch), atol=1e-5), arch.summary()
            assert arch_params(arch, sizes) == count_params(sub), arch.summary()
            one_unit = [i for i, u in enumerate(arch.encoder.units) if u == 1]
            tables = {int(name.split(".")[1]) for name in sub.state_dict() if "rel_k" in name}
            if relative_layers == "units":
                assert tables == set(range(arch.encoder.layers)) - set(one_unit)
            else:
                assert tables == set(range(arch.encoder.layers))


def _spec(tmp_path, **supernet):
    raw = tiny_spec_dict(MULTI30K, tmp_path)
    raw["supernet"] = {**raw["supernet"], "units": 2, **supernet}
    raw["space"] = {**raw["space"], "units": {"values": [1, 2], "per_layer": True}}
    return parse_spec(raw)


def test_new_supernets_take_relative_layers_from_the_yaml_units_by_default(tmp_path):
    spec = _spec(tmp_path)
    assert spec.supernet.relative_layers == "units"
    assert supernet_config(spec, 50)["relative_layers"] == "units"
    assert build_supernet(spec, 50).config()["relative_layers"] == "units"
    assert supernet_config(_spec(tmp_path, relative_layers="all"), 50)["relative_layers"] == "all"
    plain = parse_spec(tiny_spec_dict(MULTI30K, tmp_path))
    assert "relative_layers" not in supernet_config(plain, 50)  # no relative positions: the config is unchanged
    with pytest.raises(SpecError, match="relative_layers"):
        _spec(tmp_path, relative_layers="some")


def test_ctranslate2_refuses_relative_positions_only_where_every_layer_has_them():
    plain = Arch(StackArch((16,), (32,)), StackArch((16,), (32,)))
    assert ctranslate2_problem(plain, {"relative_positions": 4, "relative_layers": "units"}) is None
    assert "relative_positions=4" in ctranslate2_problem(plain, {"relative_positions": 4, "relative_layers": "all"})
