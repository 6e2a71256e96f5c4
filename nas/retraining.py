"""``nas retrain``: train one sub-Transformer alone with the YAML's ``retrain:`` recipe, tracked in MLflow.

HAT's claim rests on one pipeline (Wang et al. 2020, sec. 4): train the supernet, search under a latency budget,
**retrain the found sub-Transformer** with the recipe the hand-designed baseline gets, and compare at equal
latency. This module is step 3. The arch comes from a search trial (its MLflow run, or the best one under the
sweep's constraints) or from an arch string (a hand-designed baseline, which then trains through the same
recipe and code); :class:`nas.space.recipe.RetrainSpec` is the recipe.

- **Checks first.** The source, the arch and the output folder are checked before anything is written: an
  unknown, ambiguous or unfinished run, an arch the model cannot build, or a folder that holds another arch (or
  the same arch under another recipe) is a :class:`~nas.errors.NasError` naming the fix.
- **Resumable.** The folder keeps the training loop's checkpoint (model, optimizer, schedule, RNG, data
  position; :func:`trainers.train_standalone`), so rerunning a killed retrain ends with the weights of an
  uninterrupted one; a finished one is returned as it is.
- **Tracked.** One MLflow run with tag ``nas.role=retrain``: a child of the sweep's parent run with
  ``nas.source_run_id`` naming the trial, or a run of its own for an ``--arch``. It holds the recipe as params,
  the validation ``bleu``, ``chrf`` and ``valid_loss`` (beam ``retrain.beam_size``, length penalty
  ``retrain.length_penalty``), ``bleu_paper`` (the same translations scored as the fairseq papers do: lowercased,
  Moses-tokenized; :func:`nas.eval.scores.paper_bleu`), the fixed-length ``latency_ms`` (and ``latency_ratio`` to
  the sweep's reference arch, timed the same way), ``params_m``, ``train_loss``, ``train_seconds``, and the
  weights as artifacts (``model/``), which ``nas export --run-id`` exports.

Folder layout (``<workdir>/<name>/retrain/<arch_id>-<init>-seed<seed>`` by default): ``retrain.json`` (arch,
recipe, source; the marker), ``checkpoint.pt``, ``snapshots/``, then ``model.safetensors`` + ``model.json``
(the final, averaged weights), ``arch.json``, ``spm.model`` and ``metrics.json``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nas.errors import NasError
from nas.atomic import atomic_write_text
from nas.locks import lock_folder, run_lock
from nas.space import SweepSpec
from nas.space.arch import Arch

__all__ = ["RetrainResult", "retrain", "parse_arch", "target_language", "MARKER"]

MARKER = "retrain.json"
"""The file that makes a folder a retrain folder: its arch, recipe and source."""
METRICS = "metrics.json"


@dataclass(frozen=True)
class RetrainResult:
    """A finished retrain."""

    out_dir: Path
    """The retrain folder (``model.safetensors``, ``model.json``, ``arch.json``, ``spm.model``, ``metrics.json``)."""
    arch: Arch
    run_id: str
    """The MLflow run (``nas.role=retrain``)."""
    metrics: dict[str, float]
    """``bleu``, ``chrf`` (sacrebleu on detokenized text, 0-100, the whole validation set; beam
    ``retrain.beam_size``, length penalty ``retrain.length_penalty``), ``bleu_paper`` (BLEU of the same translations
    lowercased and Moses-tokenized, as Wu et al. report it: :func:`nas.eval.scores.paper_bleu`; the target language
    from the file name of ``data.valid.tgt``, :func:`target_language`), ``valid_loss``
    (nats per target token), ``latency_ms`` (fixed-length workload, ``search.latency_workload``),
    ``latency_reference_ms`` and ``latency_ratio``, ``params_m`` (millions), ``train_loss``, ``train_seconds``."""
    source_run_id: str | None
    """The trial whose arch was retrained (None for an ``arch``)."""
    recipe: dict[str, Any]
    """The effective recipe (:meth:`nas.space.recipe.RetrainSpec.resolved`)."""


@dataclass(frozen=True)
class _Source:
    arch: Arch
    run: Any | None  # the trial's mlflow Run
    parent_run_id: str | None
    sweep_id: str | None


def parse_arch(text: str) -> Arch:
    """An arch from ``--arch``: a summary string (``enc[128/256 128/256] dec[128/256]``), arch JSON, or the path
    of an ``arch.json`` file.

    Raises:
        NasError: none of these (names the value and the forms accepted).
    """
    text = text.strip()
    try:
        path = Path(text)
        if not text.startswith(("{", "enc[", "C")) and path.is_file():
            return Arch.from_json(path.read_text(encoding="utf-8"))
        return Arch.parse(text)
    except (ValueError, TypeError) as e:  # ArchError and JSONDecodeError are ValueErrors
        raise NasError(f"--arch {text!r}: {e}") from None


def target_language(spec: SweepSpec) -> str:
    """The target language's code that ``bleu_paper`` Moses-tokenizes with: from the file name of
    ``data.valid.tgt`` (``val.de.gz`` -> ``de``; :func:`nas.eval.scores.file_language`), ``en`` (Moses' default)
    when the name carries none. The YAML has no language field; Multi30k's files are named by language."""
    from nas.eval.scores import file_language

    return file_language(spec.data.valid.tgt)


def _arch_config(spec: SweepSpec, vocab_size: int, arch: Arch) -> dict[str, Any]:
    """The constructor config of a standalone model of ``arch`` under the YAML's supernet settings (vocabulary,
    head size, positions, io projection): the supernet's config with ``arch`` as its maxima, what
    :func:`nas.model.supernet.extract` gives a crop of the sweep's supernet."""
    from nas.builders import supernet_config

    maxima = dataclasses.replace(arch, model_width=None).to_dict()
    config = {**supernet_config(spec, vocab_size), "max_arch": maxima}
    if arch.model_width is not None:  # type 1: the layers run at the arch's model width, as extract() crops them
        config["model_dim"] = arch.model_width
        if spec.io_projection:
            config["embed_dim"] = spec.supernet.model_dim
    return config


def _check_arch_builds(spec: SweepSpec, arch: Arch) -> None:
    """Raise NasError unless a model of ``arch`` can be built under the YAML's supernet settings (the model's
    rules: widths divisible by the head size, a model width only with io projections, kernels only on Prime
    layers), independent of the sweep's space."""
    import torch

    from nas.model.supernet import SuperTransformer, check_arch

    config = _arch_config(spec, 8, arch)  # the vocabulary does not change the rules
    try:
        with torch.device("meta"):  # no memory: only the shapes are built
            model = SuperTransformer.from_config(config)
        check_arch(arch, model.max_arch, spec.supernet.model_dim, model.head_dim or model.heads, model.io_projection,
                   fixed_dim=model.head_dim is not None)
    except (ValueError, TypeError) as e:
        raise NasError(f"--arch {arch.summary()}: cannot build this model under supernet.* of {spec.name}: {e}") \
            from None


def _resolve_source(spec: SweepSpec, run_id: str | None, best: bool, arch: str | Arch | None, *,
                    experiment: str | None, metric: str, where: Sequence[str], include_infeasible: bool) -> _Source:
    if (run_id is not None) + bool(best) + (arch is not None) != 1:
        raise NasError("pass exactly one of --run-id ID, --best or --arch ARCH")
    if arch is not None:
        arch = arch if isinstance(arch, Arch) else parse_arch(arch)
        _check_arch_builds(spec, arch)
        return _Source(arch, None, None, None)
    from nas import tracking

    if best:
        chosen = tracking.best_trial(experiment or spec.experiment, metric=metric, where=where,
                                     include_infeasible=include_infeasible)
        run = tracking.get_client().get_run(chosen.run_id)
    else:
        run = tracking.resolve_run_id(run_id)
    problem = tracking.model_run_problem(run, roles=("trial",))
    if problem:
        raise NasError(problem)
    client = tracking.get_client()
    try:
        with tempfile.TemporaryDirectory(prefix="nas-retrain-") as tmp:
            found = Arch.from_json(Path(client.download_artifacts(run.info.run_id, "arch.json", tmp)).read_text())
    except Exception as e:  # noqa: BLE001 - a trial without its arch artifact
        raise NasError(f"trial run {run.info.run_id} has no readable arch.json artifact: {e}") from None
    tags = run.data.tags
    return _Source(found, run, tags.get(tracking.TAG_PARENT), tags.get(tracking.TAG_SWEEP_ID))


def _marker(arch: Arch, recipe: dict[str, Any], source: _Source, spec: SweepSpec) -> dict[str, Any]:
    return {"arch": arch.to_dict(), "arch_summary": arch.summary(), "recipe": recipe,
            "source_run_id": source.run.info.run_id if source.run is not None else None,
            "sweep": spec.name}


def _check_out_dir(out_dir: Path, marker: dict[str, Any]) -> bool:
    """Whether ``out_dir`` holds this retrain already (resume); raise NasError when it holds anything else."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise NasError(f"--out {out_dir} is a file; pass a folder")
    if not any(out_dir.iterdir()):
        return False
    path = out_dir / MARKER
    if not path.is_file():
        raise NasError(f"--out {out_dir} holds files and is no retrain folder (no {MARKER}); pass a new or empty "
                       f"folder")
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NasError(f"{path} is unreadable ({e}); pass another --out") from None
    if stored.get("arch") != marker["arch"]:
        raise NasError(f"--out {out_dir} holds a retrain of another arch ({stored.get('arch_summary')}, not "
                       f"{marker['arch_summary']}); pass another --out")
    changed = sorted(k for k in set(stored.get("recipe", {})) | set(marker["recipe"])
                     if stored.get("recipe", {}).get(k) != marker["recipe"].get(k))
    if changed:
        raise NasError(f"--out {out_dir} holds a retrain of this arch with another recipe (retrain."
                       f"{', retrain.'.join(changed)} differ); pass another --out, or the same retrain: settings")
    return True


def retrain(spec: SweepSpec, *, run_id: str | None = None, best: bool = False, arch: str | Arch | None = None,
            out_dir: str | Path | None = None, experiment: str | None = None, metric: str = "bleu",
            where: Sequence[str] = (), include_infeasible: bool = False, progress: bool | None = None,
            device: str | None = None, latency_runner: Any = None) -> RetrainResult:
    """Train one sub-Transformer alone with ``spec.retrain`` and track it (see the module docstring).

    Args:
        spec: the sweep (its ``retrain``, ``data``, ``supernet``, ``train`` and ``search`` sections are used).
        run_id: a FINISHED trial run, or a unique prefix of its id.
        best: the best trial by ``metric`` among those meeting their sweep's constraints (``where`` filters
            further, ``include_infeasible`` drops the constraints), in ``experiment`` (default the YAML's).
        arch: a hand-designed sub-Transformer (:func:`parse_arch`), checked against the model's rules only.
        out_dir: the retrain folder (default ``<workdir>/<name>/retrain/<arch_id>-<init>-seed<seed>``).
        progress: a progress bar on stderr (default: when stderr is a terminal; else a line per checkpoint).
        device: default ``cuda`` when available, else ``cpu``.
        latency_runner: ``search.latency_engine: onnxruntime``'s runner factory (``nas retrain`` and ``nas.api`` pass
            :func:`nas.export.latency_engine.onnx_runner`; :func:`nas.search.trials.engine_runner`).

    Raises:
        BackendError: the MLflow tracking store does not answer (one line, before anything runs).
        NasError: not exactly one source; an unknown, ambiguous or unfinished run; an arch the model cannot
            build; ``init: inherited`` without the supernet; an ``out_dir`` holding anything but this retrain.
            Nothing is written before these checks pass.
        RunLockedError: another process writes into the folder.
        FloatingPointError: training diverged.
    """
    from nas.preflight import check_tracking_store

    check_tracking_store(read_only=False)  # a server or database that refuses: one line, within seconds
    source = _resolve_source(spec, run_id, best, arch, experiment=experiment, metric=metric, where=where,
                             include_infeasible=include_infeasible)
    arch = source.arch
    recipe = spec.retrain.resolved(spec)
    supernet_dir = _inherited_supernet(spec, source) if recipe["init"] == "inherited" else None
    out_dir = Path(out_dir) if out_dir is not None else \
        spec.run_dir / "retrain" / f"{arch.arch_id}-{recipe['init']}-seed{recipe['seed']}"
    marker = _marker(arch, recipe, source, spec)
    _check_out_dir(out_dir, marker)
    with run_lock(lock_folder(spec.run_dir, out_dir), f"nas retrain {spec.name}"):
        return _retrain_locked(spec, source, recipe, supernet_dir, out_dir, marker, progress, device, latency_runner)


def _inherited_supernet(spec: SweepSpec, source: _Source) -> Path:
    """The supernet folder ``init: inherited`` crops from: the trial's (local, else from MLflow), else the YAML's."""
    if source.run is not None:
        from nas import tracking

        downloads = Path(tempfile.mkdtemp(prefix="nas-retrain-"))
        atexit.register(shutil.rmtree, downloads, True)
        return tracking.trial_model_files(source.run, downloads).supernet_dir
    folder = spec.run_dir / "supernet"
    if not (folder / "supernet.safetensors").is_file():
        raise NasError(f"retrain.init: inherited needs the trained supernet, but {folder}/supernet.safetensors does "
                       f"not exist; run `nas train` first, or set retrain.init: scratch")
    config = json.loads((folder / "supernet.json").read_text(encoding="utf-8"))
    try:
        source.arch.check_within(Arch.from_dict(config["max_arch"]))
    except ValueError as e:
        raise NasError(f"retrain.init: inherited: --arch is not inside the supernet ({e}); set retrain.init: "
                       f"scratch") from None
    return folder


def _retrain_locked(spec: SweepSpec, source: _Source, recipe: dict[str, Any], supernet_dir: Path | None,
                    out_dir: Path, marker: dict[str, Any], progress: bool | None,
                    device: str | None, latency_runner: Any = None) -> RetrainResult:
    from nas import tracking
    from nas.builders import prepare_sweep_data
    from nas.model.io import save_model

    data = prepare_sweep_data(spec, progress=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / MARKER, json.dumps(marker, indent=2))
    experiment = (tracking.get_client().get_experiment(source.run.info.experiment_id).name
                  if source.run is not None else spec.experiment)
    finished = tracking.find_tagged_runs(experiment, {tracking.TAG_ROLE: "retrain",
                                                      tracking.TAG_RETRAIN_DIR: str(out_dir.resolve())})
    done = next((r for r in finished if r.info.status == "FINISHED"), None)
    if done is not None and (out_dir / METRICS).is_file():  # already retrained: nothing to do
        return RetrainResult(out_dir, source.arch, done.info.run_id,
                             json.loads((out_dir / METRICS).read_text(encoding="utf-8")),
                             marker["source_run_id"], recipe)
    for stale in finished:  # left RUNNING by a killed retrain of this folder
        if stale.info.status == "RUNNING":
            tracking.end_run(stale.info.run_id, "KILLED")
    tags = {tracking.TAG_RETRAIN_DIR: str(out_dir.resolve()), tracking.TAG_ARCH_ID: source.arch.arch_id,
            tracking.TAG_ARCH_SUMMARY: source.arch.summary(), "nas.init": recipe["init"]}
    if source.run is not None:
        tags[tracking.TAG_SOURCE_RUN] = source.run.info.run_id
    run = tracking.start_run(experiment, f"retrain-{source.arch.arch_id}-{recipe['init']}-seed{recipe['seed']}",
                             role="retrain", parent_run_id=source.parent_run_id, tags=tags,
                             params=spec.redact({"retrain": recipe, "arch": source.arch.to_dict()}))
    try:
        model, metrics = _train_and_score(spec, source.arch, recipe, supernet_dir, data, out_dir, progress, device,
                                          latency_runner)
        save_model(model, out_dir, "model")
        atomic_write_text(out_dir / "arch.json", json.dumps(source.arch.to_dict(), indent=2))
        shutil.copyfile(data.spm_model, out_dir / "spm.model")
        tracking.log_metrics(run, metrics, step=recipe["steps"])
        tracking.log_retrain_files(run, out_dir)
        atomic_write_text(out_dir / METRICS, json.dumps(metrics, indent=2))
    except BaseException:
        tracking.end_run(run, "FAILED")
        raise
    tracking.end_run(run)
    return RetrainResult(out_dir, source.arch, run, metrics, marker["source_run_id"], recipe)


def _train_and_score(spec: SweepSpec, arch: Arch, recipe: dict[str, Any], supernet_dir: Path | None, data,
                     out_dir: Path, progress: bool | None, device: str | None, latency_runner: Any = None):
    """Build the model (fresh or cropped), train it resumably, average the newest snapshots, score it."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from nas.eval.validation import ValidationSet, validation_scores
    from nas.model.io import load_model
    from nas.model.supernet import SuperTransformer, count_params, extract
    from trainers import train_standalone
    from trainers.average import SNAPSHOTS, average_snapshots, latest_snapshots
    from trainers.loop import PROGRESS_EVERY_S

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if spec.train.threads:
        torch.set_num_threads(spec.train.threads)
    torch.manual_seed(recipe["seed"])
    if supernet_dir is not None:
        model = extract(load_model(supernet_dir, "supernet"), arch)
    else:
        model = SuperTransformer.from_config(_arch_config(spec, data.vocab_size, arch))
    model.dropout_rate = recipe["dropout"]  # the recipe's; saved with the config
    steps, train_spec = recipe["steps"], spec.retrain.training_spec(spec)
    show = sys.stderr.isatty() if progress is None else progress
    bar = Progress(TextColumn("[bold]retrain"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn(), console=Console(stderr=True), disable=not show)
    every = recipe["checkpoint_every"]
    last_line = [time.monotonic()]

    def on_step(step: int, loss: float) -> None:
        bar.update(task, completed=step, info=f"loss {loss:.3f}")
        late = time.monotonic() - last_line[0] >= PROGRESS_EVERY_S  # a line at least this often in a log
        if not show and (step % every == 0 or step == steps or late):
            last_line[0] = time.monotonic()
            print(f"retrain step {step}/{steps} loss {loss:.3f}", file=sys.stderr, flush=True)

    with bar:
        task = bar.add_task("retrain", total=steps, info=arch.summary())
        stats = train_standalone(model, arch, train_spec, data, steps, device=device, on_step=on_step,
                                 lr=recipe["lr"], warmup_steps=recipe["warmup_steps"], checkpoint_dir=out_dir,
                                 checkpoint_every=every, keep_last=recipe["average_last"])
    if recipe["average_last"] > 1:  # fairseq average_checkpoints over the newest snapshots
        paths = latest_snapshots(out_dir / SNAPSHOTS, min(recipe["average_last"],
                                                          len(list((out_dir / SNAPSHOTS).glob("step_*")))))
        model.load_state_dict(average_snapshots(paths))
    model.eval()
    vset = ValidationSet.load(data)
    metrics = validation_scores(model, arch, vset, beam_size=recipe["beam_size"],
                                len_penalty=recipe["length_penalty"], paper_lang=target_language(spec),
                                max_tokens=recipe["max_tokens"])
    metrics.update(_latency(spec, model, arch, data.vocab_size, latency_runner, data.spm_model))
    metrics.update(params_m=count_params(model) / 1e6, **stats, steps=float(steps))
    return model, {k: float(v) for k, v in metrics.items()}


def _latency(spec: SweepSpec, model, arch: Arch, vocab_size: int, latency_runner: Any = None,
             spm_model: Path | None = None) -> dict[str, float]:
    """``latency_ms``, ``latency_reference_ms`` and ``latency_ratio`` of ``model`` running ``arch``: the one
    measurement a sweep's trials use (:func:`nas.eval.latency.measure_latency_ratio`: the sweep's reference arch, a
    fresh model of it, timed interleaved; latency does not depend on weights), on the device a trial of this
    sweep times on (:func:`nas.eval.latency.latency_device`) with ``search.cpu_per_trial`` threads, under the
    node's measurement lock."""
    import torch

    from nas.builders import build_space
    from nas.eval.latency import latency_device, measure_latency_ratio, resolve_reference
    from nas.eval.measure_lock import MeasureLock
    from nas.model.supernet import SuperTransformer
    from nas.space.predictor_file import workload_of

    se = spec.search
    scoring = torch.device("cuda" if se.gpu_per_trial > 0 and torch.cuda.is_available() else "cpu")
    device = latency_device(se.latency_device, scoring)
    reference = resolve_reference(spec, build_space(spec))
    reference_model = SuperTransformer.from_config(_arch_config(spec, vocab_size, reference)).eval().to(device)
    from nas.search.trials import engine_runner

    threads = max(1, int(se.cpu_per_trial))
    runner = engine_runner(spec, latency_runner, spm_model, threads)
    try:
        measured = measure_latency_ratio(model.to(device), arch, reference_model, reference, workload=workload_of(se),
                                         rounds=se.latency_repeats, threads=threads, lock=MeasureLock(), runner=runner)
    finally:
        getattr(runner, "close", lambda: None)()
    model.to("cpu")
    return measured
