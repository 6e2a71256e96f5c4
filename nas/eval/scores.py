"""Scoring a sub-Transformer with inherited weights: BLEU, chrF, validation loss, latency.

BLEU and chrF are sacrebleu's corpus scores on detokenized text (SentencePiece decoding),
with sacrebleu's default ``13a`` tokenization.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import sacrebleu
import torch

from nas.data import EOS_ID, Batch, TokenBatcher, Tokenizer, length_batches
from nas.model.decode import beam_search
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch
from nas.model.losses import label_smoothed_nll

__all__ = ["translate", "corpus_scores", "valid_loss", "nll_per_token", "encode_sources", "length_batches",
           "source_batches", "Scores"]


@dataclass(frozen=True)
class Scores:
    bleu: float
    """sacrebleu corpus BLEU (0-100)."""
    chrf: float
    """sacrebleu corpus chrF (0-100)."""


def encode_sources(tokenizer: Tokenizer, sentences: list[str], max_len: int) -> list[list[int]]:
    """Token ids of raw sentences as the decoder reads them: each cut to ``max_len - 1`` ids, then EOS."""
    return [ids[: max_len - 1] + [EOS_ID] for ids in tokenizer.encode(sentences)]


def source_batches(ids: list[list[int]], todo: list[int], max_tokens: int | None,
                   batch_size: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """The sentences ``todo`` (indices into ``ids``, encoded sources) in :func:`length_batches` order: per batch
    its indices and ``src [b, s]`` int64, right-padded with PAD = 0 (what :func:`translate` decodes)."""
    for batch in length_batches([len(ids[i]) for i in todo], max_tokens, batch_size):
        chunk = [todo[j] for j in batch]
        width = max(len(ids[i]) for i in chunk)
        src = torch.zeros(len(chunk), width, dtype=torch.long)  # [b, s], PAD = 0
        for row, i in enumerate(chunk):
            src[row, : len(ids[i])] = torch.tensor(ids[i])
        yield chunk, src


@torch.no_grad()
def translate(model: SuperTransformer, tokenizer: Tokenizer, sentences: list[str], arch: Arch | None = None, *,
              beam_size: int = 4, batch_size: int = 64, max_tokens: int | None = None,
              on_batch: Callable[[int, int], None] | None = None) -> list[str]:
    """Translate raw sentences with beam search; returns detokenized strings in input order.

    Sentences are sorted by length and decoded in batches of up to ``batch_size`` sentences and, with
    ``max_tokens``, up to that many padded source tokens (:func:`length_batches`). An empty (or blank)
    sentence translates to an empty string without being decoded. ``on_batch(sentences, target_tokens)`` is
    called after each batch (a progress bar, a throughput count; target tokens are SentencePiece pieces,
    EOS not counted).
    """
    model.eval()
    ids = encode_sources(tokenizer, sentences, model.max_positions // 2)
    out: list[list[int]] = [[] for _ in ids]
    todo = [i for i, text in enumerate(sentences) if text.strip()]
    if on_batch is not None and len(todo) < len(ids):
        on_batch(len(ids) - len(todo), 0)
    device = next(model.parameters()).device
    for chunk, src in source_batches(ids, todo, max_tokens, batch_size):
        hyps = beam_search(model, src.to(device), arch, beam_size=beam_size)
        for i, hyp in zip(chunk, hyps):
            out[i] = hyp
        if on_batch is not None:
            on_batch(len(chunk), sum(map(len, hyps)))
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
    device = next(model.parameters()).device
    batches = (batch.to(device) for batch in TokenBatcher(src_ids, tgt_ids, max_tokens, shuffle=False).batches(0))
    return nll_per_token(model, batches, arch)


@torch.no_grad()
def nll_per_token(model: SuperTransformer, batches: Iterable[Batch], arch: Arch | None = None) -> float:
    """Teacher-forced negative log-likelihood of ``batches`` (on the model's device) per target token (nats, no
    label smoothing): the sum over every batch divided by their label tokens (:func:`valid_loss`'s)."""
    total, tokens = 0.0, 0
    for batch in batches:
        _, nll = label_smoothed_nll(model(batch.src, batch.tgt_in, arch), batch.tgt_out, 0.0)
        total, tokens = total + float(nll), tokens + batch.ntokens
    return total / max(tokens, 1)
