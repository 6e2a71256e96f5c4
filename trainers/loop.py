"""Supernet training with the sandwich rule in stages, resumable from atomic checkpoints, data-parallel.

Each step trains the widest sub-Transformer, the narrowest and ``k`` random ones on the
same batch and sums their gradients (the sandwich rule of slimmable networks), with Adam
with inverse-square-root warm-up and gradient clipping; ``train.accumulate`` batches make one
step. ``train.stages`` runs Scalable Transformers' three stages in order (sec. 3.3,
:mod:`trainers.distill`, :mod:`trainers.seq_distill`): ``joint`` (eq. 4: all learn from the ground
truth, label-smoothed), ``word_distill`` (the sub-Transformers also learn from the widest's word
distribution, weighted by the eq. 5 schedule) and ``seq_distill`` (eq. 6: the widest's beam-search
translations of the training sources replace the ground truth); the stage and the step within it
follow from the global step. ``train.width_dropout`` sets the dropout rate per sub-Transformer
width (sec. 4.1). A checkpoint (model, optimizer, scheduler, RNG states, data position and stage)
is written every ``checkpoint_every`` steps through a temporary file and ``os.replace``; rerunning
resumes from it exactly (same sampled sub-Transformers, same batches, same losses). Beside each
checkpoint a model-only snapshot ``snapshots/step_{step:08d}.safetensors`` is written and the newest
``keep_last`` are kept, for checkpoint averaging (:mod:`trainers.average`, ``nas average``).
"""

from __future__ import annotations

import functools
import json
import random
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from nas.errors import NasError
from nas.builders import build_space, build_supernet, supernet_config
from nas.data import PreparedData, TokenBatcher
from nas.eval.validation import ValidationSet, validation_scores
from nas.io import atomic_write_text
from nas.model.io import save_model
from nas.model.supernet import SuperTransformer
from nas.precision import autocast_for, resolve_precision, training_device
from nas.space.arch import Arch
from nas.space.space import SearchSpace
from nas.space import SeqDistillStage, SweepSpec
from trainers.average import SNAPSHOTS, prune_snapshots, save_snapshot
from trainers.distill import STAGE_NUMBERS, StagePosition, check_width_dropout, stage_at
from trainers.distributed import broadcast, dist_info, param_sums
from trainers.engine import LoopHooks, StepResult, run_loop, save_checkpoint
from trainers.optim import make_optimizer, make_scheduler
from trainers.proximal import load_proximal_source, proximal_initialize

PROGRESS_EVERY_S = 30.0
"""Without a progress bar (a log, a Ray trial), a step line is printed at least this often (seconds), besides
every ``train.log_every`` steps: a slow machine still shows progress (issue 30)."""
from trainers.seq_distill import (
    DISTILL_DIR,
    load_distill_targets,
    write_distill_targets,
)
from trainers.stages import SandwichArchs, Stage, StageContext, build_stage
from trainers.window import LossWindow

__all__ = ["train_supernet", "TrainResult", "supernet_fingerprint", "check_fingerprint"]

Report = Callable[[dict[str, float]], None]
CHECKPOINT = "checkpoint.pt"
SAMPLE_COUNTS = "sample_counts.json"
"""How often each (layer, dimension, value) was trained: the sandwich's draws of the whole run
(:attr:`~trainers.stages.SandwichArchs.counts`), written beside the supernet and logged with its files."""
SUPERNET = "supernet"


