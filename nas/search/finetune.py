"""Fine-tune the search's most promising sub-Transformers from their inherited weights; ASHA stops the weak ones.

Inherited weights rank sub-Transformers cheaply, but a sub-Transformer cropped from the supernet is short of
what it reaches when trained on its own a little longer (OFA and HAT fine-tune the chosen sub-network after the
search). With ``search.finetune`` in the YAML (:class:`~nas.space.schema.FinetuneSpec`) a sweep ends with this stage:

1. :func:`select_candidates` picks ``top_k`` COMPLETE Optuna trials: the feasible Pareto front
   (``study.best_trials``, which leaves out trials violating ``search.constraints``), best first by the first
   metric of ``search.metrics``, then the best remaining feasible trials by that metric. When no trial is
   feasible it falls back to all COMPLETE trials, and says so.
2. :func:`run_finetune_stage` runs one Ray Tune trial per candidate (:func:`finetune_trial`): the sub-Transformer
   is extracted from the trained supernet with its inherited weights (:func:`nas.model.supernet.extract`) and
   trained ``steps`` more steps as ``train.*`` trains (:func:`trainers.train_standalone`; peak rate
   ``finetune.lr``, default ``train.lr / 10``), reporting its validation loss every ``eval_every`` steps. ASHA
   (Li et al. 2020, "A System for Massively Parallel Hyperparameter Tuning", Algorithm 2; Ray Tune's
   ``ASHAScheduler``) counts one evaluation as one time unit: at rung ``grace_period * reduction_factor**k``
   (evaluations) it stops a trial whose validation loss is worse than the best ``1/reduction_factor`` of the
   losses recorded at that rung before it. Every evaluation saves the weights to
   ``<workdir>/<name>/finetune/<NNNNN>/`` (``model.safetensors``, ``model.json``, ``arch.json``; NNNNN the
   Optuna trial number), so a stopped sub-Transformer keeps the weights it was stopped with.
3. A sub-Transformer that runs all its steps reports its final BLEU, chrF and validation loss
   (:func:`nas.search.fidelity.score_model`) beside the inherited ones. The summary table is printed and logged as
   ``finetune.json`` on the sweep's parent run.

MLflow: one child run per candidate under the sweep's parent run (role ``finetune``, tag ``nas.optuna_trial``),
FINISHED also when ASHA stopped it, with tag ``nas.finetune_stopped`` = the step it was stopped at.

Resume: a candidate that ran all its steps writes its result to ``<workdir>/<name>/finetune/<NNNNN>.json``
(atomically, before reporting it); a trial that Ray runs again after the driver was killed reports that file
instead of training again. The Ray Tune experiment (``<sweep id>-finetune``) is restored like the search's, so a
finished stage run again trains nothing and logs no new run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from nas.console import make_console
from rich.table import Table

from nas.errors import NasError
from nas import tracking
from nas.eval.validation import ValidationSet, validation_scores
from nas.search.ray_session import quiet_worker_exit
from nas.search.fidelity import score_model
from nas.atomic import atomic_write_text
from nas.model.io import save_model
from nas.model.supernet import extract
from nas.search.callbacks import MlflowTrialCallback
from nas.search.searcher import OPTUNA_TRIAL_KEY, StudyRef
from nas.search.trials import SweepContext, load_supernet
from nas.search.stop import fit
from nas.search.tune import make_tuner, ray_dir, run_config
from nas.builders import build_space
from nas.space.arch import Arch
from nas.space.space import SearchSpace
from nas.space import FinetuneSpec, SweepSpec
from trainers.standalone_trainer import train_standalone

__all__ = ["select_candidates", "finetune_trial", "run_finetune_stage", "finetune_counts", "finetune_table",
           "finetune_dir", "is_feasible", "FinetuneCallback", "ROLE", "TAG_STOPPED", "DONE_KEY", "ARCH_KEY",
           "SUMMARY_ARTIFACT"]

console = make_console()

ROLE = "finetune"
"""MLflow ``nas.role`` of a fine-tune run, and the Ray Tune experiment's stage name (``<sweep id>-finetune``)."""
TAG_STOPPED = "nas.finetune_stopped"
"""MLflow tag of a fine-tune run ASHA stopped: the step (optimizer steps) of its last evaluation."""
DONE_KEY = "finetune_done"
"""Key of the final report (``True``) of a trial that ran all ``finetune.steps`` steps."""
ARCH_KEY = "arch"
"""Key of the candidate's Optuna arch parameters in a fine-tune trial's config (MLflow params ``arch.*``)."""
SUMMARY_ARTIFACT = "finetune.json"
"""The stage's table (:func:`run_finetune_stage`'s rows), an artifact of the sweep's parent run."""


