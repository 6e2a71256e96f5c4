"""Supernet training with the sandwich rule in stages, resumable from atomic checkpoints, data-parallel.

Each step trains the widest sub-Transformer, the narrowest and ``k`` random ones on the
same batch and sums their gradients (the sandwich rule of slimmable networks), with Adam
with inverse-square-root warm-up and gradient clipping; ``train.accumulate`` batches make one
step. ``train.stages`` runs Scalable Transformers' three stages in order (sec. 3.3,
:mod:`trainers.stage_plan`, :mod:`trainers.distill_losses`, :mod:`trainers.distill_targets`):
``joint`` (eq. 4: all learn from the ground truth, label-smoothed), ``word_distill`` (the
sub-Transformers also learn from the widest's word distribution, weighted by the eq. 5 schedule) and
``seq_distill`` (eq. 6: the widest's beam-search translations of the training sources replace the
ground truth); the stage and the step within it
follow from the global step. ``train.width_dropout`` sets the dropout rate per sub-Transformer
width (sec. 4.1). A checkpoint (model, optimizer, scheduler, RNG states, data position and stage)
is written every ``checkpoint_every`` steps through a temporary file and ``os.replace``; rerunning
resumes from it exactly (same sampled sub-Transformers, same batches, same losses). Beside each
checkpoint a model-only snapshot ``snapshots/step_{step:08d}.safetensors`` is written and the newest
``keep_last`` are kept, for checkpoint averaging (:mod:`trainers.average`, ``nas average``).

The recipe is :class:`SupernetRecipe` (torchtune's shape): its constructor reads the sweep, ``setup()`` builds
the run in one place (the search space once, by :func:`nas.builders.build_space`, passed on to the supernet's
and the fingerprint's builders), ``train()`` runs the one loop (:func:`trainers.engine.run_loop`) with the
recipe's methods as hooks. :class:`TrainState` is what a checkpoint stores besides the weights, Adam, the
schedule and the RNGs. :func:`train_supernet` is the entry point.
"""

from __future__ import annotations

import json
import random
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from nas.builders import build_space, build_supernet, supernet_config
from nas.data import PreparedData, TokenBatcher, TokenCorpus
from nas.errors import NasError
from nas.eval.validation import ValidationSet, validation_scores
from nas.atomic import atomic_write_text
from nas.model.io import save_model
from nas.model.supernet import SuperTransformer
from nas.precision import DeviceSettings, autocast_for, resolve_precision, training_device
from nas.space import SeqDistillStage, SweepSpec, TrainSpec
from nas.space.arch import Arch
from nas.space.space import SearchSpace
from trainers.average import SNAPSHOTS, prune_snapshots, save_snapshot
from trainers.distributed import broadcast, dist_info, param_sums
from trainers.engine import LoopHooks, StepResult, run_loop, save_checkpoint
from trainers.optim import make_optimizer, make_scheduler
from trainers.proximal import load_proximal_source, proximal_initialize
from trainers.regularization_schedule import check_width_dropout
from trainers.stage_plan import STAGE_NUMBERS, StagePosition, StageSpec, stage_at
from trainers.distill_targets import DISTILL_DIR, load_distill_targets, write_distill_targets
from trainers.stages import SandwichArchs, Stage, StageContext, build_stage
from trainers.window import LossWindow, timing_text

__all__ = ["train_supernet", "SupernetRecipe", "TrainState", "TrainResult", "supernet_fingerprint",
           "check_fingerprint"]

Report = Callable[[dict[str, float]], None]
CHECKPOINT = "checkpoint.pt"
SAMPLE_COUNTS = "sample_counts.json"
"""How often each (layer, dimension, value) was trained: the sandwich's draws of the whole run
(:attr:`~trainers.stages.SandwichArchs.counts`), written beside the supernet and logged with its files."""
SUPERNET = "supernet"
PROGRESS_EVERY_S = 30.0
"""Without a progress bar (a log, a Ray trial), a step line is printed at least this often (seconds), besides
every ``train.log_every`` steps: a slow machine still shows progress (issue 30)."""


