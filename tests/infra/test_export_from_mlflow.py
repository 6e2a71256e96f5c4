"""Export when the supernet is on neither this machine nor MLflow: the error names both places.

The export through a real ``mlflow server`` with the sweep's folders elsewhere is tested on the combined backends
sweep (``tests/infra/test_backends_sweep.py``)."""

from __future__ import annotations


def test_export_names_what_is_missing_when_neither_the_folder_nor_mlflow_holds_the_supernet(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from nas import tracking
    from nas.cli import app
    from nas.space.arch import Arch, StackArch

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    arch = Arch(StackArch((16,), (32,)), StackArch((16,), (32,)))
    parent = tracking.start_run("lost", "s", role="sweep", tags={"nas.sweep_id": "s"})
    trial = tracking.start_run("lost", "t", role="trial", parent_run_id=parent,
                               tags={"nas.supernet_dir": str(tmp_path / "gone"), "nas.data_dir": str(tmp_path / "gone")})
    tracking.log_json_artifact(trial, arch.to_dict(), "arch.json")
    tracking.end_run(trial)
    result = CliRunner().invoke(app, ["export", "--run-id", trial, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert f"is neither in {tmp_path / 'gone'} on this machine nor in the artifacts of its sweep's supernet run" in message
    assert not (tmp_path / "x").exists()
