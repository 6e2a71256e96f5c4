"""The sweep YAML's ``train:`` section: supernet training (:class:`TrainSpec`) and its stages (Scalable
Transformers sec. 3.3: :class:`JointStage`, :class:`WordDistillStage`, :class:`SeqDistillStage`, in
:data:`STAGE_ORDER`). Pydantic and the standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from nas.space.schema.base import StrictModel

__all__ = ["JointStage", "WordDistillStage", "SeqDistillStage", "StageSpec", "STAGE_ORDER", "TrainSpec"]


class JointStage(StrictModel):
    """Stage 1 of Scalable Transformers (sec. 3.3, eq. 4): the widest, the narrowest and ``sandwich_k``
    random sub-Transformers all learn from the ground truth."""
    name: Literal["joint"]
    steps: int = Field(..., ge=1)
    """Optimizer steps of this stage."""


class WordDistillStage(StrictModel):
    """Stage 2 of Scalable Transformers (sec. 3.3, the L_2 loss annealed by eq. 5): the widest learns from
    the ground truth; every other sub-Transformer from ``lambda_2 * ground truth + (1 - lambda_2) * the
    widest's word distribution`` of the same step."""
    name: Literal["word_distill"]
    steps: int = Field(..., ge=1)
    """Optimizer steps of this stage."""
    lambda_start: float = Field(1.0, ge=0.0, le=1.0)
    """lambda_2 at the stage's first step (eq. 5: 1)."""
    lambda_end: float = Field(0.5, ge=0.0, le=1.0)
    """lambda_2 from step ``lambda_steps`` of the stage on (eq. 5: 0.5)."""
    lambda_steps: int | None = Field(None, ge=0)
    """t_j of eq. 5: steps (counted from the stage's start) over which lambda_2 goes linearly from
    ``lambda_start`` to ``lambda_end``; default: half the stage's ``steps``, so lambda_2 holds its plateau
    for the second half (the paper gives no value for t_j); 0: ``lambda_end`` throughout."""

    @model_validator(mode="after")
    def _check_lambda_steps(self) -> "WordDistillStage":
        if self.lambda_steps is not None and self.lambda_steps > self.steps:
            raise ValueError(f"lambda_steps={self.lambda_steps} is above the stage's steps={self.steps}, so "
                             f"lambda_end is never reached; lower lambda_steps or leave it out (the whole stage)")
        return self


class SeqDistillStage(StrictModel):
    """Stage 3 of Scalable Transformers (sec. 3.3, eq. 6): at the stage's start the widest translates the
    training sources with beam search (sec. 4.1: beam 4, length penalty 0.6) into distillation targets
    (Parquet, resumable); then the widest learns from those targets alone and every other sub-Transformer
    from ``lambda_3 * targets + (1 - lambda_3) * the widest's word distribution`` of the same step."""
    name: Literal["seq_distill"]
    steps: int = Field(..., ge=1)
    """Optimizer steps of this stage."""
    lambda_3: float = Field(0.1, ge=0.0, le=1.0)
    """Weight of the beam-search targets for the sub-Transformers (eq. 6). 0.1, the value of the paper's
    text (sec. 3.3); its Table 4 lists 0.9. We follow the text, which states the value with the equation
    it belongs to; no run here has compared the two, so set 0.9 to follow the table."""
    beam_size: int = Field(4, ge=1)
    """Beam size of the widest when writing the targets (sec. 4.1: 4)."""
    length_penalty: float = Field(0.6, ge=0.0)
    """Length penalty of that beam search (sec. 4.1: 0.6): hypotheses ranked by ``log p / len**length_penalty``."""
    max_length: int = Field(250, ge=1)
    """Targets longer than this (subword tokens) are dropped (sec. 4.1: 250 words)."""
    max_length_ratio: float = Field(20.0, gt=0.0)
    """Pairs whose source/target or target/source length ratio exceeds this are dropped (sec. 4.1: 20)."""
    max_sentences: int | None = Field(None, ge=1)
    """Translate only the first N training pairs (a budget for CPU runs); default: all of them."""
    batch_size: int = Field(64, ge=1)
    """Sentences per beam-search batch while writing the targets."""


