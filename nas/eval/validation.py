"""The validation score of a sub-Transformer: one recipe for the search, the trainer, fidelity and fine-tuning.

:func:`validation_scores` translates the validation sources (beam search), scores the translations with
sacrebleu (BLEU and chrF, :func:`nas.eval.scores.corpus_scores`) and computes the teacher-forced validation
loss (nats per target token, no label smoothing), with the numbers of :func:`~nas.eval.scores.translate`,
:func:`~nas.eval.scores.corpus_scores` and :func:`~nas.eval.scores.valid_loss` on the same sentences.

A :class:`ValidationSet` holds what every call shares, built once: the first N sentence pairs (text, ids), the
tokenizer, the encoded and padded source batches of each source length bound, and the loss batches of each
``max_tokens`` and device. A search that scores a thousand candidates on a 200-sentence subset reads no file
and tokenizes nothing after the first call::

    vset = ValidationSet.load(data, sentences=200)
    for arch in candidates:
        scores = validation_scores(supernet, arch, vset, beam_size=None)  # loss only: {"valid_loss": ...}
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nas.data import Batch, PreparedData, TokenBatcher, TokenCorpus, Tokenizer
from nas.eval.scores import corpus_scores, encode_sources, nll_per_token, paper_bleu, source_batches
from nas.model.decode import beam_search
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

__all__ = ["ValidationSet", "validation_scores"]

BATCH_SENTENCES = 64
"""Sentences per beam-search batch (:func:`nas.eval.scores.translate`'s default ``batch_size``)."""


class ValidationSet:
    """Validation sentence pairs loaded once, with the batches every :func:`validation_scores` call reuses.

    Attributes:
        src_text: the raw source sentences (stripped).
        refs: one reference translation per source.
        corpus: their token ids (:class:`~nas.data.TokenCorpus`, no BOS/EOS), or None (BLEU/chrF only: a test set
            read from text files).
        tokenizer: the joint SentencePiece tokenizer.

    Raises:
        ValueError: the sides differ in length.
    """

    def __init__(self, src_text: Sequence[str], refs: Sequence[str], corpus: TokenCorpus | None,
                 tokenizer: Tokenizer) -> None:
        if len(src_text) != len(refs) or (corpus is not None and len(corpus) != len(src_text)):
            raise ValueError(f"{len(src_text)} sources, {len(refs)} references and "
                             f"{'no' if corpus is None else len(corpus)} token pairs; give as many of each")
        self.src_text, self.refs, self.corpus, self.tokenizer = list(src_text), list(refs), corpus, tokenizer
        self._sources: dict[tuple[int, int], list[tuple[list[int], torch.Tensor]]] = {}
        self._losses: dict[tuple[int, str], list[Batch]] = {}

    @classmethod
    def load(cls, data: PreparedData, sentences: int | None = None) -> "ValidationSet":
        """The first ``sentences`` validation pairs of ``data`` (None: all; more than there are: all).

        Raises:
            ValueError: ``sentences`` < 1.
            DataError: the validation file is unreadable (names it).
        """
        if sentences is not None and sentences < 1:
            raise ValueError(f"sentences={sentences}: score at least 1 validation sentence (None: all)")
        src_text, refs = data.valid_text()
        n = len(src_text) if sentences is None else min(sentences, len(src_text))
        return cls(src_text[:n], refs[:n], _first(data.corpus("valid"), n), data.tokenizer())

    @classmethod
    def from_text(cls, src_text: Sequence[str], refs: Sequence[str], tokenizer: Tokenizer) -> "ValidationSet":
        """Sentence pairs from text alone (e.g. a test set): BLEU and chrF only, no loss."""
        return cls(src_text, refs, None, tokenizer)

    def __len__(self) -> int:
        """Sentence pairs."""
        return len(self.src_text)

    @property
    def size(self) -> int:
        """Sentence pairs (``len``)."""
        return len(self)

    def source_batches(self, max_len: int,
                       batch_size: int = BATCH_SENTENCES) -> list[tuple[list[int], torch.Tensor]]:
        """The non-blank sources as :func:`~nas.eval.scores.translate` batches them for a model of
        ``max_positions = 2 * max_len``: (sentence indices, ``src [b, s]`` int64 on the CPU), built on the first
        call for each ``(max_len, batch_size)``."""
        key = (max_len, batch_size)
        if key not in self._sources:
            ids = encode_sources(self.tokenizer, self.src_text, max_len)
            todo = [i for i, text in enumerate(self.src_text) if text.strip()]
            self._sources[key] = list(source_batches(ids, todo, None, batch_size))
        return self._sources[key]

    def loss_batches(self, max_tokens: int, device: torch.device) -> list[Batch]:
        """The pairs as :func:`~nas.eval.scores.valid_loss` batches them (``max_tokens`` per batch, sorted by
        length, not shuffled), on ``device``; built on the first call for each ``(max_tokens, device)``.

        Raises:
            ValueError: the set has no token ids (:meth:`from_text`).
        """
        if self.corpus is None:
            raise ValueError("this ValidationSet was built from text alone and has no token ids for a loss; "
                             "load it with ValidationSet.load(data), or pass loss=False")
        key = (max_tokens, str(device))
        if key not in self._losses:
            batcher = TokenBatcher(self.corpus, max_tokens, shuffle=False)
            self._losses[key] = [batch.to(device) for batch in batcher.batches(0)]
        return self._losses[key]

    def translate(self, model: SuperTransformer, arch: Arch | None, beam_size: int,
                  len_penalty: float = 1.0) -> list[str]:
        """Detokenized translations of the sources in order (beam search, ``beam_size`` beams, hypotheses ranked by
        ``sum log p / len**len_penalty``; a blank source gives ""), equal to :func:`nas.eval.scores.translate` of
        :attr:`src_text`."""
        model.eval()
        out: list[list[int]] = [[] for _ in self.src_text]
        device = next(model.parameters()).device
        with torch.no_grad():
            for chunk, src in self.source_batches(model.max_positions // 2):
                hyps = beam_search(model, src.to(device), arch, beam_size=beam_size, len_penalty=len_penalty)
                for i, hyp in zip(chunk, hyps):
                    out[i] = hyp
        return self.tokenizer.decode(out)


def _first(corpus: TokenCorpus, n: int) -> TokenCorpus:
    """The first ``n`` pairs of ``corpus`` (views: the offsets of a prefix are a prefix of the offsets)."""
    return TokenCorpus(corpus.src_values, corpus.src_offsets[:n + 1], corpus.tgt_values, corpus.tgt_offsets[:n + 1],
                       owner=corpus)


def validation_scores(model: SuperTransformer, arch: Arch | None, vset: ValidationSet, *, beam_size: int | None = 4,
                      len_penalty: float = 1.0, paper_lang: str | None = None, loss: bool = True,
                      max_tokens: int = 4096) -> dict[str, float]:
    """Validation scores of ``arch`` run by ``model`` (a supernet, or a standalone model of that arch) on ``vset``.

    Returns:
        ``bleu`` and ``chrf`` (sacrebleu corpus scores, 0-100, of the detokenized beam-search translations with
        ``beam_size`` beams, length penalty ``len_penalty``; 1: greedy; None: not computed); with ``paper_lang``
        (the target language's Moses code, e.g. ``de``) also ``bleu_paper`` of the same translations (lowercased,
        Moses-tokenized BLEU as the fairseq papers report it, :func:`nas.eval.scores.paper_bleu`); and, when
        ``loss``, ``valid_loss`` (teacher-forced negative log-likelihood per target token, nats, no label
        smoothing; batches of ``max_tokens`` padded tokens). Leaves ``model`` in eval mode.

    Raises:
        ValueError: ``loss`` on a set without token ids (:meth:`ValidationSet.from_text`); ``arch`` exceeds the
            model's maxima.
    """
    scores: dict[str, float] = {}
    if beam_size is not None:
        hypotheses = vset.translate(model, arch, beam_size, len_penalty)
        quality = corpus_scores(hypotheses, vset.refs)
        scores["bleu"], scores["chrf"] = quality.bleu, quality.chrf
        if paper_lang is not None:
            scores["bleu_paper"] = paper_bleu(hypotheses, vset.refs, paper_lang)
    if loss:
        model.eval()
        device = next(model.parameters()).device
        scores["valid_loss"] = nll_per_token(model, vset.loss_batches(max_tokens, device), arch)
    return scores
