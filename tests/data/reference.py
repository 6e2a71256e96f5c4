"""The list-based code that nas.data's numpy code replaced, transcribed: the references it must equal.

:class:`OldBatcher` and :func:`old_collate` are ``TokenBatcher`` and ``collate`` before issue 16 (the batches must
stay the same, so that runs resume identically); :func:`old_length_batches` is ``nas.eval.scores.length_batches``
before it became :func:`nas.data.length_batches` over the one max-tokens cut (issue 29).
"""

from __future__ import annotations

import random

import torch

from nas.data import BOS_ID, EOS_ID, PAD_ID


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


def old_length_batches(lengths, max_tokens, batch_size):
    """``nas.eval.scores.length_batches`` before issue 29, copied."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches = []
    for i in order:
        chunk = batches[-1] if batches else None
        if (chunk is None or len(chunk) >= batch_size
                or (max_tokens is not None and (len(chunk) + 1) * lengths[i] > max_tokens)):
            batches.append([i])
        else:
            chunk.append(i)
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


def random_pairs(n: int, seed: int, longest: int = 40, empty: bool = False):
    """``n`` random id-list pairs (sides of 0 or 1 to ``longest`` ids), then two pairs with one side longer than
    every ``max_tokens`` the tests use (each a batch of its own)."""
    rng = random.Random(seed)
    low = 0 if empty else 1
    src = [[rng.randrange(4, 500) for _ in range(rng.randint(low, longest))] for _ in range(n)]
    tgt = [[rng.randrange(4, 500) for _ in range(rng.randint(low, longest))] for _ in range(n)]
    src += [list(range(4, 300)), [7]]  # longer than every max_tokens below: a batch of its own
    tgt += [[5, 6], list(range(4, 200))]
    return src, tgt


def assert_batch_equal(batch, old) -> None:
    """A :class:`nas.data.Batch` equals :func:`old_collate`'s tuple (and is int64)."""
    for new, ref in zip((batch.src, batch.tgt_in, batch.tgt_out), old[:3]):
        assert new.dtype == torch.int64 and torch.equal(new, ref)
    assert batch.ntokens == old[3]
