"""The decoder's products on three CPU libraries, side by side in one process (issue 41).

``x [M, K] @ W [K, N]``, float32, row-major, at the shapes of the quickstart's plain Transformer (C=128, FFN 512,
vocabulary 6000), at ``--rows`` (default: 4, batch 1 and beam 4; 16, the encoder at batch 1; 128, batch 32 and
beam 4; 448, the encoder at batch 32). Per shape, in interleaved rounds:

- ``mkl``: ``torch.mm`` (MKL on x86);
- ``onednn-packed``: ``torch.ops.mkldnn._linear_pointwise`` by a weight pre-packed for ``M`` rows (what
  :class:`nas.export.aot_products.ProductLayout` inserts for ``packing='wide'``/``'all'``);
- ``dnnl_sgemm``: oneDNN's ``dnnl_sgemm`` from ``libdnnl.so.3`` (the ``serve`` extra's ``onednn-cpu-gomp``), called
  through ``ctypes`` (what :mod:`nas.export.sgemm`'s shim calls inside a package, without ctypes' 1-2 us a call).

Prints the median microseconds a call and each library's time relative to MKL's, and checks each product against
``torch.mm`` in float64. This is what :func:`nas.export.aot_products.packing` chooses from on a CPU class::

    python benchmarks/bench_products.py --threads 1 --rounds 9 [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nas.export.aot_products import avx512_cpu, intel_cpu  # noqa: E402
from nas.export.sgemm import find_dnnl  # noqa: E402

PRODUCTS = [(128, 6000), (128, 512), (512, 128), (128, 384), (128, 128), (128, 256)]
"""``(K, N)``: the output projection, FFN in and out, fused QKV, attention output, cross-attention KV."""


def _sgemm():
    """A ``(x, w) -> out`` product by ``dnnl_sgemm`` through ctypes, or None without ``libdnnl``."""
    path = find_dnnl()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    f = lib.dnnl_sgemm
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_char, ctypes.c_char, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                  ctypes.c_void_p, ctypes.c_int64]

    def product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[1]
        if f(b"N", b"N", m, n, k, 1.0, x.data_ptr(), k, w.data_ptr(), n, 0.0, out.data_ptr(), n) != 0:
            raise RuntimeError("dnnl_sgemm failed")
        return out

    return product


def _time(fn, loops: int) -> float:
    """Microseconds a call of ``fn``, the mean of ``loops`` calls."""
    start = time.perf_counter()
    for _ in range(loops):
        fn()
    return (time.perf_counter() - start) / loops * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--budget-ms", type=float, default=20.0, help="time a library gets in each round")
    parser.add_argument("--rows", default="4,16,128,448", help="comma-separated row counts M")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sgemm = _sgemm()
    mkldnn = torch.backends.mkldnn.is_available()
    rows = []
    print(f"CPU: {'Intel' if intel_cpu() else 'not Intel'}, AVX-512 {'yes' if avx512_cpu() else 'no'}; "
          f"torch {torch.__version__}; {args.threads} thread(s); median of {args.rounds} rounds; us a call")
    print(f"{'M x K x N':>18} {'mkl':>9} {'onednn-packed':>14} {'dnnl_sgemm':>11} {'packed/mkl':>11} "
          f"{'sgemm/mkl':>10}")
    shapes = [(m, k, n) for m in map(int, args.rows.split(",")) for k, n in PRODUCTS
              if n != 6000 or m not in (16, 448)]  # the encoder has no output projection
    for m, k, n in shapes:
        x = torch.randn(m, k)
        w = torch.randn(k, n) / k**0.5
        want = (x.double() @ w.double()).float()
        fns = {"mkl": lambda x=x, w=w: torch.mm(x, w)}
        if mkldnn:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), m)
            fns["onednn-packed"] = lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none",
                                                                                           [], "")
        if sgemm is not None:
            out = torch.empty(m, n)
            fns["dnnl_sgemm"] = lambda x=x, w=w, out=out: sgemm(x, w, out)
        for name, fn in fns.items():
            got = fn()
            if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                raise SystemExit(f"{name} gave a wrong product at {m}x{k}x{n}")
        loops = {name: max(3, int(args.budget_ms * 1e3 / max(_time(fn, 3), 0.5))) for name, fn in fns.items()}
        times: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(args.rounds):
            order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
            for name in order:
                times[name].append(_time(fns[name], loops[name]))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        row = {"m": m, "k": k, "n": n, "us": med, "rounds": times}
        rows.append(row)
        cell = lambda name: f"{med[name]:.1f}" if name in med else "-"  # noqa: E731
        ratio = lambda name: f"{med[name] / med['mkl']:.2f}" if name in med else "-"  # noqa: E731
        print(f"{f'{m} x {k} x {n}':>18} {cell('mkl'):>9} {cell('onednn-packed'):>14} {cell('dnnl_sgemm'):>11} "
              f"{ratio('onednn-packed'):>11} {ratio('dnnl_sgemm'):>10}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
                "intel": intel_cpu(), "avx512": avx512_cpu(), "machine": platform.machine(),
                "dnnl": str(find_dnnl()) if sgemm else None}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
