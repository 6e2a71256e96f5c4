"""The file of a fitted latency predictor, read without torch: its JSON sidecar and its weights' header.

``nas latency fit`` writes a predictor as ``<name>.safetensors`` (the MLP's weights) plus ``<name>.json`` (the
sidecar: format, feature names, standardisation, model_dim, the latency workload it was timed on, the reference
arch and its latency, device, metrics);
:class:`nas.eval.latency.LatencyPredictor` loads both. A sweep YAML that names a predictor
(``search.latency_predictor``) is checked with :func:`read_predictor_meta` here, so loading a YAML never
imports torch (HAT, Wang et al. 2020, sec. 3.3: a predictor is fitted once per device).

The latency workload (``search.latency_workload``, resolved by :func:`workload_of`) lives here too: the YAML
layer, the sweep's tags and the predictor all name it without importing torch.

Standard library only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping

from nas.errors import PredictorFileError

__all__ = ["STACK_FEATURES", "FEATURE_NAMES", "FEATURE_NAMES_BEFORE_ENCODER_ATTENTION", "PREDICTOR_FORMAT",
           "WORKLOAD_KEYS", "read_predictor_meta", "workload_of", "workload_tag", "workload_mismatch"]

STACK_FEATURES = (
    "layers",
    "width_mean", "width_sum",
    "ffn_width_mean", "ffn_width_sum",
    "branches_mean", "branches_sum",
    "paths_mean", "paths_sum",
    "units_mean", "units_sum",
    "prime_layers",
    "kernel_taps",
    "sequential_dependency_layers",
    "attention_work",
    "ffn_work",
)
FEATURE_NAMES: tuple[str, ...] = (
    *(f"encoder.{name}" for name in STACK_FEATURES),
    *(f"decoder.{name}" for name in STACK_FEATURES),
    "model_width",
    "decoder.encoder_attention_sum",
)
"""Names of :func:`nas.eval.latency.arch_features`' entries, in order (a saved predictor checks them on load).

