"""Ranking fidelity: does the supernet rank sub-Transformers the way standalone training does?

A weight-sharing search is only as good as the ranking its inherited weights give. This module picks K
sub-Transformers spread over the space (the narrowest, the widest and K-2 evenly spaced in parameter
count), scores each with the supernet's inherited weights (validation BLEU and loss, as a search trial
does), retrains each from scratch for a fixed budget of steps and scores it again, then reports the
Kendall tau and Spearman rho between the two rankings (HAT, OFA and NNI publish no such number; a
tau below :data:`TAU_WARNING` means the supernet's ranking should not be trusted).

Run the real measurement after the supernet is trained (``nas sweep FILE`` or ``nas train FILE``)::

    nas fidelity search_spaces/quickstart.yaml --k 8 --steps 300

It is resumable: each arch's result is written to ``<out>/arch_<arch_id>.json`` as soon as it exists
(default ``<out>``: ``<workdir>/<name>/fidelity/steps_<N>_seed_<S>``), and a killed run continues with
the next arch not trained yet. The summary goes to ``<out>/fidelity.json`` and to an MLflow run with
role ``fidelity`` in the sweep's experiment (metrics ``kendall_tau``, ``spearman_rho``; the scatter
plot ``fidelity.png`` and the per-arch table ``fidelity_table.json`` as artifacts).

Standalone training (:func:`trainers.train_standalone`, re-exported here) repeats ``train.*`` for one
sub-Transformer: the same batches (``max_tokens``, ``accumulate``, the data order of ``train.seed``), Adam
with the inverse-square-root schedule, label smoothing, gradient clipping, drop-branch, width dropout and
precision; only the sandwich rule is gone (one arch per step). Its model is freshly initialised by the modules' own initialisers at the arch's
own sizes (not a crop of a fresh supernet, whose fan-in scales are the widest's).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

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
from nas.data import PreparedData
from nas.eval.validation import ValidationSet, validation_scores
from nas.atomic import atomic_write_bytes, atomic_write_text
from nas.locks import lock_folder, run_lock
from nas.model.io import load_model
from nas.model.supernet import SuperTransformer, count_params, extract
from nas.builders import build_space
from nas.space.arch import Arch
from nas.space.space import SearchSpace
from nas.space import SweepSpec
from trainers.standalone_trainer import train_standalone

__all__ = ["METRICS", "TAU_WARNING", "Correlation", "FidelityResult", "spread_archs", "rank_correlation",
           "supernet_dir", "check_supernet", "score_model", "standalone_model", "train_standalone", "run_fidelity",
           "fidelity_png", "warning_text", "log_fidelity"]

METRICS = ("bleu", "valid_loss")
"""Scores that can be ranked: validation BLEU (0-100) or validation loss (nats/token)."""
TAU_WARNING = 0.5
"""Below this Kendall tau the supernet's ranking is flagged as untrustworthy."""
PLOT = "fidelity.png"
TABLE = "fidelity_table.json"
SUMMARY = "fidelity.json"
TAG_WARNING = "nas.fidelity_warning"
_LABELS = {"bleu": "BLEU", "valid_loss": "validation loss (nats/token)"}


class Correlation(NamedTuple):
    """Rank correlation of two score lists (NaN where undefined: fewer than 2 points, or a constant list)."""

    kendall_tau: float
    """Kendall's tau-b in [-1, 1] (scipy.stats.kendalltau)."""
    spearman_rho: float
    """Spearman's rho in [-1, 1] (scipy.stats.spearmanr)."""
    kendall_p: float
    """Two-sided p-value of tau = 0."""
    spearman_p: float
    """Two-sided p-value of rho = 0."""


