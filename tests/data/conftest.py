"""Fixtures of the nas.data tests: the Multi30k files and one small prepared cache entry shared by the modules
that only read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from nas.data import PreparedData, prepare_data

SMALL = {"max_train_pairs": 1000, "max_valid_pairs": 20, "progress": False}
"""The settings of the shared :func:`prepared` entry (with ``vocab_size=400``)."""


@pytest.fixture(scope="session")
def files(multi30k: Path) -> list[Path]:
    """Multi30k's train.en, train.de, val.en, val.de beside the repository (conftest's ``multi30k`` fails,
    never skips, when they are missing)."""
    return [multi30k / name for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz")]


@pytest.fixture(scope="session")
def prepared(files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    """1000 training pairs, 20 validation pairs, vocabulary 400; read-only (no test writes into its cache
    folder). ``test_cache.py`` and ``test_tokenizer.py`` override it with a larger entry of their own."""
    return prepare_data(*files, vocab_size=400, cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)
