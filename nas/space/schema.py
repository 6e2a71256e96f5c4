"""The sweep YAML's schema: pydantic models, one per section, with the checks that need only the YAML.

Every field carries its unit in its docstring (STYLE habit 1). :class:`SweepSpec` is the whole file;
reading it from disk is :func:`nas.space.loader.load_spec`. Relative data paths are resolved against the
current working directory (the repository root in the README's commands).

Pydantic and the standard library only: no torch, Ray, Optuna or MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from nas.redact import REDACTED
from nas.space.arch import DEPENDENCIES, LAYOUTS, UNIT_BIASES
from nas.space.constraints import Constraint, parse_constraint
from nas.space.recipe import RetrainSpec

__all__ = ["SweepSpec", "DataSpec", "PairFiles", "TokenizerSpec", "SupernetSpec", "Dimension", "SpaceSpec",
           "JointStage", "WordDistillStage", "SeqDistillStage", "StageSpec", "STAGE_ORDER", "TrainSpec",
           "MetricSpec", "FinetuneSpec", "LatencyWorkloadSpec", "EvolutionSpec", "SearchSpec", "ResourcesSpec", "TrackingSpec", "RetrainSpec", "OPTUNA_STORAGE_SCHEMES",
           "REDACTED"]

# REDACTED (:mod:`nas.redact`) is what values interpolated from the environment (``${VAR}``) are replaced by
# wherever the spec is logged.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PairFiles(_Strict):
    src: Path
    """Source-side text file (one sentence per line, gzip or plain UTF-8)."""
    tgt: Path
    """Target-side text file, line-aligned with ``src``."""


class TokenizerSpec(_Strict):
    vocab_size: int = Field(8000, ge=100)
    """Joint SentencePiece vocabulary size (tokens)."""


class DataSpec(_Strict):
    train: PairFiles
    valid: PairFiles
    tokenizer: TokenizerSpec = TokenizerSpec()
    max_train_pairs: int | None = Field(None, ge=1)
    """Use only the first N training pairs (None: all)."""
    max_valid_pairs: int | None = Field(None, ge=1)
    """Use only the first N validation pairs (None: all)."""
    max_len: int = Field(128, ge=4)
    """Longest training sentence kept (subword tokens)."""
    cache_dir: Path = Path("nas_runs/data")
    """Where tokenized Parquet files are cached (by a hash of inputs and settings)."""


class SupernetSpec(_Strict):
    model_dim: int = Field(..., ge=8)
    """C: the widest model width (channels); every sub-Transformer's unless ``space.model_width`` chooses
    a narrower one (type-1 Scalable Transformers, sec. 3.2)."""
    heads: int = Field(4, ge=1)
    """Attention heads per branch of the widest attention (``model_dim``); sets the default ``head_dim``."""
    head_dim: int | None = Field(None, ge=1)
    """The fixed width of one attention head (channels); default ``model_dim / heads``. An attention width
    D has ``D / head_dim`` heads per branch, the widest's leading heads (Scalable Transformers sec. 4.1:
    "attention head dimension is fixed to 64"); every width must be divisible by it."""

    @property
    def head_width(self) -> int:
        """``head_dim``, or ``model_dim / heads`` when it is not set."""
        return self.head_dim or self.model_dim // self.heads
    encoder_layers: int = Field(..., ge=1)
    decoder_layers: int = Field(..., ge=1)
    ffn_width: int | None = Field(None, ge=1)
    """Widest FFN inner width (channels); default: the largest value in ``space.ffn_width``."""
    branches: int | None = Field(None, ge=1)
    """Most attention branches N_a (MAT); default: the largest value in ``space.branches``."""
    paths: int | None = Field(None, ge=1)
    """Most parallel paths per sublayer (Multi-Path); default: the largest value in ``space.paths``."""
    more_features: bool = False
    """Multi-Path "more features" (sec. 3.2): add the averages of n-1 paths in sublayers with 3+ paths."""
    kernels: list[int] = Field(default_factory=list)
    """Kernel sizes (odd) of the Prime convolution cells; default: those used in ``space.kernels``."""
    units: int | None = Field(None, ge=1)
    """Most MUTE units per layer; default: the largest value in ``space.units``."""
    relative_positions: int | None = Field(None, ge=0)
    """Clipping distance k (positions) of the encoder self-attention's relative position representations
    (Shaw et al. 2018, eq. 3-6); 0: none. Default: 16 when the supernet has MUTE units (MUTE sec. 4 runs its
    units on relative positions: swap and disorder biases do nothing to a unit that sees positions only at its
    input), else 0."""
    relative_layers: Literal["units", "all"] = "units"
    """Which encoder layers have the relative position tables (when ``relative_positions`` > 0): ``units``, only
    layers with MUTE units (a layer's tables are built when its most units > 1 and used by sub-Transformers
    running it with units > 1; one unit runs on absolute positions only); ``all``, every layer whatever its
    units: the format before this choice existed (what older supernets and exports hold; keep it to compare
    with models trained that way)."""
    share_layouts: bool = True
    """Whether a layer's ``sequential`` and ``prime`` layouts share their attention(s) and FFN (the format before
    this choice existed). false: the Prime layout of each layer gets its own (``prime_*``, its convolution on
    its own attention's values), so a Prime and a sequential sub-Transformer share no weight in that layer:
    sharing less between dissimilar sub-networks improves the supernet's rank correlation (Few-shot NAS, Zhao
    et al., ICML 2021; Mixture-of-Supernets, Jawahar et al., Findings of ACL 2024). Costs the attention(s)
    and FFN again in every ``sequential+prime`` layer."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    max_positions: int = Field(256, ge=16)
    """Longest sequence (tokens) the sinusoidal position table covers."""
    io_projection: bool | None = None
    """The input/output projections of Scalable Transformers eq. 3 between the ``model_dim``-wide word
    embeddings and the (croppable) model width. None: on exactly when the space chooses ``model_width``."""