def finetune_dir(spec: SweepSpec) -> Path:
    """``<workdir>/<name>/finetune``: each candidate's result ``<NNNNN>.json`` and weights ``<NNNNN>/``."""
    return spec.run_dir.resolve() / "finetune"


def _finetune_spec(spec: SweepSpec) -> FinetuneSpec:
    if spec.search.finetune is None:
        raise NasError("search.finetune is not set: add e.g. `finetune: {top_k: 4, steps: 200}` under search")
    return spec.search.finetune


def _peak_lr(spec: SweepSpec) -> float:
    """``finetune.lr``, default ``train.lr / 10`` (the weights are trained already)."""
    ft = _finetune_spec(spec)
    return ft.lr if ft.lr is not None else spec.train.lr / 10


# --------------------------------------------------------------------------- choosing the candidates


def is_feasible(trial: FrozenTrial) -> bool:
    """Whether every constraint Optuna holds for ``trial`` (``trial.set_constraint``) is ``<= 0``; True without any."""
    return all(v <= 0 for v in trial.constraints.values())


def select_candidates(study: optuna.Study, spec: SweepSpec) -> list[FrozenTrial]:
    """The COMPLETE trials to fine-tune, at most ``search.finetune.top_k``, best first.

    First the feasible Pareto front (``study.best_trials``: trials that violate a constraint are left out),
    ordered by the first metric of ``search.metrics`` (its goal: highest BLEU first, lowest latency first;
    ties by trial number), then the best remaining feasible trials by that metric. When some trials completed
    but none is feasible, the same rule runs over all COMPLETE trials (a console line says so).

    Args:
        study: the sweep's Optuna study; its objectives are ``search.metrics``, in order.
        spec: the sweep (``search.finetune`` must be set).

    Returns:
        Up to ``top_k`` trials ([] when none completed).

    Raises:
        ValueError: ``search.finetune`` is not set, or the study's objectives are not ``search.metrics``.
    """
    top_k = _finetune_spec(spec).top_k
    metrics = spec.search.metrics
    if len(study.directions) != len(metrics):
        raise ValueError(f"study {study.study_name!r} has {len(study.directions)} objectives but search.metrics has "
                         f"{len(metrics)} ({', '.join(m.name for m in metrics)})")
    maximize = [m.goal == "maximize" for m in metrics]
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    feasible = [t for t in complete if is_feasible(t)]
    if complete and not feasible:
        console.print(f"[yellow]none of the {len(complete)} complete trials satisfies search.constraints "
                      f"({'; '.join(spec.search.constraints) or 'set by the objective'}); fine-tuning the best of all "
                      f"complete trials instead[/yellow]")
        pool = complete
        front = [t for t, on in zip(complete, tracking.pareto_mask([t.values for t in complete], maximize)) if on]
    else:
        pool, front = feasible, study.best_trials

    def rank(t: FrozenTrial) -> tuple[float, int]:
        return (-t.values[0] if maximize[0] else t.values[0], t.number)

    chosen = sorted(front, key=rank)[:top_k]
    taken = {t.number for t in chosen}
    chosen += sorted((t for t in pool if t.number not in taken), key=rank)[: top_k - len(chosen)]
    return chosen


# --------------------------------------------------------------------------- the trainable


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # missing, torn or unreadable


def _sweep_id(ctx: SweepContext) -> str:
    """The sweep id: the name of the search results folder (``trials/<sweep id>``; see ``runner.results_dir``)."""
    return Path(ctx.results_dir).name if ctx.results_dir is not None else ""


def _settings(ctx: SweepContext, arch: Arch) -> dict[str, Any]:
    """What a stored result depends on; a file with other settings is trained again."""
    ft = _finetune_spec(ctx.spec)
    return {"sweep_id": _sweep_id(ctx), "arch_id": arch.arch_id,
            "finetune": {**ft.model_dump(mode="json"), "lr": _peak_lr(ctx.spec)}}


