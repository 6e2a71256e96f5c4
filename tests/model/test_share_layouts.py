"""``share_layouts=False``: a ``sequential+prime`` layer's Prime layout runs its own attention(s) and FFN.

Few-shot NAS (Zhao et al., ICML 2021) and Mixture-of-Supernets (Jawahar et al., Findings of ACL 2024) raise a
supernet's rank correlation by sharing less between dissimilar sub-networks; here the Prime and the
sequential sub-Transformers of a layer share no attention or FFN weight. Checked by gradients (what a
forward touches), against ``extract`` and the parameter count, through incremental decoding, and for the
config and YAML formats (old configs load shared).
"""

from __future__ import annotations

import pytest
import torch

from nas.builders import build_supernet, supernet_config
from nas.model import SuperTransformer
from nas.model.decode import IncrementalDecoder
from nas.model.supernet import count_params, extract
from nas.space import parse_spec
from nas.space.errors import SpecError
from nas.space.arch import Arch, StackArch
from nas.space.params import ModelSizes, arch_params
from tests.conftest import MULTI30K, tiny_spec_dict

V, C, H = 37, 16, 2
BOTH = Arch(*(StackArch((16,) * 2, (32,) * 2, (2,) * 2, (2,) * 2, ("sequential+prime",) * 2, ((3, 5),) * 2)
              for _ in range(2)))
"""Maxima: every layer supports both layouts."""
MIXED_MAXIMA = Arch(*(StackArch((16,) * 3, (32,) * 3, (2,) * 3, (2, 1, 2), ("sequential+prime", "prime", "sequential"),
                                ((3, 5), (3,), ())) for _ in range(2)))
"""Maxima with a Prime-only and a sequential-only layer (which build only the modules they run)."""
MIXED_ARCHS = (Arch(*(StackArch((16, 8, 16), (32, 16, 32), (2, 1, 1), (1, 1, 2), ("prime", "prime", "sequential"),
                                 ((5,), (3,), ())) for _ in range(2))),
               Arch(StackArch((8, 16, 8), (16, 32, 16), (1, 2, 1), (2, 1, 1), ("sequential", "prime", "sequential"),
                              ((), (), ())), StackArch((16,), (32,), layout=("prime",), kernels=((3, 5),))))


def _stack(layout: str) -> StackArch:
    """Two layers of ``layout``, the second narrower; Prime with one kernel, sequential with two paths."""
    prime = layout == "prime"
    return StackArch((16, 8), (32, 16), (2, 2), (1 if prime else 2,) * 2, (layout,) * 2, (((3,) if prime else ()),) * 2)


PRIME, SEQUENTIAL = Arch(_stack("prime"), _stack("prime")), Arch(_stack("sequential"), _stack("sequential"))


def _model(share_layouts: bool, maxima: Arch = BOTH, seed: int = 0) -> SuperTransformer:
    torch.manual_seed(seed)
    model = SuperTransformer(V, C, H, maxima, share_layouts=share_layouts).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _batch(b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, V, (b, 7), generator=g), torch.randint(4, V, (b, 5), generator=g)
    src[0, -2:] = 0  # padding in one sentence
    return src, tgt


def _touched(model: SuperTransformer, arch: Arch) -> set[str]:
    """Names of the layer parameters with a non-zero gradient after a backward of ``arch``'s logits."""
    model.zero_grad(set_to_none=True)
    src, tgt = _batch()
    model(src, tgt, arch).square().mean().backward()
    return {name for name, p in model.named_parameters()
            if name.startswith(("encoder.", "decoder.")) and p.grad is not None and p.grad.abs().sum() > 0}


def _modules(names: set[str]) -> set[str]:
    """The attention and FFN modules among parameter names (``encoder.0.prime_attn.w_in``: ``encoder.0.prime_attn``)."""
    return {name.rsplit(".", 1)[0] for name in names if name.startswith(("encoder.", "decoder."))
            and name.split(".")[2].removeprefix("prime_") in
            ("attn", "self_attn", "cross_attn", "ffn")}


def test_a_prime_and_a_sequential_forward_share_no_layer_parameter_when_layouts_are_separate():
    model = _model(share_layouts=False)
    prime, sequential = _touched(model, PRIME), _touched(model, SEQUENTIAL)
    assert not prime & sequential, sorted(prime & sequential)
    assert _modules(prime) == {f"{stack}.{i}.prime_{name}" for i in (0, 1)
                               for stack, names in (("encoder", ("attn", "ffn")),
                                                    ("decoder", ("self_attn", "cross_attn", "ffn")))
                               for name in names}
    assert _modules(sequential) == {f"{stack}.{i}.{name}" for i in (0, 1)
                                    for stack, names in (("encoder", ("attn", "ffn")),
                                                         ("decoder", ("self_attn", "cross_attn", "ffn")))
                                    for name in names}
    assert "encoder.0.conv.w_out" in prime  # the convolution runs on the Prime attention's values


def test_shared_layouts_still_share_the_attention_and_the_ffn():
    model = _model(share_layouts=True)
    shared = _touched(model, PRIME) & _touched(model, SEQUENTIAL)
    assert {"encoder.0.attn.w_in", "encoder.0.ffn.w1", "decoder.1.cross_attn.w_in"} <= shared
    assert not any(".prime_" in name for name in _modules(set(model.state_dict())))


