"""The sweep YAML's ``retrain:`` section: the recipe ``nas retrain`` trains one sub-Transformer with, alone.

HAT's protocol (Wang et al. 2020, sec. 4) retrains the sub-Transformer a search found from scratch with the
recipe of the hand-designed baseline it is compared with; a baseline given as an arch (``nas retrain --arch``)
trains through the same recipe. Every key left out takes the supernet training's value (``train.*``,
``supernet.dropout``), so an empty section retrains with the sweep's own settings.

Pydantic and the standard library only: no torch, Ray, Optuna or MLflow.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RetrainSpec"]


class RetrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int | None = Field(None, ge=1)
    """Optimizer steps (default ``train.steps``)."""
    lr: float | None = Field(None, gt=0)
    """Peak learning rate of the inverse-square-root schedule (default ``train.lr``)."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear warm-up steps (default ``train.warmup_steps``; 0: the peak rate from the first step, no decay)."""
    warmup_init_lr: float | None = Field(None, ge=0.0)
    """Learning rate of the first step, the warm-up's start (fairseq ``--warmup-init-lr``; Transformer-Tiny: 1e-7;
    default ``train.warmup_init_lr``)."""
    clip_norm: float | None = Field(None, ge=0.0)
    """Gradient clipping, max global L2 norm; 0: none, fairseq's default and Transformer-Tiny's recipe (default
    ``train.clip_norm``)."""
    accumulate: int | None = Field(None, ge=1)
    """Batches per optimizer step (gradient accumulation, fairseq ``--update-freq``): ``max_tokens: 4096`` with
    ``accumulate: 2`` is Transformer-Tiny's 8,192 tokens per update on one device (default ``train.accumulate``)."""
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    """Residual, FFN and embedding dropout of the model (default ``supernet.dropout``)."""
    label_smoothing: float | None = Field(None, ge=0.0, lt=1.0)
    """Label smoothing of the cross-entropy (default ``train.label_smoothing``)."""
    max_tokens: int | None = Field(None, ge=8)
    """Padded tokens per batch (default ``train.max_tokens``); ``train.accumulate`` batches make one step."""
    drop_branch: float | None = Field(None, ge=0.0, lt=1.0)
    """MAT drop-branch rate rho (default the supernet training's, ``train.drop_branch``); 0 for a recipe without it,
    e.g. a hand-designed baseline's."""
    seed: int = 0
    """Seed of the initialisation (``init: scratch``), the data order, dropout and drop-branch."""
    init: Literal["scratch", "inherited"] = "scratch"
    """``scratch``: fresh weights (HAT's protocol); ``inherited``: the supernet's crop of the arch, then the whole
    recipe (``search.finetune`` stays the short screening of the search)."""
    average_last: int = Field(1, ge=1)
    """Average the weights of the newest N checkpoints into the final model (fairseq ``average_checkpoints``;
    1: the last weights as they are)."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Steps between checkpoints, the points a killed run resumes from and that ``average_last`` averages
    (default ``train.checkpoint_every``)."""
    beam_size: int | None = Field(None, ge=1)
    """Beams of the final scoring (validation and test BLEU; Transformer-Tiny: 5; default ``search.beam_size``)."""
    length_penalty: float | None = Field(None, ge=0.0)
    """Length penalty of that beam search, hypotheses ranked by ``sum log p / len**length_penalty`` (fairseq
    ``--lenpen``; Transformer-Tiny: 1.0; default 1.0, fairseq's)."""

    def resolved(self, spec: Any) -> dict[str, Any]:
        """The effective recipe: every key with the value it takes for ``spec`` (the :class:`~nas.space.SweepSpec`
        holding this section; defaults filled in), JSON-ready. (Typed ``Any``: the schema imports this module.)"""
        tr = spec.train
        return {"steps": self.steps or tr.steps, "lr": self.lr or tr.lr,
                "warmup_steps": tr.warmup_steps if self.warmup_steps is None else self.warmup_steps,
                "warmup_init_lr": tr.warmup_init_lr if self.warmup_init_lr is None else self.warmup_init_lr,
                "dropout": spec.supernet.dropout if self.dropout is None else self.dropout,
                "label_smoothing": tr.label_smoothing if self.label_smoothing is None else self.label_smoothing,
                "max_tokens": self.max_tokens or tr.max_tokens, "accumulate": self.accumulate or tr.accumulate,
                "seed": self.seed,
                "init": self.init, "average_last": self.average_last,
                "checkpoint_every": self.checkpoint_every or tr.checkpoint_every,
                "clip_norm": tr.clip_norm if self.clip_norm is None else self.clip_norm,
                "beam_size": self.beam_size or spec.search.beam_size,
                "length_penalty": 1.0 if self.length_penalty is None else self.length_penalty, "weight_decay": tr.weight_decay, "precision": tr.precision,
                "drop_branch": spec.drop_branch if self.drop_branch is None else self.drop_branch, "drop_branch_warmup": tr.drop_branch_warmup}

    def training_spec(self, spec: Any) -> Any:
        """``spec`` with ``train.*`` set to this recipe, as :func:`trainers.train_standalone` reads it: steps, lr,
        warm-up (and its initial rate), clipping, label smoothing, batch size and accumulation, drop-branch and the data-order seed; no width dropout or dropout range (they are
        supernet options). The model's dropout is set on the model (``dropout``)."""
        r = self.resolved(spec)
        train = spec.train.model_copy(update={
            "steps": r["steps"], "lr": r["lr"], "warmup_steps": max(r["warmup_steps"], 1),
            "warmup_init_lr": r["warmup_init_lr"], "clip_norm": r["clip_norm"], "accumulate": r["accumulate"],
            "label_smoothing": r["label_smoothing"], "max_tokens": r["max_tokens"], "seed": r["seed"],
            "checkpoint_every": r["checkpoint_every"], "width_dropout": None, "dropout_range": None,
            "drop_branch": r["drop_branch"]})
        return spec.model_copy(update={"train": train})
