"""The maintainer's `nas` commands beside the user jobs of `nas.cli`: `average` (snapshots into one supernet),
`space show|sample`, `latency fit` and `fidelity` (ranking fidelity); they parse and print only."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from nas.cli_common import fail, load_yaml, out
from nas.errors import NasError
from nas.redact import redact_url

space_app = typer.Typer(no_args_is_help=True, help="Inspect a search space.")
latency_app = typer.Typer(no_args_is_help=True, help="Latency predictors (HAT-style) for this device.")


def average(supernet_dir: Path = typer.Argument(..., help="Supernet folder written by `nas train` (holds snapshots/)."),
            last: int = typer.Option(..., "--last", min=1, help="Average the newest N snapshots."),
            out_dir: Path = typer.Option(..., "--out", help="New folder for the averaged supernet (must not hold files).")) -> None:
    """Average the weights of the newest N training snapshots into a new supernet folder (fairseq average_checkpoints)."""
    from nas.api import average_checkpoints

    try:
        path = average_checkpoints(supernet_dir, last, out_dir)
    except (FileNotFoundError, FileExistsError, NasError) as e:
        fail(str(e))
    steps = json.loads((path / "average.json").read_text())["steps"]
    out.print(f"averaged {len(steps)} snapshots of {escape(str(supernet_dir))} (steps {', '.join(map(str, steps))}) "
              f"into {escape(str(path))}", highlight=False, soft_wrap=True)


@space_app.command("show")
def space_show(file: Path) -> None:
    """Dimensions, number of sub-Transformers and parameter counts of a sweep's space."""
    spec = load_yaml(file, check_files=False)
    from rich.table import Table

    from nas.builders import build_space, space_param_counts
    from nas.space.space import format_count

    space = build_space(spec)
    table = Table(title=f"{spec.name}: search space")
    for col in ("dimension", "choices", "scope"):
        table.add_column(col)
    for row in space.describe():
        table.add_row(*row)
    out.print(table)
    out.print(f"sub-Transformers: {format_count(space.size())}")
    for label, count in space_param_counts(spec, space).items():
        out.print(f"{label}: {count / 1e6:.2f} M parameters (vocabulary {spec.data.tokenizer.vocab_size})")


@space_app.command("sample")
def space_sample(file: Path, seed: int = typer.Option(0, help="Random seed.")) -> None:
    """Print a random sub-Transformer of the space as JSON."""
    spec = load_yaml(file, check_files=False)
    from nas.builders import build_space

    out.print_json(build_space(spec).sample(random.Random(seed)).to_json())


@latency_app.command("fit")
def latency_fit(file: Path = typer.Argument(..., help="Sweep YAML whose supernet has been trained."),
                samples: int = typer.Option(100, min=2, help="Sub-Transformers to measure (widest, narrowest, then random; at least 2; plus the latency reference)."),
                threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: search.cpu_per_trial)."),
                out_file: Optional[Path] = typer.Option(None, "--out", help="Predictor file (default: <workdir>/<name>/latency_<workload>.safetensors)."),
                seed: int = typer.Option(0, help="Seed for the sampled archs.")) -> None:
    """Time sub-Transformers on this machine on the YAML's fixed workload (search.latency_workload), each interleaved
    with the reference arch, fit a latency predictor on their latency_ratio and report its held-out RMSE and MAPE."""
    spec = load_yaml(file, check_predictor=False)  # it may name the file this writes
    from nas.api import latency_runner
    from nas.search import fit_latency

    try:
        fit = fit_latency(spec, samples=samples, threads=threads, out_file=out_file, seed=seed,
                          latency_runner=latency_runner(spec))
    except NasError as e:
        fail(str(e))
    m, ref = fit.metrics, fit.reference
    out.print(f"{len(fit.samples)} sub-Transformers measured on {fit.samples[0]['device']}, workload {fit.workload}; "
              f"reference ({spec.search.latency_reference}) {ref['latency_reference_ms']:.2f} ms", highlight=False)
    out.print(f"held-out RMSE {m['rmse_ratio']:.3f} (latency ratio), MAPE {m['mape']:.1f}% "
              f"({int(m['holdout_samples'])} of {len(fit.samples)} held out; the saved predictor is fitted on all "
              f"{int(m['train_samples'])}); predictor: {fit.path}")
    if "cv_mape" in m:
        out.print(f"5-fold cross-validated MAPE {m['cv_mape']:.1f}% (bias {m['cv_bias']:+.1f}%): the margin level 1 "
                  f"adds to a predicted ratio before checking it against a latency budget "
                  f"(search.evolution.latency_margin: auto)", highlight=False)


