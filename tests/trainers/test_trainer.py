"""The supernet trainer: learning, exact resume from a checkpoint, the warm-up schedule."""

import json
import math

import pytest
import torch

from nas.data import PreparedData
from nas.model.io import load_model
from nas.builders import prepare_sweep_data
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict, use_tiny_data
from trainers import inverse_sqrt_lr, train_supernet


@pytest.fixture(scope="module")
def prepared(multi30k, tiny_data, tmp_path_factory) -> tuple[dict, PreparedData]:
    work = tmp_path_factory.mktemp("trainer")
    raw = use_tiny_data(tiny_spec_dict(multi30k, work), tiny_data)
    return raw, prepare_sweep_data(parse_spec(raw), progress=False)


def _spec(raw, **train):
    return parse_spec({**raw, "train": {**raw["train"], **train}})


def test_inverse_sqrt_schedule_warms_up_then_decays():
    f = inverse_sqrt_lr(100)
    assert f(50) == pytest.approx(0.5)
    assert f(100) == pytest.approx(1.0)
    assert f(400) == pytest.approx(0.5)


def test_training_lowers_the_loss_and_writes_a_loadable_supernet(prepared, tmp_path):
    raw, data = prepared
    reports = []
    result = train_supernet(_spec(raw, steps=30, log_every=5, lr=3e-3), data, tmp_path, report=reports.append,
                            progress=False)
    losses = [r["train_loss"] for r in reports if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.5
    assert {"widest_bleu", "widest_chrf", "widest_valid_loss"} <= set(result.metrics)
    assert json.loads((tmp_path / "metrics.json").read_text()) == result.metrics
    model = load_model(tmp_path, "supernet")
    assert model.max_arch.encoder.layers == 2 and model.max_arch.encoder.branches == (2, 2)
    assert all(math.isfinite(v) for r in reports for v in r.values())


def test_resume_from_checkpoint_matches_an_uninterrupted_run(prepared, tmp_path):
    raw, data = prepared
    straight = train_supernet(_spec(raw, steps=8), data, tmp_path / "a", progress=False)
    train_supernet(_spec(raw, steps=4), data, tmp_path / "b", progress=False)  # "killed" after step 4
    resumed = train_supernet(_spec(raw, steps=8), data, tmp_path / "b", progress=False)
    assert straight.steps == resumed.steps == 8
    a, b = load_model(tmp_path / "a", "supernet"), load_model(tmp_path / "b", "supernet")
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-6), name


def test_resuming_in_another_precision_warns_and_records_the_new_one(prepared, tmp_path):
    import warnings

    raw, data = prepared
    train_supernet(_spec(raw, steps=2, precision="fp32"), data, tmp_path, progress=False)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["state"]["precision"] == "fp32"
    with warnings.catch_warnings():  # the same precision again: no word about it
        warnings.simplefilter("error", UserWarning)
        train_supernet(_spec(raw, steps=3, precision="fp32"), data, tmp_path, progress=False)
    with pytest.warns(UserWarning, match=r"checkpoint .* trained steps 1-3 in fp32; training goes on in bf16"):
        train_supernet(_spec(raw, steps=4, precision="bf16"), data, tmp_path, progress=False)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["state"]["precision"] == "bf16"


def test_a_finished_run_is_not_trained_again(prepared, tmp_path):
    raw, data = prepared
    first = train_supernet(_spec(raw, steps=4), data, tmp_path, progress=False)
    mtime = (tmp_path / "supernet.safetensors").stat().st_mtime_ns
    again = train_supernet(_spec(raw, steps=4), data, tmp_path, progress=False)
    assert again.metrics == first.metrics
    assert (tmp_path / "supernet.safetensors").stat().st_mtime_ns == mtime


def test_checkpoint_file_is_replaced_atomically(prepared, tmp_path):
    raw, data = prepared
    train_supernet(_spec(raw, steps=4, checkpoint_every=2), data, tmp_path, progress=False)
    assert (tmp_path / "checkpoint.pt").is_file()
    assert not list(tmp_path.glob(".*.tmp"))
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["state"]["step"] == 4


