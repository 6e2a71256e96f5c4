"""Scoring a sub-Transformer with inherited weights: BLEU, chrF, validation loss, latency.

BLEU and chrF are sacrebleu's corpus scores on detokenized text (SentencePiece decoding),
with sacrebleu's default ``13a`` tokenization: the primary figures. :func:`paper_bleu` is the BLEU the
fairseq papers report on Multi30k (lowercased, Moses-tokenized), for comparison with their tables only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sacrebleu
import torch

from nas.data import EOS_ID, PAD_ID, Batch, TokenBatcher, Tokenizer, length_batches
from nas.model.decode import beam_search
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

__all__ = ["translate", "corpus_scores", "paper_bleu", "file_language", "PAPER_BLEU_LABEL", "valid_loss",
           "nll_per_token", "target_nll", "encode_sources", "length_batches", "source_batches", "Scores"]

PAPER_BLEU_LABEL = "BLEU (lowercased, Moses-tokenized, as Wu et al.)"
"""How :func:`paper_bleu` (metric ``bleu_paper``) is named wherever it is printed."""


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
              beam_size: int = 4, len_penalty: float = 1.0, batch_size: int = 64, max_tokens: int | None = None,
              on_batch: Callable[[int, int], None] | None = None,
              search: Callable[[torch.Tensor], list[list[int]]] | None = None) -> list[str]:
    """Translate raw sentences with beam search (``beam_size`` beams, hypotheses ranked by
    ``sum log p / len**len_penalty``, :func:`~nas.model.decode.beam_search`); returns detokenized strings in input
    order.

    Sentences are sorted by length and decoded in batches of up to ``batch_size`` sentences and, with
    ``max_tokens``, up to that many padded source tokens (:func:`length_batches`). An empty (or blank)
    sentence translates to an empty string without being decoded. ``on_batch(sentences, target_tokens)`` is
    called after each batch (a progress bar, a throughput count; target tokens are SentencePiece pieces,
    EOS not counted). ``search(src [b, s]) -> ids`` replaces the model's beam search (the AOT-compiled decoder of
    :class:`nas.export.aot.AotTranslator`).
    """
    model.eval()
    ids = encode_sources(tokenizer, sentences, model.max_positions // 2)
    out: list[list[int]] = [[] for _ in ids]
    todo = [i for i, text in enumerate(sentences) if text.strip()]
    if on_batch is not None and len(todo) < len(ids):
        on_batch(len(ids) - len(todo), 0)
    device = next(model.parameters()).device
    for chunk, src in source_batches(ids, todo, max_tokens, batch_size):
        if search is not None:
            hyps = search(src.to(device))
        else:
            hyps = beam_search(model, src.to(device), arch, beam_size=beam_size, len_penalty=len_penalty)
        for i, hyp in zip(chunk, hyps):
            out[i] = hyp
        if on_batch is not None:
            on_batch(len(chunk), sum(map(len, hyps)))
    return tokenizer.decode(out)


def corpus_scores(hypotheses: list[str], references: list[str]) -> Scores:
    """Corpus BLEU and chrF (sacrebleu) of detokenized hypotheses against one reference each."""
    return Scores(bleu=sacrebleu.corpus_bleu(hypotheses, [references]).score,
                  chrf=sacrebleu.corpus_chrf(hypotheses, [references]).score)


def paper_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
    """Corpus BLEU (0-100) as the fairseq papers on Multi30k report it: hypotheses and references lowercased and
    Moses-tokenized (sacremoses' port of ``tokenizer.perl -l lang``, no HTML escaping), then 4-gram BLEU over
    those tokens (sacrebleu with ``tokenize="none"``: the whitespace-token BLEU4 that ``fairseq-generate`` prints).

    This is how Wu et al. (ACL 2021; fairseq; Transformer-Tiny 41.02 on Multi30k En-De) score: their Multi30k text
    is lowercased and Moses-tokenized before training, and BLEU is computed on that text. The figure is not
    sacreBLEU on raw text (:func:`corpus_scores`, the primary figure here) and is usually higher: casing errors
    no longer count, and Moses splits punctuation and clitics differently from sacreBLEU's ``13a``. Use it only to
    compare with such papers' tables. Moses' punctuation normalisation (``normalize-punctuation.perl``), which
    some Multi30k preparations also run, is not applied.

    Args:
        hypotheses, references: detokenized text, one reference per hypothesis.
        lang: the target language's Moses code (``de``, ``fr``, ``en``...; :func:`file_language`): its list of
            non-breaking prefixes (``z.B.``) and its apostrophe rules; an unknown code tokenizes without them.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses and {len(references)} references; give one reference each")
    from sacremoses import MosesTokenizer  # on first use: only `nas retrain` reports this figure

    moses = MosesTokenizer(lang=lang)

    def tokenized(text: str) -> str:
        return moses.tokenize(text.lower(), escape=False, return_str=True)

    return sacrebleu.corpus_bleu([tokenized(h) for h in hypotheses], [[tokenized(r) for r in references]],
                                 tokenize="none", force=True).score


_LANGUAGE_SUFFIX = re.compile(r"[a-z]{2}")
_COMPRESSED = {".gz", ".bz2", ".xz", ".zst"}


def file_language(path: str | Path, default: str = "en") -> str:
    """The language code in a corpus file name, ``<name>.<lang>[.gz]`` (``train.de.gz`` -> ``de``, ``val.fr`` ->
    ``fr``): the last suffix, after dropping a compression suffix, when it is two lowercase letters (an ISO 639-1
    code, as Moses names its languages); else ``default`` (Moses' own default, ``en``: ``train.txt``, ``tgt``)."""
    suffixes = [s for s in Path(path).suffixes if s not in _COMPRESSED]
    code = suffixes[-1][1:] if suffixes else ""
    return code if _LANGUAGE_SUFFIX.fullmatch(code) else default


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
        total, tokens = total + float(target_nll(model, batch, arch)), tokens + batch.ntokens
    return total / max(tokens, 1)


def target_nll(model: SuperTransformer, batch: Batch, arch: Arch | None = None) -> torch.Tensor:
    """The summed negative log-likelihood (nats, float32 scalar) of ``batch.tgt_out [b, t]``'s non-pad tokens,
    teacher-forced: ``sum(logsumexp(z) - z_y)`` over them, with ``z`` the logits of the tied output layer computed for
    those positions only.

    The same figure as :func:`nas.model.losses.label_smoothed_nll`'s plain NLL of the full ``[b, t, V]`` logits
    (what this computed before, and what ``torch.nn.functional.cross_entropy`` with ``ignore_index=PAD_ID`` gives),
    without the padding's logits and the ``[b, t, V]`` log-softmax: level 1 scores each candidate by it, and the
    output layer and its log-softmax over V = 6,000 words were about half of a candidate's time (``cProfile`` of
    the quickstart's level 1 on a 2-core CPU).
    """
    mask = batch.tgt_out.ne(PAD_ID)
    hidden = model(batch.src, batch.tgt_in, arch, features=True)[mask]  # [N, E], N the non-pad target tokens
    logits = torch.nn.functional.linear(hidden, model.embed.weight).float()  # [N, V]
    target = batch.tgt_out[mask].unsqueeze(-1)
    return (torch.logsumexp(logits, dim=-1) - logits.gather(-1, target).squeeze(-1)).sum()
