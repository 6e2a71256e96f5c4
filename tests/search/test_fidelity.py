"""Ranking fidelity (nas.search.fidelity, `nas fidelity`): the spread of archs, the rank correlation, fresh standalone
models, and a tiny end-to-end run through the CLI that is resumed without retraining."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import yaml

from nas.search.fidelity import rank_correlation, spread_archs, standalone_model
from nas.model.supernet import count_params, extract
from nas.space.space import SearchSpace
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict


@pytest.fixture(autouse=True)
def _restore_threads():
    """The tiny sweeps set ``train.threads: 1`` (on a loaded 2-core machine, 10x faster than contending threads);
    torch's thread count is process-wide, so it is put back for the tests that follow."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(spec, freshly initialised supernet, space) of the tiny sweep; nothing trained."""
    from nas.builders import build_supernet

    work = tmp_path_factory.mktemp("fidelity_space")
    spec = parse_spec(tiny_spec_dict(work, work), "tiny")
    torch.manual_seed(1234)  # not the standalone models' seed: their weights must differ from these
    return spec, build_supernet(spec, 400), SearchSpace.from_spec(spec)


def test_spread_archs_holds_both_ends_k_distinct_archs_sorted_and_spread_by_params(tiny):
    _, supernet, space = tiny
    params = lambda arch: count_params(extract(supernet, arch))  # noqa: E731
    k = 6
    archs = spread_archs(space, k, params, seed=3, samples=64)
    ids = [a.arch_id for a in archs]
    counts = [params(a) for a in archs]
    assert len(set(ids)) == k
    assert ids[0] == space.narrowest().arch_id and ids[-1] == space.widest().arch_id
    assert counts == sorted(counts)
    # spread in count, not clustered in the middle: no gap above twice the even spacing
    even = (counts[-1] - counts[0]) / (k - 1)
    assert max(b - a for a, b in zip(counts, counts[1:])) <= 2 * even
    assert [a.arch_id for a in spread_archs(space, k, params, seed=3, samples=64)] == ids  # deterministic


def test_spread_archs_picks_the_candidate_nearest_each_evenly_spaced_target(tiny):
    _, _, space = tiny
    rng = random.Random(0)
    pool = {a.arch_id: a for a in [space.narrowest(), space.widest(), *(space.sample(rng) for _ in range(40))]}
    fake = {arch_id: i * 10 for i, arch_id in enumerate(sorted(pool))}  # any injective count works
    fake[space.narrowest().arch_id], fake[space.widest().arch_id] = -1000, 10_000
    archs = spread_archs(space, 3, lambda a: fake[a.arch_id], seed=0, samples=40)
    middle = min((a for a in pool if fake[a] not in (-1000, 10_000)), key=lambda a: abs(fake[a] - 4500))
    assert [a.arch_id for a in archs] == [space.narrowest().arch_id, middle, space.widest().arch_id]


def test_spread_archs_rejects_k_below_two_and_more_than_the_distinct_candidates(tiny):
    _, supernet, space = tiny
    params = lambda arch: count_params(extract(supernet, arch))  # noqa: E731
    with pytest.raises(ValueError, match="k=1"):
        spread_archs(space, 1, params)
    with pytest.raises(ValueError, match="k=50 but only .* distinct"):
        spread_archs(space, 50, params, samples=3)


def test_rank_correlation_matches_hand_computed_tau_and_rho():
    # one discordant pair (2, 3) of 6: tau = (5 - 1) / 6; d = (0, 1, 1, 0): rho = 1 - 6 * 2 / (4 * 15)
    c = rank_correlation([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0])
    assert c.kendall_tau == pytest.approx(2 / 3)
    assert c.spearman_rho == pytest.approx(0.8)
    reverse = rank_correlation([1, 2, 3, 4, 5], [5, 4, 3, 2, 1])
    assert reverse.kendall_tau == pytest.approx(-1.0) and reverse.spearman_rho == pytest.approx(-1.0)
    assert math.isnan(rank_correlation([1, 2, 3], [7, 7, 7]).kendall_tau)  # constant: undefined, no warning
    with pytest.raises(ValueError, match="3 inherited scores but 2"):
        rank_correlation([1, 2, 3], [1, 2])


