"""Parallel-text data: streaming preparation, a joint SentencePiece tokenizer, memory-mapped token ids, batching.

Pipeline: :func:`prepare_data` streams the four raw text files (gzip or plain, one sentence a line),
trains one joint SentencePiece model on a sample of the training pairs, encodes the training pairs in
shards on all cores and writes the content-addressed cache folder: ``spm.model``, ``train.arrow`` (an
uncompressed Arrow IPC file, memory-mapped by every training process) and ``valid.parquet`` (the small
validation split, with its text for BLEU). :class:`TokenCorpus` holds a split as flat token ids (numpy
views over the mapped file: no Python object per sentence), :class:`TokenBatcher` cuts it into
fairseq-style token-count batches and :meth:`TokenCorpus.collate` pads them into ``int64`` tensors
(:class:`Batch`) with numpy fancy indexing.

Token ids: ``PAD_ID=0``, ``UNK_ID=1``, ``BOS_ID=2``, ``EOS_ID=3``. Stored and encoded
sequences carry no BOS/EOS; :func:`collate` adds them.

What lives where (each module imports only those above it; every public name below is re-exported here and
loaded on first use, PEP 562, so ``from nas.data import BOS_ID`` loads neither pyarrow nor sentencepiece):

- :mod:`nas.data.errors`: :class:`DataError`.
- :mod:`nas.data.ids`: the special token ids.
- :mod:`nas.data.text`: :func:`read_lines` and the streaming readers of the raw parallel files (line counts,
  the tokenizer's seeded sample).
- :mod:`nas.data.tokenizer`: :class:`Tokenizer`, the joint SentencePiece model (train, encode, decode).
- :mod:`nas.data.batch`: :class:`Batch`, the padded tensors of a step.
- :mod:`nas.data.corpus`: :class:`TokenCorpus` (flat ids, memory-mapped), :func:`collate`, the ``train.arrow``
  format.
- :mod:`nas.data.batcher`: :class:`TokenBatcher` and :func:`length_batches` over one max-tokens cut.
- :mod:`nas.data.prepared`: :class:`PreparedData`, a finished cache folder and its readers.
- :mod:`nas.data.encode`: the shards of a preparation and who encodes them (:class:`ShardEncoders`,
  :data:`EncodersFactory`, :func:`encode_pairs`, :func:`write_shard`; local worker processes).
- :mod:`nas.data.cache`: :func:`prepare_data`: the cache entry's key, lock, work folder and publication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nas.lazy import lazy_exports

_MODULES = {
    "errors": ("DataError",),
    "ids": ("BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID"),
    "text": ("read_lines",),
    "tokenizer": ("Tokenizer",),
    "batch": ("Batch",),
    "corpus": ("TokenCorpus", "collate"),
    "batcher": ("TokenBatcher", "length_batches"),
    "prepared": ("PreparedData",),
    "encode": ("EncodersFactory", "ShardEncoders", "encode_pairs", "write_shard"),
    "cache": ("prepare_data",),
}
"""Submodule -> the public names it exports here."""
_HOMES = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "Batch",
    "DataError",
    "EncodersFactory",
    "PreparedData",
    "ShardEncoders",
    "TokenBatcher",
    "TokenCorpus",
    "Tokenizer",
    "collate",
    "encode_pairs",
    "length_batches",
    "prepare_data",
    "read_lines",
    "write_shard",
]

if TYPE_CHECKING:
    from nas.data.batch import Batch
    from nas.data.batcher import TokenBatcher, length_batches
    from nas.data.cache import prepare_data
    from nas.data.corpus import TokenCorpus, collate
    from nas.data.encode import EncodersFactory, ShardEncoders, encode_pairs, write_shard
    from nas.data.errors import DataError
    from nas.data.ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
    from nas.data.prepared import PreparedData
    from nas.data.text import read_lines
    from nas.data.tokenizer import Tokenizer


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
