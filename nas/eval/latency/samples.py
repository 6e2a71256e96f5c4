"""The predictor's dataset (HAT sec. 3.3): distinct sub-Transformers of a space, each extracted and timed on one
fixed workload interleaved with the reference arch (:func:`nas.eval.latency.ratio.measure_latency_ratio`, as a
sweep times its trials): :func:`collect_samples`, :func:`collect_fixed_samples`; and the reference arch that every
``latency_ratio`` divides by (:func:`resolve_reference`).
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from nas.errors import NasError
from nas.eval.latency.ratio import DEFAULT_ROUNDS, WARMUP_ROUNDS, Runner, latency_device, measure_latency_ratio
from nas.eval.latency.timing import DEFAULT_WORKLOAD, describe_device, torch_threads
from nas.eval.measure_lock import MeasureLock
from nas.model.supernet import SuperTransformer, extract
from nas.space.arch import Arch
from nas.space.predictor_file import workload_of
from nas.space.schema import SweepSpec
from nas.space.space import SearchSpace

__all__ = ["REFERENCE_NAMES", "resolve_reference", "collect_samples", "collect_fixed_samples"]

REFERENCE_NAMES = ("narrowest", "widest", "middle")
"""Named values of ``search.latency_reference`` (else an arch as JSON)."""


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]latency"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


def resolve_reference(spec: SweepSpec, space: SearchSpace) -> Arch:
    """The arch ``latency_ratio`` divides by: ``search.latency_reference`` (``narrowest``, ``widest``, ``middle`` of
    ``space``, the sweep's (:func:`nas.builders.build_space`); or an arch as JSON, :meth:`Arch.to_json`).

    Raises:
        NasError: the value is none of the names and no arch JSON, or the arch exceeds the supernet (names
            ``search.latency_reference`` and the value).
    """
    named = spec.search.latency_reference
    if named in REFERENCE_NAMES:
        return getattr(space, named)()
    try:
        arch = Arch.from_json(named)
        arch.check_within(space.supernet_maxima(spec))
    except (ValueError, TypeError, AttributeError) as e:  # JSONDecodeError and ArchError are ValueErrors
        raise NasError(f"search.latency_reference: {named!r} is not {', '.join(REFERENCE_NAMES)} or an arch of this "
                       f"supernet as JSON (Arch.to_json(), e.g. from `nas space sample`): {e}") from None
    return arch


def _sample_archs(space: SearchSpace, n: int, seed: int, reference: Arch) -> list[Arch]:
    """The widest, the narrowest, then distinct random archs: ``n`` in all, fewer if the space is smaller; then
    ``reference`` when it is not among them."""
    rng = random.Random(seed)
    archs: dict[str, Arch] = {}
    candidates = [space.widest(), space.narrowest()]
    attempts = 0
    while len(archs) < n and attempts < 20 * n + 20:
        arch = candidates.pop(0) if candidates else space.sample(rng)
        archs.setdefault(arch.arch_id, arch)
        attempts += 1
    archs.setdefault(reference.arch_id, reference)
    return list(archs.values())


def collect_samples(supernet: SuperTransformer, space: SearchSpace, n: int, *,
                    workload: Mapping[str, int] | None = None, reference: Arch | None = None, seed: int = 0,
                    rounds: int = DEFAULT_ROUNDS, warmup: int = WARMUP_ROUNDS, threads: int | None = None,
                    lock: MeasureLock | None = None, progress: bool = True,
                    runner: Runner | None = None) -> list[dict[str, Any]]:
    """Measure the latency of ``n`` distinct sub-Transformers of ``space`` on one workload (HAT sec. 3.3's dataset).

    The first two are the widest and the narrowest, the rest uniformly random (``space.sample`` with
    ``random.Random(seed)``); fewer than ``n`` when the space is smaller; then ``reference`` (``latency_ratio``'s
    denominator) if it is not among them. Each is extracted (:func:`nas.model.supernet.extract`) and timed on
    ``workload`` interleaved with the extracted reference (:func:`nas.eval.latency.ratio.measure_latency_ratio`, the
    one measurement a sweep's trials and ``nas retrain`` use too), with a rich progress bar on stderr.

    Args:
        supernet: the (trained or untrained) supernet: the fixed workload does not depend on the weights.
        space: where the archs come from (each must fit the supernet).
        n: number of archs (besides the reference).
        workload: ``src_tokens``, ``tgt_tokens``, ``beam``, ``batch`` (:func:`workload_of` of the sweep's
            ``search``; None: :data:`DEFAULT_WORKLOAD`).
        reference: the arch ``latency_ratio`` divides by (:func:`nas.search.trials.resolve_reference`; None: the
            narrowest).
        rounds, warmup: timed interleaved rounds and untimed runs per arch (:func:`measure_latency_ratio`).
        threads: torch threads while measuring (None: the process's; the sweep's trials run with
            ``search.cpu_per_trial``), restored afterwards.
        lock: the node's measurement lock, held exclusively during each measurement (None: none).
        runner: the engine (:func:`measure_latency_ratio`; None: PyTorch); its samples' ``device`` says which.

    Returns:
        One JSON-ready dict per arch: ``arch`` (:meth:`Arch.to_dict`), ``arch_id``, ``model_dim``, ``workload``,
        ``batch_size`` and ``beam_size`` (the workload's), ``latency_ms`` and ``latency_reference_ms`` (medians, ms),
        ``latency_ratio`` (what the predictor is fitted on), ``device`` (:func:`describe_device`), ``reference``
        (True for the reference arch only).

    Raises:
        ValueError: ``n`` below 1, or an arch beyond the supernet's maxima (names the choice).
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    workload = dict(DEFAULT_WORKLOAD if workload is None else workload)
    reference = space.narrowest() if reference is None else reference
    archs = _sample_archs(space, n, seed, reference)
    device = next(supernet.parameters()).device
    with torch_threads(threads or torch.get_num_threads()):
        return _measure_all(supernet, archs, workload, reference, rounds, warmup, device, lock, progress, runner)


def collect_fixed_samples(supernet: SuperTransformer, spec: SweepSpec, n: int, *, space: SearchSpace,
                          seed: int | None = None,
                          threads: int | None = None, lock: MeasureLock | None = None,
                          progress: bool = False, runner: Runner | None = None) -> list[dict[str, Any]]:
    """:func:`collect_samples` as a sweep times its trials: ``space`` (the sweep's, :func:`nas.builders.build_space`),
    the workload (:func:`workload_of`), reference
    (:func:`resolve_reference`) and ``search.latency_repeats`` (interleaved rounds) of ``spec``, on the device
    ``search.latency_device`` names for a supernet on its device (:func:`latency_device`; the supernet is moved
    there); ``seed`` None: ``search.seed``; ``threads`` None: ``search.cpu_per_trial``; ``runner``: the engine of
    ``search.latency_engine`` (:func:`nas.search.trials.engine_runner`; None: PyTorch).

    Raises:
        NasError: a bad ``search.latency_reference``.
        ValueError: as :func:`collect_samples`.
    """
    supernet.to(latency_device(spec.search.latency_device, next(supernet.parameters()).device))
    return collect_samples(supernet, space, n, workload=workload_of(spec.search),
                           reference=resolve_reference(spec, space),
                           seed=spec.search.seed if seed is None else seed, rounds=spec.search.latency_repeats,
                           threads=threads or max(1, int(spec.search.cpu_per_trial)), lock=lock, progress=progress,
                           runner=runner)


def _measure_all(supernet: SuperTransformer, archs: list[Arch], workload: dict[str, int], reference: Arch,
                 rounds: int, warmup: int, device: torch.device, lock: MeasureLock | None,
                 progress: bool, runner: Runner | None) -> list[dict[str, Any]]:
    where = describe_device(device) + ("" if runner is None else ", onnxruntime")
    threads = torch.get_num_threads()
    reference_model = extract(supernet, reference).to(device)
    samples = []
    with _progress(progress) as bar:
        task = bar.add_task("archs", total=len(archs), info="")
        for arch in archs:
            model = extract(supernet, arch).to(device)
            measured = measure_latency_ratio(model, arch, reference_model, reference, workload=workload,
                                             rounds=rounds, warmup=warmup, threads=threads, lock=lock, runner=runner)
            samples.append({"arch": arch.to_dict(), "arch_id": arch.arch_id, "model_dim": supernet.model_dim,
                            "workload": dict(workload), "batch_size": workload["batch"], "beam_size": workload["beam"],
                            **measured, "device": where, "reference": arch.arch_id == reference.arch_id})
            bar.update(task, advance=1, info=f"{arch.arch_id}: {measured['latency_ratio']:.2f}x "
                                             f"({measured['latency_ms']:.1f} ms)")
    return samples
