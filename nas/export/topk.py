"""A top-``k`` of few entries as a loop in an AOT package (issue 41): the custom op ``nas::small_topk`` and the C
function that AOTInductor's generated code calls for it directly (``aot_inductor.custom_ops_to_c_shims``), as
:mod:`nas.export.sgemm` does for oneDNN's sgemm.

Why: Inductor has no kernel of its own for ``topk``; in a package it is a call into ATen's, which at batch 1, beam 4
(the top 8 of a sentence's 600 block maxima, then of the 320 candidates of the best blocks:
:func:`nas.model.decode.top_candidates`) took 7.4 us a call on a 2-core AVX2 EPYC (``torch.profiler``, one thread),
about 3% of a decoder step, for a few hundred comparisons. The shim keeps the ``k`` best of a row in a sorted
array of ``k`` slots, one comparison per entry with the ``k``-th best once the slots are full.

How: :func:`load` compiles the shim against AOTInductor's C ABI (``aoti_torch_*``: no ATen headers, under a
second) once per machine into the package cache and loads it with ``RTLD_GLOBAL``, so that a package compiled with
:func:`shim_options` finds ``aoti_torch_cpu_small_topk`` when it is loaded. The op's eager implementation is
``torch.topk`` (only tracing, Inductor's shape propagation and eager callers run it).

Departures: values equal ``topk``'s; where values tie, the first entries are taken (``topk``'s may be other tied
ones). NaN is not ranked as the largest value, as ``topk`` ranks it: the decoder's scores hold no NaN.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nas.export.sgemm import load_shim
from nas.native import compiler

__all__ = ["C_SHIM", "load", "shim_options", "small_topk"]

SHIM_SOURCE = r"""
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <cstdint>

extern "C" {
// values [n, k] (descending) and indices [n, k] (int64) of the k largest entries of each row of x [n, m] (float32,
// rows unit-strided); ties: the first entries. k <= m, else an error.
AOTITorchError aoti_torch_cpu_small_topk(AtenTensorHandle x, int64_t k, AtenTensorHandle *ret0,
                                         AtenTensorHandle *ret1) {
  int64_t *xs, *xt;
  int32_t dtype;
  if (aoti_torch_get_sizes(x, &xs) || aoti_torch_get_strides(x, &xt) || aoti_torch_get_dtype(x, &dtype))
    return AOTI_TORCH_FAILURE;
  const int64_t n = xs[0], m = xs[1];
  if (dtype != aoti_torch_dtype_float32() || k < 0 || k > m || (m > 1 && xt[1] != 1))
    return AOTI_TORCH_FAILURE;
  int64_t sizes[2] = {n, k}, strides[2] = {k, 1};
  AtenTensorHandle values, indices;
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0,
                               &values))
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_int64(), aoti_torch_device_type_cpu(), 0,
                               &indices)) {
    aoti_torch_delete_tensor_object(values);
    return AOTI_TORCH_FAILURE;
  }
  void *xp, *vp, *ip;
  if (aoti_torch_get_data_ptr(x, &xp) || aoti_torch_get_data_ptr(values, &vp) ||
      aoti_torch_get_data_ptr(indices, &ip)) {
    aoti_torch_delete_tensor_object(values);
    aoti_torch_delete_tensor_object(indices);
    return AOTI_TORCH_FAILURE;
  }
  for (int64_t r = 0; k > 0 && r < n; r++) {
    const float *row = static_cast<const float *>(xp) + r * xt[0];
    float *val = static_cast<float *>(vp) + r * k;
    int64_t *idx = static_cast<int64_t *>(ip) + r * k;
    int64_t filled = 0;
    for (int64_t j = 0; j < m; j++) {
      const float v = row[j];
      if (filled == k && !(v > val[k - 1]))
        continue;  // not above the k-th best (or NaN)
      int64_t i = filled < k ? filled++ : k - 1;  // the free slot, or the k-th best's
      for (; i > 0 && val[i - 1] < v; i--) {  // after every entry >= v: ties keep their order
        val[i] = val[i - 1];
        idx[i] = idx[i - 1];
      }
      val[i] = v;
      idx[i] = j;
    }
  }
  *ret0 = values;
  *ret1 = indices;
  return AOTI_TORCH_SUCCESS;
}
}
"""

C_SHIM = ("AOTITorchError aoti_torch_cpu_small_topk(AtenTensorHandle x, int64_t k, AtenTensorHandle* ret0, "
          "AtenTensorHandle* ret1)")
"""The C declaration of the op's shim, as ``aot_inductor.custom_ops_to_c_shims`` wants it (see :func:`shim_options`)."""


@torch.library.custom_op("nas::small_topk", mutates_args=())
def small_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, m]`` -> the values ``[n, k]`` (descending) and indices ``[n, k]`` of each row's ``k`` largest entries.
    Eager: ``torch.topk``; in an AOT package compiled with :func:`shim_options`: the shim (module docstring)."""
    values, indices = torch.topk(x, k, dim=1)
    return values.contiguous(), indices.contiguous()


@small_topk.register_fake
def _(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.long)


def shim_options() -> dict:
    """Inductor settings under which the op compiles to a direct call of its C shim (not a dispatcher call)."""
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.nas.small_topk.default: [C_SHIM]}}


_loaded: bool | None = None
"""What :func:`load` answered in this process (None: not asked yet)."""


def load(cache_dir: str | Path) -> bool:
    """Build (once per machine, under ``cache_dir/topk``, written atomically) and load the shim with
    ``RTLD_GLOBAL``, once per process (later calls return the first one's answer). True when it is loaded; False
    where no C++ compiler (``$CXX`` or ``g++``) is found, or the build or the load fails (a logged warning with the
    compiler's message; the packages then call ATen's ``topk``)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if compiler() is None:
        return False
    _loaded = load_shim("nas_small_topk", SHIM_SOURCE, [], Path(cache_dir, "topk"), "the AOT packages call ATen's topk")
    return _loaded
