"""The WMT-scale data path of nas.data (issue 16): memory-mapped token ids, the numpy batcher, streaming and
resumable preparation.

The batcher and ``collate`` are checked against a transcription of the list-based code they replaced
(:class:`OldBatcher`, :func:`old_collate`): the batches must stay the same, so that runs resume identically.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest
import torch

import nas.data as data_module
from nas import faults
from nas.data import BOS_ID, EOS_ID, PAD_ID, DataError, PreparedData, TokenBatcher, TokenCorpus, collate, prepare_data
from tests.conftest import REPO

SMALL = {"max_train_pairs": 1000, "max_valid_pairs": 20, "progress": False}


@pytest.fixture(scope="module")
def files(multi30k: Path) -> list[Path]:
    return [multi30k / name for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz")]


@pytest.fixture(scope="module")
def prepared(files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    return prepare_data(*files, vocab_size=400, cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)


# --------------------------------------------------------------------------- the replaced code, as it was


class OldBatcher:
    """The list-based ``TokenBatcher`` before issue 16, copied (the reference the numpy one must equal)."""

    def __init__(self, src_ids, tgt_ids, max_tokens, *, shuffle=True, seed=0):
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self._batches = self._cut(self._sorted_indices())

    def _sorted_indices(self):
        order = list(range(len(self.src_ids)))
        if self.shuffle:
            random.Random(self.seed).shuffle(order)
        return sorted(order, key=lambda i: (len(self.src_ids[i]), len(self.tgt_ids[i])))

    def _cut(self, order):
        batches, current, longest = [], [], 0
        for i in order:
            length = max(len(self.src_ids[i]), len(self.tgt_ids[i])) + 1
            if current and (len(current) + 1) * max(longest, length) > self.max_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, length)
        if current:
            batches.append(current)
        return batches

    def epoch(self, epoch):
        batches = [list(b) for b in self._batches]
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(batches)
        return batches


def _old_pad(rows):
    out = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def old_collate(src_ids, tgt_ids):
    """``collate`` before issue 16: (src, tgt_in, tgt_out, ntokens), padded row by row."""
    tgt_out = _old_pad([list(t) + [EOS_ID] for t in tgt_ids])
    return (_old_pad([list(s) + [EOS_ID] for s in src_ids]), _old_pad([[BOS_ID] + list(t) for t in tgt_ids]),
            tgt_out, int((tgt_out != PAD_ID).sum()))


def _random_pairs(n: int, seed: int, longest: int = 40, empty: bool = False):
    rng = random.Random(seed)
    low = 0 if empty else 1
    src = [[rng.randrange(4, 500) for _ in range(rng.randint(low, longest))] for _ in range(n)]
    tgt = [[rng.randrange(4, 500) for _ in range(rng.randint(low, longest))] for _ in range(n)]
    src += [list(range(4, 300)), [7]]  # longer than every max_tokens below: a batch of its own
    tgt += [[5, 6], list(range(4, 200))]
    return src, tgt


def _assert_batch_equal(batch, old) -> None:
    for new, ref in zip((batch.src, batch.tgt_in, batch.tgt_out), old[:3]):
        assert new.dtype == torch.int64 and torch.equal(new, ref)
    assert batch.ntokens == old[3]


# --------------------------------------------------------------------------- batches and collate


@pytest.mark.parametrize("max_tokens", [8, 64, 512, 4096])
@pytest.mark.parametrize("shuffle, seed", [(True, 0), (True, 7), (False, 0)])
def test_batches_equal_the_list_batcher_on_random_lengths(max_tokens, shuffle, seed):
    src, tgt = _random_pairs(3000, seed=max_tokens + seed, empty=True)
    new = TokenBatcher(src, tgt, max_tokens, shuffle=shuffle, seed=seed)
    old = OldBatcher(src, tgt, max_tokens, shuffle=shuffle, seed=seed)
    assert len(new) == len(old._batches)
    for epoch in (0, 1, 5):
        assert new.epoch(epoch) == old.epoch(epoch)


@pytest.mark.parametrize("max_tokens", [64, 512, 4096])
def test_batches_of_the_mapped_corpus_equal_the_list_batcher_on_multi30k(prepared, max_tokens):
    src, tgt = prepared.load_split("train")
    old = OldBatcher(src, tgt, max_tokens, shuffle=True, seed=3)
    new = TokenBatcher(prepared.corpus("train"), max_tokens, shuffle=True, seed=3)
    assert len(new) == len(old._batches) > 1
    for epoch in (0, 2):
        assert new.epoch(epoch) == old.epoch(epoch)
    for k, (batch, rows) in enumerate(zip(new.batches(1), old.epoch(1))):
        _assert_batch_equal(batch, old_collate([src[i] for i in rows], [tgt[i] for i in rows]))
        if k == 20:
            break


def test_collate_equals_the_row_by_row_padding():
    src, tgt = _random_pairs(200, seed=1, longest=12, empty=True)
    for lo, hi in [(0, 1), (0, 200), (17, 60), (200, 202), (5, 6)]:
        _assert_batch_equal(collate(src[lo:hi], tgt[lo:hi]), old_collate(src[lo:hi], tgt[lo:hi]))
    corpus = TokenCorpus.from_lists(src, tgt)
    rows = [199, 3, 3, 150, 0]
    _assert_batch_equal(corpus.collate(rows), old_collate([src[i] for i in rows], [tgt[i] for i in rows]))
    assert collate([[]], [[]]).src.tolist() == [[EOS_ID]]
    with pytest.raises(ValueError, match="non-empty"):
        corpus.collate([])


def test_rank_shards_of_a_corpus_batch_are_the_rows_rank_to_world(prepared):
    from trainers.distributed import shard

    src, tgt = prepared.load_split("train")
    batch = next(TokenBatcher(prepared.corpus("train"), 512, seed=1).batches(0))
    rows = TokenBatcher(src, tgt, 512, seed=1).epoch(0)[0]
    whole = old_collate([src[i] for i in rows], [tgt[i] for i in rows])
    for rank in range(3):
        part = shard(batch, rank, 3)
        assert torch.equal(part.src, whole[0][rank::3]) and torch.equal(part.tgt_out, whole[2][rank::3])
        assert part.ntokens == int(whole[2][rank::3].ne(PAD_ID).sum())


def test_batcher_arguments_are_checked():
    corpus = TokenCorpus.from_lists([[4]], [[5]])
    assert TokenBatcher(corpus, 8).epoch(0) == TokenBatcher(corpus, max_tokens=8).epoch(0) == [[0]]
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBatcher(corpus, 7)
    with pytest.raises(TypeError, match="max_tokens"):
        TokenBatcher(corpus)
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        TokenBatcher([[4], [5]], [[6]], 64)


# --------------------------------------------------------------------------- the mapped corpus


def test_mapped_corpus_equals_the_lists_and_is_a_read_only_map_of_train_arrow(prepared):
    corpus = prepared.corpus("train")
    src, tgt = prepared.load_split("train")
    assert len(corpus) == len(src) > 900
    assert corpus.rows(range(len(corpus))) == (src, tgt)
    assert corpus.src[5] == src[5] and corpus.tgt[-1] == tgt[-1] and corpus.src[2:4] == src[2:4]
    assert corpus.src_lengths.tolist() == [len(s) for s in src]
    assert corpus.tgt_lengths.tolist() == [len(t) for t in tgt]
    assert corpus.src_values.dtype == np.int32 and not corpus.src_values.flags.writeable  # a view of the map
    assert corpus.src_offsets.dtype == np.int64 and not corpus.tgt_offsets.flags.writeable
    reader = pa.ipc.open_file(pa.memory_map(str(prepared.train_arrow)))
    assert reader.num_record_batches == 1
    assert reader.schema.field("src").type == pa.large_list(pa.int32())
    valid = prepared.corpus("valid")
    assert valid.rows(range(len(valid))) == prepared.load_split("valid")
    with pytest.raises(ValueError, match="test"):
        prepared.corpus("test")


def test_a_damaged_train_file_names_itself_and_the_fix(tmp_path):
    bad = tmp_path / "train.arrow"
    bad.write_bytes(b"not arrow")
    with pytest.raises(DataError, match=r"train\.arrow.*prepare again"):
        TokenCorpus.open(bad)


def test_opening_a_large_mapped_corpus_adds_little_anonymous_memory(tmp_path):
    """2M pairs, 160 MB of ids on disk: a process that maps them and touches every id holds its [n] lengths
    (16 MB), not a copy of the ids (RssAnon, Linux)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux)")
    code = """
import sys, numpy as np
from pathlib import Path
from nas.data import TokenCorpus, _write_token_file
def anon():
    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1]) // 1024
rows, width = 2_000_000, 10
out = Path(sys.argv[1])
sides = {}
for side in ('src', 'tgt'):
    ids, offs = out / f'{side}.ids', out / f'{side}.offsets'
    np.arange(rows * width, dtype=np.int32).tofile(ids)
    np.arange(0, rows * width + 1, width, dtype=np.int64).tofile(offs)
    sides[side] = (ids, offs)
_write_token_file(out / 'train.arrow', rows, sides)
for ids, offs in sides.values():
    ids.unlink(); offs.unlink()
before = anon()
corpus = TokenCorpus.open(out / 'train.arrow')
total = int(corpus.src_values.sum(dtype=np.int64)) + int(corpus.tgt_values.sum(dtype=np.int64))
assert len(corpus) == rows and corpus.src[rows - 1][-1] == rows * width - 1
print(anon() - before, (out / 'train.arrow').stat().st_size >> 20)
"""
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    grown_mib, file_mib = map(int, proc.stdout.split())
    assert file_mib >= 150
    assert grown_mib < 40, f"RssAnon grew by {grown_mib} MiB opening a {file_mib} MiB corpus"