Per stack: ``layers``; mean and sum over layers of ``width`` (D_l, channels), ``ffn_width``
(F_l, channels), ``branches``, ``paths`` and ``units``; ``prime_layers`` (count);
``kernel_taps`` (sum of all kernel sizes of all Prime layers); ``sequential_dependency_layers``
(layers whose MUTE units are chained); ``attention_work`` = sum_l D_l * branches_l * paths_l
* units_l and ``ffn_work`` = sum_l F_l * paths_l * units_l (channels; the widths the layer's
matrix products actually run at). Then ``model_width`` C (channels), and ``decoder.encoder_attention_sum``, the sum
over decoder layers of the encoder layers each cross-attention attends to (HAT sec. 3.1, clamped to the encoder's
depth: :attr:`~nas.space.arch.Arch.attended_layers`; HAT's predictor takes their mean, here the number of layers is
a feature of its own)."""
FEATURE_NAMES_BEFORE_ENCODER_ATTENTION: tuple[str, ...] = FEATURE_NAMES[:-1]
"""The features of a predictor fitted before ``encoder_attention`` existed: it still loads, and predicts archs whose
decoder layers all attend to the last encoder layer only (:class:`~nas.eval.latency.LatencyPredictor`)."""
PREDICTOR_FORMAT = "nas-latency-predictor/2"
"""``format`` key of the JSON sidecar. Version 2 predicts the log latency ratio to the reference arch, measured
interleaved with it; version 1 (log milliseconds of arch and reference timed apart) is refused, to be refit."""

_REQUIRED = ("model_dim", "hidden", "hidden_layers", "batch_size", "beam_size", "feature_mean", "feature_std",
             "target_mean", "target_std", "reference_ms")
"""Sidecar keys a predictor cannot be loaded without (and ``workload``, checked on its own)."""

WORKLOAD_KEYS = ("src_tokens", "tgt_tokens", "beam", "batch")
"""Keys of a resolved latency workload, in the order of its tag."""


def workload_of(search: Any) -> dict[str, int]:
    """The resolved ``search.latency_workload`` of a :class:`~nas.space.schema.SearchSpec`: ``src_tokens`` (source
    tokens, EOS included), ``tgt_tokens`` (decoder steps), ``beam`` (``None`` in the YAML: ``search.beam_size``)
    and ``batch`` (sentences), all ints."""
    w = search.latency_workload
    return {"src_tokens": int(w.src_tokens), "tgt_tokens": int(w.tgt_tokens),
            "beam": int(search.beam_size if w.beam is None else w.beam), "batch": int(w.batch)}


def workload_tag(workload: Mapping[str, int]) -> str:
    """One line for tags and file names: ``{"src_tokens": 30, "tgt_tokens": 30, "beam": 4, "batch": 1}`` ->
    ``"src30-tgt30-beam4-batch1"``."""
    return (f"src{workload['src_tokens']}-tgt{workload['tgt_tokens']}-beam{workload['beam']}"
            f"-batch{workload['batch']}")


def workload_mismatch(fitted: Mapping[str, Any], wanted: Mapping[str, int]) -> str | None:
    """How the workload a predictor was ``fitted`` on differs from the ``wanted`` one (``"tgt_tokens 20 vs 30;
    beam 5 vs 4"``: fitted vs wanted), or None when they are the same."""
    diffs = [f"{k} {fitted.get(k)} vs {wanted[k]}" for k in WORKLOAD_KEYS if fitted.get(k) != wanted[k]]
    return "; ".join(diffs) or None


def _check_weights_header(path: Path) -> None:
    """``path`` starts like a safetensors file: an 8-byte little-endian header length, then a JSON object.

    Raises:
        FileNotFoundError: ``path`` is missing.
        PredictorFileError: the header is truncated or not a JSON object.
    """
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PredictorFileError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", head)
        header = f.read(size) if size <= 100_000_000 else b""
    try:
        parsed = json.loads(header.decode("utf-8")) if len(header) == size else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        parsed = None
    if not isinstance(parsed, dict):
        raise PredictorFileError(f"{path} is not a safetensors file (its header is not a JSON object of {size} bytes)")


def read_predictor_meta(path: str | Path) -> dict[str, Any]:
    """The sidecar of the predictor whose weights are ``path`` (``path`` with suffix ``.json``), checked.

    Checks: the sidecar is JSON with :data:`PREDICTOR_FORMAT`, the predictor was fitted on this version's
    :data:`FEATURE_NAMES` (same names, same order; or :data:`FEATURE_NAMES_BEFORE_ENCODER_ATTENTION`), it names the latency workload it was timed on (a predictor
    fitted before ``latency_ms`` became the fixed workload has none), it has every key a predictor needs, and the
    weights file has a safetensors header.

    Returns:
        The sidecar mapping: ``model_dim`` (channels), ``workload`` (:data:`WORKLOAD_KEYS`), ``batch_size``
        (sentences) and ``beam_size`` (the workload's), ``hidden``/``hidden_layers`` (MLP),
        ``feature_mean``/``feature_std``, ``target_mean``/``target_std`` (of the log latency ratio), ``reference_ms``
        (the reference arch's latency, ms, the median of the samples' interleaved timings of it) and ``reference_arch``
        (:meth:`Arch.to_json`; None likewise), ``device``, ``metrics``.

    Raises:
        FileNotFoundError: the weights or the sidecar is missing.
        PredictorFileError: the sidecar is not JSON or not a predictor's, it was fitted on other features or without
            a latency workload (refit with ``nas latency fit``), a key is missing, or the weights file is not
            safetensors.
    """
    path = Path(path)
    sidecar = path.with_suffix(".json")
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PredictorFileError(f"{sidecar} is not JSON ({e}); refit with `nas latency fit`") from None
    if isinstance(meta, dict) and meta.get("format") == "nas-latency-predictor/1":
        raise PredictorFileError(f"predictor {path} predicts milliseconds timed apart from the reference arch (format "
                                 f"nas-latency-predictor/1); this version predicts the latency ratio timed "
                                 f"interleaved with it ({PREDICTOR_FORMAT}): refit with `nas latency fit`")
    if not isinstance(meta, dict) or meta.get("format") != PREDICTOR_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise PredictorFileError(f"{sidecar} has format {found!r}, expected {PREDICTOR_FORMAT!r}")
    names = meta.get("feature_names")
    if names not in (list(FEATURE_NAMES), list(FEATURE_NAMES_BEFORE_ENCODER_ATTENTION)):
        missing = [n for n in FEATURE_NAMES if n not in (names or [])]
        extra = [n for n in (names or []) if n not in FEATURE_NAMES]
        raise PredictorFileError(f"predictor {path} was fitted on features {names}; this version computes "
                         f"{list(FEATURE_NAMES)} (missing: {missing}, unknown: {extra}, or another order); "
                         f"refit with `nas latency fit`")
    workload = meta.get("workload")
    if not isinstance(workload, dict) or any(not isinstance(workload.get(k), int) for k in WORKLOAD_KEYS):
        raise PredictorFileError(f"predictor {path} names no latency workload ({sidecar} has workload={workload!r}): it "
                                 f"was fitted on real sentences before latency_ms became the fixed workload "
                                 f"search.latency_workload; refit with `nas latency fit`")
    absent = [k for k in _REQUIRED if k not in meta]
    if absent:
        raise PredictorFileError(f"{sidecar} lacks {', '.join(absent)}; refit with `nas latency fit`")
    _check_weights_header(path)
    return meta
