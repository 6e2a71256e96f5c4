"""Training progress reaches a log at least every ``trainers.loop.PROGRESS_EVERY_S`` seconds, not only every
``train.log_every`` steps (issue 30: inside Ray a line came every 50 steps, minutes apart on a slow machine)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import tiny_spec_dict, use_tiny_data


@pytest.mark.parametrize("every_s, lines", [(0.0, 8), (1e9, 1)])
def test_step_lines_come_every_progress_interval_too(every_s, lines, multi30k, tiny_data, tmp_path, capsys, monkeypatch):
    import trainers.loop
    from nas.builders import prepare_sweep_data
    from nas.space import parse_spec
    from trainers import train_supernet

    monkeypatch.setattr(trainers.loop, "PROGRESS_EVERY_S", every_s)
    raw = use_tiny_data(tiny_spec_dict(multi30k, tmp_path), tiny_data)
    raw["train"].update(log_every=100, stage_eval=False)  # by steps: only the last step (8 of 8) logs
    spec = parse_spec(raw, "progress")
    data = prepare_sweep_data(spec, progress=False)
    reported = []
    train_supernet(spec, data, tmp_path / "supernet", report=reported.append, progress=False)
    printed = re.findall(r"^step (\d+)/8 ", capsys.readouterr().err, flags=re.M)
    assert len(printed) == lines, printed
    assert printed[-1] == "8"
