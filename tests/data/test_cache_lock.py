"""nas.data.cache: the data cache's lock per entry (issue 15): one preparation of an entry at a time, the second
waits and reuses it; leftovers of killed preparations are removed, folders of running ones are kept."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from nas.data import prepare_data
from tests.test_locks import held

SETTINGS = {"vocab_size": 300, "max_train_pairs": 500, "max_valid_pairs": 20, "progress": False}


@pytest.fixture
def entry(files: list[Path], tmp_path: Path) -> Path:
    """A cache entry's folder, prepared once then moved to ``<tmp>/done`` (its place in the cache is empty)."""
    root = prepare_data(*files, cache_dir=tmp_path / "cache", **SETTINGS).root
    shutil.move(root, tmp_path / "done")
    return root


def _tmp_folder(cache: Path, key: str, suffix: str) -> Path:
    folder = cache / f"{key}.tmp-{suffix}"
    folder.mkdir()
    (folder / "spm.model").write_bytes(b"half written")
    return folder


def test_leftovers_of_killed_preparations_are_removed_by_the_next_one(files, entry, tmp_path):
    """Before: a ``*.tmp-*`` folder of a killed preparation stayed in the cache forever."""
    cache = entry.parent
    mine, other = _tmp_folder(cache, entry.name, "killed"), _tmp_folder(cache, "0123456789abcdef", "killed")
    data = prepare_data(*files, cache_dir=cache, **SETTINGS)
    assert data.root == entry and (entry / "DONE").is_file()
    assert not mine.exists() and not other.exists()
    assert not list(cache.glob("*.tmp-*"))


def test_the_folder_of_a_running_preparation_is_kept(files, entry, tmp_path):
    cache = entry.parent
    running = _tmp_folder(cache, "0123456789abcdef", "running")
    with held(cache / "0123456789abcdef.lock"):  # that preparation holds its entry's lock
        prepare_data(*files, cache_dir=cache, **SETTINGS)
        assert (running / "spm.model").read_bytes() == b"half written"


def test_a_second_preparation_waits_for_the_first_and_reuses_its_result(files, entry, tmp_path):
    """Before: both prepared the same entry at once (twice the work; the loser's rename failed)."""
    cache = entry.parent
    result: list = []
    with held(cache / f"{entry.name}.lock"):  # the first preparation, still running
        waiter = threading.Thread(target=lambda: result.append(prepare_data(*files, cache_dir=cache, **SETTINGS)))
        waiter.start()
        time.sleep(2.0)
        assert waiter.is_alive() and not result, "the second preparation did not wait"
        assert not list(cache.glob(f"{entry.name}.tmp-*")), "the second preparation started building"
        shutil.copytree(tmp_path / "done", entry)  # the first one publishes ...
        (entry / "built-by-the-first").touch()
    waiter.join(timeout=60)  # ... and exits, releasing the lock
    assert result and result[0].root == entry
    assert (entry / "built-by-the-first").exists()
