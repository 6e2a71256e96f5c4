"""Scalable Transformers' stages: the stage-2 loss, its lambda_2 schedule, the YAML, a 2-stage run with exact
resume, width-dependent dropout."""

import math

import pytest
import torch

from nas.model.io import load_model
from nas.model.losses import label_smoothed_nll
from nas.builders import prepare_sweep_data
from nas.space.space import SearchSpace
from nas.space import SpecError, parse_spec
from tests.conftest import tiny_spec_dict
from nas.builders import build_supernet
from trainers import anneal_lambda, soft_cross_entropy, stage_at, train_supernet, \
    word_distill_loss
import trainers.loop
import trainers.stages.sandwich

TWO_STAGES = [{"name": "joint", "steps": 3},
              {"name": "word_distill", "steps": 3, "lambda_start": 1.0, "lambda_end": 0.5, "lambda_steps": 2}]


@pytest.fixture(scope="module")
def prepared(multi30k, tmp_path_factory):
    work = tmp_path_factory.mktemp("distill")
    raw = tiny_spec_dict(multi30k, work)
    # fp32 and 128-token batches: a step takes milliseconds on 2 cores (bf16 autocast is slow without AMX)
    raw["train"] = {k: v for k, v in raw["train"].items() if k != "steps"} | \
        {"max_tokens": 128, "precision": "fp32", "log_every": 1, "checkpoint_every": 2, "keep_last": 0}
    return raw, prepare_sweep_data(parse_spec({**raw, "train": {**raw["train"], "steps": 1}}), progress=False)


def _spec(raw, **train):
    return parse_spec({**raw, "train": {**raw["train"], **train}})


# ---- the stage-2 loss (sec. 3.3) ------------------------------------------------------------------

