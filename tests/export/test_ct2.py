"""CTranslate2 export: the engine MT engineers deploy with computes what our model computes.

The reference is our own PyTorch model (teacher-forced log-probabilities and ``beam_search``); CTranslate2 is
the independent implementation being checked, built from our weights by ``nas.export.ct2``.
"""

import json

import pytest
import torch

from nas.data import EOS_ID, Tokenizer, read_lines
from nas.errors import NasError
from nas.export import export_arch, load_export
from nas.model import SuperTransformer, beam_search
from nas.model.io import save_model
from nas.space.arch import Arch, StackArch

ctranslate2 = pytest.importorskip("ctranslate2", reason="the serving extra: pip install 'nas[serve]'")

from nas.export.ct2 import (CT2_DIR, Ct2Translator, UnsupportedArchError, ctranslate2_problem,  # noqa: E402
                            export_ctranslate2)

MAXIMA = Arch(StackArch((32, 32, 32), (64, 64, 64), (2, 2, 2)), StackArch((32, 32), (64, 64), (2, 2)))
# Uniform attention width per stack; FFN widths differ per layer; the decoder's attention (16) is narrower than
# the model (32): CTranslate2 gets head_dim 8 and 2 heads there.
PLAIN = Arch(StackArch((32, 32), (64, 32)), StackArch((16, 16), (48, 64)))


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer(multi30k, tmp_path_factory) -> Tokenizer:
    lines = read_lines(multi30k / "train.en.gz", limit=300) + read_lines(multi30k / "train.de.gz", limit=300)
    return Tokenizer.train(lines, tmp_path_factory.mktemp("spm") / "spm", vocab_size=300)


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    """A `nas export` folder of PLAIN from a supernet with N(0, 0.3) noise on every weight (a fresh model's
    greedy output repeats one token, which would hide a misplaced weight), and its CTranslate2 folder."""
    root = tmp_path_factory.mktemp("ct2")
    torch.manual_seed(0)
    supernet = SuperTransformer(tokenizer.vocab_size, 32, 2, MAXIMA, max_positions=128, head_dim=8)
    with torch.no_grad():
        for p in supernet.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_model(supernet, root / "sn", "supernet")
    path = export_arch(root / "sn", tokenizer.model_path, PLAIN, root / "export", beam_size=4)
    return path, export_ctranslate2(path)


@pytest.fixture(scope="module")
def sources(multi30k) -> list[str]:
    return read_lines(multi30k / "val.en.gz", limit=16)


def test_token_log_probabilities_equal_pytorch(exported, sources):
    path, folder = exported
    model = load_export(path).model.eval()
    t = Ct2Translator(folder)
    pieces = t.pieces(sources)
    refs = [[t.sp.id_to_piece(i) for i in ids] for ids in t.sp.encode(sources[::-1], out_type=int)]  # any targets
    scored = t.translator.score_batch(pieces, refs)
    worst = 0.0
    for src_pieces, ref, result in zip(pieces, refs, scored):
        src = torch.tensor([[t.sp.piece_to_id(p) for p in src_pieces] + [EOS_ID]])
        tgt = [t.sp.piece_to_id(p) for p in ref]
        with torch.no_grad():
            memory, pad = model.encode(src)
            lprobs = torch.log_softmax(model.decode(torch.tensor([[2] + tgt]), memory, pad), -1)[0]
        ours = [float(lprobs[i, tok]) for i, tok in enumerate(tgt + [EOS_ID])]
        assert len(result.log_probs) == len(ours)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, result.log_probs)))
    assert worst < 1e-4, worst


def test_greedy_tokens_equal_beam_search_on_validation_sentences(exported, sources):
    path, folder = exported
    model = load_export(path).model.eval()
    t = Ct2Translator(folder)
    lengths = set()
    for sentence in sources:  # one at a time: CTranslate2 takes one length bound per call, beam_search one per row
        pieces = t.pieces([sentence])
        src = torch.tensor([[t.sp.piece_to_id(p) for p in pieces[0]] + [EOS_ID]])
        ours = beam_search(model, src, beam_size=1)[0]
        theirs = [t.sp.piece_to_id(p) for p in t.translate_pieces(pieces, beam_size=1)[0]]
        assert theirs == ours, sentence
        lengths.add(len(ours))
    assert len(lengths) > 3  # outputs vary: a degenerate model would pass trivially


