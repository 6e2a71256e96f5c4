"""One nested MLflow run per training stage, with the reference sub-Transformers' BLEU at each stage's end."""

import yaml
from typer.testing import CliRunner

from nas import tracking
from nas.cli import app
from tests.conftest import tiny_spec_dict

STAGES = [{"name": "joint", "steps": 2}, {"name": "word_distill", "steps": 2},
          {"name": "seq_distill", "steps": 2, "max_sentences": 24, "beam_size": 2}]


def _children(client, parent):
    runs = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    return sorted(runs, key=lambda r: r.data.tags["nas.stage"])


def test_nas_train_logs_one_nested_run_per_stage(multi30k, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)
    raw = tiny_spec_dict(multi30k, tmp_path)
    raw["train"] = {k: v for k, v in raw["train"].items() if k != "steps"} | \
        {"stages": STAGES, "max_tokens": 128, "precision": "fp32", "log_every": 1, "keep_last": 0}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "tiny.yaml")])
    assert result.exit_code == 0, result.output
    client = tracking.get_client()  # the env URI, whatever mlflow.set_tracking_uri an earlier test left
    supernet = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                                  "tags.`nas.role` = 'supernet'")
    assert len(supernet) == 1 and supernet[0].info.status == "FINISHED"
    parent = supernet[0]
    stages = _children(client, parent.info.run_id)
    assert [r.info.run_name for r in stages] == ["stage 1 (joint)", "stage 2 (word_distill)", "stage 3 (seq_distill)"]
    for n, run in enumerate(stages, 1):
        assert run.info.status == "FINISHED" and run.data.tags["nas.role"] == "stage"
        assert {"loss_widest", "loss_narrowest", "tokens_per_s", "lr", "grad_norm", "bleu_narrowest", "bleu_middle",
                "bleu_widest"} <= set(run.data.metrics)
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss_widest")]
        assert steps == [2 * n - 1, 2 * n]  # only this stage's steps
        assert parent.data.metrics[f"stage{n}_bleu_widest"] == run.data.metrics["bleu_widest"]
    assert "lambda_3" in stages[2].data.metrics and "lambda_2" in stages[1].data.metrics


def test_a_restarted_trainer_reuses_the_open_stage_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)
    parent = tracking.start_run("x", "supernet", role="supernet")
    first = tracking.StageRuns("x", parent)
    first({"stage": 1, "loss_widest": 3.0, "step": 1})
    second = tracking.StageRuns("x", parent)  # the driver was killed; a new one resumes
    second({"stage": 1, "loss_widest": 2.0, "step": 2})
    second({"stage": 1, "stage_end": 1, "bleu_widest": 1.5, "step": 2})
    second({"stage": 2, "loss_widest": 1.0, "step": 3})
    second.close("KILLED")
    client = tracking.get_client()  # the env URI, whatever mlflow.set_tracking_uri an earlier test left
    runs = _children(client, parent)
    assert [r.data.tags["nas.stage"] for r in runs] == ["1", "2"]
    assert [r.info.status for r in runs] == ["FINISHED", "KILLED"]
    assert [m.value for m in client.get_metric_history(runs[0].info.run_id, "loss_widest")] == [3.0, 2.0]
    assert client.get_run(parent).data.metrics["stage1_bleu_widest"] == 1.5
