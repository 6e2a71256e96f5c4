"""Scalable Transformers' word-level distillation losses (sec. 3.3): the stage-2 loss against hand computations,
the detached teacher, lambda's range."""

import math

import pytest
import torch

from nas.model.losses import label_smoothed_nll
from trainers import soft_cross_entropy, word_distill_loss


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
