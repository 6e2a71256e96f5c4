"""``latency_ratio``: a trial's fixed-workload latency over the reference arch's (``search.latency_reference``),
reported by :func:`score_arch` (measured or predicted) and usable in ``search.constraints``; a predictor fitted on
another workload or reference is refused. Real tiny data and an untrained tiny supernet (fixed-length latency does
not depend on the weights)."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

import nas.eval.latency.ratio as ratio_module
from nas.errors import NasError
from nas.eval.latency import LatencyPredictor, collect_fixed_samples, fit_predictor_file, workload_of, workload_tag
from nas.search.trials import feasibility, resolve_reference, score_arch
from nas.space import SpecError, load_spec, parse_spec
from nas.space.space import SearchSpace
from tests.conftest import tiny_spec_dict, use_tiny_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEARCH = {"beam_size": 2, "valid_sentences": 4, "latency_repeats": 2,
          "latency_workload": {"src_tokens": 8, "tgt_tokens": 6}}


@pytest.fixture(scope="module")
def tiny(multi30k, tiny_data, tmp_path_factory):
    """(raw spec dict, prepared data, untrained supernet) of :func:`tiny_spec_dict`."""
    import torch

    from nas.builders import build_supernet, prepare_sweep_data

    work = tmp_path_factory.mktemp("ratio")
    raw = use_tiny_data(tiny_spec_dict(multi30k, work, search=dict(SEARCH)), tiny_data)
    spec = parse_spec(raw)
    data = prepare_sweep_data(spec, progress=False)
    torch.manual_seed(0)
    return raw, data, build_supernet(spec, data.vocab_size).eval()


def _spec(raw: dict, **search):
    return parse_spec({**raw, "search": {**raw["search"], **search}})


@pytest.fixture
def fake_timings(monkeypatch):
    """``interleaved_timings`` returns fixed ms per arch (by extracted encoder width: the narrowest enc[16] 11 ms,
    the widest enc[32 32] 14 ms), counting its calls."""
    calls = []

    def fake(model, arch, reference_model, reference_arch, *, rounds, **kw):
        calls.append((arch.arch_id, reference_arch.arch_id, rounds, kw))
        ms = lambda a: 10.0 + sum(a.encoder.width) / 16  # noqa: E731
        return [ms(arch)] * rounds, [ms(reference_arch)] * (rounds + 1)

    monkeypatch.setattr(ratio_module, "interleaved_timings", fake)
    return calls


def test_score_arch_times_the_arch_interleaved_with_the_reference_in_every_trial(tiny, monkeypatch):
    raw, data, model = tiny
    spec = _spec(raw)
    space = SearchSpace.from_spec(spec)
    real, calls = ratio_module.interleaved_timings, []

    def spy(sub, arch, ref_model, reference, **kw):
        calls.append((arch.arch_id, reference.arch_id, kw))
        return real(sub, arch, ref_model, reference, **kw)

    monkeypatch.setattr(ratio_module, "interleaved_timings", spy)
    first = score_arch(model, space.widest(), spec, data)
    assert [(a, r) for a, r, _ in calls] == [(space.widest().arch_id, space.narrowest().arch_id)]
    assert calls[0][2] == {"workload": {"src_tokens": 8, "tgt_tokens": 6, "beam": 2, "batch": 1}, "rounds": 2,
                           "warmup": 2, "threads": 1, "lock": calls[0][2]["lock"],
                           "runner": None}  # the YAML's workload and rounds, PyTorch's engine
    assert calls[0][2]["lock"] is not None  # timed holding the node's lock
    assert first["latency_ms"] > 0 and first["latency_reference_ms"] > 0 and first["latency_ratio"] > 0
    second = score_arch(model, space.middle(), spec, data)
    # the reference is timed again, interleaved with each arch: no figure carried over from another moment
    assert [(a, r) for a, r, _ in calls[1:]] == [(space.middle().arch_id, space.narrowest().arch_id)]
    assert second["latency_ratio"] > 0


def test_a_latency_ratio_constraint_makes_a_trial_feasible_or_not(tiny, fake_timings):
    raw, data, model = tiny
    space = SearchSpace.from_spec(_spec(raw))
    tight = _spec(raw, constraints=["latency_ratio <= 1.2"])
    metrics = score_arch(model, space.widest(), tight, data)
    assert metrics["latency_reference_ms"] == 11.0 and metrics["latency_ms"] == 14.0
    assert metrics["latency_ratio"] == pytest.approx(14.0 / 11.0)
    assert feasibility(metrics, tight) == {"feasible": 0.0, "violated": "latency_ratio<=1.2"}
    assert feasibility(metrics, _spec(raw, constraints=["latency_ratio <= 1.3"])) == {"feasible": 1.0}
    narrowest = score_arch(model, space.narrowest(), tight, data)
    assert narrowest["latency_ratio"] == 1.0 and feasibility(narrowest, tight) == {"feasible": 1.0}
    assert len(fake_timings) == 2  # one interleaved measurement per arch


def test_the_ratio_is_the_median_per_round_ratio_not_a_quotient_of_times_from_other_moments(tiny, monkeypatch):
    raw, data, model = tiny
    space = SearchSpace.from_spec(_spec(raw))
    # R0 C0 R1 C1 R2: the machine slows down 3x for the second round; every round's ratio is 1.5
    monkeypatch.setattr(ratio_module, "interleaved_timings",
                        lambda *a, **k: ([15.0, 45.0], [10.0, 10.0, 50.0]))
    metrics = score_arch(model, space.widest(), _spec(raw), data)
    assert metrics["latency_ratio"] == pytest.approx((15.0 / 10.0 + 45.0 / 30.0) / 2) == pytest.approx(1.5)
    assert metrics["latency_ms"] == 30.0 and metrics["latency_reference_ms"] == 10.0


def test_the_workload_and_reference_of_the_yaml_are_the_ones_timed(tiny, fake_timings):
    raw, data, model = tiny
    arch = SearchSpace.from_spec(_spec(raw)).middle()
    score_arch(model, arch, _spec(raw), data)
    score_arch(model, arch, _spec(raw, latency_workload={"src_tokens": 8, "tgt_tokens": 7}), data)
    widest = score_arch(model, arch, _spec(raw, latency_reference="widest"), data)
    assert [c[3]["workload"]["tgt_tokens"] for c in fake_timings] == [6, 7, 6]
    assert fake_timings[2][1] == SearchSpace.from_spec(_spec(raw)).widest().arch_id
    assert widest["latency_reference_ms"] == 14.0


def test_resolve_reference_reads_names_and_arch_json_and_names_the_key_when_bad(tiny):
    raw, _, _ = tiny
    space = SearchSpace.from_spec(_spec(raw))
    for name in ("narrowest", "middle", "widest"):
        assert resolve_reference(_spec(raw, latency_reference=name), space) == getattr(space, name)()
    sampled = space.sample(__import__("random").Random(3))
    assert resolve_reference(_spec(raw, latency_reference=sampled.to_json()), space) == sampled
    with pytest.raises(NasError, match=r"search.latency_reference: 'smallest' is not narrowest, widest, middle"):
        resolve_reference(_spec(raw, latency_reference="smallest"), space)
    too_wide = json.loads(space.widest().to_json())
    too_wide["encoder"]["width"] = [64, 64]
    with pytest.raises(NasError, match=r"search.latency_reference: .*encoder.width\[0\]=64 exceeds"):
        resolve_reference(_spec(raw, latency_reference=json.dumps(too_wide)), space)


# ---------------------------------------------------------------- predicted latency_ratio


@pytest.fixture(scope="module")
def predictor_file(tiny, tmp_path_factory):
    """A predictor fitted by :func:`fit_predictor_file` on samples timed by :func:`collect_fixed_samples` (the YAML's
    workload and reference), as ``nas latency fit`` writes it."""
    raw, _, model = tiny
    spec = _spec(raw, latency_repeats=1)
    samples = collect_fixed_samples(model, spec, 6, space=SearchSpace.from_spec(spec), threads=1)
    reference = resolve_reference(spec, SearchSpace.from_spec(spec))
    assert [s["arch_id"] for s in samples if s["reference"]] == [reference.arch_id]
    path = tmp_path_factory.mktemp("pred") / "latency.safetensors"
    fit_predictor_file(samples, spec, path)
    return path, statistics.median(s["latency_reference_ms"] for s in samples)


def test_the_saved_predictor_is_fitted_on_every_sample_and_reports_a_held_out_fit_s_error(tiny, tmp_path):
    """fit_predictor_file: the error it reports is that of a fit on 80% of the samples, scored on the other 20%; the
    predictor it saves is fitted on all of them (before, the saved one was the 80% fit: a fifth of the timed samples
    went to the report only)."""
    import random

    raw, _, _ = tiny
    spec = _spec(raw)
    space = SearchSpace.from_spec(spec)
    rng = random.Random(0)
    samples = []
    for _ in range(20):  # a ratio linear in the widths and the decoder's depth, with 3% noise
        arch = space.sample(rng)
        ratio = (1 + 0.01 * sum(arch.encoder.width) + 0.2 * arch.decoder.layers) * (1 + rng.gauss(0.0, 0.03))
        samples.append({"arch": arch.to_dict(), "latency_ratio": ratio, "latency_reference_ms": 10.0,
                        "workload": workload_of(spec.search)})
    path = tmp_path / "latency.safetensors"
    metrics = fit_predictor_file(samples, spec, path)
    partial = LatencyPredictor(spec.supernet.model_dim, workload=workload_of(spec.search))
    held_out = partial.fit(samples, seed=0)  # holds out 20%
    full = LatencyPredictor(spec.supernet.model_dim, workload=workload_of(spec.search))
    full.fit(samples, seed=0, holdout=0.0)
    assert {k: v for k, v in metrics.items() if not k.startswith("cv_")} == {
        "rmse_ratio": held_out["rmse_ratio"], "mape": held_out["mape"], "holdout_samples": 4.0,
        "heldout_fit_samples": 16.0, "train_samples": 20.0}
    assert metrics["cv_samples"] == 20.0  # and its cross-validated error (tests/search/test_latency_margin.py)
    saved = LatencyPredictor.load(path)
    assert saved.metrics == metrics
    fresh = [space.sample(rng) for _ in range(10)]
    assert [saved.predict_ratio(a) for a in fresh] == pytest.approx([full.predict_ratio(a) for a in fresh], rel=1e-6)
    assert [saved.predict_ratio(a) for a in fresh] != pytest.approx([partial.predict_ratio(a) for a in fresh], rel=1e-6)


def test_predicted_latency_ratio_divides_by_the_predictor_s_reference(tiny, predictor_file, monkeypatch):
    raw, data, model = tiny
    path, reference_ms = predictor_file
    monkeypatch.setattr(ratio_module, "interleaved_timings", lambda *a, **k: pytest.fail("predicted: nothing timed"))
    spec = _spec(raw, latency="predicted", latency_predictor=str(path))
    arch = SearchSpace.from_spec(spec).widest()
    metrics = score_arch(model, arch, spec, data)
    assert metrics["latency_reference_ms"] == reference_ms  # the median of the samples' interleaved reference runs
    assert metrics["latency_ratio"] == pytest.approx(LatencyPredictor.load(path).predict_ratio(arch))
    assert metrics["latency_ms"] == pytest.approx(metrics["latency_ratio"] * reference_ms)
    assert json.loads(path.with_suffix(".json").read_text())["workload"] == workload_of(spec.search)


def test_a_predictor_of_another_workload_or_reference_is_refused(tiny, predictor_file, tmp_path):
    raw, data, model = tiny
    path, _ = predictor_file
    arch = SearchSpace.from_spec(_spec(raw)).widest()
    other = _spec(raw, latency="predicted", latency_predictor=str(path),
                  latency_workload={"src_tokens": 8, "tgt_tokens": 30})
    with pytest.raises(NasError, match=r"was fitted on latency workload src8-tgt6-beam2-batch1, but "
                                       r"search.latency_workload is src8-tgt30-beam2-batch1 \(tgt_tokens 6 vs 30\)"):
        score_arch(model, arch, other, data)
    widest = _spec(raw, latency="predicted", latency_predictor=str(path), latency_reference="widest")
    with pytest.raises(NasError, match=r"measured the reference .* but search.latency_reference: widest is"):
        score_arch(model, arch, widest, data)
    file = tmp_path / "other.yaml"  # and before anything runs, when the YAML is loaded
    file.write_text(yaml.safe_dump({**raw, "search": {**raw["search"], "latency": "predicted",
                                                      "latency_predictor": str(path), "beam_size": 4}}))
    with pytest.raises(SpecError, match=r"search.latency_predictor: .* predicts latency workload src8-tgt6-beam2-batch1,"
                                        r" but trials time search.latency_workload src8-tgt6-beam4-batch1"):
        load_spec(file)


def test_the_workload_tag_names_every_field_with_beam_from_beam_size(tiny):
    raw, _, _ = tiny
    assert workload_tag(workload_of(_spec(raw).search)) == "src8-tgt6-beam2-batch1"
    spec = _spec(raw, latency_workload={"beam": 5, "batch": 3})
    assert workload_of(spec.search) == {"src_tokens": 30, "tgt_tokens": 30, "beam": 5, "batch": 3}


def test_a_trial_s_line_shows_the_measured_ratio_and_level_1_s_prediction_beside_it():
    from nas.search.callbacks import _latency_text

    measured = {"latency_ratio": 1.12, "latency_ms": 76.54}
    assert _latency_text(measured) == "latency 1.12x the reference, 76.5 ms"
    predicted = {**measured, "latency_ratio_pred": 1.08, "latency_drift": 0.0357}
    assert _latency_text(predicted) == "latency 1.12x the reference (predicted 1.08x, 4% off), 76.5 ms"
    spread = {**predicted, "latency_ratio_iqr": 0.021}
    assert _latency_text(spread) == "latency 1.12x the reference (predicted 1.08x, 4% off; rounds' IQR 2%), 76.5 ms"
    alone = {**measured, "latency_ratio_iqr": 0.1}
    assert _latency_text(alone) == "latency 1.12x the reference (rounds' IQR 10%), 76.5 ms"


@pytest.mark.filterwarnings("ignore:.*latency predictor drift")  # the fake timings are far from the prediction
def test_score_arch_reports_level_1_s_predicted_ratio_beside_the_measured_one(tiny, predictor_file, fake_timings):
    raw, data, model = tiny
    path, _ = predictor_file
    spec = _spec(raw)  # no search.latency_predictor: the predictor level 1 fitted in this sweep
    arch = SearchSpace.from_spec(spec).widest()
    metrics = score_arch(model, arch, spec, data, level1_predictor=path)
    assert metrics["latency_ratio"] == pytest.approx(14.0 / 11.0)  # measured (the fake timings)
    assert metrics["latency_ratio_pred"] == pytest.approx(LatencyPredictor.load(path).predict_ratio(arch))
    assert metrics["latency_drift"] == pytest.approx(abs(metrics["latency_ratio_pred"] - metrics["latency_ratio"])
                                                     / metrics["latency_ratio"])
    assert "latency_ratio_pred" not in score_arch(model, arch, spec, data)  # without one, no prediction
