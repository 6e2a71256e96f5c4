"""Export: standalone files that translate exactly like the supernet's sub-Transformer."""

import json
import os
import subprocess
import sys

import pytest
import torch

from nas.data import read_lines
from nas.errors import OutputPathError
from nas.eval.scores import translate
from nas.export import export_arch, load_export
from nas.model import SuperTransformer
from nas.model.io import save_model
from nas.space.arch import Arch, StackArch


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


TINY = Arch(StackArch((16,), (32,), (1,)), StackArch((16,), (32,), (1,)))


def _tiny_supernet(tokenizer, folder):
    torch.manual_seed(0)
    save_model(SuperTransformer(tokenizer.vocab_size, 16, 2, TINY), folder, "supernet")
    return folder


def test_export_refuses_a_too_wide_arch_and_writes_nothing(tokenizer, tmp_path):
    too_wide = Arch(StackArch((32,), (32,), (1,)), StackArch((16,), (32,), (1,)))
    with pytest.raises(ValueError, match=r"encoder\.width\[0\]=32"):
        export_arch(_tiny_supernet(tokenizer, tmp_path / "sn"), tokenizer.model_path, too_wide, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sn"]


def test_export_refuses_a_folder_holding_other_files_and_they_survive_unless_forced(tokenizer, tmp_path):
    sn = _tiny_supernet(tokenizer, tmp_path / "sn")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("months of work")
    with pytest.raises(OutputPathError, match=r"mine is not empty and is no earlier output \(it has no export.json\): "
                                              r"thesis.tex; .* pass --force"):
        export_arch(sn, tokenizer.model_path, TINY, tmp_path / "mine")
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "months of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "sn"]
    export_arch(sn, tokenizer.model_path, TINY, tmp_path / "mine", force=True)
    assert not (tmp_path / "mine" / "thesis.tex").exists() and load_export(tmp_path / "mine").arch == TINY


@pytest.mark.parametrize("out", [".", "..", "CWD", "HOME"])
def test_export_never_replaces_the_cwd_its_ancestors_or_home_even_with_force(tokenizer, tmp_path, monkeypatch, out):
    sn = _tiny_supernet(tokenizer, tmp_path / "sn")
    work, home = tmp_path / "work", tmp_path / "home"
    for folder in (work, home):
        folder.mkdir()
        (folder / "keep.txt").write_text("keep")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    out = {"CWD": str(work), "HOME": str(home)}.get(out, out)
    with pytest.raises(OutputPathError, match=r"refusing to replace .*not even with --force"):
        export_arch(sn, tokenizer.model_path, TINY, out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "sn", "work"]
    assert [p.name for p in work.iterdir()] == ["keep.txt"] and [p.name for p in home.iterdir()] == ["keep.txt"]


def test_re_export_replaces_an_earlier_export_which_stays_whole_until_the_swap(tokenizer, tmp_path, monkeypatch):
    import nas.export.folder as folder_module

    sn = _tiny_supernet(tokenizer, tmp_path / "sn")
    out = export_arch(sn, tokenizer.model_path, TINY, tmp_path / "exported", provenance={"run_id": "old"})
    files = sorted(p.name for p in out.iterdir())
    seen = []
    real = folder_module.atomic_write_text

    def write_and_look(path, text, **kwargs):  # the export's last writes: the old export must still be whole
        seen.append((sorted(p.name for p in out.iterdir()), json.loads((out / "export.json").read_text())["run_id"]))
        return real(path, text, **kwargs)

    monkeypatch.setattr(folder_module, "atomic_write_text", write_and_look)
    export_arch(sn, tokenizer.model_path, TINY, out, provenance={"run_id": "new"})  # no force: an earlier export
    assert seen and all(entry == (files, "old") for entry in seen)
    assert json.loads((out / "export.json").read_text())["run_id"] == "new" and load_export(out).arch == TINY
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "sn"]


