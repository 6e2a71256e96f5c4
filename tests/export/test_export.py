"""Export: standalone files that translate exactly like the supernet's sub-Transformer."""

import json

import pytest
import torch

from nas.data import Tokenizer, read_lines
from nas.eval.scores import translate
from nas.export import export_arch, load_export
from nas.model import SuperTransformer
from nas.model.io import save_model
from nas.space.arch import Arch, StackArch
from tests.tracking.test_tracking import empty_mlflow_db, mlflow_uri  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def tokenizer(multi30k, tmp_path_factory) -> Tokenizer:
    lines = read_lines(multi30k / "train.en.gz", limit=500) + read_lines(multi30k / "train.de.gz", limit=500)
    return Tokenizer.train(lines, tmp_path_factory.mktemp("spm") / "spm", vocab_size=300)


def test_export_translates_like_the_supernet_sub_transformer(tokenizer, multi30k, tmp_path):
    torch.manual_seed(0)
    maxima = Arch(StackArch((32, 32), (64, 64), (2, 2)), StackArch((32, 32), (64, 64), (2, 2)))
    supernet = SuperTransformer(tokenizer.vocab_size, 32, 2, maxima, max_positions=128).eval()
    save_model(supernet, tmp_path / "sn", "supernet")
    arch = Arch(StackArch((16,), (32,), (2,)), StackArch((32, 16), (64, 32), (1, 2)))
    out = export_arch(tmp_path / "sn", tokenizer.model_path, arch, tmp_path / "exported", beam_size=3,
                      provenance={"run_id": "abc"})
    assert sorted(p.name for p in out.iterdir()) == ["arch.json", "export.json", "model.json", "model.safetensors", "spm.model"]
    assert json.loads((out / "export.json").read_text())["run_id"] == "abc"
    exported = load_export(out)
    assert exported.arch == arch and exported.beam_size == 3
    src = read_lines(multi30k / "test_2016_flickr.en.gz", limit=6)
    assert exported.translate(src) == translate(supernet, tokenizer, src, arch, beam_size=3)


def test_export_replaces_an_existing_folder_and_refuses_a_too_wide_arch(tokenizer, tmp_path):
    maxima = Arch(StackArch((16,), (32,), (1,)), StackArch((16,), (32,), (1,)))
    save_model(SuperTransformer(tokenizer.vocab_size, 16, 2, maxima), tmp_path / "sn", "supernet")
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "stale.txt").write_text("old")
    export_arch(tmp_path / "sn", tokenizer.model_path, maxima, tmp_path / "exported")
    assert not (tmp_path / "exported" / "stale.txt").exists()
    too_wide = Arch(StackArch((32,), (32,), (1,)), StackArch((16,), (32,), (1,)))
    with pytest.raises(ValueError, match=r"encoder\.width\[0\]=32"):
        export_arch(tmp_path / "sn", tokenizer.model_path, too_wide, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_loading_a_folder_that_is_not_an_export_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a nas export"):
        load_export(tmp_path)


@pytest.fixture
def constrained_trials(tokenizer, tmp_path, mlflow_uri):
    """A real supernet and SentencePiece model on disk, and sweep C under ``latency_ms<=30`` in a real MLflow
    store with two trial runs as `nas sweep` leaves them (tags naming the supernet and data folders, arch.json):
    the wide one has the better BLEU but breaks the constraint, the narrow one meets it."""
    from nas import tracking

    maxima = Arch(StackArch((32, 32), (64, 64), (2, 2)), StackArch((32, 32), (64, 64), (2, 2)))
    save_model(SuperTransformer(tokenizer.vocab_size, 32, 2, maxima, max_positions=128), tmp_path / "sn", "supernet")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "spm.model").write_bytes(tokenizer.model_path.read_bytes())
    narrow = Arch(StackArch((16,), (32,), (1,)), StackArch((16,), (32,), (1,)))
    tags = {"nas.supernet_dir": str(tmp_path / "sn"), "nas.data_dir": str(tmp_path / "data"), "nas.beam_size": "2"}

    def sweep(experiment: str, sweep_id: str, trials: dict) -> dict[str, str]:
        parent = tracking.start_run(experiment, sweep_id, role="sweep", tags={"nas.sweep_id": sweep_id},
                                    params={tracking.PARAM_CONSTRAINTS: "latency_ms<=30"})
        ids = {}
        for name, (arch, metrics) in trials.items():
            ids[name] = tracking.start_run(experiment, name, role="trial", parent_run_id=parent,
                                           tags={**tags, "nas.arch_summary": arch.summary()})
            tracking.log_metrics(ids[name], metrics)
            tracking.log_json_artifact(ids[name], arch.to_dict(), "arch.json")
            tracking.end_run(ids[name])
        tracking.end_run(parent)
        return ids

    ids = sweep("constrained", "C", {"wide": (maxima, {"bleu": 25.0, "latency_ms": 45.0}),
                                     "narrow": (narrow, {"bleu": 20.0, "latency_ms": 12.0})})
    ids.update(sweep("all-slow", "S", {"slow": (maxima, {"bleu": 25.0, "latency_ms": 45.0})}))
    return ids, maxima, narrow


def test_export_best_exports_the_best_trial_meeting_the_sweep_s_constraints(constrained_trials, tmp_path):
    from typer.testing import CliRunner

    from nas.cli import app

    ids, _, narrow = constrained_trials
    result = CliRunner().invoke(app, ["export", "--best", "--experiment", "constrained", "--out", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "x" / "export.json").read_text())["run_id"] == ids["narrow"]
    assert load_export(tmp_path / "x").arch == narrow
    assert "meets its sweep's search.constraints latency_ms<=30 (sweep C)" in " ".join(result.stdout.split())


def test_export_best_with_no_feasible_trial_names_the_constraints_unless_infeasible_ones_are_included(
        constrained_trials, tmp_path):
    from typer.testing import CliRunner

    from nas.cli import app

    ids, maxima, _ = constrained_trials
    runner = CliRunner()
    result = runner.invoke(app, ["export", "--best", "--experiment", "all-slow", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert ("none of the 1 finished trials in experiment 'all-slow' meets its sweep's search.constraints "
            "(latency_ms<=30 (sweep S)); pass --include-infeasible") in message
    assert not (tmp_path / "x").exists()
    result = runner.invoke(app, ["export", "--best", "--experiment", "all-slow", "--include-infeasible",
                                 "--out", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "x" / "export.json").read_text())["run_id"] == ids["slow"]
    assert load_export(tmp_path / "x").arch == maxima
    assert "breaks its sweep's search.constraints latency_ms<=30 (sweep S)" in " ".join(result.stderr.split())
