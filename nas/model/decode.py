"""Incremental (key/value-cached) decoding and batched beam search (greedy decoding is beam size 1)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nas.model.kv_cache import LayerCache
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``(x [n, m], kk)`` -> each row's ``kk`` largest values and their indices, descending."""

__all__ = ["beam_search", "beam_candidates", "first_continuing", "search", "top_candidates", "IncrementalDecoder"]


class IncrementalDecoder:
    """Key/value-cached decoding of one batch by one sub-Transformer: ``logits = dec.step(tokens)``.

    Each step runs ``DecoderLayer.forward`` on the newest position with one
    :class:`~nas.model.kv_cache.LayerCache` per layer: self-attention keys/values in preallocated
    buffers (doubled when full), the cross-attention keys/values of ``memory`` computed at the first
    step, Prime's causal-convolution window, and every decoder weight cropped once (at the first
    step) and reused. Each :meth:`step` equals the last position of
    ``model.decode(prefix, memory, src_pad, arch)`` (no regularisation). Inference only: use it
    under ``torch.inference_mode()`` (as :func:`beam_search` does) or ``torch.no_grad()``.

    Args:
        model: a supernet or an extracted model.
        memory: encoder output ``[n, K*s, C]`` (from ``model.encode`` for ``arch``, rows repeated per beam).
        src_pad: ``[n, s]`` bool, True at padding.
        arch: the sub-Transformer (None: the model's widest).
        max_len: expected target length (tokens), the initial length of the key/value buffers.

    Raises:
        ValueError: ``arch`` exceeds the model's maxima (names the choice).
    """

    def __init__(self, model: SuperTransformer, memory: torch.Tensor, src_pad: torch.Tensor,
                 arch: Arch | None = None, max_len: int = 64) -> None:
        self.arch = arch = model.check_arch(arch)
        self.model, self.pos = model, 0
        self.dims = arch.decoder.layer_dims()
        for layer, dims in zip(model.decoder, self.dims):
            layer.check_layout(dims)
        self.caches = [LayerCache(max(max_len, 1)) for _ in self.dims]
        self.layers = tuple(model.decoder)  # not model.decoder at every step: Module.__getattr__
        self.memory = memory  # [n, K*s, C]
        self.src_pad = src_pad if src_pad is not None and bool(src_pad.any()) else None  # [n, s]
        self.sources = model.cross_sources(memory, self.src_pad, arch)  # per layer: [n, k*s, C], [n, k*s]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """The newest tokens of each row ``[n, t]`` (positions ``self.pos .. self.pos + t - 1``; usually
        ``t = 1``) -> the logits of the token after the last ``[n, V]``. Several tokens at once attend
        causally, as one token at a time would (e.g. a forced prefix).

        Raises:
            ValueError: the positions reach the model's ``max_positions``.
        """
        model, pos = self.model, self.pos
        x = model.embed_tokens(tokens, model.width_of(self.arch), offset=pos)  # [n, t, C]
        for layer, dims, cache, (mem, pad) in zip(self.layers, self.dims, self.caches, self.sources):
            x = layer.forward(x, mem, dims, pad, cache=cache)  # no hooks: skip Module.__call__
        self.pos = pos + tokens.size(1)
        return model.step_logits(x[:, -1])  # [n, V]

    def reorder(self, index: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Continue from rows ``index [n']`` (beam search's surviving hypotheses); with ``sentences [n']``,
        also drop the cross-attention rows of finished sentences (``sentences[i]`` is row i's old row)."""
        for cache in self.caches:
            cache.reorder(index, sentences)
        if sentences is not None:
            self.memory = self.memory.index_select(0, sentences)
            if self.src_pad is not None:
                self.src_pad = self.src_pad.index_select(0, sentences)
            self.sources = self.model.cross_sources(self.memory, self.src_pad, self.arch)


def candidate_block(vocab: int) -> int | None:
    """The block length of :func:`top_candidates` for a vocabulary of ``vocab`` tokens: 64 or another divisor between
    32 and 128; None if there is none."""
    return next((b for b in (64, *range(32, 129)) if vocab % b == 0), None)


