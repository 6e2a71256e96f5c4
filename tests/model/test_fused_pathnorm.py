"""``nas.model.fused``: the fused PathNorm (Multi-Path eq. 6) against a float64 loop transcription of the equation,
its gradients against autograd through that transcription, and the fallback to ATen's kernels."""

from __future__ import annotations

import shutil

import pytest
import torch

from nas import native
from nas.model import fused
from nas.model.paths import PathFusion

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the fused kernel")


def _eq6(ys, weight, bias, keep, eps=1e-5):
    """``out[u, n] = sum_i keep[u, i, n // T] * (gamma_i * (y - mean) / sqrt(var + eps) + beta_i)``, row by row."""
    units, paths, bsz, t, c = ys.shape
    rows = []
    for u in range(units):
        for s in range(bsz):
            for j in range(t):
                total = torch.zeros(c, dtype=torch.float64)
                for i in range(paths):
                    y = ys[u, i, s, j].double()
                    mean = y.sum() / c
                    var = ((y - mean) ** 2).sum() / c
                    k = 1.0 if keep is None else keep[u, i, s].double()
                    normed = (y - mean) / torch.sqrt(var + eps)
                    total = total + k * (weight[u, i].double() * normed + bias[u, i].double())
                rows.append(total)
    return torch.stack(rows).view(units, bsz, t, c)