@dataclass(frozen=True)
class TrainResult:
    supernet_dir: Path
    """Folder with ``supernet.safetensors`` + ``supernet.json``."""
    steps: int
    metrics: dict[str, float]
    """Final metrics: ``widest_bleu``, ``widest_chrf``, ``widest_valid_loss``, ``train_loss``, ``train_seconds``."""


@dataclass
class TrainState:
    """A supernet run's progress besides the weights, Adam, the schedule and the two RNGs: a checkpoint stores it
    (:meth:`to_dict`, its ``state``) and a rerun restores it (:meth:`from_dict`), so the run goes on exactly."""

    loop: dict[str, Any]
    """The loop's position, ``step`` (optimizer steps done), ``epoch``, ``position`` (batches into the epoch) and
    ``corpus`` (the targets trained on: ``train`` or a ``seq_distill/step_XXXXXXXX``), in the form
    :func:`~trainers.engine.run_loop` advances in place; read it as :attr:`step`, :attr:`epoch`, :attr:`position`
    and :attr:`corpus`."""
    stage: str
    """The name of the stage of the last step (the first stage's before any step)."""
    elapsed_s: float = 0.0
    """Training seconds (the logging windows summed), the runs it resumed included."""
    stage_scores: dict[str, dict[str, float]] = field(default_factory=dict)
    """The paper's stage number (``"1"`` to ``"3"``) -> the reference sub-Transformers' ``bleu_*``/``chrf_*`` at the
    end of that stage (``train.stage_eval``)."""
    sample_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Optuna parameter name -> {value label: times drawn}: the very dict :class:`~trainers.stages.SandwichArchs`
    counts into."""
    precision: str | None = None
    """The precision the run trains in (``bf16`` or ``fp32``); None in checkpoints written before it was recorded."""
    final: dict[str, float] = field(default_factory=dict)
    """The final metrics (:attr:`TrainResult.metrics`); empty until training has finished."""

    @classmethod
    def fresh(cls, first_stage: str) -> TrainState:
        """The state before the first step; ``first_stage``: the name of ``train.stages[0]``."""
        return cls(loop={"step": 0, "epoch": 0, "position": 0, "corpus": "train"}, stage=first_stage)

    @classmethod
    def from_dict(cls, state: dict[str, Any], first_stage: str) -> TrainState:
        """The state a checkpoint stored (:meth:`to_dict`'s keys; older checkpoints lack ``corpus``,
        ``stage_scores``, ``sample_counts`` or ``precision``: their defaults)."""
        return cls(loop={"step": state["step"], "epoch": state["epoch"], "position": state["position"],
                         "corpus": state.get("corpus", "train")},
                   stage=state.get("stage", first_stage), elapsed_s=state["elapsed_s"],
                   stage_scores=state.get("stage_scores", {}), sample_counts=state.get("sample_counts", {}),
                   precision=state.get("precision"), final=state["final"])

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's ``state``: plain values that ``torch.load(weights_only=True)`` reads back."""
        precision = {} if self.precision is None else {"precision": self.precision}
        return {"step": self.step, "epoch": self.epoch, "position": self.position, "elapsed_s": self.elapsed_s,
                "final": self.final, "stage": self.stage, "corpus": self.corpus, "stage_scores": self.stage_scores,
                "sample_counts": self.sample_counts, **precision}

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.loop["step"]

    @property
    def epoch(self) -> int:
        """Epochs of :attr:`corpus` done."""
        return self.loop["epoch"]

    @property
    def position(self) -> int:
        """Batches of the current epoch done."""
        return self.loop["position"]

    @property
    def corpus(self) -> str:
        """The name of the corpus the run trains on."""
        return self.loop["corpus"]