def test_a_supernet_of_another_configuration_is_refused_and_kept(prepared, tmp_path):
    raw, data = prepared
    train_supernet(_spec(raw, steps=2), data, tmp_path, progress=False)
    before = (tmp_path / "supernet.safetensors").read_bytes()
    wider = parse_spec({**raw, "supernet": {**raw["supernet"], "ffn_width": 128}})
    with pytest.raises(ValueError, match="another configuration"):
        train_supernet(wider, data, tmp_path, progress=False)
    assert (tmp_path / "supernet.safetensors").read_bytes() == before


def test_training_with_units_keeps_autoshuffle_matrices_normalized(prepared, tmp_path):
    """MUTE eq. 17-18 after every optimizer step, with the eq. 19 penalty in the loss (eq. 20)."""
    raw, data = prepared
    spec = parse_spec({**raw, "supernet": {**raw["supernet"], "units": 2},
                       "space": {**raw["space"], "units": {"values": [1, 2], "per_layer": True},
                                 "unit_dependency": {"values": ["sequential"], "per_layer": True}},
                       "train": {**raw["train"], "steps": 3, "autoshuffle_penalty": 0.1}})
    result = train_supernet(spec, data, tmp_path, progress=False)
    model = load_model(tmp_path, "supernet")
    for layer in (*model.encoder, *model.decoder):
        m = layer.shuffle
        assert (m >= 0).all() and torch.allclose(m.sum(1), torch.ones(2), atol=1e-5)
    assert math.isfinite(result.metrics["widest_valid_loss"])


def test_type1_training_updates_the_eq3_projections_and_the_narrow_crop(prepared, tmp_path):
    """Type-1 Scalable Transformers: the sandwich trains C=16 and C=32 sub-Transformers of one supernet."""
    raw, data = prepared
    spec = parse_spec({**raw, "space": {"model_width": {"values": [16, 32]}, "width": {"tie": "model_width"},
                                        "ffn_width": {"tie": "model_width", "scale": 2}},
                       "train": {**raw["train"], "steps": 4, "sandwich_k": 0}})
    assert spec.io_projection
    train_supernet(spec, data, tmp_path, progress=False)
    model = load_model(tmp_path, "supernet")
    eye = torch.eye(32)
    assert not torch.allclose(model.proj_in.weight, eye) and not torch.allclose(model.proj_out.weight, eye)
    assert model.model_dim == 32 and model.embed_dim == 32


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_a_few_steps_on_the_unified_space_lower_the_loss_of_the_widest_and_the_narrowest(prepared, tmp_path):
    """search_spaces/unified.yaml's space and supernet (all five families) on the Multi30k slice."""
    import yaml

    from nas.eval.scores import valid_loss
    from nas.space.space import SearchSpace
    from tests.conftest import REPO
    from nas.builders import build_supernet

    raw, data = prepared
    unified = yaml.safe_load((REPO / "search_spaces" / "unified.yaml").read_text())
    spec = parse_spec({**raw, "supernet": {**unified["supernet"], "max_positions": 128}, "space": unified["space"],
                       "train": {**raw["train"], "steps": 25, "lr": 2e-3, "warmup_steps": 5, "precision": "fp32",
                                 "checkpoint_every": 100, "keep_last": 0}})
    space = SearchSpace.from_spec(spec)
    torch.manual_seed(spec.train.seed)  # the trainer's initialisation
    before = build_supernet(spec, data.vocab_size).eval()
    train_supernet(spec, data, tmp_path, progress=False)
    after = load_model(tmp_path, "supernet").eval()
    src, tgt = data.load_split("valid")
    for arch in (space.widest(), space.narrowest()):
        start, end = (valid_loss(m, src, tgt, arch, max_tokens=512) for m in (before, after))
        assert end < start - 0.3, (arch.summary(), start, end)
