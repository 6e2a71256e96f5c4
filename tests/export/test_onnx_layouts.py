"""ONNX export of a supernet with separate layouts (``share_layouts=False``) and relative positions only in
layers with MUTE units (``relative_layers="units"``): onnxruntime's logits equal PyTorch's."""

import pytest
import torch

from nas.data import Tokenizer, read_lines
from nas.export import load_export
from nas.export.onnx import export_onnx, verify_onnx
from nas.model import SuperTransformer
from nas.space.arch import Arch, StackArch

# Encoder: layer 0 runs two units (relative positions), layer 1 one unit (none), Prime; decoder: a Prime layer
# with kernels running its own attentions, FFN and causal convolution.
ARCH = Arch(StackArch((32, 16), (64, 32), (2, 1), (1, 1), ("sequential", "prime"), ((), (3,)), (2, 1)),
            StackArch((32, 16), (64, 32), (2, 2), (2, 1), ("sequential", "prime"), ((), (3, 5)), (1, 2)))
MAXIMA = Arch(*(StackArch((32, 32), (64, 64), (2, 2), (2, 2), ("sequential+prime",) * 2, ((3, 5), (3, 5)), (2, 2))
                for _ in range(2)))

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # tests/conftest.py
              pytest.mark.slow]  # ONNX exports: 15-35 s on 2 cores, out of the inner loop (pytest -m "not slow")


@pytest.fixture(scope="module")
def tokenizer(multi30k, tmp_path_factory) -> Tokenizer:
    lines = read_lines(multi30k / "train.en.gz", limit=300) + read_lines(multi30k / "train.de.gz", limit=300)
    return Tokenizer.train(lines, tmp_path_factory.mktemp("spm") / "spm", vocab_size=300)


def test_onnxruntime_logits_match_pytorch_with_separate_layouts_and_relative_positions_in_unit_layers(
        tokenizer, multi30k, tmp_path):
    torch.manual_seed(0)
    model = SuperTransformer(tokenizer.vocab_size, 32, 2, MAXIMA, max_positions=64, relative_positions=3,
                             relative_layers="units", share_layouts=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    out = export_onnx(model.eval(), tmp_path / "onnx", spm_model=tokenizer.model_path, arch=ARCH)
    sub = load_export(out).model
    assert sub.config()["share_layouts"] is False and sub.config()["relative_layers"] == "units"
    assert [hasattr(layer.prime_attn if i else layer.attn, "rel_k") for i, layer in enumerate(sub.encoder)] == [True,
                                                                                                              False]
    assert verify_onnx(out, read_lines(multi30k / "test_2016_flickr.en.gz", limit=4), steps=5) <= 1e-4
