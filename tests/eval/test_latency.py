"""Latency: the fixed workload (exactly ``tgt_tokens`` decoder steps whatever the weights, HAT's trimmed mean), the
predictor (features, fitting a known relation, save/load with its workload and reference, drift), real
measurements."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from nas.errors import NasError
from nas.eval.latency import (DEFAULT_WORKLOAD, FEATURE_NAMES, LatencyPredictor, arch_features, check_drift,
                              collect_samples, measure_fixed_latency, measure_latency, trimmed_mean)
from nas.model import decode
from nas.model.supernet import SuperTransformer
from nas.space.predictor_file import read_predictor_meta
from nas.space.arch import Arch, StackArch
from nas.space.space import SearchSpace
from nas.space import parse_spec

MODEL_DIM = 32

# Per-layer widths, depths, paths/kernels under a layout condition: every feature group varies.
SPACE = {
    "encoder_layers": {"values": [1, 2, 3]},
    "decoder_layers": {"values": [1, 2]},
    "width": {"values": [8, 16, 32], "per_layer": True},
    "ffn_width": {"values": [16, 32, 64], "per_layer": True},
    "branches": {"values": [1, 2], "per_layer": True},
    "layout": {"values": ["sequential", "prime"], "per_layer": True},
    "paths": {"values": [1, 2], "per_layer": True, "when": {"layout": "sequential"}},
    "kernels": {"values": [[], [3]], "per_layer": True, "when": {"layout": "prime"}},
}


def _space(space: dict = SPACE, **supernet) -> tuple[SearchSpace, object]:
    raw = {
        "name": "t",
        "data": {"train": {"src": "a.en", "tgt": "a.de"}, "valid": {"src": "b.en", "tgt": "b.de"}},
        "supernet": {"model_dim": MODEL_DIM, "heads": 2, "head_dim": 8, "encoder_layers": 3, "decoder_layers": 2,
                     "kernels": [3], **supernet},
        "space": space,
    }
    spec = parse_spec(raw)
    return SearchSpace.from_spec(spec), spec


def _stack(n: int, width: int = 16, paths: int = 1) -> StackArch:
    return StackArch((width,) * n, (32,) * n, (1,) * n, (paths,) * n)


def _synthetic(n: int, seed: int, noise: float = 0.02) -> list[dict]:
    """latency_ms = 0.05 * sum(width) + 1.0 * layers + 2, times (1 + N(0, noise))."""
    space, _ = _space()
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        arch = space.sample(rng)
        layers = arch.encoder.layers + arch.decoder.layers
        ms = 0.05 * (sum(arch.encoder.width) + sum(arch.decoder.width)) + 1.0 * layers + 2.0
        samples.append({"arch": arch.to_dict(), "latency_ms": ms * (1.0 + rng.gauss(0.0, noise)),
                        "workload": dict(DEFAULT_WORKLOAD), "batch_size": 1, "beam_size": 4})
    return samples


# ---- features ------------------------------------------------------------------------------------

def test_features_have_one_value_per_name_for_every_sampled_arch():
    space, _ = _space()
    rng = random.Random(0)
    for arch in [space.widest(), space.narrowest(), *(space.sample(rng) for _ in range(20))]:
        features = arch_features(arch, MODEL_DIM)
        assert len(features) == len(FEATURE_NAMES) and all(math.isfinite(f) for f in features)
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)


def test_more_paths_gives_larger_path_features_and_nothing_else_shrinks():
    one = arch_features(Arch(_stack(2, paths=1), _stack(1)), MODEL_DIM)
    two = arch_features(Arch(_stack(2, paths=2), _stack(1)), MODEL_DIM)
    changed = {name for name, a, b in zip(FEATURE_NAMES, one, two) if a != b}
    assert changed == {"encoder.paths_mean", "encoder.paths_sum", "encoder.attention_work", "encoder.ffn_work"}
    assert all(b >= a for a, b in zip(one, two))
    assert two[FEATURE_NAMES.index("encoder.paths_sum")] == 4.0


def test_prime_kernels_units_and_depth_show_in_their_features():
    base = Arch(_stack(2), _stack(1))
    prime = Arch(StackArch((16, 16), (32, 32), layout=("prime", "sequential"), kernels=((3, 7), ())), _stack(1))
    units = Arch(_stack(2), StackArch((16,), (32,), units=(2,), unit_dependency=("sequential",)))
    f = lambda arch, name: arch_features(arch, MODEL_DIM)[FEATURE_NAMES.index(name)]
    assert f(prime, "encoder.prime_layers") == 1 and f(prime, "encoder.kernel_taps") == 10
    assert f(units, "decoder.units_sum") == 2 and f(units, "decoder.sequential_dependency_layers") == 1
    assert f(Arch(_stack(3), _stack(1)), "encoder.layers") == 3 > f(base, "encoder.layers")
    assert f(base, "model_width") == MODEL_DIM


def test_model_width_attribute_overrides_model_dim_and_none_falls_back():
    idx = FEATURE_NAMES.index("model_width")
    assert arch_features(Arch(_stack(1), _stack(1), model_width=24), MODEL_DIM)[idx] == 24
    assert arch_features(Arch(_stack(1), _stack(1)), MODEL_DIM)[idx] == MODEL_DIM


# ---- fitting ------------------------------------------------------------------------------------

# 2% multiplicative noise alone costs a perfect model a MAPE of E|N(0, 0.02)| = 1.6%; the
# relation is linear in two features the predictor sees (sum of widths = width_sum, layers),
# so a fitted MLP adds little: 5% leaves room for 160 training samples. Shuffling the target
# breaks the relation, and predicting the mean of a target spanning ~5-15 ms gives ~25-30%.
MAPE_LIMIT = 5.0


def test_predictor_learns_a_known_relation_within_the_noise():
    predictor = LatencyPredictor(MODEL_DIM)
    metrics = predictor.fit(_synthetic(200, seed=1), holdout=0.2, epochs=600, seed=0)
    assert metrics["holdout_samples"] == 40 and metrics["train_samples"] == 160
    assert metrics["mape"] < MAPE_LIMIT, metrics
    fresh = _synthetic(30, seed=2, noise=0.0)
    errors = [abs(predictor.predict(s["arch"]) - s["latency_ms"]) / s["latency_ms"] for s in fresh]
    assert sum(errors) / len(errors) * 100 < MAPE_LIMIT


def test_predictor_cannot_fit_a_shuffled_target():
    samples = _synthetic(200, seed=1)
    latencies = [s["latency_ms"] for s in samples]
    random.Random(3).shuffle(latencies)
    shuffled = [{**s, "latency_ms": ms} for s, ms in zip(samples, latencies)]
    metrics = LatencyPredictor(MODEL_DIM).fit(shuffled, holdout=0.2, epochs=600, seed=0)
    assert metrics["mape"] > 2 * MAPE_LIMIT, metrics


def test_fit_uses_only_samples_on_its_workload_and_says_which_exist():
    samples = _synthetic(10, seed=4)
    with pytest.raises(NasError, match=r"0 samples on workload src30-tgt30-beam4-batch8 .*'src30-tgt30-beam4-batch1'"):
        LatencyPredictor(MODEL_DIM, workload={**DEFAULT_WORKLOAD, "batch": 8}).fit(samples, epochs=1)
    with pytest.raises(NasError, match=r"0 samples on workload src30-tgt20-beam4-batch1"):  # same batch and beam
        LatencyPredictor(MODEL_DIM, workload={**DEFAULT_WORKLOAD, "tgt_tokens": 20}).fit(samples, epochs=1)
    legacy = [{k: v for k, v in s.items() if k != "workload"} for s in samples]  # batch and beam size only
    with pytest.raises(NasError, match=r"0 samples .*'batch1-beam4'"):
        LatencyPredictor(MODEL_DIM, workload={**DEFAULT_WORKLOAD, "beam": 5}).fit(legacy, epochs=1)
    with pytest.raises(ValueError, match="latency_ms=0.0"):
        LatencyPredictor(MODEL_DIM).fit([*samples, {**samples[0], "latency_ms": 0.0}], epochs=1)
    with pytest.raises(RuntimeError, match="not fitted"):
        LatencyPredictor(MODEL_DIM).predict(samples[0]["arch"])


# ---- save / load --------------------------------------------------------------------------------

def test_save_and_load_give_identical_predictions_and_keep_workload_and_reference(tmp_path):
    samples = _synthetic(40, seed=5)
    space, _ = _space()
    workload = {"src_tokens": 12, "tgt_tokens": 9, "beam": 4, "batch": 1}
    samples = [{**s, "workload": workload} for s in samples]
    reference = space.narrowest().to_json()
    predictor = LatencyPredictor(MODEL_DIM, hidden=16, workload=workload, device="cpu: test", reference_ms=7.5,
                                 reference_arch=reference)
    predictor.fit(samples, epochs=50, seed=0)
    path = predictor.save(tmp_path / "latency.safetensors")
    loaded = LatencyPredictor.load(path)
    archs = [s["arch"] for s in samples]
    assert loaded.predict_many(archs) == predictor.predict_many(archs)
    assert loaded.workload == workload and loaded.reference_ms == 7.5 and loaded.reference_arch == reference
    meta = json.loads((tmp_path / "latency.json").read_text())
    assert meta["device"] == "cpu: test" and meta["batch_size"] == 1 and meta["beam_size"] == 4
    assert meta["workload"] == workload and meta["reference_ms"] == 7.5 and meta["reference_arch"] == reference
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary files left


def test_a_predictor_saved_without_a_workload_is_refused_with_refit(tmp_path):
    """A sidecar from before the fixed workload (timed on real sentences) names no workload: refused on load."""
    predictor = LatencyPredictor(MODEL_DIM, hidden=8)
    predictor.fit(_synthetic(10, seed=6), epochs=5)
    path = predictor.save(tmp_path / "old.safetensors")
    meta = json.loads(path.with_suffix(".json").read_text())
    for key in ("workload", "reference_ms", "reference_arch"):
        del meta[key]
    path.with_suffix(".json").write_text(json.dumps(meta))
    for read in (LatencyPredictor.load, read_predictor_meta):
        with pytest.raises(NasError, match=r"old\.safetensors names no latency workload.*refit with `nas latency fit`"):
            read(path)


def test_load_refuses_a_predictor_fitted_on_other_features(tmp_path):
    predictor = LatencyPredictor(MODEL_DIM, hidden=8)
    predictor.fit(_synthetic(10, seed=6), epochs=5)
    path = predictor.save(tmp_path / "latency.safetensors")
    meta = json.loads(path.with_suffix(".json").read_text())
    meta["feature_names"] = meta["feature_names"][:-1] + ["encoder.heads_mean"]
    path.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"fitted on features .*encoder\.heads_mean.*refit with `nas latency fit`"):
        LatencyPredictor.load(path)


# ---- drift --------------------------------------------------------------------------------------

def test_check_drift_warns_only_beyond_the_tolerance():
    assert check_drift(11.9, 10.0) is None
    assert check_drift(8.1, 10.0) is None
    warning = check_drift(12.5, 10.0)
    assert warning is not None and "25%" in warning and "nas latency fit" in warning
    assert check_drift(7.0, 10.0) is not None
    assert check_drift(11.0, 10.0, tolerance=0.05) is not None
    with pytest.raises(ValueError, match="measured_ms=0"):
        check_drift(1.0, 0.0)


# ---- measuring on a real supernet ---------------------------------------------------------------

def _tiny_supernet(seed: int) -> tuple[SearchSpace, SuperTransformer]:
    torch.manual_seed(seed)
    space, spec = _space({"encoder_layers": {"values": [1, 2]}, "width": {"values": [16, 32], "per_layer": True},
                          "ffn_width": {"values": [32, 64]}}, encoder_layers=2, decoder_layers=1, kernels=[])
    return space, SuperTransformer(100, MODEL_DIM, 2, space.supernet_maxima(spec), max_positions=64).eval()


def test_the_fixed_workload_runs_exactly_tgt_tokens_decoder_steps_whatever_the_weights(monkeypatch):
    steps = []
    real = decode.IncrementalDecoder.step

    def counting(self, tokens):
        steps.append(tokens.size(0))  # rows decoded this step: batch * beam
        return real(self, tokens)

    monkeypatch.setattr(decode.IncrementalDecoder, "step", counting)
    for seed in (0, 1):  # two random supernets: different weights, different argmaxes
        space, supernet = _tiny_supernet(seed)
        for arch in (space.narrowest(), space.widest()):
            steps.clear()
            ms = measure_fixed_latency(supernet, arch, src_tokens=7, tgt_tokens=11, beam_size=3, batch_size=2,
                                       repeats=1, warmup=0)
            assert steps == [2 * 3] * 11 and ms > 0  # every step decodes all beams of both sentences
            steps.clear()
            measure_fixed_latency(supernet, arch, src_tokens=7, tgt_tokens=11, beam_size=3, repeats=2, warmup=1)
            assert len(steps) == 3 * 11  # warm-up and timed runs alike


def test_trimmed_mean_drops_the_top_and_bottom_tenth_as_hat_does():
    assert trimmed_mean([float(x) for x in range(1, 21)]) == pytest.approx(10.5)  # 3..18 averaged
    assert trimmed_mean([10.0] * 18 + [0.0, 1000.0]) == 10.0  # one outlier at each end: gone
    assert trimmed_mean([1.0, 2.0, 6.0]) == 3.0  # fewer than 10: all kept
    with pytest.raises(ValueError, match="no timings"):
        trimmed_mean([])


def test_measure_fixed_latency_rejects_a_workload_beyond_the_model():
    _, supernet = _tiny_supernet(0)
    with pytest.raises(ValueError, match="tgt_tokens=64 exceed the model's max_positions=64"):
        measure_fixed_latency(supernet, None, tgt_tokens=64)
    with pytest.raises(ValueError, match=r"^repeats=0 must be >= 1; warmup=-1 must be >= 0$"):
        measure_fixed_latency(supernet, None, repeats=0, warmup=-1)


def test_collect_samples_times_real_extracted_models_on_the_workload_with_the_reference():
    space, supernet = _tiny_supernet(0)
    workload = {"src_tokens": 6, "tgt_tokens": 5, "beam": 2, "batch": 1}
    samples = collect_samples(supernet, space, 3, workload=workload, seed=0, repeats=2, warmup=1, threads=1,
                              progress=False)
    assert len(samples) == 3 and len({s["arch_id"] for s in samples}) == 3
    assert samples[0]["arch"] == space.widest().to_dict() and samples[1]["arch"] == space.narrowest().to_dict()
    assert [s["reference"] for s in samples] == [False, True, False]  # default reference: the narrowest
    assert all(math.isfinite(s["latency_ms"]) and s["latency_ms"] > 0 for s in samples)
    assert all(s["workload"] == workload and (s["batch_size"], s["beam_size"]) == (1, 2) for s in samples)
    assert all("(1 thread)" in s["device"] for s in samples)
    json.dumps(samples)  # JSON-ready for `nas latency fit`'s samples file
    middle = space.middle()
    assert middle.arch_id not in {s["arch_id"] for s in samples}
    more = collect_samples(supernet, space, 3, workload=workload, reference=middle, seed=0, repeats=1, warmup=0,
                           threads=1, progress=False)
    assert len(more) == 4 and [s["arch_id"] for s in more if s["reference"]] == [middle.arch_id]


def test_measure_latency_rejects_a_batch_larger_than_the_sentences():
    space, spec = _space({}, encoder_layers=1, decoder_layers=1, kernels=[], ffn_width=32)
    supernet = SuperTransformer(50, MODEL_DIM, 2, space.supernet_maxima(spec), max_positions=32)
    with pytest.raises(ValueError, match="batch_size=4 needs at least 4 sentences; got 2"):
        measure_latency(supernet, None, [[5, 3], [6, 3]], batch_size=4)


def test_latency_fit_without_a_trained_supernet_names_the_folder_and_exits_2(multi30k, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from nas.cli import app
    from tests.conftest import tiny_spec_dict

    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(tiny_spec_dict(multi30k, tmp_path)))
    result = CliRunner().invoke(app, ["latency", "fit", str(spec_file)])
    assert result.exit_code == 2
    assert "no trained supernet" in " ".join(result.output.split()) and "supernet" in result.output


def test_latency_fit_onto_a_folder_fails_before_measuring(multi30k, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from nas.cli import app
    from tests.conftest import tiny_spec_dict

    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(tiny_spec_dict(multi30k, tmp_path)))
    (tmp_path / "predictors").mkdir()
    result = CliRunner().invoke(app, ["latency", "fit", str(spec_file), "--out", str(tmp_path / "predictors")])
    assert result.exit_code == 2
    assert f"--out: {tmp_path / 'predictors'} is a folder, not a file" in " ".join(result.stderr.split())
    assert list((tmp_path / "predictors").iterdir()) == []
