"""Checkpoint averaging: training snapshots, their exact mean, the averaged supernet, ``nas average``."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from nas.cli import app
from nas.model.io import load_model
from nas.model.supernet import SuperTransformer
from nas.builders import prepare_sweep_data
from nas.space.space import SearchSpace
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict, use_tiny_data
from trainers import average_checkpoints, average_snapshots, latest_snapshots, train_supernet

runner = CliRunner()


def squash(text: str) -> str:
    """Drop all whitespace, so a message the console wrapped still matches."""
    return "".join(text.split())


@pytest.fixture(scope="module")
def prepared(multi30k, tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("average")
    raw = use_tiny_data(tiny_spec_dict(multi30k, work), tiny_data)
    return raw, prepare_sweep_data(parse_spec(raw), progress=False)


def _spec(raw, **train):
    return parse_spec({**raw, "train": {**raw["train"], **train}})


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """A supernet trained 8 steps with a checkpoint every 2 and the 2 newest snapshots kept."""
    raw, data = prepared
    out = tmp_path_factory.mktemp("trained")
    train_supernet(_spec(raw, steps=8, checkpoint_every=2, keep_last=2), data, out, progress=False)
    return out


def _write(path, tensors):
    save_file(tensors, str(path))
    return path


def test_average_of_hand_made_files_is_the_exact_mean_in_each_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    files = [{"w": torch.randn(3, 4, generator=g), "h": torch.randn(5, generator=g).to(torch.bfloat16)}
             for _ in range(3)]
    paths = [_write(tmp_path / f"{i}.safetensors", t) for i, t in enumerate(files)]
    mean = average_snapshots(paths)
    assert torch.equal(mean["w"], (files[0]["w"] + files[1]["w"] + files[2]["w"]) / 3)
    expected_h = sum(f["h"].float() for f in files) / 3
    assert mean["h"].dtype == torch.bfloat16 and torch.equal(mean["h"], expected_h.to(torch.bfloat16))


def test_a_file_with_another_shape_is_named(tmp_path):
    good = _write(tmp_path / "good.safetensors", {"w": torch.zeros(2, 3)})
    bad = _write(tmp_path / "bad.safetensors", {"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r".*'w' has shape \(3, 2\)"):
        average_snapshots([good, good, bad])


def test_a_file_with_other_tensor_names_is_named(tmp_path):
    good = _write(tmp_path / "good.safetensors", {"w": torch.zeros(2), "b": torch.zeros(1)})
    bad = _write(tmp_path / "bad.safetensors", {"w": torch.zeros(2), "c": torch.zeros(1)})
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r".*missing \['b'\], unexpected \['c'\]"):
        average_snapshots([good, bad])


def test_averaging_nothing_is_an_error():
    with pytest.raises(ValueError, match="no snapshot files"):
        average_snapshots([])


def test_too_few_snapshots_names_the_folder_and_the_count(tmp_path):
    _write(tmp_path / "step_00000004.safetensors", {"w": torch.zeros(1)})
    _write(tmp_path / "notes.safetensors", {"w": torch.zeros(1)})  # not a snapshot name: ignored
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + r" holds 1 snapshot.*fewer than the 2"):
        latest_snapshots(tmp_path, 2)
    assert [p.name for p in latest_snapshots(tmp_path, 1)] == ["step_00000004.safetensors"]


def test_trainer_keeps_exactly_the_newest_snapshots(trained):
    names = sorted(p.name for p in (trained / "snapshots").iterdir())
    assert names == ["step_00000006.safetensors", "step_00000008.safetensors"]
    final = load_model(trained, "supernet").state_dict()
    last = load_file(str(trained / "snapshots" / "step_00000008.safetensors"))
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in final)


def test_resumed_run_writes_the_same_snapshots_as_an_uninterrupted_one(prepared, trained, tmp_path):
    raw, data = prepared
    train_supernet(_spec(raw, steps=4, checkpoint_every=2, keep_last=2), data, tmp_path, progress=False)  # "killed"
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["step_00000002.safetensors",
                                                                          "step_00000004.safetensors"]
    train_supernet(_spec(raw, steps=8, checkpoint_every=2, keep_last=2), data, tmp_path, progress=False)
    straight, resumed = sorted((trained / "snapshots").iterdir()), sorted((tmp_path / "snapshots").iterdir())
    assert [p.name for p in straight] == [p.name for p in resumed]
    for a, b in zip(straight, resumed):
        ta, tb = load_file(str(a)), load_file(str(b))
        for name in ta:
            torch.testing.assert_close(ta[name], tb[name], rtol=0, atol=1e-6, msg=f"{a.name} {name}")


def test_keep_last_zero_writes_no_snapshots(prepared, tmp_path):
    raw, data = prepared
    train_supernet(_spec(raw, steps=2, checkpoint_every=1, keep_last=0), data, tmp_path, progress=False)
    assert not (tmp_path / "snapshots").exists()


def test_averaged_supernet_loads_and_computes_like_the_mean_of_weights(prepared, trained, tmp_path):
    raw, _ = prepared
    out = average_checkpoints(trained, 2, tmp_path / "avg")
    averaged = load_model(out, "supernet")

    snaps = [load_file(str(trained / "snapshots" / f"step_{s:08d}.safetensors")) for s in (6, 8)]
    by_hand = SuperTransformer.from_config(json.loads((trained / "supernet.json").read_text()))
    by_hand.load_state_dict({k: (snaps[0][k] + snaps[1][k]) / 2 for k in snaps[0]})
    by_hand.eval()
    last = load_model(trained, "supernet")

    arch = SearchSpace.from_spec(parse_spec(raw)).widest()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, 400, (2, 7), generator=g), torch.randint(4, 400, (2, 5), generator=g)
    with torch.no_grad():
        got, want, final = averaged(src, tgt, arch), by_hand(src, tgt, arch), last(src, tgt, arch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(got, final, atol=1e-4)  # really an average, not the last snapshot
    assert json.loads((out / "average.json").read_text())["steps"] == [6, 8]
    assert not list(tmp_path.glob(".*"))  # the temporary folder was renamed into place


def test_a_non_empty_out_folder_is_refused_and_kept(trained, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=re.escape(str(tmp_path)) + ".*another --out or delete it"):
        average_checkpoints(trained, 2, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_cli_average_writes_the_folder_and_prints_the_steps(trained, tmp_path):
    result = runner.invoke(app, ["average", str(trained), "--last", "2", "--out", str(tmp_path / "avg")])
    assert result.exit_code == 0, result.output
    assert "steps 6, 8" in result.output
    assert {p.name for p in (tmp_path / "avg").iterdir()} == {"supernet.json", "supernet.safetensors", "average.json"}


@pytest.mark.parametrize("case", ["missing_folder", "too_few"])
def test_cli_average_on_a_bad_folder_exits_2_and_names_it(case, trained, tmp_path):
    folder, last = (tmp_path / "nope", 1) if case == "missing_folder" else (trained, 3)
    result = runner.invoke(app, ["average", str(folder), "--last", str(last), "--out", str(tmp_path / "avg")])
    assert result.exit_code == 2, result.output
    assert squash(str(folder)) in squash(result.output)
    assert "Traceback" not in result.output and not (tmp_path / "avg").exists()


def test_snapshots_can_be_averaged_before_training_wrote_supernet_json(trained, tmp_path):
    """Mid-training (no supernet.json yet) the config comes from the snapshots' safetensors metadata."""
    (tmp_path / "run" / "snapshots").mkdir(parents=True)
    for p in (trained / "snapshots").iterdir():
        (tmp_path / "run" / "snapshots" / p.name).write_bytes(p.read_bytes())
    out = average_checkpoints(tmp_path / "run", 2, tmp_path / "avg")
    assert json.loads((out / "supernet.json").read_text()) == json.loads((trained / "supernet.json").read_text())
    assert load_model(out, "supernet").max_arch.encoder.layers == 2
