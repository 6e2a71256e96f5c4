"""The special token ids: the tokenizer trains SentencePiece with them, the corpus and the batches pad with them.

Stored and encoded sequences carry no BOS/EOS; :meth:`nas.data.TokenCorpus.collate` adds them.
"""

from __future__ import annotations

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID"]

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
