"""Training-time regularisation, passed to each forward call (never set on the model)."""

from __future__ import annotations

import dataclasses

__all__ = ["Regularization"]


@dataclasses.dataclass(frozen=True)
class Regularization:
    """The regularisation of one forward call: ``supernet(src, tgt_in, arch, reg=...)``.

    It applies exactly when passed, whatever ``model.train()``/``model.eval()`` says; ``reg=None``
    (the default) is the deterministic model of evaluation and decoding. (MUTE's unit-bias input
    noise, configured by the model's ``unit_bias_rate``, is the one training behaviour still tied to
    ``model.train()``.) ``SuperTransformer.regularization()`` gives the model's configured defaults.
    """

    dropout: float = 0.0
    """Dropout rate on the embeddings, every residual branch and the FFN's hidden layer (probability)."""
    attention_dropout: float = 0.0
    """Dropout rate on the attention probabilities (probability)."""
    drop_branch: float = 0.0
    """MAT drop-branch rate rho (eq. 5-7): each branch (and the FFN) of each sentence is dropped with it."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not 0.0 <= value <= 1.0 or (field.name == "drop_branch" and value == 1.0):
                raise ValueError(f"Regularization.{field.name}={value} is outside [0, 1]"
                                 f"{' (1 excluded: eq. 5 divides by 1 - rho)' if field.name == 'drop_branch' else ''}")
