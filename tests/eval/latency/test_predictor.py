"""The latency predictor (:mod:`nas.eval.latency.predictor`): features, fitting a known relation, save/load with
its workload and reference, drift."""

from __future__ import annotations

import json
import math
import random

import pytest
from safetensors.torch import load_file, save_file

from nas.errors import NasError
from nas.eval.latency import DEFAULT_WORKLOAD, FEATURE_NAMES, LatencyPredictor, arch_features, check_drift
from nas.space.arch import Arch, StackArch
from nas.space.predictor_file import read_predictor_meta
from tests.eval.latency.conftest import MODEL_DIM, tiny_space


def _stack(n: int, width: int = 16, paths: int = 1) -> StackArch:
    return StackArch((width,) * n, (32,) * n, (1,) * n, (paths,) * n)


REFERENCE_MS = (7.0, 7.5, 8.0)
"""The samples' interleaved reference timings cycle through these (median 7.5 ms)."""


def _synthetic(n: int, seed: int, noise: float = 0.02) -> list[dict]:
    """latency_ms = 0.05 * sum(width) + 1.0 * layers + 2, times (1 + N(0, noise)); ``latency_ratio`` = latency_ms / 7.5
    (the median of :data:`REFERENCE_MS`), as :func:`collect_samples` measures it against the reference."""
    space, _ = tiny_space()
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        arch = space.sample(rng)
        layers = arch.encoder.layers + arch.decoder.layers
        ms = 0.05 * (sum(arch.encoder.width) + sum(arch.decoder.width)) + 1.0 * layers + 2.0
        ms *= 1.0 + rng.gauss(0.0, noise)
        samples.append({"arch": arch.to_dict(), "latency_ms": ms, "latency_ratio": ms / 7.5,
                        "latency_reference_ms": REFERENCE_MS[len(samples) % 3],
                        "workload": dict(DEFAULT_WORKLOAD), "batch_size": 1, "beam_size": 4})
    return samples


# ---- features ------------------------------------------------------------------------------------

def test_features_have_one_value_per_name_for_every_sampled_arch():
    space, _ = tiny_space()
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


def test_encoder_attention_sums_the_encoder_layers_each_decoder_layer_attends_to_clamped_to_the_depth():
    idx = FEATURE_NAMES.index("decoder.encoder_attention_sum")
    hat = lambda ks: Arch(_stack(2), StackArch((16,) * len(ks), (32,) * len(ks), encoder_attention=ks))
    assert arch_features(hat((1, 1, 1)), MODEL_DIM)[idx] == 3  # the last encoder layer only: the layer count
    assert arch_features(hat((2, 3, 1)), MODEL_DIM)[idx] == 2 + 2 + 1  # 3 clamped to the encoder's 2 layers
    changed = {n for n, a, b in zip(FEATURE_NAMES, arch_features(hat((1, 1)), MODEL_DIM),
                                    arch_features(hat((2, 1)), MODEL_DIM)) if a != b}
    assert changed == {"decoder.encoder_attention_sum"}


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
    assert sum(errors) / len(errors) * 100 < MAPE_LIMIT  # ms: the predicted ratio times the reference's 7.5 ms
    assert predictor.reference_ms == 7.5
    ratio_errors = [abs(predictor.predict_ratio(s["arch"]) - s["latency_ratio"]) / s["latency_ratio"] for s in fresh]
    assert sum(ratio_errors) / len(ratio_errors) * 100 < MAPE_LIMIT


@pytest.mark.parametrize("hidden_layers", [0, 3])
def test_both_models_learn_the_known_relation(hidden_layers):
    """The linear default and HAT's MLP (``hidden_layers >= 1``) alike."""
    predictor = LatencyPredictor(MODEL_DIM, hidden_layers=hidden_layers)
    metrics = predictor.fit(_synthetic(200, seed=1), holdout=0.2, epochs=600, seed=0)
    assert metrics["mape"] < MAPE_LIMIT, metrics
    assert len(predictor.net) == (1 if hidden_layers == 0 else 2 * hidden_layers + 1)