@dataclass(frozen=True)
class FidelityResult:
    """The outcome of :func:`run_fidelity`."""

    rows: list[dict[str, Any]]
    """One per arch, by parameter count: ``arch_id``, ``arch_summary``, ``arch`` (dict), ``params_m``
    (millions), ``inherited`` and ``standalone`` (``bleu``, ``chrf``, ``valid_loss``; standalone also
    ``train_loss`` and ``train_seconds``)."""
    correlation: Correlation
    metric: str
    k: int
    steps: int
    seed: int
    out_dir: Path
    supernet_dir: Path
    trained: int = 0
    """Archs trained by this call (the others were read from their files)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def untrusted(self) -> bool:
        """Kendall tau below :data:`TAU_WARNING`, or undefined."""
        tau = self.correlation.kendall_tau
        return not tau >= TAU_WARNING

    @property
    def path(self) -> Path:
        """``<out_dir>/fidelity.json``."""
        return self.out_dir / SUMMARY

    def table(self) -> list[dict[str, Any]]:
        """Flat rows (JSON-ready): arch id and summary, params_m, ``inherited_<score>``, ``standalone_<score>``."""
        flat = []
        for r in self.rows:
            row = {"arch_id": r["arch_id"], "arch_summary": r["arch_summary"], "params_m": r["params_m"]}
            for side in ("inherited", "standalone"):
                row.update({f"{side}_{k}": v for k, v in r[side].items()})
            flat.append(row)
        return flat

    def summary(self) -> dict[str, Any]:
        """What ``fidelity.json`` holds."""
        return {"metric": self.metric, "k": self.k, "steps": self.steps, "seed": self.seed,
                **self.correlation._asdict(), "tau_warning": TAU_WARNING, "untrusted": self.untrusted,
                "supernet_dir": str(self.supernet_dir), "archs": self.rows, **self.extra}


# --------------------------------------------------------------------------- choosing the archs


def spread_archs(space: SearchSpace, k: int, params_of: Callable[[Arch], int], *, seed: int = 0,
                 samples: int = 256) -> list[Arch]:
    """K distinct sub-Transformers spread over the space by parameter count, smallest first.

    The narrowest and the widest are always in; the other K-2 are drawn from ``samples`` uniformly random
    archs (``random.Random(seed)``): for targets evenly spaced in parameter count between the smallest
    and largest candidate, the not yet chosen candidate nearest each target (in count, not in rank:
    random archs crowd the middle of the range). Deterministic for a given ``seed``.

    Args:
        space: the search space.
        k: how many archs (>= 2).
        params_of: parameter count of an arch (e.g. ``count_params(extract(supernet, arch))``).
        samples: random archs drawn as candidates.

    Returns:
        K archs sorted by (parameter count, arch_id).

    Raises:
        ValueError: ``k`` < 2, or fewer than ``k`` distinct archs among the candidates (names both).
    """
    if k < 2:
        raise NasError(f"k={k}: at least 2 sub-Transformers are needed (the narrowest and the widest)")
    rng = random.Random(seed)
    ends = [space.narrowest(), space.widest()]
    pool: dict[str, Arch] = {}
    for arch in [*ends, *(space.sample(rng) for _ in range(samples))]:
        pool.setdefault(arch.arch_id, arch)
    if len(pool) < k:
        raise NasError(f"k={k} but only {len(pool)} distinct sub-Transformers were found among {samples} random "
                         f"samples of a space of {space.size()}; lower --k")
    params = {arch_id: int(params_of(arch)) for arch_id, arch in pool.items()}
    chosen = {a.arch_id for a in ends}
    lo, hi = min(params.values()), max(params.values())
    rest = [a for a in pool if a not in chosen]
    m = k - len(chosen)
    for j in range(1, m + 1):
        target = lo + (hi - lo) * j / (m + 1)
        best = min((a for a in rest if a not in chosen), key=lambda a: (abs(params[a] - target), params[a], a))
        chosen.add(best)
    return sorted((pool[a] for a in chosen), key=lambda a: (params[a.arch_id], a.arch_id))


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> Correlation:
    """Kendall tau-b and Spearman rho between two score lists of equal length (scipy.stats).

    Raises:
        ValueError: the lists differ in length.
    """
    if len(x) != len(y):
        raise ValueError(f"{len(x)} inherited scores but {len(y)} standalone scores")
    if len(x) < 2:
        return Correlation(math.nan, math.nan, math.nan, math.nan)
    from scipy.stats import kendalltau, spearmanr

    with warnings.catch_warnings():  # a constant list: NaN, with a warning we report ourselves
        warnings.simplefilter("ignore")
        tau, rho = kendalltau(x, y), spearmanr(x, y)
    return Correlation(float(tau.statistic), float(rho.statistic), float(tau.pvalue), float(rho.pvalue))


# --------------------------------------------------------------------------- scoring and training


def supernet_dir(spec: SweepSpec) -> Path:
    """``<workdir>/<name>/supernet``: where ``nas sweep``/``nas train`` save the sweep's supernet."""
    return spec.run_dir / "supernet"


