"""Scoring a sub-Transformer with inherited weights: BLEU, chrF, validation loss, latency.

BLEU and chrF are sacrebleu's corpus scores on detokenized text (SentencePiece decoding),
with sacrebleu's default ``13a`` tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu
import torch

from nas.data import EOS_ID, TokenBatcher, Tokenizer
from nas.model.decode import beam_search
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch
from nas.model.losses import label_smoothed_nll

__all__ = ["translate", "corpus_scores", "valid_loss", "encode_sources", "Scores"]


@dataclass(frozen=True)
class Scores:
    bleu: float
    """sacrebleu corpus BLEU (0-100)."""
    chrf: float
    """sacrebleu corpus chrF (0-100)."""


def encode_sources(tokenizer: Tokenizer, sentences: list[str], max_len: int) -> list[list[int]]:
    """Token ids of raw sentences as the decoder reads them: each cut to ``max_len - 1`` ids, then EOS."""
    return [ids[: max_len - 1] + [EOS_ID] for ids in tokenizer.encode(sentences)]


@torch.no_grad()
def translate(model: SuperTransformer, tokenizer: Tokenizer, sentences: list[str], arch: Arch | None = None, *,
              beam_size: int = 4, batch_size: int = 64) -> list[str]:
    """Translate raw sentences with beam search; returns detokenized strings in input order.

    Sentences are decoded in batches of up to ``batch_size``, sorted by length to limit padding.
    """
    model.eval()
    ids = encode_sources(tokenizer, sentences, model.max_positions // 2)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[list[int]] = [[] for _ in ids]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(ids[i]) for i in chunk)
        src = torch.zeros(len(chunk), width, dtype=torch.long)  # [b, s], PAD = 0
        for row, i in enumerate(chunk):
            src[row, : len(ids[i])] = torch.tensor(ids[i])
        src = src.to(next(model.parameters()).device)
        for i, hyp in zip(chunk, beam_search(model, src, arch, beam_size=beam_size)):
            out[i] = hyp
    return tokenizer.decode(out)


def corpus_scores(hypotheses: list[str], references: list[str]) -> Scores:
    """Corpus BLEU and chrF (sacrebleu) of detokenized hypotheses against one reference each."""
    return Scores(bleu=sacrebleu.corpus_bleu(hypotheses, [references]).score,
                  chrf=sacrebleu.corpus_chrf(hypotheses, [references]).score)


@torch.no_grad()
def valid_loss(model: SuperTransformer, src_ids: list[list[int]], tgt_ids: list[list[int]], arch: Arch | None = None,
               *, max_tokens: int = 4096) -> float:
    """Mean negative log-likelihood per target token (nats, no label smoothing)."""
    model.eval()
    total, tokens = 0.0, 0
    device = next(model.parameters()).device
    for batch in TokenBatcher(src_ids, tgt_ids, max_tokens, shuffle=False).batches(0):
        batch = batch.to(device)
        _, nll = label_smoothed_nll(model(batch.src, batch.tgt_in, arch), batch.tgt_out, 0.0)
        total, tokens = total + float(nll), tokens + batch.ntokens
    return total / max(tokens, 1)
