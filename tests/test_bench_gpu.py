"""benchmarks/bench_gpu.py: its analytic FLOPs equal torch's FLOP counter, and it runs end to end on CPU through the
trainer's own sandwich step without loading Ray, Optuna or MLflow."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nas.model.supernet import SuperTransformer, extract
from nas.space import load_spec
from nas.space.arch import Arch, StackArch
from nas.space.space import SearchSpace
from tests.conftest import load_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("ray", "optuna", "mlflow", "matplotlib", "pandas")
"""What a GPU machine with only torch and ``nas``'s own dependencies (pyarrow, sentencepiece, rich...) lacks."""


def _bench():
    return load_script("benchmarks/bench_gpu.py")


BENCH = _bench()


def _counted(forward) -> int:
    """FLOPs torch's ``FlopCounterMode`` counts for ``forward()``, attention through the math backend (whose
    matrix products it sees; it has no formula for the CPU flash kernel)."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]), torch.no_grad():
        forward()
    return counter.get_total_flops()


def _ids(rows: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))  # [b, t]


def _stack(*layers: dict) -> StackArch:
    """A stack from one dict of choices per layer."""
    return StackArch(**{key: tuple(layer[key] for layer in layers) for key in layers[0]})


def _layer(width=32, ffn=64, branches=1, paths=1, layout="sequential", kernels=(), units=1,
           encoder_attention=1) -> dict:
    return dict(width=width, ffn_width=ffn, branches=branches, paths=paths, layout=layout, kernels=kernels,
                units=units, encoder_attention=encoder_attention)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_forward_flops_equal_the_flop_counter_on_torch_nn_transformer():
    torch.manual_seed(0)
    core = nn.Transformer(32, 2, 1, 1, 64, 0.0, norm_first=True, batch_first=True)
    embed = nn.Embedding(50, 32)
    src, tgt = _ids(2, 5, 50), _ids(2, 4, 50, seed=1)

    def forward():
        mask = nn.Transformer.generate_square_subsequent_mask(4)
        h = core(embed(src), embed(tgt), tgt_mask=mask, src_key_padding_mask=src.eq(0),
                 memory_key_padding_mask=src.eq(0), tgt_is_causal=True)  # [b, t, C]
        return h @ embed.weight.T  # [b, t, V]

    arch = Arch(StackArch((32,), (64,)), StackArch((32,), (64,)))
    assert BENCH.forward_flops(arch, model_dim=32, vocab_size=50, batch=2, src_len=5, tgt_len=4) == _counted(forward)


def test_forward_flops_equal_the_flop_counter_on_the_extracted_plain_widest():
    spec = load_spec(REPO / "search_spaces" / "quickstart.yaml", check_files=False)
    torch.manual_seed(0)
    supernet = SuperTransformer.from_config(BENCH.supernet_config(spec, 50))
    plain = BENCH.plain_arch(SearchSpace.from_spec(spec).widest())
    model = extract(supernet, plain).eval()
    src, tgt = _ids(3, 6, 50), _ids(3, 5, 50, seed=1)
    expected = BENCH.model_forward_flops(model, plain, 3, 6, 5)
    assert expected == _counted(lambda: model(src, tgt, plain))
    doubled = StackArch(plain.decoder.width, tuple(2 * f for f in plain.decoder.ffn_width))
    wrong = dataclasses.replace(plain, decoder=doubled)
    assert BENCH.model_forward_flops(model, wrong, 3, 6, 5) != expected  # a wrong FFN width is seen


FAMILIES = {
    "per-layer widths, branches": dict(
        enc=[_layer(32, 64, branches=2), _layer(16, 32, branches=3)], dec=[_layer(16, 64, branches=2)]),
    "paths": dict(enc=[_layer(paths=2), _layer(16, 32, paths=3)], dec=[_layer(32, 32, branches=2, paths=2)]),
    "relative positions": dict(enc=[_layer(branches=2), _layer()], dec=[_layer()], model=dict(relative_positions=3)),
    "prime layers": dict(enc=[_layer(layout="prime", kernels=(3, 7)), _layer(layout="prime")],
                         dec=[_layer(16, 32, layout="prime", kernels=(3,), branches=2)]),
    "type-1 model width": dict(enc=[_layer(16, 32)], dec=[_layer(16, 32)], model_width=16,
                               model=dict(io_projection=True)),
    "units": dict(enc=[_layer(units=2, branches=2)], dec=[_layer(units=2, paths=2)]),
    "encoder attention (HAT), the second clamped to the depth": dict(
        enc=[_layer(), _layer(16, 32)],
        dec=[_layer(encoder_attention=2, branches=2), _layer(16, 32, encoder_attention=3)]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_flops_per_token_terms_equal_the_flop_counter_in_every_family(family):
    """``FlopCounterMode`` also counts products of weights alone (crops, the multi-path FFN's folded layer norm),
    which do not grow with the batch: the counts at 4 and at 2 sentences differ by exactly the tokens' FLOPs.
    Units: plus their weighted sum ``einsum("u,ubtc->btc")``, which :func:`forward_flops` does not count."""
    case = FAMILIES[family]
    arch = Arch(_stack(*case["enc"]), _stack(*case["dec"]), model_width=case.get("model_width"))
    maxima = Arch(_stack(*case["enc"]), _stack(*case["dec"]))
    torch.manual_seed(0)
    model = SuperTransformer(50, 32, 2, maxima, head_dim=8, **case.get("model", {})).eval()
    s, t = 6, 5

    def counted(rows: int) -> int:
        return _counted(lambda: model(_ids(rows, s, 50), _ids(rows, t, 50, seed=1), arch))

    def expected(rows: int) -> int:
        c = arch.model_width or 32
        unit_sums = sum(2 * d.units * rows * n * c for st, n in ((arch.encoder, s), (arch.decoder, t))
                        for d in st.layer_dims() if d.units > 1)
        return BENCH.model_forward_flops(model, arch, rows, s, t) + unit_sums

    assert expected(4) - expected(2) == counted(4) - counted(2)
    assert 2 * BENCH.model_forward_flops(model, arch, 2, s, t) == BENCH.model_forward_flops(model, arch, 4, s, t)


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5),
                                          ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
                                          ("Some Future GPU", None)])
def test_peak_lookup_by_device_name(name, tflops):
    assert BENCH.peak_bf16_tflops(name) == tflops


def test_synthetic_batch_is_bos_words_eos_without_padding():
    batch = BENCH.synthetic_batch(100, 7, 10, 30, "cpu")
    assert batch.src.shape == (10, 7) and batch.tgt_in.shape == batch.tgt_out.shape == (10, 10)
    assert batch.ntokens == 100 and batch.src.min() >= 3 and batch.src.max() < 30
    assert (batch.src[:, -1] == 3).all() and (batch.tgt_in[:, 0] == 2).all() and (batch.tgt_out[:, -1] == 3).all()
    assert torch.equal(batch.tgt_in[:, 1:], batch.tgt_out[:, :-1])
    with pytest.raises(ValueError, match="--max-tokens 5"):
        BENCH.synthetic_batch(5, 7, 10, 30, "cpu")


_RUN = """
import runpy, sys, json
sys.argv = ["benchmarks/bench_gpu.py", *json.loads(sys.argv[1])]
try:
    runpy.run_path("benchmarks/bench_gpu.py", run_name="__main__")
finally:
    print("LOADED", json.dumps(sorted(m for m in {forbidden} if m in sys.modules)))
"""


def _run(args: list[str]) -> subprocess.CompletedProcess:
    code = _RUN.format(forbidden=FORBIDDEN)
    return subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, cwd=REPO,
                          timeout=600)


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_runs_end_to_end_on_cpu_without_ray_optuna_or_mlflow(tmp_path):
    out = tmp_path / "out.json"
    done = _run(["search_spaces/quickstart.yaml", "--device", "cpu", "--vocab", "1000", "--max-tokens", "256",
                 "--src-len", "8", "--tgt-len", "8", "--steps", "2", "--warmup", "1", "--compile", "--json", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'LOADED []' in done.stdout, done.stdout
    assert "--compile skipped on cpu" in done.stdout
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    assert names == ["ours, plain widest (extracted)", "ours, plain widest in the supernet",
                     "torch.nn.Transformer, same dims", "ours, widest in the supernet",
                     "sandwich step (widest+narrowest+1)"]
    assert all(r["tokens_per_s"] > 0 and r["tflops_per_s"] > 0 for r in report["rows"])
    assert report["rows"][2]["vs_nn_transformer"] == 1.0 and report["rows"][0]["mfu_percent"] is None
    assert report["batch"] == {"rows": 32, "src_len": 8, "tgt_len": 8, "target_tokens": 256}
    for line in ("goal ours (plain widest, extracted) >= 0.90x torch.nn.Transformer tokens/s", "MFU", "FLOPs: 3 x"):
        assert line in done.stdout


TINY_YAML = """\
# nas sweep tiny.yaml
name: tiny
data:
  train: {src: unused.en.gz, tgt: unused.de.gz}
  valid: {src: unused.en.gz, tgt: unused.de.gz}
  tokenizer: {vocab_size: 100}
supernet: {model_dim: 32, heads: 2, encoder_layers: 1, decoder_layers: 1, ffn_width: 64, branches: 2}
space:
  width: {values: [16, 32], per_layer: true}
  ffn_width: {values: [32, 64], per_layer: true}
  branches: {values: [1, 2], per_layer: true}
"""
"""1+1 layers: dynamo traces a layer in about a second on a busy 2-core machine; the data files are never read."""


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_compiled_rows_count_the_sandwich_steps_recompiles(tmp_path):
    """``--compile-cpu`` with the eager backend (dynamo traces, no C++ build): the sandwich step's new archs
    compile new graphs after the first step; the plain widest compiles once."""
    (tmp_path / "tiny.yaml").write_text(TINY_YAML)
    out = tmp_path / "out.json"
    done = _run([str(tmp_path / "tiny.yaml"), "--device", "cpu", "--vocab", "200", "--max-tokens", "64",
                 "--src-len", "4", "--tgt-len", "4", "--steps", "2", "--warmup", "1", "--compile", "--compile-cpu",
                 "--compile-backend", "eager", "--peak-tflops", "1", "--json", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'LOADED []' in done.stdout, done.stdout
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    sandwich = rows["sandwich step (widest+narrowest+1), compiled"]["compile"]
    assert sandwich["recompiles_after_first_step"] >= 1 and sandwich["graphs"] >= 3
    assert rows["ours, plain widest (extracted), compiled"]["compile"]["recompiles_after_first_step"] == 0
    assert "compile, sandwich step (widest+narrowest+1): " in done.stdout
    assert rows["ours, plain widest (extracted)"]["mfu_percent"] > 0
