"""Decoding state of incremental (key/value-cached) decoding, one object per decoder layer.

The decoder layer runs the same code over a whole target (no cache) and over one new position
(with a :class:`LayerCache`): each sublayer takes its part of the state, as torchtune's
``KVCache`` does. The state holds

- :class:`KVCache` for the self-attention (keys/values appended every step) and the
  cross-attention (keys/values of the encoder memory, computed once);
- :class:`ConvCache`, the last ``K - 1`` values of Prime's causal convolution;
- ``memo``: weights cropped (and folded) once per batch by the sublayers, so a step does no
  cropping (a dict keyed by the sublayer's name).

Two storage modes: ``capacity > 0`` preallocates the self-attention buffers (doubled when full;
eager decoding, :class:`nas.model.decode.IncrementalDecoder`); ``capacity == 0`` concatenates,
so a step's state is a function of the previous one (``SuperTransformer.decode_step`` and the
exported ONNX decoder step: past in, present out).

Preallocated storage follows beam search's reordering by gathering the filled positions into a second
buffer of the same shape (``index_select(..., out=)``), which then becomes the current one: one pass over the
keys and values a step, where gathering into a temporary and copying it back made two and an allocation
(``copy_`` was 16% of a batch-32, beam-4 decoding profile, issue 41).
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "ConvCache", "LayerCache"]


class KVCache:
    """Keys and values of one attention sublayer, each ``[G, n, B*h, T, dh]`` (time at axis 3, rows at 1).

    Args:
        capacity: initial buffer length (positions) for preallocated storage; 0 concatenates.
        k, v: initial contents (the ONNX interface's past state, or cross-attention keys/values).
    """

    def __init__(self, capacity: int = 0, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> None:
        self.capacity = capacity
        self.k, self.v = k, v
        self.length = 0 if k is None else k.size(3)  # filled positions
        self.memo: dict = {}
        self._kv: torch.Tensor | None = None  # preallocated storage: [2, G, n, B*h, T_max, dh], k and v its halves
        self._spare: torch.Tensor | None = None  # the buffer :meth:`reorder` gathers into (shape of _kv), or None
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None  # k, v as [N, T_max, dh] (preallocated storage)

    @property
    def filled(self) -> bool:
        """True once keys/values are stored (cross-attention: computed from the memory)."""
        return self.k is not None

    def set(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store fixed keys/values ``[G, n, B*h, s, dh]`` (cross-attention over the encoder memory)."""
        self.k, self.v, self.length = k, v, k.size(3)
        self.memo.pop("kv", None)
        self._flat = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the newest positions ``k, v [G, n, B*h, t, dh]``; return every position so far ``[G, n, B*h, T, dh]``."""
        if not self.capacity:
            if self.k is not None:
                k, v = torch.cat([self.k, k], 3), torch.cat([self.v, v], 3)
            self.set(k, v)
            return k, v
        start, end = self.length, self.length + k.size(3)
        self._reserve(k, end)
        self.k.narrow(3, start, end - start).copy_(k)
        self.v.narrow(3, start, end - start).copy_(v)
        self.length = end
        return self.k.narrow(3, 0, end), self.v.narrow(3, 0, end)

    def _reserve(self, k: torch.Tensor, end: int) -> None:
        """Preallocated storage: make the buffers hold ``end`` positions (allocate, or double until they do). Keys
        and values share one buffer ``[2, G, n, B*h, T_max, dh]`` (:attr:`k`, :attr:`v` its two halves), so a
        step writes both with one copy (:meth:`step`)."""
        if self.k is None:
            kv = k.new_zeros((2, *k.shape[:3], max(self.capacity, end), k.size(4)))
        elif end > self.k.size(3):
            kv = self._kv
            while end > kv.size(4):
                kv = torch.cat([kv, torch.zeros_like(kv)], 4)
        else:
            return
        self._kv, self.k, self.v = kv, kv[0], kv[1]
        self._flat = self._spare = None  # the spare no longer fits: reorder allocates one of the new shape

    def step(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one position's keys and values ``kv [G, n, 2, B*h, dh]`` (keys at index 0 of axis 2, as the
        self-attention's projection lays them out); return every position so far as the two operands of
        :func:`~nas.model.ops.attend_cached`: keys transposed ``[N, dh, T]`` and values ``[N, T, dh]``
        (N = G*n*B*h; views of the buffer with preallocated storage)."""
        if not self.capacity:
            k, v = kv.unsqueeze(4).unbind(2)
            k, v = self.append(k, v)
            return k.flatten(0, 2).transpose(1, 2), v.flatten(0, 2)
        pos = self.length
        if self.k is None or pos >= self.k.size(3):
            self._reserve(kv.select(2, 0).unsqueeze(3), pos + 1)  # allocates or grows the buffer
        self._kv.select(4, pos).copy_(kv.permute(2, 0, 1, 3, 4))  # keys and values: one copy
        self.length = pos + 1
        if self._flat is None:  # views of the buffer, rebuilt only when it is replaced
            self._flat = self.k.flatten(0, 2), self.v.flatten(0, 2)  # [N, T_max, dh]
        kf, vf = self._flat
        return kf[:, :pos + 1].transpose(1, 2), vf[:, :pos + 1]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index [n']`` (beam search's surviving hypotheses, or the sentences left)."""
        if self.k is None:
            return
        if self.capacity:
            self._gather(index)
        else:
            self.k, self.v = self.k.index_select(1, index), self.v.index_select(1, index)
        for key in ("bias", "kv"):  # views of the rows: rebuilt from the kept rows
            self.memo.pop(key, None)

    def _gather(self, index: torch.Tensor) -> None:
        """Preallocated storage: rows ``index [n']`` of the filled positions, keys and values in one
        ``index_select`` into the spare buffer (same row count: allocated once, then the two buffers take turns;
        fewer rows, as sentences finish: a new buffer of ``n'`` rows), which becomes :attr:`_kv`. The positions
        after :attr:`length` are left as they are: :meth:`step` writes each before any read."""
        kv, n = self._kv, self.length  # kv [2, G, rows, B*h, T_max, dh]
        if index.numel() == kv.size(2):
            spare = self._spare
            if spare is None or spare.shape != kv.shape:  # first reorder, or the buffer grew
                spare = torch.empty_like(kv)
        else:
            spare = kv.new_empty((*kv.shape[:2], index.numel(), *kv.shape[3:]))
        torch.index_select(kv.narrow(4, 0, n), 2, index, out=spare.narrow(4, 0, n))
        self._kv, self._spare = spare, kv if index.numel() == kv.size(2) else None
        self.k, self.v, self._flat = spare[0], spare[1], None


class ConvCache:
    """The last ``K - 1`` values ``[U, n, K-1, D]`` of Prime's causal convolution (K: the largest kernel)."""

    def __init__(self, window: torch.Tensor | None = None) -> None:
        self.window = window
        self.memo: dict = {}

    def extend(self, v: torch.Tensor, size: int) -> torch.Tensor:
        """Values of the newest positions ``v [U, n, t, D]`` -> ``[U, n, K-1+t, D]`` (the past ``K - 1`` first,
        zeros before the first position); keeps the last ``K - 1`` (``K = size``)."""
        past = self.window
        if past is None:
            past = v.new_zeros(v.size(0), v.size(1), size - 1, v.size(-1))
        padded = torch.cat([past, v], 2)  # [U, n, K-1+t, D]
        self.window = padded[:, :, padded.size(2) - (size - 1):]
        return padded

    def reorder(self, index: torch.Tensor) -> None:
        if self.window is not None:
            self.window = self.window.index_select(1, index)


class LayerCache:
    """The incremental-decoding state of one decoder layer (see the module docstring).

    Args:
        capacity: the self-attention buffers' initial length (positions); 0 concatenates.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.self_attn = KVCache(capacity)
        self.cross_attn = KVCache()
        self.conv = ConvCache()
        self.memo: dict = {}

    def reorder(self, index: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Keep rows ``index [n']`` of the per-hypothesis state (self-attention keys/values, the
        convolution window) and, with ``sentences [n']``, of the cross-attention keys/values."""
        self.self_attn.reorder(index)
        self.conv.reorder(index)
        if sentences is not None:
            self.cross_attn.reorder(sentences)

    def to_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state as plain tensors: ``{"self": {"k", "v"}, "cross": {"ck", "cv"}, "conv": {"v"}}``
        (parts not yet filled left out): the ONNX decoder step's ``past.*``/``present.*`` names."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        if self.self_attn.filled:
            out["self"] = {"k": self.self_attn.k, "v": self.self_attn.v}
        if self.cross_attn.filled:
            out["cross"] = {"ck": self.cross_attn.k, "cv": self.cross_attn.v}
        if self.conv.window is not None:
            out["conv"] = {"v": self.conv.window}
        return out

    @classmethod
    def from_dict(cls, parts: dict[str, dict[str, torch.Tensor]]) -> "LayerCache":
        """Inverse of :meth:`to_dict` (concatenating storage)."""
        cache = cls()
        if "self" in parts:
            cache.self_attn.set(parts["self"]["k"], parts["self"]["v"])
        if "cross" in parts:
            cache.cross_attn.set(parts["cross"]["ck"], parts["cross"]["cv"])
        if "conv" in parts:
            cache.conv.window = parts["conv"]["v"]
        return cache
