"""Which decoding steps reorder the key/value cache: beam search's, and no greedy step that keeps every row.

Greedy decoding continues each row from itself, so reordering its cache by the identity is pure cost (it
gathered every stored key and value at every step before issue 41).
"""

from __future__ import annotations

import torch

from nas.model import SuperTransformer, beam_search
from nas.model.decode import IncrementalDecoder
from nas.space.arch import Arch, StackArch

ARCH = Arch(*(StackArch((16, 16), (32, 32), (1, 1), (1, 1)) for _ in range(2)))


def _reorders(monkeypatch, beam_size: int) -> tuple[list[list[int]], list[list[int]], int]:
    """Fixed-length search (every sentence ends at step 6): cached and uncached hypotheses, and how many times
    the cached search reordered its decoder state."""
    torch.manual_seed(0)
    model = SuperTransformer(37, 16, 2, ARCH).eval()
    src = torch.randint(4, 37, (3, 5), generator=torch.Generator().manual_seed(1))
    calls = []
    original = IncrementalDecoder.reorder

    def counted(self, index, sentences=None):
        calls.append(index.numel())
        return original(self, index, sentences)

    monkeypatch.setattr(IncrementalDecoder, "reorder", counted)
    kw = dict(beam_size=beam_size, max_len_a=0.0, max_len_b=6, min_len=6)
    cached = beam_search(model, src, ARCH, **kw)
    uncached = beam_search(model, src, ARCH, use_cache=False, **kw)
    return cached, uncached, len(calls)


def test_greedy_search_keeping_every_row_never_reorders_the_cache(monkeypatch):
    cached, uncached, reorders = _reorders(monkeypatch, beam_size=1)
    assert cached == uncached and [len(h) for h in cached] == [5] * 3
    assert reorders == 0


def test_beam_search_reorders_the_cache_every_step_but_the_last(monkeypatch):
    cached, uncached, reorders = _reorders(monkeypatch, beam_size=4)
    assert cached == uncached and [len(h) for h in cached] == [5] * 3
    assert reorders == 5  # steps 1..5; the sixth forces EOS and ends the search