def fidelity(file: Path = typer.Argument(..., help="Sweep YAML whose supernet has been trained."),
             k: int = typer.Option(8, "--k", min=2, help="Sub-Transformers compared: the narrowest, the widest and K-2 "
                                                         "spread over parameter count."),
             steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Standalone training steps per "
                                                 "sub-Transformer, from scratch (default: the YAML's train.steps)."),
             metric: str = typer.Option("bleu", help="bleu | valid_loss: the validation score whose rankings are compared."),
             seed: int = typer.Option(0, help="Seed of the sampled sub-Transformers and the standalone initialisation."),
             out_dir: Optional[Path] = typer.Option(None, "--out", help="Folder for arch_<id>.json and fidelity.json "
                                                    "(default: <workdir>/<name>/fidelity/steps_<N>_seed_<S>).")) -> None:
    """Ranking fidelity: inherited-weight scores of K sub-Transformers against the same ones trained from scratch
    (Kendall tau, Spearman rho). Resumable: rerun it to continue."""
    from nas.search import FIDELITY_METRICS as METRICS

    if metric not in METRICS:
        fail(f"--metric {metric!r}: expected one of {' | '.join(METRICS)}")
    spec = load_yaml(file, check_predictor=False)
    from rich.table import Table

    from nas import tracking
    from nas.builders import prepare_sweep_data
    from nas.search import check_supernet, log_fidelity, run_fidelity, warning_text

    from nas.preflight import check_tracking_store

    try:
        check_tracking_store(read_only=False)  # it logs a run: a server that refuses is one line, within seconds
        check_supernet(spec, file)
        data = prepare_sweep_data(spec)
        result = run_fidelity(spec, data, k=k, steps=steps, metric=metric, seed=seed, out_dir=out_dir)
    except (FileNotFoundError, NasError) as e:
        fail(str(e))
    table = Table(title=f"{spec.name}: ranking fidelity ({metric}, {result.steps} standalone steps)")
    for col, justify in (("arch", "left"), ("params (M)", "right"), ("inherited", "right"), ("standalone", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    digits = 3 if metric == "valid_loss" else 2
    for r in result.rows:
        table.add_row(escape(r["arch_summary"]), f"{r['params_m']:.2f}", f"{r['inherited'][metric]:.{digits}f}",
                      f"{r['standalone'][metric]:.{digits}f}")
    out.print(table)
    c = result.correlation
    out.print(f"Kendall tau {c.kendall_tau:.3f} (p {c.kendall_p:.3f}), Spearman rho {c.spearman_rho:.3f} "
              f"(p {c.spearman_p:.3f}) over {len(result.rows)} sub-Transformers; {result.trained} trained now, "
              f"{len(result.rows) - result.trained} reused from {escape(str(result.out_dir))}", highlight=False)
    note = warning_text(result)
    if note:
        out.print(f"[yellow]warning: {escape(note)}[/yellow]", highlight=False)
    run_id = log_fidelity(spec, result)
    out.print(f"wrote {escape(str(result.path))}; MLflow: experiment '{escape(spec.experiment)}', run {run_id} "
              f"at {escape(redact_url(tracking.tracking_uri()))}", highlight=False)
