"""A step line in a log carries the elapsed time and an ETA, as fairseq's and Hugging Face's trainers print
(issue 40: a user could not tell a 10-minute wait from a 40-minute one)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import tiny_spec_dict
from trainers.window import format_duration, timing_text


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (44.6, "45s"), (432, "7m12s"), (3600 + 180, "1h03m"),
                                           (-3, "0s")])
def test_durations_read_as_a_log_shows_them(seconds, text):
    assert format_duration(seconds) == text


def test_eta_is_the_remaining_steps_at_the_mean_rate_so_far():
    assert timing_text(432.0, 100, 560) == "7m12s, ETA 33m"  # 460 steps at 4.32 s: 1987 s
    assert timing_text(30.0, 10, 14) == "30s, ETA 12s"
    assert timing_text(600.0, 560, 560) == "10m00s, ETA 0s"
    assert timing_text(5.0, 0, 560) == "5s, ETA ?"


def test_every_step_line_of_a_run_has_its_elapsed_time_and_eta(multi30k, tmp_path, capsys):
    from nas.builders import prepare_sweep_data
    from nas.space import parse_spec
    from trainers import train_supernet

    raw = tiny_spec_dict(multi30k, tmp_path)
    raw["train"].update(stage_eval=False)  # log_every 2 of 8 steps: 4 lines
    spec = parse_spec(raw, "eta")
    train_supernet(spec, prepare_sweep_data(spec, progress=False), tmp_path / "supernet", progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/8", "4/8", "6/8", "8/8"]
    pattern = re.compile(r"^step \d+/8 joint loss [\d.]+ tok/s \d+ lr \S+ (\d+s|\d+m\d\ds), ETA (\d+s|\d+m)$")
    assert all(pattern.match(line) for line in lines), lines
    assert lines[-1].endswith("ETA 0s")
