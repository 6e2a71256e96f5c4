"""nas: sweep, train, retrain, average, leaderboard, report, export, translate, fidelity, space, latency.

Bad input (a YAML error, a missing file, an unknown run) prints one clear line and exits with code 2, before anything starts; any other exception is a bug and keeps its traceback (exit code 1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from nas import cli_tools
from nas.cli_common import SET_HELP, check_output_option, err, fail, load_yaml, out
from nas.errors import NasError
from nas.redact import redact_url

# The CLI downloads small JSON artifacts (arch.json, result tables); mlflow's per-download tqdm bars
# only cluttered the tables that leaderboard, report and export print.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


@app.command()
def sweep(file: Optional[Path] = typer.Argument(None, help="Sweep YAML (search_spaces/*.yaml); optional with --resume/--status."),
          address: Optional[str] = typer.Option(None, help="Ray cluster address (auto or ray://HOST:10001)."),
          resume: Optional[str] = typer.Option(None, "--resume", metavar="NAME",
                                               help="Continue the sweep NAME (error if it never started); without FILE "
                                                    "it reads the YAML copy saved when it started."),
          status: Optional[str] = typer.Option(None, "--status", metavar="NAME",
                                               help="Print sweep NAME's trial counts by state in Optuna, Ray Tune and "
                                                    "MLflow, then exit."),
          workdir: Path = typer.Option(Path("nas_runs"), help="Where --resume/--status NAME look without FILE "
                                                               "(the YAML's workdir)."),
          overrides: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY.PATH=VALUE", help=SET_HELP)) -> None:
    """Train the supernet (or reuse a trained one) and run the Optuna search; prints the leaderboard.

    Running it again continues the sweep named by the YAML's `name` (after a crash or a kill): finished trials are kept, unfinished ones run again, nothing is duplicated.

    Exit codes: 0 done, 1 every trial failed (the errors are listed), 2 bad input, 130 stopped by Ctrl-C, 143 by SIGTERM.
    """
    if resume and status:
        fail("pass --resume NAME or --status NAME, not both")
    if not status:
        from nas import faults

        try:  # a test-only hook; a malformed value would otherwise fail every trial
            faults.check()
        except NasError as e:
            fail(str(e))
    from nas.api import sweep_spec

    try:
        spec = sweep_spec(file, resume or status, workdir=workdir, check_files=not status, overrides=overrides or ())
    except NasError as e:  # SpecError included
        fail(str(e))
    from nas import tracking
    from nas.search import SweepFailed

    if status:
        from nas.preflight import check_backends
        from nas.search import sweep_status

        try:  # before MLflow or Optuna is read: an unreachable tracking server or database
            check_backends(spec, None)
            lines = sweep_status(spec).lines()
        except NasError as e:
            fail(str(e))
        out.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
        return
    from nas.api import run_spec

    try:  # its backends are checked first (one line within seconds), before Ray, MLflow or any folder
        result = run_spec(spec, file or spec.run_dir / "sweep.yaml", address=address, resume=bool(resume))
    except NasError as e:
        fail(str(e))
    except SweepFailed as e:
        fail(str(e), code=1)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: one line, the way back in, the shell's 128 + signal
        from nas.search import read_sweep_record

        signum = getattr(e, "signum", signal.SIGINT)  # SweepStopped carries SIGTERM's
        where = "" if spec.workdir == Path("nas_runs") else f" --workdir {spec.workdir}"
        try:
            started = read_sweep_record(spec.run_dir) is not None
        except NasError:  # a damaged record: the next start names it
            started = True
        again = (f"the same command, or `nas sweep --resume {spec.name}{where}`, continues it and keeps the finished "
                 f"trials" if started else "the same command starts it (prepared data is kept)")
        fail(f"{'interrupted' if signum == signal.SIGINT else signal.Signals(signum).name}: sweep {spec.name} "
             f"stopped; {again}", code=128 + signum)
    rows = tracking.leaderboard(result.experiment, sweep_id=result.sweep_id, top=10,
                                metric=spec.search.metrics[0].name)
    out.print(tracking.leaderboard_table(rows, title=f"sweep {result.sweep_id}"))
    note = tracking.feasibility_note(result.experiment, result.sweep_id, include_infeasible=False)
    if note:
        out.print(escape(note), highlight=False)
    m = result.supernet_metrics
    out.print(f"supernet: widest sub-Transformer BLEU {m.get('widest_bleu', float('nan')):.2f} "
              f"(chrF {m.get('widest_chrf', float('nan')):.2f}) on the whole validation set; "
              f"trials completed {result.trials_completed}, failed {result.trials_failed}"
              + (" (resumed)" if result.resumed else ""))
    scope = trial_bleu_scope(spec.search.valid_sentences)
    if scope:
        out.print(scope)
    out.print(f"MLflow: experiment '{result.experiment}', parent run {result.parent_run_id} at "
              f"{escape(redact_url(tracking.tracking_uri()))}", highlight=False)


def trial_bleu_scope(valid_sentences: int | None) -> str | None:
    """The line that says the trials' BLEU/chrF come from a validation subset (``search.valid_sentences``), so that
    a reader does not compare them with the supernet's figure on the whole set; None when trials score on it all."""
    if valid_sentences is None:
        return None
    return (f"trials: BLEU and chrF on the first {valid_sentences} validation sentences (search.valid_sentences), "
            f"not comparable with the whole set's")


