"""The fused PathNorm of the Multi-Path sublayers on CPU: ``sum_i keep_i * LN(y_i; w_i, b_i)`` and its backward,
one pass over the P paths' outputs each way (Multi-Path Transformer eq. 6, with ``w_i = alpha_i gamma_i`` and
``b_i = alpha_i beta_i``; :class:`nas.model.paths._PathNormSum` calls it).

Why (issue 41): on a 2-core Xeon with AMX, the 4-path FFN's PathNorm took 4.6 ms of a 23 ms training step (four
``native_layer_norm`` and their backward, the drop masks, the fp32 sum: about ten passes over the paths' outputs),
against 19.7 ms for the whole 1-path FFN of the same FLOPs. ATen has no fused kernel for it, so this is a short C++
source compiled on the machine (:mod:`nas.native`, ``-O3 -march=native -fopenmp``, about 2 s), cached under
:func:`cache_dir`, and called through ``ctypes`` on the tensors' memory. It runs on torch's own OpenMP runtime
(``libgomp.so.1`` from torch's folder: one thread pool, no contention), with ``torch.get_num_threads()`` threads.

Numerics: every statistic and product is computed in fp32 from the stored values (bf16 or fp32), and each output is
rounded once (round to nearest even). The ATen path rounds the normalised bf16 outputs, the drop-masked ones, and the
incoming gradient to bf16 before the backward; this one does not, so in bf16 the two differ in the last bits (both
are checked against a float64 loop transcription in ``tests/model/test_fused_pathnorm.py``). The mean and variance
are two-pass over a row (biased variance, ``eps`` inside the root), as ``torch.nn.functional.layer_norm``.

Where no C++ compiler is found, the build fails, ``NAS_FUSED_KERNELS=0`` is set, or the tensors are not on the CPU
in bf16 or fp32, :func:`available` is False and the caller keeps ATen's kernels.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from nas.native import build_library, cpu_flags

log = logging.getLogger(__name__)

__all__ = ["available", "cache_dir", "pathnorm_backward", "pathnorm_forward"]

SOURCE = r"""
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
typedef uint16_t bf16;

inline float load(const float *p, int64_t i) { return p[i]; }
inline float load(const bf16 *p, int64_t i) {
  uint32_t u = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float *p, int64_t i, float v) { p[i] = v; }
inline void store(bf16 *p, int64_t i, float v) {  // round to nearest even; a NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &v, 4);
  p[i] = (u & 0x7fffffffu) > 0x7f800000u ? bf16((u >> 16) | 0x40u) : bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ys [U, P, B*T, C]; w, b [U, P, C] fp32; keep [U, P, B] fp32 or null -> out [U, B*T, C]; mean, rstd [U, P, B*T]
template <typename TI, typename TO>
void forward(const TI *ys, const float *w, const float *b, const float *keep, TO *out, float *mean, float *rstd,
             int64_t U, int64_t P, int64_t B, int64_t T, int64_t C, float eps, int threads) {
  const int64_t N = B * T;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> x(C), acc(C);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < U * N; ++r) {
      const int64_t u = r / N, n = r % N;
      for (int64_t j = 0; j < C; ++j) acc[j] = 0.f;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t up = u * P + p;
        const TI *y = ys + (up * N + n) * C;
        float s = 0.f, v = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < C; ++j) { x[j] = load(y, j); s += x[j]; }
        const float mu = s / C;
#pragma omp simd reduction(+ : v)
        for (int64_t j = 0; j < C; ++j) { const float d = x[j] - mu; v += d * d; }
        const float rs = 1.f / std::sqrt(v / C + eps);
        mean[up * N + n] = mu;
        rstd[up * N + n] = rs;
        const float k = keep ? keep[up * B + n / T] : 1.f;
        if (k == 0.f) continue;
        const float *wp = w + up * C, *bp = b + up * C;
#pragma omp simd
        for (int64_t j = 0; j < C; ++j) acc[j] += k * ((x[j] - mu) * rs * wp[j] + bp[j]);
      }
      TO *o = out + r * C;
      for (int64_t j = 0; j < C; ++j) store(o, j, acc[j]);
    }
  }
}

