"""The sweep YAML's ``data:`` section: the parallel text files and the tokenizer (:class:`DataSpec`).

Relative paths are resolved against the current working directory (the repository root in the README's commands);
the files themselves are checked by :mod:`nas.space.datafiles`. Pydantic and the standard library only.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from nas.space.schema.base import StrictModel

__all__ = ["PairFiles", "TokenizerSpec", "DataSpec"]


class PairFiles(StrictModel):
    src: Path
    """Source-side text file (one sentence per line, gzip or plain UTF-8)."""
    tgt: Path
    """Target-side text file, line-aligned with ``src``."""


class TokenizerSpec(StrictModel):
    vocab_size: int = Field(8000, ge=100)
    """Joint SentencePiece vocabulary size (tokens)."""


class DataSpec(StrictModel):
    train: PairFiles
    valid: PairFiles
    tokenizer: TokenizerSpec = TokenizerSpec()
    max_train_pairs: int | None = Field(None, ge=1)
    """Use only the first N training pairs (None: all)."""
    max_valid_pairs: int | None = Field(None, ge=1)
    """Use only the first N validation pairs (None: all)."""
    max_len: int = Field(128, ge=4)
    """Longest training sentence kept (subword tokens)."""
    cache_dir: Path = Path("nas_runs/data")
    """Where tokenized Parquet files are cached (by a hash of inputs and settings)."""
