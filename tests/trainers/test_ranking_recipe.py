"""The supernet recipe that ranks the middle of the space (issue 27): in-place distillation in the joint stage,
dropout that follows a sub-Transformer's share of parameters, and balanced sampling of the sandwich's random
members. Each is checked against an independent computation: a loop transcription of the losses
(``tests.trainers.test_stages._reference``), parameter counts of the extracted models, counts by hand."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from nas.model.supernet import count_params, extract
from nas.space import SpecError, parse_spec
from nas.space.space import SearchSpace
from tests.conftest import tiny_spec_dict, use_tiny_data
from tests.trainers.test_stages import SEED, Built, Forwards, _batch, _raw, _reference, two_layouts
from trainers.stages import SandwichArchs
from trainers.stage_plan import stage_at
from trainers.stages.base import StepInfo

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- 1. in-place distillation in the joint stage ----------------------------------------------------------

@pytest.mark.parametrize("lam", [0.0, 0.25])
def test_inplace_distillation_teaches_with_the_widests_output_of_the_same_step_and_no_extra_forward(lam):
    built = Built("joint", sandwich_k=2, inplace_distill=True, distill_lambda=lam)
    batches = [_batch(1), _batch(2)]
    ntokens = sum(b.ntokens for b in batches)
    forwards = Forwards(built.model)
    out = built.stage.step(built.model, batches, built.info(0, ntokens))
    forwards.handle.remove()
    (archs,) = built.expected_archs()
    assert len(archs) == 4
    assert forwards.archs == archs * len(batches)  # 2 + k forwards per batch: the teacher is not run again
    grads, expected = _reference(built.model, batches, archs, lam, built.spec.train.label_smoothing, ntokens)
    for name, param in built.model.named_parameters():
        if grads[name] is None:
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, grads[name].to(param.grad.dtype), rtol=1e-4, atol=1e-6, msg=name)
    assert out.distill == pytest.approx(expected.distill, rel=1e-5) and out.distill > 0
    assert out.widest == pytest.approx(expected.widest, rel=1e-5)


def test_without_inplace_distillation_the_joint_stage_is_eq4():
    built = Built("joint")
    batch = _batch(1)
    out = built.stage.step(built.model, [batch], built.info(0, batch.ntokens))
    assert out.distill == 0.0


def test_the_teacher_is_the_widest_of_the_steps_layout():
    spec, space, model, stage = two_layouts("joint", {"dropout": 0.0}, stages=[{"name": "joint", "steps": 4}],
                                            sandwich_k=0, inplace_distill=True, drop_branch=0.0)
    batch = _batch(1)
    for step, layout in enumerate(["sequential", "prime"]):
        model.zero_grad(set_to_none=True)
        forwards = Forwards(model)
        out = stage.step(model, [batch], StepInfo(step, batch.ntokens, stage_at(spec.train.stage_plan, step)))
        forwards.handle.remove()
        ends = [space.widest(layout), space.narrowest(layout)]
        assert forwards.archs == ends
        grads, expected = _reference(model, [batch], ends, 0.0, spec.train.label_smoothing, batch.ntokens)
        assert out.distill == pytest.approx(expected.distill, rel=1e-5)


# ---- 2. dropout that follows the share of parameters ------------------------------------------------------

def _extracted_params(model, arch) -> int:
    return count_params(extract(model, arch))


@pytest.mark.parametrize("low,high", [(0.0, 0.1), (0.05, 0.3)])
def test_dropout_follows_the_sub_transformers_share_of_parameters(low, high):
    rho = 0.2
    built = Built("joint", exact=False, sandwich_k=3, dropout_range=[low, high], drop_branch=rho)
    batch = _batch(1)
    forwards = Forwards(built.model)
    built.stage.step(built.model, [batch], built.info(5, batch.ntokens))
    space, model = built.space, built.model
    p_narrow = _extracted_params(model, space.narrowest())  # independent: parameters of the extracted models
    p_wide = _extracted_params(model, space.widest())
    assert len(forwards.calls) == 5
    rates = []
    for arch, reg in forwards.calls:
        share = (_extracted_params(model, arch) - p_narrow) / (p_wide - p_narrow)
        expected = low + share * (high - low)
        assert reg.dropout == pytest.approx(expected, abs=1e-9), arch.summary()
        assert reg.drop_branch == pytest.approx(rho * expected / high, abs=1e-9)
        rates.append(reg.dropout)
    assert rates[0] == pytest.approx(high) and rates[1] == pytest.approx(low)
    assert len(set(rates)) >= 3  # the sampled ones sit in between


def test_standalone_training_keeps_the_supernets_dropout_under_a_dropout_range():
    built = Built("standalone", exact=False, dropout_range=[0.0, 0.3])
    batch = _batch(1)
    forwards = Forwards(built.model)
    built.stage.step(built.model, [batch], built.info(0, batch.ntokens))
    assert [reg.dropout for _, reg in forwards.calls] == [built.model.dropout_rate]


@pytest.mark.parametrize("bad,match", [([0.3, 0.1], "0 <= min <= max < 1"), ([0.0, 1.0], "0 <= min <= max < 1")])
def test_a_bad_dropout_range_is_refused_naming_the_key(bad, match):
    with pytest.raises(SpecError, match="dropout_range") as info:
        parse_spec(_raw(steps=4, dropout_range=bad))
    assert match in str(info.value)


def test_dropout_range_and_width_dropout_together_are_refused():
    with pytest.raises(SpecError, match="width_dropout"):
        parse_spec(_raw(steps=4, dropout_range=[0.0, 0.3], width_dropout={32: 0.1}))


# ---- 4. balanced sampling ---------------------------------------------------------------------------------

def _three_valued_space(depths=(2,), **train):
    """Per-layer choices with a value between the ends (FFN 48, 2 branches): uniform draws train it less."""
    raw = _raw(stages=[{"name": "joint", "steps": 4}], **train)
    raw["supernet"] = {**raw["supernet"], "branches": 3}
    raw["space"] = {"encoder_layers": {"values": list(depths)}, "width": {"values": [16, 32], "per_layer": True},
                    "ffn_width": {"values": [32, 48, 64], "per_layer": True},
                    "branches": {"values": [1, 2, 3], "per_layer": True}}
    spec = parse_spec(raw)
    return spec, SearchSpace.from_spec(spec)


def _hand_counts(archs, space) -> dict[str, Counter]:
    """Counts by hand from the archs' layers (independent of ``SearchSpace.count``)."""
    counts: dict[str, Counter] = {}
    for arch in archs:
        for stack_name, stack in (("encoder", arch.encoder), ("decoder", arch.decoder)):
            if len(space.layers[stack_name]) > 1:
                counts.setdefault(f"{stack_name}.layers", Counter())[str(stack.layers)] += 1
            for i, layer in enumerate(stack.layer_dims()):
                for dim in ("width", "ffn_width", "branches"):
                    counts.setdefault(f"{stack_name}.{dim}.{i}", Counter())[str(getattr(layer, dim))] += 1
    return counts


