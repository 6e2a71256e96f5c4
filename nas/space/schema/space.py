"""The sweep YAML's ``space:`` section: the search dimensions (:class:`Dimension`, :class:`SpaceSpec`) and
:func:`check_space`, the checks of their choices against each other and against the ``supernet:`` section.

Pydantic and the standard library only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nas.space.arch import DEPENDENCIES, LAYOUTS, UNIT_BIASES
from nas.space.schema.base import StrictModel
from nas.space.schema.supernet import SupernetSpec

__all__ = ["STACKS", "DECODER_ONLY", "Dimension", "SpaceSpec", "check_space", "dimension_stacks"]

STACKS = ("encoder", "decoder")
"""The two stacks of a sub-Transformer; a dimension is chosen in both unless its ``stacks`` says otherwise."""
DECODER_ONLY = ("encoder_attention",)
"""Dimensions only decoder layers choose (HAT's arbitrary encoder-decoder attention): their ``stacks`` is
``[decoder]`` whether the YAML says so or not; ``stacks: [encoder]`` (or both) is refused."""


class Dimension(StrictModel):
    values: list[int | str | list[int]] | None = Field(None, min_length=1)
    """The choices (an Optuna categorical): integers, layout names, or kernel-size lists."""
    tie: Literal["model_width"] | None = None
    """Instead of ``values``: take the sub-Transformer's model width times ``scale`` in every layer, e.g.
    ``width: {tie: model_width}`` and ``ffn_width: {tie: model_width, scale: 4}`` (type-1 Scalable
    Transformers, sec. 3.2: ``C = D^1 = ... = D^L``)."""
    scale: int = Field(1, ge=1)
    """Multiplier of a tied dimension (``ffn_width = scale * model_width``)."""
    per_layer: bool = False
    """True: one choice per layer; False: one choice per stack (encoder, decoder)."""
    when: dict[str, int | str | list[int | str]] | None = None
    """Condition on another per-layer dimension of the same layer, e.g. ``{layout: prime}`` or
    ``{units: [2, 3]}`` (any of the values); where it does not hold the dimension takes its
    inactive value (1 branch/path/unit, no kernels, identity bias, independent units). In a stack that
    does not choose the referred dimension (its ``stacks``), the condition is tested on that dimension's
    inactive value (a decoder layer of ``layout: {stacks: [encoder]}`` is sequential)."""
    stacks: list[Literal["encoder", "decoder"]] | None = None
    """The stacks whose layers choose this dimension, ``[encoder]`` or ``[decoder]``; default: both
    (``encoder_attention``: the decoder only, :data:`DECODER_ONLY`). Every layer of the other stack takes the
    dimension's inactive value (1 branch/path/unit, sequential layout, no kernels, independent units; widths:
    ``supernet.model_dim`` and ``supernet.ffn_width``) and Optuna is asked no parameter for it there, e.g.
    ``branches: {values: [1, 2], per_layer: true, stacks: [encoder]}`` keeps the decoder at one branch.
    :func:`check_space` refuses an empty or repeating list, ``stacks`` on a depth, ``model_width`` or a tied
    width, and any ``stacks`` of ``encoder_attention`` other than ``[decoder]``."""

    @model_validator(mode="after")
    def _one_source(self) -> "Dimension":
        if self.values is None and self.tie is None:
            raise ValueError("give `values: [...]` (the choices) or `tie: model_width` (type-1 Scalable Transformers)")
        if self.values is not None and self.tie is not None:
            raise ValueError("give either `values` or `tie`, not both")
        if self.scale != 1 and self.tie is None:
            raise ValueError(f"scale={self.scale} applies only to a tied dimension; add `tie: model_width` or remove scale")
        return self


class SpaceSpec(StrictModel):
    model_width: Dimension | None = None
    """C per sub-Transformer (type-1 Scalable Transformers): one model width for every layer, cropped
    from ``supernet.model_dim`` with the eq. 3 input/output projections; default: model_dim only."""
    encoder_layers: Dimension | None = None
    """Encoder depth choices; default: the supernet's depth only."""
    decoder_layers: Dimension | None = None
    width: Dimension | None = None
    """Attention width D_l (channels); default: model_dim only."""
    ffn_width: Dimension | None = None
    """FFN inner width F_l (channels); default: supernet.ffn_width only."""
    branches: Dimension | None = None
    """Attention branches N_a (MAT eq. 4); default: supernet.branches, else 1."""
    paths: Dimension | None = None
    """Parallel paths per sublayer (Multi-Path eq. 4); default: supernet.paths, else 1."""
    layout: Dimension | None = None
    """``sequential`` or ``prime`` (Unified Transformer eq. 4) per layer; default: sequential."""
    kernels: Dimension | None = None
    """Dynamic-convolution kernel sets of Prime layers, e.g. ``[[], [3], [3, 15]]`` (``[]``: Prime-simple)."""
    units: Dimension | None = None
    """MUTE units per layer (eq. 10); default: supernet.units, else 1."""
    unit_bias: Dimension | None = None
    """Refused: MUTE's unit biases act only in training, so they are no search dimension; see ``train.unit_bias``."""
    unit_dependency: Dimension | None = None
    """``independent`` (eq. 10) or ``sequential`` (eq. 13-16, AutoShuffle) unit combination."""
    encoder_attention: Dimension | None = None
    """Decoder layers only: how many of the last encoder layers each cross-attention attends to, their keys and
    values concatenated along the source length (HAT sec. 3.1, arbitrary encoder-decoder attention; no parameters),
    e.g. ``{values: [1, 2, 3], per_layer: true}``; at most the deepest encoder; default: 1 (the last layer only)."""


