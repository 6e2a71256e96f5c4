"""`nas translate` on bad input: empty input, bytes that are not UTF-8, lines longer than the model reads."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from nas.cli import app
from nas.data import Tokenizer, read_lines
from nas.export import export_arch, load_export
from nas.model import SuperTransformer
from nas.model.io import save_model
from nas.space.arch import Arch, StackArch

TINY = Arch(StackArch((16,), (32,), (1,)), StackArch((16,), (32,), (1,)))
MAX_POSITIONS = 32
"""The tiny model's position table (tokens): it reads sources of up to MAX_POSITIONS // 2 - 1 pieces, then EOS."""


@pytest.fixture(scope="module")
def exported(multi30k, tmp_path_factory):
    """An export folder of a tiny untrained seeded supernet with a short position table."""
    work = tmp_path_factory.mktemp("translate")
    lines = read_lines(multi30k / "train.en.gz", limit=500) + read_lines(multi30k / "train.de.gz", limit=500)
    tokenizer = Tokenizer.train(lines, work / "spm", vocab_size=300)
    torch.manual_seed(0)
    save_model(SuperTransformer(tokenizer.vocab_size, 16, 2, TINY, max_positions=MAX_POSITIONS), work / "sn",
               "supernet")
    return export_arch(work / "sn", tokenizer.model_path, TINY, work / "exported", beam_size=1)


def translate(folder, stdin: bytes):
    return CliRunner().invoke(app, ["translate", str(folder)], input=stdin)


def test_empty_input_translates_to_empty_output(exported):
    result = translate(exported, b"")
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout == "" and result.stderr == ""


def test_input_that_is_not_utf8_names_its_line_in_one_error_line(exported):
    result = translate(exported, "a dog runs\na man sits\nun caf\u00e9\n".encode("latin-1"))
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "stdin line 3 is not UTF-8" in lines[0] and "iconv" in lines[0], lines[0]
    assert result.stdout == ""


def test_a_line_longer_than_the_model_reads_is_translated_with_a_warning_naming_it(exported):
    model = load_export(exported)
    limit = MAX_POSITIONS // 2 - 1
    long_line = " ".join(["a man in a blue shirt is standing on a ladder"] * 8)
    assert len(model.tokenizer.encode([long_line])[0]) > limit
    result = translate(exported, f"a dog runs\n{long_line}\ntwo women\n".encode())
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout.splitlines() == model.translate(["a dog runs", long_line, "two women"])
    lines = result.stderr.strip().splitlines()
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert len(warnings) == 1 and len(lines) == 2 and lines[-1].startswith("translated 3 sentences"), result.stderr
    assert "stdin line 2 is longer than the model reads" in warnings[0], warnings[0]
    assert f"truncated to {limit} tokens" in warnings[0] and model.max_src_tokens == limit, warnings[0]


THROUGHPUT = re.compile(r"^translated (\d+) sentences \((\d+) target tokens\) in [\d.]+ s: [\d.]+ sentences/s, \d+ tokens/s$")


def test_files_in_and_out_keep_the_input_order_and_an_empty_line_stays_empty(exported, tmp_path):
    model = load_export(exported)
    source = ["two women are talking", "", "a dog runs through the grass near a lake", "a man"]
    (tmp_path / "in.en").write_text("\n".join(source) + "\n", encoding="utf-8")
    threads = torch.get_num_threads()
    result = CliRunner().invoke(app, ["translate", str(exported), "--input", str(tmp_path / "in.en"),
                                      "--output", str(tmp_path / "out.de"), "--max-tokens", "8",
                                      "--threads", str(threads + 1)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert torch.get_num_threads() == threads  # --threads does not leak into the calling process
    assert result.stdout == ""
    got = (tmp_path / "out.de").read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) == len(source) + 1
    assert got[1] == ""  # the empty line
    for i in (0, 2, 3):  # each sentence translated on its own: the batching changes nothing
        assert got[i] == model.translate([source[i]])[0]
    last = result.stderr.strip().splitlines()[-1]
    match = THROUGHPUT.match(last)
    assert match and match.group(1) == "4", last
    pieces = sum(len(ids) for ids in model.tokenizer.encode([got[i] for i in (0, 2, 3)]))
    assert int(match.group(2)) >= 1 and abs(int(match.group(2)) - pieces) <= 3 * 3, (last, pieces)


def test_an_output_path_that_is_a_folder_is_refused_before_translating(exported, tmp_path):
    (tmp_path / "in.en").write_text("a dog\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["translate", str(exported), "--input", str(tmp_path / "in.en"),
                                      "--output", str(tmp_path)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert len(result.stderr.strip().splitlines()) == 1 and str(tmp_path) in result.stderr


def test_a_missing_input_file_is_named(exported, tmp_path):
    result = CliRunner().invoke(app, ["translate", str(exported), "--input", str(tmp_path / "nope.en")])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "nope.en" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_file_line_that_is_not_utf8_names_the_file(exported, tmp_path):
    (tmp_path / "in.en").write_bytes("ok\ncaf\u00e9\n".encode("latin-1"))
    result = CliRunner().invoke(app, ["translate", str(exported), "--input", str(tmp_path / "in.en")])
    assert result.exit_code == 2 and f"{tmp_path / 'in.en'} line 2 is not UTF-8" in result.stderr, result.stderr
