"""``top_candidates``: the top ``2k`` beam-search candidates found through block maxima (the AOT-compiled decoder's
ranking) equal ``topk`` over every candidate, the reference written out here as the eager search computes it."""

from __future__ import annotations

import pytest
import torch

from nas.model.decode import beam_candidates, candidate_block, first_continuing, top_candidates


def _reference(lprobs: torch.Tensor, scores: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = lprobs.size(0)
    return (lprobs + scores[:, :, None]).view(n, -1).topk(kk, dim=1)


def _case(n: int, k: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lprobs = torch.log_softmax(torch.randn(n, k, vocab, generator=g) * 3, -1)
    lprobs[:, :, [0, 2]] = float("-inf")  # banned tokens, as the search bans PAD and BOS
    scores = torch.randn(n, k, generator=g) * 2
    scores[0, 1:] = float("-inf")  # a first step: only beam 0 of sentence 0 is alive
    return lprobs, scores


@pytest.mark.parametrize("k, vocab", [(4, 6000), (1, 6000), (3, 300), (2, 64 * 9)])
def test_the_values_and_their_entries_equal_topk_over_every_candidate(k, vocab):
    lprobs, scores = _case(5, k, vocab, seed=k + vocab)
    values, idx = top_candidates(lprobs, scores, 2 * k)
    ref_values, ref_idx = _reference(lprobs, scores, 2 * k)
    assert candidate_block(vocab) is not None
    assert torch.equal(values, ref_values)  # bit for bit: the same single addition per entry
    assert torch.equal(idx, ref_idx)  # random values: no ties


def test_the_top_candidates_all_in_one_block_are_found():
    lprobs, scores = _case(2, 4, 6000, seed=1)
    block = candidate_block(6000)
    lprobs[1, 2, block * 7:block * 7 + 8] = 5.0 + torch.arange(8.0)  # the 8 best of sentence 1: one block
    values, idx = top_candidates(lprobs, scores, 8)
    ref_values, ref_idx = _reference(lprobs, scores, 8)
    assert torch.equal(values, ref_values) and torch.equal(idx, ref_idx)
    assert set((idx[1] // 6000).tolist()) == {2}


def test_a_vocabulary_without_a_block_length_falls_back_to_topk():
    lprobs, scores = _case(3, 2, 307, seed=3)  # 307 is prime
    assert candidate_block(307) is None
    values, idx = top_candidates(lprobs, scores, 4)
    ref_values, ref_idx = _reference(lprobs, scores, 4)
    assert torch.equal(values, ref_values) and torch.equal(idx, ref_idx)


def test_from_logits_and_log_sum_exp_the_candidates_match_log_softmax():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 4, 6000, generator=g) * 3
    scores = torch.randn(3, 4, generator=g)
    lse = torch.logsumexp(logits, -1)
    banned = logits.clone()
    banned[:, :, [0, 2]] = float("-inf")
    block = candidate_block(6000)
    block_max = banned.view(3, 4, -1, block).amax(-1)
    lprobs = torch.log_softmax(logits, -1)
    lprobs[:, :, [0, 2]] = float("-inf")
    ref_values, ref_idx = _reference(lprobs, scores, 8)
    for given in (None, block_max):
        values, idx = top_candidates(banned, scores, 8, lse, given)
        assert torch.equal(idx, ref_idx)
        assert torch.allclose(values, ref_values, atol=1e-5, rtol=0)


def test_blocked_beam_candidates_equal_the_eager_ones():
    lprobs, scores = _case(4, 4, 6000, seed=11)
    lprobs[2, 1, 3] = 50.0  # EOS (id 3) the best of sentence 2
    eager = beam_candidates(lprobs.clone(), scores, 3, inplace=True)
    blocked = beam_candidates(lprobs, scores, 3, blocked=True)
    for a, b in zip(eager, blocked):
        assert torch.equal(a, b)
    assert bool(eager[3][2].any())  # the EOS candidate was ranked and flagged


def test_with_a_shift_and_log_sum_the_candidates_carry_log_softmax_s_two_subtractions():
    # the compiled step's (shift, log_sum): its values are ((x - max) - log(sum exp(x - max))) + score bit for bit,
    # the reference computed over every entry and ranked by topk
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 6000, generator=g) * 3
    scores = torch.randn(3, 4, generator=g)
    top = logits.amax(-1)
    log_sum = (logits - top[:, :, None]).exp().sum(-1).log()
    lprobs = (logits - top[:, :, None]) - log_sum[:, :, None]
    banned = logits.clone()
    banned[:, :, [0, 2]] = lprobs[:, :, [0, 2]] = float("-inf")
    ref_values, ref_idx = _reference(lprobs, scores, 8)
    block_max = banned.view(3, 4, -1, candidate_block(6000)).amax(-1)
    for given in (None, block_max):
        values, idx = top_candidates(banned, scores, 8, (top, log_sum), given)
        assert torch.equal(values, ref_values) and torch.equal(idx, ref_idx)


def _first_continuing_loop(values: list[float], eos: list[bool], k: int) -> list[float]:
    """fairseq's rule written out: walk the sorted candidates, keep those not ending in EOS until k are kept."""
    kept = [v for v, e in zip(values, eos) if not e][:k]
    return kept + [float("-inf")] * (k - len(kept))


@pytest.mark.parametrize("k", [1, 2, 4, 5])
def test_first_continuing_takes_the_first_k_non_eos_candidates_in_order(k):
    g = torch.Generator().manual_seed(k)
    top_scores = torch.randn(6, 2 * k, generator=g).sort(1, descending=True).values
    top_scores[1, k:] = float("-inf")  # dead candidates at the end
    is_eos = (torch.rand(6, 2 * k, generator=g) < 0.4) & torch.isfinite(top_scores)
    is_eos[2] = torch.isfinite(top_scores[2])  # every candidate of sentence 2 an EOS
    is_eos[3] = False
    values, pick = first_continuing(top_scores, is_eos, k)
    for i in range(6):
        assert values[i].tolist() == _first_continuing_loop(top_scores[i].tolist(), is_eos[i].tolist(), k)
        assert len(set(pick[i].tolist())) == k  # k distinct candidates
        alive = torch.isfinite(values[i])
        assert not bool(is_eos[i][pick[i][alive]].any())
        assert torch.equal(top_scores[i][pick[i][alive]], values[i][alive])
