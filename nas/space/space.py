"""The search space built from a :class:`SweepSpec`: widest, narrowest, random and Optuna archs."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from nas.space.arch import DIMENSIONS, Arch, StackArch
from nas.space.spec import Dimension, SweepSpec

if TYPE_CHECKING:  # optuna stays out of the model/trainer import path
    import optuna

__all__ = ["SearchSpace"]

_LAYER_DIMS = DIMENSIONS


@dataclass(frozen=True)
class SearchSpace:
    """Choices per stack; every value list is sorted ascending.

    ``layers[stack]`` are depth choices; ``dims[stack][name]`` the per-layer choices and
    ``per_layer[name]`` whether each layer chooses on its own (else one value per stack).
    Optuna parameter names: ``encoder.layers``, ``encoder.width.3`` (per layer) or
    ``encoder.width`` (per stack).
    """

    layers: Mapping[str, tuple[int, ...]]
    dims: Mapping[str, tuple[int, ...]]
    per_layer: Mapping[str, bool]

    @classmethod
    def from_spec(cls, spec: SweepSpec) -> "SearchSpace":
        sn, sp = spec.supernet, spec.space
        defaults = {
            "width": Dimension(values=[sn.model_dim]),
            "ffn_width": Dimension(values=[sn.ffn_width or max(sp.ffn_width.values)]),
            "branches": Dimension(values=[sn.branches or 1]),
            "paths": Dimension(values=[sn.paths or 1]),
        }
        dims = {n: getattr(sp, n) or defaults[n] for n in _LAYER_DIMS}
        layers = {
            "encoder": tuple(sorted((sp.encoder_layers.values if sp.encoder_layers else [sn.encoder_layers]))),
            "decoder": tuple(sorted((sp.decoder_layers.values if sp.decoder_layers else [sn.decoder_layers]))),
        }
        return cls(layers=layers, dims={n: tuple(sorted(d.values)) for n, d in dims.items()},
                   per_layer={n: d.per_layer for n, d in dims.items()})

    def supernet_maxima(self, spec: SweepSpec) -> Arch:
        """The supernet's per-layer maxima: its depth, model_dim-wide attention, widest FFN, most branches and paths."""
        sn = spec.supernet
        ffn = sn.ffn_width or max(self.dims["ffn_width"])
        branches = sn.branches or max(self.dims["branches"])
        paths = sn.paths or max(self.dims["paths"])
        stack = lambda n: StackArch((sn.model_dim,) * n, (ffn,) * n, (branches,) * n, (paths,) * n)
        return Arch(stack(sn.encoder_layers), stack(sn.decoder_layers))

    def _uniform(self, choose) -> Arch:
        """Build an arch by calling ``choose(param_name, values)``; single-value choices are constants."""
        pick = lambda name, values: values[0] if len(values) == 1 else choose(name, values)
        stacks = {}
        for stack in ("encoder", "decoder"):
            n = pick(f"{stack}.layers", self.layers[stack])
            values = {}
            for name in _LAYER_DIMS:
                if self.per_layer[name]:
                    values[name] = tuple(pick(f"{stack}.{name}.{i}", self.dims[name]) for i in range(n))
                else:
                    values[name] = (pick(f"{stack}.{name}", self.dims[name]),) * n
            stacks[stack] = StackArch(**values)
        return Arch(**stacks)

    def widest(self) -> Arch:
        """The largest sub-Transformer of the space (deepest, widest, most branches and paths)."""
        return self._uniform(lambda _name, values: values[-1])

    def narrowest(self) -> Arch:
        """The smallest sub-Transformer of the space (the sandwich rule's lower end)."""
        return self._uniform(lambda _name, values: values[0])

    def sample(self, rng: random.Random) -> Arch:
        """A uniformly random sub-Transformer (each choice independent)."""
        return self._uniform(lambda _name, values: rng.choice(values))

    def suggest(self, trial: "optuna.Trial") -> Arch:
        """Define-by-run: ask Optuna for each choice; per-layer choices exist only for the chosen depth."""
        return self._uniform(lambda name, values: trial.suggest_categorical(name, list(values)))

    def from_params(self, params: Mapping[str, Any]) -> Arch:
        """Rebuild the arch from the flat parameters :meth:`suggest` produced.

        Raises:
            KeyError: a parameter is missing (names it).
        """
        def pick(name, _values):
            if name not in params:
                raise KeyError(f"parameter {name!r} missing from trial config {sorted(params)}")
            return int(params[name])
        return self._uniform(pick)

    def size(self) -> int:
        """Number of distinct sub-Transformers in the space."""
        total = 1
        for stack in ("encoder", "decoder"):
            count = 0
            for n in self.layers[stack]:
                per_depth = 1
                for name in _LAYER_DIMS:
                    per_depth *= len(self.dims[name]) ** (n if self.per_layer[name] else 1)
                count += per_depth
            total *= count
        return total

    def describe(self) -> list[tuple[str, str, str]]:
        """(dimension, choices, scope) rows for ``nas space show``."""
        rows = [(f"{s}.layers", str(list(self.layers[s])), "per stack") for s in ("encoder", "decoder")]
        for name in _LAYER_DIMS:
            rows.append((name, str(list(self.dims[name])), "per layer" if self.per_layer[name] else "per stack"))
        return rows


def format_count(n: int) -> str:
    """``1234`` -> ``1,234``; large counts as a power of ten (``~3.2e+12``)."""
    return f"{n:,}" if n < 10 ** 7 else f"~{n:.1e} (10^{math.log10(n):.1f})"
