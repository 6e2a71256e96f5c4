"""A sweep's report: best sub-Transformers, the Pareto front (table + plot) and Optuna's parameter
importances, as one self-contained HTML file (plot embedded as base64) or Markdown (plot beside it).

Everything is read back from MLflow (the sweep's parent run and its trial runs) and from the sweep's
Optuna study; nothing is recomputed from models.
"""

from __future__ import annotations

import base64
import html
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nas.errors import NasError
from nas.atomic import atomic_write_bytes
from nas.redact import REDACTED, redact_url
from nas import tracking
from nas.tracking.plots import pareto_png
from nas.tracking.pareto import Objective
from nas.tracking.rows import LeaderboardRow

if TYPE_CHECKING:
    import mlflow
    import optuna

__all__ = ["FORMATS", "ImportanceError", "SweepReport", "build_report", "locate_study", "param_importances",
           "render_html", "render_markdown", "write_report"]

FORMATS = ("html", "md")
_JOURNAL = "optuna.journal"


class ImportanceError(NasError):
    """Parameter importances cannot be computed (no study found, or too few completed trials)."""


@dataclass(frozen=True)
class SweepReport:
    """Everything a report shows. Metric units as in :class:`nas.tracking.LeaderboardRow`."""

    sweep_id: str
    experiment: str
    parent_run_id: str
    status: str
    """The parent run's MLflow status."""
    info: dict[str, str]
    """Sweep facts for the header (YAML, method, trials completed/failed, supernet BLEU)."""
    objectives: tuple[Objective, ...]
    scanned: int
    """FINISHED trial runs of the sweep."""
    best: list[LeaderboardRow]
    """The best rows by the first objective, best first, with ``pareto`` and ``feasible`` flags: feasible rows
    only unless ``include_infeasible``."""
    front: list[LeaderboardRow]
    """Every row on the Pareto front, ordered by the second objective, best first."""
    png: bytes
    """The Pareto plot (first objective against the second)."""
    importances: dict[str, dict[str, float]] | None
    """Target ("Pareto front" or an objective name) -> parameter -> importance (sums to 1 per target)."""
    importance_error: str | None
    """Why ``importances`` is None."""
    study: str | None
    """Where the Optuna study was found (``name @ location``)."""
    constraints: str = ""
    """The sweep's ``search.constraints`` (``"latency_ms<=30"``; "" when it has none)."""
    infeasible: int = 0
    """FINISHED trials that break them (counted in ``scanned``)."""
    include_infeasible: bool = False
    """Whether ``best`` ranks infeasible trials too."""


# --------------------------------------------------------------------------- Optuna study


def locate_study(parent: mlflow.entities.Run, sweep_id: str, *, storage: str | None = None,
                 study_name: str | None = None) -> tuple[optuna.Study, str]:
    """Open the sweep's Optuna study; returns ``(study, "name @ location")``.

    Storage: ``storage`` if given (a journal file path or a database URL), else the parent run's
    ``nas.optuna_storage`` tag, else ``<parent of the nas.supernet_dir tag>/optuna.journal`` (the
    layout of ``nas sweep``). Study name: ``study_name``, else the ``nas.study_name`` tag, else
    ``sweep_id`` if the storage holds it, else the only study in the storage.

    Raises:
        ImportanceError: no storage can be found or opened, it holds no study or several without
            one matching (the message names the storage and the studies).
    """
    import optuna

    tags = parent.data.tags
    location = storage or tags.get(tracking.TAG_OPTUNA_STORAGE)
    if not location:
        supernet_dir = tags.get("nas.supernet_dir")
        if not supernet_dir:
            raise ImportanceError(f"sweep {sweep_id!r}: its parent run has neither a {tracking.TAG_OPTUNA_STORAGE} nor a "
                                  "nas.supernet_dir tag; pass --storage FILE_OR_URL")
        location = str(Path(supernet_dir).parent / _JOURNAL)
    address = redact_url(location)
    if "://" in location:
        if REDACTED in location:
            raise ImportanceError(f"the Optuna storage {address} is redacted in MLflow; pass --storage URL with "
                                  "the password")
        try:
            backend = optuna.storages.RDBStorage(location)
        except Exception as e:  # sqlalchemy / driver errors
            raise ImportanceError(f"cannot open the Optuna storage {address}: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
    else:
        if not Path(location).is_file():
            raise ImportanceError(f"no Optuna study journal at {location}; pass --storage FILE_OR_URL")
        backend = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(location))
    names = optuna.study.get_all_study_names(storage=backend)
    name = study_name or tags.get(tracking.TAG_STUDY_NAME)
    if name is None:
        if sweep_id in names:
            name = sweep_id
        elif len(names) == 1:
            name = names[0]
        else:
            shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "none"
            raise ImportanceError(f"cannot tell which Optuna study in {address} is sweep {sweep_id!r} "
                                  f"(studies: {shown}); pass --study NAME")
    if name not in names:
        raise ImportanceError(f"no Optuna study {name!r} in {address} (studies: {', '.join(names[:10]) or 'none'})")
    return optuna.load_study(study_name=name, storage=backend), f"{name} @ {address}"