def test_translate_keeps_input_order_and_empty_lines(exported, sources):
    path, folder = exported
    lines = [sources[0], "", sources[1], "   ", sources[2]]
    out = Ct2Translator(folder).translate(lines, beam_size=1)
    ours = load_export(path).translate([sources[0], sources[1], sources[2]], beam_size=1)
    assert out[1] == out[3] == "" and [out[0], out[2], out[4]] == ours


def test_folder_holds_the_model_vocabulary_and_provenance(exported):
    path, folder = exported
    assert folder == path / CT2_DIR
    names = {p.name for p in folder.iterdir()}
    assert {"model.bin", "config.json", "spm.model", "nas_ctranslate2.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["add_source_eos"] is True and config["bos_token"] == "<s>" and config["eos_token"] == "</s>"
    assert Arch.from_dict(json.loads((folder / "nas_ctranslate2.json").read_text())["arch"]) == PLAIN


def test_int8_conversion_translates(exported, sources, tmp_path):
    path, _ = exported
    folder = export_ctranslate2(path, tmp_path / "int8", quantization="int8")
    assert json.loads((folder / "nas_ctranslate2.json").read_text())["quantization"] == "int8"
    assert all(isinstance(s, str) for s in Ct2Translator(folder).translate(sources[:3], beam_size=2))


@pytest.mark.parametrize("arch, named", [
    (Arch(StackArch((32, 32), (64, 64), (1, 2)), PLAIN.decoder), "encoder layer 1 has branches=2"),
    (Arch(StackArch((32, 16), (64, 64)), PLAIN.decoder), "the encoder mixes attention widths [16, 32]"),
    (Arch(PLAIN.encoder, StackArch((16,), (64,), (1,), (2,))), "decoder layer 0 has paths=2"),
    (Arch(PLAIN.encoder, StackArch((16,), (64,), (1,), (1,), ("prime",), ((3,),))), "uses the 'prime' layout"),
    (Arch(PLAIN.encoder, StackArch((16,), (64,), (1,), (1,), (), (), (2,))), "decoder layer 0 has units=2"),
    (Arch(PLAIN.encoder, StackArch((16, 16), (64, 64), encoder_attention=(1, 3))),
     "decoder layer 1 attends to the last 2 encoder layers (encoder_attention=3"),  # clamped to the depth
])
def test_an_arch_ctranslate2_cannot_run_is_named(arch, named):
    problem = ctranslate2_problem(arch, {})
    assert problem is not None and named in problem
    assert ctranslate2_problem(PLAIN, {}) is None
    assert "io_projection" in ctranslate2_problem(PLAIN, {"io_projection": True})
    assert "relative_positions=4" in ctranslate2_problem(PLAIN, {"relative_positions": 4})


def test_converting_an_unsupported_export_raises_and_writes_nothing(tokenizer, tmp_path):
    maxima = Arch(StackArch((32,), (64,), (2,)), StackArch((32,), (64,), (2,)))
    save_model(SuperTransformer(tokenizer.vocab_size, 32, 2, maxima, max_positions=64), tmp_path / "sn", "supernet")
    path = export_arch(tmp_path / "sn", tokenizer.model_path, maxima, tmp_path / "export")
    with pytest.raises(UnsupportedArchError, match="encoder layer 0 has branches=2"):
        export_ctranslate2(path)
    assert not (path / CT2_DIR).exists()


def test_a_folder_that_is_not_a_ctranslate2_export_is_named(tmp_path):
    with pytest.raises(NasError, match="nas export --ctranslate2"):
        Ct2Translator(tmp_path)


def test_torch_keeps_its_thread_count_after_ctranslate2_runs(exported, sources):
    """CTranslate2 sets the process's OpenMP thread count to its own; torch read it back (2 threads became 1),
    which slowed PyTorch and changed its rounding in later in-process computations."""
    _, folder = exported
    torch.set_num_threads(2)
    translator = Ct2Translator(folder, threads=1)
    assert torch.get_num_threads() == 2
    translator.translate(sources[:2], beam_size=1)
    assert torch.get_num_threads() == 2