def check_supernet(spec: SweepSpec, file: str | Path) -> Path:
    """The trained supernet's folder.

    Raises:
        FileNotFoundError: no ``supernet.safetensors`` there (names the path and the commands that write it).
    """
    folder = supernet_dir(spec)
    weights = folder / "supernet.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no trained supernet: {weights} does not exist; run `nas sweep {file}` or "
                                f"`nas train {file}` first")
    return folder


def score_model(model: SuperTransformer, arch: Arch, spec: SweepSpec, data: PreparedData,
                vset: ValidationSet | None = None) -> dict[str, float]:
    """Validation ``bleu``, ``chrf`` (sacrebleu, beam ``search.beam_size``) and ``valid_loss`` (nats/token) of
    ``arch`` run by ``model`` (a supernet, or a standalone model of that arch), on the first
    ``search.valid_sentences`` sentences as :func:`nas.search.trials.score_arch` does (no latency):
    :func:`nas.eval.validation.validation_scores` on ``vset`` (default: loaded from ``data`` for this call; pass
    one to score many archs)."""
    vset = ValidationSet.load(data, spec.search.valid_sentences) if vset is None else vset
    return validation_scores(model, arch, vset, beam_size=spec.search.beam_size, max_tokens=spec.train.max_tokens)


def standalone_model(supernet: SuperTransformer, arch: Arch, *, seed: int) -> SuperTransformer:
    """A model of ``arch``'s sizes (the one :func:`~nas.model.supernet.extract` builds), freshly initialised
    under ``torch.manual_seed(seed)``: no inherited weight.

    Raises:
        ValueError: ``arch`` exceeds the supernet's maxima.
    """
    config = extract(supernet, arch).config()
    torch.manual_seed(seed)
    return SuperTransformer.from_config(config).train()


# --------------------------------------------------------------------------- the measurement


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _standalone_settings(spec: SweepSpec, data: PreparedData, model_config: dict[str, Any], steps: int,
                         seed: int) -> dict[str, Any]:
    """Everything a standalone result depends on; a stored result with other settings is not reused."""
    tr, se = spec.train, spec.search
    return _jsonable({"steps": steps, "seed": seed, "model": model_config, "data": Path(data.root).name,
                      "train": {k: getattr(tr, k) for k in ("lr", "warmup_steps", "max_tokens", "accumulate", "seed",
                                                            "label_smoothing", "clip_norm", "weight_decay", "precision",
                                                            "drop_branch_warmup", "width_dropout",
                                                            "autoshuffle_penalty")} | {"drop_branch": spec.drop_branch},
                      "beam_size": se.beam_size, "valid_sentences": se.valid_sentences})


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # torn or unreadable: computed again


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=Console(stderr=True),
                    disable=not enabled)


