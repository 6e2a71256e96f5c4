"""Cross-attention with the memory once per sentence (``MultiBranchAttention._cached``; the AOT-compiled step's
layout): each sentence's beams attend to its keys/values together. The reference is the same decoding with the
memory repeated per beam (one row per hypothesis, the eager decoder's layout, itself checked against the full
pass in ``test_decoding.py``): the same logits within 1e-5 over several steps, for a plain arch and for one with
branches, paths, units, a Prime layer and HAT's attention over two encoder layers."""

from __future__ import annotations

import pytest
import torch

from nas.data import BOS_ID
from nas.export.onnx import sample_src
from nas.model import SuperTransformer
from tests.export.archs import MIXED, MIXED_MAXIMA, PLAIN, varied

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.mark.parametrize("arch, maxima", [(PLAIN, PLAIN), (MIXED, MIXED_MAXIMA)], ids=["plain", "mixed"])
@torch.no_grad()
def test_beams_attending_their_sentences_memory_together_give_the_per_row_logits(arch, maxima):
    torch.manual_seed(0)
    model = varied(SuperTransformer(60, 32, 2, maxima, max_positions=32))
    beams, sentences = 3, 2
    src = sample_src(model, sentences, 6)  # row 0 padded: the key padding mask is per sentence too
    memory, src_pad = model.encode(src, arch)  # [n, s, C], [n, s]
    rows = torch.arange(sentences).repeat_interleave(beams)
    per_row, per_sentence = [{} for _ in model.decoder], [{} for _ in model.decoder]
    tokens = torch.full((sentences * beams, 1), BOS_ID)
    for step in range(4):
        want = model.decode_step(tokens, step, memory[rows], src_pad[rows], arch, per_row)
        got = model.decode_step(tokens, step, memory, src_pad, arch, per_sentence)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        tokens = torch.randint(4, 60, (sentences * beams, 1))  # each row its own history
    assert per_sentence[0]["cross"]["ck"].size(1) == sentences  # the keys stayed one row per sentence
    assert per_row[0]["cross"]["ck"].size(1) == sentences * beams
