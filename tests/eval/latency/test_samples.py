"""The predictor's dataset (:mod:`nas.eval.latency.samples`): real measurements of extracted models on the workload
with the reference, and ``nas latency fit``'s failures before it measures."""

from __future__ import annotations

import json
import math

from nas.eval.latency import collect_samples
from tests.eval.latency.conftest import deep_and_shallow


def test_collect_samples_times_real_extracted_models_on_the_workload_with_the_reference():
    # widest 2+3 layers, narrowest 1+1: about twice as slow. With tiny_supernet's (2+1 against 1+1, the decoder the
    # same) the widest read 0.89x the narrowest once beside the other xdist worker on 2 cores
    space, supernet = deep_and_shallow()
    workload = {"src_tokens": 6, "tgt_tokens": 5, "beam": 2, "batch": 1}
    samples = collect_samples(supernet, space, 3, workload=workload, seed=0, rounds=9, warmup=1, threads=1,
                              progress=False)
    assert len(samples) == 3 and len({s["arch_id"] for s in samples}) == 3
    assert samples[0]["arch"] == space.widest().to_dict() and samples[1]["arch"] == space.narrowest().to_dict()
    assert [s["reference"] for s in samples] == [False, True, False]  # default reference: the narrowest
    assert all(math.isfinite(s[k]) and s[k] > 0 for s in samples
               for k in ("latency_ms", "latency_reference_ms", "latency_ratio"))
    # each arch against the reference timed interleaved with it: the widest is slower, the reference about itself
    # (9 rounds: with 3, the reference read 0.64x itself once, beside 3 other test processes on 2 cores)
    assert samples[0]["latency_ratio"] > 1.0 and 0.7 < samples[1]["latency_ratio"] < 1.4
    assert all(s["workload"] == workload and (s["batch_size"], s["beam_size"]) == (1, 2) for s in samples)
    assert all("(1 thread)" in s["device"] for s in samples)
    json.dumps(samples)  # JSON-ready for `nas latency fit`'s samples file
    middle = space.middle()
    assert middle.arch_id not in {s["arch_id"] for s in samples}
    more = collect_samples(supernet, space, 3, workload=workload, reference=middle, seed=0, rounds=1, warmup=0,
                           threads=1, progress=False)
    assert len(more) == 4 and [s["arch_id"] for s in more if s["reference"]] == [middle.arch_id]


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