class SupernetRecipe:
    """The supernet training recipe (torchtune's recipe shape): the sweep is read once here, :meth:`setup` builds
    the run in one place, :meth:`train` runs the loop (:func:`~trainers.engine.run_loop`) with this recipe's
    methods as its hooks, then saves and scores the supernet. :func:`train_supernet` is ``setup`` + ``train``; its
    docstring says what a run writes, reports and raises.

    Its attributes are the run: what ``__init__`` read from the sweep, then what :meth:`setup` built. The sweep
    travels one way: the builders and the stages get ``spec`` (they read their own sections), everything else
    reads :attr:`cfg` and passes values on.
    """

    spec: SweepSpec
    """The sweep, for the builders (:mod:`nas.builders`) and the stages (:class:`~trainers.stages.StageContext`)."""
    cfg: TrainSpec
    """``spec.train``: every training setting this recipe reads."""
    plan: tuple[StageSpec, ...]
    """``train.stages`` in order (one joint stage of ``train.steps`` when absent)."""
    model_dim: int
    """``supernet.model_dim``: the model width of an arch without its own (``train.width_dropout``'s key)."""
    data: PreparedData
    out_dir: Path
    report: Report
    progress: bool | None
    device: str | torch.device | None

    # built by setup()
    rank: int
    world: int
    main: bool
    """Rank 0: the one that writes files and prints."""
    settings: DeviceSettings
    space: SearchSpace
    """The sweep's space, built once (:func:`~nas.builders.build_space`) for the model, the fingerprint and the
    sandwich."""
    model: SuperTransformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    corpus: TokenCorpus
    """The training split (memory-mapped: the ranks of one machine share its pages)."""
    batchers: dict[str, TokenBatcher]
    """Corpus name -> its batcher; a stage-3 corpus is added when its stage starts (:meth:`_batcher`)."""
    rng: random.Random
    """The sampler RNG: which sub-Transformers each step trains (checkpointed)."""
    state: TrainState
    fingerprint: str
    finished: bool
    """``out_dir`` holds a finished run: :meth:`train` returns its result and trains nothing."""
    archs: SandwichArchs
    precision: str
    stages: list[Stage]
    """One :class:`~trainers.stages.Stage` per entry of :attr:`plan`."""
    show: bool
    """Show a progress bar (else a step line now and then)."""
    window: LossWindow
    bar: Progress
    task: TaskID
    last_line_s: float
    """``time.monotonic()`` of the last step line."""

    def __init__(self, spec: SweepSpec, data: PreparedData, out_dir: str | Path, *, report: Report | None = None,
                 progress: bool | None = None, device: str | torch.device | None = None) -> None:
        """Read the sweep; nothing is built or written (:meth:`setup`). Arguments as :func:`train_supernet`'s."""
        self.spec = spec
        self.cfg = spec.train
        self.plan = self.cfg.stage_plan
        self.model_dim = spec.supernet.model_dim
        self.data = data
        self.out_dir = Path(out_dir)
        self.report = report or _no_report
        self.progress = progress
        self.device = device
        self._valid: ValidationSet | None = None

    def setup(self) -> None:
        """Build the run, in the order that fixes its random numbers: the device, the seed, the space, the supernet
        (its initial weights), Adam, the schedule, the batches, the sampler RNG; then restore ``checkpoint.pt``
        when ``out_dir`` has one (else MAT's proximal initialisation, sec. 3.3, when ``train.proximal_init`` names
        one). A finished run stops there (:attr:`finished`); otherwise the fingerprint is written and the sandwich,
        the precision, the stages and the logging are set up.

        Raises:
            ValueError: ``out_dir`` holds another configuration's supernet; ``train.width_dropout`` lacks a
                model width of the space.
        """
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world = dist_info()
        self.main = self.rank == 0
        self.settings = training_device(self.device)  # CUDA: TF32, fused Adam, pinned batches, no host sync per step
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.space = build_space(self.spec)
        check_width_dropout(cfg.width_dropout, {w or self.model_dim for w in self.space.model_widths})
        self.model = build_supernet(self.spec, self.data.vocab_size, self.space).to(self.settings.device)
        self.optimizer = make_optimizer(self.model, cfg.lr, cfg.weight_decay, fused=self.settings.fused_adam)
        self.scheduler = make_scheduler(self.optimizer, cfg.warmup_steps,
                                        [stage.steps for stage in self.plan],  # restarts per stage
                                        init_ratio=min(cfg.warmup_init_lr / cfg.lr, 1.0))
        self.corpus = self.data.corpus("train")
        self.batchers = {"train": TokenBatcher(self.corpus, cfg.max_tokens, shuffle=True, seed=cfg.seed)}
        self.rng = random.Random(cfg.seed)
        self.state = TrainState.fresh(self.plan[0].name)
        self.fingerprint = supernet_fingerprint(self.spec, self.data, self.space)
        check_fingerprint(self.out_dir, self.fingerprint)
        self._restore()
        self.finished = self.state.step >= cfg.steps and (self.out_dir / "metrics.json").is_file()
        if self.finished:
            return
        if self.main:
            atomic_write_text(self.out_dir / "fingerprint.json", self.fingerprint)
        self.archs = SandwichArchs(self.space, self.rng, cfg.sandwich_k, balanced=cfg.balanced_sampling,
                                   counts=self.state.sample_counts)
        self.precision = self._resolve_precision()
        context = StageContext(self.spec, self.archs, autocast_for(self.precision, self.settings.device),
                               penalty=self.main)
        self.stages = [build_stage(stage.name, context) for stage in self.plan]
        self.show = (sys.stderr.isatty() if self.progress is None else self.progress) and self.main
        self.window = LossWindow()
        self.last_line_s = time.monotonic()
        self.bar = _progress(self.show)
        self.task = self.bar.add_task("train", total=cfg.steps, completed=self.state.step, info="")

    def train(self) -> TrainResult:
        """Train from the restored step to ``train.steps``, then save the supernet, score it and write its metrics
        (a finished run: its result as it is). See :func:`train_supernet`.

        Raises:
            FloatingPointError: a non-finite gradient norm.
        """
        if self.finished:
            return self.result()
        hooks = LoopHooks(stage_at=self._stage_at, corpus_at=self._corpus_at, batcher=self._batcher,
                          after_step=self._after_step, reads_at=self._reads_at)
        self.model.train()
        with self.bar:
            run_loop(self.model, self.optimizer, self.scheduler, self.state.loop, hooks, steps=self.cfg.steps,
                     accumulate=self.cfg.accumulate, clip_norm=self.cfg.clip_norm, device=self.settings,
                     rank=self.rank, world=self.world)
        self.model.eval()
        if self.main:
            save_model(self.model, self.out_dir, SUPERNET)
        self.state.final = self._final_metrics()
        self._checkpoint()
        self._write_metrics()
        self.report({**self.state.final, **(param_sums(self.model) if self.world > 1 else {}), "step": self.state.step})
        return self.result()

    def result(self) -> TrainResult:
        """Where the supernet is, its steps and its final metrics (empty before the end)."""
        return TrainResult(self.out_dir, self.state.step, dict(self.state.final))

    # ---- setup ----

    def _restore(self) -> None:
        """Load ``checkpoint.pt`` (weights, Adam, schedule, both RNGs, the state) when there is one; else MAT's
        proximal initialisation when ``train.proximal_init`` names a source."""
        path = self.out_dir / CHECKPOINT
        if path.is_file():
            ckpt = torch.load(path, weights_only=True, map_location=self.settings.device)
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.scheduler.load_state_dict(ckpt["scheduler"])
            torch.set_rng_state(ckpt["torch_rng"].cpu())
            self.rng.setstate(_as_tuple(ckpt["sampler_rng"]))
            self.state = TrainState.from_dict(ckpt["state"], self.plan[0].name)
        elif self.cfg.proximal_init is not None:  # a fresh run: MAT sec. 3.3
            proximal_initialize(self.model, load_proximal_source(self.cfg.proximal_init))

    def _resolve_precision(self) -> str:
        """``train.precision`` on this device (auto: bf16 only where the device has it natively), recorded in the
        state; warns when a resumed run's checkpoint trained in another one."""
        cfg, device = self.cfg, self.settings.device
        precision = resolve_precision(cfg.precision, device)
        before = self.state.precision  # None in checkpoints written before precision was recorded
        if self.main and before is not None and before != precision and self.state.step < cfg.steps:
            warnings.warn(f"train.precision: {cfg.precision} is {precision} on {torch.device(device)}, but the "
                          f"checkpoint {self.out_dir / CHECKPOINT} trained steps 1-{self.state.step} in {before}; "
                          f"training goes on in {precision} (weights stay fp32, but the run is no longer bit-for-bit "
                          f"reproducible; set train.precision: {before} to keep {before})",
                          stacklevel=4)  # the caller of train_supernet
        self.state.precision = precision
        return precision

    # ---- the loop's hooks (trainers.engine.LoopHooks) ----

    def _stage_at(self, step: int) -> tuple[Stage, StagePosition]:
        at = stage_at(self.plan, step)
        return self.stages[at.index], at

    def _corpus_at(self, step: int) -> str:
        return _corpus(self.plan, stage_at(self.plan, step))

    def _batcher(self, name: str) -> TokenBatcher:
        """The batcher of corpus ``name``; a stage-3 corpus is made when its stage starts: a checkpoint first (the
        model that translates survives a kill), then the widest's translations (:func:`_distilled_corpus`)."""
        if name not in self.batchers:
            if self.state.step % self.cfg.checkpoint_every:
                self._checkpoint()
            src, tgt = _distilled_corpus(self.model, self.archs.widest, self.corpus.src,
                                         stage_at(self.plan, self.state.step), self.out_dir / name, self.rank,
                                         self.world, self.precision == "bf16", self.show)
            self.batchers[name] = TokenBatcher(src, tgt, self.cfg.max_tokens, shuffle=True, seed=self.cfg.seed)
        return self.batchers[name]

    def _reads_at(self, step: int) -> bool:
        """Whether :meth:`_after_step` of 1-based ``step`` reads losses or weights: logs, stage ends, checkpoints."""
        cfg = self.cfg
        return (step % cfg.log_every == 0 or step == cfg.steps or step % cfg.checkpoint_every == 0
                or stage_at(self.plan, step - 1).is_last_step)

    def _after_step(self, result: StepResult) -> None:
        """After each optimizer step: the losses into the window; a step line and a report when one is due (else
        the bar moves); the reference scores at a stage's end; a checkpoint every ``train.checkpoint_every``."""
        at = result.position
        self.state.stage = at.stage.name
        self.window.add(result.output, result.ntokens)
        if self._log_due(at):
            self._log(at, result.grad_norm)
        else:
            self.bar.update(self.task, completed=self.state.step)
        if at.is_last_step and self.cfg.stage_eval:
            self._score_references(at)
        if self.state.step % self.cfg.checkpoint_every == 0:
            self._checkpoint()

    # ---- what a step does besides training ----

    def _log_due(self, at: StagePosition) -> bool:
        """Every ``train.log_every`` steps, at the last step of a stage and of the run, and without a bar at
        least every :data:`PROGRESS_EVERY_S` seconds."""
        step, cfg = self.state.step, self.cfg
        late = not self.show and time.monotonic() - self.last_line_s >= PROGRESS_EVERY_S
        return step % cfg.log_every == 0 or step == cfg.steps or at.is_last_step or late

    def _log(self, at: StagePosition, grad_norm: torch.Tensor) -> None:
        """Report the window's metrics (``train_supernet``'s ``report``) and show them on the bar or a step line."""
        cfg, step = self.cfg, self.state.step
        self.last_line_s = time.monotonic()
        inplace = at.number == 1 and cfg.inplace_distill
        students = cfg.sandwich_k + 1 if at.distill_lambda is not None or inplace else 0
        metrics = {**self.window.metrics(self.optimizer, grad_norm, sampled=cfg.sandwich_k, distilled=students),
                   "stage": at.number, "sample_spread": _max_spread(self.space, self.state.sample_counts)}
        if at.distill_lambda is not None:
            metrics[f"lambda_{at.number}"] = at.distill_lambda
        elif inplace:
            metrics["distill_lambda"] = cfg.distill_lambda
        self.state.elapsed_s += metrics.pop("window_s")
        self.bar.update(self.task, completed=step,
                        info=f"{at.stage.name} | loss {metrics['train_loss']:.3f} | "
                             f"{metrics['tokens_per_s']:.0f} tok/s | lr {metrics['lr']:.2e}")
        if self.main and not self.show:
            print(f"step {step}/{cfg.steps} {at.stage.name} loss {metrics['train_loss']:.3f} "
                  f"tok/s {metrics['tokens_per_s']:.0f} lr {metrics['lr']:.2e} "  # ETA: the resumed runs' rate too
                  f"{timing_text(self.state.elapsed_s, step, cfg.steps)}", file=sys.stderr, flush=True)
        if self.world > 1:  # checked equal across ranks by nas.search.ddp.ReportSink
            metrics.update(param_sums(self.model))
        self.report({**metrics, "step": step})

    def _score_references(self, at: StagePosition) -> None:
        """At the end of a stage: the reference sub-Transformers' validation BLEU/chrF, kept, printed, reported."""
        scores = broadcast(lambda: _reference_scores(self.model, self._validation(), self.space,
                                                     self.cfg.eval_beam_size), self.main)
        self.model.train()
        self.state.stage_scores[str(at.number)] = scores
        if self.main:
            print(f"end of stage {at.number} ({at.stage.name}): " + ", ".join(
                f"{k} {v:.2f}" for k, v in scores.items() if k.startswith("bleu")), file=sys.stderr, flush=True)
        self.report({**scores, "stage": at.number, "stage_end": 1, "step": self.state.step})

    def _checkpoint(self) -> None:
        """Rank 0: a snapshot (``train.keep_last`` > 0: written first, so a crash before the checkpoint re-creates
        it on resume), then ``checkpoint.pt`` (atomically)."""
        if not self.main:
            return
        if self.cfg.keep_last > 0:
            save_snapshot(self.model.state_dict(), self.out_dir / SNAPSHOTS, self.state.step, self.model.config())
            prune_snapshots(self.out_dir / SNAPSHOTS, self.cfg.keep_last)
        save_checkpoint(self.out_dir / CHECKPOINT, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
            "sampler_rng": self.rng.getstate(), "state": self.state.to_dict()})

    def _validation(self) -> ValidationSet:
        """The validation set, read on the first evaluation (by the main rank)."""
        if self._valid is None:
            self._valid = ValidationSet.load(self.data)
        return self._valid

    # ---- the end ----

    def _final_metrics(self) -> dict[str, float]:
        """The widest's validation scores, each stage's reference scores, training seconds, sample spread, epochs."""
        cfg, state = self.cfg, self.state
        last = state.stage_scores.get(str(STAGE_NUMBERS[self.plan[-1].name])) if cfg.stage_eval else None
        final = broadcast(lambda: _final_scores(self.model, self._validation(), self.archs.widest, last,
                                                beam_size=cfg.eval_beam_size, max_tokens=cfg.max_tokens), self.main)
        stage_scores = {f"stage{n}_{k}": v for n, scores in state.stage_scores.items() for k, v in scores.items()}
        return {**final, **stage_scores, "train_seconds": state.elapsed_s,
                "sample_spread": _max_spread(self.space, state.sample_counts),
                "epochs": state.epoch + state.position / max(len(self.batchers[state.corpus]), 1)}

    def _write_metrics(self) -> None:
        """Rank 0: ``sample_counts.json`` and ``metrics.json`` (whose presence marks the run finished)."""
        if self.main:
            atomic_write_text(self.out_dir / SAMPLE_COUNTS,
                              json.dumps(self.state.sample_counts, indent=1, sort_keys=True))
            atomic_write_text(self.out_dir / "metrics.json", json.dumps(self.state.final, indent=2))


