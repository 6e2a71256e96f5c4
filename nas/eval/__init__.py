"""Scoring a sub-Transformer: translation quality and loss, latency and its predictor.

What lives where (every public name below is re-exported here and loaded on first use, PEP 562, so
``import nas.eval`` alone imports no torch):

- :mod:`nas.eval.scores`: :func:`translate` (beam search over raw sentences), :func:`corpus_scores` (BLEU and
  chrF, sacrebleu), :func:`valid_loss` (NLL, nats per target token), :func:`encode_sources`, :class:`Scores`.
- :mod:`nas.eval.validation`: :func:`validation_scores` (BLEU, chrF and validation loss of a sub-Transformer: the
  one scoring recipe of the search, the trainer, fidelity and fine-tuning) on a :class:`ValidationSet` loaded once.
- :mod:`nas.eval.latency` (modules timing, ratio, predictor, samples): :func:`measure_latency_ratio` (a trial's
  ``latency_ratio``, ``latency_ms`` and ``latency_reference_ms``: the arch and the reference timed interleaved on
  HAT's fixed workload), :func:`measure_fixed_latency` (one arch alone), :func:`resolve_reference` (``latency_ratio``'s reference arch),
  :func:`measure_latency` (median ms per batch of real sentences), :func:`collect_samples`,
  :func:`collect_fixed_samples`, :func:`fit_predictor_file`, :func:`arch_features` and the HAT-style
  :class:`LatencyPredictor`, :func:`check_drift`, :func:`describe_device`.
- :mod:`nas.eval.measure_lock`: :class:`MeasureLock`, the node-wide lock that a latency measurement holds alone
  and other scoring work holds shared (standard library only).

Ranking fidelity (inherited against standalone scores) trains models, so it sits above the trainers:
:mod:`nas.search.fidelity`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nas.lazy import lazy_exports

_MODULES = {
    "scores": ("translate", "corpus_scores", "valid_loss", "encode_sources", "Scores"),
    "validation": ("ValidationSet", "validation_scores"),
    "latency": ("FEATURE_NAMES", "arch_features", "measure_latency", "collect_samples", "describe_device",
                "LatencyPredictor", "check_drift", "measure_fixed_latency", "resolve_reference",
                "collect_fixed_samples", "fit_predictor_file", "measure_latency_ratio", "latency_device"),
    "measure_lock": ("LOCK_DIR_ENV", "Hold", "MeasureLock", "lock_dir"),
}
"""Submodule -> the public names it defines (its ``__all__``)."""
_HOMES = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["FEATURE_NAMES", "Hold", "LOCK_DIR_ENV", "LatencyPredictor", "MeasureLock", "Scores", "arch_features",
           "check_drift", "collect_samples", "corpus_scores", "describe_device", "encode_sources", "lock_dir",
           "measure_latency", "translate", "valid_loss", "ValidationSet", "validation_scores",
           "measure_fixed_latency", "resolve_reference", "collect_fixed_samples", "fit_predictor_file",
           "measure_latency_ratio", "latency_device"]

if TYPE_CHECKING:
    from nas.eval.latency import (FEATURE_NAMES, LatencyPredictor, arch_features, check_drift,
                                  collect_fixed_samples, collect_samples, describe_device, fit_predictor_file,
                                  latency_device, measure_fixed_latency, measure_latency, measure_latency_ratio,
                                  resolve_reference)
    from nas.eval.measure_lock import LOCK_DIR_ENV, Hold, MeasureLock, lock_dir
    from nas.eval.scores import Scores, corpus_scores, encode_sources, translate, valid_loss
    from nas.eval.validation import ValidationSet, validation_scores


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