def check_space(sp: SpaceSpec, sn: SupernetSpec) -> None:
    """Check the ``space:`` section's choices against each other and against the ``supernet:`` section ``sn``:
    no ``space.unit_bias``, an FFN width from one of them, odd ``supernet.kernels``, every dimension's values
    (distinct, known names, integers within the supernet's maxima, widths divisible by the head width), ties,
    ``when`` conditions, ``stacks`` (:func:`dimension_stacks`), Prime layers' paths and kernels, ``model_width``, and
    ``encoder_attention`` (integers from 1 to the deepest encoder, decoder layers only).

    Raises:
        ValueError: the first problem, naming the key (``space.<dimension>...`` or ``supernet.<key>``) and the fix.
    """
    if sp.unit_bias is not None:
        raise ValueError("space.unit_bias: MUTE's unit biases act only in training (sec. 3.2), so sub-Transformers "
                         "that differ only in them score identically; it is no search dimension: remove "
                         "space.unit_bias and set train.unit_bias (mixed, swap, disorder, mask or identity)")
    if sn.ffn_width is None and sp.ffn_width is None:
        raise ValueError("set supernet.ffn_width or space.ffn_width.values (the FFN inner width)")
    for k in sn.kernels:
        if k < 1 or k % 2 == 0:
            raise ValueError(f"supernet.kernels contains {k}; kernel sizes must be odd and >= 1 (e.g. 3, 7, 15)")
    limits = {
        "encoder_layers": ("supernet.encoder_layers", sn.encoder_layers),
        "decoder_layers": ("supernet.decoder_layers", sn.decoder_layers),
        "model_width": ("supernet.model_dim", sn.model_dim),
        "width": ("supernet.model_dim", sn.model_dim),
        "ffn_width": ("supernet.ffn_width", sn.ffn_width),
        "branches": ("supernet.branches", sn.branches),
        "paths": ("supernet.paths", sn.paths),
        "units": ("supernet.units", sn.units),
    }
    for key in SpaceSpec.model_fields:
        dim = getattr(sp, key)
        if dim is None:
            continue
        _check_stacks(key, dim)
        if dim.tie is not None:
            _check_tie(key, dim, sp, *limits.get(key, (None, None)), head_dim=sn.head_width)
            continue
        values = [tuple(v) if isinstance(v, list) else v for v in dim.values]
        if len(set(values)) != len(values):
            raise ValueError(f"space.{key}.values={dim.values} repeats a value; list each choice once")
        if key == "layout":
            _check_names(key, dim.values, LAYOUTS)
        elif key == "unit_bias":
            _check_names(key, dim.values, UNIT_BIASES)
        elif key == "unit_dependency":
            _check_names(key, dim.values, DEPENDENCIES)
        elif key == "kernels":
            _check_kernels(dim.values, sn.kernels, sp.layout)
        elif key == "encoder_attention":
            _check_encoder_attention(dim.values, sp, sn)
        else:
            _check_ints(key, dim.values, *limits[key], head_dim=sn.head_width)
        if dim.when is not None:
            _check_when(key, dim, sp)
    _check_prime_conditions(sp)
    if sp.model_width is not None:
        if sp.model_width.per_layer or sp.model_width.when:
            raise ValueError("space.model_width is one choice per sub-Transformer: remove per_layer and when")
        if sn.io_projection is False:
            raise ValueError("space.model_width needs the input/output projections of Scalable Transformers eq. 3: "
                             "set supernet.io_projection: true (or leave it out)")