StageSpec = Annotated[Union[JointStage, WordDistillStage, SeqDistillStage], Field(discriminator="name")]
"""One training stage, chosen by ``name``."""
STAGE_ORDER = ("joint", "word_distill", "seq_distill")
"""Stage names in the order the paper runs them (sec. 3.3); ``train.stages`` must keep it."""


class TrainSpec(StrictModel):
    steps: int = Field(3000, ge=1)
    """Optimizer steps of supernet training; with ``stages`` it may be left out (the sum of their steps)."""
    stages: list[StageSpec] | None = Field(None, min_length=1)
    """Training stages in order, e.g. ``[{name: joint, steps: 2000}, {name: word_distill, steps: 1000}]``
    (Scalable Transformers sec. 3.3); default: one joint stage of ``steps`` steps."""
    width_dropout: dict[int, float] | None = None
    """Dropout rate per model width (channels -> rate in [0, 1)), passed (as ``Regularization.dropout``) to every forward while a
    sub-Transformer of that width runs, e.g. ``{256: 0.0, 512: 0.1, 1024: 0.3}`` (Scalable Transformers
    sec. 4.1, appendix Table 5). The width is ``model_width`` (type 1), else ``supernet.model_dim``;
    every width of the space needs a rate. Default: ``supernet.dropout`` for all."""
    max_tokens: int = Field(4096, ge=8)
    """Padded tokens per batch (source or target side, whichever is longer)."""
    accumulate: int = Field(1, ge=1)
    """Batches per optimizer step (gradient accumulation, fairseq's ``update_freq``): the step's
    sub-Transformers are sampled once and their gradients summed over these batches, normalised by
    the step's target tokens, so ``accumulate: 2`` equals one batch of twice ``max_tokens``."""
    stage_eval: bool = True
    """At the end of each stage, log validation BLEU/chrF (beam ``eval_beam_size``) of the reference
    sub-Transformers: the narrowest, the middle and the widest of the space."""
    lr: float = Field(5e-4, gt=0)
    """Peak learning rate, reached after ``warmup_steps``; then inverse square root decay."""
    warmup_steps: int = Field(400, ge=1)
    warmup_init_lr: float = Field(0.0, ge=0.0)
    """Learning rate of the first step, from which the warm-up rises linearly to ``lr`` (fairseq's
    ``--warmup-init-lr`` of the ``inverse_sqrt`` schedule; Transformer-Tiny's recipe: 1e-7). 0: the rate rises
    from ``lr / warmup_steps``."""
    sandwich_k: int = Field(1, ge=0)
    """Random sub-Transformers per step besides the widest and the narrowest (sandwich rule)."""
    inplace_distill: bool = False
    """In-place distillation in the ``joint`` stage from its first step (BigNAS sec. 3.1; OFA): every
    sub-Transformer of a step but the widest learns from ``distill_lambda * ground truth + (1 - distill_lambda)
    * the widest's word distribution`` (Scalable Transformers' L_2 form), the teacher being the widest of the
    step's layout, its logits of the same forward pass reused (detached: no extra forward). Off: eq. 4.

    The teacher is the step's first sub-Transformer, the widest of the layout whose turn it is
    (:class:`~trainers.stages.base.SandwichArchs`), which in a space with several layouts is not always the
    step's largest child: on a Prime step the teacher has Prime layers (one path each), and a random member
    with sequential layers and more paths or branches can have more parameters (13 of 5,000 uniform draws of
    ``unified.yaml``); it still learns from the teacher. In a one-layout space the widest is the largest child."""
    distill_lambda: float = Field(0.5, ge=0.0, le=1.0)
    """With ``inplace_distill``: the weight of the ground truth for the students (BigNAS: 0, the teacher's
    distribution alone)."""
    student_dropout: Literal["keep", "zero"] = "keep"
    """The regularisation of the students, the sub-Transformers of a distilling step but the teacher (the joint
    stage with ``inplace_distill``; the ``word_distill`` and ``seq_distill`` stages). ``keep`` (default): each
    runs with the dropout, attention dropout and drop-branch of the others (``supernet.dropout``,
    ``width_dropout`` or ``dropout_range``; ``drop_branch``). ``zero``: they run with all three at 0 and only the
    teacher keeps its configured rates, as BigNAS regularises only the biggest child, the only one trained on the
    labels (sec. 3.1) and AttentiveNAS's ``train_attentive_nas.py`` calls ``set_dropout_rate(0, 0, ...)``
    before the smaller children. MUTE's unit-bias input noise is unchanged. Refused when nothing distils."""
    dropout_range: tuple[float, float] | None = None
    """``[min, max]``: each sub-Transformer's dropout (and drop-branch) grows with its size (Scalable
    Transformers sec. 4.1: 0 for the narrowest up to 0.3 for the widest). Its share is ``(params - params of the
    narrowest) / (params of the widest - params of the narrowest)`` over the space, its dropout
    ``min + share * (max - min)`` and its drop-branch rate ``drop_branch * dropout / max``. Keyed by parameters,
    not by a model width, so it acts in type-2 spaces (per-layer widths), where ``width_dropout`` cannot. Default:
    ``supernet.dropout`` for all. Not with ``width_dropout``. Supernet stages only: standalone training keeps
    ``supernet.dropout``."""
    balanced_sampling: bool = False
    """Draw the sandwich's random members so that every (layer, dimension, value) is trained about equally
    often, the widest and the narrowest counted: of 32 candidates (one taking each choice's least-trained value,
    31 uniform) the one with the most under-trained values is kept (:meth:`SearchSpace.sample_balanced`). Off: uniform draws, under which values never at the ends (e.g. a kernel set between the
    narrowest's and the widest's) train only through the random members."""
    drop_branch: float | None = Field(None, ge=0.0, lt=1.0)
    """MAT drop-branch rate rho (eq. 5-7), training only; on the branches and the FFN. Default: 0.1 in a
    space with branches (``SweepSpec.drop_branch``), else 0: without branches there is nothing to drop."""
    drop_branch_warmup: int = Field(0, ge=0)
    """Drop-branch schedule: rho rises linearly from 0 to ``drop_branch`` over these first steps (as
    drop-path schedules do), then stays; 0 (default): MAT's fixed rho from the first step."""
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    clip_norm: float = Field(1.0, ge=0)
    """Gradient clipping: max global L2 norm; 0: no clipping (fairseq's ``--clip-norm 0``, its default, which
    Transformer-Tiny's recipe keeps)."""
    weight_decay: float = Field(0.0, ge=0.0)
    checkpoint_every: int = Field(200, ge=1)
    """Steps between checkpoints (also written at the end)."""
    log_every: int = Field(50, ge=1)
    keep_last: int = Field(5, ge=0)
    """Model snapshots kept (one per checkpoint, newest first) for ``nas average``; 0 keeps none."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Autocast dtype for training. ``auto``: bf16 where the device computes it natively (CUDA GPUs from
    Ampere on, CPUs with AVX512-BF16 or AMX: 1.75-2x faster with the same loss curve), else fp32, since
    emulated bf16 is tens of times slower (:mod:`nas.precision`)."""
    threads: int | None = Field(None, ge=1)
    """torch threads for standalone training (None: torch's default); Ray trials use resources.cpu."""
    seed: int = 0
    proximal_init: Path | None = None
    """MAT proximal initialization (sec. 3.3): a single-branch ``*.safetensors`` whose branch 0 starts every branch."""
    unit_bias: Literal["mixed", "swap", "disorder", "mask", "identity"] = "mixed"
    """Input noise of units 1.. of every multi-unit encoder layer in training (MUTE sec. 3.2): ``swap``,
    ``disorder``, ``mask``, or ``mixed`` (unit u gets swap, disorder, mask in turn), ``identity`` for none.
    A training setting of the supernet, not a search dimension: it changes nothing at evaluation, so
    sub-Transformers that differ only in it would score identically. Decoder units get no noise."""
    unit_bias_rate: float = Field(0.85, ge=0.0, le=1.0)
    """MUTE p_beta: the rate (per sentence) at which unit biases are switched on in training (sec. 3.2;
    the paper's 0.85)."""
    autoshuffle_penalty: float = Field(0.01, ge=0.0)
    """MUTE lambda (eq. 20): weight of the AutoShuffle permutation penalty (eq. 19) in the loss."""
    eval_beam_size: int = Field(4, ge=1)
    """Beam size for the widest sub-Transformer's validation BLEU at the end of training."""

    @property
    def stage_plan(self) -> tuple["JointStage | WordDistillStage | SeqDistillStage", ...]:
        """The stages in order; one joint stage of ``steps`` steps when ``stages`` is absent."""
        return tuple(self.stages) if self.stages is not None else (JointStage(name="joint", steps=self.steps),)

    @field_validator("width_dropout", mode="before")
    @classmethod
    def _check_width_dropout(cls, rates: Any) -> Any:
        if rates is None:
            return rates
        if not isinstance(rates, dict) or not rates:
            raise ValueError(f"got {rates!r}; give model width (channels) -> dropout rate, e.g. {{256: 0.0, 1024: 0.3}}")
        for width, rate in rates.items():
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"key {width!r} is not a model width; keys are widths in channels "
                                 f"(integers >= 1), e.g. {{256: 0.0, 1024: 0.3}}")
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
                raise ValueError(f"width {width} has rate {rate!r}; dropout rates are numbers in [0, 1)")
        return rates

    @model_validator(mode="after")
    def _check_dropout_range(self) -> "TrainSpec":
        if self.dropout_range is None:
            return self
        low, high = self.dropout_range
        if not 0.0 <= low <= high < 1.0:
            raise ValueError(f"train.dropout_range={list(self.dropout_range)}: give [min, max] with "
                             f"0 <= min <= max < 1, e.g. [0.0, 0.3]")
        if self.width_dropout is not None:
            raise ValueError("train.dropout_range and train.width_dropout both set a sub-Transformer's dropout; "
                             "keep one (dropout_range acts in every space, width_dropout only on model widths)")
        return self

    @model_validator(mode="after")
    def _check_student_dropout(self) -> "TrainSpec":
        if self.student_dropout == "zero" and not self.inplace_distill and \
                all(stage.name == "joint" for stage in self.stage_plan):
            raise ValueError("train.student_dropout: zero sets the students' dropout to 0, but no step has students: "
                             "set train.inplace_distill: true, or add a word_distill or seq_distill stage, "
                             "or leave train.student_dropout out (keep)")
        return self

    @model_validator(mode="after")
    def _check_stages(self) -> "TrainSpec":
        if self.stages is None:
            return self
        order = [STAGE_ORDER.index(s.name) for s in self.stages]
        for i in range(1, len(order)):
            if order[i] < order[i - 1]:
                raise ValueError(f"train.stages.{i} ({self.stages[i].name}) comes after train.stages.{i - 1} "
                                 f"({self.stages[i - 1].name}); "
                                 f"stages run in the order {' -> '.join(STAGE_ORDER)} (sec. 3.3): reorder them")
        total = sum(s.steps for s in self.stages)
        if "steps" not in self.model_fields_set:
            object.__setattr__(self, "steps", total)  # frozen: derived once, here
        elif self.steps != total:
            parts = " + ".join(f"{s.name} {s.steps}" for s in self.stages)
            raise ValueError(f"train.steps={self.steps} but train.stages add up to {total} steps ({parts}); "
                             f"make them agree or leave train.steps out (it is then the sum of the stages)")
        return self