class Dimension(_Strict):
    values: list[int | str | list[int]] | None = Field(None, min_length=1)
    """The choices (an Optuna categorical): integers, layout names, or kernel-size lists."""
    tie: Literal["model_width"] | None = None
    """Instead of ``values``: take the sub-Transformer's model width times ``scale`` in every layer, e.g.
    ``width: {tie: model_width}`` and ``ffn_width: {tie: model_width, scale: 4}`` (type-1 Scalable
    Transformers, sec. 3.2: ``C = D^1 = ... = D^L``)."""
    scale: int = Field(1, ge=1)
    """Multiplier of a tied dimension (``ffn_width = scale * model_width``)."""
    per_layer: bool = False
    """True: one choice per layer; False: one choice per stack (encoder, decoder)."""
    when: dict[str, int | str | list[int | str]] | None = None
    """Condition on another per-layer dimension of the same layer, e.g. ``{layout: prime}`` or
    ``{units: [2, 3]}`` (any of the values); where it does not hold the dimension takes its
    inactive value (1 branch/path/unit, no kernels, identity bias, independent units)."""

    @model_validator(mode="after")
    def _one_source(self) -> "Dimension":
        if self.values is None and self.tie is None:
            raise ValueError("give `values: [...]` (the choices) or `tie: model_width` (type-1 Scalable Transformers)")
        if self.values is not None and self.tie is not None:
            raise ValueError("give either `values` or `tie`, not both")
        if self.scale != 1 and self.tie is None:
            raise ValueError(f"scale={self.scale} applies only to a tied dimension; add `tie: model_width` or remove scale")
        return self


class SpaceSpec(_Strict):
    model_width: Dimension | None = None
    """C per sub-Transformer (type-1 Scalable Transformers): one model width for every layer, cropped
    from ``supernet.model_dim`` with the eq. 3 input/output projections; default: model_dim only."""
    encoder_layers: Dimension | None = None
    """Encoder depth choices; default: the supernet's depth only."""
    decoder_layers: Dimension | None = None
    width: Dimension | None = None
    """Attention width D_l (channels); default: model_dim only."""
    ffn_width: Dimension | None = None
    """FFN inner width F_l (channels); default: supernet.ffn_width only."""
    branches: Dimension | None = None
    """Attention branches N_a (MAT eq. 4); default: supernet.branches, else 1."""
    paths: Dimension | None = None
    """Parallel paths per sublayer (Multi-Path eq. 4); default: supernet.paths, else 1."""
    layout: Dimension | None = None
    """``sequential`` or ``prime`` (Unified Transformer eq. 4) per layer; default: sequential."""
    kernels: Dimension | None = None
    """Dynamic-convolution kernel sets of Prime layers, e.g. ``[[], [3], [3, 15]]`` (``[]``: Prime-simple)."""
    units: Dimension | None = None
    """MUTE units per layer (eq. 10); default: supernet.units, else 1."""
    unit_bias: Dimension | None = None
    """Refused: MUTE's unit biases act only in training, so they are no search dimension; see ``train.unit_bias``."""
    unit_dependency: Dimension | None = None
    """``independent`` (eq. 10) or ``sequential`` (eq. 13-16, AutoShuffle) unit combination."""


