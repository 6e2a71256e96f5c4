"""The sweep YAML's ``supernet:`` section: the widest sizes every sub-Transformer is cropped from
(:class:`SupernetSpec`). Pydantic and the standard library only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nas.space.schema.base import StrictModel

__all__ = ["SupernetSpec"]


class SupernetSpec(StrictModel):
    model_dim: int = Field(..., ge=8)
    """C: the widest model width (channels); every sub-Transformer's unless ``space.model_width`` chooses
    a narrower one (type-1 Scalable Transformers, sec. 3.2)."""
    heads: int = Field(4, ge=1)
    """Attention heads per branch of the widest attention (``model_dim``); sets the default ``head_dim``."""
    head_dim: int | None = Field(None, ge=1)
    """The fixed width of one attention head (channels); default ``model_dim / heads``. An attention width
    D has ``D / head_dim`` heads per branch, the widest's leading heads (Scalable Transformers sec. 4.1:
    "attention head dimension is fixed to 64"); every width must be divisible by it."""

    @property
    def head_width(self) -> int:
        """``head_dim``, or ``model_dim / heads`` when it is not set."""
        return self.head_dim or self.model_dim // self.heads
    encoder_layers: int = Field(..., ge=1)
    decoder_layers: int = Field(..., ge=1)
    ffn_width: int | None = Field(None, ge=1)
    """Widest FFN inner width (channels); default: the largest value in ``space.ffn_width``."""
    branches: int | None = Field(None, ge=1)
    """Most attention branches N_a (MAT); default: the largest value in ``space.branches``."""
    paths: int | None = Field(None, ge=1)
    """Most parallel paths per sublayer (Multi-Path); default: the largest value in ``space.paths``."""
    more_features: bool = False
    """Multi-Path "more features" (sec. 3.2): add the averages of n-1 paths in sublayers with 3+ paths."""
    kernels: list[int] = Field(default_factory=list)
    """Kernel sizes (odd) of the Prime convolution cells; default: those used in ``space.kernels``."""
    units: int | None = Field(None, ge=1)
    """Most MUTE units per layer; default: the largest value in ``space.units``."""
    relative_positions: int | None = Field(None, ge=0)
    """Clipping distance k (positions) of the encoder self-attention's relative position representations
    (Shaw et al. 2018, eq. 3-6); 0: none. Default: 16 when the supernet has MUTE units (MUTE sec. 4 runs its
    units on relative positions: swap and disorder biases do nothing to a unit that sees positions only at its
    input), else 0."""
    relative_layers: Literal["units", "all"] = "units"
    """Which encoder layers have the relative position tables (when ``relative_positions`` > 0): ``units``, only
    layers with MUTE units (a layer's tables are built when its most units > 1 and used by sub-Transformers
    running it with units > 1; one unit runs on absolute positions only); ``all``, every layer whatever its
    units: the format before this choice existed (what older supernets and exports hold; keep it to compare
    with models trained that way)."""
    share_layouts: bool = True
    """Whether a layer's ``sequential`` and ``prime`` layouts share their attention(s) and FFN (the format before
    this choice existed). false: the Prime layout of each layer gets its own (``prime_*``, its convolution on
    its own attention's values), so a Prime and a sequential sub-Transformer share no weight in that layer:
    sharing less between dissimilar sub-networks improves the supernet's rank correlation (Few-shot NAS, Zhao
    et al., ICML 2021; Mixture-of-Supernets, Jawahar et al., Findings of ACL 2024). Costs the attention(s)
    and FFN again in every ``sequential+prime`` layer."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    max_positions: int = Field(256, ge=16)
    """Longest sequence (tokens) the sinusoidal position table covers."""
    io_projection: bool | None = None
    """The input/output projections of Scalable Transformers eq. 3 between the ``model_dim``-wide word
    embeddings and the (croppable) model width. None: on exactly when the space chooses ``model_width``."""
