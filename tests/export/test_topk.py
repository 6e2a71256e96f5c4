"""``nas.export.topk``: the candidates' top-k called from an AOT package through its C shim.

The reference is a loop written out here (each row's entries ranked by value, the first of tied ones first), not
the op's eager implementation (``torch.topk``): the claim is about what the package computes. That the package calls
the shim, and not ATen's ``topk``, is read from its generated wrapper."""

from __future__ import annotations

import math
import zipfile

import pytest
import torch
from torch import nn

from nas.export import topk
from nas.export.aot import _compile

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class _Ranked(nn.Module):
    """The top ``k`` of ``x [n, m] + 1`` (the addition: the op reads a buffer the package's own kernel wrote)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.nas.small_topk(x + 1.0, self.k)


def _loop(row: list[float], k: int) -> tuple[list[float], list[int]]:
    """Each entry ranked by value, descending; tied entries in their order in the row."""
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
    return [row[j] for j in order], order


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cache = tmp_path_factory.mktemp("topk_cache")
    if not topk.load(cache):
        pytest.skip("no C++ compiler ($CXX or g++)")
    return cache


@pytest.mark.slow  # one package: about 10 s on 2 cores
def test_a_package_ranks_through_the_shim_as_the_loop_does(shim, tmp_path):
    from torch.export import Dim

    program = torch.export.export(_Ranked(8), (torch.randn(3, 40),),
                                  dynamic_shapes=({0: Dim("rows", min=1, max=4096), 1: Dim("m", min=8, max=1 << 20)},))
    with torch.no_grad():
        path = _compile(program, tmp_path / "topk.pt2", {}, small_topk=True)
    with zipfile.ZipFile(path) as package:
        wrapper = "".join(package.read(n).decode() for n in package.namelist() if n.endswith(".wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_small_topk(") == 2  # the declaration, then the call
    assert "aoti_torch_cpu_topk(" not in wrapper
    runner = torch._inductor.aoti_load_package(str(path))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 600, generator=g)
    x[1, 100:] = -math.inf  # 100 finite entries, then -inf ones
    x[2, 3:] = -math.inf  # 3 finite entries, then -inf ones: the first -inf entries fill the other 5 places
    x[3] = torch.randint(0, 4, (600,), generator=g).float()  # ties everywhere
    x[4, :8] = torch.arange(8.0)  # ascending: every entry of the first 8 moves in the slots
    for rows in (x, x[:1, :8], torch.randn(2, 9, generator=g)):
        with torch.no_grad():
            values, indices = runner(rows)
        assert values.shape == indices.shape == (rows.size(0), 8) and indices.dtype == torch.long
        for i, row in enumerate((rows + 1.0).tolist()):
            want_values, want_indices = _loop(row, 8)
            assert values[i].tolist() == want_values
            assert indices[i].tolist() == want_indices


def test_the_op_is_topk_eagerly_and_in_shape_propagation():
    x = torch.randn(4, 50)
    values, indices = torch.ops.nas.small_topk(x, 6)
    ref_values, ref_indices = x.topk(6, dim=1)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_values, fake_indices = torch.ops.nas.small_topk(mode.from_tensor(x), 6)
    assert fake_values.shape == fake_indices.shape == (4, 6) and fake_indices.dtype == torch.long


def test_load_is_false_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(topk, "_loaded", None)
    monkeypatch.setattr(topk, "compiler", lambda: None)
    assert topk.load(tmp_path) is False
    assert not (tmp_path / "topk").exists()  # nothing built, nothing written