class JointStage(_Strict):
    """Stage 1 of Scalable Transformers (sec. 3.3, eq. 4): the widest, the narrowest and ``sandwich_k``
    random sub-Transformers all learn from the ground truth."""
    name: Literal["joint"]
    steps: int = Field(..., ge=1)
    """Optimizer steps of this stage."""


class WordDistillStage(_Strict):
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


class SeqDistillStage(_Strict):
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


class TrainSpec(_Strict):
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
    sandwich_k: int = Field(1, ge=0)
    """Random sub-Transformers per step besides the widest and the narrowest (sandwich rule)."""
    inplace_distill: bool = False
    """In-place distillation in the ``joint`` stage from its first step (BigNAS sec. 3.1; OFA): every
    sub-Transformer of a step but the widest learns from ``distill_lambda * ground truth + (1 - distill_lambda)
    * the widest's word distribution`` (Scalable Transformers' L_2 form), the teacher being the widest of the
    step's layout, its logits of the same forward pass reused (detached: no extra forward). Off: eq. 4."""
    distill_lambda: float = Field(0.5, ge=0.0, le=1.0)
    """With ``inplace_distill``: the weight of the ground truth for the students (BigNAS: 0, the teacher's
    distribution alone)."""
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
    clip_norm: float = Field(1.0, gt=0)
    """Gradient clipping: max global L2 norm."""
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


class MetricSpec(_Strict):
    name: Literal["bleu", "chrf", "valid_loss", "params_m", "latency_ms", "latency_ratio"]  # constraints.METRIC_NAMES
    goal: Literal["maximize", "minimize"]