// grad [U, B*T, C]; the rest as forward -> dys [U, P, B*T, C]; dw, db [U, P, C] fp32 (summed over rows)
template <typename TI, typename TG>
void backward(const TG *grad, const TI *ys, const float *w, const float *keep, const float *mean, const float *rstd,
              TI *dys, float *dw, float *db, int64_t U, int64_t P, int64_t B, int64_t T, int64_t C, int threads) {
  const int64_t N = B * T, W = U * P * C;
  // each thread sums its rows' weight gradients into its own slot; the slots are added in thread order after the
  // parallel region, so a result depends on the thread count only, not on which thread finished first
  std::vector<float> slots(size_t(threads) * 2 * W, 0.f);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> g(C), xh(C);
    float *dwl = slots.data() + size_t(omp_get_thread_num()) * 2 * W, *dbl = dwl + W;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < U * N; ++r) {
      const int64_t u = r / N, n = r % N;
      const TG *gr = grad + r * C;
      for (int64_t j = 0; j < C; ++j) g[j] = load(gr, j);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t up = u * P + p;
        const TI *y = ys + (up * N + n) * C;
        TI *dy = dys + (up * N + n) * C;
        const float k = keep ? keep[up * B + n / T] : 1.f;
        if (k == 0.f) {
          for (int64_t j = 0; j < C; ++j) store(dy, j, 0.f);
          continue;
        }
        const float mu = mean[up * N + n], rs = rstd[up * N + n];
        const float *wp = w + up * C;
        float *dwp = dwl + up * C, *dbp = dbl + up * C;
        float s1 = 0.f, s2 = 0.f;
#pragma omp simd reduction(+ : s1, s2)
        for (int64_t j = 0; j < C; ++j) {
          xh[j] = (load(y, j) - mu) * rs;
          const float gk = g[j] * k, dx = gk * wp[j];
          dwp[j] += gk * xh[j];
          dbp[j] += gk;
          s1 += dx;
          s2 += dx * xh[j];
        }
        const float a = s1 / C, c = s2 / C;
        for (int64_t j = 0; j < C; ++j) store(dy, j, rs * (g[j] * k * wp[j] - a - xh[j] * c));
      }
    }
  }
  for (int64_t i = 0; i < W; ++i) dw[i] = db[i] = 0.f;
  for (int t = 0; t < threads; ++t) {
    const float *dwl = slots.data() + size_t(t) * 2 * W, *dbl = dwl + W;
    for (int64_t i = 0; i < W; ++i) { dw[i] += dwl[i]; db[i] += dbl[i]; }
  }
}
}  // namespace

extern "C" {
// in_bf16: ys (and dys) in bf16, else fp32; out_bf16: out (and grad) in bf16, else fp32
void nas_pathnorm_forward(int in_bf16, int out_bf16, const void *ys, const float *w, const float *b,
                          const float *keep, void *out, float *mean, float *rstd, int64_t U, int64_t P, int64_t B,
                          int64_t T, int64_t C, float eps, int threads) {
  if (in_bf16 && out_bf16)
    forward((const bf16 *)ys, w, b, keep, (bf16 *)out, mean, rstd, U, P, B, T, C, eps, threads);
  else if (in_bf16)
    forward((const bf16 *)ys, w, b, keep, (float *)out, mean, rstd, U, P, B, T, C, eps, threads);
  else if (out_bf16)
    forward((const float *)ys, w, b, keep, (bf16 *)out, mean, rstd, U, P, B, T, C, eps, threads);
  else
    forward((const float *)ys, w, b, keep, (float *)out, mean, rstd, U, P, B, T, C, eps, threads);
}

void nas_pathnorm_backward(int in_bf16, int out_bf16, const void *grad, const void *ys, const float *w,
                           const float *keep, const float *mean, const float *rstd, void *dys, float *dw, float *db,
                           int64_t U, int64_t P, int64_t B, int64_t T, int64_t C, int threads) {
  if (in_bf16 && out_bf16)
    backward((const bf16 *)grad, (const bf16 *)ys, w, keep, mean, rstd, (bf16 *)dys, dw, db, U, P, B, T, C, threads);
  else if (in_bf16)
    backward((const float *)grad, (const bf16 *)ys, w, keep, mean, rstd, (bf16 *)dys, dw, db, U, P, B, T, C, threads);
  else if (out_bf16)
    backward((const bf16 *)grad, (const float *)ys, w, keep, mean, rstd, (float *)dys, dw, db, U, P, B, T, C,
             threads);
  else
    backward((const float *)grad, (const float *)ys, w, keep, mean, rstd, (float *)dys, dw, db, U, P, B, T, C,
             threads);
}
}
"""

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lib: ctypes.CDLL | None | bool = None
"""The loaded library; False once it could not be had in this process; None before the first asking."""


def cache_dir() -> Path:
    """``$NAS_KERNEL_CACHE``, else ``~/.cache/nas/kernels``: where the compiled library is kept."""
    return Path(os.environ.get("NAS_KERNEL_CACHE") or Path.home() / ".cache" / "nas" / "kernels")


def _load() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        _lib = False
        torch_lib = Path(torch.__file__).parent / "lib"
        # torch's own libgomp (same soname, already loaded): the kernel shares torch's OpenMP thread pool
        flags = ["-O3", "-march=native", "-fopenmp", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
        path = build_library("nas_pathnorm", SOURCE, flags, cache_dir(), "PathNorm keeps ATen's kernels",
                             key=cpu_flags())  # -march=native: another CPU, another library
        if path is not None:
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                log.warning("could not load %s (%s); PathNorm keeps ATen's kernels", path, e)
            else:
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                lib.nas_pathnorm_forward.argtypes = [ctypes.c_int] * 2 + [ptr] * 7 + [i64] * 5 + [ctypes.c_float,
                                                                                                   ctypes.c_int]
                lib.nas_pathnorm_backward.argtypes = [ctypes.c_int] * 2 + [ptr] * 9 + [i64] * 5 + [ctypes.c_int]
                lib.nas_pathnorm_forward.restype = lib.nas_pathnorm_backward.restype = None
                _lib = lib
    return _lib or None


def _loaded() -> ctypes.CDLL:
    """The library, for the kernels' callers; RuntimeError where it is not :func:`available`."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the fused PathNorm kernel is not available here; check nas.model.fused.available() first")
    return lib