def test_a_re_export_that_fails_while_writing_keeps_the_earlier_export_and_no_temporary(tokenizer, tmp_path,
                                                                                       monkeypatch):
    import nas.export.folder as folder_module

    sn = _tiny_supernet(tokenizer, tmp_path / "sn")
    out = export_arch(sn, tokenizer.model_path, TINY, tmp_path / "exported", provenance={"run_id": "old"})
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):  # the SentencePiece copy, after the weights were written
        raise OSError("disk full")

    monkeypatch.setattr(folder_module.shutil, "copyfile", disk_full)
    with pytest.raises(OSError, match="disk full"):
        export_arch(sn, tokenizer.model_path, TINY, out, provenance={"run_id": "new"})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "sn"]


def test_a_re_export_whose_final_rename_fails_keeps_the_earlier_export(tokenizer, tmp_path, monkeypatch):
    """The moment a kill used to lose the export: the old folder gone, the new one not yet in place."""
    sn = _tiny_supernet(tokenizer, tmp_path / "sn")
    out = export_arch(sn, tokenizer.model_path, TINY, tmp_path / "exported", provenance={"run_id": "old"})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.rename

    def new_into_place_fails(src, dst):
        if os.path.abspath(dst) == str(out.resolve()) and str(src).endswith(".tmp"):
            raise OSError("killed here")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", new_into_place_fails)
    with pytest.raises(OSError, match="killed here"):
        export_arch(sn, tokenizer.model_path, TINY, out, provenance={"run_id": "new"})
    monkeypatch.undo()
    assert out.is_dir() and {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "sn"]


def test_loading_a_folder_that_is_not_an_export_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a nas export"):
        load_export(tmp_path)


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


def test_export_cli_refuses_a_folder_of_other_files_in_one_line_until_forced(constrained_trials, tmp_path):
    from typer.testing import CliRunner

    from nas.cli import app

    ids, _, narrow = constrained_trials
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    runner = CliRunner()
    result = runner.invoke(app, ["export", "--run-id", ids["narrow"], "--out", str(tmp_path / "mine")])
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert message.startswith("error: --out: ") and "no export.json): notes.txt;" in message and "--force" in message
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.output  # one (wrapped) line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    result = runner.invoke(app, ["export", "--run-id", ids["narrow"], "--out", str(tmp_path / "mine"), "--force"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["arch.json", "export.json", "model.json",
                                                                     "model.safetensors", "spm.model"]
    result = runner.invoke(app, ["export", "--run-id", ids["slow"], "--out", str(tmp_path / "mine")])  # re-export
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "mine" / "export.json").read_text())["run_id"] == ids["slow"]


