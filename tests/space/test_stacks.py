"""Tests for ``space.<dimension>.stacks`` (a dimension chosen by one stack only): the schema's checks, sampling with a
real Optuna study, the sandwich ends, membership of archs and points, the space's size, level 1's genes, the
supernet's maxima, and ``search_spaces/multi30k_latency.yaml`` (the encoder's families, a plain decoder)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import optuna
import pytest
import yaml

from nas.space import SpecError, load_spec, parse_spec
from nas.space.arch import Arch
from nas.space.space import SearchSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)

ROOT = Path(__file__).resolve().parents[2]
LATENCY_YAML = ROOT / "search_spaces" / "multi30k_latency.yaml"

ENCODER_BRANCHES = {
    "encoder_layers": {"values": [1, 2]},
    "decoder_layers": {"values": [1, 2]},
    "width": {"values": [16, 32], "per_layer": True},
    "branches": {"values": [1, 2], "per_layer": True, "stacks": ["encoder"]},
}


def raw_spec(space: dict, **supernet) -> dict:
    """A spec mapping around ``space``; data paths are never opened by parse_spec."""
    return {
        "name": "t",
        "data": {"train": {"src": "a.en", "tgt": "a.de"}, "valid": {"src": "b.en", "tgt": "b.de"}},
        "supernet": {"model_dim": 32, "heads": 4, "encoder_layers": 2, "decoder_layers": 2, "ffn_width": 64,
                     "branches": 2, **supernet},
        "space": space,
    }


def make_space(space: dict, **supernet) -> SearchSpace:
    return SearchSpace.from_spec(parse_spec(raw_spec(space, **supernet)))


def refusal(space: dict, **supernet) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(raw_spec(space, **supernet))
    return str(info.value)


# --------------------------------------------------------------------------- schema


def test_stacks_is_accepted_on_a_per_layer_dimension():
    spec = parse_spec(raw_spec(ENCODER_BRANCHES))
    assert spec.space.branches.stacks == ["encoder"]
    assert spec.space.width.stacks is None  # default: both stacks


def test_encoder_attention_limited_to_the_encoder_is_refused_naming_the_key():
    msg = refusal({"encoder_attention": {"values": [1, 2], "per_layer": True, "stacks": ["encoder"]}})
    assert "space.encoder_attention.stacks" in msg and "only decoder layers" in msg and "[decoder]" in msg


def test_encoder_attention_in_both_stacks_is_refused_and_in_the_decoder_accepted():
    both = {"encoder_attention": {"values": [1, 2], "per_layer": True, "stacks": ["encoder", "decoder"]}}
    assert "space.encoder_attention.stacks" in refusal(both)
    decoder = {"encoder_attention": {"values": [1, 2], "per_layer": True, "stacks": ["decoder"]}}
    assert make_space(decoder).widest().decoder.encoder_attention == (2, 2)


def test_an_unknown_stack_name_is_refused_naming_the_key():
    msg = refusal({"branches": {"values": [1, 2], "per_layer": True, "stacks": ["encoders"]}})
    assert "space.branches.stacks.0" in msg and "'encoder' or 'decoder'" in msg


def test_an_empty_stacks_list_is_refused_with_the_fix():
    msg = refusal({"branches": {"values": [1, 2], "per_layer": True, "stacks": []}})
    assert "space.branches.stacks is empty" in msg and "stacks: [encoder]" in msg


def test_a_repeated_stack_is_refused():
    msg = refusal({"branches": {"values": [1, 2], "stacks": ["encoder", "encoder"]}})
    assert "space.branches.stacks" in msg and "repeats a stack" in msg


@pytest.mark.parametrize("space, key", [
    ({"encoder_layers": {"values": [1, 2], "stacks": ["encoder"]}}, "space.encoder_layers.stacks"),
    ({"model_width": {"values": [16, 32], "stacks": ["encoder"]}, "width": {"tie": "model_width"}},
     "space.model_width.stacks"),
    ({"model_width": {"values": [16, 32]}, "width": {"tie": "model_width", "stacks": ["encoder"]}},
     "space.width.stacks"),
])
def test_stacks_on_a_depth_the_model_width_or_a_tied_width_is_refused(space, key):
    msg = refusal(space)
    assert key in msg and "remove stacks" in msg


def test_prime_conditions_hold_only_in_the_stacks_that_choose_the_layout():
    # the decoder chooses paths but has no Prime layers: paths need no `when`
    make_space({"layout": {"values": ["sequential", "prime"], "per_layer": True, "stacks": ["encoder"]},
                "paths": {"values": [1, 2], "per_layer": True, "stacks": ["decoder"]}}, paths=2)
    # kernels in the decoder, whose layers are all sequential, still need `when: {layout: prime}`
    msg = refusal({"layout": {"values": ["prime"], "per_layer": True, "stacks": ["encoder"]},
                   "kernels": {"values": [[3]], "per_layer": True}}, kernels=[3])
    assert "space.kernels" in msg and "when: {layout: prime}" in msg


# --------------------------------------------------------------------------- sampling and the sandwich ends


def test_optuna_never_gives_a_decoder_layer_a_second_branch_and_does_give_encoder_layers_two():
    space = make_space(ENCODER_BRANCHES)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    encoder_branches = set()
    for _ in range(30):
        trial = study.ask()
        arch = space.suggest(trial)
        study.tell(trial, 0.0)
        assert set(arch.decoder.branches) == {1}
        assert not any(name.startswith("decoder.branches") for name in trial.params)
        encoder_branches |= set(arch.encoder.branches)
    assert encoder_branches == {1, 2}
    assert any(name.startswith("encoder.branches.") for name in study.trials[0].params)


def test_widest_has_two_branches_in_the_encoder_and_one_in_the_decoder():
    space = make_space(ENCODER_BRANCHES)
    widest = space.widest()
    assert widest.encoder.branches == (2, 2) and widest.decoder.branches == (1, 1)
    assert widest.decoder.width == (32, 32)  # widths are still chosen in both stacks
    assert set(space.narrowest().encoder.branches) == {1}


def test_a_width_limited_to_the_decoder_leaves_the_encoder_at_model_dim():
    space = make_space({**ENCODER_BRANCHES, "width": {"values": [16, 32], "per_layer": True, "stacks": ["decoder"]}})
    assert space.narrowest().encoder.width == (32,) and space.narrowest().decoder.width == (16,)


def test_a_when_on_a_dimension_the_stack_does_not_choose_takes_its_inactive_value():
    space = make_space({"layout": {"values": ["sequential", "prime"], "per_layer": True, "stacks": ["encoder"]},
                        "kernels": {"values": [[3], [7]], "per_layer": True, "when": {"layout": "prime"}}},
                       kernels=[3, 7])
    assert space.widest("prime").encoder.kernels == ((7,), (7,))
    rng = random.Random(0)
    for _ in range(20):
        arch = space.sample(rng)
        assert arch.decoder.layout == ("sequential",) * 2 and arch.decoder.kernels == ((),) * 2
        assert not any(name.startswith("decoder.") for name in space.params_of(arch))


def test_the_space_size_counts_a_stack_that_does_not_choose_as_one_choice():
    one_layer = {"branches": {"values": [1, 2], "per_layer": True, "stacks": ["encoder"]}}
    assert make_space(one_layer, encoder_layers=1, decoder_layers=1).size() == 2
    both = {"branches": {"values": [1, 2], "per_layer": True}}
    assert make_space(both, encoder_layers=1, decoder_layers=1).size() == 4


def test_level1_genes_leave_out_the_stack_that_does_not_choose():
    from nas.search.evolution import gene_choices

    genes = gene_choices(make_space(ENCODER_BRANCHES))
    assert "encoder.branches.1" in genes and not any(g.startswith("decoder.branches") for g in genes)


def test_the_supernet_decoder_is_built_with_one_branch():
    spec = parse_spec(raw_spec(ENCODER_BRANCHES))
    maxima = SearchSpace.from_spec(spec).supernet_maxima(spec)
    assert maxima.encoder.branches == (2, 2) and maxima.decoder.branches == (1, 1)


def test_the_supernet_of_a_stack_limited_space_runs_its_archs_and_has_fewer_parameters():
    import torch

    from nas.builders import build_supernet
    from nas.model.supernet import count_params

    space = {"layout": {"values": ["sequential", "prime"], "per_layer": True, "stacks": ["encoder"]},
             "kernels": {"values": [[3]], "per_layer": True, "when": {"layout": "prime"}},
             "branches": {"values": [1, 2], "per_layer": True, "stacks": ["encoder"]}}
    spec = parse_spec(raw_spec(space, kernels=[3], encoder_layers=1, decoder_layers=1))
    both = parse_spec(raw_spec({**space, "branches": {"values": [1, 2], "per_layer": True}}, kernels=[3],
                               encoder_layers=1, decoder_layers=1))
    torch.manual_seed(0)
    net = build_supernet(spec, vocab_size=11)
    assert count_params(net) < count_params(build_supernet(both, vocab_size=11))
    src, tgt = torch.randint(1, 11, (2, 3)), torch.randint(1, 11, (2, 4))
    searched = SearchSpace.from_spec(spec)
    for arch in (searched.widest(), searched.widest("prime"), searched.narrowest()):
        assert net(src, tgt, arch).shape == (2, 4, 11)  # [batch, tgt_len, vocab]


# --------------------------------------------------------------------------- membership


def test_an_arch_with_two_decoder_branches_is_outside_the_space_naming_the_key_and_layer():
    space = make_space(ENCODER_BRANCHES)
    widest = space.widest()
    outside = dataclasses.replace(widest, decoder=dataclasses.replace(widest.decoder, branches=(1, 2)))
    with pytest.raises(ValueError, match=r"decoder\.branches\.1=2: space\.branches\.stacks is \['encoder'\]"):
        space.arch_point_params(outside)
    assert space.arch_point_params(widest)  # the widest itself is inside


def test_a_decoder_branches_parameter_is_refused_by_the_membership_check():
    space = make_space(ENCODER_BRANCHES)
    why = space.check_params({"decoder.branches.0": 2})
    assert why is not None and "decoder.branches.0" in why and "space.branches.stacks" in why
    assert space.check_params({"encoder.branches.0": 2}) is None


def test_a_named_point_with_decoder_branches_is_refused_when_the_yaml_loads(tmp_path):
    raw = raw_spec(ENCODER_BRANCHES)
    raw["search"] = {"points_to_evaluate": [{"name": "two-branch-decoder",
                                             "arch": "enc[32/64x2 32/64x2] dec[32/64x2 32/64]"}]}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(SpecError, match=r"decoder\.branches\.0=2.*space\.branches\.stacks"):
        load_spec(path, check_files=False)


# --------------------------------------------------------------------------- multi30k_latency.yaml


@pytest.fixture(scope="module")
def latency_space() -> SearchSpace:
    return SearchSpace.from_spec(load_spec(LATENCY_YAML, check_files=False))


def test_multi30k_latency_loads_with_encoder_only_families_and_encoder_attention(latency_space):
    spec = load_spec(LATENCY_YAML, check_files=False)
    for key in ("layout", "kernels", "branches", "paths", "units", "unit_dependency"):
        assert getattr(spec.space, key).stacks == ["encoder"], key
    assert spec.space.encoder_attention.values == [1, 2, 3]
    assert "TODO" not in LATENCY_YAML.read_text(encoding="utf-8")
    assert latency_space.widest().decoder.encoder_attention == (3,) * 4


def test_multi30k_latency_samples_have_plain_decoders_and_family_encoders(latency_space):
    rng = random.Random(0)
    archs = [latency_space.sample(rng) for _ in range(40)]
    for arch in archs:
        d = arch.decoder
        assert set(d.branches) == set(d.paths) == set(d.units) == {1}
        assert set(d.layout) == {"sequential"} and set(d.kernels) == {()}
        assert set(d.unit_dependency) == {"independent"}
        assert set(d.encoder_attention) <= {1, 2, 3}
    assert any(2 in a.encoder.branches for a in archs) and any("prime" in a.encoder.layout for a in archs)
    assert any(k > 1 for a in archs for k in a.decoder.encoder_attention)


def test_multi30k_latency_holds_its_hand_designed_baselines(latency_space):
    tiny = lambda n: " ".join(["128/256"] * n)
    deep_encoder = f"enc[{tiny(6)}] dec[128/256e3 128/256e2]"  # the decoder reads the last 3 and 2 encoder layers
    for arch in (f"enc[{tiny(4)}] dec[{tiny(4)}]", f"enc[{tiny(6)}] dec[{tiny(1)}]", f"enc[{tiny(5)}] dec[{tiny(3)}]",
                 deep_encoder):
        assert latency_space.arch_point_params(Arch.parse(arch)), arch
    with pytest.raises(ValueError):  # Tiny-L (6+6) is outside: the decoder's maximum is 4
        latency_space.arch_point_params(Arch.parse(f"enc[{tiny(6)}] dec[{tiny(6)}]"))


def test_multi30k_latency_scores_its_baselines_file():
    points = load_spec(LATENCY_YAML, check_files=False).search.points_to_evaluate
    named = {p.name: p.arch for p in points if not isinstance(p, str)}
    assert set(named) == {"Transformer-Tiny", "Tiny-6+2", "Tiny-6+1", "Tiny-5+2"}  # baselines/multi30k_latency.yaml
    assert named["Transformer-Tiny"] == "enc[128/256 128/256 128/256 128/256] dec[128/256 128/256 128/256 128/256]"