# one sentence, t=3, V=3; the last target is padding (id 0)
STUDENT = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [5.0, 5.0, 5.0]]])
TEACHER = torch.tensor([[[2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [-4.0, 9.0, 0.0]]])
TARGET = torch.tensor([[1, 2, 0]])


def _softmax(xs):
    e = [math.exp(x) for x in xs]
    return [v / sum(e) for v in e]


def test_soft_cross_entropy_matches_a_hand_computation_and_skips_padding():
    expected = 0.0
    for t in range(2):  # position 2 is padding
        p, q = _softmax(TEACHER[0, t].tolist()), _softmax(STUDENT[0, t].tolist())
        expected += -sum(pv * math.log(qv) for pv, qv in zip(p, q))
    assert soft_cross_entropy(STUDENT, TEACHER, TARGET).item() == pytest.approx(expected, rel=1e-6)


def test_word_distill_loss_mixes_ground_truth_and_teacher_by_lambda():
    eps, lam = 0.1, 0.7
    hard = soft = 0.0
    for t, gold in enumerate([1, 2]):
        q = _softmax(STUDENT[0, t].tolist())
        hard += (1 - eps) * -math.log(q[gold]) + eps * -sum(math.log(v) for v in q) / 3
        p = _softmax(TEACHER[0, t].tolist())
        soft += -sum(pv * math.log(qv) for pv, qv in zip(p, q))
    objective, h, s = word_distill_loss(STUDENT, TEACHER, TARGET, lam, eps)
    assert h.item() == pytest.approx(hard, rel=1e-6) and s.item() == pytest.approx(soft, rel=1e-6)
    assert objective.item() == pytest.approx(lam * hard + (1 - lam) * soft, rel=1e-6)


def test_word_distill_loss_with_lambda_one_is_the_stage1_cross_entropy():
    objective, _, _ = word_distill_loss(STUDENT, TEACHER, TARGET, 1.0, 0.1)
    assert torch.equal(objective, label_smoothed_nll(STUDENT, TARGET, 0.1)[0])


def test_no_gradient_reaches_the_widest_through_the_distillation_term():
    student = STUDENT.clone().requires_grad_(True)
    teacher = TEACHER.clone().requires_grad_(True)
    objective, _, _ = word_distill_loss(student, teacher, TARGET, 0.5, 0.1)
    objective.backward()
    assert teacher.grad is None or torch.count_nonzero(teacher.grad) == 0
    assert torch.count_nonzero(student.grad[0, :2]) > 0
    assert torch.count_nonzero(student.grad[0, 2]) == 0  # padding


def test_word_distill_loss_refuses_lambda_outside_0_1():
    with pytest.raises(ValueError, match="lambda_2=1.5"):
        word_distill_loss(STUDENT, TEACHER, TARGET, 1.5, 0.1)


# ---- the stage plan and the lambda_2 schedule (eq. 5) ---------------------------------------------

def test_anneal_lambda_is_eq5_for_start_1_end_half():
    t_j = 10
    for j in (0, 3, 5, 9):
        assert anneal_lambda(j, 1.0, 0.5, t_j) == pytest.approx(1 - 0.5 * j / t_j)
    assert anneal_lambda(10, 1.0, 0.5, t_j) == anneal_lambda(40, 1.0, 0.5, t_j) == 0.5
    assert anneal_lambda(0, 1.0, 0.2, 0) == 0.2


def test_stage_and_lambda_follow_from_the_global_step():
    plan = parse_spec_train({"stages": [{"name": "joint", "steps": 3},
                                        {"name": "word_distill", "steps": 5, "lambda_steps": 4}]}).stage_plan
    got = [(p.stage.name, p.step, p.lambda_2) for p in (stage_at(plan, s) for s in range(8))]
    assert got == [("joint", 0, None), ("joint", 1, None), ("joint", 2, None),
                   ("word_distill", 0, 1.0), ("word_distill", 1, 0.875), ("word_distill", 2, 0.75),
                   ("word_distill", 3, 0.625), ("word_distill", 4, 0.5)]  # start, middle, end, then constant
    assert [stage_at(plan, s).number for s in (2, 3)] == [1, 2]
    with pytest.raises(ValueError, match="add up to 8 steps"):
        stage_at(plan, 8)


def test_lambda_steps_defaults_to_half_the_stage_so_lambda_2_reaches_its_plateau():
    """Eq. 5's t_j is not given by the paper; by default lambda_2 reaches lambda_end half-way and holds it."""
    plan = parse_spec_train({"stages": [{"name": "word_distill", "steps": 4, "lambda_end": 0.6}]}).stage_plan
    assert [stage_at(plan, s).lambda_2 for s in range(4)] == pytest.approx([1.0, 0.8, 0.6, 0.6])


# ---- the YAML ---------------------------------------------------------------------------------------

BASE = {"name": "x", "data": {"train": {"src": "a", "tgt": "b"}, "valid": {"src": "a", "tgt": "b"}},
        "supernet": {"model_dim": 32, "encoder_layers": 1, "decoder_layers": 1, "ffn_width": 64}}


def parse_spec_train(train):
    return parse_spec({**BASE, "train": train}).train


def test_without_stages_training_is_one_joint_stage_of_train_steps():
    tr = parse_spec_train({"steps": 7})
    assert tr.stages is None and [(s.name, s.steps) for s in tr.stage_plan] == [("joint", 7)]
    assert tr.width_dropout is None


def test_train_steps_is_the_sum_of_the_stages_when_left_out():
    tr = parse_spec_train({"stages": TWO_STAGES})
    assert tr.steps == 6
    assert parse_spec_train(tr.model_dump(mode="json")).steps == 6  # what MLflow params record re-validates


@pytest.mark.parametrize("train, fragments", [
    ({"steps": 10, "stages": TWO_STAGES}, ["train.steps=10", "train.stages add up to 6", "leave train.steps out"]),
    ({"stages": TWO_STAGES[::-1]}, ["train.stages.1 (joint) comes after train.stages.0 (word_distill)"]),
    ({"stages": [TWO_STAGES[0], {"name": "seq_distill", "steps": 2}, TWO_STAGES[1]]},
     ["train.stages.2 (word_distill) comes after train.stages.1 (seq_distill)", "joint -> word_distill -> seq_distill"]),
    ({"stages": [{"name": "seq_distill", "steps": 2, "lambda_3": 1.2}]},
     ["train.stages.0.seq_distill.lambda_3", "less than or equal to 1"]),
    ({"stages": [{"name": "seq_distill", "steps": 2, "beam": 4}]},
     ["train.stages.0.seq_distill.beam: unknown key (did you mean 'beam_size'?)"]),
    ({"accumulate": 0}, ["train.accumulate", "greater than or equal to 1"]),
    ({"stages": [{"name": "word_distill", "steps": 3, "lambda_end": 1.5}]},
     ["train.stages.0.word_distill.lambda_end", "less than or equal to 1"]),
    ({"stages": [{"name": "word_distill", "steps": 3, "lambda_start": -0.1}]},
     ["train.stages.0.word_distill.lambda_start", "greater than or equal to 0"]),
    ({"stages": [{"name": "word_distill", "steps": 3, "lambda_steps": 4}]}, ["lambda_steps=4", "steps=3"]),
    ({"stages": [{"name": "joint", "steps": 3, "lambda_end": 0.5}]}, ["train.stages.0.joint.lambda_end: unknown key"]),
    ({"width_dropout": {0: 0.1}}, ["train.width_dropout", "key 0 is not a model width"]),
    ({"width_dropout": {"wide": 0.1}}, ["train.width_dropout", "key 'wide'"]),
    ({"width_dropout": {32: 1.0}}, ["train.width_dropout", "width 32 has rate 1.0", "[0, 1)"]),
], ids=["steps_not_summing", "word_distill_before_joint", "word_distill_after_seq_distill", "lambda_3_above_1",
        "seq_distill_unknown_key", "accumulate_zero", "lambda_above_1",
        "lambda_below_0", "lambda_steps_above_steps", "lambda_on_joint", "width_zero", "width_not_int",
        "rate_one"])
def test_bad_train_section_names_the_key(train, fragments):
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, "train": train}, "bad.yaml")
    for fragment in fragments:
        assert fragment in str(info.value)


