"""oneDNN's ``dnnl_sgemm`` as a product of the AOT packages (issue 41): the custom op ``nas::dnnl_sgemm`` and the C
function that AOTInductor's generated code calls for it directly (``aot_inductor.custom_ops_to_c_shims``).

Why: on AMD CPUs CTranslate2 multiplies with oneDNN's sgemm, PyTorch with MKL, and at the few rows of a batch-1 beam
search MKL is the slower of the two there. On a 2-core AMD EPYC with AVX2 and FMA only (1 thread, ``x [4, K] @ W [K,
N]``, both row-major, median of 9 loops): ``[4, 128] x [128, 6000]`` (the output projection) took 85 us with
``dnnl_sgemm`` against 154-172 us with MKL's ``mm`` and 133-149 us with oneDNN's pre-packed ``_linear_pointwise``;
``[4, 128] x [128, 384]`` 8.4-8.8 against 11-14 us; ``[4, 512] x [512, 128]`` 9.4-11.6 against 14-19 us. PyTorch
does not export oneDNN's sgemm (``libtorch_cpu.so`` keeps it internal), so it comes from the ``onednn-cpu-gomp``
wheel (``libdnnl.so.3`` under ``sys.prefix/lib``; the ``serve`` extra installs it on x86-64 Linux).

How: :func:`load` compiles a 40-line C++ shim against AOTInductor's C ABI (``aoti_torch_*``: no ATen headers, under
a second) once per machine into the package cache, and loads it with ``RTLD_GLOBAL``, so that a package compiled with
:data:`C_SHIM` finds ``aoti_torch_cpu_dnnl_sgemm`` when it is loaded. The op's eager implementation is ``torch.mm``
(only tracing and Inductor's shape propagation run it: the packages call the shim).

Departure: the products' sums run in oneDNN's order, not MKL's; logits may differ in their last bits, as the module
docstring of :mod:`nas.export.aot` says of every compiled kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

import torch

from nas.native import build_library, compiler

log = logging.getLogger(__name__)

__all__ = ["C_SHIM", "dnnl_sgemm", "find_dnnl", "load", "load_shim", "shim_options", "torch_flags"]

SHIM_SOURCE = r"""
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <cstdint>
#include <cstring>

extern "C" {
int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
               int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

// out [M, N] = x [M, K] @ w [K, N]; rows of x and w may be strided (unit stride within a row), out contiguous.
AOTITorchError aoti_torch_cpu_dnnl_sgemm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle *ret0) {
  int64_t *xs, *xt, *ws, *wt;
  if (aoti_torch_get_sizes(x, &xs) || aoti_torch_get_strides(x, &xt) || aoti_torch_get_sizes(w, &ws) ||
      aoti_torch_get_strides(w, &wt))
    return AOTI_TORCH_FAILURE;
  const int64_t M = xs[0], K = xs[1], N = ws[1];
  // rows unit-strided inside and not overlapping: anything else is refused (an error, never a wrong product)
  if (ws[0] != K || (K > 1 && xt[1] != 1) || (N > 1 && wt[1] != 1) || (M > 1 && xt[0] < K) || (K > 1 && wt[0] < N))
    return AOTI_TORCH_FAILURE;
  int64_t sizes[2] = {M, N}, strides[2] = {N, 1};
  AtenTensorHandle out;
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0,
                               &out))
    return AOTI_TORCH_FAILURE;
  void *xp, *wp, *op;
  if (aoti_torch_get_data_ptr(x, &xp) || aoti_torch_get_data_ptr(w, &wp) || aoti_torch_get_data_ptr(out, &op)) {
    aoti_torch_delete_tensor_object(out);
    return AOTI_TORCH_FAILURE;
  }
  if (M > 0 && N > 0) {
    if (K == 0) {
      std::memset(op, 0, sizeof(float) * M * N);
    } else if (dnnl_sgemm('N', 'N', M, N, K, 1.0f, static_cast<const float *>(xp), xt[0] > K ? xt[0] : K,
                          static_cast<const float *>(wp), wt[0] > N ? wt[0] : N, 0.0f, static_cast<float *>(op),
                          N) != 0) {
      aoti_torch_delete_tensor_object(out);
      return AOTI_TORCH_FAILURE;
    }
  }
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}
}
"""

C_SHIM = "AOTITorchError aoti_torch_cpu_dnnl_sgemm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"
"""The C declaration of the op's shim, as ``aot_inductor.custom_ops_to_c_shims`` wants it (see :func:`shim_options`)."""