def _no_report(_metrics: dict[str, float]) -> None:
    """The report of a run without one."""


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]supernet"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


def train_supernet(spec: SweepSpec, data: PreparedData, out_dir: str | Path, *, report: Report | None = None,
                   progress: bool | None = None, device: str | torch.device | None = None) -> TrainResult:
    """Train (or resume training) the sweep's supernet; returns where it was saved and its final scores.

    Runs data-parallel when ``torch.distributed`` is initialised (one process per worker, e.g. Ray
    Train's ``TorchTrainer``, see :mod:`nas.search.ddp`): every rank samples the same sub-Transformers
    (one seeded RNG), takes rows ``rank::world`` of every batch, normalises its loss by the global
    batch's target tokens and all-reduces (sums) the gradients, so each optimizer step equals the
    single-process step on the whole batch. Only rank 0 writes files; every rank calls ``report``
    with the same metrics.

    Args:
        spec: the sweep (``train``, ``supernet`` and ``space`` sections are used).
        data: tokenized corpus from :func:`nas.data.prepare_data`.
        out_dir: folder for ``checkpoint.pt``, the final ``supernet.*`` files, the ``snapshots/``
            (the newest ``train.keep_last``, one per checkpoint) and the stage-3 targets
            (``seq_distill/``); a finished run found there is not trained again.
        report: called with metrics every ``log_every`` steps, at the end of each stage and once at
            the end (``ray.tune.report`` inside a trial, MLflow logging standalone). Besides
            ``train_loss`` (the widest's), ``lr``, ``tokens_per_s`` and ``grad_norm``: ``stage`` (the
            paper's number: 1 joint, 2 word_distill, 3 seq_distill), ``loss_widest``, ``loss_narrowest``,
            ``loss_sampled`` (mean of the ``sandwich_k`` random ones; absent when k = 0), each the
            label-smoothed cross-entropy per target token against the stage's targets (the ground
            truth; the widest's beam-search translations in stage 3) averaged over the interval; in
            distillation stages ``lambda_2`` (eq. 5) or ``lambda_3`` (eq. 6) and ``loss_distill``
            (the sub-Transformers' cross-entropy against the widest's distribution per token). At the
            end of each stage (``train.stage_eval``): ``stage_end: 1`` and ``bleu_<ref>``/``chrf_<ref>``
            of the reference sub-Transformers (narrowest, middle, widest) on the validation set.
        progress: show a progress bar (default: when stderr is a terminal; never on ranks > 0).
        device: where to train (default: ``cuda`` when available, else ``cpu``).

    Raises:
        ValueError: ``out_dir`` holds another configuration's supernet; ``train.width_dropout`` lacks a
            model width of the space.
        FloatingPointError: a non-finite gradient norm.
    """
    recipe = SupernetRecipe(spec, data, out_dir, report=report, progress=progress, device=device)
    recipe.setup()
    return recipe.train()


