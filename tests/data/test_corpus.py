"""nas.data.corpus: flat token ids (memory-mapped from train.arrow, read-only, little anonymous memory) and their
vectorised padding, equal to the row-by-row padding it replaced (issue 16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest
import torch

from nas.data import BOS_ID, EOS_ID, PAD_ID, DataError, TokenCorpus, collate
from tests.conftest import REPO
from tests.data.reference import assert_batch_equal, old_collate, random_pairs

# --------------------------------------------------------------------------- collate


def test_collate_places_bos_eos_and_counts_target_tokens() -> None:
    batch = collate([[10, 11, 12], [20]], [[30], [40, 41]])
    assert batch.src.tolist() == [[10, 11, 12, EOS_ID], [20, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 30, PAD_ID], [BOS_ID, 40, 41]]
    assert batch.tgt_out.tolist() == [[30, EOS_ID, PAD_ID], [40, 41, EOS_ID]]
    assert batch.src.dtype == batch.tgt_in.dtype == torch.int64
    assert batch.ntokens == 5


def test_collate_equals_the_row_by_row_padding():
    src, tgt = random_pairs(200, seed=1, longest=12, empty=True)
    for lo, hi in [(0, 1), (0, 200), (17, 60), (200, 202), (5, 6)]:
        assert_batch_equal(collate(src[lo:hi], tgt[lo:hi]), old_collate(src[lo:hi], tgt[lo:hi]))
    corpus = TokenCorpus.from_lists(src, tgt)
    rows = [199, 3, 3, 150, 0]
    assert_batch_equal(corpus.collate(rows), old_collate([src[i] for i in rows], [tgt[i] for i in rows]))
    assert collate([[]], [[]]).src.tolist() == [[EOS_ID]]
    with pytest.raises(ValueError, match="non-empty"):
        corpus.collate([])


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
from nas.data.corpus import TokenCorpus, write_token_file
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
write_token_file(out / 'train.arrow', rows, sides)
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