@torch.library.custom_op("nas::dnnl_sgemm", mutates_args=())
def dnnl_sgemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [K, N]`` -> ``[M, N]`` (float32). Eager: ``torch.mm``; in an AOT package compiled with
    :func:`shim_options`: oneDNN's ``dnnl_sgemm`` (module docstring)."""
    return torch.mm(x, w)


@dnnl_sgemm.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def shim_options() -> dict:
    """Inductor settings under which the op compiles to a direct call of its C shim (not a dispatcher call)."""
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.nas.dnnl_sgemm.default: [C_SHIM]}}


def find_dnnl() -> Path | None:
    """``libdnnl.so.3``: under ``sys.prefix/lib`` (where the ``onednn-cpu-gomp`` wheel puts it) or on the linker's
    path; None where there is none."""
    for name in ("libdnnl.so.3", "libdnnl.so"):
        path = Path(sys.prefix, "lib", name)
        if path.exists():
            return path
    found = ctypes.util.find_library("dnnl")
    return Path(found) if found and Path(found).is_absolute() else None


_loaded: bool | None = None
"""What :func:`load` answered in this process (None: not asked yet)."""


def load(cache_dir: str | Path) -> bool:
    """Build (once per machine, under ``cache_dir/sgemm``, written atomically) and load the shim with
    ``RTLD_GLOBAL``, once per process (later calls return the first one's answer). True when it is loaded; False
    where ``libdnnl`` or a C++ compiler (``$CXX`` or ``g++``) is missing, or the build or the load fails (logged as a
    warning with the compiler's message; the packages then keep MKL's or oneDNN's packed products:
    :func:`nas.export.aot_products.packing`)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    dnnl = find_dnnl()
    if dnnl is None or compiler() is None:
        return False
    _loaded = load_shim("nas_dnnl_sgemm", SHIM_SOURCE, [str(dnnl), f"-Wl,-rpath,{dnnl.parent}"],
                        Path(cache_dir, "sgemm"), "the AOT packages keep MKL's or oneDNN's packed products")
    return _loaded


def torch_flags(flags: list[str]) -> list[str]:
    """The compiler flags of a library built against AOTInductor's C ABI (``aoti_torch/c/shim.h``): ``-O2``,
    torch's headers, ``flags``, then torch's libraries (linked, and found at run time). Shared with
    :mod:`nas.export.steploop`."""
    torch_dir = Path(torch.__file__).parent
    return ["-O2", f"-I{torch_dir / 'include'}", *flags, f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{torch_dir / 'lib'}"]


def load_shim(name: str, source: str, flags: list[str], cache_dir: Path, what: str) -> bool:
    """Build ``source``, a C shim against AOTInductor's C ABI, with ``flags`` besides torch's headers and libraries
    (:func:`nas.native.build_library`, keyed by torch's version) and load it with ``RTLD_GLOBAL``, so that the
    packages that call it find it. False where the build or the load fails (a logged warning ending in ``what``).
    Shared with :mod:`nas.export.topk`."""
    lib = build_library(name, source, torch_flags(flags), cache_dir, what, key=torch.__version__)
    if lib is None:
        return False
    try:
        ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError as e:
        log.warning("could not load %s (%s); %s", lib, e, what)
        return False
    return True
