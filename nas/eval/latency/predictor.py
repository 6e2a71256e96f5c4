"""HAT's latency predictor (sec. 3.3) on this project's unified layer: the arch features
(:func:`arch_features`), the MLP from them to the log latency ratio on one fixed workload (:class:`LatencyPredictor`:
fit, predict, save and load), :func:`fit_predictor_file` (what ``nas latency fit`` and the evolutionary search write) and
:func:`check_drift` (a prediction against a fresh measurement).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nas.errors import NasError
from nas.eval.latency.timing import DEFAULT_WORKLOAD, torch_threads
from nas.atomic import atomic_path, atomic_write_text
from nas.space.arch import Arch, StackArch
from nas.space.predictor_file import (FEATURE_NAMES, PREDICTOR_FORMAT, read_predictor_meta, workload_mismatch,
                                     workload_of, workload_tag)
from nas.space.schema import SweepSpec

__all__ = ["FEATURE_NAMES", "arch_features", "LatencyPredictor", "cross_validate", "fit_predictor_file", "check_drift"]


def _stack_features(stack: StackArch) -> list[float]:
    n = stack.layers
    mean_sum = lambda values: [sum(values) / n, float(sum(values))]
    dims = stack.layer_dims()
    return [
        float(n),
        *mean_sum(stack.width), *mean_sum(stack.ffn_width), *mean_sum(stack.branches),
        *mean_sum(stack.paths), *mean_sum(stack.units),
        float(sum(d.layout == "prime" for d in dims)),
        float(sum(sum(d.kernels) for d in dims)),
        float(sum(d.units > 1 and d.unit_dependency == "sequential" for d in dims)),
        float(sum(d.width * d.branches * d.paths * d.units for d in dims)),
        float(sum(d.ffn_width * d.paths * d.units for d in dims)),
    ]


def arch_features(arch: Arch, model_dim: int) -> list[float]:
    """The fixed-length feature vector of ``arch`` (``len == len(FEATURE_NAMES)``; see there).

    Extends HAT's features (sec. 3.3: layer counts and per-stack averages of the embedding,
    FFN and head dimensions, and of the encoder layers each decoder layer attends to) with the sums and the
    dimensions of the unified layer.

    Args:
        arch: the sub-Transformer; an optional ``arch.model_width`` (type-1 Scalable
            Transformers) is its model width C, None meaning ``model_dim``.
        model_dim: the supernet's model width (channels).

    Raises:
        ValueError: ``model_dim`` (or ``arch.model_width``) below 1.
    """
    model_width = arch.model_width or model_dim
    if model_width < 1:
        raise ValueError(f"model width {model_width} must be >= 1 (model_dim={model_dim})")
    return [*_stack_features(arch.encoder), *_stack_features(arch.decoder), float(model_width),
            float(sum(arch.attended_layers))]


def _mlp(features: int, hidden: int, hidden_layers: int) -> nn.Sequential:
    """HAT's predictor: ``hidden_layers`` Linear+ReLU blocks of ``hidden`` units, then one output."""
    layers: list[nn.Module] = []
    width = features
    for _ in range(hidden_layers):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _as_arch(arch: Arch | Mapping[str, Any]) -> Arch:
    return arch if isinstance(arch, Arch) else Arch.from_dict(arch)


