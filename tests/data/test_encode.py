"""nas.data.encode: a preparation's shards, encoded in this process or in worker processes, and resumed from
the finished ones after a kill (issue 16)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nas.data.cache as cache_module
import nas.data.encode as encode_module
from nas import faults
from nas.data import PreparedData, Tokenizer, prepare_data
from tests.conftest import REPO
from tests.data.conftest import SMALL


def _pieces(data: PreparedData) -> list[tuple[str, float]]:
    """The tokenizer's pieces and scores (its file also names the folder it was trained in)."""
    sp = data.tokenizer()._sp
    return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]


def _prepare_script(files: list[Path], cache: Path, tmp_path: Path, *, kill_after: int | None = None,
                    workers: bool = False) -> subprocess.CompletedProcess:
    """Run a preparation (1000 pairs, shards of 200) as a script file without a ``__main__`` guard."""
    script = tmp_path / "prepare.py"
    script.write_text(
        "import nas.data.cache as c\n"
        "import nas.data.encode as e\n"
        "c._SHARD_PAIRS = 200\n"
        + ("e._POOL_MIN_PAIRS = 0\ne._cpus = lambda: 2\n" if workers else "")
        + f"c.prepare_data(*{[str(f) for f in files]!r}, vocab_size=400, cache_dir={str(cache)!r}, "
          f"max_train_pairs=1000, max_valid_pairs=20, progress=False)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), faults.KILL_LOG_ENV: str(tmp_path / "kills.log")}
    if kill_after:
        env[faults.KILL_ENV] = f"data_prepare:{kill_after}"
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)


def _encoding_workers(work: Path) -> list[int]:
    """Pids of live encoding workers of the work folder ``work``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.name.isdigit() and str(work).encode() in cmdline and any(b"serve_encoding" in c for c in cmdline):
            pids.append(int(entry.name))
    return pids


def test_a_killed_preparation_resumes_from_its_finished_shards(files, prepared, tmp_path, monkeypatch):
    """Killed after 2 of 5 shards: the rerun trains no tokenizer, encodes only shards 2-4 and gives what an
    uninterrupted run gives (with any shard size)."""
    cache = tmp_path / "cache"
    proc = _prepare_script(files, cache, tmp_path, kill_after=2)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (work,) = cache.glob("*.work")
    assert sorted(p.name for p in work.iterdir()) == ["plan.json", "shard-00000.arrow", "shard-00001.arrow",
                                                     "spm.model", "spm.vocab"]
    assert json.loads((work / "plan.json").read_text())["shard_pairs"] == 200
    kept = {p.name: p.stat().st_mtime_ns for p in work.iterdir()}

    encoded = []
    real_encode = encode_module.encode_pairs
    monkeypatch.setattr(cache_module, "_SHARD_PAIRS", 50)  # ignored on resume: the plan says 200
    monkeypatch.setattr(encode_module, "encode_pairs", lambda *a: encoded.append(len(a[1])) or real_encode(*a))
    monkeypatch.setattr(Tokenizer, "train", lambda *a, **k: pytest.fail("the tokenizer was retrained"))
    original_write = encode_module.write_shard
    rewritten = []
    monkeypatch.setattr(encode_module, "write_shard",
                        lambda w, shard, table: rewritten.append(shard) or original_write(w, shard, table))

    def check_work_folder(*args):  # before publication: the finished shards were not touched
        assert {p.name: p.stat().st_mtime_ns for p in work.iterdir() if p.name in kept} == kept
        return real_assemble(*args)

    real_assemble = cache_module._assemble
    monkeypatch.setattr(cache_module, "_assemble", check_work_folder)
    resumed = prepare_data(*files, vocab_size=400, cache_dir=cache, **SMALL)
    assert rewritten == [2, 3, 4] and encoded == [200, 200, 200]
    assert not work.exists() and sorted(p.name for p in cache.iterdir()) == [resumed.root.name,
                                                                              f"{resumed.root.name}.lock"]
    assert resumed.root.name == prepared.root.name  # same files, same settings: the same entry
    assert _pieces(resumed) == _pieces(prepared)
    assert resumed.load_split("train") == prepared.load_split("train")
    assert resumed.load_split("valid") == prepared.load_split("valid")
    assert resumed.valid_text() == prepared.valid_text()
    done = json.loads((resumed.root / "DONE").read_text())
    assert done["train_pairs"] + done["train_dropped"] == 1000 and done["shards"] == 5
    assert json.loads((prepared.root / "DONE").read_text())["shards"] == 1


def test_encoding_in_worker_processes_equals_encoding_in_one(files, prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(encode_module, "_POOL_MIN_PAIRS", 0)
    monkeypatch.setattr(cache_module, "_SHARD_PAIRS", 150)
    monkeypatch.setattr(encode_module, "_cpus", lambda: 3)
    pooled = prepare_data(*files, vocab_size=400, cache_dir=tmp_path, **SMALL)
    assert json.loads((pooled.root / "DONE").read_text())["shards"] == 7
    assert pooled.load_split("train") == prepared.load_split("train")
    assert _pieces(pooled) == _pieces(prepared)


def test_a_kill_with_encoding_workers_leaves_none_behind_and_resumes(files, prepared, tmp_path):
    """Workers are plain subprocesses that die with the preparation (and a script without a ``__main__`` guard
    does not start one preparation per worker, each waiting for the lock forever)."""
    cache = tmp_path / "cache"
    proc = _prepare_script(files, cache, tmp_path, kill_after=2, workers=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (work,) = cache.glob("*.work")
    for _ in range(50):
        if not _encoding_workers(work):
            break
        time.sleep(0.1)
    assert not _encoding_workers(work), "an encoding worker outlived its killed preparation"
    assert len(list(work.glob("shard-*.arrow"))) >= 2
    proc = _prepare_script(files, cache, tmp_path, workers=True)
    assert proc.returncode == 0, proc.stderr
    (root,) = [p for p in cache.iterdir() if p.is_dir()]
    resumed = prepare_data(*files, vocab_size=400, cache_dir=cache, **SMALL)  # reuses the finished entry
    assert resumed.root == root == cache / prepared.root.name
    assert resumed.load_split("train") == prepared.load_split("train")
