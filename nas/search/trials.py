"""The two Ray Tune trainables of a sweep: supernet training and inherited-weight scoring.

Both run inside Ray worker processes and report through ``ray.tune.report``; MLflow is
written by the driver (:mod:`nas.search.callbacks`), so there is one writer per database.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ray import tune

from nas.data import PreparedData
from nas.evaluate import corpus_scores, latency_ms, translate, valid_loss
from nas.model.io import load_model
from nas.model.supernet import SuperTransformer, count_params, extract
from nas.space.space import SearchSpace
from nas.space.spec import SweepSpec

__all__ = ["SweepContext", "train_trial", "score_trial", "DefineByRun", "score_arch"]


@dataclass(frozen=True)
class SweepContext:
    """What every trial of a sweep needs (small and picklable: paths and the validated spec)."""

    spec: SweepSpec
    data: PreparedData
    supernet_dir: Path


def train_trial(config: dict[str, Any], *, ctx: SweepContext) -> None:
    """Ray Tune trainable: train the supernet (resuming from its checkpoint) and report metrics."""
    from trainers import train_supernet

    train_supernet(ctx.spec, ctx.data, ctx.supernet_dir, report=tune.report, progress=False)


@functools.lru_cache(maxsize=2)
def _supernet(directory: str) -> SuperTransformer:
    """Load once per worker process (Ray reuses actors between trials)."""
    return load_model(directory, "supernet")


def score_arch(model: SuperTransformer, arch, spec: SweepSpec, data: PreparedData) -> dict[str, float]:
    """Score a sub-Transformer with inherited weights on the validation set.

    Returns ``bleu``, ``chrf`` (sacrebleu, detokenized, beam search with ``search.beam_size``),
    ``valid_loss`` (nats/token), ``params_m`` (millions, the extracted model's parameters) and
    ``latency_ms`` (median ms per sentence at batch size 1 over ``search.latency_sentences``).
    """
    se = spec.search
    src_text, refs = data.valid_text()
    src_ids, tgt_ids = data.load_split("valid")
    n = se.valid_sentences or len(src_text)
    tokenizer = data.tokenizer()
    hyps = translate(model, tokenizer, src_text[:n], arch, beam_size=se.beam_size)
    scores = corpus_scores(hyps, refs[:n])
    return {
        "bleu": scores.bleu,
        "chrf": scores.chrf,
        "valid_loss": valid_loss(model, src_ids[:n], tgt_ids[:n], arch, max_tokens=spec.train.max_tokens),
        "params_m": count_params(extract(model, arch)) / 1e6,
        "latency_ms": latency_ms(model, tokenizer, src_text[: se.latency_sentences], arch, beam_size=se.beam_size),
    }


def score_trial(config: dict[str, Any], *, ctx: SweepContext) -> None:
    """Ray Tune trainable: the arch Optuna sampled (``config``), scored with inherited weights."""
    torch.set_num_threads(max(1, int(ctx.spec.search.cpu_per_trial)))
    arch = SearchSpace.from_spec(ctx.spec).from_params(config)
    metrics = score_arch(_supernet(str(ctx.supernet_dir)), arch, ctx.spec, ctx.data)
    tune.report({**metrics, "arch": arch.to_json(), "arch_id": arch.arch_id, "arch_summary": arch.summary()})


class DefineByRun:
    """Optuna define-by-run space for Ray's ``OptunaSearch`` (a picklable callable)."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space

    def __call__(self, trial) -> None:
        self.space.suggest(trial)