def _spread(counts: dict[str, Counter], space) -> float:
    worst = 0.0
    for name, seen in counts.items():
        labels = [str(v) for v in space._labels(name)]
        times = [seen.get(v, 0) for v in labels]
        worst = max(worst, float("inf") if min(times) == 0 else max(times) / min(times) - 1)
    return worst


@pytest.mark.parametrize("k", [1, 2])
def test_balanced_sampling_trains_every_layer_dimension_value_within_20_percent(k):
    spec, space = _three_valued_space()
    archs = SandwichArchs(space, random.Random(SEED), k, balanced=True)
    drawn = [a for step in range(300) for a in archs.draw(step)]
    counts = _hand_counts(drawn, space)
    assert _spread(counts, space) <= 0.2, counts
    assert {n: dict(c) for n, c in counts.items()} == archs.counts  # what the loop logs is what was drawn
    assert max(space.count_spread(archs.counts).values()) <= 0.2
    assert len(set(drawn[2::2 + k])) >= 16  # the balanced draws still vary (the 2-valued widths, 4 layers)


def test_uniform_sampling_leaves_the_values_between_the_ends_undertrained():
    """The problem balanced sampling solves: with uniform draws the middle FFN width and branch count train only
    through the random member (about a third as often as the ends' values with k = 1)."""
    spec, space = _three_valued_space()
    archs = SandwichArchs(space, random.Random(SEED), 1)
    drawn = [a for step in range(300) for a in archs.draw(step)]
    assert _spread(_hand_counts(drawn, space), space) > 1.0
    assert {n: dict(c) for n, c in _hand_counts(drawn, space).items()} == archs.counts


