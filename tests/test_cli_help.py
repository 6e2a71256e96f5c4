"""Help texts are plain text (issue 30): no reST roles or literals from docstrings, and no option text eaten by
rich markup (``nas[serve]``)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from nas.cli import app

COMMANDS = [[], ["sweep"], ["train"], ["retrain"], ["average"], ["leaderboard"], ["report"], ["export"],
            ["translate"], ["fidelity"], ["space"], ["space", "show"], ["space", "sample"], ["latency"],
            ["latency", "fit"]]
SPHINX = re.compile(r":(class|func|mod|meth|attr|data|exc):|``")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "nas")
def test_help_is_plain_text(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not SPHINX.search(result.output), result.output


def test_export_help_keeps_the_serve_extra():
    result = CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "200"})
    assert "nas[serve]" in result.output, result.output


def test_the_sweep_end_says_when_trials_scored_on_a_validation_subset():
    """With ``search.valid_sentences`` the trials' BLEU is on a subset (quickstart: 500 of 1,014), higher or lower
    than the supernet's figure on the whole set; the sweep's last lines say which."""
    from nas.cli import trial_bleu_scope

    assert trial_bleu_scope(None) is None
    assert "first 500 validation sentences (search.valid_sentences)" in trial_bleu_scope(500)
