"""``search.latency_engine: onnxruntime``: the fixed latency workload run by the exported ONNX translator.

:func:`onnx_runner` is a :data:`nas.eval.latency.ratio.Runner`: it exports a model (cropped to an arch) with
:func:`nas.export.export_onnx` into a folder of its own under a temporary folder, loads the translator
``nas export --onnx`` ships (``translate_onnx.py``'s :class:`OnnxTranslator`, onnxruntime on the CPU) and returns one
beam search of HAT's fixed workload (Wang et al. 2020, sec. 4) as the call to time: ``[batch, src_tokens]`` dummy
sources, beam ``beam``, exactly ``tgt_tokens`` decoder steps, the same workload PyTorch's runner
(:func:`nas.eval.latency.timing.fixed_workload_run`) runs. The export happens when the call is built, before any
timing; the folder lives as long as the :class:`OnnxRunner`.

Exports are cached by arch id and the model's structure (:func:`structure_key`): the reference arch, timed
beside every candidate, is exported once per runner, not once per candidate. The cache ignores the weights'
values, which the fixed workload's time does not depend on (it runs exactly ``tgt_tokens`` decoder steps, whatever
the tokens are), so a runner must only be used for timing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Mapping

import torch

from nas.eval.latency.timing import fixed_workload_source, fixed_workload_run
from nas.export.onnx import export_onnx
from nas.export.translate_onnx import OnnxTranslator
from nas.model.supernet import SuperTransformer
from nas.space.arch import Arch

__all__ = ["OnnxRunner", "onnx_runner", "structure_key"]


def structure_key(model: SuperTransformer, arch: Arch | None) -> tuple:
    """What decides the exported graph of ``model`` cropped to ``arch`` (None: its widest): the arch id and the
    supernet's constructor options; not the weights' values."""
    arch = arch if arch is not None else model.max_arch
    return (arch.arch_id, model.max_arch.arch_id, model.vocab_size, model.model_dim, model.embed_dim, model.heads,
            model.head_dim, model.relative_positions, model.relative_layers, model.share_layouts, model.max_positions,
            model.pad_id, model.more_features, model.unit_bias_rate, model.io_projection)


class OnnxRunner:
    """A :data:`~nas.eval.latency.ratio.Runner` on onnxruntime with ``threads`` intra-op threads; its exports live in a
    temporary folder removed by :meth:`close` (or when the object is collected)."""

    def __init__(self, spm_model: str | Path, threads: int = 1) -> None:
        self.spm_model, self.threads = Path(spm_model), int(threads)
        self._tmp = tempfile.TemporaryDirectory(prefix="nas-latency-onnx-")
        self._translators: dict[tuple, OnnxTranslator] = {}
        self.exports = 0
        """ONNX exports made so far (one per distinct :func:`structure_key`)."""

    def __call__(self, model: SuperTransformer, arch: Arch | None,
                 workload: Mapping[str, int]) -> Callable[[], None]:
        """Export ``model`` cropped to ``arch`` (None: its widest), unless this runner already exported that structure,
        and return one beam search of ``workload``.

        Raises:
            ValueError: the model is not on the CPU, or the workload is one ``fixed_workload_run`` refuses.
        """
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("search.latency_engine: onnxruntime times on the CPU, but the model is on "
                             f"{next(model.parameters()).device}; set search.latency_device: cpu")
        fixed_workload_run(model, arch, workload)  # the same checks of the workload; nothing is run
        key = structure_key(model, arch)
        translator = self._translators.get(key)
        if translator is None:
            self.exports += 1
            folder = export_onnx(model, Path(self._tmp.name) / f"model{self.exports}", spm_model=self.spm_model,
                                 arch=arch)
            translator = self._translators[key] = OnnxTranslator(folder, threads=self.threads)
        tgt_tokens, beam = int(workload["tgt_tokens"]), int(workload["beam"])
        src = fixed_workload_source(model, workload, torch.device("cpu")).numpy()

        def run() -> None:
            translator.beam_search(src, beam, min_len=tgt_tokens, max_len=tgt_tokens)
        return run

    def close(self) -> None:
        self._translators.clear()
        self._tmp.cleanup()


def onnx_runner(spm_model: str | Path, threads: int = 1) -> OnnxRunner:
    """The runner of ``search.latency_engine: onnxruntime`` (``spm_model``: the sweep's SentencePiece model, which the
    export ships; ``threads``: onnxruntime's intra-op threads, a trial's ``search.cpu_per_trial``)."""
    return OnnxRunner(spm_model, threads)
