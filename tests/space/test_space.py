"""Tests for nas.space.space (SearchSpace) and nas.space.arch (Arch, StackArch) on small parsed specs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle
import random

import optuna
import pytest

from nas.space.arch import Arch, StackArch
from nas.space.space import SearchSpace
from nas.space import SpecError, parse_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)


def make_space(space: dict, **supernet) -> tuple[SearchSpace, object]:
    """A SearchSpace from a spec dict; data paths are never opened by parse_spec."""
    raw = {
        "name": "t",
        "data": {"train": {"src": "a.en", "tgt": "a.de"}, "valid": {"src": "b.en", "tgt": "b.de"}},
        "supernet": {"model_dim": 32, "heads": 4, "encoder_layers": 3, "decoder_layers": 2, "ffn_width": 64,
                     "branches": 3, **supernet},
        "space": space,
    }
    spec = parse_spec(raw)
    return SearchSpace.from_spec(spec), spec


# Unsorted value lists on purpose: the space sorts them.
MIXED = {
    "encoder_layers": {"values": [3, 1, 2]},
    "decoder_layers": {"values": [2, 1]},
    "width": {"values": [32, 8, 16], "per_layer": True},
    "ffn_width": {"values": [64, 16]},
    "branches": {"values": [2, 1, 3], "per_layer": True},
}

SMALL = {
    "encoder_layers": {"values": [1, 2]},
    "decoder_layers": {"values": [1, 2]},
    "width": {"values": [8, 16], "per_layer": True},
    "ffn_width": {"values": [16, 32]},
    "branches": {"values": [1, 2], "per_layer": True},
}


def test_widest_takes_the_deepest_stack_and_the_largest_value_of_every_dimension():
    space, _ = make_space(MIXED)
    assert space.widest() == Arch(
        encoder=StackArch(width=(32, 32, 32), ffn_width=(64, 64, 64), branches=(3, 3, 3)),
        decoder=StackArch(width=(32, 32), ffn_width=(64, 64), branches=(3, 3)),
    )


def test_narrowest_takes_the_shallowest_stack_and_the_smallest_value_of_every_dimension():
    space, _ = make_space(MIXED)
    assert space.narrowest() == Arch(
        encoder=StackArch(width=(8,), ffn_width=(16,), branches=(1,)),
        decoder=StackArch(width=(8,), ffn_width=(16,), branches=(1,)),
    )


def test_widest_equals_the_supernet_maxima_when_the_space_reaches_them():
    space, spec = make_space(MIXED)
    assert space.widest() == space.supernet_maxima(spec)


def test_unset_dimensions_default_to_the_supernet_values():
    space, spec = make_space({}, branches=None)
    arch = Arch(encoder=StackArch((32,) * 3, (64,) * 3, (1,) * 3), decoder=StackArch((32,) * 2, (64,) * 2, (1,) * 2))
    assert space.widest() == space.narrowest() == arch
    assert space.size() == 1


@pytest.mark.parametrize("seed", range(50))
def test_random_sample_stays_within_the_supernet_and_the_listed_values(seed):
    space, spec = make_space(MIXED)
    arch = space.sample(random.Random(seed))
    arch.check_within(space.supernet_maxima(spec))
    assert arch.encoder.layers in {1, 2, 3} and arch.decoder.layers in {1, 2}
    for stack in (arch.encoder, arch.decoder):
        assert set(stack.width) <= {8, 16, 32}
        assert set(stack.ffn_width) <= {16, 64}
        assert set(stack.branches) <= {1, 2, 3}
        assert len(set(stack.ffn_width)) == 1, "ffn_width is per stack: one value for every layer"


def test_random_sample_is_reproducible_for_a_seed():
    space, _ = make_space(MIXED)
    assert space.sample(random.Random(7)) == space.sample(random.Random(7))
    assert len({space.sample(random.Random(s)) for s in range(20)}) > 1


def brute_force_archs(layers, widths, ffns, branches) -> set[Arch]:
    """Every distinct arch of SMALL: per-layer width and branches, one ffn_width per stack."""
    stacks = []
    for n in layers:
        for w in itertools.product(widths, repeat=n):
            for f in ffns:
                for b in itertools.product(branches, repeat=n):
                    stacks.append(StackArch(w, (f,) * n, b))
    return {Arch(e, d) for e, d in itertools.product(stacks, stacks)}


def test_size_counts_every_distinct_sub_transformer():
    space, _ = make_space(SMALL)
    archs = brute_force_archs([1, 2], [8, 16], [16, 32], [1, 2])
    assert len(archs) == (2 * 2 * 2 + 4 * 2 * 4) ** 2 == 1600
    assert space.size() == len(archs)


def test_every_sample_of_the_small_space_is_one_of_the_enumerated_archs():
    space, _ = make_space(SMALL)
    archs = brute_force_archs([1, 2], [8, 16], [16, 32], [1, 2])
    assert {space.sample(random.Random(s)) for s in range(200)} <= archs


def test_size_with_per_stack_choices_counts_one_choice_per_stack():
    space, _ = make_space({**SMALL, "width": {"values": [8, 16]}})
    per_stack = (2 * 2 * 2) + (2 * 2 * 4)  # depth 1: w, f, b ; depth 2: w, f, b0*b1
    assert space.size() == per_stack ** 2


def test_describe_lists_each_dimension_with_its_scope_and_no_unit_bias():
    """unit_bias is train.unit_bias, no space dimension (the validator refuses space.unit_bias): not listed."""
    space, _ = make_space(MIXED)
    assert space.describe() == [
        ("encoder.layers", "[1, 2, 3]", "per stack"),
        ("decoder.layers", "[1, 2]", "per stack"),
        ("layout", "['sequential']", "per stack"),
        ("units", "[1]", "per stack"),
        ("width", "[8, 16, 32]", "per layer"),
        ("ffn_width", "[16, 64]", "per stack"),
        ("branches", "[1, 2, 3]", "per layer"),
        ("paths", "[1]", "per stack"),
        ("kernels", "[[]]", "per stack"),
        ("unit_dependency", "['independent']", "per stack"),
        ("encoder_attention", "[1]", "per decoder stack"),
    ]


# ---- Optuna define-by-run --------------------------------------------------------------------------


def ask(space: SearchSpace, seed: int = 0, n: int = 1):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append((trial, space.suggest(trial)))
        study.tell(trial, 0.0)
    return out


def test_suggested_arch_is_rebuilt_from_the_trial_params():
    space, spec = make_space(MIXED)
    for trial, arch in ask(space, n=15):
        assert space.from_params(trial.params) == arch
        arch.check_within(space.supernet_maxima(spec))


def test_per_layer_params_exist_only_for_the_chosen_depth():
    space, _ = make_space({**SMALL, "encoder_layers": {"values": [1]}, "decoder_layers": {"values": [2]}})
    (trial, arch), = ask(space)
    assert arch.encoder.layers == 1 and arch.decoder.layers == 2
    assert set(trial.params) == {  # single-value choices (the depths here) are constants, not params
        "encoder.width.0", "encoder.ffn_width", "encoder.branches.0",
        "decoder.width.0", "decoder.width.1", "decoder.ffn_width",
        "decoder.branches.0", "decoder.branches.1",
    }
    assert "encoder.width.1" not in trial.params


def test_per_layer_param_count_follows_the_sampled_depth():
    space, _ = make_space(MIXED)
    depths = set()
    for trial, arch in ask(space, n=20):
        depths.add(arch.encoder.layers)
        widths = {k for k in trial.params if k.startswith("encoder.width.")}
        assert widths == {f"encoder.width.{i}" for i in range(arch.encoder.layers)}
    assert len(depths) > 1


def test_per_stack_dimension_is_a_single_param():
    space, _ = make_space({**SMALL, "width": {"values": [8, 16], "per_layer": False}})
    (trial, arch), = ask(space)
    assert "encoder.width" in trial.params and "decoder.width" in trial.params
    assert not any(k.startswith("encoder.width.") for k in trial.params)
    assert arch.encoder.width == (trial.params["encoder.width"],) * arch.encoder.layers


def test_from_params_names_a_missing_parameter():
    space, _ = make_space(SMALL)
    (trial, _arch), = ask(space)
    params = dict(trial.params)
    del params["decoder.ffn_width"]
    with pytest.raises(KeyError, match=r"decoder\.ffn_width"):
        space.from_params(params)


# ---- Arch ------------------------------------------------------------------------------------------

ARCH = Arch(
    encoder=StackArch(width=(64, 32), ffn_width=(256, 128), branches=(2, 1)),
    decoder=StackArch(width=(64,), ffn_width=(128,), branches=(1,)),
)


def test_arch_round_trips_through_dict():
    d = ARCH.to_dict()
    assert d == {"encoder": {"width": [64, 32], "ffn_width": [256, 128], "branches": [2, 1], "paths": [1, 1],
                             "layout": ["sequential", "sequential"], "kernels": [[], []], "units": [1, 1],
                             "unit_bias": ["identity", "identity"], "unit_dependency": ["independent", "independent"]},
                 "decoder": {"width": [64], "ffn_width": [128], "branches": [1], "paths": [1],
                             "layout": ["sequential"], "kernels": [[]], "units": [1], "unit_bias": ["identity"],
                             "unit_dependency": ["independent"]}}
    assert Arch.from_dict(d) == ARCH


def test_arch_round_trips_through_json():
    text = ARCH.to_json()
    assert json.loads(text)["encoder"]["width"] == [64, 32]
    assert Arch.from_json(text) == ARCH


def test_arch_id_is_a_stable_hash_that_differs_between_archs():
    same = Arch.from_json(ARCH.to_json())
    other = Arch(encoder=ARCH.encoder, decoder=StackArch(width=(32,), ffn_width=(128,)))
    assert len(ARCH.arch_id) == 12 and int(ARCH.arch_id, 16) >= 0
    assert same.arch_id == ARCH.arch_id
    assert other.arch_id != ARCH.arch_id


def test_stack_arch_defaults_to_one_branch_per_layer():
    assert StackArch(width=(8, 8), ffn_width=(16, 16)).branches == (1, 1)


def test_arch_summary_shows_width_ffn_and_branches_per_layer():
    assert ARCH.summary() == "enc[64/256x2 32/128] dec[64/128]"


def test_check_within_names_the_first_choice_above_the_supernet():
    maxima = Arch(encoder=StackArch((64, 64), (256, 256), (2, 2)), decoder=StackArch((64, 64), (128, 32), (1, 1)))
    too_wide = Arch(encoder=StackArch((64,), (256,)), decoder=StackArch((64, 64), (128, 64)))
    with pytest.raises(ValueError, match=r"arch\.decoder\.ffn_width\[1\]=64 exceeds the supernet's 32"):
        too_wide.check_within(maxima)


def test_check_within_rejects_more_layers_than_the_supernet():
    maxima = Arch(encoder=StackArch((64,), (256,)), decoder=StackArch((64,), (256,)))
    with pytest.raises(ValueError, match=r"arch\.encoder has 2 layers; the supernet has 1"):
        ARCH.check_within(maxima)


@pytest.mark.parametrize("kwargs", [
    {"width": (8, 8), "ffn_width": (16,)},
    {"width": (8,), "ffn_width": (16,), "branches": (1, 2)},
], ids=["ffn_width", "branches"])
def test_stack_arch_with_mismatched_lengths_raises(kwargs):
    with pytest.raises(ValueError, match="StackArch tuples differ in length"):
        StackArch(**kwargs)


def test_stack_arch_rejects_zero_layers_and_non_positive_values():
    with pytest.raises(ValueError, match="at least one layer"):
        StackArch(width=(), ffn_width=())
    with pytest.raises(ValueError, match=r"ffn_width\[1\]=0 must be >= 1"):
        StackArch(width=(8, 8), ffn_width=(16, 0))


# ---- conditional dimensions (Prime layers, paths) ----------------------------------------------------

CONDITIONAL = {
    "encoder_layers": {"values": [1, 2]},
    "decoder_layers": {"values": [1]},
    "width": {"values": [16, 32]},
    "ffn_width": {"values": [32, 64]},
    "layout": {"values": ["prime", "sequential"], "per_layer": True},
    "paths": {"values": [1, 2, 3], "per_layer": True, "when": {"layout": "sequential"}},
    "kernels": {"values": [[3, 7], [], [3]], "per_layer": True, "when": {"layout": "prime"}},
}


def _brute_force_conditional() -> set[Arch]:
    layer_choices = [("sequential", p, ()) for p in (1, 2, 3)] + [("prime", 1, k) for k in ((), (3,), (3, 7))]
    stacks = {}
    for name, depths in (("encoder", [1, 2]), ("decoder", [1])):
        stacks[name] = [StackArch((w,) * n, (f,) * n, (3,) * n, tuple(c[1] for c in cs), tuple(c[0] for c in cs),
                                  tuple(c[2] for c in cs))
                        for n in depths for w in (16, 32) for f in (32, 64)
                        for cs in itertools.product(layer_choices, repeat=n)]
    return {Arch(e, d) for e in stacks["encoder"] for d in stacks["decoder"]}


def test_conditional_space_size_and_samples_match_brute_force():
    space, spec = make_space(CONDITIONAL, kernels=[3, 7])
    everything = _brute_force_conditional()
    assert space.size() == len(everything)
    samples = {space.sample(random.Random(s)) for s in range(300)}
    assert samples <= everything
    assert any("prime" in a.encoder.layout for a in samples) and any(3 in a.encoder.paths for a in samples)
    maxima = space.supernet_maxima(spec)
    assert maxima.encoder.layout[0] == "sequential+prime" and maxima.encoder.kernels[0] == (3, 7)
    for arch in samples:
        arch.check_within(maxima)


def test_conditional_choices_are_asked_only_where_their_condition_holds():
    space, _ = make_space(CONDITIONAL, kernels=[3, 7])
    for trial, arch in ask(space, n=25):
        assert space.from_params(trial.params) == arch
        for i, layout in enumerate(arch.encoder.layout):
            assert (f"encoder.kernels.{i}" in trial.params) == (layout == "prime")
            assert (f"encoder.paths.{i}" in trial.params) == (layout == "sequential")
        assert all(isinstance(v, (int, str)) for v in trial.params.values())  # kernel sets as labels


def test_widest_is_sequential_with_most_paths_and_narrowest_is_its_first_choice():
    space, _ = make_space(CONDITIONAL, kernels=[3, 7])
    assert set(space.widest().encoder.layout) == {"sequential"} and set(space.widest().encoder.paths) == {3}
    assert space.narrowest().encoder.layout == ("sequential",)


TYPE1 = {
    "model_width": {"values": [32, 8, 16]},
    "encoder_layers": {"values": [2, 3]},
    "width": {"tie": "model_width"},
    "ffn_width": {"tie": "model_width", "scale": 2},
}


def test_type1_space_ties_every_layer_to_one_model_width():
    """Scalable Transformers type 1 (sec. 3.2): C = D^1 = ... = D^L; here F^l = 2C."""
    space, spec = make_space(TYPE1)
    assert spec.io_projection
    assert space.size() == 3 * 2  # |M| model widths x 2 encoder depths
    assert space.widest() == Arch(StackArch((32,) * 3, (64,) * 3, (3,) * 3), StackArch((32,) * 2, (64,) * 2, (3,) * 2),
                                  model_width=32)
    narrow = space.narrowest()
    assert narrow.model_width == 8 and set(narrow.encoder.width) == {8} and set(narrow.decoder.ffn_width) == {16}
    rng = random.Random(0)
    seen = {space.sample(rng) for _ in range(60)}
    assert {a.model_width for a in seen} == {8, 16, 32}
    for a in seen:
        for stack in (a.encoder, a.decoder):
            assert set(stack.width) == {a.model_width} and set(stack.ffn_width) == {2 * a.model_width}
    assert len(seen) == space.size()


def test_type1_optuna_asks_for_the_model_width_once_and_never_for_tied_widths():
    space, _ = make_space(TYPE1)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(6):
        trial = study.ask()
        arch = space.suggest(trial)
        assert set(trial.params) == {"model_width", "encoder.layers"}
        assert space.from_params(trial.params) == arch
        study.tell(trial, 0.0)


def test_model_width_is_in_the_arch_json_only_when_chosen():
    stack = StackArch((8,), (16,))
    assert "model_width" not in Arch(stack, stack).to_dict()
    arch = Arch(stack, stack, model_width=8)
    assert Arch.from_json(arch.to_json()) == arch and arch.arch_id != Arch(stack, stack).arch_id
    assert arch.summary().startswith("C8 enc[")


def test_unit_bias_is_a_training_setting_not_a_search_dimension():
    """MUTE's biases change nothing at evaluation (sec. 3.2): the space never chooses them, so its size is
    the same whatever ``train.unit_bias`` is, and every multi-unit layer carries that one bias."""
    sizes = []
    for bias in ("mixed", "swap"):
        raw = {"name": "t", "data": {"train": {"src": "a.en", "tgt": "a.de"}, "valid": {"src": "b.en", "tgt": "b.de"}},
               "supernet": {"model_dim": 32, "heads": 4, "encoder_layers": 2, "decoder_layers": 2, "ffn_width": 64,
                            "units": 2},
               "space": {"units": {"values": [1, 2], "per_layer": True}},
               "train": {"unit_bias": bias}}
        space = SearchSpace.from_spec(parse_spec(raw))
        sizes.append(space.size())
        for seed in range(20):
            arch = space.sample(random.Random(seed))
            for stack in (arch.encoder, arch.decoder):
                assert all(b == (bias if u > 1 else "identity") for b, u in zip(stack.unit_bias, stack.units))
    assert sizes[0] == sizes[1] == (2 ** 2) ** 2  # units per layer only: 2 layers x 2 stacks


# ---- the middle reference: nearest the mean parameter count ---------------------------------------------

QUICKSTART_LIKE = {  # search_spaces/quickstart.yaml's space: every dimension has two values
    "encoder_layers": {"values": [2, 3]},
    "decoder_layers": {"values": [2, 3]},
    "width": {"values": [64, 128], "per_layer": True},
    "ffn_width": {"values": [256, 512], "per_layer": True},
    "branches": {"values": [1, 2], "per_layer": True},
}
QUICKSTART_SUPERNET = dict(model_dim=128, heads=4, encoder_layers=3, decoder_layers=3, ffn_width=512, branches=2)


def test_middle_of_a_two_value_space_is_not_the_widest_and_lies_strictly_between_the_ends():
    space, _ = make_space(QUICKSTART_LIKE, **QUICKSTART_SUPERNET)
    middle, narrow, wide = space.middle(), space.narrowest(), space.widest()
    assert middle != wide and middle != narrow
    assert space.params(narrow) < space.params(middle) < space.params(wide)
    mean = (space.params(narrow) + space.params(wide)) / 2
    assert abs(space.params(middle) - mean) <= 0.01 * mean


def test_middle_is_the_arch_nearest_the_mean_count_among_every_arch_of_a_small_space():
    space, _ = make_space(SMALL)
    target2 = space.params(space.narrowest()) + space.params(space.widest())
    best = min(abs(2 * space.params(a) - target2) for a in brute_force_archs([1, 2], [8, 16], [16, 32], [1, 2]))
    assert abs(2 * space.params(space.middle()) - target2) == best


def test_middle_is_the_same_arch_in_every_build_of_the_space_and_after_pickling():
    first, _ = make_space(QUICKSTART_LIKE, **QUICKSTART_SUPERNET)
    again, _ = make_space(QUICKSTART_LIKE, **QUICKSTART_SUPERNET)
    assert first.middle().arch_id == again.middle().arch_id
    assert pickle.loads(pickle.dumps(again)).middle() == first.middle()


def test_references_and_the_middle_point_use_the_nearest_to_mean_middle():
    space, _ = make_space(QUICKSTART_LIKE, **QUICKSTART_SUPERNET)
    assert space.references() == {"narrowest": space.narrowest(), "middle": space.middle(), "widest": space.widest()}
    assert space.from_params(space.point_params(["middle"])[0]) == space.middle()


def test_middle_keeps_the_first_layout_as_the_two_ends_do():
    space, _ = make_space(CONDITIONAL, kernels=[3, 7])
    assert set(space.middle().encoder.layout) == set(space.middle().decoder.layout) == {"sequential"}
    assert space.params(space.narrowest()) < space.params(space.middle()) < space.params(space.widest())


def test_a_space_built_without_its_supernet_sizes_refuses_to_count():
    space, _ = make_space(SMALL)
    bare = SearchSpace(layers=space.layers, dims=space.dims, per_layer=space.per_layer, when=space.when)
    with pytest.raises(ValueError, match="from_spec"):
        bare.middle()


def test_a_small_space_is_enumerated_for_its_middle_every_arch_once():
    space, _ = make_space(SMALL)
    archs = list(space._enumerate(lambda name: True))
    assert len(archs) == len(set(archs)) == space.size()
    assert set(archs) == brute_force_archs([1, 2], [8, 16], [16, 32], [1, 2])


# ---- HAT's arbitrary encoder-decoder attention -----------------------------------------------------

HAT_LIKE = {**SMALL, "encoder_attention": {"values": [2, 1], "per_layer": True}}


def test_encoder_attention_is_chosen_per_decoder_layer_and_never_asked_of_the_encoder():
    space, spec = make_space(HAT_LIKE)
    assert space.widest().decoder.encoder_attention == (2, 2)  # widest: the most encoder layers
    assert space.narrowest().decoder.encoder_attention == (1,)
    assert space.supernet_maxima(spec).decoder.encoder_attention == (2, 2)
    assert space.supernet_maxima(spec).encoder.encoder_attention == (1, 1, 1)
    for trial, arch in ask(space, n=20):
        assert not any(name.startswith("encoder.encoder_attention") for name in trial.params)
        assert {n for n in trial.params if n.startswith("decoder.encoder_attention.")} == \
            {f"decoder.encoder_attention.{i}" for i in range(arch.decoder.layers)}
        assert space.from_params(trial.params) == arch and space.params_of(arch) == trial.params
        arch.check_within(space.supernet_maxima(spec))
    assert {k for _, a in ask(space, seed=1, n=20) for k in a.decoder.encoder_attention} == {1, 2}
    from nas.search.evolution import gene_choices  # HAT's fixed-length genes: none for the encoder

    genes = gene_choices(space)
    assert [g for g in genes if "encoder_attention" in g] == [f"decoder.encoder_attention.{i}" for i in (0, 1)]


def test_encoder_attention_multiplies_only_the_decoder_s_count_of_archs():
    space, _ = make_space(HAT_LIKE)
    archs = list(space._enumerate(lambda name: True))
    assert len(archs) == len(set(archs)) == space.size() == 40 * (2 * 8 + 2 * 64)  # encoder 40 as in SMALL
    assert space.params(space.widest()) == space.params(dataclasses.replace(
        space.widest(), decoder=dataclasses.replace(space.widest().decoder, encoder_attention=())))  # no params
    assert ("encoder_attention", "[1, 2]", "per decoder layer") in space.describe()


@pytest.mark.parametrize("dimension, message", [
    ({"values": [0, 1]}, "space.encoder_attention.values contains 0; choices must be >= 1"),
    ({"values": [1, 4]}, "space.encoder_attention.values contains 4, above the deepest encoder "
                         "(supernet.encoder_layers reaches 3)"),
    ({"values": [1, "two"]}, "space.encoder_attention.values contains 'two'; this dimension takes integers"),
    ({"values": [1, 2], "per_layer": True, "when": {"branches": 2}}, "space.encoder_attention.when"),
])
def test_bad_encoder_attention_values_name_the_key_and_the_fix(dimension, message):
    with pytest.raises(SpecError) as info:
        make_space({"branches": {"values": [1, 2], "per_layer": True}, "encoder_attention": dimension})
    assert message in str(info.value)