def _max_spread(space: SearchSpace, counts: dict[str, dict[str, int]]) -> float:
    """The largest ``max / min - 1`` of a choice's value counts (:meth:`SearchSpace.count_spread`); 0 when nothing
    is counted yet or the space has one arch. Capped at 1e6 so that MLflow logs a finite number."""
    spread = space.count_spread(counts).values()
    return min(max(spread, default=0.0), 1e6)


def _corpus(plan, at: StagePosition) -> str:
    """Which targets a stage trains on: ``train`` (the ground truth) or, for a seq_distill stage,
    ``seq_distill/step_XXXXXXXX`` (the widest's translations made at that global step)."""
    if not isinstance(at.stage, SeqDistillStage):
        return "train"
    start = sum(s.steps for s in plan[:at.index])
    return f"{DISTILL_DIR}/step_{start:08d}"


def _distilled_corpus(model: SuperTransformer, widest: Arch, train_src: Sequence[list[int]], at: StagePosition,
                      folder: Path, rank: int, world: int, bf16: bool, show: bool):
    """Write (or finish writing) stage 3's targets with every rank's share, then load them all.

    ``train_src`` is the training sources as a sequence of id lists (the mapped corpus's ``src`` view: a row
    becomes a list when it is read); the stage-3 corpus returned is lists (at most ``max_sentences`` pairs).
    """
    stage = at.stage
    write_distill_targets(model, widest, train_src, folder, stage, rank=rank, world=world, bf16=bf16, progress=show)
    if world > 1:
        torch.distributed.barrier()
    src, tgt = load_distill_targets(folder, train_src, stage.max_sentences)
    if not src:
        raise ValueError(f"no stage-3 target survived the filters in {folder}; raise "
                         f"train.stages.{at.index}.max_length or max_length_ratio")
    return src, tgt


