"""The sweep YAML's ``search:`` section: the sampler, its metrics and constraints, how ``latency_ms`` is timed or
predicted (:class:`LatencyWorkloadSpec`), the two-level search (:class:`EvolutionSpec`) and the fine-tune stage
(:class:`FinetuneSpec`), all under :class:`SearchSpec`. Pydantic and the standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from nas.space.constraints import Constraint, parse_constraint
from nas.space.schema.base import StrictModel
from nas.space.schema.points import PointSpec, is_arch_point, point_name

__all__ = ["DEFAULT_LATENCY_ROUNDS", "MetricSpec", "FinetuneSpec", "LatencyWorkloadSpec", "EvolutionSpec", "SearchSpec"]



DEFAULT_LATENCY_ROUNDS = 15
"""``search.latency_repeats``' default: interleaved rounds per latency measurement. Past about 15 the ratio's spread
over repeated measurements on a 2-core VM stops shrinking (``benchmarks/bench_latency_ratio.py``, ``docs/search.md``)."""

class MetricSpec(StrictModel):
    name: Literal["bleu", "chrf", "valid_loss", "params_m", "latency_ms", "latency_ratio"]  # constraints.METRIC_NAMES
    goal: Literal["maximize", "minimize"]


class FinetuneSpec(StrictModel):
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


class LatencyWorkloadSpec(StrictModel):
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


class EvolutionSpec(StrictModel):
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
    latency_margin: Literal["auto"] | float = "auto"
    """How much worse than predicted level 1 assumes each candidate's latency to be when it checks the latency
    constraints (``latency_ratio``, ``latency_ms``): an upper bound is checked on ``predicted x (1 + margin)``, a lower
    one on ``predicted x (1 - margin)``. ``auto``: the predictor's 5-fold cross-validated MAPE
    (:func:`nas.eval.latency.cross_validate`, saved in its ``metrics``; 0 for a predictor file without it); a number
    >= 0 (0.05: 5%) sets it; 0 checks the prediction itself, as HAT does. Level 1 keeps the candidates predicted
    fastest, so it keeps the under-predicted ones; without a margin about half of the archs it keeps near the budget
    are measured over it in level 2 (:func:`nas.search.evolution.predicted_constraints`)."""

    @field_validator("latency_margin")
    @classmethod
    def _check_margin(cls, margin: str | float) -> str | float:
        if margin != "auto" and not 0.0 <= margin < 1.0:
            raise ValueError(f"latency_margin: {margin} is not a fraction in [0, 1) (0.05 is 5%) or 'auto' (the "
                             f"latency predictor's cross-validated error)")
        return margin


class SearchSpec(StrictModel):
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
    latency_repeats: int = Field(DEFAULT_LATENCY_ROUNDS, ge=1)
    """Interleaved rounds of ``latency_workload``: one run of the arch between two of the reference arch, after 2
    untimed runs of each (:func:`nas.eval.latency.measure_latency_ratio`); ``latency_ratio`` is the median per-round
    ratio, ``latency_ms`` and ``latency_reference_ms`` the medians of the runs."""
    latency_workload: LatencyWorkloadSpec = LatencyWorkloadSpec()
    """What ``latency_ms`` times (:class:`LatencyWorkloadSpec`; default a 30-token source, 30 decoder steps,
    beam ``beam_size``, batch 1)."""
    latency_reference: str = "narrowest"
    """The arch ``latency_ratio`` divides by: ``narrowest``, ``widest``, ``middle`` or an arch as JSON
    (``Arch.to_json``), timed once per worker process and device on the same workload."""
    evolution: EvolutionSpec = EvolutionSpec()
    """Settings of ``method: evolution`` (ignored by the other methods)."""
    latency_engine: Literal["torch", "onnxruntime"] = "torch"
    """What runs the fixed workload when a latency is measured (trials, level 1's predictor samples, ``nas latency
    fit``, ``nas retrain``): ``torch``, the sub-Transformer's own beam search in PyTorch (what ``nas translate`` and the
    MLflow model run; CPU or GPU); ``onnxruntime``, the sub-Transformer and the reference exported to ONNX first and
    timed in onnxruntime on the CPU (what ``nas export --onnx``'s ``translate_onnx.py`` runs). Choose the engine you
    will serve with: the ratios differ between engines. ``onnxruntime`` adds two ONNX exports (seconds) to each
    measurement, needs ``latency_device`` to resolve to the CPU, and runs only through ``nas sweep`` /
    ``nas.api`` (which supply the engine to the search)."""
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
    points_to_evaluate: list[PointSpec] = Field(default_factory=list)
    """Sub-Transformers scored first (Optuna ``enqueue_trial``), in order (:mod:`nas.space.schema.points`):
    ``widest``, ``narrowest``, ``middle``; an arch as ``nas retrain --arch`` reads it
    (``"enc[128/256 128/256] dec[128/256 128/256]"``); a named arch ``{name: tiny, arch: ...}``;
    ``{file: baselines.yaml}``, the named archs of a file (read by ``load_spec``, relative to the sweep YAML); or a
    mapping of Optuna parameters (``encoder.layers: 2``, ``decoder.width.0: 128``; those left out are sampled).
    They count toward ``trials``; each trial is tagged with its point's name (:meth:`point_names`). An arch must
    lie inside the space (checked when the YAML is loaded). With ``method: evolution`` every point opens level 1's
    first generation, and the archs (not the references or mappings) are also scored in level 2, whatever level 1
    finds (:meth:`arch_points`)."""
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
        if self.latency_engine == "onnxruntime" and (self.latency_device == "cuda" or (
                self.latency_device == "trial" and self.gpu_per_trial > 0)):
            raise ValueError("latency_engine: onnxruntime times on the CPU, but latency_device resolves to the GPU; "
                             "set latency_device: cpu, or latency_engine: torch")
        if self.latency_device == "cuda" and self.gpu_per_trial <= 0:
            raise ValueError("latency_device: cuda needs gpu_per_trial > 0 (a GPU for each trial); set "
                             "gpu_per_trial, or latency_device: trial or cpu")
        if self.trials < len(self.points_to_evaluate):
            raise ValueError(f"points_to_evaluate has {len(self.points_to_evaluate)} points but trials={self.trials}; "
                             f"raise trials or drop points")
        names = self.point_names()
        for i in self.arch_points():
            if names[i] in names[:i]:
                raise ValueError(f"points_to_evaluate.{i}: the name {names[i]!r} is taken by points_to_evaluate."
                                 f"{names.index(names[i])}; give each arch its own name")
        return self

    def point_names(self) -> list[str]:
        """The name of each ``points_to_evaluate`` entry, in order (:func:`~nas.space.schema.points.point_name`):
        what its trial is tagged with (MLflow tag ``nas.point``)."""
        return [point_name(p, i) for i, p in enumerate(self.points_to_evaluate)]

    def arch_points(self) -> list[int]:
        """Indices of the ``points_to_evaluate`` entries that are whole archs the user wrote (arch strings and named
        archs, :func:`~nas.space.schema.points.is_arch_point`): level 2 of ``method: evolution`` scores them."""
        return [i for i, p in enumerate(self.points_to_evaluate) if is_arch_point(p)]

    def parsed_constraints(self) -> list[Constraint]:
        """The :class:`Constraint` of each ``constraints`` entry, in order."""
        return [parse_constraint(c) for c in self.constraints]