def run_fidelity(spec: SweepSpec, data: PreparedData, *, k: int = 8, steps: int | None = None, metric: str = "bleu",
                 seed: int = 0, out_dir: str | Path | None = None, samples: int = 256, progress: bool | None = None,
                 device: str | torch.device | None = None) -> FidelityResult:
    """Measure how well the trained supernet's inherited-weight scores rank K sub-Transformers against the
    same sub-Transformers trained from scratch; writes ``<out_dir>/arch_<arch_id>.json`` per arch (resumable)
    and ``<out_dir>/fidelity.json``.

    Args:
        spec: the sweep; its supernet must be trained (``<workdir>/<name>/supernet``).
        data: the sweep's tokenized corpus (:func:`nas.search.prepare_sweep_data`).
        k: sub-Transformers compared (:func:`spread_archs`).
        steps: standalone training steps per arch (default ``train.steps``).
        metric: ``bleu`` or ``valid_loss``, the score whose rankings are compared.
        seed: seed of the arch sampling and of each standalone model's initialisation.
        out_dir: default ``<workdir>/<name>/fidelity/steps_<steps>_seed_<seed>``.
        samples: random archs drawn as candidates for :func:`spread_archs`.
        progress: show progress bars on stderr (default: when stderr is a terminal).
        device: default ``cuda`` when available, else ``cpu``.

    Raises:
        FileNotFoundError: the supernet is not trained (names the path).
        ValueError: an unknown metric, a bad ``k`` or ``steps``, or a stored arch file trained with other
            settings (names the file and the settings that differ).
        FloatingPointError: standalone training diverged.
        RunLockedError: another process writes into the run folder (``out_dir`` inside it) or ``out_dir``.
    """
    if metric not in METRICS:
        raise NasError(f"metric {metric!r}: expected one of {', '.join(METRICS)}")
    steps = spec.train.steps if steps is None else steps
    if steps < 1:
        raise NasError(f"steps={steps}: standalone training needs at least 1 step")
    folder = check_supernet(spec, "FILE")
    out_dir = Path(out_dir) if out_dir is not None else spec.run_dir / "fidelity" / f"steps_{steps}_seed_{seed}"
    with run_lock(lock_folder(spec.run_dir, out_dir), f"nas fidelity {spec.name}"):  # before anything is written
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if spec.train.threads:
            torch.set_num_threads(spec.train.threads)
        supernet = load_model(folder, "supernet").to(device)
        supernet_sha = _sha256(folder / "supernet.safetensors")
        space = build_space(spec)
        archs = spread_archs(space, k, lambda arch: count_params(extract(supernet, arch)), seed=seed, samples=samples)
        vset = ValidationSet.load(data, spec.search.valid_sentences)
        show = sys.stderr.isatty() if progress is None else progress
        rows, trained = [], 0
        inherited_key = {"supernet_sha256": supernet_sha, "beam_size": spec.search.beam_size,
                         "valid_sentences": spec.search.valid_sentences}
        with _progress(show) as bar:
            arch_task = bar.add_task("archs", total=len(archs), info="")
            step_task = bar.add_task("steps", total=steps, info="")
            for arch in archs:
                path = out_dir / f"arch_{arch.arch_id}.json"
                sub = extract(supernet, arch)
                settings = _standalone_settings(spec, data, sub.config(), steps, seed)
                stored = _read_json(path) or {}
                row = {"arch_id": arch.arch_id, "arch_summary": arch.summary(), "arch": arch.to_dict(),
                       "params_m": count_params(sub) / 1e6}
                del sub
                bar.update(arch_task, info=row["arch_summary"])
                if stored.get("standalone") is not None and stored.get("settings") != settings:
                    changed = sorted(key for key in settings if stored.get("settings", {}).get(key) != settings[key])
                    raise NasError(f"{path} holds a standalone result trained with other settings "
                                   f"({', '.join(changed)}); pass another --out or delete that file")
                dirty = False
                if stored.get("inherited") is not None and stored.get("inherited_key") == inherited_key:
                    inherited = stored["inherited"]
                else:
                    inherited, dirty = score_model(supernet, arch, spec, data, vset), True
                standalone = stored.get("standalone")
                if standalone is None:
                    atomic_write_text(path, json.dumps({**row, "inherited": inherited, "inherited_key": inherited_key,
                                                        "standalone": None, "settings": settings}, indent=2))
                    bar.reset(step_task, total=steps, info="")
                    model = standalone_model(supernet, arch, seed=seed)
                    stats = train_standalone(model, arch, spec, data, steps, device=device,
                                             on_step=lambda s, loss: bar.update(step_task, completed=s,
                                                                                info=f"loss {loss:.3f}"))
                    standalone = {**score_model(model, arch, spec, data, vset), **stats}
                    trained += 1
                    dirty = True
                    del model
                if dirty:
                    atomic_write_text(path, json.dumps({**row, "inherited": inherited, "inherited_key": inherited_key,
                                                        "standalone": standalone, "settings": settings}, indent=2))
                rows.append({**row, "inherited": inherited, "standalone": standalone})
                bar.update(arch_task, advance=1)
                if not show:  # a log file gets one line per arch instead of the bars
                    print(f"fidelity {len(rows)}/{len(archs)} {row['arch_summary']} ({row['params_m']:.2f} M): "
                          f"inherited BLEU {inherited['bleu']:.2f} loss {inherited['valid_loss']:.3f}, standalone BLEU "
                          f"{standalone['bleu']:.2f} loss {standalone['valid_loss']:.3f}"
                          f" ({standalone.get('train_seconds', 0.0):.0f} s of training{'' if dirty else ', stored'})",
                          file=sys.stderr, flush=True)
        correlation = rank_correlation([r["inherited"][metric] for r in rows], [r["standalone"][metric] for r in rows])
        result = FidelityResult(rows=rows, correlation=correlation, metric=metric, k=k, steps=steps, seed=seed,
                                out_dir=out_dir, supernet_dir=folder, trained=trained,
                                extra={"standalone_seconds": sum(r["standalone"].get("train_seconds", 0.0)
                                                                 for r in rows)})
        atomic_write_text(result.path, json.dumps(result.summary(), indent=2))
        return result