# --------------------------------------------------------------------------- streaming, resumable preparation


def test_tokenizer_sample_is_uniform_seeded_and_all_pairs_when_few(files, monkeypatch):
    monkeypatch.setattr(data_module, "_SHARD_PAIRS", 128)
    keys = ("data.train.src", "data.train.tgt")
    few = data_module._scan_pairs(files[0], files[1], 300, keys, sample=500)
    assert few.pairs == 300 and few.src == data_module.read_lines(files[0], limit=300)
    assert few.tgt == data_module.read_lines(files[1], limit=300)
    picked = data_module._scan_pairs(files[0], files[1], 3000, keys, sample=200, seed=1)
    again = data_module._scan_pairs(files[0], files[1], 3000, keys, sample=200, seed=1)
    other = data_module._scan_pairs(files[0], files[1], 3000, keys, sample=200, seed=2)
    lines = data_module.read_lines(files[0], limit=3000)
    where = [lines.index(s) for s in picked.src]
    assert len(picked.src) == len(picked.tgt) == 200 and picked.pairs == 3000
    assert picked.src == again.src and picked.src != other.src
    assert where == sorted(where) and max(where) > 2500 and min(where) < 500  # spread over all 3000, in order
    assert sum(w >= 1500 for w in where) > 60


def test_misalignment_after_the_first_shard_fails_before_anything_is_written(files, tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "_SHARD_PAIRS", 50)
    src, tgt = tmp_path / "a.en", tmp_path / "a.de"
    src.write_text("a sentence\n" * 300)
    tgt.write_text("ein Satz\n" * 301)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="has 300 lines but .* has 301"):
        prepare_data(src, tgt, files[2], files[3], vocab_size=50, cache_dir=cache, max_train_pairs=100,
                     progress=False)
    assert not cache.exists()