def test_with_a_depth_choice_balanced_sampling_halves_the_worst_spread():
    """A layer only the deeper archs have gets the widest's values every step but the random member's only when
    it is deep: with k = 1 no draw balances both the depth and that layer (the README's deviations), so balanced
    sampling trades one against the other; its worst spread is still less than half of uniform sampling's."""
    spec, space = _three_valued_space(depths=(1, 2))
    worst = {}
    for balanced in (True, False):
        archs = SandwichArchs(space, random.Random(SEED), 1, balanced=balanced)
        drawn = [a for step in range(300) for a in archs.draw(step)]
        worst[balanced] = _spread(_hand_counts(drawn, space), space)
    assert worst[True] < worst[False] / 2, worst


def test_balanced_sampling_reaches_values_behind_a_condition():
    """``unit_dependency`` exists only where a layer has 2 units: a choice-by-choice draw that balances the units
    on their own never opens it in a layer the widest always runs with 2 units (found on the unified space:
    ``independent`` never trained in the third layer). The uniform candidates let such archs win."""
    raw = _raw(stages=[{"name": "joint", "steps": 4}], sandwich_k=1)
    raw["supernet"] = {**raw["supernet"], "units": 2}
    raw["space"] = {**raw["space"], "units": {"values": [1, 2], "per_layer": True},
                    "unit_dependency": {"values": ["sequential", "independent"], "per_layer": True,
                                        "when": {"units": [2]}}}
    space = SearchSpace.from_spec(parse_spec(raw))
    worst = {}
    for balanced in (True, False):
        archs = SandwichArchs(space, random.Random(SEED), 1, balanced=balanced)
        for step in range(300):
            archs.draw(step)
        worst[balanced] = max(space.count_spread(archs.counts).values())
    assert worst[True] < 3.0 and worst[True] < worst[False], worst  # every value trained (a never-drawn one: inf)


def test_training_writes_the_sample_counts_and_resumes_them(multi30k, tiny_data, tmp_path):
    """The counts are part of the checkpoint (a resumed run draws what an uninterrupted one draws) and are written
    as ``sample_counts.json`` beside the supernet (logged with its files to MLflow)."""
    from nas.builders import prepare_sweep_data
    from trainers import train_supernet

    raw = use_tiny_data(tiny_spec_dict(multi30k, tmp_path), tiny_data)
    raw["train"] = {**raw["train"], "balanced_sampling": True, "inplace_distill": True,
                    "dropout_range": [0.0, 0.3]}
    data = prepare_sweep_data(parse_spec(raw), progress=False)
    spec = lambda steps: parse_spec({**raw, "train": {**raw["train"], "steps": steps}})
    straight = train_supernet(spec(6), data, tmp_path / "a", progress=False)
    train_supernet(spec(4), data, tmp_path / "b", progress=False)
    resumed = train_supernet(spec(6), data, tmp_path / "b", progress=False)
    a, b = (json.loads((tmp_path / d / "sample_counts.json").read_text()) for d in "ab")
    assert a == b
    assert sum(a["encoder.layers"].values()) == 6 * 3  # widest, narrowest and one random member per step
    assert straight.metrics["sample_spread"] == resumed.metrics["sample_spread"]
    from nas.model.io import load_model
    ma, mb = load_model(tmp_path / "a", "supernet"), load_model(tmp_path / "b", "supernet")
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-6), name