# --------------------------------------------------------------------------- plot and MLflow


def fidelity_png(result: FidelityResult) -> bytes:
    """A PNG (bytes): standalone score (y) against inherited-weight score (x) of each arch, labelled with its
    parameter count (M), the two coefficients in the title; matplotlib's Agg canvas, no global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric, c = result.metric, result.correlation
    xs = [r["inherited"][metric] for r in result.rows]
    ys = [r["standalone"][metric] for r in result.rows]
    fig = Figure(figsize=(6.4, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.scatter(xs, ys, s=30, c="tab:red" if result.untrusted else "tab:blue", zorder=3)
    for x, y, r in zip(xs, ys, result.rows):
        ax.annotate(f"{r['params_m']:.2f}M", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    label = _LABELS[metric]
    ax.set_xlabel(f"inherited weights: {label}")
    ax.set_ylabel(f"standalone, {result.steps} steps from scratch: {label}")
    ax.set_title(f"Kendall tau {c.kendall_tau:.2f}, Spearman rho {c.spearman_rho:.2f} (K={len(result.rows)})",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()



def warning_text(result: FidelityResult) -> str | None:
    """The warning for an untrustworthy ranking (Kendall tau below :data:`TAU_WARNING` or undefined), else None."""
    if not result.untrusted:
        return None
    tau = result.correlation.kendall_tau
    if math.isnan(tau):
        return (f"Kendall tau is undefined: the {result.metric} scores of one side are all equal; "
                f"train longer (--steps) or compare valid_loss (--metric valid_loss)")
    return (f"Kendall tau {tau:.2f} < {TAU_WARNING}: the supernet's inherited-weight {result.metric} ranks these "
            f"{len(result.rows)} sub-Transformers unlike standalone training; do not trust its ranking")


def log_fidelity(spec: SweepSpec, result: FidelityResult) -> str:
    """Log ``result`` to a FINISHED MLflow run (role ``fidelity``) in the sweep's experiment; returns its id.

    Params ``k``, ``steps``, ``metric``, ``seed``; metrics ``kendall_tau``, ``spearman_rho`` (and their
    p-values); tag ``nas.fidelity_warning`` when the ranking is untrustworthy; artifacts ``fidelity.png``
    (also written to the result's folder) and ``fidelity_table.json``.

    Raises:
        mlflow.MlflowException: store errors (the run is then ended FAILED).
    """
    from nas import tracking

    note = warning_text(result)
    tags = {"nas.supernet_dir": str(result.supernet_dir.resolve()), "nas.fidelity_dir": str(result.out_dir.resolve()),
            **({TAG_WARNING: note} if note else {})}
    run_id = tracking.start_run(spec.experiment, f"{spec.name}-fidelity", role="fidelity", tags=tags,
                                params={"k": result.k, "steps": result.steps, "metric": result.metric,
                                        "seed": result.seed})
    try:
        c = result.correlation
        tracking.log_metrics(run_id, {"kendall_tau": c.kendall_tau, "spearman_rho": c.spearman_rho,
                                      "kendall_p": c.kendall_p, "spearman_p": c.spearman_p})
        tracking.log_file_artifact(run_id, atomic_write_bytes(result.out_dir / PLOT, fidelity_png(result)))
        tracking.log_json_artifact(run_id, result.table(), TABLE)
    except BaseException:
        tracking.end_run(run_id, "FAILED")
        raise
    tracking.end_run(run_id)
    return run_id
