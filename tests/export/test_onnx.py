"""ONNX export: onnxruntime's logits and translations equal PyTorch's, with no torch at translation time."""

import json
import subprocess
import sys

import pytest
import torch

from nas.data import Tokenizer, read_lines
from nas.errors import OutputPathError
from nas.eval.scores import translate
from nas.export import export_arch, load_export
from nas.model import SuperTransformer
from nas.model.io import save_model
from nas.export.onnx import MANIFEST, export_onnx, verify_onnx
from nas.space.arch import Arch, StackArch
from tests.export.archs import MIXED, MIXED_MAXIMA, PLAIN, varied


# Runs the folder's script in a fresh interpreter; fails if torch or nas got imported.
_RUN_SCRIPT = """
import json, runpy, sys
t = runpy.run_path("translate_onnx.py")["OnnxTranslator"](".", threads=1)
src = json.loads(sys.stdin.read())
out = {"greedy": t.translate(src, beam_size=1), "beam3": t.translate(src, beam_size=3, batch_size=2)}
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nas"))
assert not leaked, leaked
print(json.dumps(out))
"""


pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # tests/conftest.py
              pytest.mark.slow]  # ONNX exports: 15-35 s on 2 cores, out of the inner loop (pytest -m "not slow")



@pytest.fixture(scope="module")
def tokenizer(multi30k, tmp_path_factory) -> Tokenizer:
    lines = read_lines(multi30k / "train.en.gz", limit=300) + read_lines(multi30k / "train.de.gz", limit=300)
    return Tokenizer.train(lines, tmp_path_factory.mktemp("spm") / "spm", vocab_size=300)


@pytest.fixture(scope="module")
def sentences(multi30k) -> list[str]:
    return read_lines(multi30k / "test_2016_flickr.en.gz", limit=5)


@pytest.fixture(scope="module")
def exports(tokenizer, tmp_path_factory) -> dict:
    """Two ONNX folders: PLAIN from a `nas export` folder (written in place), MIXED from a model."""
    root = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    supernet = varied(SuperTransformer(tokenizer.vocab_size, 32, 2, PLAIN, max_positions=64))
    save_model(supernet, root / "sn", "supernet")
    plain = export_arch(root / "sn", tokenizer.model_path, PLAIN, root / "plain", beam_size=2,
                        provenance={"run_id": "abc"})
    export_onnx(plain, plain)
    torch.manual_seed(1)
    mixed = varied(SuperTransformer(tokenizer.vocab_size, 32, 2, MIXED_MAXIMA, max_positions=64))
    export_onnx(mixed, root / "mixed", spm_model=tokenizer.model_path, arch=MIXED)  # extracts MIXED
    return {"plain": plain, "mixed": root / "mixed"}


@pytest.mark.parametrize("name", ["plain", "mixed"])
def test_onnxruntime_logits_match_pytorch(exports, sentences, name):
    assert verify_onnx(exports[name], sentences, steps=6) <= 1e-4
    assert verify_onnx(exports[name], sentences[:1], steps=3) <= 1e-4  # batch 1


def test_manifest_names_the_cache_layout_with_the_causal_conv_window(exports):
    meta = json.loads((exports["mixed"] / MANIFEST).read_text())
    parts = {(e["layer"], e["part"]) for e in meta["cache"]}
    assert parts == {(0, "self"), (0, "cross"), (1, "self"), (1, "cross"), (1, "conv")}
    conv = next(e for e in meta["cache"] if e["part"] == "conv")
    assert conv["shape"] == [1, "batch", 4, 16] and conv["time_axis"] is None  # K-1 = 4 values of width 16
    self_k = next(e for e in meta["cache"] if e["input"] == "past.0.self.k")
    assert self_k["shape"][self_k["batch_axis"]] == "batch" and self_k["shape"][self_k["time_axis"]] == "past_len"
    inputs = [i["name"] for i in meta["decoder_step"]["inputs"]]
    assert inputs[:3] == ["tokens", "memory", "src_pad"] and "cross.1.ck" in inputs and "past.1.conv.v" in inputs
    assert [o["name"] for o in meta["encoder"]["outputs"]][:2] == ["memory", "src_pad"]
    assert load_export(exports["mixed"]).model.max_arch == MIXED  # the supernet was cropped to the arch