@app.command()
def train(file: Path = typer.Argument(..., help="Sweep YAML; its data, supernet, space and train sections are used."),
          out_dir: Optional[Path] = typer.Option(None, "--out", help="Checkpoint folder (default: <workdir>/<name>/supernet)."),
          overrides: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY.PATH=VALUE", help=SET_HELP)) -> None:
    """Train the supernet standalone (no Ray), resuming from its checkpoint; tracked as one MLflow run."""
    spec = load_yaml(file, check_predictor=False, overrides=overrides)  # the predictor is used by sweeps only
    from nas.api import train as train_tracked

    try:
        result = train_tracked(spec, out_dir)
    except NasError as e:  # e.g. a full disk (DiskFullError): the previous checkpoint is kept, rerun to resume
        fail(str(e))
    out.print_json(json.dumps(result.metrics))


@app.command()
def retrain(file: Path = typer.Argument(..., help="Sweep YAML; its retrain section is the recipe."),
            run_id: Optional[str] = typer.Option(None, "--run-id", help="Retrain the arch of this trial run (a unique "
                                                 "prefix of its id is enough)."),
            best: bool = typer.Option(False, "--best", help="Retrain the best trial meeting its sweep's constraints."),
            arch: Optional[str] = typer.Option(None, "--arch", help="Retrain this arch: a summary string "
                                               "('enc[128/256 128/256] dec[128/256 128/256]'), JSON or an arch.json."),
            out_dir: Optional[Path] = typer.Option(None, "--out", help="Retrain folder (default: "
                                                   "<workdir>/<name>/retrain/<arch_id>-<init>-seed<seed>)."),
            metric: str = typer.Option("bleu", help="Metric that --best ranks by."),
            experiment: Optional[str] = typer.Option(None, help="Experiment for --best (default: the YAML's)."),
            where: Optional[list[str]] = typer.Option(None, "--where", help="With --best: only trials meeting METRIC "
                                                      "OP NUMBER (repeatable)."),
            overrides: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY.PATH=VALUE", help=SET_HELP)) -> None:
    """Train one sub-Transformer alone with the YAML's retrain recipe (resumable), tracked as an MLflow run with
    tag nas.role=retrain; export it with nas export --run-id."""
    spec = load_yaml(file, check_predictor=False, overrides=overrides)
    from nas.api import latency_runner
    from nas.retraining import retrain as run_retrain

    try:
        result = run_retrain(spec, run_id=run_id, best=best, arch=arch, out_dir=out_dir, experiment=experiment,
                             metric=metric, where=where or (), latency_runner=latency_runner(spec))
    except NasError as e:
        fail(str(e))
    m, r = result.metrics, result.recipe
    from nas.eval.scores import PAPER_BLEU_LABEL

    out.print(f"retrained {escape(result.arch.summary())} ({r['init']}, seed {r['seed']}, {r['steps']} steps; "
              f"beam {r['beam_size']}, length penalty {r['length_penalty']:g}): sacreBLEU {m['bleu']:.2f}, "
              f"{PAPER_BLEU_LABEL} {m['bleu_paper']:.2f}, chrF {m['chrf']:.2f}, latency {m['latency_ms']:.1f} ms "
              f"({m['latency_ratio']:.2f}x the reference), {m['params_m']:.2f} M params", highlight=False,
              soft_wrap=True)
    out.print(f"weights in {escape(str(result.out_dir))}; MLflow run {result.run_id}; export with "
              f"nas export --run-id {result.run_id[:8]} --out DIR", highlight=False, soft_wrap=True)


app.command()(cli_tools.average)


@app.command()
def leaderboard(experiment: Optional[str] = typer.Option(None, help="MLflow experiment (default: the latest sweep's)."),
                metric: str = typer.Option("bleu", help="bleu | chrf | valid_loss | params_m | latency_ms | "
                                                          "latency_ratio"),
                top: int = typer.Option(10, min=1), sweep_id: Optional[str] = typer.Option(None, "--sweep", help="Only this sweep id."),
                fmt: str = typer.Option("table", "--format", help="table | csv | json | parquet"),
                out_file: Optional[Path] = typer.Option(None, "--out", help="File for csv/json/parquet."),
                status: str = typer.Option("FINISHED", help="FINISHED | FAILED | KILLED | RUNNING | all"),
                where: Optional[list[str]] = typer.Option(None, "--where", help="Constraint METRIC OP NUMBER, e.g. "
                                                          "'latency_ratio<=1.25' (repeatable; all must hold)."),
                pareto: bool = typer.Option(False, "--pareto", help="Mark the trials on the Pareto front (scans every "
                                                                  "matching trial; with --sweep, of the trials meeting "
                                                                  "its search.constraints)."),
                objectives: Optional[str] = typer.Option(None, help="Front objectives, e.g. 'bleu:max,latency_ratio:min' "
                                                         "(default: with --sweep, the sweep YAML's first two "
                                                         "metrics; else bleu:max,latency_ms:min)."),
                page_size: int = typer.Option(1000, min=1, help="Runs fetched from MLflow per request."),
                plot_file: Optional[Path] = typer.Option(None, "--plot", help="Also write the front as a PNG "
                                                         "(first objective against the second)."),
                include_infeasible: bool = typer.Option(False, "--include-infeasible",
                                                        help="Also rank trials that break their sweep's "
                                                             "search.constraints (default: feasible trials only).")) -> None:
    """Best trials from MLflow, ranked by a metric, filtered by sweep, status and constraints; optionally the Pareto front.

    Each trial is judged by its own sweep's search.constraints: only the feasible ones are ranked (and can be on the
    front) unless --include-infeasible; the feasible column says which.
    """
    if fmt == "table" and out_file is not None:
        fail(f"--out {out_file}: the table is printed, not written; pass --format csv, json or parquet to write "
              f"a file")
    check_output_option(out_file)
    check_output_option(plot_file, "--plot")
    from nas import tracking
    from nas.api import ranked_board

    try:
        experiment, board = ranked_board(experiment, metric=metric, top=top, sweep_id=sweep_id, status=status,
                                         where=where or (), include_infeasible=include_infeasible,
                                         pareto=pareto or plot_file is not None, objectives=objectives,
                                         page_size=page_size, keep_points=plot_file is not None)
        if plot_file is not None and len(board.scan.objectives) != 2:
            raise NasError(f"--plot needs exactly two objectives, got --objectives {objectives!r}")
    except NasError as e:
        fail(str(e))
    rows, scan = board.rows, board.scan
    for line in board.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(line)}", highlight=False)
    if scan is not None and plot_file is not None:
        from nas.tracking.plots import write_pareto_plot

        write_pareto_plot(scan, plot_file, title=f"{experiment}{f' / {sweep_id}' if sweep_id else ''}: "
                                                 f"{len(scan.front)} of {scan.scanned} trials on the front")
        out.print(f"wrote the Pareto plot to {escape(str(plot_file))}", highlight=False)
    if board.why_empty:
        err.print(escape(board.why_empty), highlight=False)
    if fmt == "table":
        out.print(tracking.leaderboard_table(rows, title=f"{experiment}: top {top} by {metric}", below=board.below))
        if scan is not None:
            out.print(f"Pareto front ({', '.join(map(str, scan.objectives))}): {len(scan.front)} of {scan.scanned} "
                      f"matching trials; {sum(bool(r.pareto) for r in rows)} in this table (marked *)", highlight=False)
    else:
        if out_file is None:
            fail(f"--format {fmt} needs --out FILE")
        try:
            path = tracking.write_leaderboard(rows, fmt, out_file)
        except NasError as e:
            fail(str(e))
        out.print(f"wrote {len(rows)} rows to {path}")
    if board.note:
        out.print(escape(board.note), highlight=False)


@app.command()
def report(sweep_id: str = typer.Argument(..., help="Sweep id (the nas.sweep_id tag; `nas sweep` prints it)."),
           fmt: str = typer.Option("html", "--format", help="html (one self-contained file) | md (+ a PNG beside it)"),
           out_file: Optional[Path] = typer.Option(None, "--out", help="Report file (default: report-<SWEEP>.<format>)."),
           experiment: Optional[str] = typer.Option(None, help="MLflow experiment of the sweep (default: any)."),
           top: int = typer.Option(10, min=1, help="Rows in the best sub-Transformers table."),
           storage: Optional[str] = typer.Option(None, help="Optuna storage: journal file or database URL (default: "
                                                 "the sweep's nas.optuna_storage tag, else <run dir>/optuna.journal)."),
           study: Optional[str] = typer.Option(None, help="Optuna study name (default: the sweep id, or the only one)."),
           include_infeasible: bool = typer.Option(False, "--include-infeasible",
                                                   help="Also list trials that break the sweep's search.constraints "
                                                        "among the best sub-Transformers (default: feasible only).")) -> None:
    """Write a sweep's report: best sub-Transformers, the Pareto front and Optuna's parameter importances.

    The best sub-Transformers are the feasible trials (meeting the sweep's search.constraints) unless
    --include-infeasible; the Pareto front is always made of feasible trials.
    """
    from nas.report import FORMATS, build_report, write_report

    if fmt not in FORMATS:
        fail(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    out_file = out_file or Path(f"report-{sweep_id}.{fmt}")
    check_output_option(out_file)
    from nas.preflight import check_tracking_store

    try:
        check_tracking_store(read_only=True)  # one line within seconds; a missing SQLite store is not created
        rep = build_report(sweep_id, experiment=experiment, top=top, storage=storage, study_name=study,
                           include_infeasible=include_infeasible)
    except NasError as e:
        fail(str(e))
    try:
        paths = write_report(rep, out_file, fmt)
    except NasError as e:  # the Markdown report's PNG beside it is a folder
        fail(str(e))
    out.print(f"wrote {', '.join(escape(str(p)) for p in paths)}: {rep.scanned} finished trials, {len(rep.front)} on the "
              f"front ({', '.join(map(str, rep.objectives))})", highlight=False)
    if rep.constraints:
        kept = ("all of them listed among the best" if include_infeasible else
                f"the best sub-Transformers are the {rep.scanned - rep.infeasible} feasible ones; "
                "--include-infeasible lists the others too")
        out.print(f"search.constraints {escape(rep.constraints)}: {rep.infeasible} trials break them, {kept}",
                  highlight=False)
    if rep.importance_error:
        err.print(f"[yellow]warning:[/yellow] parameter importances not computed: {escape(rep.importance_error)}",
                  highlight=False)


@app.command()
def export(out_dir: Path = typer.Option(..., "--out", help="Folder to write: new, empty or an earlier export "
                                                          "(replaced as a whole, atomically)."),
           force: bool = typer.Option(False, "--force", help="Replace --out even if it holds files and is not an "
                                                            "earlier export (never the current folder, its "
                                                            "ancestors or the home folder)."),
           best: bool = typer.Option(False, "--best", help="Export the best trial of the experiment."),
           run_id: Optional[str] = typer.Option(None, "--run-id", help="Export this trial run, or a retrain run (nas retrain); a unique prefix of its id is enough."),
           metric: str = typer.Option("bleu", help="Metric that --best ranks by."),
           experiment: Optional[str] = typer.Option(None, help="Experiment for --best (default: the latest sweep's)."),
           where: Optional[list[str]] = typer.Option(None, "--where", help="With --best: only trials meeting METRIC OP "
                                                     "NUMBER, e.g. 'latency_ms<=40' (repeatable)."),
           include_infeasible: bool = typer.Option(False, "--include-infeasible",
                                                   help="With --best: also consider trials that break their sweep's "
                                                        "search.constraints (default: the best feasible trial)."),
           onnx: bool = typer.Option(False, "--onnx", help="Also write encoder.onnx, decoder_step.onnx and translate_onnx.py, "
                                                          "verified with onnxruntime."),
           quantize: Optional[str] = typer.Option(None, "--quantize", metavar="int8",
                                                  help="With the ONNX graphs (implies --onnx): also write int8 ones "
                                                       "(onnxruntime dynamic quantization of the matrix weights), which "
                                                       "translate_onnx.py then uses."),
           ctranslate2: bool = typer.Option(False, "--ctranslate2",
                                            help="Also write a CTranslate2 model folder (<out>/ctranslate2), checked "
                                                 "against PyTorch; the sub-Transformer must be a plain Transformer "
                                                 "(needs pip install 'nas\\[serve]')."),
           register: Optional[str] = typer.Option(None, "--register", metavar="NAME",
                                                  help="Also log the export as an MLflow pyfunc model, register it as NAME "
                                                       "and point the alias 'champion' at it.")) -> None:
    """Write a standalone sub-Transformer: safetensors weights, config, arch and SentencePiece model (and ONNX, and an MLflow model).

    --best exports the best trial that meets its sweep's search.constraints (exit 2, naming them, when none does)
    unless --include-infeasible.
    """
    from nas.export.trial import ExportCheckFailed, export_trial

    try:
        result = export_trial(out_dir, run_id=run_id, best=best, metric=metric, experiment=experiment,
                              where=where or (), include_infeasible=include_infeasible, onnx=onnx,
                              quantize=quantize, ctranslate2=ctranslate2, register=register, force=force)
    except NasError as e:
        fail(str(e))
    except ExportCheckFailed as e:
        fail(str(e), code=1)
    for line in result.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(line)}", highlight=False)
    for line in result.messages:
        out.print(escape(line), highlight=False)


@app.command(name="translate")
def translate_cmd(directory: Path = typer.Argument(..., help="Folder written by `nas export`."),
                  beam_size: Optional[int] = typer.Option(None, "--beam", min=1, help="Beam size (default: the export's)."),
                  input_file: Optional[Path] = typer.Option(None, "--input", "-i",
                                                            help="Source sentences, one a line, UTF-8 (default: stdin)."),
                  output_file: Optional[Path] = typer.Option(None, "--output", "-o",
                                                             help="Translations, one a line in input order (default: stdout); "
                                                                  "written whole at the end, atomically."),
                  max_tokens: int = typer.Option(4096, "--max-tokens", min=1,
                                                 help="Batch the length-sorted sentences up to this many padded source tokens."),
                  threads: Optional[int] = typer.Option(None, "--threads", min=1,
                                                        help="CPU threads for decoding (default: torch's)."),
                  compiled: bool = typer.Option(False, "--compiled",
                                                help="Decode with the beam-search step compiled ahead of time "
                                                     "(AOTInductor, CPU): the encoder and two step packages per "
                                                     "beam size, compiled on first use (about 15 s each), cached in "
                                                     "~/.cache/nas/aot or $NAS_AOT_CACHE; "
                                                     "faster at batch 1 (docs/benchmarks.md).")) -> None:
    """Translate source sentences (one a line, UTF-8) from stdin or --input to stdout or --output.

    Sentences are sorted by length and batched by --max-tokens, and the output keeps the input order. On a
    terminal a progress bar runs; a last line on stderr gives sentences/s and target tokens/s. Empty input gives
    empty output and an empty line an empty line; a line that is not UTF-8 is an error (exit 2) naming it; a line
    longer than the model reads is translated truncated, with a warning naming it.
    """
    from nas.atomic import check_output_file

    try:
        if output_file is not None:
            check_output_file(output_file)
        source = "stdin" if input_file is None else str(input_file)
        raw = sys.stdin.buffer.read() if input_file is None else input_file.read_bytes()
    except (NasError, OSError) as e:
        fail(str(e) if isinstance(e, NasError) else f"cannot read {input_file}: {e.strerror}")
    from nas.export import load_export
    from nas.export.text import decode_lines, translate_lines

    try:
        lines = decode_lines(raw, source)
        model = load_export(directory)
    except NasError as e:  # a missing or damaged file of the export (names it)
        fail(str(e))
    long_lines = [i + 1 for i in model.too_long(lines)]
    if long_lines:
        shown = ", ".join(map(str, long_lines[:10])) + (f" ({len(long_lines)} in all)" if len(long_lines) > 10 else "")
        err.print(f"[yellow]warning:[/yellow] {escape(source)} line{'s' if len(long_lines) > 1 else ''} {shown} "
                  f"{'are' if len(long_lines) > 1 else 'is'} longer than the model reads: truncated to "
                  f"{model.max_src_tokens} tokens (SentencePiece pieces) before translating", highlight=False)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]translate"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("translate", total=len(lines))
        engine = model
        if compiled:
            from nas.export.aot import AotTranslator, default_cache_dir

            err.print(f"compiling the decoder unless {default_cache_dir()} holds it (AOTInductor)…", highlight=False)
            engine = AotTranslator(model, beam_size)
        done = translate_lines(engine, lines, beam_size=beam_size, max_tokens=max_tokens, threads=threads,
                               on_batch=lambda sentences, _: bar.advance(task, sentences))
    hyps, seconds, tokens = done.hypotheses, done.seconds, done.tokens
    text = "".join(h + "\n" for h in hyps)
    if output_file is None:
        sys.stdout.write(text)
    else:
        from nas.atomic import atomic_write_text

        atomic_write_text(output_file, text)
    if lines:
        err.print(f"translated {len(lines)} sentences ({tokens} target tokens) in {seconds:.1f} s: "
                  f"{len(lines) / seconds:.1f} sentences/s, {tokens / seconds:.0f} tokens/s", highlight=False)


app.add_typer(cli_tools.space_app, name="space")
app.add_typer(cli_tools.latency_app, name="latency")
app.command()(cli_tools.fidelity)

if __name__ == "__main__":
    app()
