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