@pytest.mark.parametrize("arch", [PRIME, SEQUENTIAL, Arch(_stack("prime"), _stack("sequential"))],
                         ids=["prime", "sequential", "prime encoder, sequential decoder"])
def test_an_extracted_arch_of_a_separate_layout_supernet_gives_the_supernet_s_logits(arch):
    model = _model(share_layouts=False)
    src, tgt = _batch()
    with torch.no_grad():
        sub = extract(model, arch).eval()
        assert torch.allclose(sub(src, tgt, arch), model(src, tgt, arch), atol=1e-5)
    prime = arch.encoder.layout[0] == "prime"
    names = {name.split(".")[2] for name in sub.state_dict() if name.startswith("encoder.")}
    assert ("prime_attn" in names, "attn" in names) == (prime, not prime)  # only the layout's own modules


def test_a_layer_builds_only_the_modules_its_layouts_run():
    model = _model(share_layouts=False, maxima=MIXED_MAXIMA)
    owned = lambda layer: {name for name, _ in layer.named_children() if name.removeprefix("prime_") in
                           ("attn", "self_attn", "cross_attn", "ffn")}
    assert [owned(layer) for layer in model.encoder] == [{"attn", "ffn", "prime_attn", "prime_ffn"},
                                                        {"prime_attn", "prime_ffn"}, {"attn", "ffn"}]
    assert owned(model.decoder[1]) == {"prime_self_attn", "prime_cross_attn", "prime_ffn"}
    src, tgt = _batch()
    with torch.no_grad():
        for arch in MIXED_ARCHS:
            assert torch.allclose(extract(model, arch)(src, tgt, arch), model(src, tgt, arch), atol=1e-5)


@pytest.mark.parametrize("path", ["incremental", "decode_step"])
def test_cached_decoding_of_a_prime_arch_runs_the_prime_modules(path):
    model = _model(share_layouts=False)
    src, tgt = _batch()
    with torch.no_grad():
        full = model(src, tgt, PRIME)
        memory, pad = model.encode(src, PRIME)
        if path == "incremental":
            decoder = IncrementalDecoder(model, memory, pad, PRIME, max_len=2)
            steps = torch.stack([decoder.step(tgt[:, i:i + 1]) for i in range(tgt.size(1))], 1)
        else:
            cache = [{} for _ in model.decoder]
            steps = torch.stack([model.decode_step(tgt[:, i:i + 1], i, memory, pad, PRIME, cache)
                                 for i in range(tgt.size(1))], 1)
    assert (steps - full).abs().max().item() <= 1e-5


def test_the_config_records_separate_layouts_and_an_old_config_loads_shared():
    model = _model(share_layouts=False)
    config = model.config()
    assert config["share_layouts"] is False
    again = SuperTransformer.from_config(config)
    assert again.share_layouts is False and sorted(again.state_dict()) == sorted(model.state_dict())
    shared = _model(share_layouts=True).config()
    assert "share_layouts" not in shared  # configs keep the format they had before the option existed
    old = SuperTransformer.from_config(shared)
    assert old.share_layouts and not any(".prime_" in name for name in _modules(set(old.state_dict())))


@pytest.mark.parametrize("maxima, archs", [(BOTH, (PRIME, SEQUENTIAL, Arch(_stack("prime"), _stack("sequential")))),
                                           (MIXED_MAXIMA, MIXED_ARCHS)], ids=["both layouts", "mixed"])
@pytest.mark.parametrize("share_layouts", [True, False])
def test_the_count_of_an_arch_equals_its_extracted_model_s_and_the_maxima_count_the_supernet(maxima, archs,
                                                                                             share_layouts):
    model = _model(share_layouts, maxima)
    sizes = ModelSizes.from_config(model.config(), with_embedding=True)
    assert sizes.share_layouts == share_layouts
    assert arch_params(maxima, sizes) == count_params(model)  # both layouts' modules
    for arch in archs:
        expected = count_params(extract(model, arch))
        assert arch_params(arch, sizes) == expected, arch.summary()
        assert arch_params(arch, ModelSizes.from_config(model.config())) == expected - V * C  # without the embedding


def _spec(tmp_path, **supernet):
    raw = tiny_spec_dict(MULTI30K, tmp_path)
    raw["supernet"] = {**raw["supernet"], "kernels": [3], **supernet}
    raw["space"] = {**raw["space"], "layout": {"values": ["sequential", "prime"], "per_layer": True}}
    return parse_spec(raw)


def test_the_yaml_key_is_a_bool_passed_to_the_supernet(tmp_path):
    assert _spec(tmp_path).supernet.share_layouts is True
    spec = _spec(tmp_path, share_layouts=False)
    assert supernet_config(spec, 50)["share_layouts"] is False
    model = build_supernet(spec, 50)
    assert hasattr(model.encoder[0], "prime_attn") and hasattr(model.decoder[0], "prime_cross_attn")
    assert "share_layouts" not in supernet_config(_spec(tmp_path), 50)  # the fingerprint of older sweeps is kept
    with pytest.raises(SpecError, match="share_layouts"):
        _spec(tmp_path, share_layouts="sometimes")
