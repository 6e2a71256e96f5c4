"""`nas export --run-id` of a trial that breaks its sweep's search.constraints exports it with a warning naming the
bound and the value (before: without a word); a feasible one exports quietly."""

from __future__ import annotations

from typer.testing import CliRunner

from nas.cli import app


def test_an_infeasible_run_id_exports_with_a_warning_naming_the_constraint(constrained_trials, tmp_path):
    ids, *_ = constrained_trials
    runner = CliRunner()
    result = runner.invoke(app, ["export", "--run-id", ids["wide"][:8], "--out", str(tmp_path / "wide")])
    assert result.exit_code == 0, (result.output, result.exception)
    said = " ".join(result.stderr.split())
    assert (f"warning: run {ids['wide']} breaks sweep C's search.constraints: latency_ms<=30 (latency_ms is 45); "
            "exporting it anyway") in said, said
    assert (tmp_path / "wide" / "model.safetensors").is_file()
    result = runner.invoke(app, ["export", "--run-id", ids["narrow"], "--out", str(tmp_path / "narrow")])
    assert result.exit_code == 0 and "warning" not in result.stderr, result.stderr
