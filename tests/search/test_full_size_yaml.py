"""The GPU-sized ``search_spaces/multi30k_en_de.yaml`` parses, builds and runs on this CPU, cut down by ``--set``
overrides only (the file itself is not edited): real Ray Tune, Optuna and MLflow."""

from pathlib import Path

import pytest

from tests.conftest import REPO, nas_cli, nas_env, read_sweep, run_nas


YAML = REPO / "search_spaces" / "multi30k_en_de.yaml"


def _cut(work: Path) -> list[str]:
    """Steps, trials, data and resources cut to seconds on 2 CPU cores; every model dimension kept."""
    sets = {"workdir": work / "runs", "data.cache_dir": work / "data", "data.max_train_pairs": 400,
            "data.max_valid_pairs": 4, "data.tokenizer.vocab_size": 500, "train.steps": 2, "train.max_tokens": 512,
            "train.warmup_steps": 1, "train.checkpoint_every": 2, "train.log_every": 1, "train.eval_beam_size": 1,
            "search.trials": 1, "search.max_concurrent": 1, "search.cpu_per_trial": 1, "search.beam_size": 1,
            "search.latency_sentences": 1, "resources.cpu": 2, "resources.gpu": 0}
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


@pytest.mark.slow
def test_the_full_size_yaml_runs_a_sweep_with_steps_and_trials_cut_by_overrides(multi30k, tmp_path):
    env = nas_env(tmp_path)
    result = run_nas(["sweep", str(YAML), *_cut(tmp_path)], env, cwd=REPO, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    copy = (tmp_path / "runs" / "multi30k_en_de" / "sweep.yaml").read_text()
    assert "--set train.steps=2" in copy.splitlines()[0]  # the sweep's copy is the effective YAML
    from nas.space import load_spec

    spec = load_spec(tmp_path / "runs" / "multi30k_en_de" / "sweep.yaml", check_files=False)
    assert (spec.train.steps, spec.search.trials, spec.supernet.model_dim, spec.supernet.encoder_layers) == (2, 1, 512, 6)
    records = read_sweep(tmp_path / "runs" / "multi30k_en_de" / "sweep.yaml", env)
    assert [t.state.name for t in records.optuna] == ["COMPLETE"]
    assert len(records.trial_runs()) == 1 and records.trial_runs()[0].info.status == "FINISHED"
    assert "bleu" in records.trial_runs()[0].data.metrics


def test_a_bad_override_names_the_key_and_starts_nothing(tmp_path):
    env = nas_env(tmp_path)
    result = nas_cli(["sweep", str(YAML), "--set", f"workdir={tmp_path / 'runs'}", "--set", "train.step=2"], env,
                     cwd=REPO)
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert "(with --set" in message and "train.step: unknown key (did you mean 'steps'?)" in message
    result = nas_cli(["sweep", str(YAML), "--set", "train.steps"], env, cwd=REPO)
    assert result.returncode == 2 and "expected KEY.PATH=VALUE" in result.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