# ---- width-dependent dropout (sec. 4.1, Table 5) ------------------------------------------------------

def test_the_dropout_rate_passed_to_the_forward_is_the_one_applied(prepared):
    """Regularisation is passed, not set (issue 13): rate 0 is the deterministic model, a rate > 0
    changes the output, and the model keeps no rate of a call."""
    raw, data = prepared
    model = build_supernet(_spec(raw, steps=1), data.vocab_size).train()
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
        train_supernet(_spec(raw, steps=1, width_dropout={64: 0.1}), data, tmp_path, progress=False)
    assert not (tmp_path / "checkpoint.pt").exists()


# ---- a 2-stage run ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_stage_run(prepared, tmp_path_factory):
    raw, data = prepared
    out = tmp_path_factory.mktemp("two_stages")
    reports = []
    result = train_supernet(_spec(raw, stages=TWO_STAGES), data, out, report=reports.append, progress=False)
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
    spec = _spec(raw, stages=TWO_STAGES)

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
    train_supernet(_spec(raw, stages=[{"name": "joint", "steps": 3}, {"name": "joint", "steps": 3}]), data, tmp_path,
                   progress=False)
    joint = load_model(tmp_path, "supernet").state_dict()
    distilled = load_model(two_stage_run[0], "supernet").state_dict()
    assert any(not torch.allclose(joint[k], distilled[k], atol=1e-6) for k in joint)


def test_word_distill_teaches_with_the_widest_logits_of_the_same_step(prepared, tmp_path, monkeypatch):
    """One widest forward per step; its logits, detached, are the target of the narrowest and the sampled one."""
    raw, data = prepared
    spec = _spec(raw, stages=[{"name": "word_distill", "steps": 2, "lambda_start": 0.5}])
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
