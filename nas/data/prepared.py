""":class:`PreparedData`, a finished cache folder of :func:`nas.data.prepare_data`: its layout (``spm.model``,
``train.arrow``, ``valid.parquet``) and the readers of its tokenizer, token ids and validation text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from nas.data.corpus import TokenCorpus, map_ipc
from nas.data.tokenizer import Tokenizer

__all__ = ["PreparedData"]

_SPLITS = ("train", "valid")


@dataclass(frozen=True)
class PreparedData:
    """A finished cache folder produced by :func:`nas.data.prepare_data`.

    Attributes:
        root: the cache folder.
        spm_model: ``root / "spm.model"``.
        train_arrow: ``root / "train.arrow"``: uncompressed Arrow IPC file, one record batch, columns ``src``,
            ``tgt``: ``large_list<int32>`` (memory-mapped by :meth:`corpus`).
        valid_parquet: ``root / "valid.parquet"`` (columns ``src``, ``tgt``: list<int32>; ``src_text``,
            ``tgt_text``: string).
        vocab_size: actual number of pieces of the trained model.
    """

    root: Path
    spm_model: Path
    train_arrow: Path
    valid_parquet: Path
    vocab_size: int

    @classmethod
    def open(cls, root: Path) -> PreparedData:
        """The finished cache folder ``root`` (its paths; ``vocab_size`` read from its tokenizer).

        Raises:
            DataError: ``root / "spm.model"`` is missing or not a SentencePiece model.
        """
        spm_model = root / "spm.model"
        return cls(
            root=root,
            spm_model=spm_model,
            train_arrow=root / "train.arrow",
            valid_parquet=root / "valid.parquet",
            vocab_size=Tokenizer(spm_model).vocab_size,
        )

    def tokenizer(self) -> Tokenizer:
        """Load the joint SentencePiece tokenizer."""
        return Tokenizer(self.spm_model)

    def corpus(self, split: str = "train") -> TokenCorpus:
        """The ids of ``"train"`` (memory-mapped from ``train.arrow``: no copy, shared by every process that
        opens it) or ``"valid"`` (read into memory) as a :class:`TokenCorpus`.

        Raises:
            ValueError: unknown split name.
            DataError: the file is unreadable (names it; delete the cache folder).
        """
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {_SPLITS}")
        if split == "train":
            return TokenCorpus.open(self.train_arrow)
        return TokenCorpus.from_arrow(pq.read_table(self.valid_parquet, columns=["src", "tgt"]))

    def load_split(self, split: str) -> tuple[list[list[int]], list[list[int]]]:
        """Return ``(src_ids, tgt_ids)`` of ``"train"`` or ``"valid"`` (no BOS/EOS) as Python lists.

        For the small validation split and tests: the training split's lists cost ~100 bytes per token;
        train from :meth:`corpus` instead.

        Raises:
            ValueError: unknown split name.
        """
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {_SPLITS}")
        if split == "train":
            _, batch = map_ipc(self.train_arrow)
            return batch.column("src").to_pylist(), batch.column("tgt").to_pylist()
        table = pq.read_table(self.valid_parquet, columns=["src", "tgt"])
        return table.column("src").to_pylist(), table.column("tgt").to_pylist()

    def valid_text(self) -> tuple[list[str], list[str]]:
        """Return the raw (stripped) validation source sentences and target references."""
        table = pq.read_table(self.valid_parquet, columns=["src_text", "tgt_text"])
        return table.column("src_text").to_pylist(), table.column("tgt_text").to_pylist()
