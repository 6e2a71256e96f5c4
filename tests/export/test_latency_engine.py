"""``search.latency_engine: onnxruntime``: the fixed workload timed on the exported ONNX translator."""

from __future__ import annotations

import pytest
import torch

from nas.eval.latency import measure_latency_ratio
from nas.export.latency_engine import onnx_runner
from tests.eval.latency.conftest import deep_and_shallow

WORKLOAD = {"src_tokens": 10, "tgt_tokens": 8, "beam": 2, "batch": 1}


def test_onnxruntime_runs_exactly_the_workload_s_decoder_steps_and_the_deeper_arch_is_slower(tiny_data,
                                                                                              translator_steps):
    """Both models exported and run by ``translate_onnx.py``'s beam search; each run is ``tgt_tokens`` decoder
    steps (counted on the translator, not on our model), and the deep widest arch is slower than the narrowest."""
    space, supernet = deep_and_shallow()
    runner = onnx_runner(tiny_data.spm_model, threads=1)
    try:
        m = measure_latency_ratio(supernet, space.widest(), supernet, space.narrowest(), workload=WORKLOAD, rounds=3,
                                  warmup=1, runner=runner)
    finally:
        runner.close()
    runs = 2 * 1 + 3 + 4  # warm-up 1 of each, then R0 C0 R1 C1 R2 C2 R3
    assert len(translator_steps) == WORKLOAD["tgt_tokens"] * runs
    assert m["latency_ratio"] > 1.2, m


def test_onnxruntime_refuses_a_model_off_the_cpu(tiny_data):
    runner = onnx_runner(tiny_data.spm_model)
    with pytest.raises(ValueError, match="latency_engine: onnxruntime times on the CPU, but the model is on meta"):
        runner(torch.nn.Linear(1, 1, device="meta"), None, WORKLOAD)
    runner.close()