def test_standalone_model_has_the_extracted_shapes_but_fresh_weights(tiny):
    _, supernet, space = tiny
    arch = space.middle()
    inherited = extract(supernet, arch).state_dict()
    fresh = standalone_model(supernet, arch, seed=0).state_dict()
    assert {k: v.shape for k, v in fresh.items()} == {k: v.shape for k, v in inherited.items()}
    for name in ("embed.weight", "encoder.0.attn.w_in", "decoder.0.ffn.w1"):
        assert not torch.equal(fresh[name], inherited[name]), f"{name} was inherited"
    again = standalone_model(supernet, arch, seed=0).state_dict()
    assert all(torch.equal(fresh[k], again[k]) for k in fresh)  # seeded


def _tiny_trained(multi30k, work):
    """A tiny sweep YAML (fp32, max_tokens 128, 4 validation sentences, greedy scoring) whose supernet is trained
    for 4 steps in place: untrained models translate up to the length limit, so scoring dominates the time."""
    from nas.builders import prepare_sweep_data
    from trainers import train_supernet

    raw = tiny_spec_dict(multi30k, work, **{"train.steps": 4, "train.max_tokens": 128, "train.precision": "fp32",
                                             "train.stage_eval": False, "train.keep_last": 0, "train.eval_beam_size": 1,
                                             "train.threads": 1,
                                             "data.max_valid_pairs": 4, "search.beam_size": 1})
    spec = parse_spec(raw, "tiny")
    train_supernet(spec, prepare_sweep_data(spec, progress=False), spec.run_dir / "supernet", progress=False)
    path = work / "tiny.yaml"
    path.write_text("# nas sweep tiny.yaml\n" + yaml.safe_dump(raw))
    return path, spec


def test_fidelity_cli_reports_logs_to_mlflow_and_reuses_trained_archs(multi30k, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from nas import tracking
    from nas.cli import app

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec_file, spec = _tiny_trained(multi30k, tmp_path)
    out = tmp_path / "fid"
    args = ["fidelity", str(spec_file), "--k", "3", "--steps", "3", "--metric", "valid_loss", "--out", str(out)]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    text = " ".join(first.output.split())
    assert "Kendall tau" in text and "Spearman rho" in text and "3 trained now" in text
    assert "fidelity 1/3 " in text and "fidelity 3/3 " in text and "stored)" not in text  # one line per arch

    summary = json.loads((out / "fidelity.json").read_text())
    assert summary["k"] == 3 and summary["steps"] == 3 and summary["metric"] == "valid_loss"
    assert len(summary["archs"]) == 3
    params = [r["params_m"] for r in summary["archs"]]
    assert params == sorted(params)
    for r in summary["archs"]:
        assert math.isfinite(r["inherited"]["valid_loss"]) and math.isfinite(r["standalone"]["valid_loss"])
    tau = summary["kendall_tau"]
    assert math.isnan(tau) or -1.0 <= tau <= 1.0
    assert summary["untrusted"] == (not tau >= 0.5)
    if summary["untrusted"]:
        assert "warning" in text

    (run,) = tracking.find_runs(spec.experiment, role="fidelity")
    assert set(run.data.metrics) >= {"kendall_tau", "spearman_rho"}
    assert run.data.params["k"] == "3" and run.data.params["steps"] == "3" and run.data.params["metric"] == "valid_loss"
    assert ("nas.fidelity_warning" in run.data.tags) == summary["untrusted"]
    artifacts = {a.path for a in tracking.get_client().list_artifacts(run.info.run_id)}
    assert {"fidelity.png", "fidelity_table.json"} <= artifacts
    assert (out / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    files = sorted(out.glob("arch_*.json"))
    assert len(files) == 3
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "0 trained now" in " ".join(second.output.split())
    assert " ".join(second.output.split()).count("s of training, stored)") == 3
    assert {f: f.stat().st_mtime_ns for f in files} == mtimes  # read back, not retrained or rewritten
    again = json.loads((out / "fidelity.json").read_text())
    assert again["archs"] == summary["archs"]


def test_fidelity_cli_without_a_trained_supernet_names_the_path_and_the_commands(multi30k, tmp_path):
    from typer.testing import CliRunner

    from nas.cli import app

    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(tiny_spec_dict(multi30k, tmp_path)))
    result = CliRunner().invoke(app, ["fidelity", str(spec_file), "--k", "3"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2
    assert "supernet.safetensors" in text and "nas train" in text and "nas sweep" in text
    bad = CliRunner().invoke(app, ["fidelity", str(spec_file), "--metric", "chrf"])
    assert bad.exit_code == 2 and "bleu | valid_loss" in bad.output
