"""nas.data.batch: a Batch moves to a device whole."""

from __future__ import annotations

from nas.data import collate


def test_batch_to_moves_every_tensor() -> None:
    moved = collate([[10]], [[30]]).to("meta")
    assert {t.device.type for t in (moved.src, moved.tgt_in, moved.tgt_out)} == {"meta"}
    assert moved.ntokens == 2
