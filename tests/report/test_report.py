"""`nas report`: best archs, the Pareto front and Optuna importances from a real MLflow store and a
real Optuna journal (no sweep is run: the runs and the study are written directly)."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from nas import tracking
from nas.cli import app
from nas.report import ImportanceError, build_report, locate_study, param_importances
from tests.conftest import EXP

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DISTRIBUTIONS = {"width": optuna.distributions.CategoricalDistribution([16, 32]),
                 "layers": optuna.distributions.IntDistribution(1, 2)}


def _designed_trials():
    """20 (width, layers, bleu, latency_ms) rows. The 2 best BLEU share width 32 (layers mixed), the 2
    worst share layers 2 (width mixed); the 2 fastest share layers 1, the 2 slowest width 16. So BLEU's
    importances rank width first and latency's rank layers first, and a flipped goal flips them."""
    special = [(32, 1, 30, 25), (32, 2, 29, 26), (16, 2, 1, 24), (32, 2, 2, 23),
               (16, 1, 12, 5), (32, 1, 13, 6), (16, 1, 15, 50), (16, 2, 16, 49)]
    combos = [(w, n) for w in (16, 32) for n in (1, 2)]
    neutral = [(*combos[i % 4], 10 + i * 0.9, 20 + i * 0.9) for i in range(12)]
    return special + neutral


def _journal_study(path: Path, name: str, rows, *, fail_extra: int = 0) -> None:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    study = optuna.create_study(study_name=name, storage=storage, directions=["maximize", "minimize"])
    for width, layers, bleu, latency in rows:
        study.add_trial(optuna.trial.create_trial(params={"width": width, "layers": layers},
                                                  distributions=DISTRIBUTIONS, values=[bleu, latency]))
    for _ in range(fail_extra):
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))