def dimension_stacks(key: str, dim: "Dimension | None") -> tuple[str, ...]:
    """The stacks whose layers choose dimension ``key`` of ``space:``, in :data:`STACKS` order: ``dim.stacks`` when
    given, else :data:`STACKS` (``encoder_attention``: ``("decoder",)``). ``dim`` may be None (a dimension the YAML
    leaves out). No checks: :func:`check_space` refuses bad ``stacks``."""
    if dim is not None and dim.stacks:
        return tuple(s for s in STACKS if s in dim.stacks)
    return ("decoder",) if key in DECODER_ONLY else STACKS


def _check_stacks(key: str, dim: "Dimension") -> None:
    """``space.<key>.stacks``: a non-empty list of distinct stacks, on a dimension that layers choose; the decoder
    only for :data:`DECODER_ONLY` dimensions."""
    if dim.stacks is None:
        return
    if not dim.stacks:
        raise ValueError(f"space.{key}.stacks is empty; list the stacks whose layers choose {key}, e.g. "
                         f"`stacks: [encoder]`, or remove stacks (both stacks choose it)")
    if len(set(dim.stacks)) != len(dim.stacks):
        raise ValueError(f"space.{key}.stacks={dim.stacks} repeats a stack; list each of encoder, decoder once")
    if key in ("encoder_layers", "decoder_layers", "model_width"):
        scope = "one stack's depth" if key != "model_width" else "one choice per sub-Transformer"
        raise ValueError(f"space.{key}.stacks: {key} is {scope}, not a choice of a stack's layers; remove stacks")
    if dim.tie is not None:
        raise ValueError(f"space.{key}.stacks: a tied {key} is model_width x scale in every layer of both stacks; "
                         f"remove stacks, or give `values` instead of `tie`")
    if key in DECODER_ONLY and list(dimension_stacks(key, dim)) != ["decoder"]:
        raise ValueError(f"space.{key}.stacks={dim.stacks}: only decoder layers choose {key} (their cross-attention "
                         f"reads the encoder); write `stacks: [decoder]` or remove stacks")


def _check_ints(key: str, values: list, limit_key: str, limit: int | None, head_dim: int) -> None:
    for v in values:
        if not isinstance(v, int):
            raise ValueError(f"space.{key}.values contains {v!r}; this dimension takes integers")
        if v < 1:
            raise ValueError(f"space.{key}.values contains {v}; choices must be >= 1")
        if limit is not None and v > limit:
            raise ValueError(f"space.{key}.values contains {v}, above {limit_key}={limit}; "
                             f"lower the value or raise {limit_key}")
        if key == "width" and v % head_dim:
            raise ValueError(f"space.width.values contains {v}, not divisible by the head width {head_dim} "
                             f"(supernet.head_dim, default model_dim / heads); use multiples of {head_dim}")


def _check_encoder_attention(values: list, sp: "SpaceSpec", sn: SupernetSpec) -> None:
    """Each choice is an integer from 1 to the deepest encoder of the space (a decoder layer cannot attend to more
    encoder layers than there are; shallower sampled encoders are handled by clamping, :attr:`Arch.attended_layers`)."""
    _check_ints("encoder_attention", values, "", None, head_dim=1)
    if sp.encoder_layers is not None and sp.encoder_layers.values:
        key, deepest = "space.encoder_layers.values", max(sp.encoder_layers.values)
    else:
        key, deepest = "supernet.encoder_layers", sn.encoder_layers
    for v in values:
        if v > deepest:
            raise ValueError(f"space.encoder_attention.values contains {v}, above the deepest encoder ({key} reaches "
                             f"{deepest}): a decoder layer attends to at most that many encoder layers; lower the "
                             f"value to {deepest} or less, or deepen the encoder")


def _check_tie(key: str, dim: "Dimension", sp: "SpaceSpec", limit_key: str | None, limit: int | None,
               head_dim: int) -> None:
    if key not in ("width", "ffn_width"):
        raise ValueError(f"space.{key}.tie: only width and ffn_width can be tied to the model width")
    if sp.model_width is None or sp.model_width.values is None:
        raise ValueError(f"space.{key}.tie: model_width needs `space.model_width: {{values: [...]}}`")
    if dim.when:
        raise ValueError(f"space.{key}: a tied dimension cannot be conditional; remove `when`")
    for c in sp.model_width.values:
        v = c * dim.scale if isinstance(c, int) else c
        if isinstance(v, int) and limit is not None and v > limit:
            raise ValueError(f"space.{key}: model_width {c} x scale {dim.scale} = {v} is above {limit_key}={limit}; "
                             f"lower the scale or raise {limit_key}")
        if key == "width" and isinstance(v, int) and v % head_dim:
            raise ValueError(f"space.width: tied to model_width {c}, {v} is not divisible by the head width "
                             f"{head_dim} (supernet.head_dim, default model_dim / heads)")


