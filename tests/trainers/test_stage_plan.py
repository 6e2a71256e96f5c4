"""Scalable Transformers' stage plan (sec. 3.3): the stage and lambda_2 (eq. 5) of a global step, and the YAML's
``train.stages`` with its errors."""

import pytest

from nas.space import SpecError, parse_spec
from trainers import anneal_lambda, stage_at

TWO_STAGES = [{"name": "joint", "steps": 3},
              {"name": "word_distill", "steps": 3, "lambda_start": 1.0, "lambda_end": 0.5, "lambda_steps": 2}]


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
