"""``train.student_dropout`` (issue 39): BigNAS (sec. 3.1) regularises only the biggest child, and AttentiveNAS's
``train_attentive_nas.py`` calls ``set_dropout_rate(0, 0, ...)`` before the other children. With ``zero`` every
student of a distilling step runs with dropout, attention dropout and drop-branch 0 and the teacher keeps its
configured rates; with ``keep`` (the default) nothing changes. What each forward receives is read by a forward
pre-hook (:class:`tests.trainers.test_stages.Forwards`), and that it is noiseless by running it twice."""

from __future__ import annotations

import pytest
import torch

from nas.model.regularization import Regularization
from nas.space import SpecError, parse_spec
from tests.trainers.test_stages import CASES, Built, Forwards, _batch, _raw

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RHO = 0.2
"""The configured drop-branch rate (no warm-up): the teacher's in every step."""
ZERO = Regularization(dropout=0.0, attention_dropout=0.0, drop_branch=0.0)


def _step(name: str, **train) -> tuple[Built, list[tuple]]:
    """One step of stage ``name`` with dropout on (supernet 0.1, drop-branch :data:`RHO`) and ``sandwich_k: 2``:
    (the built stage, the (arch, reg) of each forward)."""
    built = Built(name, exact=False, sandwich_k=2, drop_branch=RHO, **train)
    batch = _batch(1)
    forwards = Forwards(built.model)
    built.stage.step(built.model, [batch], built.info(2, batch.ntokens))
    forwards.handle.remove()
    assert len(forwards.calls) == 4  # widest, narrowest, 2 sampled
    return built, forwards.calls


def test_with_zero_the_students_run_without_dropout_and_the_teacher_with_the_configured_rates():
    built, calls = _step("joint", inplace_distill=True, student_dropout="zero")
    configured = Regularization(dropout=0.1, attention_dropout=built.model.attention_dropout, drop_branch=RHO)
    assert built.model.dropout_rate == 0.1
    (archs,) = built.expected_archs()
    assert [arch for arch, _ in calls] == archs  # the teacher is the first: the widest
    assert [reg for _, reg in calls] == [configured, ZERO, ZERO, ZERO]


def test_with_keep_every_sub_transformer_runs_with_the_configured_rates():
    for train in ({"inplace_distill": True}, {"inplace_distill": True, "student_dropout": "keep"}):
        built, calls = _step("joint", **train)
        configured = built.model.regularization(drop_branch=RHO)
        assert configured.dropout == 0.1 and configured.drop_branch == RHO
        assert [reg for _, reg in calls] == [configured] * 4, train


def test_the_default_is_keep():
    assert parse_spec(_raw(steps=4)).train.student_dropout == "keep"


@pytest.mark.parametrize("name", ["word_distill", "seq_distill"])
def test_with_zero_the_students_of_the_distillation_stages_run_without_dropout(name):
    built, calls = _step(name, student_dropout="zero")
    assert [reg for _, reg in calls] == [built.model.regularization(drop_branch=RHO), ZERO, ZERO, ZERO]


def test_with_zero_and_a_dropout_range_the_teacher_keeps_the_range_maximum():
    built, calls = _step("joint", inplace_distill=True, student_dropout="zero", dropout_range=[0.05, 0.25])
    teacher = calls[0][1]
    assert teacher.dropout == pytest.approx(0.25) and teacher.drop_branch == pytest.approx(RHO)
    assert [reg for _, reg in calls[1:]] == [ZERO] * 3


def test_a_students_forward_is_deterministic_in_train_mode_and_the_teachers_is_not():
    """What the step hands a student makes the forward noiseless (two forwards in train mode agree), what it hands
    the teacher does not: the rates reach the model, not only the hook."""
    built, calls = _step("joint", inplace_distill=True, student_dropout="zero")
    model = built.model.train()
    batch = _batch(1)

    def twice(arch, reg):
        with torch.no_grad():
            return [model(batch.src, batch.tgt_in, arch, reg=reg) for _ in range(2)]  # [b, t, V] each

    torch.manual_seed(1)
    for arch, reg in calls[1:]:
        first, second = twice(arch, reg)
        assert torch.equal(first, second), arch.summary()
    first, second = twice(*calls[0])
    assert not torch.equal(first, second)


def test_zero_where_no_step_distils_is_refused_naming_the_key():
    with pytest.raises(SpecError, match="student_dropout") as info:
        parse_spec(_raw(stages=[CASES["joint"][0]], student_dropout="zero"))
    assert "inplace_distill" in str(info.value)


@pytest.mark.parametrize("bad", ["none", 0, True, "Zero"])
def test_a_bad_student_dropout_is_refused_naming_the_key(bad):
    with pytest.raises(SpecError, match="student_dropout") as info:
        parse_spec(_raw(steps=4, inplace_distill=True, student_dropout=bad))
    assert "keep" in str(info.value) and "zero" in str(info.value)


@pytest.mark.parametrize("train", [{"inplace_distill": True}, {"stages": [CASES["word_distill"][0]]},
                                   {"stages": [CASES["joint"][0], CASES["seq_distill"][0]]}])
def test_zero_is_accepted_wherever_a_step_distils(train):
    assert parse_spec(_raw(student_dropout="zero", **train)).train.student_dropout == "zero"
