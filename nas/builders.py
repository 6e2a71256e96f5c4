"""Builders: a validated spec in, the pieces a recipe needs out (torchtune's ``_model_builders``).

The one place that reads a :class:`~nas.space.SweepSpec` to build

- the supernet (:func:`supernet_config`, :func:`build_supernet`),
- the tokenized corpus (:func:`prepare_sweep_data`),
- the search space (:func:`build_space`),
- the Optuna sampler (:func:`build_sampler`).

The recipes (``trainers/``, ``nas/search/``, the CLI, the benchmarks) call these and never construct
the pieces by hand. Importing this module loads torch (the model) but no Ray, Optuna or MLflow:
Optuna is imported inside :func:`build_sampler` only, so ``nas train``, ``nas latency fit`` and
``nas fidelity`` can build a model or read data without the search stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nas.data import EncodersFactory, PreparedData, prepare_data
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch
from nas.space.space import SearchSpace
from nas.space import SearchSpec, SweepSpec

if TYPE_CHECKING:
    import optuna

__all__ = ["supernet_config", "build_supernet", "prepare_sweep_data", "build_space", "build_sampler",
           "relative_positions", "RELATIVE_DEFAULT"]


def build_space(spec: SweepSpec) -> SearchSpace:
    """The sweep's search space (``space`` section, bounded by ``supernet``)."""
    return SearchSpace.from_spec(spec)


def supernet_config(spec: SweepSpec, vocab_size: int) -> dict[str, Any]:
    """The sweep's supernet constructor arguments, JSON-ready (what ``SuperTransformer.config()`` returns).

    The maxima are the space's (``SearchSpace.supernet_maxima``), so the supernet's size is the product
    of the YAML's maxima (DESIGN: "the unified layer").
    """
    sn = spec.supernet
    maxima = build_space(spec).supernet_maxima(spec)
    return dict(vocab_size=vocab_size, model_dim=sn.model_dim, heads=sn.heads, head_dim=sn.head_width,
                max_arch=maxima.to_dict(),
                dropout=sn.dropout, attention_dropout=sn.attention_dropout, drop_branch=spec.drop_branch,
                max_positions=sn.max_positions, pad_id=0, more_features=sn.more_features,
                unit_bias_rate=spec.train.unit_bias_rate, io_projection=spec.io_projection,
                relative_positions=relative_positions(spec, maxima))


RELATIVE_DEFAULT = 16
"""Shaw et al.'s clipping distance k used when the supernet has MUTE units and ``supernet.relative_positions``
is not set (their ablation finds no gain beyond k >= 2; 16 covers most of a Multi30k sentence)."""


def relative_positions(spec: SweepSpec, maxima: Arch) -> int:
    """``supernet.relative_positions``, else :data:`RELATIVE_DEFAULT` when an encoder layer has MUTE units, else 0."""
    if spec.supernet.relative_positions is not None:
        return spec.supernet.relative_positions
    return RELATIVE_DEFAULT if max(maxima.encoder.units) > 1 else 0


def build_supernet(spec: SweepSpec, vocab_size: int) -> SuperTransformer:
    """The supernet of a sweep (freshly initialised): maxima from ``spec.supernet`` and the space."""
    return SuperTransformer.from_config(supernet_config(spec, vocab_size))


def prepare_sweep_data(spec: SweepSpec, progress: bool = True,
                       encoders: EncodersFactory | None = None) -> PreparedData:
    """Tokenize the sweep's corpus (cached by content hash under ``data.cache_dir``); ``encoders``: where the
    shards are encoded (default: this machine's cores; :func:`nas.data.prepare_data`).

    Raises:
        DataError: a data file is missing, unreadable or misaligned (names it).
    """
    d = spec.data
    return prepare_data(d.train.src, d.train.tgt, d.valid.src, d.valid.tgt, d.tokenizer.vocab_size,
                        Path(d.cache_dir).resolve(),  # absolute: Ray trials run in their own folders
                        max_train_pairs=d.max_train_pairs, max_valid_pairs=d.max_valid_pairs, max_len=d.max_len,
                        seed=spec.train.seed, progress=progress, encoders=encoders)


def build_sampler(search: SearchSpec, seed_offset: int = 0) -> "optuna.samplers.BaseSampler":
    """The Optuna sampler named by ``search.method`` (TPE is multivariate and multi-objective in Optuna 5).

    ``seed_offset`` (the number of trials already in the study when a driver resumes it) shifts the seed,
    so that a resumed random or TPE start-up phase does not draw the first trials' archs again.
    """
    import optuna  # here, not at the top: building a model or data must not load the search stack

    seed = None if search.seed is None else search.seed + seed_offset
    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed),
        "gp": lambda: optuna.samplers.GPSampler(seed=seed),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }
    return samplers[search.method]()