def _check_names(key: str, values: list, allowed: tuple[str, ...]) -> None:
    for v in values:
        if v not in allowed:
            raise ValueError(f"space.{key}.values contains {v!r}; expected one of {', '.join(allowed)}")


def _check_kernels(values: list, available: list[int], layout: "Dimension | None") -> None:
    if layout is None or "prime" not in layout.values:
        raise ValueError("space.kernels needs Prime layers: add 'prime' to space.layout.values")
    for v in values:
        if not isinstance(v, list):
            raise ValueError(f"space.kernels.values contains {v!r}; each choice is a list of kernel sizes, e.g. [3, 15]")
        for k in v:
            if k < 1 or k % 2 == 0:
                raise ValueError(f"space.kernels.values contains kernel size {k}; kernel sizes must be odd and >= 1")
            if available and k not in available:
                raise ValueError(f"space.kernels.values contains {k}, not in supernet.kernels={available}; "
                                 f"add it there or remove it here")


def _check_prime_conditions(sp: "SpaceSpec") -> None:
    """Prime layers have one path and sequential layers no kernels, one unit neither bias nor dependency: the YAML
    must say so with ``when``. A stack that does not choose ``layout`` (``units``) has sequential layers (one unit)."""
    layouts = sp.layout.values if sp.layout else ["sequential"]
    layout_stacks = dimension_stacks("layout", sp.layout)
    prime_in = {s for s in layout_stacks if "prime" in layouts}
    sequential_in = {s for s in STACKS if s not in layout_stacks or "sequential" in layouts}
    if sp.paths and len(sp.paths.values) > 1 and sp.paths.when != {"layout": "sequential"} \
            and prime_in & set(dimension_stacks("paths", sp.paths)):
        raise ValueError("space.paths: a Prime layer has one path; add `when: {layout: sequential}` to space.paths")
    if sp.kernels and any(v for v in sp.kernels.values):
        kernel_stacks = set(dimension_stacks("kernels", sp.kernels))
        if not prime_in & kernel_stacks:
            raise ValueError(f"space.kernels.stacks={sorted(kernel_stacks)}: no layer there can be Prime "
                             f"(space.layout.stacks={list(layout_stacks)}); give both the same stacks")
        if sp.kernels.when != {"layout": "prime"} and sequential_in & kernel_stacks:
            raise ValueError("space.kernels: sequential layers have no convolution; add `when: {layout: prime}` to "
                             "space.kernels")
    units = sp.units.values if sp.units else [1]
    units_stacks = dimension_stacks("units", sp.units)
    for key in ("unit_bias", "unit_dependency"):
        dim = getattr(sp, key)
        single_in = {s for s in dimension_stacks(key, dim) if s not in units_stacks or 1 in units}
        if dim and len(dim.values) > 1 and single_in and not dim.when:
            raise ValueError(f"space.{key}: one unit has no bias or dependency; add `when: {{units: [2, ...]}}` "
                             f"listing the unit counts above 1")


def _check_when(key: str, dim: "Dimension", sp: "SpaceSpec") -> None:
    if key in ("width", "ffn_width", "encoder_layers", "decoder_layers", "encoder_attention"):
        raise ValueError(f"space.{key}.when: {key} applies to every layer and cannot be conditional")
    if len(dim.when) != 1:
        raise ValueError(f"space.{key}.when={dim.when}: give exactly one condition, e.g. {{layout: prime}}")
    (ref, value), = dim.when.items()
    if ref == "encoder_attention":
        raise ValueError(f"space.{key}.when refers to encoder_attention, which only decoder layers choose; "
                         f"refer to another dimension")
    target = getattr(sp, ref, None) if ref in SpaceSpec.model_fields else None
    if target is None:
        raise ValueError(f"space.{key}.when refers to {ref!r}, which is not a dimension of this space")
    if target.when is not None:
        raise ValueError(f"space.{key}.when refers to {ref!r}, which is conditional itself; refer to an unconditional one")
    if target.values is None:
        raise ValueError(f"space.{key}.when refers to {ref!r}, which is tied to the model width; refer to a chosen one")
    if not (dim.per_layer and target.per_layer):
        raise ValueError(f"space.{key}.when: both space.{key} and space.{ref} need per_layer: true")
    for v in value if isinstance(value, list) else [value]:
        if v not in target.values:
            raise ValueError(f"space.{key}.when: {ref}={v!r} is not one of space.{ref}.values={target.values}")