class FinetuneSpec(_Strict):
    """Optional fine-tune stage after the search: the most promising sub-Transformers are trained a few
    hundred steps from their inherited weights, and Ray Tune's ASHA scheduler stops the weak ones early."""

    top_k: int = Field(4, ge=1)
    """Sub-Transformers fine-tuned: the search's Pareto front (feasible trials only) first, then the best
    remaining trials by the first metric."""
    steps: int = Field(200, ge=1)
    """Fine-tune steps of a sub-Transformer that ASHA never stops."""
    eval_every: int = Field(50, ge=1)
    """Steps between two validation losses (one ASHA time unit)."""
    grace_period: int = Field(1, ge=1)
    """Evaluations a sub-Transformer gets before ASHA may stop it."""
    reduction_factor: int = Field(2, ge=2)
    """ASHA's reduction factor: about 1/reduction_factor of the trials go on at each rung."""
    lr: float | None = Field(None, gt=0)
    """Peak learning rate (default: train.lr / 10, since the weights are already trained)."""
    warmup_steps: int = Field(20, ge=0)

    @model_validator(mode="after")
    def _check_rungs(self) -> "FinetuneSpec":
        if self.eval_every > self.steps:
            raise ValueError(f"eval_every={self.eval_every} is above steps={self.steps}: ASHA would see no "
                             f"validation loss before the end; lower eval_every")
        rungs = -(-self.steps // self.eval_every)
        if self.grace_period > rungs:
            raise ValueError(f"grace_period={self.grace_period} evaluations, but steps={self.steps} with "
                             f"eval_every={self.eval_every} give only {rungs}; lower grace_period or eval_every")
        return self


class LatencyWorkloadSpec(_Strict):
    """The fixed workload that defines ``latency_ms`` (HAT sec. 4: batch 1, a 30-token source, exactly 30
    decoder steps): encode ``batch`` sources of ``src_tokens`` tokens, then run exactly ``tgt_tokens`` decoder
    steps of beam search with EOS held back, so the time depends on the arch and the device, never on the
    weights."""

    src_tokens: int = Field(30, ge=1)
    """Source length (subword tokens, EOS included)."""
    tgt_tokens: int = Field(30, ge=1)
    """Decoder steps (the last emits EOS)."""
    beam: int | None = Field(None, ge=1)
    """Beams per sentence (None: ``search.beam_size``)."""
    batch: int = Field(1, ge=1)
    """Sentences per batch."""


class EvolutionSpec(_Strict):
    """``search.method: evolution``: HAT's two-level search (Wang et al. 2020, sec. 3.3-3.4) on this stack.

    Level 1 scores ``population x generations`` sub-Transformers cheaply with inherited weights (``score`` on
    the first ``subset_sentences`` validation sentences) and a latency predictor fitted in the same sweep on
    ``predictor_samples`` timed archs, with Optuna's NSGA-II sampler through ask/tell (its study beside the
    sweep's, so level 1 resumes after a kill). Level 2 scores ``search.trials`` archs of level 1's Pareto front
    as ordinary trials (beam BLEU, chrF, measured ``latency_ms``)."""

    population: int = Field(100, ge=2)
    """Candidates per generation (NSGA-II ``population_size``)."""
    generations: int = Field(10, ge=1)
    """Generations; level 1 scores ``population x generations`` candidates."""
    mutation_prob: float | None = Field(None, gt=0, le=1)
    """Probability that a gene (one Optuna parameter) is redrawn (None: NSGA-II's 1 / genes)."""
    crossover_prob: float = Field(0.9, ge=0, le=1)
    """Probability that a child comes from crossover of two parents (NSGA-II)."""
    subset_sentences: int = Field(200, ge=1)
    """Validation sentences (the first N) that level 1 scores each candidate on."""
    score: Literal["valid_loss", "greedy_bleu"] = "valid_loss"
    """Level 1's score: teacher-forced validation loss (nats/token, minimized) or greedy BLEU (maximized)."""
    predictor_samples: int = Field(40, ge=4)
    """Archs timed on the fixed workload to fit level 1's latency predictor (ignored with
    ``search.latency_predictor``)."""
    batch_size: int = Field(25, ge=1)
    """Candidates a Ray Tune trial scores (Ray's overhead is paid once a batch)."""


class SearchSpec(_Strict):
    method: Literal["tpe", "nsga2", "gp", "random", "evolution"] = "tpe"
    """Optuna sampler; ``evolution`` is the two-level search (:class:`EvolutionSpec`, key ``evolution``)."""
    trials: int = Field(8, ge=1)
    max_concurrent: int = Field(2, ge=1)
    cpu_per_trial: float = Field(1.0, gt=0)
    """CPUs per search trial (Ray Tune resources; also the trial's torch threads)."""
    gpu_per_trial: float = Field(0.0, ge=0)
    """GPUs per search trial (Ray Tune resources); fractional shares one GPU, e.g. 0.25: four trials per GPU."""
    metrics: list[MetricSpec] = Field(default_factory=lambda: [MetricSpec(name="bleu", goal="maximize")], min_length=1)
    beam_size: int = Field(4, ge=1)
    valid_sentences: int | None = Field(None, ge=1)
    """Score each trial on the first N validation sentences (None: all)."""
    latency_sentences: int = Field(10, ge=1)
    """Ignored since ``latency_ms`` times the fixed workload ``latency_workload``; kept so old YAMLs load."""
    latency_repeats: int = Field(20, ge=1)
    """Timed runs of ``latency_workload`` (after 5 untimed ones); ``latency_ms`` averages them with the top and
    bottom 10% dropped (HAT's statistic)."""
    latency_workload: LatencyWorkloadSpec = LatencyWorkloadSpec()
    """What ``latency_ms`` times (:class:`LatencyWorkloadSpec`; default a 30-token source, 30 decoder steps,
    beam ``beam_size``, batch 1)."""
    latency_reference: str = "narrowest"
    """The arch ``latency_ratio`` divides by: ``narrowest``, ``widest``, ``middle`` or an arch as JSON
    (``Arch.to_json``), timed once per worker process and device on the same workload."""
    evolution: EvolutionSpec = EvolutionSpec()
    """Settings of ``method: evolution`` (ignored by the other methods)."""
    latency_device: Literal["trial", "cpu", "cuda"] = "trial"
    """Where ``latency_ms`` is timed: ``trial``, the device the trial scores on (its GPU with ``gpu_per_trial``
    > 0, else the CPU); ``cpu``, the CPU even when the trial scores on a GPU (a model to be served on CPUs,
    searched on a GPU cluster; timed on ``cpu_per_trial`` threads); ``cuda``, the trial's GPU
    (``gpu_per_trial`` must be > 0)."""
    seed: int = 0
    max_failures: int = Field(0, ge=0)
    """Retries of a failing trial (Ray Tune ``FailureConfig(max_failures)``), for search trials and the
    supernet-training trial; after the last retry the trial is recorded as failed and the sweep goes on."""
    constraints: list[str] = Field(default_factory=list)
    """Bounds a trial must satisfy to count, ``METRIC OP NUMBER`` (e.g. ``latency_ms <= 40``; OP <=, <, >=, >),
    on any metric a trial reports. Each becomes ``trial.set_constraint`` in Optuna, so the samplers
    (TPE, NSGA-II, GP) favour feasible archs and the Pareto front (``study.best_trials``) holds feasible
    trials only; an infeasible trial still completes and is tagged ``feasible = 0``."""
    points_to_evaluate: list[Union[Literal["widest", "narrowest", "middle"], dict[str, Union[int, str]]]] = \
        Field(default_factory=list)
    """Sub-Transformers scored first (Optuna ``enqueue_trial``), in order: ``widest``, ``narrowest``,
    ``middle``, or a mapping of Optuna parameters (``encoder.layers: 2``, ``decoder.width.0: 128``; those
    left out are sampled). They count toward ``trials``."""
    latency: Literal["measured", "predicted"] = "measured"
    """Where a trial's ``latency_ms`` comes from: timed on the trial's device (the fixed ``latency_workload``), or
    the ``latency_predictor`` (no timing; the predictor's device counts)."""
    latency_predictor: Path | None = None
    """A predictor written by ``nas latency fit`` (``.safetensors``; a relative path is made absolute against the
    working folder when the YAML is loaded, as Ray trials run in folders of their own; it must be readable on every node). With ``latency: measured`` it is evaluated as
    well (metric ``latency_pred_ms``), and a prediction more than 20% off the measurement is warned about."""
    finetune: FinetuneSpec | None = None
    """Optional ASHA fine-tune stage after the search (see :class:`FinetuneSpec`)."""

    @field_validator("latency_predictor")
    @classmethod
    def _absolute_predictor(cls, path: Path | None) -> Path | None:
        return None if path is None else path.expanduser().absolute()

    @field_validator("constraints")
    @classmethod
    def _check_constraints(cls, constraints: list[str]) -> list[str]:
        for i, expr in enumerate(constraints):
            try:
                parse_constraint(expr)
            except ValueError as e:
                raise ValueError(f"constraints.{i}: {e}") from None
        return constraints

    @model_validator(mode="after")
    def _check_latency(self) -> "SearchSpec":
        if self.latency == "predicted" and self.latency_predictor is None:
            raise ValueError("latency: predicted needs latency_predictor: a file written by "
                             "`nas latency fit FILE --out PATH`; or set latency: measured")
        if self.latency_device == "cuda" and self.gpu_per_trial <= 0:
            raise ValueError("latency_device: cuda needs gpu_per_trial > 0 (a GPU for each trial); set "
                             "gpu_per_trial, or latency_device: trial or cpu")
        if self.trials < len(self.points_to_evaluate):
            raise ValueError(f"points_to_evaluate has {len(self.points_to_evaluate)} points but trials={self.trials}; "
                             f"raise trials or drop points")
        return self

    def parsed_constraints(self) -> list[Constraint]:
        """The :class:`Constraint` of each ``constraints`` entry, in order."""
        return [parse_constraint(c) for c in self.constraints]


class ResourcesSpec(_Strict):
    cpu: float = Field(2.0, gt=0)
    """CPUs for the supernet-training trial (per worker when ``workers`` > 1)."""
    gpu: float = Field(0.0, ge=0)
    """GPUs for the supernet-training trial (per worker when ``workers`` > 1)."""
    workers: int = Field(1, ge=1)
    """Data-parallel workers for supernet training (Ray Train ``TorchTrainer``, DDP; NCCL on GPUs, else gloo).
    Each worker takes its share of every batch, so the global batch stays ``train.max_tokens``."""
    storage_path: str | None = None
    """Where Ray Tune keeps both stages' experiments (``RunConfig(storage_path)``): a folder every node of the
    cluster sees, or a URI such as ``s3://bucket/prefix``; default: ``<workdir>/<name>/ray``."""

    @field_validator("storage_path")
    @classmethod
    def _check_storage_path(cls, path: str | None) -> str | None:
        if path is not None and not path.strip():
            raise ValueError("is empty; give a shared folder or a URI such as s3://bucket/prefix, or leave it out")
        return path


OPTUNA_STORAGE_SCHEMES = ("postgresql", "postgresql+psycopg", "postgresql+psycopg2")


class TrackingSpec(_Strict):
    experiment: str | None = None
    """MLflow experiment; default: the sweep's name."""
    optuna_storage: str | None = None
    """Optuna study storage: a PostgreSQL URL ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE`` (Optuna
    ``RDBStorage``; ``postgresql+psycopg2://`` for psycopg2), shared by every driver that resumes the sweep.
    None: a journal file ``<workdir>/<name>/optuna.journal`` (Optuna ``JournalFileBackend``)."""

    @field_validator("optuna_storage")
    @classmethod
    def _check_optuna_storage(cls, url: str | None) -> str | None:
        if url is None:
            return url
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in OPTUNA_STORAGE_SCHEMES:
            raise ValueError(f"{scheme + sep if sep else url!r} is not a PostgreSQL URL; write "
                             "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE (or leave tracking.optuna_storage "
                             "out for the journal file <workdir>/<name>/optuna.journal)")
        if "/" not in rest or not rest.rsplit("/", 1)[1]:
            raise ValueError(f"{scheme}://... names no database; write {scheme}://USER@HOST:PORT/DATABASE")
        return url


MIN_SECRET_CHARS = 6
"""A value interpolated from ``${VAR}`` is replaced inside free text only from this length on (by key always)."""


class SweepSpec(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    data: DataSpec
    supernet: SupernetSpec
    space: SpaceSpec = SpaceSpec()
    train: TrainSpec = TrainSpec()
    search: SearchSpec = SearchSpec()
    resources: ResourcesSpec = ResourcesSpec()
    tracking: TrackingSpec = TrackingSpec()
    retrain: RetrainSpec = RetrainSpec()
    """The recipe of ``nas retrain`` (:class:`~nas.space.recipe.RetrainSpec`)."""
    workdir: Path = Path("nas_runs")
    """Where checkpoints, the Optuna journal and Ray results go (a folder per sweep name)."""
    _secrets: dict[tuple[str, ...], tuple[str, frozenset[str]]] = PrivateAttr(default_factory=dict)
    """Key path -> (masked, values) of every string ``load_spec`` substituted a ``${VAR}`` into (see :meth:`redact`)."""

    _source_text: str | None = PrivateAttr(default=None)
    """The YAML text this spec was read from when ``--set`` overrides changed it (:meth:`yaml_text`)."""

    def keep_source(self, text: str | None) -> "SweepSpec":
        """Remember the effective YAML text (the file's, with ``--set`` overrides applied); returns this spec."""
        self._source_text = text
        return self

    def yaml_text(self, path: str | Path) -> str:
        """The YAML the spec was read from: the effective text :meth:`keep_source` kept (``--set`` overrides
        applied), else the file ``path`` as it is. ``${VAR}`` references are kept, not substituted."""
        if self._source_text is not None:
            return self._source_text
        return Path(path).read_text(encoding="utf-8")

    def keep_secrets(self, secrets: Mapping[tuple[str, ...], tuple[str, frozenset[str]]]) -> "SweepSpec":
        """Remember the strings that ``${VAR}`` references were substituted into, by YAML key path:
        ``("tracking", "optuna_storage")`` -> (the YAML's string with each reference shown as ``***``, the
        substituted string and the variables' values), so that :meth:`redact` hides them; returns this spec."""
        self._secrets = dict(secrets)
        return self

    def redact(self, obj: Any, path: tuple[str, ...] = ()) -> Any:
        """``obj`` with every value interpolated from the environment hidden; use it on whatever is logged or
        written.

        By key: in a mapping (nested, or flat with dotted keys such as MLflow params, both rooted at the YAML's
        top level), the value at a key path that the YAML filled from ``${VAR}`` becomes the YAML's string with
        each reference shown as ``***``. A string outside such a key, or ``obj`` itself when it is a string,
        has each substituted string and variable value of at least :data:`MIN_SECRET_CHARS` characters
        replaced by ``***`` (a shorter one, ``1`` or ``nas``, would mangle unrelated text; a password in a
        URL is masked by :func:`nas.redact.redact_url` wherever one is shown).
        """
        if not self._secrets:
            return obj
        if path in self._secrets:
            return self._secrets[path][0]
        if isinstance(obj, str):
            values = {v for _, vs in self._secrets.values() for v in vs if len(v) >= MIN_SECRET_CHARS}
            for value in sorted(values, key=len, reverse=True):
                obj = obj.replace(value, REDACTED)
            return obj
        if isinstance(obj, Mapping):
            return {k: self.redact(v, (*path, *str(k).split("."))) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.redact(v, (*path, str(i))) for i, v in enumerate(obj))
        return obj

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or self.name

    @property
    def run_dir(self) -> Path:
        return self.workdir / self.name

    @property
    def max_branches(self) -> int:
        """The most attention branches any sub-Transformer of the space has (1: no MAT branches)."""
        if self.supernet.branches is not None:
            return self.supernet.branches
        dim = self.space.branches
        return max((v for v in (dim.values or []) if isinstance(v, int)), default=1) if dim is not None else 1

    @property
    def drop_branch(self) -> float:
        """The drop-branch rate rho in use: ``train.drop_branch``, default 0.1 with branches, else 0."""
        if self.train.drop_branch is not None:
            return self.train.drop_branch
        return 0.1 if self.max_branches > 1 else 0.0

    @property
    def io_projection(self) -> bool:
        """Whether the supernet has the eq. 3 input/output projections (Scalable Transformers)."""
        if self.supernet.io_projection is not None:
            return self.supernet.io_projection
        return self.space.model_width is not None

    @model_validator(mode="after")
    def _check_space(self) -> "SweepSpec":
        sn, sp = self.supernet, self.space
        if sn.head_dim is None and sn.model_dim % sn.heads:
            raise ValueError(f"supernet.model_dim={sn.model_dim} is not divisible by supernet.heads={sn.heads}; "
                             f"change one, or set supernet.head_dim")
        if self.train.drop_branch and self.max_branches == 1:
            raise ValueError(f"train.drop_branch={self.train.drop_branch}, but the space has no branches (MAT "
                             f"drop-branch drops attention branches and the FFN): remove train.drop_branch, or "
                             f"add space.branches with values above 1")
        if sp.unit_bias is not None:
            raise ValueError("space.unit_bias: MUTE's unit biases act only in training (sec. 3.2), so sub-Transformers "
                             "that differ only in them score identically; it is no search dimension: remove "
                             "space.unit_bias and set train.unit_bias (mixed, swap, disorder, mask or identity)")
        if sn.ffn_width is None and sp.ffn_width is None:
            raise ValueError("set supernet.ffn_width or space.ffn_width.values (the FFN inner width)")
        for k in sn.kernels:
            if k < 1 or k % 2 == 0:
                raise ValueError(f"supernet.kernels contains {k}; kernel sizes must be odd and >= 1 (e.g. 3, 7, 15)")
        limits = {
            "encoder_layers": ("supernet.encoder_layers", sn.encoder_layers),
            "decoder_layers": ("supernet.decoder_layers", sn.decoder_layers),
            "model_width": ("supernet.model_dim", sn.model_dim),
            "width": ("supernet.model_dim", sn.model_dim),
            "ffn_width": ("supernet.ffn_width", sn.ffn_width),
            "branches": ("supernet.branches", sn.branches),
            "paths": ("supernet.paths", sn.paths),
            "units": ("supernet.units", sn.units),
        }
        for key in SpaceSpec.model_fields:
            dim = getattr(sp, key)
            if dim is None:
                continue
            if dim.tie is not None:
                _check_tie(key, dim, sp, *limits.get(key, (None, None)), head_dim=sn.head_width)
                continue
            values = [tuple(v) if isinstance(v, list) else v for v in dim.values]
            if len(set(values)) != len(values):
                raise ValueError(f"space.{key}.values={dim.values} repeats a value; list each choice once")
            if key == "layout":
                _check_names(key, dim.values, LAYOUTS)
            elif key == "unit_bias":
                _check_names(key, dim.values, UNIT_BIASES)
            elif key == "unit_dependency":
                _check_names(key, dim.values, DEPENDENCIES)
            elif key == "kernels":
                _check_kernels(dim.values, sn.kernels, sp.layout)
            else:
                _check_ints(key, dim.values, *limits[key], head_dim=sn.head_width)
            if dim.when is not None:
                _check_when(key, dim, sp)
        _check_prime_conditions(sp)
        if sp.model_width is not None:
            if sp.model_width.per_layer or sp.model_width.when:
                raise ValueError("space.model_width is one choice per sub-Transformer: remove per_layer and when")
            if sn.io_projection is False:
                raise ValueError("space.model_width needs the input/output projections of Scalable Transformers eq. 3: "
                                 "set supernet.io_projection: true (or leave it out)")
        return self



def _check_ints(key: str, values: list, limit_key: str, limit: int | None, head_dim: int) -> None:
    for v in values:
        if not isinstance(v, int):
            raise ValueError(f"space.{key}.values contains {v!r}; this dimension takes integers")
        if v < 1:
            raise ValueError(f"space.{key}.values contains {v}; choices must be >= 1")
        if limit is not None and v > limit:
            raise ValueError(f"space.{key}.values contains {v}, above {limit_key}={limit}; "
                             f"lower the value or raise {limit_key}")
        if key == "width" and v % head_dim:
            raise ValueError(f"space.width.values contains {v}, not divisible by the head width {head_dim} "
                             f"(supernet.head_dim, default model_dim / heads); use multiples of {head_dim}")


def _check_tie(key: str, dim: "Dimension", sp: "SpaceSpec", limit_key: str | None, limit: int | None,
               head_dim: int) -> None:
    if key not in ("width", "ffn_width"):
        raise ValueError(f"space.{key}.tie: only width and ffn_width can be tied to the model width")
    if sp.model_width is None or sp.model_width.values is None:
        raise ValueError(f"space.{key}.tie: model_width needs `space.model_width: {{values: [...]}}`")
    if dim.when:
        raise ValueError(f"space.{key}: a tied dimension cannot be conditional; remove `when`")
    for c in sp.model_width.values:
        v = c * dim.scale if isinstance(c, int) else c
        if isinstance(v, int) and limit is not None and v > limit:
            raise ValueError(f"space.{key}: model_width {c} x scale {dim.scale} = {v} is above {limit_key}={limit}; "
                             f"lower the scale or raise {limit_key}")
        if key == "width" and isinstance(v, int) and v % head_dim:
            raise ValueError(f"space.width: tied to model_width {c}, {v} is not divisible by the head width "
                             f"{head_dim} (supernet.head_dim, default model_dim / heads)")


def _check_names(key: str, values: list, allowed: tuple[str, ...]) -> None:
    for v in values:
        if v not in allowed:
            raise ValueError(f"space.{key}.values contains {v!r}; expected one of {', '.join(allowed)}")


def _check_kernels(values: list, available: list[int], layout: "Dimension | None") -> None:
    if layout is None or "prime" not in layout.values:
        raise ValueError("space.kernels needs Prime layers: add 'prime' to space.layout.values")
    for v in values:
        if not isinstance(v, list):
            raise ValueError(f"space.kernels.values contains {v!r}; each choice is a list of kernel sizes, e.g. [3, 15]")
        for k in v:
            if k < 1 or k % 2 == 0:
                raise ValueError(f"space.kernels.values contains kernel size {k}; kernel sizes must be odd and >= 1")
            if available and k not in available:
                raise ValueError(f"space.kernels.values contains {k}, not in supernet.kernels={available}; "
                                 f"add it there or remove it here")


def _check_prime_conditions(sp: "SpaceSpec") -> None:
    """Prime layers have one path and sequential layers no kernels: the YAML must say so with ``when``."""
    layouts = sp.layout.values if sp.layout else ["sequential"]
    if "prime" in layouts and sp.paths and len(sp.paths.values) > 1 and sp.paths.when != {"layout": "sequential"}:
        raise ValueError("space.paths: a Prime layer has one path; add `when: {layout: sequential}` to space.paths")
    if "sequential" in layouts and sp.kernels and sp.kernels.when != {"layout": "prime"} \
            and any(v for v in sp.kernels.values):
        raise ValueError("space.kernels: sequential layers have no convolution; add `when: {layout: prime}` to space.kernels")
    units = sp.units.values if sp.units else [1]
    for key in ("unit_bias", "unit_dependency"):
        dim = getattr(sp, key)
        if dim and len(dim.values) > 1 and 1 in units and not dim.when:
            raise ValueError(f"space.{key}: one unit has no bias or dependency; add `when: {{units: [2, ...]}}` "
                             f"listing the unit counts above 1")


def _check_when(key: str, dim: "Dimension", sp: "SpaceSpec") -> None:
    if key in ("width", "ffn_width", "encoder_layers", "decoder_layers"):
        raise ValueError(f"space.{key}.when: {key} applies to every layer and cannot be conditional")
    if len(dim.when) != 1:
        raise ValueError(f"space.{key}.when={dim.when}: give exactly one condition, e.g. {{layout: prime}}")
    (ref, value), = dim.when.items()
    target = getattr(sp, ref, None) if ref in SpaceSpec.model_fields else None
    if target is None:
        raise ValueError(f"space.{key}.when refers to {ref!r}, which is not a dimension of this space")
    if target.when is not None:
        raise ValueError(f"space.{key}.when refers to {ref!r}, which is conditional itself; refer to an unconditional one")
    if target.values is None:
        raise ValueError(f"space.{key}.when refers to {ref!r}, which is tied to the model width; refer to a chosen one")
    if not (dim.per_layer and target.per_layer):
        raise ValueError(f"space.{key}.when: both space.{key} and space.{ref} need per_layer: true")
    for v in value if isinstance(value, list) else [value]:
        if v not in target.values:
            raise ValueError(f"space.{key}.when: {ref}={v!r} is not one of space.{ref}.values={target.values}")
