"""Batched beam search with a key/value cache (and greedy decoding as beam size 1)."""

from __future__ import annotations

import torch

from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

__all__ = ["beam_search"]


@torch.no_grad()
def beam_search(model: SuperTransformer, src: torch.Tensor, arch: Arch | None = None, *, beam_size: int = 4,
                bos_id: int = 2, eos_id: int = 3, len_penalty: float = 1.0, max_len_a: float = 1.5,
                max_len_b: int = 10, return_scores: bool = False) -> list[list[int]] | tuple[list[list[int]], list[float]]:
    """Translate a batch with beam search; returns the best hypothesis per sentence (ids, no BOS/EOS).

    Hypotheses are ranked by ``sum log p / len**len_penalty`` (len counts the EOS), as in
    fairseq. A sentence is finished once ``beam_size`` hypotheses ended in EOS; finished
    sentences leave the batch, and decoding stops when all are finished or after
    ``max_len_a * src_len + max_len_b`` tokens (EOS is forced at that length).

    Args:
        model: a supernet or an extracted model, in eval mode.
        src: ``[b, s]`` source ids with EOS, PAD-padded.
        arch: the sub-Transformer (None: the model's widest).
        beam_size: beams per sentence (1 gives greedy decoding).
        return_scores: also return each best hypothesis's normalized score (log-probability / len**len_penalty).
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    bsz, k, vocab = src.size(0), beam_size, model.vocab_size
    device = src.device
    memory, src_pad = model.encode(src, arch)
    src_len = (~src_pad).sum(1)  # [b]
    max_len = torch.clamp((src_len.float() * max_len_a + max_len_b).long(), max=model.max_positions - 1)  # [b]
    rows = torch.arange(bsz, device=device).repeat_interleave(k)  # beam row -> sentence
    memory, src_pad = memory.index_select(0, rows), src_pad.index_select(0, rows)  # [b*k, s, C]
    cache: list = [{} for _ in model.decoder]
    tokens = torch.full((bsz * k, 1), bos_id, dtype=torch.long, device=device)  # [n, 1 + step]
    scores = torch.zeros(bsz, k, device=device)
    scores[:, 1:] = float("-inf")  # the first step expands beam 0 only
    active = torch.arange(bsz, device=device)  # sentence ids still decoding
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(bsz)]
    step = 0
    while active.numel() > 0:
        n_act = active.numel()
        logits = model.decode_step(tokens[:, -1:], step, memory, src_pad, arch, cache)  # [n_act*k, V]
        lprobs = torch.log_softmax(logits.float(), dim=-1).view(n_act, k, vocab)
        at_limit = (step + 1) >= max_len[active]  # [n_act]
        if at_limit.any():
            forced = torch.full_like(lprobs[at_limit], float("-inf"))
            forced[..., eos_id] = lprobs[at_limit][..., eos_id]
            lprobs[at_limit] = forced
        cand = (scores[:, :, None] + lprobs).view(n_act, k * vocab)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # [n_act, 2k]
        top_beam, top_tok = top_idx // vocab, top_idx % vocab
        is_eos = top_tok.eq(eos_id) & torch.isfinite(top_scores)
        # Finalize EOS candidates that rank among the first k (fairseq's rule).
        hits = (is_eos[:, :k]).nonzero().tolist()
        norm = float(step + 1) ** len_penalty
        for i, j in hits:
            sid = int(active[i])
            if len(finished[sid]) < k:
                hyp = tokens[i * k + int(top_beam[i, j]), 1:].tolist()
                finished[sid].append((float(top_scores[i, j]) / norm, hyp))
        # Continue with the k best non-EOS candidates.
        cont_scores = top_scores.masked_fill(is_eos, float("-inf"))
        cont_scores, pick = cont_scores.topk(k, dim=1)  # [n_act, k]
        next_beam, next_tok = top_beam.gather(1, pick), top_tok.gather(1, pick)
        done = torch.tensor([len(finished[int(s)]) >= k for s in active], device=device) | at_limit
        keep = (~done).nonzero().squeeze(1)  # indices into active
        src_rows = (keep[:, None] * k + next_beam[keep]).reshape(-1)  # [n_keep*k]
        tokens = torch.cat([tokens.index_select(0, src_rows), next_tok[keep].reshape(-1, 1)], 1)
        scores = cont_scores[keep]
        SuperTransformer.reorder_cache(cache, src_rows, ("self", "conv"))
        if keep.numel() < n_act:
            sent_rows = (keep[:, None] * k + torch.arange(k, device=device)).reshape(-1)
            SuperTransformer.reorder_cache(cache, sent_rows, ("cross",))
            memory, src_pad = memory.index_select(0, sent_rows), src_pad.index_select(0, sent_rows)
        active = active[keep]
        step += 1
    best = [max(hyps, key=lambda h: h[0]) for hyps in finished]
    hyps = [h[1] for h in best]
    return (hyps, [h[0] for h in best]) if return_scores else hyps