def _reference_scores(model: SuperTransformer, valid: ValidationSet, space: SearchSpace,
                      beam_size: int) -> dict[str, float]:
    """Validation BLEU/chrF (beam ``beam_size``: ``train.eval_beam_size``) of the narrowest, middle and widest
    sub-Transformers."""
    out: dict[str, float] = {}
    for name, arch in space.references().items():
        scores = validation_scores(model, arch, valid, beam_size=beam_size, loss=False)
        out[f"bleu_{name}"], out[f"chrf_{name}"] = scores["bleu"], scores["chrf"]
    return out


FORMAT_VERSION = 3
"""Bumped whenever the supernet's parameter layout changes (old checkpoints then fail the fingerprint)."""


def supernet_fingerprint(spec: SweepSpec, data: PreparedData, space: SearchSpace | None = None) -> str:
    """JSON identifying what a supernet checkpoint is: the model config, the tokenized data and the code's format.

    Steps, logging and checkpoint intervals are left out, so training can be extended. ``space``: the sweep's space
    when already built (:func:`nas.builders.build_space`; default: built here).
    """
    config = supernet_config(spec, data.vocab_size, space)  # no weights allocated
    return json.dumps({"format": FORMAT_VERSION, "model": config, "data": Path(data.root).name}, sort_keys=True)