@pytest.mark.parametrize("out", [".", ".."])
def test_export_cli_never_replaces_the_current_folder_or_its_parent(constrained_trials, tmp_path, out):
    from typer.testing import CliRunner

    from nas.cli import app

    ids, _, _ = constrained_trials
    before = sorted(p.name for p in tmp_path.iterdir())  # the MLflow database lives here (cwd)
    result = CliRunner().invoke(app, ["export", "--run-id", ids["narrow"], "--out", out, "--force"])
    assert result.exit_code == 2, result.output
    assert "refusing to replace" in result.stderr and "not even with --force" in " ".join(result.stderr.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _one_error_line(result) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_export_of_a_sweep_parent_run_names_it_and_asks_for_a_trial(constrained_trials, tmp_path):
    from typer.testing import CliRunner

    from nas import tracking
    from nas.cli import app

    (parent,) = [r.info.run_id for r in tracking.find_runs("constrained", role="sweep")]
    result = CliRunner().invoke(app, ["export", "--run-id", parent, "--out", str(tmp_path / "x")])
    line = _one_error_line(result)
    assert f"run {parent} is the parent run of sweep C, not a trial" in line, line
    assert "pass the run id of one of its FINISHED trials (nas leaderboard --sweep C) or --best" in line, line
    assert not (tmp_path / "x").exists()


def test_export_of_a_failed_trial_run_names_it_and_asks_for_a_finished_one(constrained_trials, tmp_path):
    from typer.testing import CliRunner

    from nas import tracking
    from nas.cli import app

    ids, maxima, _ = constrained_trials
    (parent,) = [r.info.run_id for r in tracking.find_runs("constrained", role="sweep")]
    failed = tracking.start_run("constrained", "broken", role="trial", parent_run_id=parent,
                                tags={"nas.supernet_dir": str(tmp_path / "sn"), "nas.data_dir": str(tmp_path / "data")})
    tracking.log_json_artifact(failed, maxima.to_dict(), "arch.json")  # sampled, then training or scoring failed
    tracking.end_run(failed, "FAILED")
    result = CliRunner().invoke(app, ["export", "--run-id", failed, "--out", str(tmp_path / "x")])
    line = _one_error_line(result)
    assert f"run {failed} is a FAILED trial of sweep C" in line, line
    assert "pass the run id of a FINISHED trial (nas leaderboard --sweep C) or --best" in line, line
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_export_quantize_int8_writes_int8_graphs_that_translate_onnx_uses(constrained_trials, multi30k, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from nas.cli import app

    ids, _, _ = constrained_trials
    source = read_lines(multi30k / "val.en.gz", limit=6)
    pq.write_table(pa.table({"src_text": source}), tmp_path / "data" / "valid.parquet")  # what --onnx verifies on
    runner = CliRunner()
    bad = runner.invoke(app, ["export", "--run-id", ids["narrow"], "--out", str(tmp_path / "q"), "--quantize", "fp16"])
    assert bad.exit_code == 2 and "--quantize int8" in bad.stderr and not (tmp_path / "q").exists()
    result = runner.invoke(app, ["export", "--run-id", ids["narrow"], "--out", str(tmp_path / "q"), "--quantize", "int8"])
    assert result.exit_code == 0, result.output
    assert "int8: encoder.int8.onnx" in " ".join(result.stdout.split())
    meta = json.loads((tmp_path / "q" / "onnx.json").read_text())
    assert meta["decoder_step"]["file"] == "decoder_step.int8.onnx" and meta["quantized"]["weights"] == "int8"
    assert meta["quantized"]["graphs"]["decoder_step"]["quantized"] >= 4
    run = subprocess.run([sys.executable, "translate_onnx.py", "--beam", "2", "--threads", "1"], cwd=tmp_path / "q",
                         input="\n".join(source) + "\n", capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and len(run.stdout.split("\n")[:-1]) == len(source), run.stderr[-2000:]


def test_export_ctranslate2_writes_a_checked_model_or_names_the_choice_that_prevents_it(constrained_trials, multi30k,
                                                                                        tmp_path):
    pytest.importorskip("ctranslate2", reason="the serving extra: pip install 'nas[serve]'")
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from nas.cli import app
    from nas.export.ct2 import Ct2Translator

    ids, _, _ = constrained_trials
    source = read_lines(multi30k / "val.en.gz", limit=6)
    pq.write_table(pa.table({"src_text": source}), tmp_path / "data" / "valid.parquet")  # what the check reads
    runner = CliRunner()
    wide = runner.invoke(app, ["export", "--run-id", ids["wide"], "--out", str(tmp_path / "w"), "--ctranslate2"])
    assert wide.exit_code == 2 and "Traceback" not in wide.output
    message = " ".join(wide.stderr.split())
    assert message.startswith("error: --ctranslate2: encoder layer 0 has branches=2") and "1 branch" in message
    assert not (tmp_path / "w").exists()  # refused before anything was written
    result = runner.invoke(app, ["export", "--run-id", ids["narrow"], "--out", str(tmp_path / "c"), "--ctranslate2"])
    assert result.exit_code == 0, result.output
    assert "greedy translations of 6 validation sentences equal PyTorch's" in " ".join(result.stdout.split())
    ours = load_export(tmp_path / "c").translate(source, beam_size=1)
    assert Ct2Translator(tmp_path / "c" / "ctranslate2").translate(source, beam_size=1) == ours