def _pieces(data: PreparedData) -> list[tuple[str, float]]:
    """The tokenizer's pieces and scores (its file also names the folder it was trained in)."""
    sp = data.tokenizer()._sp
    return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]


def _prepare_script(files: list[Path], cache: Path, tmp_path: Path, *, kill_after: int | None = None,
                    workers: bool = False) -> subprocess.CompletedProcess:
    """Run a preparation (1000 pairs, shards of 200) as a script file without a ``__main__`` guard."""
    script = tmp_path / "prepare.py"
    script.write_text(
        "import nas.data as d\n"
        "d._SHARD_PAIRS = 200\n"
        + ("d._POOL_MIN_PAIRS = 0\nd._cpus = lambda: 2\n" if workers else "")
        + f"d.prepare_data(*{[str(f) for f in files]!r}, vocab_size=400, cache_dir={str(cache)!r}, "
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
        if entry.name.isdigit() and str(work).encode() in cmdline and any(b"_serve_encoding" in c for c in cmdline):
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
    real_encode = data_module.encode_pairs
    monkeypatch.setattr(data_module, "_SHARD_PAIRS", 50)  # ignored on resume: the plan says 200
    monkeypatch.setattr(data_module, "encode_pairs", lambda *a: encoded.append(len(a[1])) or real_encode(*a))
    monkeypatch.setattr(data_module.Tokenizer, "train", lambda *a, **k: pytest.fail("the tokenizer was retrained"))
    original_write = data_module.write_shard
    rewritten = []
    monkeypatch.setattr(data_module, "write_shard",
                        lambda w, shard, table: rewritten.append(shard) or original_write(w, shard, table))

    def check_work_folder(*args):  # before publication: the finished shards were not touched
        assert {p.name: p.stat().st_mtime_ns for p in work.iterdir() if p.name in kept} == kept
        return real_assemble(*args)

    real_assemble = data_module._assemble
    monkeypatch.setattr(data_module, "_assemble", check_work_folder)
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
    monkeypatch.setattr(data_module, "_POOL_MIN_PAIRS", 0)
    monkeypatch.setattr(data_module, "_SHARD_PAIRS", 150)
    monkeypatch.setattr(data_module, "_cpus", lambda: 3)
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
