"""``nas.export.sgemm``: oneDNN's ``dnnl_sgemm`` called from an AOT package through its C shim.

The reference is the same product in float64 (``torch.mm`` of the float64 operands), not the op's eager
implementation: the claim is about what the package computes. That the package calls the shim, and not a fallback,
is read from its generated wrapper."""

from __future__ import annotations

import shutil
import zipfile

import pytest
import torch
from torch import nn

from nas.export import sgemm
from nas.export.aot import _compile
from nas.export.aot_products import ProductLayout

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class _Products(nn.Module):
    """``relu(x W1 + b1) W2`` with ``x [M, 37]``, ``W1 [37, 2100]`` (wider than ``PACK_WIDE``), ``W2 [2100, 5]``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.l1 = nn.Linear(37, 2100)
        self.l2 = nn.Linear(2100, 5, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))

    def float64(self, x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2 = (p.detach().double() for p in (self.l1.weight, self.l1.bias, self.l2.weight))
        return (torch.relu(x.double() @ w1.t() + b1) @ w2.t()).float()


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cache = tmp_path_factory.mktemp("sgemm_cache")
    if not sgemm.load(cache):
        pytest.skip("no libdnnl.so.3 (pip install 'nas[serve]' installs onednn-cpu-gomp) or no C++ compiler")
    return cache


@pytest.mark.slow  # one package: about 10 s on 2 cores
@pytest.mark.parametrize("pack, calls", [("sgemm", 2), ("sgemm-wide", 1)])
def test_a_package_multiplies_through_the_shim_as_float64_does(shim, tmp_path, pack, calls):
    from torch.export import Dim

    model = _Products().eval()
    program = torch.export.export(model, (torch.randn(4, 37),), dynamic_shapes=({0: Dim("rows", min=1, max=4096)},))
    with torch.no_grad():  # freezing: the weights become the graph's constants, which the pass reads
        path = _compile(program, tmp_path / "products.pt2", {"freezing": True, "cpp.weight_prepack": False},
                        ProductLayout(pack))
    with zipfile.ZipFile(path) as package:
        wrapper = "".join(package.read(n).decode() for n in package.namelist() if n.endswith(".wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_dnnl_sgemm(") == calls + 1  # the declaration, then each call
    runner = torch._inductor.aoti_load_package(str(path))
    g = torch.Generator().manual_seed(1)
    for rows in (1, 4, 130):
        x = torch.randn(rows, 37, generator=g)
        with torch.no_grad():
            got = runner(x)
        want = model.float64(x)
        assert got.shape == (rows, 5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_load_is_false_without_libdnnl(monkeypatch, tmp_path):
    monkeypatch.setattr(sgemm, "_loaded", None)
    monkeypatch.setattr(sgemm, "find_dnnl", lambda: None)
    assert sgemm.load(tmp_path) is False
    assert not (tmp_path / "sgemm").exists()  # nothing built, nothing written


def test_the_op_is_a_product_eagerly_and_in_shape_propagation():
    x, w = torch.randn(3, 4), torch.randn(4, 6)
    torch.testing.assert_close(torch.ops.nas.dnnl_sgemm(x, w), x.double().mm(w.double()).float())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        out = torch.ops.nas.dnnl_sgemm(mode.from_tensor(x), mode.from_tensor(w))
    assert out.shape == (3, 6)


def test_a_failed_build_is_a_warning_and_leaves_no_library(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(sgemm, "_loaded", None)
    monkeypatch.setattr(sgemm, "find_dnnl", lambda: tmp_path / "libdnnl.so.3")
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with caplog.at_level("WARNING", logger="nas.native"):
        assert sgemm.load(tmp_path) is False
    assert f"could not build nas_dnnl_sgemm ({shutil.which('false')} " in caplog.text  # the command, named
    assert list((tmp_path / "sgemm").iterdir()) == []  # no library, no build folder left
