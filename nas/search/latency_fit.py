"""``nas latency fit``: time sub-Transformers of a trained supernet on the YAML's fixed workload and fit the HAT
latency predictor (after Wang et al. 2020, sec. 3.3, which fits an MLP from the arch encoding to the measured latency; here a
ridge regression on the log latency ratio, :class:`nas.eval.latency.LatencyPredictor`).

It prepares what a sweep reads (``search.latency: predicted``), so it sits beside the sweep: above the builders,
the model and the latency measurement (:func:`nas.eval.latency.collect_fixed_samples`,
:func:`nas.eval.latency.fit_predictor_file`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nas.errors import NasError, OutputPathError
from nas.space import SweepSpec

__all__ = ["LatencyFit", "default_predictor_path", "fit_latency"]


@dataclass(frozen=True)
class LatencyFit:
    """What :func:`fit_latency` wrote and measured.

    Attributes:
        path: the predictor file (safetensors); ``<path stem>.samples.json`` beside it holds ``samples``.
        samples: one dict per timed sub-Transformer (``arch``, ``latency_ratio``, ``latency_ms``,
            ``latency_reference_ms``, ``device``, ``reference``).
        metrics: held-out ``rmse_ratio`` (of the latency ratio), ``mape`` (%) and ``holdout_samples``.
        workload: the workload tag (``src30_tgt30_beam4_batch1``).
    """

    path: Path
    samples: list[dict[str, Any]]
    metrics: dict[str, float]
    workload: str

    @property
    def reference(self) -> dict[str, Any]:
        """The sample of ``search.latency_reference`` (its latency is what ``latency_ratio`` divides by)."""
        return next(s for s in self.samples if s["reference"])


def default_predictor_path(spec: SweepSpec) -> Path:
    """``<workdir>/<name>/latency_<workload>.safetensors``: where a sweep looks for the predictor by default."""
    from nas.space.predictor_file import workload_of, workload_tag

    return spec.run_dir / f"latency_{workload_tag(workload_of(spec.search))}.safetensors"


def fit_latency(spec: SweepSpec, *, samples: int = 100, threads: int | None = None, out_file: str | Path | None = None,
                seed: int = 0, progress: bool = True, latency_runner: Any = None) -> LatencyFit:
    """Time ``samples`` sub-Transformers (widest, narrowest, then random; plus the latency reference) of the
    sweep's trained supernet on this machine and fit the latency predictor.

    Args:
        threads: torch threads while timing (default ``search.cpu_per_trial``).
        out_file: the predictor file (default :func:`default_predictor_path`).
        seed: of the sampled archs (and of an MLP's initial weights).
        latency_runner: ``search.latency_engine: onnxruntime``'s runner factory (``nas latency fit`` passes
            :func:`nas.export.latency_engine.onnx_runner`; :func:`nas.search.trials.engine_runner`).

    Raises:
        OutputPathError: ``out_file`` is a folder. NasError: no trained supernet in ``<workdir>/<name>/supernet``
            (names the command that trains it); too few samples to hold some out.
    """
    from nas.builders import build_space
    from nas.eval.latency import collect_fixed_samples, fit_predictor_file
    from nas.eval.measure_lock import MeasureLock
    from nas.atomic import atomic_write_text, check_output_file
    from nas.model.io import load_model
    from nas.space.predictor_file import workload_of, workload_tag

    target = Path(out_file) if out_file is not None else default_predictor_path(spec)
    try:
        check_output_file(target)
    except NasError as e:
        raise OutputPathError(f"--out: {e}") from None
    supernet_dir = spec.run_dir / "supernet"
    if not (supernet_dir / "supernet.safetensors").is_file():
        raise NasError(f"no trained supernet in {supernet_dir}; run `nas sweep FILE` or `nas train FILE` with the "
                       f"YAML of {spec.name!r} first")
    model = load_model(supernet_dir, "supernet").eval()
    runner = None
    if spec.search.latency_engine != "torch":
        from nas.builders import prepare_sweep_data
        from nas.search.trials import engine_runner

        runner = engine_runner(spec, latency_runner, prepare_sweep_data(spec, progress=False).spm_model,
                               threads or max(1, int(spec.search.cpu_per_trial)))
    try:
        measured = collect_fixed_samples(model, spec, samples, space=build_space(spec), seed=seed, threads=threads,
                                         lock=MeasureLock(), progress=progress, runner=runner)
    finally:
        getattr(runner, "close", lambda: None)()
    metrics = fit_predictor_file(measured, spec, target, seed=seed)
    atomic_write_text(target.with_name(target.stem + ".samples.json"), json.dumps(measured, indent=1))
    return LatencyFit(target, measured, {k: float(v) for k, v in metrics.items()},
                      workload_tag(workload_of(spec.search)))
