"""Export a trial (or a retrained model) tracked in MLflow: the user job behind `nas export` and `nas.export`.

`export_trial` finds the run (`--run-id`, a unique prefix of it, or `--best` under its sweep's
constraints), fetches the weights (the supernet on this machine or logged to MLflow; a retrain run's own weights),
writes the export folder (`nas.export.folder.export_arch`) and, on request, the ONNX graphs (verified with
onnxruntime), their int8 version, a CTranslate2 folder (checked against PyTorch) and a registered MLflow model.
It prints nothing: what a user should read comes back in `ExportResult.messages` and
`ExportResult.warnings`, which the CLI prints.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nas.errors import NasError

__all__ = ["ExportCheckFailed", "ExportResult", "export_trial"]

FALLBACK_SENTENCES = ("a", "the house .", "two people are walking down the street .", "1 2 3")
"""What the export checks translate when the sweep logged no validation file (any text tokenizes)."""
ONNX_LOGIT_TOLERANCE = 1e-4
"""Largest |logit difference| between the ONNX graphs and PyTorch that `export_trial` accepts."""


class ExportCheckFailed(RuntimeError):
    """A written export failed its check against PyTorch (ONNX logits, CTranslate2 translations): a defect of the
    conversion, not bad input (the CLI exits 1, keeping the message)."""


@dataclass
class ExportResult:
    """What `export_trial` wrote.

    Attributes:
        path: the export folder (`model.safetensors`, `model.json`, `arch.json`, `spm.model`,
            `export.json`; ONNX and CTranslate2 files when asked).
        run_id: the exported MLflow run (a trial, or a retrain run).
        arch: the exported sub-Transformer.
        retrained: the weights are a retrain run's (`nas retrain`), not the supernet's crop.
        metrics: the run's MLflow metrics (BLEU, chrF, `latency_ms`, ...).
        feasible: with `best`: whether the trial meets its sweep's `search.constraints` (None: not judged).
        onnx_max_diff: the largest |logit difference| of the ONNX graphs against PyTorch (None: no ONNX).
        registered: `(name, version)` of the registered MLflow model (None: not registered).
        messages: lines for the user (what was written and how to use it), in order.
        warnings: lines for the user that need attention (an infeasible trial exported).
    """

    path: Path
    run_id: str
    arch: Any
    retrained: bool
    metrics: dict[str, float]
    feasible: bool | None = None
    onnx_max_diff: float | None = None
    registered: tuple[str, int] | None = None
    messages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def export_trial(out_dir: str | Path, *, run_id: str | None = None, best: bool = False, metric: str = "bleu",
                 experiment: str | None = None, where: Sequence[str] = (), include_infeasible: bool = False,
                 onnx: bool = False, quantize: str | None = None, ctranslate2: bool = False,
                 register: str | None = None, force: bool = False) -> ExportResult:
    """Write the sub-Transformer of an MLflow run as a standalone export folder.

    Args:
        out_dir: folder to write: new, empty or an earlier export (replaced as a whole, atomically).
        run_id: a trial run, or a retrain run (its retrained weights); a unique prefix of the id is enough.
        best: instead of `run_id`, the best trial of `experiment` by `metric` that meets its sweep's
            `search.constraints` (any trial with `include_infeasible`) and every `where` (`METRIC OP NUMBER`).
        experiment: for `best` (default: the newest sweep's, `nas.tracking.latest_experiment`).
        onnx: also write `encoder.onnx`, `decoder_step.onnx` and `translate_onnx.py`, verified with
            onnxruntime (at most `ONNX_LOGIT_TOLERANCE` from PyTorch's logits).
        quantize: `"int8"`: also the int8 ONNX graphs (implies `onnx`).
        ctranslate2: also `<out>/ctranslate2`, whose greedy translations must equal PyTorch's (needs the
            `serve` extra); the sub-Transformer must be a plain Transformer.
        register: also log the export as an MLflow pyfunc model registered under this name (alias `champion`).
        force: replace `out_dir` even if it holds files and is not an earlier export (never the current folder,
            its ancestors or the home folder).

    Returns:
        `ExportResult`.

    Raises:
        NasError: bad input, checked before anything is written: not exactly one of `run_id`/`best`, an
            unknown, ambiguous or parent run id, no trial meeting the constraints, an `out_dir` that is not
            replaceable, an arch CTranslate2 cannot represent, a missing `ctranslate2` package; a missing or
            damaged weights file (`nas.errors.MissingFileError`, `nas.errors.DamagedFileError`).
        ExportCheckFailed: the ONNX graphs or the CTranslate2 model disagree with PyTorch (the folder is written).
    """
    from nas import tracking
    from nas.export.folder import PROVENANCE, export_arch
    from nas.atomic import check_output_dir
    from nas.preflight import check_tracking_store
    from nas.space.arch import Arch

    if not isinstance(out_dir, (str, Path)):
        raise NasError(f"export(out_dir): expected a folder path (str or Path), got {type(out_dir).__name__}")
    if isinstance(where, str):
        where = (where,)
    if register is not None and (not isinstance(register, str) or not register.strip()):
        raise NasError("--register needs a model name, e.g. --register quickstart-en-de")
    if best == bool(run_id):
        raise NasError("pass exactly one of --best or --run-id ID")
    if quantize is not None and quantize != "int8":
        raise NasError(f"--quantize {quantize}: the one quantization is int8 (--quantize int8)")
    onnx = onnx or quantize is not None
    out_dir = Path(out_dir)
    try:  # before MLflow is read or the supernet loaded
        check_output_dir(out_dir, marker=PROVENANCE, force=force)
    except NasError as e:
        raise type(e)(f"--out: {e}") from None
    check_tracking_store(read_only=True)  # one line within seconds; a missing SQLite store is not created
    client = tracking.get_client()
    chosen = None
    try:
        if best:
            experiment = experiment or tracking.latest_experiment()
            chosen = tracking.best_trial(experiment, metric=metric, where=tuple(where or ()),
                                         include_infeasible=include_infeasible)
            run_id = chosen.run_id
        run = tracking.resolve_run_id(run_id)
    except NasError:
        raise
    except Exception as e:  # mlflow raises MlflowException for an unreadable store
        raise NasError(f"cannot read MLflow run {run_id!r}: {e}") from None
    problem = tracking.model_run_problem(run)
    if problem:
        raise NasError(problem)
    run_id = run.info.run_id
    tags = run.data.tags
    retrained = tags.get(tracking.TAG_ROLE) == "retrain"
    result_messages: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nas-export-") as tmp:  # ours: the downloads, removed at the end
        downloads = Path(tmp)
        try:  # the supernet on this machine, else the sweep logged it to MLflow (a laptop exporting a cluster's)
            if retrained:  # the retrained weights, local or from the run's artifacts
                folder = tracking.retrained_model_files(run, downloads)
                files = tracking.ModelFiles(folder, folder / "spm.model", None, "local")
                arch = Arch.from_dict(json.loads((folder / "arch.json").read_text(encoding="utf-8")))
            else:
                arch = Arch.from_dict(json.loads(Path(client.download_artifacts(run_id, "arch.json")).read_text()))
                files = tracking.trial_model_files(run, downloads)
        except NasError as e:
            raise type(e)(f"cannot export run {run_id}: {e}") from None
        if files.source == "mlflow":
            result_messages.append(f"read the supernet from MLflow run {files.run_id} (not on this machine)")
        if ctranslate2:  # before anything is written: the choice CTranslate2 cannot represent, and the package
            _check_ctranslate2(arch, files.supernet_dir / ("model.json" if retrained else "supernet.json"))
        warnings: list[str] = []
        if chosen is None and not retrained:  # --run-id of a trial: say when it breaks its sweep's constraints
            warnings += _infeasible_warning(tracking, run)
        provenance = {"run_id": run_id, "experiment_id": run.info.experiment_id, "metrics": run.data.metrics,
                      "sweep_id": tags.get("nas.sweep_id")}
        try:
            path = export_arch(files.supernet_dir, files.spm_model, arch, out_dir,
                               beam_size=int(tags.get("nas.beam_size", 4)), provenance=provenance, force=force,
                               model_name="model" if retrained else "supernet")
        except NasError as e:
            raise type(e)(f"cannot export run {run_id}: {e}") from None
        except (FileNotFoundError, KeyError) as e:
            raise NasError(f"cannot export run {run_id}: {e}") from None
        result = ExportResult(path, run_id, arch, retrained, dict(run.data.metrics), warnings=warnings,
                              messages=result_messages)
        kind = "retrained " if retrained else ""
        result.messages.append(f"exported {kind}{arch.summary()} (BLEU {run.data.metrics.get('bleu', float('nan')):.2f})"
                               f" to {path}")
        if chosen is not None and chosen.feasible is not None:
            result.feasible = chosen.feasible
            bounds = tracking.describe_constraints(tracking.constraints_by_sweep(experiment, chosen.sweep_id))
            if chosen.feasible:
                result.messages.append(f"the best trial by {metric} that meets its sweep's search.constraints "
                                       f"{bounds}")
            else:
                result.warnings.append(f"run {run_id} breaks its sweep's search.constraints {bounds} "
                                       "(--include-infeasible)")
        valid = files.valid if files.valid is not None and Path(files.valid).is_file() else None
        if onnx:
            _write_onnx(result, valid, quantize)
        if ctranslate2:
            _write_ctranslate2(result, valid)
        if register is not None:
            _register(result, register, run, valid)
    return result


def _sentences(valid: Path | None, n: int) -> list[str]:
    """The first `n` source sentences of the sweep's validation file (real ones), else `FALLBACK_SENTENCES`."""
    if valid is None:
        return list(FALLBACK_SENTENCES)
    import pyarrow.parquet as pq

    return pq.read_table(valid, columns=["src_text"]).column("src_text").to_pylist()[:n] or list(FALLBACK_SENTENCES)


def _infeasible_warning(tracking, run) -> list[str]:
    """One line when trial `run` breaks its sweep's search.constraints, naming each bound and the value."""
    from nas.space.constraints import violated

    parent = run.data.tags.get(tracking.TAG_PARENT)
    if not parent:
        return []
    try:
        constraints = tracking.sweep_constraints(tracking.get_client().get_run(parent))
    except Exception:  # noqa: BLE001 - a deleted or unreadable parent: nothing to judge by
        return []
    broken = violated(constraints, run.data.metrics)
    if not broken:
        return []
    sweep = run.data.tags.get(tracking.TAG_SWEEP_ID, "?")
    values = ", ".join(f"{c.key} ({c.metric} is {run.data.metrics.get(c.metric, float('nan')):g})" for c in broken)
    return [f"run {run.info.run_id} breaks sweep {sweep}'s search.constraints: {values}; exporting it anyway "
            "(--run-id)"]


def _check_ctranslate2(arch, supernet_config: Path) -> None:
    """Raise NasError when `arch` has a choice CTranslate2 cannot represent, or ctranslate2 is missing."""
    from nas.export.ct2 import ctranslate2_problem, require_ctranslate2

    config = json.loads(supernet_config.read_text(encoding="utf-8")) if supernet_config.is_file() else {}
    problem = ctranslate2_problem(arch, config)
    if problem:
        raise NasError(f"--ctranslate2: {problem}; export without --ctranslate2, or pick a plain Transformer trial")
    try:
        require_ctranslate2()
    except NasError as e:
        raise NasError(f"--ctranslate2: {e}") from None


def _write_onnx(result: ExportResult, valid: Path | None, quantize: str | None) -> None:
    from nas.export.onnx import export_onnx, verify_onnx

    path = result.path
    export_onnx(path, path)
    diff = verify_onnx(path, _sentences(valid, 4))
    result.onnx_max_diff = diff
    if diff > ONNX_LOGIT_TOLERANCE:
        raise ExportCheckFailed(f"ONNX export of {path} differs from PyTorch by {diff:.2e} in the logits "
                                f"(limit {ONNX_LOGIT_TOLERANCE:g})")
    result.messages.append(f"ONNX: encoder.onnx + decoder_step.onnx, max |logit diff| vs PyTorch {diff:.1e}; "
                           f"translate with `python {path}/translate_onnx.py < input.txt` (onnxruntime only)")
    if quantize is not None:
        from nas.export.onnx import quantize_onnx

        report = quantize_onnx(path)
        done = ", ".join(f"{g}.int8.onnx ({r['quantized']} weight products int8, {r['int8_bytes'] / 2**20:.1f} "
                         f"vs {r['fp32_bytes'] / 2**20:.1f} MiB)" for g, r in report.items())
        result.messages.append(f"int8: {done}; translate_onnx.py now uses them (the fp32 graphs stay beside them)")


def _write_ctranslate2(result: ExportResult, valid: Path | None) -> None:
    """Convert the export to `<path>/ctranslate2` and check its greedy translations of the first validation
    sentences against PyTorch's."""
    from nas.export.ct2 import Ct2Translator, export_ctranslate2
    from nas.export.folder import load_export

    folder = export_ctranslate2(result.path)
    sentences = _sentences(valid, 8)
    theirs = Ct2Translator(folder).translate(sentences, beam_size=1)
    ours = load_export(result.path).translate(sentences, beam_size=1)
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if mismatched:
        raise ExportCheckFailed(f"the CTranslate2 model in {folder} translates validation sentences {mismatched} "
                                "differently from PyTorch (greedy)")
    result.messages.append(f"CTranslate2: {folder} (greedy translations of {len(sentences)} validation sentences "
                           f"equal PyTorch's); translate with ctranslate2.Translator({str(folder)!r})")


def _register(result: ExportResult, name: str, run, valid: Path | None) -> None:
    """Log the export folder as an MLflow pyfunc model, register it as `name`, alias champion."""
    import mlflow

    from nas import tracking
    from nas.export.mlflow_model import DEFAULT_EXAMPLE, log_translator

    example = _sentences(valid, 3) if valid is not None else list(DEFAULT_EXAMPLE)
    experiment = tracking.get_client().get_experiment(run.info.experiment_id).name
    try:
        logged = log_translator(result.path, experiment=experiment, register=name, source_run_id=run.info.run_id,
                                input_example=example)
    except FileNotFoundError as e:
        raise NasError(str(e)) from None
    except mlflow.MlflowException as e:
        raise NasError(f"cannot register MLflow model {name!r}: {e.message}") from None
    result.registered = (name, int(logged.version))
    result.messages.append(f"registered MLflow model '{name}' version {logged.version} (alias champion, run "
                           f"{logged.run_id}); load it with mlflow.pyfunc.load_model({logged.alias_uri!r})")
