"""The interface every training stage implements: :class:`Stage`, its input :class:`StepInfo` and output
:class:`StepOutput` (STYLE habit 7: composition and a ``Protocol``, no class tree)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import random

import torch

from nas.data import Batch
from nas.model.supernet import SuperTransformer
from nas.space import SweepSpec
from nas.space.arch import Arch
from nas.space.space import SearchSpace

if TYPE_CHECKING:
    from trainers.distill import StagePosition

__all__ = ["Stage", "StepInfo", "StepOutput", "StageContext"]


@dataclass
class SandwichArchs:
    """The sub-Transformers of one sandwich step: the widest, the narrowest and ``k`` drawn from ``rng``.

    In a space with several layer layouts (sequential and Prime) the two ends take each layout in turn,
    step by step: with only the sequential ends a Prime layer would train only when a random draw picks
    it (about 1/6 of the forward passes with ``sandwich_k: 1`` in ``unified.yaml``), against every pass
    for the sequential weights. The sandwich rule (Yu & Huang 2019, sec. 3.2) trains the largest and the
    smallest sub-network every step; here every layout gets its own largest and smallest.
    """

    space: SearchSpace
    rng: random.Random
    """The loop's sampler RNG (checkpointed by the loop: a resumed run draws the same archs)."""
    k: int
    """Randomly sampled sub-Transformers per step (``train.sandwich_k``)."""

    def __post_init__(self) -> None:
        self.ends = [(self.space.widest(layout), self.space.narrowest(layout)) for layout in self.space.layouts]
        self.widest, self.narrowest = self.ends[0]

    def draw(self, step: int = 0) -> list[Arch]:
        """``[widest, narrowest, k random]`` of optimizer step ``step`` (0-based): the ends in layout
        ``layouts[step % len(layouts)]`` (every layer), then ``k`` draws from ``rng``."""
        widest, narrowest = self.ends[step % len(self.ends)]
        return [widest, narrowest] + [self.space.sample(self.rng) for _ in range(self.k)]


@dataclass(frozen=True)
class StageContext:
    """What a supernet stage is built from (:data:`trainers.stages.STAGES`)."""

    spec: SweepSpec
    """The sweep (``train.*`` losses and regularisation, ``supernet.model_dim``)."""
    archs: SandwichArchs
    """Draws each step's sub-Transformers."""
    autocast: AbstractContextManager
    """The training precision's autocast context (re-entered for every forward)."""
    penalty: bool = True
    """Add MUTE's eq. 20 AutoShuffle penalty (only data-parallel rank 0 does, once per step)."""


@dataclass(frozen=True)
class StepInfo:
    """Where an optimizer step is."""

    step: int
    """Optimizer steps already done (0-based index of this step)."""
    ntokens: int
    """Target tokens of the whole step (all accumulated batches, all data-parallel ranks): the loss divisor."""
    position: StagePosition | None = None
    """Where the step falls in ``train.stages`` (None outside a stage plan: standalone training)."""


@dataclass(frozen=True)
class StepOutput:
    """Per-token losses of one step (nats), each summed over the batches of the step and divided by
    :attr:`StepInfo.ntokens`; label-smoothed cross-entropy against the step's targets except ``distill``.
    Each is a float or a 0-dim tensor on the training device (no host synchronisation until it is read)."""

    widest: float | torch.Tensor = 0.0
    """The first sub-Transformer's (the widest's; in standalone training the only one's) label-smoothed loss."""
    nll: float | torch.Tensor = 0.0
    """The first sub-Transformer's unsmoothed negative log-likelihood."""
    narrowest: float | torch.Tensor = 0.0
    """The second sub-Transformer's (the narrowest's) loss."""
    sampled: float | torch.Tensor = 0.0
    """Sum over the randomly sampled sub-Transformers' losses."""
    distill: float | torch.Tensor = 0.0
    """Sum over the students of the cross-entropy against the widest's word distribution (Scalable
    Transformers sec. 3.3); 0 in a stage without distillation."""

    def to_dict(self) -> dict[str, float | torch.Tensor]:
        """The five losses by field name (what the data-parallel all-reduce sums)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict: it deep-copies tensors


class Stage(Protocol):
    """One kind of training step: forward and backward of one optimizer step's sub-Transformers.

    ``step`` leaves the gradients of the step in ``model`` (the loop has zeroed them before and
    all-reduces, clips and steps after); it does not touch the optimizer. Implementations:
    :mod:`trainers.stages.joint`, :mod:`~trainers.stages.word_distill`, :mod:`~trainers.stages.seq_distill`
    and :mod:`~trainers.stages.standalone`; :data:`trainers.stages.STAGES` maps ``train.stages[*].name`` to them.
    """

    def step(self, model: SuperTransformer, batches: Sequence[Batch], step: StepInfo) -> StepOutput:
        """Accumulate one optimizer step's gradients from ``batches`` (each ``src [b, s]``, ``tgt_in``/``tgt_out
        [b, t]`` token ids) into ``model``; returns the step's per-token losses."""
        ...