def _normalized(x: torch.Tensor, lse: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x - lse`` or, for ``lse = (shift, log_sum)``, ``(x - shift) - log_sum`` (log-softmax's two subtractions);
    ``lse`` broadcast against ``x``."""
    if isinstance(lse, tuple):
        return (x - lse[0]) - lse[1]
    return x - lse


def _per_entry(lse: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``lse`` (``[n, k]`` or a pair of them) as ``[n, k, 1]``: broadcast over a beam's entries."""
    return tuple(t[:, :, None] for t in lse) if isinstance(lse, tuple) else lse[:, :, None]


def aten_topk(x: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, m]`` -> each row's ``kk`` largest values and their indices, descending (ATen's ``topk``)."""
    return x.topk(kk, dim=1)


def top_candidates(lprobs: torch.Tensor, scores: torch.Tensor, kk: int,
                   lse: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                   block_max: torch.Tensor | None = None, topk: TopK = aten_topk) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kk`` largest ``lprobs[i, j, v] + scores[i, j]`` of each sentence ``i`` (values ``[n, kk]``, descending,
    and flat indices ``j * V + v``): ``(lprobs + scores[:, :, None]).view(n, -1).topk(kk)`` without adding the
    scores to every entry and without ``topk``'s pass over all of them.

    Each beam's vocabulary is cut into blocks of 32-128 tokens. A vectorized maximum of each block, plus its beam's
    score, ranks the blocks (``fl(max a + s) = max fl(a + s)``: rounding is monotonic); the ``kk`` best blocks hold
    ``kk`` candidates at least as large as the ``kk``-th of their maxima, so a top ``kk`` of the sentence, and
    ``topk`` runs over their ``kk * block`` candidates only. The values equal the plain computation's bit for bit;
    where values tie at the ``kk``-th place the indices may be other tied ones. At batch 32, beam 4, vocabulary
    6,000, ``kk = 8``, 1 thread, the top-k alone took 281 us against 849 us (blocks of the flattened rows).
    Falls back to the plain computation where ``V`` has no divisor between 32 and 128.

    With ``lse [n, k]`` (each row's log-sum-exp), ``lprobs`` holds logits instead (banned tokens ``-inf``) and the
    candidates are ``(x - lse) + score``: the log-probabilities of the few candidates are computed, not all
    ``[n, k, V]`` (``x - lse`` may differ from ``log_softmax``'s value in its last bit). With ``lse = (shift,
    log_sum)`` (each ``[n, k]``) they are ``(x - shift) - log_sum``: log-softmax's own two subtractions (its
    decomposition in Inductor: the row's maximum, then the log of the sum of the shifted exponentials), so the same
    bits as the log-softmax they replace. ``block_max [n, k, V/block]`` (:func:`candidate_block`), if given, holds
    each block's maximum of ``lprobs``, computed by the caller. ``topk(x [n, m], kk)``: the top-``kk`` of rows
    (ATen's, or the AOT packages' loop, :mod:`nas.export.topk`).
    """
    n, k, vocab = lprobs.shape
    block = candidate_block(vocab)
    if block is None or k * (vocab // block) < 2 * kk:
        base = lprobs if lse is None else _normalized(lprobs, _per_entry(lse))
        return topk((base + scores[:, :, None]).view(n, k * vocab), kk)
    best = lprobs.view(n, k, vocab // block, block).amax(3) if block_max is None else block_max  # [n, k, V/block]
    best = (best if lse is None else _normalized(best, _per_entry(lse))) + scores[:, :, None]
    _, blocks = topk(best.view(n, -1), kk)  # [n, kk]: block q covers flat entries q*block ...
    idx = (blocks[:, :, None] * block + torch.arange(block, device=lprobs.device)).view(n, kk * block)
    values = lprobs.view(n, k * vocab).gather(1, idx)
    beam = idx // vocab
    if lse is not None:
        values = _normalized(values, tuple(t.gather(1, beam) for t in lse) if isinstance(lse, tuple)
                             else lse.gather(1, beam))
    values, pick = topk(values + scores.gather(1, beam), kk)
    return values, idx.gather(1, pick)


def first_continuing(top_scores: torch.Tensor, is_eos: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_scores.masked_fill(is_eos, -inf).topk(k)`` for ``top_scores [n, 2k]`` sorted in descending order (as
    ``topk`` returns them): the first ``k`` entries that are not EOS, in order, then EOS entries (``-inf``) where
    fewer are left. Returns ``(values [n, k], positions [n, k])``; the values equal ``topk``'s, and where values tie
    the positions are the first ones (``topk``'s may be other tied ones).

    Each entry's place in that order is counted with a ``[n, 2k, 2k]`` comparison (the non-EOS entries before it),
    pointwise ops and sums that a compiled graph runs in its own loops, where a second ``topk`` would be a call into
    ATen.
    """
    width = top_scores.size(1)
    go = ~is_eos  # [n, 2k]
    pos = torch.arange(width, device=top_scores.device)
    before = (go[:, None, :] & (pos[None, :] < pos[:, None])[None]).sum(-1)  # [n, 2k]: non-EOS entries before each
    order = torch.where(go, before, go.sum(-1, keepdim=True) + pos - before)  # a permutation of 0 .. 2k-1
    pick = ((order[:, None, :] == pos[:k, None]) * pos).sum(-1)  # [n, k]: the entry at place r
    return top_scores.masked_fill(is_eos, float("-inf")).gather(1, pick), pick


def beam_candidates(lprobs: torch.Tensor, scores: torch.Tensor, eos_id: int, inplace: bool = False,
                    blocked: bool = False, lse: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                    block_max: torch.Tensor | None = None, in_order: bool = False,
                    topk: TopK = aten_topk) -> tuple[torch.Tensor, ...]:
    """One beam-search expansion (fairseq's ``BeamSearch.step``): the ``2k`` best continuations of each sentence,
    then the ``k`` best of those that do not end in EOS.

    The tensor part of :func:`beam_search`'s step, shared with the AOT-compiled step of
    :mod:`nas.export.aot`, which runs it inside its graph: both engines rank candidates with the same code.

    Args:
        lprobs: ``[n, k, V]`` log-probabilities of the next token (banned tokens already ``-inf``).
        scores: ``[n, k]`` the hypotheses' summed log-probabilities so far.
        eos_id: the EOS token id.
        inplace: add ``scores`` into ``lprobs`` in place (eager decoding: no ``[n, k*V]`` allocation a step).
        blocked: the ``2k`` best by :func:`top_candidates` (the AOT-compiled decoder; the same values, tied
            indices may differ; ``lprobs`` is left as it is) instead of adding and ``topk``; with ``lse`` (``[n, k]``
            or a pair ``(shift, log_sum)``, blocked only) ``lprobs`` holds the logits with banned tokens at ``-inf``;
            ``lse`` and ``block_max`` as in :func:`top_candidates`.
        in_order: take the ``k`` best non-EOS candidates in their order among the ``2k`` (:func:`first_continuing`)
            instead of a second ``topk``: the same values, in a compiled graph's own loops (``topk`` is a call
            into ATen there, 5-6 us at batch 1, beam 4 on a 2-core AVX2 EPYC).
        topk: the top-k of :func:`top_candidates` (blocked only).
    Returns:
        ``top_scores, top_beam, top_tok, is_eos`` (each ``[n, 2k]``: the candidates' scores, their beams and
        tokens, and which end in a finite-scored EOS), then ``cont_scores, next_beam, next_tok`` (each ``[n, k]``:
        the ``k`` best non-EOS candidates, ``-inf`` where fewer are left).
    """
    n, k, vocab = lprobs.shape
    if blocked:
        top_scores, top_idx = top_candidates(lprobs, scores, 2 * k, lse, block_max, topk)  # [n, 2k]
    else:
        cand = (lprobs.add_(scores[:, :, None]) if inplace else lprobs + scores[:, :, None]).view(n, k * vocab)
        top_scores, top_idx = cand.topk(2 * k, dim=1)  # [n, 2k]
    top_beam, top_tok = top_idx // vocab, top_idx % vocab
    is_eos = top_tok.eq(eos_id) & torch.isfinite(top_scores)
    if in_order:
        cont_scores, pick = first_continuing(top_scores, is_eos, k)
    else:
        cont_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(k, dim=1)  # [n, k]
    return top_scores, top_beam, top_tok, is_eos, cont_scores, top_beam.gather(1, pick), top_tok.gather(1, pick)


@torch.inference_mode()  # not only no_grad: no view or version tracking, ~10% faster cached decoding
def beam_search(model: SuperTransformer, src: torch.Tensor, arch: Arch | None = None, *, beam_size: int = 4,
                bos_id: int = 2, eos_id: int = 3, len_penalty: float = 1.0, max_len_a: float = 1.5,
                max_len_b: int = 10, min_len: int = 0, return_scores: bool = False,
                use_cache: bool = True) -> list[list[int]] | tuple[list[list[int]], list[float]]:
    """Translate a batch with beam search; returns the best hypothesis per sentence (ids, no BOS/EOS).

    Hypotheses are ranked by ``sum log p / len**len_penalty`` (len counts the EOS), as in
    fairseq. PAD (``model.pad_id``) and BOS are never emitted (their log-probabilities are set
    to -inf, as fairseq's ``SequenceGenerator`` does for PAD). A sentence is finished once ``beam_size`` hypotheses ended in EOS; finished
    sentences leave the batch, and decoding stops when all are finished or after
    ``max_len_a * src_len + max_len_b`` tokens (EOS is forced at that length).

    Args:
        model: a supernet or an extracted model, in eval mode.
        src: ``[b, s]`` source ids with EOS, PAD-padded.
        arch: the sub-Transformer (None: the model's widest).
        beam_size: beams per sentence (1 gives greedy decoding).
        min_len: EOS is not emitted before this many decoding steps (fairseq's ``--min-len``), except where
            the length limit forces it; with ``max_len_a=0, max_len_b=min_len`` every output has exactly
            ``min_len - 1`` tokens and EOS (the fixed-length decoding of ``benchmarks/bench_serving.py``).
        return_scores: also return each best hypothesis's normalized score (log-probability / len**len_penalty).
        use_cache: decode incrementally with :class:`IncrementalDecoder` (keys/values cached); False
            recomputes every hypothesis's whole prefix at each step (the reference; same results).

    Raises:
        ValueError: ``beam_size < 1``; ``arch`` exceeds the model's maxima.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    memory, src_pad = model.encode(src, arch)
    src_len = (~src_pad).sum(1)  # [b]
    max_len = torch.clamp((src_len.float() * max_len_a + max_len_b).long(), max=model.max_positions - 1)  # [b]
    rows = torch.arange(src.size(0), device=src.device).repeat_interleave(beam_size)  # beam row -> sentence
    memory, src_pad = memory.index_select(0, rows), src_pad.index_select(0, rows)  # [b*k, s, C]
    stepper = _EagerStepper(model, memory, src_pad, arch, int(max_len.max()) + 1, use_cache)
    return search(stepper, src.size(0), max_len.tolist(), beam_size=beam_size, vocab=model.vocab_size,
                  pad_id=model.pad_id, bos_id=bos_id, eos_id=eos_id, len_penalty=len_penalty, min_len=min_len,
                  return_scores=return_scores, device=src.device)


class _EagerStepper:
    """:func:`search`'s steps on the PyTorch model: :class:`IncrementalDecoder` (or, without the cache, the whole
    prefix decoded again each step)."""

    def __init__(self, model: SuperTransformer, memory: torch.Tensor, src_pad: torch.Tensor, arch: Arch | None,
                 max_len: int, use_cache: bool) -> None:
        self.model, self.arch, self.memory, self.src_pad = model, arch, memory, src_pad
        self.decoder = IncrementalDecoder(model, memory, src_pad, arch, max_len) if use_cache else None

    def step(self, tokens: torch.Tensor, scores: torch.Tensor, banned: torch.Tensor, at_limit: list[bool],
             eos_zero: bool) -> tuple[torch.Tensor, None]:
        """Prefixes ``tokens [n*k, 1 + step]``, ``scores [n, k]``, token ids ``banned`` -> the log-probabilities
        ``[n, k, V]`` with ``banned`` at ``-inf``, and None (the length limit and the candidates are left to
        :func:`search`)."""
        if self.decoder is not None:
            logits = self.decoder.step(tokens[:, -1:])  # [n*k, V]
        else:
            logits = self.model.decode(tokens, self.memory, self.src_pad, self.arch)[:, -1]
        lprobs = torch.log_softmax(logits.float(), dim=-1).view(scores.size(0), scores.size(1), -1)
        return lprobs.index_fill_(2, banned, float("-inf")), None

    def reorder(self, src_rows: torch.Tensor, sent_rows: torch.Tensor | None) -> None:
        if self.decoder is not None:
            self.decoder.reorder(src_rows, sent_rows)
        elif sent_rows is not None:
            self.memory, self.src_pad = self.memory.index_select(0, sent_rows), self.src_pad.index_select(0, sent_rows)


def search(stepper, bsz: int, max_len: list[int], *, beam_size: int, vocab: int, pad_id: int, bos_id: int,
           eos_id: int, len_penalty: float, min_len: int, return_scores: bool, device: torch.device | str,
           blocked_topk: bool = False) -> list[list[int]] | tuple[list[list[int]], list[float]]:
    """:func:`beam_search`'s search over any stepper (the eager model, or the AOT-compiled step of
    :mod:`nas.export.aot`): fairseq's bookkeeping of finished hypotheses, length limits and reordering.

    Args:
        stepper: ``step(tokens [n*k, 1+t], scores [n, k], banned [m], at_limit, eos_zero)``, with ``at_limit``
            a list of n bools (the sentences whose length limit forces EOS now) and ``eos_zero`` whether EOS is
            still banned (then a forced EOS scores 0): returns ``(lprobs [n, k, V], None)``, the log-probabilities
            with ``banned`` at ``-inf``, the limit left to this function; or ``(None, candidates)``, the stepper
            having forced EOS where ``at_limit`` says, as below, and computed :func:`beam_candidates` itself,
            optionally followed by what this function computes from them when every sentence goes on
            (``src_rows [n*k]``, ``eos_any []``, the grown ``tokens [n*k, 2+t]``: the compiled step's, which
            saves about 10 Python ops a step).
            ``reorder(src_rows [n'*k], sent_rows [n'*k] or None)``: continue from the hypotheses ``src_rows``,
            and, with ``sent_rows``, drop the rows of finished sentences.
            Optionally ``run_ahead(tokens, scores, banned, eos_zero, budget)`` (None: absent): called instead of
            ``step`` where no sentence is at its limit, it runs up to ``budget`` steps, over which the limits and
            ``banned`` stay as they are, each continuing every sentence's ``k`` best candidates as this function
            would, and stops after the first whose EOS ranks among a sentence's first ``k``; returns the steps
            run, that step's ``tokens`` and its candidates with the three continuation tensors
            (:mod:`nas.export.steploop`).
        bsz: sentences; max_len: each sentence's length limit (decoder steps, EOS forced at it).
        blocked_topk: rank the candidates this function computes with :func:`top_candidates`.
        The rest as :func:`beam_search`.
    """
    k = beam_size
    tokens = torch.full((bsz * k, 1), bos_id, dtype=torch.long, device=device)  # [n, 1 + step]
    scores = torch.zeros(bsz, k, device=device)
    scores[:, 1:] = float("-inf")  # the first step expands beam 0 only
    active = torch.arange(bsz, device=device)  # sentence ids still decoding
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(bsz)]
    never = torch.tensor(sorted({pad_id, bos_id} - {eos_id}), device=device)
    never_or_eos = torch.tensor(sorted({pad_id, bos_id, eos_id}), device=device)  # before min_len
    beam_starts = torch.arange(0, bsz * k, k, device=device)[:, None]  # [b, 1]: sentence i's first row
    ahead = getattr(stepper, "run_ahead", None)
    step = 0
    while active.numel() > 0:
        n_act = active.numel()
        active_ids = active.tolist()
        at_limit_list = [step + 1 >= max_len[s] for s in active_ids]
        # PAD and BOS are never emitted; nor EOS before min_len (where the limit does not force it, below)
        eos_zero = step + 1 < min_len
        banned = never_or_eos if eos_zero else never
        if ahead is not None and not any(at_limit_list):  # steps until one whose EOS ranks, no limit reached and
            # the banned tokens the same (EOS's until min_len) on each: the tokens of one step at a time
            budget = min(max_len[s] for s in active_ids) - 1 - step
            ran, tokens, cands = ahead(tokens, scores, banned, eos_zero, min(budget, min_len - 1 - step)
                                       if eos_zero else budget)
            lprobs, step = None, step + ran - 1  # the last step's tokens and candidates, as if stepped alone
        else:
            lprobs, cands = stepper.step(tokens, scores, banned, at_limit_list, eos_zero)
        if cands is None:
            if any(at_limit_list):  # only EOS, with its log-probability (0 before min_len)
                at_limit = torch.tensor(at_limit_list, device=device)  # [n_act]
                forced = torch.full_like(lprobs[at_limit], float("-inf"))
                forced[..., eos_id] = lprobs[at_limit][..., eos_id] if step + 1 >= min_len else 0.0
                lprobs[at_limit] = forced
            cands = beam_candidates(lprobs, scores, eos_id, inplace=True, blocked=blocked_topk)
        top_scores, top_beam, top_tok, is_eos, cont_scores, next_beam, next_tok = cands[:7]
        continued = cands[7:]  # (src_rows, eos_any, tokens) where every sentence goes on, from the stepper
        # Finalize EOS candidates that rank among the first k (fairseq's rule).
        if bool(continued[1] if continued else is_eos[:, :k].any()):
            norm = float(step + 1) ** len_penalty
            beams, values = top_beam.tolist(), top_scores.tolist()  # read once, not per hypothesis
            for i, j in is_eos[:, :k].nonzero().tolist():
                sid = active_ids[i]
                if len(finished[sid]) < k:
                    hyp = tokens[i * k + beams[i][j], 1:].tolist()
                    finished[sid].append((values[i][j] / norm, hyp))
        # Continue with the k best non-EOS candidates.
        keep_list = [i for i, s in enumerate(active_ids) if len(finished[s]) < k and not at_limit_list[i]]
        if not keep_list:
            break
        if len(keep_list) == n_act and k == 1:  # greedy, every row kept: the rows stay in place (no reorder)
            tokens = continued[2] if continued else torch.cat([tokens, next_tok], 1)
            scores = cont_scores
            step += 1
            continue
        if len(keep_list) == n_act:  # every sentence goes on: the stepper's rows and history, or computed here
            src_rows = continued[0] if continued else (next_beam + beam_starts[:n_act]).reshape(-1)  # [n_act*k]
            tokens = (continued[2] if continued
                      else torch.cat([tokens.index_select(0, src_rows), next_tok.reshape(-1, 1)], 1))
            scores, sent_rows = cont_scores, None
        else:
            keep = torch.tensor(keep_list, device=device)  # indices into active
            src_rows = (keep[:, None] * k + next_beam[keep]).reshape(-1)  # [n_keep*k]
            tokens = torch.cat([tokens.index_select(0, src_rows), next_tok[keep].reshape(-1, 1)], 1)
            scores = cont_scores[keep]
            sent_rows = (keep[:, None] * k + torch.arange(k, device=device)).reshape(-1)
            active = active[keep]
        stepper.reorder(src_rows, sent_rows)
        step += 1
    best = [max(hyps, key=lambda h: h[0]) for hyps in finished]
    hyps = [h[1] for h in best]
    return (hyps, [h[0] for h in best]) if return_scores else hyps
