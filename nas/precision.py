"""Training precision and the device's training settings: bf16 autocast where the device computes bf16
natively, fp32 elsewhere; on CUDA also TF32 matrix products, fused Adam, pinned batches and an inner loop
without host synchronisation (:func:`device_settings`, the one place that decides them).

bf16 halves activation memory and, on CUDA GPUs from Ampere on and on CPUs with AVX512-BF16 or AMX,
speeds up training with the same loss curve. On other CPUs PyTorch emulates bf16 matrix products:
on an AVX2-only AMD EPYC (this project's CI machines) a 2048x512 @ 512x2048 forward and backward took
9 s in bf16 against 0.18 s in fp32 (``python -m nas.precision`` prints both). ``train.precision: auto``
(the default) therefore picks bf16 only where it is native.
"""

from __future__ import annotations

import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from nas.errors import NasError

__all__ = ["bf16_native", "resolve_precision", "autocast_for", "DeviceSettings", "device_settings",
           "training_device"]


def bf16_native(device: str | torch.device) -> bool:
    """Whether ``device`` computes bf16 matrix products natively (not emulated).

    CUDA: ``torch.cuda.is_bf16_supported()`` (compute capability 8.0 or later). CPU: AVX512-BF16 or AMX
    tiles, or oneDNN's own bf16 check (AVX512 BW/VL/DQ); an AVX2-only CPU answers False, and so does a CPU whose
    kernels are held below AVX512 (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: the CPU has the
    instructions but the kernels do not use them, and a bf16 product took 7.2 s against 0.09 s in fp32 here).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    if not _kernels_reach_avx512():
        return False
    checks = (lambda: torch.cpu._is_avx512_bf16_supported(), lambda: torch.cpu._is_amx_tile_supported(),
              lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported())
    for check in checks:  # private helpers: a torch without one of them just skips it
        try:
            if check():
                return True
        except (AttributeError, RuntimeError):
            continue
    return False


def _kernels_reach_avx512() -> bool:
    """Whether ATen's CPU kernels and oneDNN may use AVX512 (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``); a
    torch without one of the private checks is not held back by it."""
    try:
        if "AVX512" not in torch.backends.cpu.get_cpu_capability():
            return False
    except (AttributeError, RuntimeError):
        pass
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """``train.precision`` (``auto``, ``bf16`` or ``fp32``) as the precision actually used on ``device``.

    ``auto`` is ``bf16`` where :func:`bf16_native`, else ``fp32``. An explicit ``bf16`` is kept, with a
    ``UserWarning`` when the device would emulate it.

    Raises:
        ValueError: an unknown precision (names it and the choices).
    """
    if precision not in ("auto", "bf16", "fp32"):
        raise NasError(f"train.precision {precision!r}: expected auto, bf16 or fp32")
    native = bf16_native(device)
    if precision == "auto":
        return "bf16" if native else "fp32"
    if precision == "bf16" and not native:
        warnings.warn(f"train.precision: bf16 on {torch.device(device)} is emulated on this machine (no AVX512-BF16, "
                      f"AMX or bf16 GPU) and can be tens of times slower than fp32; set train.precision: auto or fp32",
                      stacklevel=2)
    return precision


def autocast_for(precision: str, device: str | torch.device) -> AbstractContextManager:
    """The autocast context for a resolved precision: bf16 autocast on ``device``'s type, or a no-op for fp32."""
    if precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass(frozen=True)
class DeviceSettings:
    """How the training loop uses a device: every difference between the CPU and the CUDA path is one field here,
    so the CUDA path is the CPU path's code with other values (and tests run it on CPU with :func:`device_settings`'s
    CUDA values where the CPU supports them)."""

    device: torch.device
    fused_adam: bool
    """``torch.optim.Adam(fused=True)``: one kernel for every parameter's update. CUDA only: on CPU the foreach
    implementation is kept, so CPU runs stay bit-for-bit what they were."""
    pin_memory: bool
    """Batches are copied into page-locked memory and moved with ``non_blocking=True`` (CUDA only: pinning needs
    a CUDA runtime)."""
    deferred_checks: bool
    """No host synchronisation in the inner loop: losses and gradient norms stay on the device and are read at
    log and checkpoint steps only, where a non-finite gradient norm since the last read is reported (so the
    steps in between are taken). False (CPU, where reading a value costs nothing): the norm is checked before
    every optimizer step and a non-finite one steps nothing."""
    tf32: bool
    """fp32 matrix products and convolutions may use TF32 (``torch.backends.cuda.matmul.fp32_precision``):
    Ampere and later; the bf16 autocast regions are not affected."""


def device_settings(device: str | torch.device) -> DeviceSettings:
    """The training settings of ``device``: everything on for CUDA, everything off elsewhere."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    return DeviceSettings(device=device, fused_adam=cuda, pin_memory=cuda, deferred_checks=cuda, tf32=cuda)


def training_device(device: str | torch.device | None = None) -> DeviceSettings:
    """Choose the training device (default: ``cuda`` when available, else ``cpu``), switch TF32 on for CUDA,
    and return its :class:`DeviceSettings`. Every trainer starts here."""
    settings = device_settings(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if settings.tf32:
        _allow_tf32()
    return settings


def _allow_tf32() -> None:
    """TF32 for fp32 matrix products and cuDNN convolutions, with the API of torch >= 2.9 where it exists."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:  # pragma: no cover - torch < 2.9
        matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def _main() -> None:  # python -m nas.precision: what `auto` picks here, and why
    x = torch.randn(2048, 512, requires_grad=True)
    w = torch.randn(512, 2048, requires_grad=True)
    for precision in ("fp32", "bf16"):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            with autocast_for(precision, "cpu"):
                y = (x @ w).relu().sum()
            y.backward()
            times.append(time.perf_counter() - start)
        print(f"cpu {precision}: {min(times) * 1e3:.1f} ms (2048x512 @ 512x2048, forward + backward)")
    print(f"bf16 native on cpu: {bf16_native('cpu')}; train.precision: auto -> {resolve_precision('auto', 'cpu')}")


if __name__ == "__main__":
    _main()