@dataclass(frozen=True)
class TrainResult:
    supernet_dir: Path
    """Folder with ``supernet.safetensors`` + ``supernet.json``."""
    steps: int
    metrics: dict[str, float]
    """Final metrics: ``widest_bleu``, ``widest_chrf``, ``widest_valid_loss``, ``train_loss``, ``train_seconds``."""




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
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank, world = dist_info()
    main = rank == 0
    settings = training_device(device)  # CUDA: TF32, fused Adam, pinned batches, no host sync per step
    device = settings.device
    tr = spec.train
    torch.manual_seed(tr.seed)
    if tr.threads:
        torch.set_num_threads(tr.threads)
    space = build_space(spec)
    valid = functools.cache(lambda: ValidationSet.load(data))  # read on the first evaluation, by the main rank
    check_width_dropout(tr.width_dropout, {w or spec.supernet.model_dim for w in space.model_widths})
    plan = tr.stage_plan
    model = build_supernet(spec, data.vocab_size).to(device)
    optimizer = make_optimizer(model, tr.lr, tr.weight_decay, fused=settings.fused_adam)
    scheduler = make_scheduler(optimizer, tr.warmup_steps, [stage.steps for stage in plan])  # restarts per stage
    corpus = data.corpus("train")  # memory-mapped: the ranks of one machine share its pages
    batchers = {"train": TokenBatcher(corpus, tr.max_tokens, shuffle=True, seed=tr.seed)}
    rng = random.Random(tr.seed)
    state = {"step": 0, "epoch": 0, "position": 0, "elapsed_s": 0.0, "final": {}, "stage": plan[0].name,
             "corpus": "train", "stage_scores": {}, "sample_counts": {}}
    ckpt_path = out_dir / CHECKPOINT
    fingerprint = supernet_fingerprint(spec, data)
    check_fingerprint(out_dir, fingerprint)
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=True, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["torch_rng"].cpu())
        rng.setstate(_as_tuple(ckpt["sampler_rng"]))
        state = {"corpus": "train", "stage_scores": {}, "sample_counts": {}, **ckpt["state"]}
    elif tr.proximal_init is not None:  # a fresh run: MAT sec. 3.3
        proximal_initialize(model, load_proximal_source(tr.proximal_init))
    if state["step"] >= tr.steps and (out_dir / "metrics.json").is_file():
        return TrainResult(out_dir, state["step"], dict(state["final"]))

    if main:
        atomic_write_text(out_dir / "fingerprint.json", fingerprint)

    def checkpoint() -> None:
        if not main:
            return
        if tr.keep_last > 0:  # snapshot first: a crash before the checkpoint re-creates it on resume
            save_snapshot(model.state_dict(), out_dir / SNAPSHOTS, state["step"], model.config())
            prune_snapshots(out_dir / SNAPSHOTS, tr.keep_last)
        save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                     "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                                     "sampler_rng": rng.getstate(), "state": state})

    archs = SandwichArchs(space, rng, tr.sandwich_k, balanced=tr.balanced_sampling, counts=state["sample_counts"])
    widest = archs.widest
    precision = resolve_precision(tr.precision, device)  # auto: bf16 only where the device has it natively
    before = state.get("precision")  # absent in checkpoints written before precision was recorded
    if main and before is not None and before != precision and state["step"] < tr.steps:
        warnings.warn(f"train.precision: {tr.precision} is {precision} on {torch.device(device)}, but the checkpoint "
                      f"{ckpt_path} trained steps 1-{state['step']} in {before}; training goes on in {precision} "
                      f"(weights stay fp32, but the run is no longer bit-for-bit reproducible; set "
                      f"train.precision: {before} to keep {before})", stacklevel=2)
    state["precision"] = precision
    bf16 = precision == "bf16"
    context = StageContext(spec, archs, autocast_for(precision, device), penalty=main)
    stages = [build_stage(stage.name, context) for stage in plan]
    show = (sys.stderr.isatty() if progress is None else progress) and main
    emit = report or (lambda _metrics: None)
    window = LossWindow()
    last_line = [time.monotonic()]  # when the last step line was printed

    def stage_of(step: int) -> tuple[Stage, StagePosition]:
        at = stage_at(plan, step)
        return stages[at.index], at

    def batcher(name: str) -> TokenBatcher:
        if name not in batchers:
            if state["step"] % tr.checkpoint_every:  # the model that translates survives a kill
                checkpoint()
            src, tgt = _distilled_corpus(model, widest, corpus.src, stage_at(plan, state["step"]),
                                         out_dir / name, rank, world, bf16, show)
            batchers[name] = TokenBatcher(src, tgt, tr.max_tokens, shuffle=True, seed=tr.seed)
        return batchers[name]

    def after_step(result: StepResult) -> None:
        at = result.position
        state["stage"] = at.stage.name
        window.add(result.output, result.ntokens)
        late = not show and time.monotonic() - last_line[0] >= PROGRESS_EVERY_S
        if state["step"] % tr.log_every == 0 or state["step"] == tr.steps or at.is_last_step or late:
            last_line[0] = time.monotonic()
            inplace = at.number == 1 and tr.inplace_distill
            students = tr.sandwich_k + 1 if at.distill_lambda is not None or inplace else 0
            metrics = {**window.metrics(optimizer, result.grad_norm, sampled=tr.sandwich_k, distilled=students),
                       "stage": at.number, "sample_spread": _max_spread(space, state["sample_counts"])}
            if at.distill_lambda is not None:
                metrics[f"lambda_{at.number}"] = at.distill_lambda
            elif inplace:
                metrics["distill_lambda"] = tr.distill_lambda
            state["elapsed_s"] += metrics.pop("window_s")
            bar.update(task, completed=state["step"],
                       info=f"{at.stage.name} | loss {metrics['train_loss']:.3f} | "
                            f"{metrics['tokens_per_s']:.0f} tok/s | lr {metrics['lr']:.2e}")
            if main and not show:
                print(f"step {state['step']}/{tr.steps} {at.stage.name} loss {metrics['train_loss']:.3f} "
                      f"tok/s {metrics['tokens_per_s']:.0f} lr {metrics['lr']:.2e}", file=sys.stderr, flush=True)
            if world > 1:  # checked equal across ranks by nas.search.ddp.ReportSink
                metrics.update(param_sums(model))
            emit({**metrics, "step": state["step"]})
        else:
            bar.update(task, completed=state["step"])
        if at.is_last_step and tr.stage_eval:  # the reference sub-Transformers after each stage
            scores = broadcast(lambda: _reference_scores(model, valid(), spec, space), main)
            model.train()
            state["stage_scores"][str(at.number)] = scores
            if main:
                print(f"end of stage {at.number} ({at.stage.name}): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in scores.items() if k.startswith("bleu")), file=sys.stderr, flush=True)
            emit({**scores, "stage": at.number, "stage_end": 1, "step": state["step"]})
        if state["step"] % tr.checkpoint_every == 0:
            checkpoint()

    def reads_at(step: int) -> bool:  # after_step reads losses or weights: logs, stage ends, checkpoints
        return (step % tr.log_every == 0 or step == tr.steps or step % tr.checkpoint_every == 0
                or stage_at(plan, step - 1).is_last_step)

    hooks = LoopHooks(stage_at=stage_of, corpus_at=lambda step: _corpus(plan, stage_at(plan, step)),
                      batcher=batcher, after_step=after_step, reads_at=reads_at)
    model.train()
    with _progress(show) as bar:
        task = bar.add_task("train", total=tr.steps, completed=state["step"], info="")
        run_loop(model, optimizer, scheduler, state, hooks, steps=tr.steps, accumulate=tr.accumulate,
                 clip_norm=tr.clip_norm, device=settings, rank=rank, world=world)
    model.eval()
    if main:
        save_model(model, out_dir, SUPERNET)
    last = state["stage_scores"].get(str(STAGE_NUMBERS[plan[-1].name])) if tr.stage_eval else None
    final = broadcast(lambda: _final_scores(model, valid(), spec, widest, last), main)
    stage_scores = {f"stage{n}_{k}": v for n, scores in state["stage_scores"].items() for k, v in scores.items()}
    state["final"] = {**final, **stage_scores, "train_seconds": state["elapsed_s"],
                      "sample_spread": _max_spread(space, state["sample_counts"]),
                      "epochs": state["epoch"] + state["position"] / max(len(batchers[state["corpus"]]), 1)}
    checkpoint()
    if main:
        atomic_write_text(out_dir / SAMPLE_COUNTS, json.dumps(state["sample_counts"], indent=1, sort_keys=True))
        atomic_write_text(out_dir / "metrics.json", json.dumps(state["final"], indent=2))
    emit({**state["final"], **(param_sums(model) if world > 1 else {}), "step": state["step"]})
    return TrainResult(out_dir, state["step"], dict(state["final"]))


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


def _reference_scores(model: SuperTransformer, valid: ValidationSet, spec: SweepSpec,
                      space: SearchSpace) -> dict[str, float]:
    """Validation BLEU/chrF (beam ``train.eval_beam_size``) of the narrowest, middle and widest sub-Transformers."""
    out: dict[str, float] = {}
    for name, arch in space.references().items():
        scores = validation_scores(model, arch, valid, beam_size=spec.train.eval_beam_size, loss=False)
        out[f"bleu_{name}"], out[f"chrf_{name}"] = scores["bleu"], scores["chrf"]
    return out


FORMAT_VERSION = 3
"""Bumped whenever the supernet's parameter layout changes (old checkpoints then fail the fingerprint)."""


def supernet_fingerprint(spec: SweepSpec, data: PreparedData) -> str:
    """JSON identifying what a supernet checkpoint is: the model config, the tokenized data and the code's format.

    Steps, logging and checkpoint intervals are left out, so training can be extended.
    """
    config = supernet_config(spec, data.vocab_size)  # no weights allocated
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


def _final_scores(model: SuperTransformer, valid: ValidationSet, spec: SweepSpec, widest,
                  last_stage: dict[str, float] | None) -> dict[str, float]:
    """Validation BLEU/chrF (beam search) and loss of the widest sub-Transformer; BLEU/chrF are taken
    from ``last_stage`` (the reference scores at the end of the last stage, same weights) when given."""
    beam_size = None if last_stage is not None else spec.train.eval_beam_size
    scores = validation_scores(model, widest, valid, beam_size=beam_size, max_tokens=spec.train.max_tokens)
    if last_stage is not None:
        scores["bleu"], scores["chrf"] = last_stage["bleu_widest"], last_stage["chrf_widest"]
    return {"widest_bleu": scores["bleu"], "widest_chrf": scores["chrf"], "widest_valid_loss": scores["valid_loss"]}