def test_the_linear_model_is_ridge_regression_in_closed_form():
    """Against the normal equations written out with numpy: standardized features X (training mean and sample
    standard deviation, constant features left at 0) and standardized log ratios y, w = (X^T X + lambda I)^-1 X^T y,
    prediction exp(y_mean + y_std * x.w)."""
    import numpy as np

    samples = _synthetic(60, seed=5, noise=0.05)
    predictor = LatencyPredictor(MODEL_DIM, ridge=2.5)
    predictor.fit(samples, holdout=0.0)
    x = np.array([arch_features(Arch.from_dict(s["arch"]), MODEL_DIM) for s in samples])
    y = np.log([s["latency_ratio"] for s in samples])
    std = x.std(0, ddof=1)
    std[std < 1e-9] = 1.0
    xs = (x - x.mean(0)) / std
    ys = (y - y.mean()) / y.std(ddof=1)
    w = np.linalg.solve(xs.T @ xs + 2.5 * np.eye(xs.shape[1]), xs.T @ ys)
    fresh = _synthetic(10, seed=6)
    xf = (np.array([arch_features(Arch.from_dict(s["arch"]), MODEL_DIM) for s in fresh]) - x.mean(0)) / std
    want = np.exp(y.mean() + y.std(ddof=1) * (xf @ w))
    got = predictor.predict_ratio_many([s["arch"] for s in fresh])
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_predictor_cannot_fit_a_shuffled_target():
    samples = _synthetic(200, seed=1)
    latencies = [s["latency_ratio"] for s in samples]
    random.Random(3).shuffle(latencies)
    shuffled = [{**s, "latency_ratio": r} for s, r in zip(samples, latencies)]
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
    with pytest.raises(ValueError, match=r"latency_ratio=0.0 must be positive"):
        LatencyPredictor(MODEL_DIM).fit([*samples, {**samples[0], "latency_ratio": 0.0}], epochs=1)
    with pytest.raises(ValueError, match=r"latency_reference_ms=-1.0 must be positive"):
        LatencyPredictor(MODEL_DIM).fit([*samples, {**samples[0], "latency_reference_ms": -1.0}], epochs=1)
    timed_apart = [{k: v for k, v in s.items() if k not in ("latency_ratio", "latency_reference_ms")} for s in samples]
    with pytest.raises(NasError, match=r"samples\[0\] has no interleaved latency_ratio.*`nas latency fit`"):
        LatencyPredictor(MODEL_DIM).fit(timed_apart, epochs=1)
    with pytest.raises(RuntimeError, match="not fitted"):
        LatencyPredictor(MODEL_DIM).predict(samples[0]["arch"])


# ---- save / load --------------------------------------------------------------------------------

def test_save_and_load_give_identical_predictions_and_keep_workload_and_reference(tmp_path):
    samples = _synthetic(40, seed=5)
    space, _ = tiny_space()
    workload = {"src_tokens": 12, "tgt_tokens": 9, "beam": 4, "batch": 1}
    samples = [{**s, "workload": workload} for s in samples]
    reference = space.narrowest().to_json()
    predictor = LatencyPredictor(MODEL_DIM, hidden=16, workload=workload, device="cpu: test", reference_ms=99.0,
                                 reference_arch=reference)  # the fit replaces 99 ms with the samples' median
    predictor.fit(samples, epochs=50, seed=0)
    path = predictor.save(tmp_path / "latency.safetensors")
    loaded = LatencyPredictor.load(path)
    archs = [s["arch"] for s in samples]
    assert loaded.predict_many(archs) == predictor.predict_many(archs)
    assert loaded.predict_ratio_many(archs) == predictor.predict_ratio_many(archs)
    assert meta_format(tmp_path / "latency.json") == "nas-latency-predictor/2"
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


def meta_format(sidecar) -> str:
    return json.loads(sidecar.read_text())["format"]


def test_a_predictor_of_milliseconds_timed_apart_is_refused_with_refit(tmp_path):
    """Format 1 predicted milliseconds timed apart from the reference: its ratios are not the trials'."""
    predictor = LatencyPredictor(MODEL_DIM, hidden=8)
    predictor.fit(_synthetic(10, seed=6), epochs=5)
    path = predictor.save(tmp_path / "v1.safetensors")
    meta = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, "format": "nas-latency-predictor/1",
                                                     "target": "log_latency_ms"}))
    for read in (LatencyPredictor.load, read_predictor_meta):
        with pytest.raises(NasError, match=r"v1\.safetensors predicts milliseconds timed apart .*refit with `nas latency "
                                           r"fit`"):
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


def test_a_predictor_fitted_before_encoder_attention_loads_and_refuses_only_archs_that_use_it(tmp_path):
    """A predictor saved before ``decoder.encoder_attention_sum`` existed (its features one shorter) still predicts
    the archs it knew; an arch attending to several encoder layers is refused with refit."""
    predictor = LatencyPredictor(MODEL_DIM, hidden=8)
    predictor.fit(_synthetic(10, seed=6), epochs=5)
    path = predictor.save(tmp_path / "old.safetensors")
    weights = load_file(str(path))
    weights["0.weight"] = weights["0.weight"][:, :-1].contiguous()  # the first layer without the last feature
    save_file(weights, str(path))
    meta = json.loads(path.with_suffix(".json").read_text())
    for key in ("feature_names", "feature_mean", "feature_std"):
        meta[key] = meta[key][:-1]
    path.with_suffix(".json").write_text(json.dumps(meta))
    old = LatencyPredictor.load(path)
    arch = Arch(_stack(2), _stack(2))
    assert old.feature_names == tuple(FEATURE_NAMES[:-1]) and math.isfinite(old.predict(arch))
    hat = Arch(_stack(2), StackArch((16, 16), (32, 32), encoder_attention=(2, 1)))
    with pytest.raises(NasError, match=r"attends to several encoder layers .*refit with `nas latency fit`"):
        old.predict(hat)
    assert LatencyPredictor.load(old.save(tmp_path / "again.safetensors")).predict(arch) == old.predict(arch)


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
    ratio = check_drift(1.5, 1.2, unit="x the reference")
    assert ratio is not None and "predicted 1.50 x the reference, measured 1.20 x the reference (25% off" in ratio