@pytest.fixture
def sweep(mlflow_uri, tmp_path):
    """Sweep R1 in MLflow (parent + one trial run per designed trial) and its study in the journal of
    the sweep's run folder, found through the nas.supernet_dir tag as `nas sweep` writes it."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    parent = tracking.start_run(EXP, "R1", role="sweep",
                                tags={"nas.sweep_id": "R1", "nas.supernet_dir": str(run_dir / "supernet")},
                                params={"yaml": "r.yaml", "search.method": "tpe", "search.trials": 20})
    rows = _designed_trials()
    for i, (width, layers, bleu, latency) in enumerate(rows):
        run = tracking.start_run(EXP, f"trial-{i}", role="trial", parent_run_id=parent,
                                 tags={"nas.arch_summary": f"w{width} L{layers} #{i}"})
        tracking.log_metrics(run, {"bleu": bleu, "latency_ms": latency, "chrf": 40.0 + i, "params_m": 1.0 + i / 10})
        tracking.end_run(run)
    tracking.log_metrics(parent, {"trials_completed": 20, "trials_failed": 0, "widest_bleu": 31.5})
    tracking.end_run(parent)
    _journal_study(run_dir / "optuna.journal", "R1", rows)
    return parent, run_dir


def test_importances_follow_each_objective_and_its_goal(tmp_path):
    _journal_study(tmp_path / "j", "s", _designed_trials())
    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "j"))))
    imp = param_importances(study, ["bleu", "latency_ms"])
    assert list(imp) == ["Pareto front", "bleu", "latency_ms"]
    assert imp["bleu"]["width"] > imp["bleu"]["layers"]
    assert imp["latency_ms"]["layers"] > imp["latency_ms"]["width"]
    for column in imp.values():
        assert sum(column.values()) == pytest.approx(1.0)


def test_html_report_is_self_contained_with_best_front_and_importances(sweep, tmp_path):
    parent, _ = sweep
    out = tmp_path / "out" / "r1.html"
    result = CliRunner().invoke(app, ["report", "R1", "--out", str(out), "--top", "3"])
    assert result.exit_code == 0, result.output
    assert "20 finished trials" in result.stdout and result.stderr == ""
    text = out.read_text()
    assert list(out.parent.iterdir()) == [out]  # no temp file left
    png = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert png and base64.b64decode(png.group(1)).startswith(PNG_MAGIC)
    assert not re.search(r'(src|href)="(http|file|/)', text)  # nothing outside the file
    best = text.split("<h2>Best sub-Transformers</h2>")[1].split("<h2>")[0]
    assert [m for m in re.findall(r"<td>(w\d+ L\d #\d+)</td>", best)] == ["w32 L1 #0", "w32 L2 #1", "w32 L2 #19"]
    front = text.split("<h2>Pareto front</h2>")[1].split("<h2>")[0]
    # front: fastest (#4: 5 ms) ... best BLEU (#0: 30); ordered by latency
    assert re.findall(r"<td>w\d+ L\d #(\d+)</td>", front)[0] == "4"
    assert re.findall(r"<td>w\d+ L\d #(\d+)</td>", front)[-1] == "0"
    importances = text.split("<h2>Parameter importances</h2>")[1]
    assert "R1 @ " in importances and "<th>Pareto front</th><th>bleu</th><th>latency_ms</th>" in importances
    assert parent in text and "tpe, 20 trials" in text and "31.50" in text


def test_markdown_report_writes_the_plot_beside_it(sweep, tmp_path):
    out = tmp_path / "md" / "r1.md"
    result = CliRunner().invoke(app, ["report", "R1", "--format", "md", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    png = out.with_name("r1.pareto.png")
    assert png.read_bytes().startswith(PNG_MAGIC) and "![Pareto front: bleu:max, latency_ms:min](r1.pareto.png)" in text
    assert sorted(p.name for p in out.parent.iterdir()) == ["r1.md", "r1.pareto.png"]
    assert "| parameter | Pareto front | bleu | latency_ms |" in text
    assert text.count("| w32 L1 #0 |") == 2  # in the best table and on the front


def test_too_few_completed_trials_still_writes_the_rest_and_warns(sweep, tmp_path):
    _, run_dir = sweep
    (run_dir / "optuna.journal").unlink()
    _journal_study(run_dir / "optuna.journal", "R1", _designed_trials()[:1], fail_extra=3)
    out = tmp_path / "r1.html"
    result = CliRunner().invoke(app, ["report", "R1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "has 1 completed trial(s); parameter importances need at least 2" in result.stderr
    text = out.read_text()
    assert "Not computed: Optuna study &#x27;R1&#x27; has 1 completed trial(s)" in text
    assert "w32 L1 #0" in text and "data:image/png;base64," in text


def test_study_is_found_from_tags_or_named_and_ambiguity_is_explained(sweep, tmp_path):
    parent_id, run_dir = sweep
    elsewhere = tmp_path / "elsewhere.journal"
    _journal_study(elsewhere, "renamed", _designed_trials()[:3])
    _journal_study(elsewhere, "other", _designed_trials()[:2])
    client = tracking.get_client()
    client.set_tag(parent_id, "nas.optuna_storage", str(elsewhere))
    parent = client.get_run(parent_id)
    with pytest.raises(ImportanceError, match=r"cannot tell which Optuna study in .*elsewhere.journal is sweep 'R1' "
                                              r"\(studies: renamed, other\); pass --study NAME"):
        locate_study(parent, "R1")
    client.set_tag(parent_id, "nas.study_name", "renamed")
    study, where = locate_study(client.get_run(parent_id), "R1")
    assert study.study_name == "renamed" and len(study.trials) == 3 and where == f"renamed @ {elsewhere}"
    study, _ = locate_study(parent, "R1", storage=str(run_dir / "optuna.journal"))
    assert study.study_name == "R1"
    with pytest.raises(ImportanceError, match=r"no Optuna study journal at .*missing.journal"):
        locate_study(parent, "R1", storage=str(tmp_path / "missing.journal"))
    assert not (tmp_path / "missing.journal").exists()
    rep = build_report("R1", experiment=EXP, storage=str(tmp_path / "missing.journal"))
    assert rep.importances is None and "missing.journal" in rep.importance_error and rep.scanned == 20


def test_report_of_an_unknown_sweep_or_format_fails_with_exit_code_2(sweep, tmp_path):
    result = CliRunner().invoke(app, ["report", "nope", "--out", str(tmp_path / "x.html")])
    assert result.exit_code == 2 and "no sweep with nas.sweep_id 'nope'" in result.stderr
    result = CliRunner().invoke(app, ["report", "R1", "--format", "pdf"])
    assert result.exit_code == 2 and "--format 'pdf': expected one of html, md" in result.stderr
    assert list(tmp_path.glob("*.html")) == []


@pytest.mark.parametrize("fmt", ["html", "md"])
def test_report_onto_a_folder_fails_in_one_line_and_leaves_the_folder(sweep, tmp_path, fmt):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "old.html").write_text("keep")
    result = CliRunner().invoke(app, ["report", "R1", "--format", fmt, "--out", str(tmp_path / "reports")])
    assert result.exit_code == 2, result.output
    assert f"--out: {tmp_path / 'reports'} is a folder, not a file" in " ".join(result.stderr.split())
    assert [p.name for p in (tmp_path / "reports").iterdir()] == ["old.html"]


def _feasible_best(bound: float, top: int) -> list[int]:
    """Trial numbers of the ``top`` best designed trials by BLEU with latency_ms <= ``bound``."""
    rows = list(enumerate(_designed_trials()))
    return [i for i, r in sorted(rows, key=lambda ir: -ir[1][2]) if r[3] <= bound][:top]


def test_best_sub_transformers_meet_the_sweep_s_constraints_unless_infeasible_ones_are_included(sweep, tmp_path):
    parent, _ = sweep
    tracking.get_client().log_param(parent, tracking.PARAM_CONSTRAINTS, "latency_ms<=25")  # as `nas sweep` logs it
    infeasible = sum(r[3] > 25 for r in _designed_trials())
    out = tmp_path / "r1.md"
    result = CliRunner().invoke(app, ["report", "R1", "--format", "md", "--out", str(out), "--top", "3"])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    best = text.split("## Best sub-Transformers")[1].split("## ")[0]
    assert re.findall(r"\| w\d+ L\d #(\d+) \|", best) == [str(i) for i in _feasible_best(25, 3)]
    assert "#1 |" not in best  # BLEU 29 at 26 ms: second best, but over the budget
    assert (f"3 best of the {20 - infeasible} feasible trials by bleu (meeting latency_ms<=25; {infeasible} of 20 "
            "finished trials break them and are left out: nas report --include-infeasible lists them)") in best
    assert f"search.constraints latency_ms<=25: {infeasible} trials break them" in " ".join(result.stdout.split())
    front = text.split("## Pareto front")[1].split("## ")[0]
    assert "non-dominated feasible trials" in front and "#1 |" not in front

    result = CliRunner().invoke(app, ["report", "R1", "--out", str(tmp_path / "r1.html"), "--top", "3",
                                      "--include-infeasible"])
    assert result.exit_code == 0, result.output
    best = (tmp_path / "r1.html").read_text().split("<h2>Best sub-Transformers</h2>")[1].split("<h2>")[0]
    assert re.findall(r"<td>w\d+ L\d #(\d+)</td>", best) == ["0", "1", "19"]
    assert "<th>feasible</th>" in best and re.findall(r"<td>(yes|no)</td></tr>", best) == ["yes", "no", "no"]
