"""A damaged or partial export folder is one NasError naming the file, from `nas translate` and the API alike
(before: a SafetensorError or JSONDecodeError traceback); and the API refuses a string where it wants sentences."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

import nas
from nas.cli import app
from nas.data import Tokenizer, read_lines
from nas.errors import DamagedFileError, MissingFileError, NasError
from nas.export import export_arch
from nas.model.io import save_model
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch, StackArch

ARCH = Arch(StackArch((16,), (32,)), StackArch((16,), (32,)))


@pytest.fixture(scope="module")
def export_dir(multi30k, tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    lines = read_lines(multi30k / "train.en.gz", limit=300) + read_lines(multi30k / "train.de.gz", limit=300)
    tokenizer = Tokenizer.train(lines, root / "spm", vocab_size=300)
    torch.manual_seed(0)
    maxima = Arch(StackArch((32,), (64,)), StackArch((32,), (64,)))
    save_model(SuperTransformer(tokenizer.vocab_size, 32, 2, maxima, max_positions=64), root / "sn", "supernet")
    return export_arch(root / "sn", tokenizer.model_path, ARCH, root / "export")


def _truncate(path):
    path.write_bytes(path.read_bytes()[:200])


def _garble(path):
    path.write_text("{not json", encoding="utf-8")


DAMAGES = {  # file -> (damage, the error class, words of the message)
    "model.safetensors": (_truncate, DamagedFileError, "unreadable, likely truncated"),
    "model.json": (_garble, DamagedFileError, "is not valid JSON"),
    "export.json": (_garble, DamagedFileError, "is not valid JSON"),
    "arch.json": (lambda p: p.write_text('{"encoder": {}}'), DamagedFileError, "is no arch"),
    "spm.model": (lambda p: p.write_bytes(b"garbage" * 10), DamagedFileError, "is not a SentencePiece model"),
}


@pytest.mark.parametrize("name", [*DAMAGES, "missing:model.safetensors", "missing:spm.model", "missing:arch.json"])
def test_a_damaged_or_partial_export_is_one_error_naming_the_file(export_dir, tmp_path, name):
    folder = tmp_path / "x"
    shutil.copytree(export_dir, folder)
    missing = name.startswith("missing:")
    target = folder / name.removeprefix("missing:")
    if missing:
        target.unlink()
        error, words = MissingFileError, ("missing" if target.suffix != ".safetensors" else "not found")
    else:
        damage, error, words = DAMAGES[name]
        damage(target)
    with pytest.raises(error) as caught:
        nas.load_export(folder)
    assert str(target) in str(caught.value) and words in str(caught.value), caught.value
    assert isinstance(caught.value, NasError)
    result = CliRunner().invoke(app, ["translate", str(folder)], input="A dog runs .\n")
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and target.name in lines[0], result.stderr


def test_the_api_refuses_a_string_of_sentences_and_a_missing_folder(export_dir, tmp_path):
    with pytest.raises(NasError, match="sentences is one string; pass a list"):
        nas.translate(export_dir, "A dog runs .")
    with pytest.raises(NasError, match=r"sentences\[1\] is a int"):
        nas.translate(export_dir, ["A dog .", 3])
    with pytest.raises(NasError, match="is not a nas export"):
        nas.load_export(tmp_path / "nothing")
    assert len(nas.translate(export_dir, ["A dog runs ."], beam_size=1)) == 1
    assert json.loads((export_dir / "export.json").read_text())  # the fixture is intact