def _inputs(dtype, keep=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    units, paths, bsz, t, c = 2, 3, 3, 2, 40  # C not a multiple of a vector's width: the loops' tails run too
    ys = (torch.randn(units, paths, bsz, t, c, generator=gen) * 3 + 1).to(dtype)
    weight = torch.randn(units, paths, c, generator=gen).to(dtype)
    bias = torch.randn(units, paths, c, generator=gen).to(dtype)
    mask = torch.tensor([[[1.0, 0.0, 2.0], [0.0, 2.0, 2.0], [2.0, 2.0, 0.0]]] * units)  # 0: a dropped path
    return ys, weight, bias, (mask.to(dtype) if keep else None)


@pytest.mark.parametrize("in_dtype, out_dtype, tol", [
    (torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.float32, 1e-5),
    (torch.float32, torch.bfloat16, 2e-2), (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keep", [True, False])
def test_forward_and_gradients_equal_the_equation_in_float64(in_dtype, out_dtype, tol, keep):
    ys, weight, bias, mask = _inputs(in_dtype, keep)
    assert fused.available(ys, out_dtype)
    out, mean, rstd = fused.pathnorm_forward(ys, weight, bias, mask, out_dtype, 1e-5)
    y64, w64, b64 = (a.double().requires_grad_() for a in (ys, weight, bias))
    ref = _eq6(y64, w64, b64, mask)
    assert out.dtype == out_dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol * 4)

    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(out_dtype)
    ref.backward(grad.double())
    dys, dw, db = fused.pathnorm_backward(grad, ys, weight, mask, mean, rstd)
    assert (dys.dtype, dw.dtype, db.dtype) == (in_dtype, in_dtype, in_dtype)
    grad_tol = 1e-5 if in_dtype == torch.float32 else 2e-2  # the gradients are rounded to ys' dtype once
    for got, want in ((dys, y64.grad), (dw, w64.grad), (db, b64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=grad_tol, atol=grad_tol * 8)
    if keep:  # a dropped path gets no gradient at all
        assert dys[0, 0, 1].abs().max() == 0 and dys[0, 2, 2].abs().max() == 0


def test_threads_split_rows_not_results():
    """Any thread count gives the same values; a given count gives the same bits every time (the weights' gradients
    are summed per thread, then over the threads in their order, not in the order they finish)."""
    gen = torch.Generator().manual_seed(2)
    ys, weight, bias = torch.randn(1, 3, 64, 8, 40, generator=gen), torch.randn(1, 3, 40), torch.randn(1, 3, 40)
    grad = torch.randn(1, 64, 8, 40, generator=gen)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2, *[4] * 10):
            torch.set_num_threads(threads)
            out, mean, rstd = fused.pathnorm_forward(ys, weight, bias, None, torch.float32, 1e-5)
            run = (out, *fused.pathnorm_backward(grad, ys, weight, None, mean, rstd))
            if threads in results:
                for a, b in zip(results[threads], run):
                    assert torch.equal(a, b)
            results[threads] = run
    finally:
        torch.set_num_threads(before)
    for one, many in zip(results[1], results[4]):
        torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-4)  # sums of 512 rows in other orders


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fusion_trains_through_the_kernel_as_through_atens(monkeypatch, dtype):
    """PathFusion.fuse with gradients: the fused kernel and ATen's (``NAS_FUSED_KERNELS=0``) give the same output and
    gradients, drop masks included."""
    fusion = PathFusion(40, max_paths=3).to(dtype)
    with torch.no_grad():
        for p in fusion.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(1, 3, 2, 40, dtype=dtype)
    ys0 = torch.randn(3, 3, 2, 40, dtype=dtype)
    keep = torch.tensor([[1.0, 0.0, 2.0], [2.0, 2.0, 0.0], [0.0, 2.0, 2.0]])
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("NAS_FUSED_KERNELS", flag)
        fusion.zero_grad()
        ys = ys0.clone().requires_grad_()
        out = fusion.fuse(x, ys, keep)
        out.float().square().sum().backward()
        results.append((out.detach(), ys.grad, fusion.pathnorm_weight.grad, fusion.alpha.grad))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(*results):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * 8)


def test_a_failed_build_leaves_atens_kernels_and_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setenv("NAS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with caplog.at_level("WARNING", logger="nas.native"):
        assert fused.available(torch.zeros(1, 2, 1, 1, 4), torch.float32) is False
    assert f"could not build nas_pathnorm ({shutil.which('false')} " in caplog.text
    assert list(tmp_path.iterdir()) == []  # no library, no build folder left
    with pytest.raises(RuntimeError, match="available"):
        fused.pathnorm_forward(torch.zeros(1, 2, 1, 1, 4), torch.ones(1, 2, 4), torch.zeros(1, 2, 4), None,
                               torch.float32, 1e-5)


def test_the_switch_and_other_dtypes_keep_atens_kernels(monkeypatch):
    ys = torch.zeros(1, 2, 1, 1, 4)
    assert fused.available(ys, torch.float32)
    assert not fused.available(ys.double(), torch.float64)
    assert not fused.available(ys.half(), torch.float32)
    monkeypatch.setenv("NAS_FUSED_KERNELS", "0")
    assert not fused.available(ys, torch.float32)


def test_a_cache_folder_that_cannot_be_written_is_a_warning_not_a_crash(monkeypatch, tmp_path, caplog):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(fused, "_lib", None)
    monkeypatch.setenv("NAS_KERNEL_CACHE", str(blocked / "kernels"))  # under a file: mkdir fails
    with caplog.at_level("WARNING", logger="nas.native"):
        assert fused.available(torch.zeros(1, 2, 1, 1, 4), torch.float32) is False
    assert "could not build nas_pathnorm in" in caplog.text
    assert blocked.read_text() == "not a folder"


def test_another_cpu_builds_another_library(monkeypatch, tmp_path):
    # the kernel is built with -march=native: a cache folder shared by two CPUs (a home folder on a cluster) must not
    # hand one CPU's instructions to the other (nas.native.build_library's key)
    monkeypatch.setenv("NAS_KERNEL_CACHE", str(tmp_path))
    built = []
    for flags in ("flags\t: fpu avx2", "flags\t: fpu avx2 avx512f", "flags\t: fpu avx2"):
        monkeypatch.setattr(fused, "_lib", None)
        monkeypatch.setattr(fused, "cpu_flags", lambda flags=flags: flags)
        assert fused.available(torch.zeros(1, 2, 1, 1, 4), torch.float32)
        built.append(sorted(p.name for p in tmp_path.glob("*.so")))
    assert len(built[0]) == 1 and len(built[1]) == 2  # a second library for the second CPU
    assert built[2] == built[1]  # the first CPU's again: found, not rebuilt
