"""The key/value cache's preallocated storage against its concatenating storage, and its reordering's cost.

Beam search reorders the cache at every step; the preallocated storage gathers the filled positions into a
second buffer that then becomes the current one (issue 41). The concatenating storage (``capacity=0``, the
ONNX decoder step's) is the reference: whatever the two are asked, they must hold the same keys and values.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from nas.model.kv_cache import KVCache

G, H, DH = 2, 3, 4  # groups, heads (branches x heads), head width


def _step_kv(n: int, seed: int) -> torch.Tensor:
    """One position's keys and values of ``n`` rows ``[G, n, 2, H, dh]`` (the self-attention projection's layout)."""
    return torch.randn(G, n, 2, H, DH, generator=torch.Generator().manual_seed(seed))


def _both(cache: KVCache, ref: KVCache, kv: torch.Tensor) -> None:
    """Step both caches with ``kv`` and check the attention operands they return (keys transposed, values)."""
    kt, v = cache.step(kv)
    kt_ref, v_ref = ref.step(kv)
    assert torch.equal(kt, kt_ref) and torch.equal(v, v_ref)


def test_preallocated_cache_follows_growth_reorders_and_fewer_rows_as_the_concatenating_one():
    """Buffers that start too short (they double), same-row reorders (the two buffers take turns, also right after
    a growth), then fewer rows (sentences finished): the stored keys and values equal the reference's each step."""
    cache, ref = KVCache(capacity=2), KVCache()
    n, seed = 5, 0
    script = ["step", "step", "step", "reorder", "step", "reorder", "reorder", "step", "step", "shrink", "step",
              "reorder", "step"]
    for op in script:
        seed += 1
        if op == "step":
            _both(cache, ref, _step_kv(n, seed))
        else:
            rows = n - 2 if op == "shrink" else n
            index = torch.randint(0, n, (rows,), generator=torch.Generator().manual_seed(seed))
            cache.reorder(index)
            ref.reorder(index)
            n = rows
        assert cache.length == ref.length
        filled = cache.length
        assert torch.equal(cache.k[:, :, :, :filled], ref.k) and torch.equal(cache.v[:, :, :, :filled], ref.v)
    assert cache.k.size(3) >= 8 > 2  # it grew


def test_same_row_reorder_gathers_once_into_the_spare_buffer_without_a_copy():
    """A reorder that keeps the row count is one ``index_select`` into the other buffer (no temporary copied back:
    ``copy_`` was 16% of a batch-32 beam-4 profile), and the two buffers then take turns: no allocation after the
    first reorder."""
    cache = KVCache(capacity=8)
    for seed in range(3):
        cache.step(_step_kv(4, seed))
    index = torch.tensor([2, 0, 0, 3])
    expected_k = cache.k[:, :, :, :3].index_select(1, index)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cache.reorder(index)
    ops = {e.key: e.count for e in prof.key_averages()}
    assert ops.get("aten::index_select") == 1
    assert "aten::copy_" not in ops, ops
    assert torch.equal(cache.k[:, :, :, :3], expected_k)
    first = cache._kv.data_ptr()
    cache.reorder(index)
    second = cache._kv.data_ptr()
    cache.reorder(index)
    assert second != first and cache._kv.data_ptr() == first  # two buffers, alternating
