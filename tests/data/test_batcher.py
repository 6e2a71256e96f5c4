"""nas.data.batcher: TokenBatcher's token-count batches (bounded, complete, deterministic, resumable, equal to the
list batcher they replaced, issue 16) and length_batches, the decoder's batches, over the same cut (issue 29)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nas.data import PAD_ID, TokenBatcher, TokenCorpus, length_batches
from nas.data.batcher import cut_batches
from tests.data.reference import OldBatcher, assert_batch_equal, old_collate, old_length_batches, random_pairs

# --------------------------------------------------------------------------- TokenBatcher


def _short_pairs(n: int = 300, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    src = [[rng.randrange(4, 50) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    tgt = [[rng.randrange(4, 50) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    src.append(list(range(4, 104)))  # one pair longer than max_tokens
    tgt.append([5, 6])
    return src, tgt


def test_every_batch_respects_max_tokens() -> None:
    src, tgt = _short_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64, seed=1)
    sizes = [len(b) for b in batcher.epoch(0)]
    assert sizes.count(1) >= 1 and max(sizes) > 1
    for batch in batcher.batches(0):
        if batch.src.shape[0] > 1:
            assert batch.src.numel() <= 64 and batch.tgt_in.numel() <= 64


def test_every_pair_appears_exactly_once_per_epoch() -> None:
    src, tgt = _short_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64)
    for epoch in (0, 1):
        indices = [i for batch in batcher.epoch(epoch) for i in batch]
        assert sorted(indices) == list(range(len(src)))
    assert len(batcher) == len(batcher.epoch(0))


def test_epoch_order_is_deterministic_and_differs_between_epochs() -> None:
    src, tgt = _short_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64, seed=3)
    twin = TokenBatcher(src, tgt, max_tokens=64, seed=3)
    assert batcher.epoch(2) == batcher.epoch(2) == twin.epoch(2)
    assert batcher.epoch(0) != batcher.epoch(1)
    assert TokenBatcher(src, tgt, max_tokens=64, seed=4).epoch(2) != batcher.epoch(2)


def test_unshuffled_batches_follow_length_order() -> None:
    src, tgt = _short_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64, shuffle=False)
    order = [i for batch in batcher.epoch(0) for i in batch]
    keys = [(len(src[i]), len(tgt[i])) for i in order]
    assert keys == sorted(keys)
    assert batcher.epoch(0) == batcher.epoch(5)


def test_batches_resume_at_start_equals_tail_of_full_epoch() -> None:
    src, tgt = _short_pairs()
    batcher = TokenBatcher(src, tgt, max_tokens=64)
    full = list(batcher.batches(epoch=1))
    tail = list(batcher.batches(epoch=1, start=5))
    assert len(tail) == len(full) - 5
    for a, b in zip(full[5:], tail):
        assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)


def test_max_tokens_below_8_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBatcher([[4]], [[5]], max_tokens=7)


@pytest.mark.parametrize("max_tokens", [8, 64, 512, 4096])
@pytest.mark.parametrize("shuffle, seed", [(True, 0), (True, 7), (False, 0)])
def test_batches_equal_the_list_batcher_on_random_lengths(max_tokens, shuffle, seed):
    src, tgt = random_pairs(3000, seed=max_tokens + seed, empty=True)
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
        assert_batch_equal(batch, old_collate([src[i] for i in rows], [tgt[i] for i in rows]))
        if k == 20:
            break


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


# --------------------------------------------------------------------------- length_batches and the one cut


@pytest.mark.parametrize("max_tokens", [None, 1, 7, 20, 1000])
def test_length_batches_cover_each_sentence_once_within_the_token_bound(max_tokens):
    lengths = [5, 1, 9, 3, 3, 12, 7, 2, 8, 4]
    batches = length_batches(lengths, max_tokens, batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths)  # shortest first, in one pass
    for b in batches:
        assert len(b) <= 3
        if len(b) > 1 and max_tokens is not None:
            assert len(b) * max(lengths[i] for i in b) <= max_tokens


@pytest.mark.parametrize("max_tokens", [None, -1, 0, 1, 7, 20, 64, 1000])
@pytest.mark.parametrize("batch_size", [-1, 0, 1, 3, 16, 10_000])
def test_length_batches_equal_the_list_version_they_replaced(max_tokens, batch_size):
    """The decoder's batches are those of the loop that ``nas.eval.scores`` had (ties, zero lengths, a batch
    size below 1 and a token bound below one item included)."""
    rng = random.Random(f"{max_tokens}:{batch_size}")
    for n in (0, 1, 2, 50, 400):
        lengths = [rng.choice([0, rng.randint(1, 5), rng.randint(1, 80)]) for _ in range(n)]
        assert length_batches(lengths, max_tokens, batch_size) == old_length_batches(lengths, max_tokens, batch_size)


def test_the_cut_bounds_padded_tokens_and_items_and_gives_a_long_item_its_own_batch():
    padded = np.array([3, 3, 3, 5, 2, 9, 40, 4, 4, 4, 4])
    bounds = cut_batches(padded, 12).tolist()
    assert bounds == [0, 3, 5, 6, 7, 10, 11]  # the 2 after the 5 is padded to 5; 40 > 12 stands alone
    assert cut_batches(padded, 12, max_items=2).tolist() == [0, 2, 4, 5, 6, 7, 9, 11]
    assert cut_batches(padded, None, max_items=4).tolist() == [0, 4, 8, 11]
    assert cut_batches(padded, None).tolist() == [0, 11]
    assert cut_batches(np.array([], dtype=np.int64), 12).tolist() == [0]