def check_fingerprint(out_dir: Path, fingerprint: str) -> None:
    """Raise ValueError when ``out_dir`` holds a supernet of another configuration (nothing is overwritten)."""
    stored = out_dir / "fingerprint.json"
    has_files = (out_dir / CHECKPOINT).is_file() or (out_dir / f"{SUPERNET}.safetensors").is_file()
    if has_files and (not stored.is_file() or stored.read_text() != fingerprint):
        raise NasError(f"{out_dir} holds a supernet trained with another configuration or an older nas version; "
                         f"delete that folder or set another `workdir`/`name` in the YAML")


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _final_scores(model: SuperTransformer, valid: ValidationSet, widest: Arch, last_stage: dict[str, float] | None,
                  *, beam_size: int, max_tokens: int) -> dict[str, float]:
    """Validation BLEU/chrF (beam search of ``beam_size``) and loss (batches of ``max_tokens``) of the widest
    sub-Transformer; BLEU/chrF are taken from ``last_stage`` (the reference scores at the end of the last stage,
    same weights) when given."""
    scores = validation_scores(model, widest, valid, beam_size=None if last_stage is not None else beam_size,
                               max_tokens=max_tokens)
    if last_stage is not None:
        scores["bleu"], scores["chrf"] = last_stage["bleu_widest"], last_stage["chrf_widest"]
    return {"widest_bleu": scores["bleu"], "widest_chrf": scores["chrf"], "widest_valid_loss": scores["valid_loss"]}
