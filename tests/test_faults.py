"""nas.faults: unarmed points do nothing; armed ones show the fault the grammar names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nas import faults
from tests.conftest import REPO


def test_unarmed_point_does_nothing(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.point("score_trial", number=3) is None


@pytest.mark.parametrize("kind, error", [("raise", RuntimeError), ("oom", torch.OutOfMemoryError)])
def test_armed_point_raises_the_named_fault(monkeypatch, kind, error):
    monkeypatch.setenv(faults.ENV, kind)
    with pytest.raises(error, match=f"{faults.ENV}={kind}: injected .* in Optuna trial 4"):
        faults.point("score_trial", number=4, label="Optuna trial 4")


def test_nan_is_returned_for_the_caller_to_apply(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan")
    assert faults.point("score_trial") == "nan"


def test_first_fires_on_the_first_attempt_only(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "nan:first")
    attempts = tmp_path / "00001.attempts"
    assert faults.point("score_trial", attempts=attempts) == "nan"
    assert faults.point("score_trial", attempts=attempts) is None
    assert attempts.read_text() == "2"


def test_trial_n_first_fires_on_the_first_attempt_of_trial_n_only(monkeypatch, tmp_path):
    """``trialNfirst``: a retry of trial N succeeds; other trials neither fire nor have their attempts counted."""
    monkeypatch.setenv(faults.ENV, "nan:trial3first")
    attempts = {n: tmp_path / f"{n:05d}.attempts" for n in (2, 3)}
    assert faults.point("score_trial", number=2, attempts=attempts[2]) is None
    assert faults.point("score_trial", number=3, attempts=attempts[3]) == "nan"
    assert faults.point("score_trial", number=3, attempts=attempts[3]) is None
    assert attempts[3].read_text() == "2" and not attempts[2].exists()


def test_trial_n_first_beside_an_always_fault_leaves_the_other_trial_failing(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "raise:trial0,nan:trial1first")
    for _ in range(2):  # trial 0 fails on its retry too; trial 1 only on its first attempt
        with pytest.raises(RuntimeError, match="injected failure"):
            faults.point("p", number=0, attempts=tmp_path / "00000.attempts")
    assert [faults.point("p", number=1, attempts=tmp_path / "00001.attempts") for _ in range(2)] == ["nan", None]


def test_even_fires_on_even_trials(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan:even")
    assert [faults.point("p", number=n) for n in range(4)] == ["nan", None, "nan", None]


@pytest.mark.parametrize("value", ["explode", "nan:sometimes", "raise:1.5", "raise:0", "1"])
def test_malformed_value_names_the_grammar(monkeypatch, value):
    monkeypatch.setenv(faults.ENV, value)
    with pytest.raises(ValueError, match="expected KIND\\[:WHEN\\]"):
        faults.point("score_trial")


@pytest.mark.parametrize("value", ["", "  ", "0", "off", "OFF", "false", "no", "none"])
def test_an_off_value_arms_nothing(monkeypatch, value):
    monkeypatch.setenv(faults.ENV, value)
    assert faults.point("score_trial", number=2) is None
    faults.check()
    assert faults.parse(value) is None


@pytest.mark.parametrize("value, armed", [("raise", [("raise", "always")]), (" nan:even ", [("nan", "even")]),
                                          ("oom:0.25", [("oom", "0.25")]), ("raise:first", [("raise", "first")]),
                                          ("raise:trial0, nan:trial12", [("raise", "trial0"), ("nan", "trial12")]),
                                          ("raise:trial3first", [("raise", "trial3first")])])
def test_parse_reads_kind_and_when(value, armed):
    assert faults.parse(value) == armed


def test_several_faults_each_fire_on_their_own_trial_and_the_first_that_holds_wins(monkeypatch):
    import torch

    monkeypatch.setenv(faults.ENV, "raise:trial0,nan:trial1,oom:trial2,nan:even")
    with pytest.raises(RuntimeError, match="injected failure"):
        faults.point("p", number=0)
    assert faults.point("p", number=1) == "nan"
    with pytest.raises(torch.OutOfMemoryError):
        faults.point("p", number=2)
    assert [faults.point("p", number=n) for n in (3, 4, 5)] == [None, "nan", None]


@pytest.mark.parametrize("value", ["explode", "raise:sometimes", "nan:1", "raise:-0.5", "1", "true", "raise:trial",
                                   "raise:trialx", "raise:trial0,explode", "raise,", "raise:trialfirst",
                                   "raise:trial3firs", "raise:firsttrial3", "raise:trial3first1"])
def test_check_refuses_a_malformed_value_as_bad_input_naming_it_and_how_to_turn_it_off(monkeypatch, value):
    from nas.errors import NasError

    monkeypatch.setenv(faults.ENV, value)
    with pytest.raises(NasError, match=f"{faults.ENV}={value!r}: expected KIND\\[:WHEN\\].*unset it, or set it to 0"):
        faults.check()


@pytest.mark.parametrize("value", ["raise:first", "raise:trial2first"])
def test_first_needs_an_attempts_file(monkeypatch, value):
    monkeypatch.setenv(faults.ENV, value)
    with pytest.raises(ValueError, match="results folder"):
        faults.point("score_trial", number=2)


# ---- kill points (NAS_TEST_KILL) -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, armed", [("mlflow_write", ("mlflow_write", 1)), (" after_tell:3 ", ("after_tell", 3)),
                                          ("0", None), ("off", None), ("", None)])
def test_parse_kill_reads_point_and_pass(value, armed):
    assert faults.parse_kill(value) == armed


@pytest.mark.parametrize("value", ["explode", "mlflow_write:0", "mlflow_write:x", "checkpoint", "after_tell:-1"])
def test_check_refuses_a_malformed_kill_value_naming_the_points(monkeypatch, value):
    from nas.errors import NasError

    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.setenv(faults.KILL_ENV, value)
    with pytest.raises(NasError, match=f"{faults.KILL_ENV}={value!r}: expected POINT\\[:N\\], POINT in "
                                       "data_prepare\\|checkpoint_write\\|mlflow_write\\|after_tell"):
        faults.check()


def _python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_an_armed_kill_point_sigkills_its_process_on_the_nth_pass_and_logs_where(tmp_path):
    import signal

    log = tmp_path / "kills.log"
    proc = _python("from nas import faults\nfor i in range(5):\n    print(i, flush=True)\n"
                   "    faults.kill_point('after_tell')\n    faults.kill_point('mlflow_write')\n",
                   tmp_path, NAS_TEST_KILL="mlflow_write:3", NAS_TEST_KILL_LOG=str(log))
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["0", "1", "2"]
    point, pid = log.read_text().split()
    assert point == "mlflow_write" and int(pid) > 0


def test_a_kill_inside_a_checkpoint_write_leaves_the_previous_checkpoint_whole(tmp_path):
    """The point sits between the temporary file's write and its rename: the old checkpoint must load."""
    import signal

    import torch

    code = ("import torch\nfrom pathlib import Path\nfrom trainers.engine import save_checkpoint\n"
            "p = Path('checkpoint.pt')\nsave_checkpoint(p, {'step': 1, 'w': torch.ones(3)})\n"
            "save_checkpoint(p, {'step': 2, 'w': torch.zeros(3)})\n")
    proc = _python(code, tmp_path, NAS_TEST_KILL="checkpoint_write:2", NAS_TEST_KILL_LOG=str(tmp_path / "k.log"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    state = torch.load(tmp_path / "checkpoint.pt")
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert (tmp_path / "k.log").read_text().startswith("checkpoint_write ")
