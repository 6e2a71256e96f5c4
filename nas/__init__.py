"""nas: neural architecture search for sequence-to-sequence Transformers (machine translation).

One weight-sharing supernet is trained; sub-Transformers are cropped from it and searched by
Optuna through Ray Tune, tracked in MLflow. The public API (lazily loaded, PEP 562, so that
``import nas`` loads no torch, Ray, Optuna or MLflow)::

    import nas
    spec = nas.load_spec("search_spaces/quickstart.yaml")
    nas.sweep("search_spaces/quickstart.yaml", overrides={"search.trials": 4})
    nas.leaderboard(top=5)                       # a pandas DataFrame, best first
    done = nas.retrain(spec, best=True)          # the best trial, trained alone with the retrain: recipe
    nas.export("exported/", run_id=done.run_id)  # also nas.export("exported/", best=True)
    nas.translate("exported/", ["A man is riding a bike ."])
    nas.train(spec)                              # the supernet alone

The packages, bottom layer first (each imports only from the layers before it; the test
``tests/test_architecture.py`` checks this):

- ``errors``, ``io``, ``faults``: bad-input errors, atomic writes, test-only fault points;
- ``space``: the YAML schema and loader, the constraint language, ``Arch``, the search space;
- ``data``: SentencePiece, Parquet, token-bucketed batches;
- ``model``: the supernet's layers, the supernet, ``extract``, decoding; ``precision``;
- ``eval``: scores (BLEU, chrF, loss), latency measurement and the latency predictor;
- ``builders``: spec -> supernet, prepared data, search space, sampler;
- ``trainers`` (top-level package): the one training loop and its stages;
- ``tracking``: MLflow runs, leaderboard queries, Pareto fronts and their plot, result files;
- ``search``: Ray Tune + Optuna orchestration, ranking fidelity (``search.fidelity``); ``preflight``;
- ``export``, ``report``: export folders, ONNX, MLflow models; sweep reports;
- ``cli``, ``api``: the ``nas`` command and this API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nas.lazy import lazy_exports

if TYPE_CHECKING:
    from nas import export
    from nas.api import leaderboard, load_export, load_spec, retrain, sweep, train, translate
    from nas.errors import NasError

__all__ = ["load_spec", "sweep", "train", "retrain", "leaderboard", "export", "load_export", "translate", "NasError"]

_HOMES = {"load_spec": "api", "sweep": "api", "train": "api", "retrain": "api", "leaderboard": "api",
          "load_export": "api", "translate": "api", "NasError": "errors"}

_lazy_getattr, __dir__ = lazy_exports(globals(), _HOMES)


def __getattr__(name: str) -> Any:
    if name == "export":  # the package, callable: nas.export(out_dir, ...) is nas.export.trial.export_trial
        return importlib.import_module("nas.export")
    return _lazy_getattr(name)
