"""The Python API (issue 29): ``nas.export`` is both the package and the user job, and the API's bad-input
errors (``NasError``, nothing started).

The user jobs through ``import nas`` on a real sweep (``nas.sweep`` with overrides, ``nas.leaderboard``,
``nas.export`` best and by run-id prefix, ``nas.translate``, in a fresh ``python -c`` process as a notebook would
run them), and the ``${NAS_DB_PASSWORD}`` secret of its YAML found nowhere afterwards, are tested on the combined
backends sweep (``tests/infra/test_backends_sweep.py``), whose driver they are: one Ray sweep for both."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_export_is_the_package_and_the_user_job():
    import nas
    import nas.export.folder  # importing a submodule binds nas.export to the package: it must stay callable

    assert callable(nas.export) and nas.export.export_trial.__module__ == "nas.export.trial"
    assert {"export", "leaderboard"} <= set(nas.__all__)


@pytest.mark.parametrize("call, message", [
    (lambda nas, tmp: nas.export(tmp / "x"), "exactly one of --best or --run-id"),
    (lambda nas, tmp: nas.export(3, best=True), "export(out_dir): expected a folder path"),
    (lambda nas, tmp: nas.export(tmp / "x", run_id="abc", quantize="int4"), "the one quantization is int8"),
    (lambda nas, tmp: nas.sweep(tmp / "missing.yaml"), "missing.yaml"),
    (lambda nas, tmp: nas.sweep(42), "sweep(path): expected a file path"),
    (lambda nas, tmp: nas.train("search_spaces/quickstart.yaml", overrides=["train.steps=2"]),
     "overrides: expected a dict"),
    (lambda nas, tmp: nas.train("search_spaces/quickstart.yaml", overrides={"train.steps": object()}),
     "is not a YAML value"),
    (lambda nas, tmp: nas.train(nas.load_spec("search_spaces/quickstart.yaml"), overrides={"train.steps": 2}),
     "overrides apply to a YAML path"),
    (lambda nas, tmp: nas.train("search_spaces/quickstart.yaml", overrides={"train.nosuch": 2}), "nosuch"),
    (lambda nas, tmp: nas.leaderboard(top=0), "expected a positive int"),
])
def test_the_api_refuses_bad_input_with_a_nas_error(call, message, tmp_path, monkeypatch):
    import nas

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(nas.NasError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        call(nas, tmp_path)
    assert not (tmp_path / "x").exists()