def test_cross_attention_over_two_encoder_layers_exports_keys_twice_the_source_long(exports):
    """HAT's arbitrary encoder-decoder attention: layer 0's cross keys/values span both encoder layers' outputs,
    concatenated along the length, and the memory holds both; layer 1 attends to the last layer only."""
    meta = json.loads((exports["mixed"] / MANIFEST).read_text())
    shape = {e["input"]: e["shape"] for e in meta["cache"]}
    assert shape["cross.0.ck"][3] == shape["cross.0.cv"][3] == "2*src_len"
    assert shape["cross.1.ck"][3] == "src_len"
    inputs = {i["name"]: i["shape"] for i in meta["decoder_step"]["inputs"]}
    assert inputs["src_pad"][1] == "src_len" and inputs["memory"][1] != "src_len" and "src_len" in inputs["memory"][1]
    assert meta["arch"]["decoder"]["encoder_attention"] == [2, 1] and "e2" in meta["arch_summary"]


@pytest.mark.parametrize("name", ["plain", "mixed"])
def test_standalone_script_translates_like_pytorch_without_torch(exports, sentences, name):
    folder = exports[name]
    run = subprocess.run([sys.executable, "-c", _RUN_SCRIPT], cwd=folder, input=json.dumps(sentences),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    assert len(set(got["greedy"])) > 1 and got["greedy"] != got["beam3"]  # not one degenerate output
    exported = load_export(folder)
    assert got["greedy"] == translate(exported.model, exported.tokenizer, sentences, exported.arch, beam_size=1)
    assert got["beam3"] == translate(exported.model, exported.tokenizer, sentences, exported.arch, beam_size=3,
                                     batch_size=2)
    cli = subprocess.run([sys.executable, "translate_onnx.py", "--beam", "1", "--threads", "1"], cwd=folder,
                         input="\n".join(sentences) + "\n", capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.split("\n")[:-1] == got["greedy"]


def test_in_place_export_stays_a_nas_export_folder(exports):
    names = sorted(p.name for p in exports["plain"].iterdir())
    assert names == ["arch.json", "decoder_step.onnx", "encoder.onnx", "export.json", "model.json",
                     "model.safetensors", MANIFEST, "spm.model", "translate_onnx.py"]
    assert load_export(exports["plain"]).beam_size == 2
    assert json.loads((exports["plain"] / "export.json").read_text())["run_id"] == "abc"
    assert json.loads((exports["plain"] / MANIFEST).read_text())["beam_size"] == 2


def test_a_failed_export_leaves_no_folder(tokenizer, tmp_path, monkeypatch):
    import nas.export.onnx as onnx_module

    def broken(*args, **kwargs):
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(onnx_module, "_write_graphs", broken)
    model = SuperTransformer(tokenizer.vocab_size, 16, 2, Arch(StackArch((16,), (32,)), StackArch((16,), (32,))))
    with pytest.raises(RuntimeError, match="exporter crashed"):
        export_onnx(model, tmp_path / "out", spm_model=tokenizer.model_path)
    assert list(tmp_path.iterdir()) == []


def test_onnx_export_refuses_a_folder_of_other_files_and_keeps_an_export_whole_on_failure(tokenizer, tmp_path,
                                                                                          monkeypatch):
    import nas.export.onnx as onnx_module

    model = SuperTransformer(tokenizer.vocab_size, 16, 2, Arch(StackArch((16,), (32,)), StackArch((16,), (32,))))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.csv").write_text("keep")
    with pytest.raises(OutputPathError, match=r"mine is not empty and is no earlier output .*: data.csv; .*--force"):
        export_onnx(model, tmp_path / "mine", spm_model=tokenizer.model_path)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["data.csv"]

    save_model(model, tmp_path / "sn", "supernet")
    plain = export_arch(tmp_path / "sn", tokenizer.model_path, model.full_arch, tmp_path / "plain")
    before = {p.name: p.read_bytes() for p in plain.iterdir()}
    def crash(*args, **kwargs):
        raise RuntimeError("crash")

    monkeypatch.setattr(onnx_module, "_write_graphs", crash)
    with pytest.raises(RuntimeError, match="crash"):
        export_onnx(plain, plain)  # in place: the export must stay as it was
    assert {p.name: p.read_bytes() for p in plain.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "plain", "sn"]


def test_bad_inputs_are_named(tokenizer, tmp_path):
    model = SuperTransformer(tokenizer.vocab_size, 16, 2, Arch(StackArch((16,), (32,)), StackArch((16,), (32,))))
    with pytest.raises(ValueError, match="opset=17"):
        export_onnx(model, tmp_path / "out", spm_model=tokenizer.model_path, opset=17)
    with pytest.raises(ValueError, match="spm_model"):
        export_onnx(model, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="export.json|model.safetensors"):
        export_onnx(tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=MANIFEST):
        verify_onnx(tmp_path, ["a"])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _logits(folder, graph_file: dict[str, str], sentences: list[str]):
    """First-step logits of ``folder``'s ONNX graphs named by ``graph_file`` (the fp32 or the int8 files)."""
    import numpy as np
    import onnxruntime as ort

    meta = json.loads((folder / MANIFEST).read_text())
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    enc = ort.InferenceSession(str(folder / graph_file["encoder"]), opts, providers=["CPUExecutionProvider"])
    dec = ort.InferenceSession(str(folder / graph_file["decoder_step"]), opts, providers=["CPUExecutionProvider"])
    tok = Tokenizer(folder / "spm.model")
    ids = [x[:20] + [meta["eos_id"]] for x in tok.encode(sentences)]
    src = np.full((len(ids), max(map(len, ids))), meta["pad_id"], dtype=np.int64)
    for row, x in enumerate(ids):
        src[row, : len(x)] = x
    names = [o["name"] for o in meta["encoder"]["outputs"]]
    out = dict(zip(names, enc.run(names, {"src": src})))
    feed = {"tokens": np.full((len(ids), 1), meta["bos_id"], dtype=np.int64), "memory": out["memory"],
            "src_pad": out["src_pad"]}
    for e in meta["cache"]:
        if e["source"] == "encoder":
            feed[e["input"]] = out[e["output"]]
        else:
            feed[e["input"]] = np.zeros([len(ids) if d == "batch" else 0 if d == "past_len" else d
                                         for d in e["shape"]], np.float32)
    return dec.run(["logits"], feed)[0]


@pytest.mark.parametrize("name", ["plain", "mixed"])
def test_int8_quantization_makes_the_weight_products_int8_and_keeps_the_logits(exports, sentences, name, tmp_path):
    import shutil

    import numpy as np

    from nas.export.onnx import cpu_has_vnni, quantize_onnx

    folder = tmp_path / name
    shutil.copytree(exports[name], folder)
    report = quantize_onnx(folder)
    meta = json.loads((folder / MANIFEST).read_text())
    assert meta["quantized"]["reduce_range"] is not cpu_has_vnni()  # 7-bit weights where the kernels can saturate
    for graph in ("encoder", "decoder_step"):
        assert meta[graph]["file"] == f"{graph}.int8.onnx" and meta[graph]["fp32_file"] == f"{graph}.onnx"
        r = report[graph]
        assert r["quantized"] >= 4, r  # the weight products (q/k/v, output, FFN), not attention's two
        assert r["int8_bytes"] < 0.8 * r["fp32_bytes"], r  # the tied embedding also stays fp32 for its lookup
    fp32 = _logits(folder, {g: meta[g]["fp32_file"] for g in ("encoder", "decoder_step")}, sentences)
    int8 = _logits(folder, {g: meta[g]["file"] for g in ("encoder", "decoder_step")}, sentences)
    error = np.abs(int8 - fp32).max() / np.abs(fp32).max()
    assert 0 < error < 0.1, error  # changed (int8), but close
    assert (int8.argmax(-1) == fp32.argmax(-1)).mean() >= 0.6
    assert quantize_onnx(folder) == report  # again: from the fp32 graphs, the same result
    run = subprocess.run([sys.executable, "translate_onnx.py", "--beam", "2", "--threads", "1"], cwd=folder,
                         input="\n".join(sentences) + "\n", capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and len(run.stdout.split("\n")[:-1]) == len(sentences), run.stderr[-2000:]


@pytest.mark.parametrize("name", ["plain", "mixed"])
def test_fixed_length_search_of_the_standalone_script_equals_pytorch(exports, sentences, name):
    """``min_len``/``max_len`` (benchmarks/bench_serving.py's fixed-length decoding) as in nas.model.beam_search."""
    from nas.export.translate_onnx import OnnxTranslator
    from nas.model import beam_search

    exported = load_export(exports[name])
    ids = [x[:20] + [3] for x in exported.tokenizer.encode(sentences)]
    src = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
    for i, row in enumerate(ids):
        src[i, :len(row)] = torch.tensor(row)
    ort = OnnxTranslator(exports[name], threads=1).beam_search(src.numpy(), 3, min_len=7, max_len=7)
    ours = beam_search(exported.model.eval(), src, exported.arch, beam_size=3, max_len_a=0.0, max_len_b=7, min_len=7)
    assert ort == ours and {len(h) for h in ours} == {6}