def available(ys: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """True where the fused kernel can run: ``ys`` on the CPU in bf16 or fp32, ``out_dtype`` one of them, the
    library built and loaded, and ``NAS_FUSED_KERNELS`` not ``0``."""
    if ys.device.type != "cpu" or ys.dtype not in _DTYPES or out_dtype not in _DTYPES:
        return False
    return os.environ.get("NAS_FUSED_KERNELS", "1") != "0" and _load() is not None


def pathnorm_forward(ys: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor | None,
                     out_dtype: torch.dtype, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sum_i keep_i * LN(ys_i; weight_i, bias_i)`` per unit (Multi-Path eq. 6, module docstring).

    Args:
        ys: the paths' outputs ``[U, P, b, t, C]``, bf16 or fp32 (made contiguous).
        weight, bias: the affine ``[U, P, C]`` (any float dtype; read in fp32).
        keep: the per-path, per-sentence multiplier ``[U, P, b]`` (0 drops a path), or None.
        out_dtype: the sum's dtype, bf16 or fp32 (accumulated in fp32 either way).
        eps: added to the variance.

    Returns:
        ``out [U, b, t, C]`` in ``out_dtype``, and each row's ``mean`` and reciprocal deviation ``rstd``
        ``[U, P, b*t]`` (fp32) for :func:`pathnorm_backward`.

    Raises:
        RuntimeError: the kernel is not :func:`available`.
    """
    lib = _loaded()
    ys = ys.contiguous()
    units, paths, bsz, t, c = ys.shape
    w, b = weight.float().contiguous(), bias.float().contiguous()
    k = None if keep is None else keep.float().contiguous()
    out = torch.empty(units, bsz, t, c, dtype=out_dtype)
    mean, rstd = torch.empty(units, paths, bsz * t), torch.empty(units, paths, bsz * t)
    lib.nas_pathnorm_forward(_DTYPES[ys.dtype], _DTYPES[out_dtype], ys.data_ptr(), w.data_ptr(), b.data_ptr(),
                             None if k is None else k.data_ptr(), out.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                             units, paths, bsz, t, c, eps, torch.get_num_threads())
    return out, mean, rstd


def pathnorm_backward(grad: torch.Tensor, ys: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor | None,
                      mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`pathnorm_forward`'s output with respect to ``ys``, ``weight`` and ``bias``.

    Args:
        grad: ``[U, b, t, C]``, bf16 or fp32 (read in fp32, not rounded first).
        ys, weight, keep, mean, rstd: as given to and returned by :func:`pathnorm_forward` (``ys`` contiguous).

    Returns:
        ``d ys [U, P, b, t, C]`` in ``ys``' dtype; ``d weight``, ``d bias`` ``[U, P, C]`` in ``weight``'s dtype
        (summed over rows in fp32 per thread, then over the threads in their order: the same inputs and thread
        count give the same bits).
    """
    lib = _loaded()
    units, paths, bsz, t, c = ys.shape
    grad = grad if grad.dtype in _DTYPES else grad.float()
    grad = grad.contiguous()
    w = weight.float().contiguous()
    k = None if keep is None else keep.float().contiguous()
    dys = torch.empty_like(ys)
    dw, db = torch.empty(units, paths, c), torch.empty(units, paths, c)
    lib.nas_pathnorm_backward(_DTYPES[ys.dtype], _DTYPES[grad.dtype], grad.data_ptr(), ys.data_ptr(), w.data_ptr(),
                              None if k is None else k.data_ptr(), mean.data_ptr(), rstd.data_ptr(), dys.data_ptr(),
                              dw.data_ptr(), db.data_ptr(), units, paths, bsz, t, c, torch.get_num_threads())
    return dys, dw.to(weight.dtype), db.to(weight.dtype)