def _inherited(ctx: SweepContext, number: int, model, arch: Arch, vset: ValidationSet) -> dict[str, float]:
    """``inherited_bleu`` and ``inherited_valid_loss``: the search trial's stored scores when its result file
    (``<results_dir>/<NNNNN>.json``) is there for this arch, else scored now (``score_model``)."""
    stored = _read_json(Path(ctx.results_dir) / f"{number:05d}.json") if ctx.results_dir is not None else None
    if stored and stored.get("arch_id") == arch.arch_id and all(
            isinstance(stored.get(k), (int, float)) and math.isfinite(stored[k]) for k in ("bleu", "valid_loss")):
        return {"inherited_bleu": float(stored["bleu"]), "inherited_valid_loss": float(stored["valid_loss"])}
    scores = score_model(model, arch, ctx.spec, ctx.data, vset)
    return {"inherited_bleu": scores["bleu"], "inherited_valid_loss": scores["valid_loss"]}


def finetune_trial(config: dict[str, Any], *, ctx: SweepContext) -> None:
    """Ray Tune trainable: fine-tune one candidate from its inherited weights, reporting for ASHA.

    ``config``: ``optuna_trial`` (the Optuna trial number) and ``arch`` (its Optuna parameters). Every
    ``finetune.eval_every`` steps (and after the last) it saves the weights to
    ``<workdir>/<name>/finetune/<NNNNN>/`` and reports ``valid_loss`` (nats/token, first
    ``search.valid_sentences`` validation sentences), ``step``, ``train_loss`` (label-smoothed, mean since the
    last evaluation), ``inherited_bleu``, ``inherited_valid_loss``, ``arch_id`` and ``arch_summary`` (the first
    report also ``arch``, JSON). The last report adds ``bleu`` and ``chrf`` (beam ``search.beam_size``) and
    ``finetune_done: True``; it is written to ``<workdir>/<name>/finetune/<NNNNN>.json`` first, and a trial
    whose file is there (same sweep, arch and ``search.finetune``) only reports it again.

    Raises:
        FloatingPointError: a non-finite validation loss or gradient norm (names the step and the arch).
        ValueError: ``search.finetune`` is not set, or the params do not make an arch of the space.
    """
    quiet_worker_exit()  # no "SystemExit" traceback when Ray stops this actor
    spec = ctx.spec
    ft = _finetune_spec(spec)
    number = int(config[OPTUNA_TRIAL_KEY])
    arch = build_space(spec).from_params(dict(config[ARCH_KEY]))
    result_file = finetune_dir(spec) / f"{number:05d}.json"
    settings = _settings(ctx, arch)
    stored = _read_json(result_file)
    if stored is not None and stored.get("settings") == settings and isinstance(stored.get("result"), dict):
        tune.report(stored["result"])  # fine-tuned before the driver was killed: not trained again
        return
    model = extract(load_supernet(str(ctx.supernet_dir)), arch).eval()  # a copy: the cached supernet is untouched
    torch.set_num_threads(max(1, int(spec.search.cpu_per_trial)))
    device = torch.device("cuda" if spec.search.gpu_per_trial > 0 and torch.cuda.is_available() else "cpu")
    vset = ValidationSet.load(ctx.data, spec.search.valid_sentences)
    info = {**_inherited(ctx, number, model, arch, vset), "arch_id": arch.arch_id, "arch_summary": arch.summary()}
    out = finetune_dir(spec) / f"{number:05d}"
    atomic_write_text(out / "arch.json", arch.to_json())
    losses: list[float] = []
    history: list[dict[str, Any]] = []

    def on_eval(step: int) -> None:
        final = step == ft.steps
        scores = (score_model(model, arch, spec, ctx.data, vset) if final else
                  validation_scores(model, arch, vset, beam_size=None, max_tokens=spec.train.max_tokens))
        if not all(math.isfinite(v) for v in scores.values()):
            raise FloatingPointError(f"Optuna trial {number}: non-finite {scores} after {step} fine-tune steps of "
                                     f"{arch.summary()}; lower search.finetune.lr")
        report = {**scores, "step": step, "train_loss": sum(losses) / max(len(losses), 1), **info}
        losses.clear()
        if not history:
            report["arch"] = arch.to_json()
        history.append({k: v for k, v in report.items() if k != "arch"})
        save_model(model, out)  # before reporting: ASHA may stop the trial at this report
        if final:
            report[DONE_KEY] = True
            atomic_write_text(result_file, json.dumps({"settings": settings, "history": history,
                                                       "result": {**report, DONE_KEY: True}}, indent=2))
        tune.report(report)

    torch.manual_seed(spec.train.seed)  # dropout and drop-branch draws: a re-run trains the same way
    train_standalone(model, arch, spec, ctx.data, ft.steps, device=device, lr=_peak_lr(spec),
                     warmup_steps=ft.warmup_steps, eval_every=ft.eval_every, on_eval=on_eval,
                     on_step=lambda step, loss: losses.append(loss))


