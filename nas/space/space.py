"""The search space built from a :class:`SweepSpec`: widest, narrowest, random and Optuna archs."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from nas.space.arch import LAYOUTS, Arch, StackArch
from nas.space.spec import Dimension, SweepSpec

if TYPE_CHECKING:  # optuna stays out of the model/trainer import path
    import optuna

__all__ = ["SearchSpace"]

ORDER = ("layout", "units", "width", "ffn_width", "branches", "paths", "kernels", "unit_bias", "unit_dependency")
"""Per-layer choices in the order they are made (a condition refers to an earlier one)."""
INACTIVE = {"branches": 1, "paths": 1, "layout": "sequential", "kernels": (), "units": 1, "unit_bias": "identity",
            "unit_dependency": "independent"}
"""The value a conditional dimension takes where its ``when`` does not hold."""


STRING_DIMENSIONS = ("layout", "unit_bias", "unit_dependency")
"""Dimensions whose values are names (kept in the YAML's order)."""


def _label(value: Any) -> Any:
    """Optuna categoricals hold int/str: a kernel set ``(3, 15)`` becomes ``"3,15"`` (``"none"`` if empty)."""
    return (",".join(map(str, value)) or "none") if isinstance(value, tuple) else value


def _unlabel(name: str, value: Any) -> Any:
    if name.split(".")[1] == "kernels":
        return () if value == "none" else tuple(int(k) for k in str(value).split(","))
    return value if name.split(".")[1] in STRING_DIMENSIONS else int(value)


@dataclass(frozen=True)
class SearchSpace:
    """Choices per stack.

    ``layers[stack]`` are depth choices; ``dims[name]`` the values of each per-layer dimension
    (ints ascending, layouts in ``LAYOUTS`` order, kernel sets as tuples), ``per_layer[name]``
    whether each layer chooses on its own (else one value per stack) and ``when[name]`` an
    optional ``(dimension, value)`` condition. Optuna parameter names: ``encoder.layers``,
    ``encoder.width.3`` (per layer) or ``encoder.width`` (per stack).
    """

    layers: Mapping[str, tuple[int, ...]]
    dims: Mapping[str, tuple[Any, ...]]
    per_layer: Mapping[str, bool]
    when: Mapping[str, tuple[str, Any] | None]

    @classmethod
    def from_spec(cls, spec: SweepSpec) -> "SearchSpace":
        sn, sp = spec.supernet, spec.space
        defaults = {
            "width": Dimension(values=[sn.model_dim]),
            "ffn_width": Dimension(values=[sn.ffn_width or max(sp.ffn_width.values)]),
            "branches": Dimension(values=[sn.branches or 1]),
            "paths": Dimension(values=[sn.paths or 1]),
            "layout": Dimension(values=["sequential"]),
            "kernels": Dimension(values=[[]]),
            "units": Dimension(values=[sn.units or 1]),
            "unit_bias": Dimension(values=["identity"]),
            "unit_dependency": Dimension(values=["independent"]),
        }
        dims = {n: getattr(sp, n) or defaults[n] for n in ORDER}
        layers = {
            "encoder": tuple(sorted((sp.encoder_layers.values if sp.encoder_layers else [sn.encoder_layers]))),
            "decoder": tuple(sorted((sp.decoder_layers.values if sp.decoder_layers else [sn.decoder_layers]))),
        }
        values = {n: tuple(sorted(d.values)) for n, d in dims.items() if n not in (*STRING_DIMENSIONS, "kernels")}
        values["layout"] = tuple(v for v in LAYOUTS if v in dims["layout"].values)
        values["unit_bias"] = tuple(dims["unit_bias"].values)
        values["unit_dependency"] = tuple(dims["unit_dependency"].values)
        values["kernels"] = tuple(sorted((tuple(sorted(v)) for v in dims["kernels"].values), key=lambda k: (len(k), k)))
        return cls(layers=layers, dims=values, per_layer={n: d.per_layer for n, d in dims.items()},
                   when={n: next(iter(d.when.items())) if d.when else None for n, d in dims.items()})

    def supernet_maxima(self, spec: SweepSpec) -> Arch:
        """The supernet's per-layer maxima: its depth, model_dim-wide attention, widest FFN,
        most branches and paths, the layouts it supports and its kernel sizes."""
        sn = spec.supernet
        ffn = sn.ffn_width or max(self.dims["ffn_width"])
        branches = sn.branches or max(self.dims["branches"])
        paths = sn.paths or max(self.dims["paths"])
        layout = "+".join(self.dims["layout"])
        kernels = tuple(sorted(set(sn.kernels) | {k for ks in self.dims["kernels"] for k in ks}))
        units = sn.units or max(self.dims["units"])
        stack = lambda n: StackArch((sn.model_dim,) * n, (ffn,) * n, (branches,) * n, (paths,) * n, (layout,) * n,
                                    (kernels,) * n, (units,) * n)
        return Arch(stack(sn.encoder_layers), stack(sn.decoder_layers))

    def _active(self, name: str, layer: dict[str, Any]) -> bool:
        cond = self.when[name]
        if cond is None:
            return True
        allowed = cond[1] if isinstance(cond[1], list) else [cond[1]]
        return layer.get(cond[0]) in allowed

    def _uniform(self, choose) -> Arch:
        """Build an arch by calling ``choose(param_name, values)``; single-value choices are
        constants, and a conditional choice is asked for only where its condition holds."""
        pick = lambda name, values: values[0] if len(values) == 1 else choose(name, values)
        stacks = {}
        for stack in ("encoder", "decoder"):
            n = pick(f"{stack}.layers", self.layers[stack])
            shared: dict[str, Any] = {}
            rows = []
            for i in range(n):
                layer: dict[str, Any] = {}
                for name in ORDER:
                    if not self._active(name, layer):
                        layer[name] = INACTIVE[name]
                    elif self.per_layer[name]:
                        layer[name] = pick(f"{stack}.{name}.{i}", self.dims[name])
                    else:
                        if name not in shared:
                            shared[name] = pick(f"{stack}.{name}", self.dims[name])
                        layer[name] = shared[name]
                rows.append(layer)
            stacks[stack] = StackArch(**{name: tuple(r[name] for r in rows) for name in ORDER})
        return Arch(**stacks)

    def widest(self) -> Arch:
        """The largest sub-Transformer (sandwich rule's upper end): deepest, widest, most branches,
        paths and units; the first listed layout, bias and dependency (sequential layout when the
        space has it: Prime layers have one path)."""
        return self._uniform(lambda name, values: values[0] if name.split(".")[1] in STRING_DIMENSIONS else values[-1])

    def narrowest(self) -> Arch:
        """The smallest sub-Transformer of the space (the sandwich rule's lower end)."""
        return self._uniform(lambda _name, values: values[0])

    def sample(self, rng: random.Random) -> Arch:
        """A uniformly random sub-Transformer (each active choice independent)."""
        return self._uniform(lambda _name, values: rng.choice(values))

    def suggest(self, trial: "optuna.Trial") -> Arch:
        """Define-by-run: ask Optuna for each choice; per-layer choices exist only for the chosen
        depth, conditional ones only where their condition holds."""
        def ask(name, values):
            return _unlabel(name, trial.suggest_categorical(name, [_label(v) for v in values]))
        return self._uniform(ask)

    def from_params(self, params: Mapping[str, Any]) -> Arch:
        """Rebuild the arch from the flat parameters :meth:`suggest` produced.

        Raises:
            KeyError: a parameter is missing (names it).
        """
        def pick(name, _values):
            if name not in params:
                raise KeyError(f"parameter {name!r} missing from trial config {sorted(params)}")
            return _unlabel(name, params[name])
        return self._uniform(pick)

    def _layer_count(self) -> int:
        """Distinct choices of one layer from its per-layer dimensions (exact with conditions)."""
        per = [n for n in ORDER if self.per_layer[n]]
        referenced = sorted({self.when[n][0] for n in per if self.when[n]})
        total = 0
        for combo in itertools.product(*(self.dims[r] for r in referenced)):
            layer = dict(zip(referenced, combo))
            count = 1
            for name in per:
                if name not in referenced and self._active(name, layer):
                    count *= len(self.dims[name])
            total += count
        return total

    def size(self) -> int:
        """Number of sub-Transformers in the space (per-stack conditional choices counted as if active)."""
        total = 1
        per_layer = self._layer_count()
        per_stack = math.prod(len(self.dims[n]) for n in ORDER if not self.per_layer[n])
        for stack in ("encoder", "decoder"):
            total *= sum(per_stack * per_layer ** n for n in self.layers[stack])
        return total

    def describe(self) -> list[tuple[str, str, str]]:
        """(dimension, choices, scope) rows for ``nas space show``."""
        rows = [(f"{s}.layers", str(list(self.layers[s])), "per stack") for s in ("encoder", "decoder")]
        for name in ORDER:
            cond = f", when {self.when[name][0]}={self.when[name][1]}" if self.when[name] else ""
            values = [list(v) if isinstance(v, tuple) else v for v in self.dims[name]]
            rows.append((name, str(values), ("per layer" if self.per_layer[name] else "per stack") + cond))
        return rows


def format_count(n: int) -> str:
    """``1234`` -> ``1,234``; large counts as a power of ten (``~3.2e+12``)."""
    return f"{n:,}" if n < 10 ** 7 else f"~{n:.1e} (10^{math.log10(n):.1f})"
