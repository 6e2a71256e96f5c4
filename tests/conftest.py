"""Shared fixtures: the real Multi30k files and tiny sweep specs built on a slice of them."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


@pytest.fixture(scope="session")
def multi30k() -> Path:
    if not (MULTI30K / "train.en.gz").is_file():
        pytest.fail(f"Multi30k not found at {MULTI30K}; the tests read the shared data beside the repository")
    return MULTI30K


def tiny_spec_dict(data_dir: Path, work: Path, **overrides) -> dict:
    """A sweep small enough for seconds on 2 CPU cores: 300 training pairs, C=32, 2+2 layers."""
    spec = {
        "name": "tiny",
        "data": {
            "train": {"src": str(data_dir / "train.en.gz"), "tgt": str(data_dir / "train.de.gz")},
            "valid": {"src": str(data_dir / "val.en.gz"), "tgt": str(data_dir / "val.de.gz")},
            "tokenizer": {"vocab_size": 400},
            "max_train_pairs": 300,
            "max_valid_pairs": 12,
            "cache_dir": str(work / "data"),
        },
        "supernet": {"model_dim": 32, "heads": 2, "encoder_layers": 2, "decoder_layers": 2, "ffn_width": 64,
                     "branches": 2, "max_positions": 128},
        "space": {"encoder_layers": {"values": [1, 2]}, "width": {"values": [16, 32], "per_layer": True},
                  "ffn_width": {"values": [32, 64]}, "branches": {"values": [1, 2], "per_layer": True}},
        "train": {"steps": 8, "max_tokens": 512, "warmup_steps": 4, "checkpoint_every": 4, "log_every": 2,
                  "eval_beam_size": 2, "lr": 2e-3},
        "search": {"trials": 2, "max_concurrent": 2, "beam_size": 2, "latency_sentences": 2},
        "resources": {"cpu": 1},
        "workdir": str(work / "runs"),
    }
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if field:
            spec[section][field] = value
        else:
            spec[section] = value
    return spec