class _ArchParams:
    """``tune.sample_from`` callable: the candidate's Optuna params, by the trial's ``optuna_trial``."""

    def __init__(self, params: dict[int, dict[str, Any]]) -> None:
        self.params = params

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        return dict(self.params[int(config[OPTUNA_TRIAL_KEY])])


# --------------------------------------------------------------------------- the driver


class FinetuneCallback(MlflowTrialCallback):
    """:class:`MlflowTrialCallback` for role ``finetune``: a run ends FINISHED also when ASHA stopped its trial,
    then with tag ``nas.finetune_stopped`` = the step of its last evaluation; prints a line per candidate."""

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        run_id = self.run_ids.get(trial.trial_id)
        last = trial.last_result or {}
        number = trial.config.get(OPTUNA_TRIAL_KEY, trial.trial_id)
        if run_id is not None and trial.trial_id not in self.done:
            if last.get(DONE_KEY):
                console.print(f"fine-tune {number} done: BLEU {last.get('inherited_bleu', float('nan')):.2f} -> "
                              f"{last.get('bleu', float('nan')):.2f}, valid loss "
                              f"{last.get('inherited_valid_loss', float('nan')):.3f} -> "
                              f"{last.get('valid_loss', float('nan')):.3f}  {last.get('arch_summary', '')}")
            else:
                step = int(last.get("step", 0))
                tracking.get_client().set_tag(run_id, TAG_STOPPED, str(step))
                console.print(f"fine-tune {number} stopped by ASHA at step {step}: valid loss "
                              f"{last.get('valid_loss', float('nan')):.3f}  {last.get('arch_summary', '')}")
        super().on_trial_complete(iteration, trials, trial, **info)


def _row(result, space: SearchSpace, ctx: SweepContext) -> dict[str, Any]:
    """One candidate's line of the summary (JSON-ready) from its Ray Tune result."""
    number = int(result.config[OPTUNA_TRIAL_KEY])
    arch = space.from_params(dict(result.config[ARCH_KEY]))
    m = result.metrics or {}
    status = ("failed" if result.error is not None else "completed" if m.get(DONE_KEY)
              else "stopped" if "step" in m else "not run")
    inherited = {k: m.get(k) for k in ("inherited_bleu", "inherited_valid_loss")}
    if inherited["inherited_bleu"] is None and ctx.results_dir is not None:  # failed before its first report
        stored = _read_json(Path(ctx.results_dir) / f"{number:05d}.json") or {}
        inherited = {"inherited_bleu": stored.get("bleu"), "inherited_valid_loss": stored.get("valid_loss")}
    model_dir = finetune_dir(ctx.spec) / f"{number:05d}"
    return {"optuna_trial": number, "arch_id": arch.arch_id, "arch_summary": arch.summary(), "status": status,
            **inherited, "bleu": m.get("bleu") if status == "completed" else None,
            "chrf": m.get("chrf") if status == "completed" else None,
            "valid_loss": m.get("valid_loss"), "step": m.get("step"),
            "stopped_at_step": m.get("step") if status == "stopped" else None,
            "model_dir": str(model_dir) if (model_dir / "model.safetensors").is_file() else None,
            "error": str(result.error)[-2000:] if result.error is not None else None}


def finetune_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """``finetune_completed``, ``finetune_stopped`` (by ASHA) and ``finetune_failed``: the sweep's parent metrics."""
    return {f"finetune_{s}": sum(r["status"] == s for r in rows) for s in ("completed", "stopped", "failed")}


def finetune_table(rows: list[dict[str, Any]]) -> Table:
    """The summary as a rich table: arch, inherited BLEU, fine-tuned BLEU (or where ASHA stopped it), valid loss."""
    def num(v: Any, digits: int) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    table = Table(title="fine-tuned sub-Transformers (ASHA)")
    for name, justify in (("trial", "right"), ("sub-Transformer", "left"), ("inherited BLEU", "right"),
                          ("fine-tuned BLEU", "right"), ("valid loss (inherited -> now)", "right")):
        table.add_column(name, justify=justify)
    for r in rows:
        outcome = {"completed": num(r["bleu"], 2), "stopped": f"stopped at step {r['stopped_at_step']}",
                   "failed": "[red]failed[/red]", "not run": "not run"}[r["status"]]
        table.add_row(str(r["optuna_trial"]), r["arch_summary"], num(r["inherited_bleu"], 2), outcome,
                      f"{num(r['inherited_valid_loss'], 3)} -> {num(r['valid_loss'], 3)}")
    return table


