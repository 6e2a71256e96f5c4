"""The joint SentencePiece tokenizer: :class:`Tokenizer` loads, trains, encodes and decodes one unigram model shared
by source and target, trained with the special ids of :mod:`nas.data.ids`."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from nas.data.errors import DataError
from nas.data.ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID

__all__ = ["INPUT_SENTENCE_SIZE", "Tokenizer"]

INPUT_SENTENCE_SIZE = 200_000
"""Lines SentencePiece trains on at most: half of them sources, half targets (see :func:`nas.data.text.scan_pairs`)."""


class Tokenizer:
    """Joint (source+target) SentencePiece model wrapper.

    Attributes:
        model_path: the ``.model`` file this tokenizer was loaded from.
    """

    def __init__(self, model_path: str | Path) -> None:
        """Load a SentencePiece model.

        Raises:
            DataError: the model file is missing or not a SentencePiece model.
        """
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"SentencePiece model not found: {self.model_path}; re-run data preparation")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        except (OSError, RuntimeError) as e:
            raise DataError(
                f"cannot load SentencePiece model {self.model_path} ({e}); delete its cache folder"
            ) from e

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special ids (pad/unk/bos/eos) included."""
        return self._sp.get_piece_size()

    def encode(self, lines: list[str]) -> list[list[int]]:
        """Encode sentences to piece ids, without BOS/EOS."""
        return self._sp.encode(list(lines), out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Decode id sequences to text.

        Each sequence is cut at its first ``EOS_ID``; ``PAD_ID`` and ``BOS_ID`` are dropped.
        Accepts lists of ints (use ``tensor.tolist()`` for tensors).
        """
        return self._sp.decode([_strip_specials(seq) for seq in ids])

    @staticmethod
    def train(lines: list[str], model_prefix: str | Path, vocab_size: int, seed: int = 0) -> Tokenizer:
        """Train a unigram SentencePiece model on ``lines`` and load it.

        Writes ``<model_prefix>.model`` and ``<model_prefix>.vocab``. ``vocab_size`` is a soft
        limit (``hard_vocab_limit=False``): tiny corpora may give fewer pieces. Training is
        capped at 200k (shuffled) sentences and uses 2 threads.

        Raises:
            RuntimeError: from SentencePiece, e.g. ``vocab_size`` is too small for the
                corpus's character set.
        """
        spm.set_random_generator_seed(seed)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type="unigram",
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            character_coverage=1.0,
            input_sentence_size=INPUT_SENTENCE_SIZE,
            shuffle_input_sentence=True,
            num_threads=2,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        return Tokenizer(f"{model_prefix}.model")


def _strip_specials(seq: list[int]) -> list[int]:
    seq = list(seq)
    if EOS_ID in seq:
        seq = seq[: seq.index(EOS_ID)]
    return [i for i in seq if i not in (PAD_ID, BOS_ID)]
