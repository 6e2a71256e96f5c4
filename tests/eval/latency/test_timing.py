"""The timing harness (:mod:`nas.eval.latency.timing`): the fixed workload runs exactly ``tgt_tokens`` decoder steps
whatever the weights, HAT's trimmed mean, and the checks of a workload or a batch against the model."""

from __future__ import annotations

import pytest

from nas.eval.latency import measure_fixed_latency, measure_latency, trimmed_mean
from nas.model import decode
from nas.model.supernet import SuperTransformer
from tests.eval.latency.conftest import MODEL_DIM, tiny_space, tiny_supernet


def test_the_fixed_workload_runs_exactly_tgt_tokens_decoder_steps_whatever_the_weights(monkeypatch):
    steps = []
    real = decode.IncrementalDecoder.step

    def counting(self, tokens):
        steps.append(tokens.size(0))  # rows decoded this step: batch * beam
        return real(self, tokens)

    monkeypatch.setattr(decode.IncrementalDecoder, "step", counting)
    for seed in (0, 1):  # two random supernets: different weights, different argmaxes
        space, supernet = tiny_supernet(seed)
        for arch in (space.narrowest(), space.widest()):
            steps.clear()
            ms = measure_fixed_latency(supernet, arch, src_tokens=7, tgt_tokens=11, beam_size=3, batch_size=2,
                                       repeats=1, warmup=0)
            assert steps == [2 * 3] * 11 and ms > 0  # every step decodes all beams of both sentences
            steps.clear()
            measure_fixed_latency(supernet, arch, src_tokens=7, tgt_tokens=11, beam_size=3, repeats=2, warmup=1)
            assert len(steps) == 3 * 11  # warm-up and timed runs alike


def test_trimmed_mean_drops_the_top_and_bottom_tenth_as_hat_does():
    assert trimmed_mean([float(x) for x in range(1, 21)]) == pytest.approx(10.5)  # 3..18 averaged
    assert trimmed_mean([10.0] * 18 + [0.0, 1000.0]) == 10.0  # one outlier at each end: gone
    assert trimmed_mean([1.0, 2.0, 6.0]) == 3.0  # fewer than 10: all kept
    with pytest.raises(ValueError, match="no timings"):
        trimmed_mean([])


def test_measure_fixed_latency_rejects_a_workload_beyond_the_model():
    _, supernet = tiny_supernet(0)
    with pytest.raises(ValueError, match="tgt_tokens=64 exceed the model's max_positions=64"):
        measure_fixed_latency(supernet, None, tgt_tokens=64)
    with pytest.raises(ValueError, match=r"^repeats=0 must be >= 1; warmup=-1 must be >= 0$"):
        measure_fixed_latency(supernet, None, repeats=0, warmup=-1)


def test_measure_latency_rejects_a_batch_larger_than_the_sentences():
    space, spec = tiny_space({}, encoder_layers=1, decoder_layers=1, kernels=[], ffn_width=32)
    supernet = SuperTransformer(50, MODEL_DIM, 2, space.supernet_maxima(spec), max_positions=32)
    with pytest.raises(ValueError, match="batch_size=4 needs at least 4 sentences; got 2"):
        measure_latency(supernet, None, [[5, 3], [6, 3]], batch_size=4)
