"""Fixtures of the export tests: a small tokenizer, and a sweep's trial runs written into a real MLflow store."""

from __future__ import annotations

import pytest

from nas.data import Tokenizer, read_lines
from nas.model import SuperTransformer
from nas.model.io import save_model
from nas.space.arch import Arch, StackArch


@pytest.fixture(scope="session")
def tokenizer(multi30k, tmp_path_factory) -> Tokenizer:
    """A SentencePiece model (vocabulary 300) of 500 English and 500 German Multi30k lines; read-only."""
    lines = read_lines(multi30k / "train.en.gz", limit=500) + read_lines(multi30k / "train.de.gz", limit=500)
    return Tokenizer.train(lines, tmp_path_factory.mktemp("spm") / "spm", vocab_size=300)


@pytest.fixture
def constrained_trials(tokenizer, tmp_path, mlflow_uri):
    """A real supernet and SentencePiece model on disk, and sweep C under ``latency_ms<=30`` in a real MLflow
    store with two trial runs as `nas sweep` leaves them (tags naming the supernet and data folders, arch.json):
    the wide one has the better BLEU but breaks the constraint, the narrow one meets it."""
    from nas import tracking

    maxima = Arch(StackArch((32, 32), (64, 64), (2, 2)), StackArch((32, 32), (64, 64), (2, 2)))
    save_model(SuperTransformer(tokenizer.vocab_size, 32, 2, maxima, max_positions=128), tmp_path / "sn", "supernet")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "spm.model").write_bytes(tokenizer.model_path.read_bytes())
    narrow = Arch(StackArch((16,), (32,), (1,)), StackArch((16,), (32,), (1,)))
    tags = {"nas.supernet_dir": str(tmp_path / "sn"), "nas.data_dir": str(tmp_path / "data"), "nas.beam_size": "2"}

    def sweep(experiment: str, sweep_id: str, trials: dict) -> dict[str, str]:
        parent = tracking.start_run(experiment, sweep_id, role="sweep", tags={"nas.sweep_id": sweep_id},
                                    params={tracking.PARAM_CONSTRAINTS: "latency_ms<=30"})
        ids = {}
        for name, (arch, metrics) in trials.items():
            ids[name] = tracking.start_run(experiment, name, role="trial", parent_run_id=parent,
                                           tags={**tags, "nas.arch_summary": arch.summary()})
            tracking.log_metrics(ids[name], metrics)
            tracking.log_json_artifact(ids[name], arch.to_dict(), "arch.json")
            tracking.end_run(ids[name])
        tracking.end_run(parent)
        return ids

    ids = sweep("constrained", "C", {"wide": (maxima, {"bleu": 25.0, "latency_ms": 45.0}),
                                     "narrow": (narrow, {"bleu": 20.0, "latency_ms": 12.0})})
    ids.update(sweep("all-slow", "S", {"slow": (maxima, {"bleu": 25.0, "latency_ms": 45.0})}))
    return ids, maxima, narrow
