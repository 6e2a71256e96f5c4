"""Scalable Transformers' stage 2 end to end (sec. 3.3, 4.1): a joint + word_distill run reports each stage's
losses and lambda_2, resumes exactly, trains otherwise than joint alone and teaches with the widest's logits of
the same step; each model width trains with its dropout rate."""

import math

import pytest
import torch

from nas.model.io import load_model
from nas.space.space import SearchSpace
from nas.space import parse_spec
from tests.trainers.conftest import spec_with
from tests.trainers.test_stage_plan import TWO_STAGES
from nas.builders import build_supernet
from trainers import train_supernet, word_distill_loss
import trainers.loop
import trainers.stages.sandwich


# ---- width-dependent dropout (sec. 4.1, Table 5) ------------------------------------------------------

def test_the_dropout_rate_passed_to_the_forward_is_the_one_applied(prepared):
    """Regularisation is passed, not set (issue 13): rate 0 is the deterministic model, a rate > 0
    changes the output, and the model keeps no rate of a call."""
    raw, data = prepared
    model = build_supernet(spec_with(raw, steps=1), data.vocab_size).train()
    config = model.config()
    src = torch.tensor([[5, 6, 7, 8]])
    plain = model(src, src)
    torch.manual_seed(0)
    assert torch.equal(model(src, src, reg=model.regularization(dropout=0.0, attention_dropout=0.0,
                                                                drop_branch=0.0)), plain)
    torch.manual_seed(0)
    assert not torch.allclose(model(src, src, reg=model.regularization(dropout=0.3)), plain)
    assert model.config() == config and torch.equal(model(src, src), plain)


def test_training_runs_each_width_with_its_dropout_rate(prepared, tmp_path, monkeypatch):
    """Type-1 space C in {16, 32}: the sandwich's C=32 forward sees p=0.3, the C=16 one p=0.0."""
    raw, data = prepared
    spec = parse_spec({**raw, "space": {"model_width": {"values": [16, 32]}, "width": {"tie": "model_width"},
                                        "ffn_width": {"tie": "model_width", "scale": 2}},
                       "train": {**raw["train"], "steps": 1, "sandwich_k": 0, "width_dropout": {16: 0.0, 32: 0.3}}})
    seen = []

    def spying_build(*args):
        model = build_supernet(*args)
        model.register_forward_pre_hook(
            lambda m, inputs, kwargs: seen.append((inputs[2].model_width, kwargs["reg"].dropout))
            if kwargs.get("reg") else None, with_kwargs=True)  # training forwards only (evaluation passes no reg)
        return model

    monkeypatch.setattr(trainers.loop, "build_supernet", spying_build)
    train_supernet(spec, data, tmp_path, progress=False)
    assert seen == [(32, 0.3), (16, 0.0)]
    assert load_model(tmp_path, "supernet").config()["dropout"] == 0.1  # supernet.dropout, untouched


def test_a_model_width_without_a_dropout_rate_is_refused_before_training(prepared, tmp_path):
    raw, data = prepared
    with pytest.raises(ValueError, match=r"train.width_dropout has no rate for model width\(s\) \[32\]"):
        train_supernet(spec_with(raw, steps=1, width_dropout={64: 0.1}), data, tmp_path, progress=False)
    assert not (tmp_path / "checkpoint.pt").exists()


# ---- a 2-stage run ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_stage_run(prepared, tmp_path_factory):
    raw, data = prepared
    out = tmp_path_factory.mktemp("two_stages")
    reports = []
    result = train_supernet(spec_with(raw, stages=TWO_STAGES), data, out, report=reports.append, progress=False)
    return out, result, reports


def test_two_stage_run_reports_stage_losses_and_lambda(two_stage_run):
    out, result, reports = two_stage_run
    steps = [r for r in reports if "stage" in r and "stage_end" not in r]
    assert result.steps == 6 and [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["stage"] for r in steps] == [1, 1, 1, 2, 2, 2]
    assert [r.get("lambda_2") for r in steps] == [None, None, None, 1.0, 0.75, 0.5]
    for r in steps:
        assert {"loss_widest", "loss_narrowest", "loss_sampled", "grad_norm"} <= set(r)
        assert r["loss_widest"] == r["train_loss"]
        assert ("loss_distill" in r) == (r["stage"] == 2)
    assert all(math.isfinite(v) for r in reports for v in r.values())
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["state"]["stage"] == "word_distill" and ckpt["state"]["step"] == 6


def test_resume_in_the_middle_of_word_distill_matches_an_uninterrupted_run(prepared, two_stage_run, tmp_path):
    raw, data = prepared
    spec = spec_with(raw, stages=TWO_STAGES)

    def crash_at_step_5(metrics):
        if metrics.get("step") == 5:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        train_supernet(spec, data, tmp_path, report=crash_at_step_5, progress=False)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["state"]["step"] == 4 and ckpt["state"]["stage"] == "word_distill"  # stage 2's j=1 of 3
    resumed = train_supernet(spec, data, tmp_path, progress=False)
    assert resumed.steps == 6
    straight = load_model(two_stage_run[0], "supernet").state_dict()
    for name, p in load_model(tmp_path, "supernet").state_dict().items():
        assert torch.allclose(p, straight[name], atol=1e-6), name


def test_word_distill_changes_training_compared_with_joint(prepared, two_stage_run, tmp_path):
    """Same seed and batches, 3 joint + 3 joint steps: the weights differ from joint + word_distill."""
    raw, data = prepared
    train_supernet(spec_with(raw, stages=[{"name": "joint", "steps": 3}, {"name": "joint", "steps": 3}]), data, tmp_path,
                   progress=False)
    joint = load_model(tmp_path, "supernet").state_dict()
    distilled = load_model(two_stage_run[0], "supernet").state_dict()
    assert any(not torch.allclose(joint[k], distilled[k], atol=1e-6) for k in joint)


def test_word_distill_teaches_with_the_widest_logits_of_the_same_step(prepared, tmp_path, monkeypatch):
    """One widest forward per step; its logits, detached, are the target of the narrowest and the sampled one."""
    raw, data = prepared
    spec = spec_with(raw, stages=[{"name": "word_distill", "steps": 2, "lambda_start": 0.5}])
    forwards, teachers = [], []

    def spying_build(*args):
        model = build_supernet(*args)
        model.register_forward_hook(
            lambda m, inputs, out: forwards.append((inputs[2], out.detach().clone())) if m.training else None)
        return model

    def spying_loss(logits, teacher_logits, *args, **kwargs):
        teachers.append((teacher_logits.clone(), teacher_logits.requires_grad, kwargs.get("probs", False)))
        return word_distill_loss(logits, teacher_logits, *args, **kwargs)

    monkeypatch.setattr(trainers.loop, "build_supernet", spying_build)
    monkeypatch.setattr(trainers.stages.sandwich, "word_distill_loss", spying_loss)
    train_supernet(spec, data, tmp_path, progress=False)
    assert len(forwards) == 2 * 3 and len(teachers) == 2 * 2  # widest, narrowest, 1 sampled; 2 students
    widest = SearchSpace.from_spec(spec).widest()
    for step in range(2):
        arch, widest_logits = forwards[3 * step]
        assert arch == widest
        for teacher, requires_grad, probs in teachers[2 * step:2 * step + 2]:  # the widest's softmax, computed once
            expected = torch.softmax(widest_logits.float(), -1) if probs else widest_logits
            assert torch.equal(teacher, expected) and not requires_grad