class LatencyPredictor:
    """A ridge regression (the default) or an MLP from standardized :func:`arch_features` to the log latency ratio on
    one fixed workload (after HAT sec. 3.3).

    HAT uses an MLP of 3 hidden layers of 400 units. The default here is linear (``hidden_layers=0``: ridge
    regression, fitted in closed form with penalty ``ridge``): on three sets of 40-60 quickstart samples its
    8-fold cross-validated error was about a third below the 64-unit MLP's (4.5% against 6.0%, 4.3% against 6.6%,
    7.2% against 10.3%; ``python benchmarks/bench_predictor.py``). With 40 samples and about 25 features an MLP fits
    the measurement noise; latency on the fixed workload is close to a sum of per-layer costs, which the sums among
    the features make linear. The error matters beyond its size: level 1 keeps the candidates whose *predicted*
    latency is low, so it keeps the under-predicted ones, and level 2 then measures them above their prediction.
    ``hidden_layers >= 1`` gives HAT's MLP (trained with AdamW). The target is ``log(latency_ratio)`` standardized, the ratio measured interleaved with the
    reference arch (:func:`nas.eval.latency.ratio.measure_latency_ratio`), so that a predicted ratio (level 1) and
    a measured one (a trial) are the same figure; the squared error is a relative one. This departs from HAT, which
    predicts milliseconds: milliseconds timed at different moments on a shared CPU differ by up to 2x, ratios timed
    interleaved do not. :meth:`predict` gives milliseconds as the ratio times ``reference_ms``.

    Args:
        model_dim: the supernet's model width C (channels), for :func:`arch_features`.
        hidden: units per hidden layer (an MLP's).
        hidden_layers: hidden Linear+ReLU layers; 0: a linear model fitted by ridge regression.
        ridge: the linear model's L2 penalty on the standardized features and target (its normal equations
            ``(X^T X + ridge I) w = X^T y``).
        workload: the workload it predicts (``src_tokens``, ``tgt_tokens``, ``beam``, ``batch``:
            :func:`workload_of`; None: :data:`DEFAULT_WORKLOAD`); ``fit`` uses only samples measured on it.
        device: where the samples were measured (:func:`describe_device`).
        reference_ms: the reference arch's latency (ms) on the workload (the median over the samples' interleaved
            reference timings), what a predicted ratio is multiplied by for milliseconds (None: not fitted yet).
        reference_arch: that arch (:meth:`Arch.to_json`).

    Raises:
        ValueError: ``hidden`` below 1, ``hidden_layers`` or ``ridge`` below 0; a workload lacking a key;
            ``reference_ms`` not positive.
    """

    def __init__(self, model_dim: int, *, hidden: int = 64, hidden_layers: int = 0, ridge: float = 3.0,
                 workload: Mapping[str, int] | None = None, device: str = "", reference_ms: float | None = None,
                 reference_arch: str | None = None) -> None:
        if hidden < 1 or hidden_layers < 0 or not ridge >= 0:
            raise ValueError(f"hidden={hidden} must be >= 1, hidden_layers={hidden_layers} and ridge={ridge} >= 0")
        self.ridge = float(ridge)
        workload = dict(DEFAULT_WORKLOAD if workload is None else workload)
        missing = [k for k in DEFAULT_WORKLOAD if k not in workload]
        if missing:
            raise ValueError(f"workload {workload} lacks {', '.join(missing)}")
        if reference_ms is not None and not (math.isfinite(reference_ms) and reference_ms > 0):
            raise ValueError(f"reference_ms={reference_ms} must be positive and finite")
        self.model_dim, self.hidden, self.hidden_layers = model_dim, hidden, hidden_layers
        self.workload = {k: int(workload[k]) for k in DEFAULT_WORKLOAD}
        self.device, self.reference_ms, self.reference_arch = device, reference_ms, reference_arch
        self.feature_names = FEATURE_NAMES  # a loaded predictor's: FEATURE_NAMES or a prefix of them
        self.net = _mlp(len(FEATURE_NAMES), hidden, hidden_layers)
        self.feature_mean = torch.zeros(len(FEATURE_NAMES))
        self.feature_std = torch.ones(len(FEATURE_NAMES))
        self.target_mean, self.target_std = 0.0, 1.0
        self.metrics: dict[str, float] = {}
        self.fitted = False

    @property
    def batch_size(self) -> int:
        """Sentences per batch of the workload."""
        return self.workload["batch"]

    @property
    def beam_size(self) -> int:
        """Beams per sentence of the workload."""
        return self.workload["beam"]

    def _measured_on_mine(self, sample: Mapping[str, Any]) -> bool:
        """A sample with a ``workload`` must have this one; an older one without, this batch and beam size."""
        if "workload" in sample:
            return workload_mismatch(sample["workload"], self.workload) is None
        return (sample.get("batch_size", self.batch_size), sample.get("beam_size", self.beam_size)) == \
            (self.batch_size, self.beam_size)

    def _x(self, archs: Sequence[Arch]) -> torch.Tensor:
        """Standardized features ``[n, F]`` of :attr:`feature_names` (a predictor fitted before
        ``encoder_attention`` existed refuses an arch that attends to more than the last encoder layer)."""
        n = len(self.feature_names)
        for a in archs:
            if n < len(FEATURE_NAMES) and any(k > 1 for k in a.attended_layers):
                raise NasError(f"arch {a.summary()} attends to several encoder layers (encoder_attention), which this "
                               f"predictor, fitted before that choice existed, cannot tell; refit with "
                               f"`nas latency fit`")
        x = torch.tensor([arch_features(a, self.model_dim)[:n] for a in archs], dtype=torch.float64)  # [n, F]
        return ((x - self.feature_mean.double()) / self.feature_std.double()).float()

    def _ratio(self, y: torch.Tensor) -> torch.Tensor:
        """Standardized log latency ratio ``[n]`` -> latency ratio ``[n]``."""
        return torch.exp(y.double() * self.target_std + self.target_mean)

    def fit(self, samples: Sequence[Mapping[str, Any]], *, holdout: float = 0.2, epochs: int = 1000,
            lr: float = 3e-3, weight_decay: float = 1e-4, seed: int = 0) -> dict[str, float]:
        """Train on the samples measured on this predictor's workload.

        A seeded random ``holdout`` fraction (at least one sample) is kept out of training
        and scored; the MLP is trained full-batch with Adam on the rest (MSE on the
        standardized log latency ratio). Standardization statistics come from the training part. ``reference_ms``
        becomes the median of the samples' ``latency_reference_ms``.

        Args:
            samples: dicts with ``arch`` (an :class:`Arch` or its dict), ``latency_ratio`` (> 0),
                ``latency_reference_ms`` (> 0) and ``workload`` (or, without one, optionally
                ``batch_size``/``beam_size``), as from :func:`collect_samples`.
            holdout: fraction in [0, 1) held out; 0 trains on all and reports training error.
            epochs: full-batch optimizer steps.

        Returns:
            ``rmse_ratio`` (root mean squared error of the ratio) and ``mape`` (mean absolute percentage
            error of the ratio, %) on the held-out samples, ``train_samples``, ``holdout_samples``.

        Raises:
            NasError: fewer than 2 samples on this workload (names the workloads present); a sample without an
                interleaved ``latency_ratio`` (timed before ratios were; names the fix).
            ValueError: a ratio or reference latency that is not positive and finite, or ``holdout`` outside
                [0, 1).
        """
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout={holdout} must be in [0, 1)")
        rows = [s for s in samples if self._measured_on_mine(s)]
        if len(rows) < 2:
            present = sorted({workload_tag(s["workload"]) if "workload" in s
                              else f"batch{s.get('batch_size')}-beam{s.get('beam_size')}" for s in samples})
            raise NasError(f"{len(rows)} samples on workload {workload_tag(self.workload)} (need >= 2); the "
                           f"samples were measured on {present}")
        for i, s in enumerate(rows):
            if "latency_ratio" not in s or "latency_reference_ms" not in s:
                raise NasError(f"samples[{i}] has no interleaved latency_ratio and latency_reference_ms: it was timed "
                               f"before ratios were measured against the reference; time the samples again "
                               f"(`nas latency fit`)")
            for key in ("latency_ratio", "latency_reference_ms"):
                if not (math.isfinite(s[key]) and s[key] > 0):
                    raise ValueError(f"samples[{i}].{key}={s[key]} must be positive and finite")
        archs = [_as_arch(s["arch"]) for s in rows]
        log_ms = torch.tensor([math.log(s["latency_ratio"]) for s in rows], dtype=torch.float64)  # [n] log ratio
        self.reference_ms = float(statistics.median(s["latency_reference_ms"] for s in rows))
        x_raw = torch.tensor([arch_features(a, self.model_dim) for a in archs], dtype=torch.float64)  # [n, F]
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(rows), generator=g)
        n_hold = max(1, round(holdout * len(rows))) if holdout > 0 else 0
        hold, train = order[:n_hold], order[n_hold:]
        self.feature_mean = x_raw[train].mean(0).float()
        std = x_raw[train].std(0) if len(train) > 1 else torch.zeros(x_raw.size(1), dtype=torch.float64)
        self.feature_std = torch.where(std > 1e-9, std, torch.ones_like(std)).float()  # constant feature: keep 0
        self.target_mean = float(log_ms[train].mean())
        self.target_std = float(log_ms[train].std()) if len(train) > 1 and float(log_ms[train].std()) > 1e-9 else 1.0
        x = ((x_raw - self.feature_mean.double()) / self.feature_std.double()).float()  # [n, F]
        y = ((log_ms - self.target_mean) / self.target_std).float()  # [n]
        self.feature_names = FEATURE_NAMES
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = _mlp(len(FEATURE_NAMES), self.hidden, self.hidden_layers)
        if self.hidden_layers == 0:
            self._fit_ridge(x[train].double(), y[train].double())
        else:
            self._fit_mlp(x[train], y[train], epochs, lr, weight_decay)
        self.net.eval()
        self.fitted = True
        scored = hold if n_hold else train
        with torch.no_grad():
            pred = self._ratio(self.net(x[scored]).squeeze(1))  # [m] ratios
        true = log_ms[scored].exp()
        self.metrics = {
            "rmse_ratio": float(((pred - true) ** 2).mean().sqrt()),
            "mape": float(((pred - true).abs() / true).mean() * 100.0),
            "train_samples": float(len(train)),
            "holdout_samples": float(n_hold),
        }
        return dict(self.metrics)

    @torch.no_grad()
    def _fit_ridge(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The linear model's weights: ridge regression of ``y [n]`` on ``x [n, F]`` (both standardized on these
        samples, so no intercept), ``(x^T x + ridge I) w = x^T y``."""
        gram = x.T @ x + self.ridge * torch.eye(x.size(1), dtype=x.dtype)
        w = torch.linalg.lstsq(gram, x.T @ y.unsqueeze(1)).solution  # [F, 1]; lstsq: ridge 0 with a singular gram
        layer = self.net[0]
        layer.weight.copy_(w.T.float())
        layer.bias.zero_()

    def _fit_mlp(self, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, weight_decay: float) -> None:
        """HAT's MLP: full-batch AdamW on the MSE of ``y [n]`` from ``x [n, F]``, cosine schedule."""
        opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(epochs, 1))
        self.net.train()
        with torch_threads(1):
            for _ in range(epochs):
                loss = nn.functional.mse_loss(self.net(x).squeeze(1), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()

    @torch.no_grad()
    def predict_ratio_many(self, archs: Sequence[Arch | Mapping[str, Any]]) -> list[float]:
        """Predicted ``latency_ratio`` of each arch to the reference arch on this predictor's workload: the figure a
        trial measures (:func:`nas.eval.latency.ratio.measure_latency_ratio`).

        Raises:
            RuntimeError: the predictor was neither fitted nor loaded.
        """
        if not self.fitted:
            raise RuntimeError("the latency predictor is not fitted; call fit() or LatencyPredictor.load()")
        if not archs:
            return []
        with torch_threads(1):
            return self._ratio(self.net(self._x([_as_arch(a) for a in archs])).squeeze(1)).tolist()

    def predict_ratio(self, arch: Arch | Mapping[str, Any]) -> float:
        """Predicted ``latency_ratio`` of one arch; see :meth:`predict_ratio_many`."""
        return self.predict_ratio_many([arch])[0]

    def predict_many(self, archs: Sequence[Arch | Mapping[str, Any]]) -> list[float]:
        """Predicted latency (ms) of each arch: its predicted ratio times ``reference_ms``.

        Raises:
            RuntimeError: the predictor was neither fitted nor loaded.
        """
        return [r * self.reference_ms for r in self.predict_ratio_many(archs)]

    def predict(self, arch: Arch | Mapping[str, Any]) -> float:
        """Predicted latency (ms) of one arch; see :meth:`predict_many`."""
        return self.predict_many([arch])[0]

    def _sidecar(self) -> dict[str, Any]:
        return {
            "format": PREDICTOR_FORMAT,
            "feature_names": list(self.feature_names),
            "feature_mean": self.feature_mean.tolist(),
            "feature_std": self.feature_std.tolist(),
            "target": "log_latency_ratio",
            "target_mean": self.target_mean,
            "target_std": self.target_std,
            "model_dim": self.model_dim,
            "hidden": self.hidden,
            "hidden_layers": self.hidden_layers,
            "ridge": self.ridge,
            "workload": dict(self.workload),
            "batch_size": self.batch_size,
            "beam_size": self.beam_size,
            "reference_ms": self.reference_ms,
            "reference_arch": self.reference_arch,
            "device": self.device,
            "metrics": self.metrics,
        }

    def save(self, path: str | Path) -> Path:
        """Write the weights to ``path`` (safetensors) and the rest to ``path`` with suffix ``.json``.

        Both files are written atomically (:mod:`nas.atomic`: a temporary sibling, fsync, ``os.replace``).
        Returns the weights' path.

        Raises:
            RuntimeError: the predictor was neither fitted nor loaded.
        """
        if not self.fitted:
            raise RuntimeError("the latency predictor is not fitted; nothing to save")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            save_file({k: v.detach().contiguous() for k, v in self.net.state_dict().items()}, str(tmp))
        atomic_write_text(path.with_suffix(".json"), json.dumps(self._sidecar(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LatencyPredictor":
        """Read a predictor written by :meth:`save` (``path`` and its ``.json`` sidecar).

        Raises:
            FileNotFoundError: either file is missing.
            PredictorFileError: (a :class:`NasError`) the sidecar is not a predictor's, it names no latency
                workload (fitted before the fixed workload), or it was fitted on other features than this
                version's :data:`FEATURE_NAMES` (refit with ``nas latency fit``). One fitted on the features before
                ``decoder.encoder_attention_sum`` loads, and refuses (NasError) to predict an arch whose decoder
                attends to more than the last encoder layer.
        """
        path = Path(path)
        meta = read_predictor_meta(path)  # format, feature names, workload, keys, weights header (torch-free)
        pred = cls(meta["model_dim"], hidden=meta["hidden"], hidden_layers=meta["hidden_layers"],
                   ridge=meta.get("ridge", 3.0), workload=meta["workload"], device=meta.get("device", ""), reference_ms=meta.get("reference_ms"),
                   reference_arch=meta.get("reference_arch"))
        pred.feature_names = tuple(meta["feature_names"])
        pred.net = _mlp(len(pred.feature_names), pred.hidden, pred.hidden_layers)
        pred.net.load_state_dict(load_file(str(path)))
        pred.net.eval()
        pred.feature_mean = torch.tensor(meta["feature_mean"], dtype=torch.float32)
        pred.feature_std = torch.tensor(meta["feature_std"], dtype=torch.float32)
        pred.target_mean, pred.target_std = float(meta["target_mean"]), float(meta["target_std"])
        pred.metrics = dict(meta.get("metrics", {}))
        pred.fitted = True
        return pred


def cross_validate(predictor: LatencyPredictor, samples: Sequence[Mapping[str, Any]], *, folds: int = 5,
                   seed: int = 0) -> dict[str, float]:
    """``folds``-fold cross-validated error of ``predictor``'s kind of fit on ``samples`` (those on its workload): each
    sample's ratio is predicted by a copy fitted (``holdout=0``) on the other folds, so every sample is scored once, by
    a fit that never saw it. The folds are a seeded shuffle dealt round-robin (fold ``i`` holds positions ``i,
    i + folds, ...``); fewer samples than ``folds`` gives leave-one-out. ``predictor`` itself is not changed.

    This is the error level 1's constraint check meets: a candidate's predicted ratio against what a trial measures
    (a fresh arch, timed once), measurement noise included. Level 1 guards the latency budget by it
    (``search.evolution.latency_margin``, :func:`nas.search.evolution.predicted_constraints`).

    Returns:
        ``cv_mape`` (mean of ``|predicted - measured| / measured``, %), ``cv_bias`` (mean signed relative error, %;
        positive: over-predicted), ``cv_rmse_rel`` (root mean square relative error, %) and ``cv_samples``; empty when
        fewer than 3 samples are on the workload (a fit needs 2).
    """
    rows = [s for s in samples if predictor._measured_on_mine(s)]
    if len(rows) < 3:
        return {}
    k = min(int(folds), len(rows))
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(rows), generator=g).tolist()
    rel = []
    for i in range(k):
        held = set(order[i::k])
        fold = LatencyPredictor(predictor.model_dim, hidden=predictor.hidden, hidden_layers=predictor.hidden_layers,
                                ridge=predictor.ridge, workload=predictor.workload)
        fold.fit([rows[j] for j in range(len(rows)) if j not in held], holdout=0.0, seed=seed)
        idx = sorted(held)
        pred = fold.predict_ratio_many([rows[j]["arch"] for j in idx])
        rel += [(q - rows[j]["latency_ratio"]) / rows[j]["latency_ratio"] for q, j in zip(pred, idx)]
    return {"cv_mape": 100.0 * statistics.fmean(abs(e) for e in rel), "cv_bias": 100.0 * statistics.fmean(rel),
            "cv_rmse_rel": 100.0 * math.sqrt(statistics.fmean(e * e for e in rel)), "cv_samples": float(len(rel))}


def fit_predictor_file(samples: Sequence[Mapping[str, Any]], spec: SweepSpec, path: str | Path, *,
                       seed: int = 0) -> dict[str, float]:
    """Fit a :class:`LatencyPredictor` on ``samples`` (from :func:`collect_fixed_samples`) for ``spec``'s workload,
    keep the reference sample's arch (the reference's latency is the median of every sample's interleaved timing of
    it), and save it to ``path`` (+ ``.json``): what ``nas latency fit``
    and the evolutionary search write.

    Two fits: the first holds out a seeded 20% of the samples and measures its error on them; the saved predictor is
    then fitted on every sample, so no timed sample is spent on the report alone. The held-out error is therefore
    that of a predictor fitted on fewer samples than the saved one (a conservative estimate: on three stored sample
    sets of 40, a ridge fit's error on unseen archs fell from 2.4-5.3% with 24 samples to 2.2-4.9% with 32,
    ``experiments/quickstart_schedule/README.md``).

    A third figure, :func:`cross_validate`'s 5-fold ``cv_mape`` (every sample predicted once by a fit without it;
    steadier than the one 20% split), sizes level 1's latency margin (``search.evolution.latency_margin: auto``).

    Returns:
        The held-out ``rmse_ratio`` and ``mape`` and ``holdout_samples`` of the first fit, its ``heldout_fit_samples``,
        ``train_samples``: the saved predictor's (every sample on the workload), and :func:`cross_validate`'s
        ``cv_mape``, ``cv_bias``, ``cv_rmse_rel`` and ``cv_samples`` (absent under 3 samples). All are saved in the
        sidecar's ``metrics``.

    Raises:
        NasError: no samples, or fewer than 2 on the workload.
    """
    if not samples:
        raise NasError("no latency samples to fit a predictor on")
    reference = next((s for s in samples if s.get("reference")), None)
    predictor = LatencyPredictor(int(samples[0].get("model_dim", spec.supernet.model_dim)),
                                 workload=workload_of(spec.search), device=str(samples[0].get("device", "")),
                                 reference_arch=None if reference is None else _as_arch(reference["arch"]).to_json())
    held_out = predictor.fit(samples, seed=seed)
    final = predictor.fit(samples, seed=seed, holdout=0.0)
    predictor.metrics = {"rmse_ratio": held_out["rmse_ratio"], "mape": held_out["mape"],
                         "holdout_samples": held_out["holdout_samples"],
                         "heldout_fit_samples": held_out["train_samples"], "train_samples": final["train_samples"],
                         **cross_validate(predictor, samples, seed=seed)}
    predictor.save(path)
    return dict(predictor.metrics)


def check_drift(predicted_ms: float, measured_ms: float, tolerance: float = 0.2, unit: str = "ms") -> str | None:
    """A warning when a prediction is more than ``tolerance`` (relative) off a fresh measurement.

    The error is ``|predicted - measured| / measured`` (milliseconds, or ratios with another ``unit``, the text
    after each figure); a predictor is only valid on the
    device, thread count and torch version it was fitted on, and HAT users report drifts
    above 20% after such changes.

    Returns:
        The warning text (both values, the error and what to do), or None within tolerance.

    Raises:
        ValueError: ``measured_ms`` not positive, ``predicted_ms`` negative or not finite,
            or ``tolerance`` negative.
    """
    if not (math.isfinite(measured_ms) and measured_ms > 0):
        raise ValueError(f"measured_ms={measured_ms} must be positive and finite")
    if not (math.isfinite(predicted_ms) and predicted_ms >= 0):
        raise ValueError(f"predicted_ms={predicted_ms} must be non-negative and finite")
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance} must be >= 0")
    error = abs(predicted_ms - measured_ms) / measured_ms
    if error <= tolerance:
        return None
    digits = 1 if unit == "ms" else 2
    return (f"latency predictor drift: predicted {predicted_ms:.{digits}f} {unit}, measured {measured_ms:.{digits}f} "
            f"{unit} "
            f"({error:.0%} off, tolerance {tolerance:.0%}); the predictor was fitted on another device, "
            f"thread count or torch version, or the space changed; refit with `nas latency fit` on this machine")