def param_importances(study: optuna.Study, objective_names: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """Optuna's parameter importances (``optuna.importance.get_param_importances``, PED-ANOVA, over
    COMPLETE trials; conditional parameters included) for each target: for a multi-objective study
    first ``"Pareto front"`` (reaching the front, no preference among objectives), then one per
    objective, named by ``study.metric_names``, else ``objective_names`` when it has one name per
    objective, else ``objective i``. Importances of one target sum to 1 (or are all 0).

    Raises:
        ImportanceError: fewer than 2 completed trials, or no trial has parameters.
    """
    from optuna.importance import get_param_importances
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2:
        raise ImportanceError(f"Optuna study {study.study_name!r} has {len(complete)} completed trial(s); parameter "
                              "importances need at least 2 (raise search.trials)")
    if not any(t.params for t in complete):
        raise ImportanceError(f"the completed trials of Optuna study {study.study_name!r} have no parameters")
    directions = study.directions
    names = study.metric_names or (list(objective_names) if len(objective_names) == len(directions) else
                                   [f"objective {i}" for i in range(len(directions))])
    out: dict[str, dict[str, float]] = {}
    with warnings.catch_warnings():  # PED-ANOVA warns on small studies and on explicit targets
        warnings.simplefilter("ignore")
        if len(directions) > 1:
            out["Pareto front"] = get_param_importances(study)
        for i, (name, direction) in enumerate(zip(names, directions)):
            sign = -1.0 if direction == StudyDirection.MAXIMIZE else 1.0  # PED-ANOVA: lower target is better
            out[name] = get_param_importances(study, target=lambda t, i=i, s=sign: s * t.values[i])
    return out


# --------------------------------------------------------------------------- building


def build_report(sweep_id: str, *, experiment: str | None = None, top: int = 10, storage: str | None = None,
                 study_name: str | None = None, include_infeasible: bool = False) -> SweepReport:
    """Collect a sweep's report from MLflow and Optuna (see :class:`SweepReport`).

    The FINISHED trials are scanned once, page by page (:func:`nas.tracking.pareto_scan`) on the
    sweep's objectives (:func:`nas.tracking.sweep_objectives`). The best sub-Transformers and the Pareto front
    hold the trials meeting the sweep's ``search.constraints`` (the best ones all trials with
    ``include_infeasible``). Importances that cannot be computed leave ``importances`` None and say why in
    ``importance_error``; the rest is built.

    Raises:
        LookupError: no such sweep (or experiment).
        ValueError: ``top`` < 1.
    """
    client = tracking.get_client()
    parent = tracking.find_sweep_run(sweep_id, experiment)
    experiment = client.get_experiment(parent.info.experiment_id).name
    objectives = tracking.sweep_objectives(parent)
    constraints = tracking.sweep_constraints(parent)
    scan = tracking.pareto_scan(experiment, objectives, top=top, sweep_id=sweep_id, keep_points=True,
                                include_infeasible=include_infeasible)
    png = pareto_png(scan.points, scan.front_flags(), objectives, feasible=scan.feasible,
                     title=f"sweep {sweep_id}: {len(scan.front)} of {scan.scanned} trials on the front")
    second = objectives[1]
    front = sorted(scan.front, key=lambda r: -getattr(r, second.metric) if second.maximize else getattr(r, second.metric))
    importances, error, where = None, None, None
    try:
        study, where = locate_study(parent, sweep_id, storage=storage, study_name=study_name)
        importances = param_importances(study, [o.metric for o in objectives])
    except ImportanceError as e:
        error = str(e)
    p, m, t = parent.data.params, parent.data.metrics, parent.data.tags
    search = f"{p['search.method']}, {p['search.trials']} trials" if {"search.method", "search.trials"} <= set(p) else "-"
    info = {"YAML": p.get("yaml", "-"), "search": search,
            "trials completed / failed": f"{_int(m.get('trials_completed'))} / {_int(m.get('trials_failed'))}",
            "widest sub-Transformer BLEU": _num(m.get("widest_bleu")),
            "objectives": ", ".join(map(str, objectives)), "supernet": t.get("nas.supernet_dir", "-"),
            "constraints": ", ".join(c.key for c in constraints) or "-"}
    if "level1_candidates" in m:  # search.method: evolution (nas.search.evolution)
        info["level-1 candidates scored / failed"] = (f"{_int(m.get('level1_candidates'))} / "
                                                      f"{_int(m.get('level1_failed'))}")
    return SweepReport(sweep_id=sweep_id, experiment=experiment, parent_run_id=parent.info.run_id,
                       status=parent.info.status, info=info, objectives=objectives, scanned=scan.scanned,
                       best=scan.rows, front=front, png=png, importances=importances, importance_error=error,
                       study=where, constraints=", ".join(c.key for c in constraints), infeasible=scan.infeasible,
                       include_infeasible=include_infeasible)


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else "nan" if math.isnan(v) else f"{v:.{digits}f}"


def _int(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else str(int(v))


# --------------------------------------------------------------------------- rendering

_COLUMNS = ("#", "run", "arch", "BLEU", "chrF", "latency (ms)", "params (M)", "front")


def _cells(i: int, r: LeaderboardRow) -> list[str]:
    return [str(i), r.run_id[:8], r.arch or "-", _num(r.bleu), _num(r.chrf), _num(r.latency_ms), _num(r.params_m),
            "*" if r.pareto else ""]


def _best_table(rep: SweepReport) -> tuple[tuple[str, ...], list[list[str]]]:
    """Header and rows of the best sub-Transformers: with infeasible trials included, a ``feasible`` column."""
    rows = [_cells(i, r) for i, r in enumerate(rep.best, 1)]
    if not (rep.include_infeasible and rep.constraints):
        return _COLUMNS, rows
    return (*_COLUMNS, "feasible"), [row + ["no" if r.feasible is False else "yes"] for row, r in zip(rows, rep.best)]


def _best_caption(rep: SweepReport) -> str:
    """What the best table ranks, and which trials it leaves out."""
    metric = rep.objectives[0].metric
    if not rep.constraints:
        return f"{len(rep.best)} best of {rep.scanned} finished trials by {metric}"
    if rep.include_infeasible:
        return (f"{len(rep.best)} best of {rep.scanned} finished trials by {metric}, feasible or not "
                f"({rep.infeasible} break {rep.constraints})")
    return (f"{len(rep.best)} best of the {rep.scanned - rep.infeasible} feasible trials by {metric} (meeting "
            f"{rep.constraints}; {rep.infeasible} of {rep.scanned} finished trials break them and are left out: "
            f"nas report --include-infeasible lists them)")


def _importance_rows(imp: dict[str, dict[str, float]]) -> tuple[list[str], list[list[str]]]:
    targets = list(imp)
    params = sorted({p for v in imp.values() for p in v}, key=lambda p: -imp[targets[0]].get(p, 0.0))
    return ["parameter", *targets], [[p, *(f"{imp[t].get(p, 0.0):.3f}" for t in targets)] for p in params]


def _title(rep: SweepReport) -> str:
    return f"Sweep {rep.sweep_id}"


def render_html(rep: SweepReport) -> str:
    """One self-contained HTML page (inline CSS, the plot as a base64 ``data:`` URI)."""
    e = html.escape

    def table(header: Sequence[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    facts = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in
                    {"experiment": rep.experiment, "parent run": f"{rep.parent_run_id} ({rep.status})",
                     **rep.info}.items())
    if rep.importances is not None:
        header, rows = _importance_rows(rep.importances)
        importances = (f"<p>Optuna study {e(rep.study or '')}; PED-ANOVA importances over completed trials "
                       f"(each column sums to 1).</p>" + table(header, rows))
    else:
        importances = f'<p class="warn">Not computed: {e(rep.importance_error or "")}</p>'
    png = base64.b64encode(rep.png).decode("ascii")
    objectives = ", ".join(map(str, rep.objectives))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(_title(rep))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
td:nth-child(n+4) {{ font-variant-numeric: tabular-nums; }}
thead th {{ background: #f2f2f2; }}
.warn {{ color: #a33; }}
</style></head><body>
<h1>{e(_title(rep))}</h1>
<table>{facts}</table>
<h2>Best sub-Transformers</h2>
<p>{e(_best_caption(rep))}; * marks the Pareto front.</p>
{table(*_best_table(rep))}
<h2>Pareto front</h2>
<p>{len(rep.front)} non-dominated {"feasible " if rep.constraints else ""}trials on {e(objectives)}.</p>
<img alt="Pareto front: {e(objectives)}" src="data:image/png;base64,{png}">
{table(_COLUMNS, [_cells(i, r) for i, r in enumerate(rep.front, 1)])}
<h2>Parameter importances</h2>
{importances}
</body></html>
"""


def render_markdown(rep: SweepReport, png_name: str) -> str:
    """Markdown with pipe tables; the plot is the file ``png_name`` (relative to the report)."""

    def cell(text: str) -> str:
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

    def table(header: Sequence[str], rows: list[list[str]]) -> str:
        lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
        return "\n".join(lines)

    facts = {"experiment": rep.experiment, "parent run": f"{rep.parent_run_id} ({rep.status})", **rep.info}
    objectives = ", ".join(map(str, rep.objectives))
    parts = [f"# {_title(rep)}", "", table(["", ""], [[k, v] for k, v in facts.items()]), "",
             "## Best sub-Transformers", "",
             f"{_best_caption(rep)}; \\* marks the Pareto front.", "",
             table(*_best_table(rep)), "",
             "## Pareto front", "",
             f"{len(rep.front)} non-dominated {'feasible ' if rep.constraints else ''}trials on {objectives}.", "",
             f"![Pareto front: {objectives}]({png_name})", "",
             table(_COLUMNS, [_cells(i, r) for i, r in enumerate(rep.front, 1)]), "",
             "## Parameter importances", ""]
    if rep.importances is not None:
        header, rows = _importance_rows(rep.importances)
        parts += [f"Optuna study {rep.study}; PED-ANOVA importances over completed trials (each column sums to 1).",
                  "", table(header, rows)]
    else:
        parts.append(f"Not computed: {rep.importance_error}")
    return "\n".join(parts) + "\n"



def write_report(rep: SweepReport, out: str | Path, fmt: str = "html") -> list[Path]:
    """Write ``rep`` to ``out`` as ``html`` (one file) or ``md`` (``out`` plus the plot
    ``<out stem>.pareto.png`` beside it, written first); returns the paths written. Each file is
    written to a temporary sibling and moved into place, so none is ever half-written.

    Raises:
        ValueError: ``fmt`` is not html or md.
    """
    if fmt not in FORMATS:
        raise NasError(f"unknown report format {fmt!r}; expected one of {', '.join(FORMATS)}")
    out = Path(out)
    if fmt == "html":
        atomic_write_bytes(out, render_html(rep).encode("utf-8"))
        return [out]
    png = out.with_name(f"{out.stem}.pareto.png")
    atomic_write_bytes(png, rep.png)
    atomic_write_bytes(out, render_markdown(rep, png.name).encode("utf-8"))
    return [out, png]
