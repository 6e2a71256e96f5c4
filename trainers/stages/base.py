"""The interface every training stage implements: :class:`Stage`, its input :class:`StepInfo` and output
:class:`StepOutput` (STYLE habit 7: composition and a ``Protocol``, no class tree)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol

import random

import torch

from nas.data import Batch
from nas.model.supernet import SuperTransformer
from nas.space import SweepSpec
from nas.space.arch import Arch
from nas.space.space import SearchSpace

if TYPE_CHECKING:
    from trainers.stage_plan import StagePosition

__all__ = ["Stage", "StepInfo", "StepOutput", "StageContext"]


@dataclass
class SandwichArchs:
    """The sub-Transformers of one sandwich step: the widest, the narrowest and ``k`` drawn from ``rng``.

    In a space with several layer layouts (sequential and Prime) the two ends take each layout in turn,
    step by step: with only the sequential ends a Prime layer would train only when a random draw picks
    it (about 1/6 of the forward passes with ``sandwich_k: 1`` in ``unified.yaml``), against every pass
    for the sequential weights. The sandwich rule (Yu & Huang 2019, sec. 3.2) trains the largest and the
    smallest sub-network every step; here every layout gets its own largest and smallest. The widest of a step
    (its teacher under in-place distillation) is therefore the largest of its layout, not always of the step:
    on a Prime step a random member with sequential layers and more paths or branches can be larger.

    Every draw is counted per (layer, dimension, value) in ``counts`` (the ends included); with ``balanced``
    the random members favour the least-counted values (:meth:`SearchSpace.sample_balanced`), so that values
    never at the ends train about as often as the others. ``counts`` is the loop's checkpointed state.
    """

    space: SearchSpace
    rng: random.Random
    """The loop's sampler RNG (checkpointed by the loop: a resumed run draws the same archs)."""
    k: int
    """Randomly sampled sub-Transformers per step (``train.sandwich_k``)."""
    balanced: bool = False
    """``train.balanced_sampling``: the random members balance the counts; False: uniform draws."""
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Optuna parameter name -> {value label: times drawn}, over every arch :meth:`draw` returned."""

    def __post_init__(self) -> None:
        self.ends = [(self.space.widest(layout), self.space.narrowest(layout)) for layout in self.space.layouts]
        self.widest, self.narrowest = self.ends[0]
        self._params: dict[Arch, int] = {}
        sizes = [self._size(a) for pair in self.ends for a in pair]
        self._lowest, self._highest = min(sizes), max(sizes)

    def draw(self, step: int = 0) -> list[Arch]:
        """``[widest, narrowest, k random]`` of optimizer step ``step`` (0-based): the ends in layout
        ``layouts[step % len(layouts)]`` (every layer), then ``k`` draws from ``rng`` (uniform, or balanced);
        all of them counted in :attr:`counts`."""
        widest, narrowest = self.ends[step % len(self.ends)]
        for arch in (widest, narrowest):
            self.space.count(arch, self.counts)
        if self.balanced:
            return [widest, narrowest] + [self.space.sample_balanced(self.rng, self.counts) for _ in range(self.k)]
        drawn = [self.space.sample(self.rng) for _ in range(self.k)]
        for arch in drawn:
            self.space.count(arch, self.counts)
        return [widest, narrowest] + drawn

    def share(self, arch: Arch) -> float:
        """``(params - params of the narrowest) / (params of the widest - params of the narrowest)`` in [0, 1],
        the ends taken over every layout (parameters of :meth:`SearchSpace.params`, without the word embedding:
        a constant every arch has, so including it changes no share); 1 when all ends have the same size."""
        if self._highest == self._lowest:
            return 1.0
        return min(max((self._size(arch) - self._lowest) / (self._highest - self._lowest), 0.0), 1.0)

    def _size(self, arch: Arch) -> int:
        if arch not in self._params:
            self._params[arch] = self.space.params(arch) if self.space.sizes is not None else 0
        return self._params[arch]


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

    @property
    def rates(self) -> "Callable[[Arch], float] | None":
        """Arch -> its ``train.dropout_range`` dropout, ``min + share * (max - min)`` with the arch's
        :meth:`SandwichArchs.share` of parameters; None without a range. Scalable Transformers sec. 4.1 scales
        dropout with the model width (0 for the narrowest up to 0.3); type-2 spaces choose widths per layer,
        so the share of parameters stands in for the width."""
        if self.spec.train.dropout_range is None:
            return None
        low, high = self.spec.train.dropout_range
        return lambda arch: low + self.archs.share(arch) * (high - low)


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
