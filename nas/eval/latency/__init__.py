"""Latency of a sub-Transformer on a fixed workload, and a HAT-style predictor: arch features -> a small MLP -> ms.

A trial's ``latency_ratio`` (the sweep's budget) and ``latency_ms`` belong to the arch, not to what its weights
emit, and come from one function, :func:`measure_latency_ratio` (:mod:`nas.eval.latency.ratio`): the arch and the
reference arch (``search.latency_reference``) timed interleaved in the process that scores the arch; trials,
level 1's predictor samples, ``nas latency fit`` and ``nas retrain`` all call it. Each run of it, like
:func:`measure_fixed_latency`, times
HAT's workload (Wang et al. 2020, "HAT: Hardware-Aware Transformers for Efficient Natural Language Processing",
ACL, sec. 4): ``batch`` dummy sources of ``src_tokens`` tokens, beam search of exactly ``tgt_tokens`` decoder
steps (EOS held back until the last), output layer included; ``warmup`` untimed runs, ``repeats`` timed ones,
the top and bottom 10% dropped and the rest averaged. The workload comes from the YAML
(``search.latency_workload``, resolved by :func:`workload_of`). :func:`measure_latency` (real beam search on real
sentences, so the output length of the weights counts) stays for benchmarks.

Measuring every candidate costs a decode per trial; HAT (sec. 3.3) instead measures a few thousand random
sub-Transformers once per device, fits an MLP on their architecture features (layer counts and averaged
dimensions) and queries it during the search. Here the same recipe runs on this project's unified layer
(branches, paths, Prime layers with kernels, MUTE units):

1. :func:`collect_samples` extracts random sub-Transformers (plus the widest, the narrowest and the reference
   arch of ``latency_ratio``) from a supernet and times each with :func:`measure_fixed_latency`;
2. :meth:`LatencyPredictor.fit` trains the MLP on :func:`arch_features` (standardized) against the log of the
   interleaved ``latency_ratio`` and reports held-out RMSE and MAPE; the predictor keeps the workload and the
   reference's latency;
3. :meth:`LatencyPredictor.predict_ratio` gives the ratio that level 1 compares with the budget, the same figure
   a trial measures; :meth:`LatencyPredictor.predict` gives it in milliseconds (times the reference's); :func:`check_drift` compares a prediction with a fresh
   measurement (a predictor fitted on another machine, thread count or torch version drifts, often by more than
   20%).

What lives where (every public name is re-exported here; each module imports only those above it):

- :mod:`nas.eval.latency.timing`: the timing harness: :func:`measure_fixed_latency`, :func:`measure_latency`,
  :func:`trimmed_mean`, :func:`describe_device`, :data:`DEFAULT_WORKLOAD` and :func:`torch_threads`.
- :mod:`nas.eval.latency.predictor`: :func:`arch_features`, :class:`LatencyPredictor`, :func:`cross_validate`,
  :func:`fit_predictor_file`,
  :func:`check_drift`.
- :mod:`nas.eval.latency.ratio`: :func:`measure_latency_ratio`, the one measurement, and :func:`latency_device`.
- :mod:`nas.eval.latency.samples`: the predictor's dataset, :func:`collect_samples` and
  :func:`collect_fixed_samples`; :func:`resolve_reference` (``latency_ratio``'s reference arch,
  :data:`REFERENCE_NAMES`).

The node-wide lock a measurement holds alone is :mod:`nas.eval.measure_lock`.
"""

from __future__ import annotations

from nas.eval.latency.predictor import (FEATURE_NAMES, LatencyPredictor, arch_features, check_drift, cross_validate,
                                       fit_predictor_file)
from nas.eval.latency.ratio import DEFAULT_ROUNDS, interleaved_timings, latency_device, measure_latency_ratio
from nas.eval.latency.samples import REFERENCE_NAMES, collect_fixed_samples, collect_samples, resolve_reference
from nas.eval.latency.timing import (DEFAULT_WORKLOAD, describe_device, measure_fixed_latency, measure_latency,
                                     trimmed_mean)
from nas.space.predictor_file import workload_of, workload_tag

__all__ = ["FEATURE_NAMES", "DEFAULT_WORKLOAD", "DEFAULT_ROUNDS", "REFERENCE_NAMES", "arch_features",
           "measure_latency_ratio", "interleaved_timings", "latency_device",
           "measure_fixed_latency", "measure_latency", "trimmed_mean", "workload_of", "workload_tag",
           "resolve_reference", "collect_samples", "collect_fixed_samples", "cross_validate", "fit_predictor_file",
           "describe_device",
           "LatencyPredictor", "check_drift"]
