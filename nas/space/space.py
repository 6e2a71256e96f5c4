"""The search space built from a :class:`SweepSpec`: widest, narrowest, random and Optuna archs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from nas.space.arch import LAYOUTS, Arch, StackArch
from nas.space.params import ModelSizes, arch_params
from nas.space.schema import ArchPoint, Dimension, SweepSpec
from nas.space.schema.space import DECODER_ONLY, STACKS, dimension_stacks

if TYPE_CHECKING:  # optuna stays out of the model/trainer import path
    import optuna

__all__ = ["SearchSpace"]

ORDER = ("layout", "units", "width", "ffn_width", "branches", "paths", "kernels", "unit_bias", "unit_dependency",
         "encoder_attention")
"""Per-layer choices in the order they are made (a condition refers to an earlier one)."""
INACTIVE = {"branches": 1, "paths": 1, "layout": "sequential", "kernels": (), "units": 1, "unit_bias": "identity",
            "unit_dependency": "independent", "encoder_attention": 1}
"""The value a conditional dimension takes where its ``when`` does not hold, and in a stack that does not choose it
(``space.<name>.stacks``; the widths there: :attr:`SearchSpace.excluded`). :data:`DECODER_ONLY` (from the schema)
names the dimensions only decoder layers choose, whatever their ``stacks``."""


STRING_DIMENSIONS = ("layout", "unit_bias", "unit_dependency")
"""Dimensions whose values are names (kept in the YAML's order)."""


def _label(value: Any) -> Any:
    """Optuna categoricals hold int/str: a kernel set ``(3, 15)`` becomes ``"3,15"`` (``"none"`` if empty)."""
    return (",".join(map(str, value)) or "none") if isinstance(value, tuple) else value


def param_label(value: Any) -> Any:
    """The Optuna label of a choice's value (:meth:`SearchSpace.suggest`): kernel sets as ``"3,15"`` (``"none"``
    when empty), other values as they are."""
    return _label(value)


def _point_value(value: Any, labels: Sequence[Any]) -> Any:
    """A ``points_to_evaluate`` value as its label: YAML reads a one-kernel set ``3`` as an int, whose label is
    the string ``"3"``."""
    return str(value) if isinstance(value, int) and value not in labels and str(value) in labels else value


def _dimension(name: str) -> str:
    """The dimension of an Optuna parameter name: ``encoder.width.3`` -> ``width``, ``model_width`` -> itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _unlabel(name: str, value: Any) -> Any:
    if _dimension(name) == "kernels":
        return () if value == "none" else tuple(int(k) for k in str(value).split(","))
    return value if _dimension(name) in STRING_DIMENSIONS else int(value)


@dataclass(frozen=True)
class SearchSpace:
    """Choices per stack.

    ``layers[stack]`` are depth choices; ``dims[name]`` the values of each per-layer dimension
    (ints ascending, layouts in ``LAYOUTS`` order, kernel sets as tuples), ``per_layer[name]``
    whether each layer chooses on its own (else one value per stack) and ``when[name]`` an
    optional ``(dimension, value)`` condition. Optuna parameter names: ``encoder.layers``,
    ``encoder.width.3`` (per layer) or ``encoder.width`` (per stack).

    ``model_widths`` are the type-1 model widths C (Scalable Transformers sec. 3.2; Optuna
    parameter ``model_width``, chosen first), ``(None,)`` when the space keeps the supernet's;
    ``tie[name] = scale`` makes a dimension ``scale * C`` in every layer instead of a choice.

    ``sizes`` are the supernet's fixed sizes (:class:`~nas.space.params.ModelSizes`) that parameter counts
    (:meth:`params`, :meth:`middle`) need; :meth:`from_spec` sets them.

    ``stacks[name]`` are the stacks whose layers choose dimension ``name`` (``space.<name>.stacks``); a name not
    listed is chosen in both, except the decoder-only ``encoder_attention`` (:meth:`chosen_in`). In the other
    stack every layer takes ``excluded[name]``, else :data:`INACTIVE`'s value (:meth:`excluded_value`), and
    Optuna has no parameter ``<stack>.<name>...`` there.
    """

    layers: Mapping[str, tuple[int, ...]]
    dims: Mapping[str, tuple[Any, ...]]
    per_layer: Mapping[str, bool]
    when: Mapping[str, tuple[str, Any] | None]
    model_widths: tuple[int | None, ...] = (None,)
    tie: Mapping[str, int] = field(default_factory=dict)
    sizes: ModelSizes | None = None
    stacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    excluded: Mapping[str, Any] = field(default_factory=dict)

    MIDDLE_EXHAUSTIVE = 4096
    """Spaces of at most this many archs (:meth:`size`) are searched exhaustively by :meth:`middle`."""
    MIDDLE_SAMPLES = 1024
    """Random archs :meth:`middle` draws as candidates (besides the uniform ones)."""
    MIDDLE_UNIFORM = 4096
    """The most uniform archs (one value per dimension in every layer) :meth:`middle` enumerates; a space with
    more draws this many of them at random."""

    @classmethod
    def from_spec(cls, spec: SweepSpec) -> "SearchSpace":
        sn, sp = spec.supernet, spec.space
        model_widths = tuple(sorted(sp.model_width.values)) if sp.model_width else (None,)
        tie = {n: getattr(sp, n).scale for n in ("width", "ffn_width") if getattr(sp, n) and getattr(sp, n).tie}
        tied = {n: Dimension(values=[c * scale for c in model_widths]) for n, scale in tie.items()}
        defaults = {
            "width": Dimension(values=[sn.model_dim]),
            "ffn_width": Dimension(values=[sn.ffn_width or max(sp.ffn_width.values)] if "ffn_width" not in tie else [1]),
            "branches": Dimension(values=[sn.branches or 1]),
            "paths": Dimension(values=[sn.paths or 1]),
            "layout": Dimension(values=["sequential"]),
            "kernels": Dimension(values=[[]]),
            "units": Dimension(values=[sn.units or 1]),
            "unit_bias": _unit_bias(spec),
            "unit_dependency": Dimension(values=["independent"]),
            "encoder_attention": Dimension(values=[1]),
        }
        dims = {n: tied.get(n) or getattr(sp, n) or defaults[n] for n in ORDER}
        layers = {
            "encoder": tuple(sorted((sp.encoder_layers.values if sp.encoder_layers else [sn.encoder_layers]))),
            "decoder": tuple(sorted((sp.decoder_layers.values if sp.decoder_layers else [sn.decoder_layers]))),
        }
        values = {n: tuple(sorted(d.values)) for n, d in dims.items() if n not in (*STRING_DIMENSIONS, "kernels")}
        values["layout"] = tuple(v for v in LAYOUTS if v in dims["layout"].values)
        values["unit_bias"] = tuple(dims["unit_bias"].values)
        values["unit_dependency"] = tuple(dims["unit_dependency"].values)
        values["kernels"] = tuple(sorted((tuple(sorted(v)) for v in dims["kernels"].values), key=lambda k: (len(k), k)))
        stacks = {n: dimension_stacks(n, getattr(sp, n, None)) for n in ORDER}
        excluded = {"width": sn.model_dim, "ffn_width": defaults["ffn_width"].values[0]}
        space = cls(layers=layers, dims=values, per_layer={n: d.per_layer for n, d in dims.items()},
                    when={n: next(iter(d.when.items())) if d.when else None for n, d in dims.items()},
                    model_widths=model_widths, tie=tie,
                    stacks={n: s for n, s in stacks.items() if s != STACKS}, excluded=excluded)
        return dataclasses.replace(space, sizes=ModelSizes.from_spec(spec, space.supernet_maxima(spec)))

    def supernet_maxima(self, spec: SweepSpec) -> Arch:
        """The supernet's per-layer maxima: its depth, model_dim-wide attention, widest FFN,
        most branches and paths, the layouts it supports and its kernel sizes; in the decoder the most encoder
        layers attended (no parameters: the bound :meth:`Arch.check_within` holds sub-Transformers to). A stack
        that does not choose a dimension (:attr:`stacks`) holds only its fixed value: with ``branches: {stacks:
        [encoder]}`` the decoder's layers have one branch, whatever ``supernet.branches`` says."""
        sn = spec.supernet
        top = {"width": sn.model_dim, "ffn_width": sn.ffn_width or max(self.dims["ffn_width"]),
               "branches": sn.branches or max(self.dims["branches"]), "paths": sn.paths or max(self.dims["paths"]),
               "layout": "+".join(self.dims["layout"]),
               "kernels": tuple(sorted(set(sn.kernels) | {k for ks in self.dims["kernels"] for k in ks})),
               "units": sn.units or max(self.dims["units"]), "encoder_attention": max(self.dims["encoder_attention"])}

        def stack(name: str, n: int) -> StackArch:
            layer = {d: top[d] if self.chosen_in(name, d) else self.excluded_value(d) for d in top}
            if "prime" not in layer["layout"].split("+"):  # kernels only in Prime layers
                layer["kernels"] = ()
            return StackArch(**{d: (v,) * n for d, v in layer.items()})

        return Arch(stack("encoder", sn.encoder_layers), stack("decoder", sn.decoder_layers))

    def chosen_in(self, stack: str, name: str) -> bool:
        """Whether the layers of ``stack`` (``encoder`` or ``decoder``) choose dimension ``name``
        (``space.<name>.stacks``; ``encoder_attention``: the decoder only)."""
        return stack in self.stacks.get(name, ("decoder",) if name in DECODER_ONLY else STACKS)

    def excluded_value(self, name: str) -> Any:
        """The value every layer of a stack that does not choose dimension ``name`` takes: :data:`INACTIVE`'s (one
        branch, sequential, no kernels, ...), for the widths the supernet's (``supernet.model_dim``,
        ``supernet.ffn_width``)."""
        return self.excluded[name] if name in self.excluded else INACTIVE[name]

    def _stack_values(self, stack: str, name: str) -> tuple[Any, ...]:
        """The values layers of ``stack`` can take for ``name``: its choices, or the one excluded value."""
        return self.dims[name] if self.chosen_in(stack, name) else (self.excluded_value(name),)

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
        model_width = pick("model_width", self.model_widths)
        stacks = {}
        for stack in ("encoder", "decoder"):
            n = pick(f"{stack}.layers", self.layers[stack])
            shared: dict[str, Any] = {}
            rows = []
            for i in range(n):
                layer: dict[str, Any] = {}
                for name in ORDER:
                    if name in self.tie:
                        layer[name] = model_width * self.tie[name]
                    elif not self.chosen_in(stack, name):
                        layer[name] = self.excluded_value(name)
                    elif not self._active(name, layer):
                        layer[name] = INACTIVE[name]
                    elif self.per_layer[name]:
                        layer[name] = pick(f"{stack}.{name}.{i}", self.dims[name])
                    else:
                        if name not in shared:
                            shared[name] = pick(f"{stack}.{name}", self.dims[name])
                        layer[name] = shared[name]
                rows.append(layer)
            stacks[stack] = StackArch(**{name: tuple(r[name] for r in rows) for name in ORDER})
        return Arch(**stacks, model_width=model_width)

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layer layouts the space chooses from (``sequential`` first when it has it)."""
        return self.dims["layout"]

    def widest(self, layout: str | None = None) -> Arch:
        """The largest sub-Transformer (sandwich rule's upper end): deepest, widest, most branches,
        paths and units; the first listed bias and dependency, and every layer in ``layout`` (default:
        the first of :attr:`layouts`, sequential when the space has it: Prime layers have one path).

        Raises:
            ValueError: ``layout`` is not one of :attr:`layouts`.
        """
        first = self._first(layout)
        return self._uniform(lambda name, values: first(name, values) if _dimension(name) in STRING_DIMENSIONS
                             else values[-1])

    def narrowest(self, layout: str | None = None) -> Arch:
        """The smallest sub-Transformer of the space (the sandwich rule's lower end), every layer in
        ``layout`` (default: the first of :attr:`layouts`). Raises ValueError as :meth:`widest`."""
        first = self._first(layout)
        return self._uniform(lambda name, values: first(name, values) if _dimension(name) in STRING_DIMENSIONS
                             else values[0])

    def _first(self, layout: str | None):
        """The choice of a name-valued dimension for :meth:`widest`/:meth:`narrowest`: ``layout`` for the
        layout, else the first listed value."""
        if layout is not None and layout not in self.layouts:
            raise ValueError(f"layout {layout!r} is not in the space; it has {', '.join(self.layouts)}")
        return lambda name, values: layout if layout is not None and _dimension(name) == "layout" else values[0]

    def params(self, arch: Arch) -> int:
        """Parameters of ``arch``'s standalone model without the word embedding (the same in every arch of the
        space): :func:`nas.space.params.arch_params` with :attr:`sizes`.

        Raises:
            ValueError: the space has no :attr:`sizes` (built without :meth:`from_spec`).
        """
        if self.sizes is None:
            raise ValueError("this SearchSpace has no supernet sizes to count parameters with; "
                             "build it with SearchSpace.from_spec(spec)")
        return arch_params(arch, self.sizes)

    def middle(self) -> Arch:
        """The reference sub-Transformer between the two ends: the one whose parameter count is nearest the mean
        of :meth:`narrowest`'s and :meth:`widest`'s (the word embedding, equal in all, left out), every
        name-valued choice at its first value as at the two ends.

        A space of at most :attr:`MIDDLE_EXHAUSTIVE` archs is enumerated. A larger one is searched (the
        quickstart's has 331,776 archs): the candidates are the uniform archs (every numeric dimension at one of
        its values in every layer, each depth and model width; all of them up to :attr:`MIDDLE_UNIFORM`, else
        that many drawn at random) and :attr:`MIDDLE_SAMPLES` random archs, drawn with fixed seeds. Ties go to
        the smallest ``arch_id``, so every call and every process gets the same arch. Where every dimension has
        two values, the old "middle value of every choice" was the widest; this one is not.

        Raises:
            ValueError: the space has no :attr:`sizes` (built without :meth:`from_spec`).
        """
        return self._middle

    @functools.cached_property
    def _middle(self) -> Arch:
        """:meth:`middle`, searched once per space object (and kept when it is pickled)."""
        target2 = self.params(self.narrowest()) + self.params(self.widest())  # twice the mean: integers only
        return min(self._middle_candidates(), key=lambda a: (abs(2 * self.params(a) - target2), a.arch_id))

    def _middle_candidates(self) -> Iterator[Arch]:
        """:meth:`middle`'s candidates, name-valued choices at their first: every arch of a small space, else
        uniform archs, then random ones."""
        numeric = lambda name: _dimension(name) not in STRING_DIMENSIONS
        if self.size() <= self.MIDDLE_EXHAUSTIVE:
            yield from self._enumerate(numeric)
            return
        keys = ["model_width", "encoder.layers", "decoder.layers",
                *(n for n in ORDER if n not in STRING_DIMENSIONS and n not in self.tie)]
        choices = {"model_width": self.model_widths, "encoder.layers": self.layers["encoder"],
                   "decoder.layers": self.layers["decoder"], **{n: self.dims[n] for n in keys[3:]}}
        key_of = lambda name: name if name in choices and name not in self.dims else _dimension(name)
        rng = random.Random(0)
        total = math.prod(len(choices[k]) for k in keys)
        if total <= self.MIDDLE_UNIFORM:
            combos = itertools.product(*(choices[k] for k in keys))
        else:
            combos = (tuple(rng.choice(choices[k]) for k in keys) for _ in range(self.MIDDLE_UNIFORM))
        for combo in combos:
            value = dict(zip(keys, combo))
            yield self._uniform(lambda name, values: value[key_of(name)] if numeric(name) else values[0])
        rng = random.Random(1)
        for _ in range(self.MIDDLE_SAMPLES):
            yield self._uniform(lambda name, values: rng.choice(values) if numeric(name) else values[0])

    def _enumerate(self, free: Callable[[str], bool]) -> Iterator[Arch]:
        """Every arch of the space (depth first over the define-by-run choices), the parameters where
        ``free(name)`` is false held at their first value."""
        pending: list[list[int]] = [[]]  # choice indices of a prefix of the choices; the rest take index 0
        while pending:
            prefix = pending.pop()
            counts: list[int] = []  # the number of values of each choice made

            def choose(name: str, values: tuple) -> Any:
                i = len(counts)
                counts.append(len(values) if free(name) else 1)
                return values[prefix[i] if i < len(prefix) else 0]

            yield self._uniform(choose)
            taken = prefix + [0] * (len(counts) - len(prefix))
            for j in range(len(prefix), len(counts)):  # later choices' other values: new subtrees
                pending.extend(taken[:j] + [k] for k in range(1, counts[j]))

    def references(self) -> dict[str, Arch]:
        """The fixed reference sub-Transformers scored at the end of each training stage:
        ``narrowest``, ``middle``, ``widest``."""
        return {"narrowest": self.narrowest(), "middle": self.middle(), "widest": self.widest()}

    def sample(self, rng: random.Random) -> Arch:
        """A uniformly random sub-Transformer (each active choice independent)."""
        return self._uniform(lambda _name, values: rng.choice(values))

    def sample_balanced(self, rng: random.Random, counts: dict[str, dict[str, int]], candidates: int = 32) -> Arch:
        """A sub-Transformer that trains the least-trained values of ``counts``, then counted there (:meth:`count`):
        over many draws each (layer, dimension, value) appears about equally often.

        Candidates: one arch whose every choice takes its least-counted value (ties: ``rng``), and
        ``candidates - 1`` uniform draws; the one with the largest deficit wins, the deficit of an arch being the
        sum over its choices of ``(the most-counted value's count - its value's count)``. The uniform draws let a
        choice that opens conditional ones (``units: 2`` opens ``unit_dependency``, ``layout: prime`` the kernels,
        a depth the layers beyond it) win when those are behind, which the choice-by-choice candidate cannot see.

        ``counts`` maps an Optuna parameter name (``encoder.width.2``) to ``{str(label): times}``; a choice is
        counted only where it exists (its layer is within the depth, its ``when`` holds), so the balance of a
        conditional choice is over the draws where it is made. Pure Python, no tensors.
        """
        def choose(name: str, values: tuple) -> Any:
            seen = counts.get(name, {})
            least = min(seen.get(str(_label(v)), 0) for v in values)
            return rng.choice([v for v in values if seen.get(str(_label(v)), 0) == least])

        def deficit(arch: Arch) -> int:
            total = 0
            for name, label in self.params_of(arch).items():
                seen = counts.get(name, {})
                total += max(seen.values(), default=0) - seen.get(str(label), 0)
            return total

        pool = [self._uniform(choose)] + [self.sample(rng) for _ in range(candidates - 1)]
        arch = max(pool, key=deficit)  # the first of equals: the choice-by-choice candidate
        self.count(arch, counts)
        return arch

    def count(self, arch: Arch, counts: dict[str, dict[str, int]]) -> None:
        """Add one to ``counts[name][str(label)]`` for every choice ``arch`` makes (:meth:`params_of`; choices
        with one value are not counted). Raises ValueError as :meth:`params_of`."""
        for name, label in self.params_of(arch).items():
            seen = counts.setdefault(name, {})
            seen[str(label)] = seen.get(str(label), 0) + 1

    def count_spread(self, counts: dict[str, dict[str, int]]) -> dict[str, float]:
        """Per counted choice, ``max / min - 1`` of its values' counts (a value never drawn counts 0: ``inf``);
        0 is perfect balance, 0.2 a spread of 20%. A choice of ``counts`` this space does not have raises KeyError."""
        spread = {}
        for name, seen in counts.items():
            labels = [str(v) for v in self._labels(name)]
            if not labels:
                raise KeyError(f"{name!r} is not a choice of this space")
            times = [seen.get(v, 0) for v in labels]
            spread[name] = float("inf") if min(times) == 0 else max(times) / min(times) - 1.0
        return spread

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

    def params_of(self, arch: Arch) -> dict[str, Any]:
        """The Optuna parameters (labels, as :meth:`suggest` stores them) that make ``arch``; the inverse of
        :meth:`from_params` for an arch of this space.

        Raises:
            ValueError: ``arch`` is not in this space (names the first parameter whose value is not a choice).
        """
        params: dict[str, Any] = {}
        wanted = {"encoder": arch.encoder, "decoder": arch.decoder}

        def choose(name: str, values: tuple) -> Any:
            parts = name.split(".")
            if name == "model_width":
                value = arch.model_width
            elif parts[1] == "layers":
                value = len(getattr(wanted[parts[0]], ORDER[0]))
            else:
                value = getattr(wanted[parts[0]], parts[1])[int(parts[2]) if len(parts) > 2 else 0]
            if value not in values:
                raise ValueError(f"{name}={_label(value)!r} is not one of this space's choices "
                                 f"{[_label(v) for v in values]}")
            params[name] = _label(value)
            return value

        self._uniform(choose)
        return params

    def check_params(self, params: Mapping[str, Any]) -> str | None:
        """Why a partial set of Optuna parameters (a ``search.points_to_evaluate`` mapping) can't be enqueued,
        or None. A name must be one :meth:`suggest` can ask (``encoder.layers``, ``encoder.width.3`` for a
        per-layer dimension within the deepest stack, ``decoder.branches`` for a per-stack one) and its value
        one of that choice's labels (kernel sets as ``"3,15"``, ``"none"`` for no kernel)."""
        for name, value in params.items():
            parts = str(name).split(".")
            if name == "model_width":
                values = self.model_widths
                if values == (None,):
                    return "model_width: this space has no model_width choice (space.model_width is not set)"
            elif len(parts) in (2, 3) and parts[0] in ("encoder", "decoder") and parts[1] == "layers" and len(parts) == 2:
                values = self.layers[parts[0]]
            elif len(parts) in (2, 3) and parts[0] in ("encoder", "decoder") and parts[1] in self.dims:
                dim = parts[1]
                if dim in self.tie:
                    return f"{name}: {dim} is tied to model_width, not a choice"
                if not self.chosen_in(parts[0], dim):
                    return (f"{name}: {parts[0]} layers do not choose {dim} in this space (space.{dim}.stacks is "
                            f"{[s for s in STACKS if self.chosen_in(s, dim)]}; they take "
                            f"{_label(self.excluded_value(dim))!r}); remove {name}")
                if self.per_layer[dim] != (len(parts) == 3):
                    form = f"{parts[0]}.{dim}.LAYER" if self.per_layer[dim] else f"{parts[0]}.{dim}"
                    return f"{name}: {dim} is chosen {'per layer' if self.per_layer[dim] else 'per stack'}; write {form}"
                if len(parts) == 3 and not (parts[2].isdigit() and int(parts[2]) < max(self.layers[parts[0]])):
                    return f"{name}: layer index must be 0..{max(self.layers[parts[0]]) - 1}"
                values = self.dims[dim]
            else:
                return (f"{name}: not a parameter of this space; parameters look like encoder.layers, "
                        f"encoder.width.0 (per layer) or decoder.branches (per stack)")
            labels = [_label(v) for v in values]
            if _point_value(value, labels) not in labels:
                return f"{name}: {value!r} is not one of the choices {labels}"
        return None

    def point_params(self, points: Sequence[str | ArchPoint | Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Optuna parameters of ``search.points_to_evaluate`` (:mod:`nas.space.schema.points`): ``widest``/
        ``narrowest``/``middle`` become the full parameters of that reference sub-Transformer, an arch string
        (``enc[128/256 128/256] dec[128/256]``) or an :class:`~nas.space.schema.ArchPoint` the full parameters of
        its arch (:meth:`arch_point_params`), a mapping is kept as it is (validate it with :meth:`check_params`).

        Raises:
            ValueError: an arch that is not in this space (names the first choice outside it); ArchError: an arch
                string that does not parse.
        """
        refs = {"widest": self.widest, "narrowest": self.narrowest, "middle": self.middle}

        def params(point: str | ArchPoint | Mapping[str, Any]) -> dict[str, Any]:
            if isinstance(point, ArchPoint):
                return self.arch_point_params(point.parsed())
            if isinstance(point, str):
                return self.params_of(refs[point]()) if point in refs else self.arch_point_params(Arch.parse(point))
            return {name: _point_value(v, self._labels(name)) for name, v in point.items()}

        return [params(p) for p in points]

    def arch_point_params(self, arch: Arch) -> dict[str, Any]:
        """The Optuna parameters of ``arch`` (:meth:`params_of`), checked to rebuild exactly ``arch``
        (:meth:`from_params`): a hand-written arch must lie inside the space, including the choices the space fixes
        (one value, a tied width, a per-stack choice, a choice its condition switches off).

        Raises:
            ValueError: ``arch`` is not in this space; names the first choice outside it and what the space allows.
        """
        params = self.params_of(arch)
        rebuilt = self.from_params(params)
        if rebuilt != arch:
            raise ValueError(self._outside(arch, rebuilt))
        return params

    def _outside(self, arch: Arch, inside: Arch) -> str:
        """Why ``arch`` is not in the space: its first choice that differs from ``inside``, the arch of the space
        with the same Optuna parameters."""
        if arch.model_width != inside.model_width:
            if inside.model_width is None:
                return (f"model_width={arch.model_width}: this space has no model_width choice (space.model_width is "
                        f"not set; drop the 'C{arch.model_width}' token)")
            return f"model_width={arch.model_width}: this space fixes model_width at {inside.model_width}"
        for stack in ("encoder", "decoder"):
            ours, theirs = getattr(arch, stack), getattr(inside, stack)
            for f in dataclasses.fields(ours):
                for i, (v, w) in enumerate(zip(getattr(ours, f.name), getattr(theirs, f.name))):
                    if v != w:
                        return f"{stack}.{f.name}.{i}={_label(v)!r}: {self._fixed_why(f.name, _label(w), stack)}"
        return f"{arch.summary()} is not an arch of this space"

    def _fixed_why(self, dim: str, value: Any, stack: str) -> str:
        """What the space has where a hand-written arch differs from it (``value``, the space's label, in a layer of
        ``stack``), and why."""
        if dim in self.dims and not self.chosen_in(stack, dim):
            return (f"space.{dim}.stacks is {[s for s in STACKS if self.chosen_in(s, dim)]}, so every {stack} layer "
                    f"has {dim} {value!r}; change the arch, or add {stack} to space.{dim}.stacks")
        if dim in self.tie:
            return f"{dim} is tied to model_width in this space ({self.tie[dim]} x model_width = {value!r})"
        values = [_label(v) for v in self.dims.get(dim, ())]
        if len(values) <= 1:
            return f"this space fixes {dim} at {value!r}"
        if self.when.get(dim) and value == _label(INACTIVE.get(dim)):
            cond = self.when[dim]
            return f"{dim} is chosen only where {cond[0]} is {cond[1]}, elsewhere it is {value!r}"
        if not self.per_layer.get(dim, True):
            return f"this space chooses {dim} once per stack, and layer 0 has {value!r}"
        return f"not one of this space's choices {values} (the space gives {value!r})"

    def _labels(self, name: str) -> list[Any]:
        """The Optuna labels of parameter ``name`` (``encoder.kernels.0`` -> ``["3", "3,15", ...]``)."""
        dim = _dimension(name)
        values = self.model_widths if name == "model_width" else (
            self.layers[name.split(".")[0]] if dim == "layers" else self.dims.get(dim, ()))
        return [_label(v) for v in values]

    def _layer_count(self, stack: str) -> int:
        """Distinct choices of one layer of ``stack`` from its per-layer dimensions (exact with conditions)."""
        per = [n for n in ORDER if self.per_layer[n] and n not in self.tie and self.chosen_in(stack, n)]
        referenced = sorted({self.when[n][0] for n in per if self.when[n]})
        total = 0
        for combo in itertools.product(*(self._stack_values(stack, r) for r in referenced)):
            layer = dict(zip(referenced, combo))
            count = 1
            for name in per:
                if name not in referenced and self._active(name, layer):
                    count *= len(self.dims[name])
            total += count
        return total

    def size(self) -> int:
        """Number of sub-Transformers in the space (per-stack conditional choices counted as if active)."""
        total = len(self.model_widths)
        for stack in ("encoder", "decoder"):
            per_layer = self._layer_count(stack)
            per_stack = math.prod(len(self.dims[n]) for n in ORDER if not self.per_layer[n] and n not in self.tie
                                  and self.chosen_in(stack, n))
            total *= sum(per_stack * per_layer ** n for n in self.layers[stack])
        return total

    def describe(self) -> list[tuple[str, str, str]]:
        """(dimension, choices, scope) rows for ``nas space show``: the YAML's ``space.*`` dimensions and the depths.
        ``unit_bias`` is left out: it is the training setting ``train.unit_bias`` (the validator refuses
        ``space.unit_bias``), held here as a one-value dimension only so that sampled archs carry it."""
        rows = [] if self.model_widths == (None,) else \
            [("model_width", str(list(self.model_widths)), "per sub-Transformer (type 1, eq. 3 projections)")]
        rows += [(f"{s}.layers", str(list(self.layers[s])), "per stack") for s in ("encoder", "decoder")]
        for name in ORDER:
            if name == "unit_bias":
                continue
            if name in self.tie:
                rows.append((name, f"{self.tie[name]} x model_width" if self.tie[name] != 1 else "model_width", "tied"))
                continue
            cond = f", when {self.when[name][0]}={self.when[name][1]}" if self.when[name] else ""
            values = [list(v) if isinstance(v, tuple) else v for v in self.dims[name]]
            scope = ("per layer" if self.per_layer[name] else "per stack") + cond
            only = [s for s in STACKS if self.chosen_in(s, name)]
            rows.append((name, str(values), scope.replace("per ", f"per {only[0]} ", 1) if len(only) == 1 else scope))
        return rows


def format_count(n: int) -> str:
    """``1234`` -> ``1,234``; large counts as a power of ten (``~3.2e+12``)."""
    return f"{n:,}" if n < 10 ** 7 else f"~{n:.1e} (10^{math.log10(n):.1f})"


def _unit_bias(spec: SweepSpec) -> Dimension:
    """The one unit bias of every multi-unit layer, ``train.unit_bias`` (a training setting: MUTE's biases
    change nothing at evaluation, so the space does not choose it); single-unit layers have none."""
    sp = spec.space
    units = sp.units.values if sp.units else [spec.supernet.units or 1]
    many = sorted(u for u in units if u > 1)
    if not many:
        return Dimension(values=["identity"])
    return Dimension(values=[spec.train.unit_bias], per_layer=bool(sp.units and sp.units.per_layer),
                     when={"units": many})