def run_finetune_stage(spec: SweepSpec, ctx: SweepContext, experiment: str, tags: dict[str, str], study: StudyRef,
                       sweep_id: str) -> list[dict[str, Any]]:
    """Fine-tune the :func:`select_candidates` of the sweep's study as one Ray Tune experiment under ASHA.

    One trial per candidate (:func:`finetune_trial`), ``search.max_concurrent`` at a time with
    ``search.cpu_per_trial``/``gpu_per_trial`` each; ASHA (``ASHAScheduler``, ``valid_loss`` minimised,
    ``training_iteration`` = evaluations, ``max_t = ceil(steps / eval_every)``) stops the weak ones. The
    experiment lives in ``ray_dir(spec, sweep_id, "finetune")`` and is restored when the sweep runs again;
    MLflow child runs come from :class:`FinetuneCallback`. Prints the summary table and logs it as
    ``finetune.json`` on the sweep's parent run.

    Args:
        spec: the sweep (``search.finetune`` must be set).
        ctx: the sweep's context (supernet and search results folders, data).
        experiment: MLflow experiment of the sweep.
        tags: tags of every child run (sweep id, supernet and data folders).
        study: where the sweep's Optuna study is.
        sweep_id: the sweep id (its parent run's ``nas.sweep_id``).

    Returns:
        One dict per candidate, in the order they were chosen: ``optuna_trial``, ``arch_id``, ``arch_summary``,
        ``status`` (``completed``, ``stopped`` by ASHA, ``failed``, ``not run``), ``inherited_bleu``,
        ``inherited_valid_loss``, ``bleu`` and ``chrf`` (fine-tuned; None unless completed), ``valid_loss`` and
        ``step`` (the last evaluation's), ``stopped_at_step``, ``model_dir`` and ``error``.

    Raises:
        ValueError: ``search.finetune`` is not set.
        RuntimeError: no MLflow parent run for ``sweep_id``.
    """

    ft, se = _finetune_spec(spec), spec.search
    candidates = select_candidates(study.load(), spec)
    if not candidates:
        return []
    max_t = math.ceil(ft.steps / ft.eval_every)  # FinetuneSpec checks grace_period <= max_t
    scheduler = ASHAScheduler(metric="valid_loss", mode="min", time_attr="training_iteration", max_t=max_t,
                              grace_period=ft.grace_period, reduction_factor=ft.reduction_factor)
    params = {"finetune": {**ft.model_dump(mode="json"), "lr": _peak_lr(spec)}}
    callback = FinetuneCallback(experiment, sweep_id, ROLE, tags, params)
    trainable = tune.with_resources(tune.with_parameters(finetune_trial, ctx=ctx),
                                    {"cpu": se.cpu_per_trial, "gpu": se.gpu_per_trial})
    exp_dir = ray_dir(spec, sweep_id, ROLE)
    numbers = [t.number for t in candidates]
    tuner, restored = make_tuner(
        trainable, exp_dir, restart_errored=False,
        param_space={OPTUNA_TRIAL_KEY: tune.grid_search(numbers),
                     ARCH_KEY: tune.sample_from(_ArchParams({t.number: dict(t.params) for t in candidates}))},
        tune_config=tune.TuneConfig(scheduler=scheduler, max_concurrent_trials=se.max_concurrent,
                                    reuse_actors=False),  # a stopped trial's process never runs the next one
        run_config=run_config(exp_dir, [callback], se.max_failures))
    console.print(f"[bold]fine-tuning[/bold] Optuna trials {', '.join(map(str, numbers))}: {ft.steps} steps from "
                  f"inherited weights at peak lr {_peak_lr(spec):g}, ASHA every {ft.eval_every} steps "
                  f"(grace {ft.grace_period}, reduction factor {ft.reduction_factor})" + (" (restored)" if restored else ""))
    grid = fit(tuner)
    space = build_space(spec)
    rows = [_row(result, space, ctx) for result in grid]
    order = {n: i for i, n in enumerate(numbers)}
    rows.sort(key=lambda r: order.get(r["optuna_trial"], len(order)))
    console.print(finetune_table(rows))
    parents = tracking.find_tagged_runs(experiment, {tracking.TAG_ROLE: "sweep", tracking.TAG_SWEEP_ID: sweep_id})
    if not parents:
        raise RuntimeError(f"no MLflow parent run for sweep {sweep_id!r} in experiment {experiment!r}")
    tracking.log_json_artifact(parents[0].info.run_id, rows, SUMMARY_ARTIFACT)
    return rows
