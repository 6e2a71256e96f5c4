"""Which library multiplies the AOT packages' products by frozen weights, and in what layout (issue 41): the Inductor
graph pass :class:`ProductLayout` (MKL's ``mm`` by row-major weights, or oneDNN's by pre-packed ones) and
:func:`packing`, the choice by CPU (vendor, AVX-512) of which products of which package are pre-packed.

Used by :mod:`nas.export.aot` for every package it compiles; the choice is part of each package's key.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import nas.export.sgemm  # noqa: F401  (registers torch.ops.nas.dnnl_sgemm, which the pass may insert)

__all__ = ["PACKING", "PACK_WIDE", "ProductLayout", "avx512_cpu", "intel_cpu", "packing", "sgemm_cpu"]

PACKING = ("none", "wide", "all", "sgemm", "sgemm-wide")
"""Which products of a package multiply by oneDNN's pre-packed weights (:class:`ProductLayout`): none, those at
least :data:`PACK_WIDE` wide (the output projection), or all; or by row-major weights through oneDNN's
``dnnl_sgemm`` (:mod:`nas.export.sgemm`): all (``sgemm``) or those at least :data:`PACK_WIDE` wide
(``sgemm-wide``, the others by MKL's ``mm``)."""
PACK_WIDE = 2048
"""Output width from which a product of the few-rows package is pre-packed on CPUs that are not Intel's."""


def packing(small: bool | None, beam_size: int = 2, sgemm: bool = False) -> str:
    """:data:`PACKING` of the few-rows step package (``small``), the many-rows one (False) or the encoder (None), at
    ``beam_size``.

    Intel CPUs, or a torch without oneDNN: none (MKL's own kernels; oneDNN's packed products were slower at 4 rows
    on a Xeon). Elsewhere
    (CTranslate2 also multiplies with oneDNN rather than MKL there), measured on a 2-core AMD EPYC with
    AVX512-BF16, 1 thread: the output projection and log-softmax as a package took 144 against 81 us at 4 rows
    and 2.26 against 1.18 ms at 128 rows (MKL's product by a plain matrix against oneDNN's by a packed one), while
    the layers' ``[4, 128] x [128, 512]`` took 11.2 against 14.8 us eager, and at one row MKL's product by the
    output projection took 39 against 54 us (from 2 rows on, oneDNN's: 53 against 86 us). So: the wide products at
    few rows with beams (at least 2 rows), none for greedy search at few rows (1 row at batch 1), every product at
    many rows and in the encoder. On such CPUs without AVX-512 (a 2-core AMD EPYC with AVX2 and FMA only, 1 thread,
    interleaved rounds in one process), the encoder took 0.57-0.61 ms a sentence at batch 1 with MKL's products
    against 0.80-0.92 with oneDNN's packed ones, and 26.3-30.0 against 29.6-32.4 ms for 32 sentences at once
    (``docs/benchmarks.md``): none there for the encoder.

    With ``sgemm`` (oneDNN's ``dnnl_sgemm`` loaded, :func:`nas.export.sgemm.load`) on CPUs that are not Intel's and
    lack AVX-512: every product of the few-rows package by it (``sgemm``), and the wide ones of the many-rows
    package (``sgemm-wide``: at 128 rows ``[128, 128] x [128, 6000]`` took 2.06 ms by it against 2.2-2.5 ms by MKL
    or oneDNN's packed weights, while ``[128, 128] x [128, 512]`` took 0.25 against MKL's 0.20 ms). On the 2-core
    AVX2 EPYC this took the batch-1, beam-4 translation from 1.20x to 1.02-1.10x CTranslate2 fp32's time and batch
    32 from 1.12x to 1.00-1.10x (three runs, ``docs/benchmarks.md``). On CPUs that are not Intel's and have
    AVX-512: every product of every package by it (``sgemm``): on a 2-core AMD EPYC with AVX512-BF16, 1 thread
    (``benchmarks/bench_products.py``), it took 0.42-0.98x MKL's time at 1-16 rows (the output projection 0.42,
    against 0.58 for oneDNN's packed weights; 1.19 only for ``[1, 128] x [128, 128]``, 3.0 against 2.5 us) and
    0.79-0.91x at 128 and 448 rows, where the packed weights took 0.84-1.17x.
    """
    if sgemm and sgemm_cpu():
        if avx512_cpu():
            return "sgemm"
        return "none" if small is None else "sgemm" if small else "sgemm-wide"
    if intel_cpu() or not torch.backends.mkldnn.is_available():
        return "none"
    if small:
        return "wide" if beam_size >= 2 else "none"
    if small is None and not avx512_cpu():
        return "none"
    return "all"


def sgemm_cpu() -> bool:
    """Whether :func:`packing` would choose oneDNN's sgemm on this CPU, were it loaded (not Intel's): the only CPUs
    on which :class:`nas.export.aot.AotTranslator` builds and loads :mod:`nas.export.sgemm`'s shim."""
    return not intel_cpu() and torch.backends.mkldnn.is_available()


CPUINFO = Path("/proc/cpuinfo")
"""What :func:`intel_cpu` and :func:`avx512_cpu` read."""


def _cpuinfo(key: str) -> str | None:
    """The first ``key`` line's value in :data:`CPUINFO`, or None where there is none or it cannot be read."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(key):
                    return line.partition(":")[2]
    except OSError:
        pass
    return None


def intel_cpu() -> bool:
    """Whether this machine's CPU is Intel's (``vendor_id`` in ``/proc/cpuinfo``; True where that cannot be read)."""
    vendor = _cpuinfo("vendor_id")
    return vendor is None or "GenuineIntel" in vendor


def avx512_cpu() -> bool:
    """Whether this machine's CPU has AVX-512 (``avx512f`` among the ``flags`` of ``/proc/cpuinfo``; True where
    that cannot be read, as for Intel's in :func:`intel_cpu`)."""
    flags = _cpuinfo("flags")
    return flags is None or "avx512f" in flags.split()


class ProductLayout(CustomGraphPass):
    """An Inductor post-grad graph pass (``post_grad_custom_post_pass``) for the packages' matrix products with
    frozen weights: ``addmm(bias, x, W)`` becomes ``mm(x, W') + bias`` and ``mm(x, W)`` becomes ``mm(x, W')``,
    where ``W'`` is the constant ``W`` stored contiguous (``[C_in, C_out]`` row-major) instead of ``F.linear``'s
    transposed view of ``[C_out, C_in]``.

    Why (issue 41): at a few rows the products are bound by per-call work, not arithmetic. ATen's ``addmm`` copies
    the bias into its output before MKL adds the product to it (an ``expand`` and a ``copy_`` per call), and MKL
    multiplies by a transposed view more slowly than by a row-major matrix: ``[4, 128] x [128, 512]`` took 8.0 us
    as ``addmm`` of the view and 4.5 us as ``mm`` of the contiguous matrix (1 thread, eager). The bias addition is a
    pointwise op that Inductor fuses into the kernel that reads the product next (attention, the residual and
    LayerNorm, the ReLU). The whole batch-1, beam-4 search step took 0.48 against 0.53-0.55 ms (AVX512 Xeon, 1
    thread, the same tokens; ``benchmarks/bench_aot_step.py``).

    With ``pack`` ``"all"``, or ``"wide"`` for products at least :data:`PACK_WIDE` wide, a product by a frozen weight
    becomes oneDNN's ``mkldnn._linear_pointwise`` by the weight pre-packed for about ``rows`` rows, its bias passed
    in (:func:`packing` says where: CPUs that are not Intel's). The pass packs the weights itself, per package,
    rather than through Inductor's ``cpp.weight_prepack``: Inductor registers that pattern once per process, when
    the first compilation asks for it, so a package's products would depend on which was compiled first.

    The result of a product may differ from ``addmm``'s in its last bit (MKL's other kernel for the other layout, and
    the bias added after the product's rounding), as the compiled kernels already do elsewhere (module docstring).
    Only products whose right operand is a 2-D constant (a frozen weight) are changed; a constant read by other ops
    too keeps its original for them.
    """

    def __init__(self, pack: str = "none", rows: int = 4) -> None:
        if pack not in PACKING:
            raise ValueError(f"pack={pack!r}: one of {', '.join(PACKING)}")
        self.pack, self.rows = pack, rows

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        module, layouts, packed = graph.owning_module, {}, {}
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is aten.baddbmm.default and len(node.args) == 3 \
                    and not node.kwargs:  # beta = alpha = 1
                self._bmm_then_add(graph, node)
                continue
            if node.op != "call_function" or node.target not in (aten.addmm.default, aten.mm.default) or node.kwargs:
                continue
            weight = node.args[-1]
            if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
                continue
            value = getattr(module, weight.target)
            if value.dim() != 2:
                continue
            wide = value.size(1) >= PACK_WIDE
            if self.pack == "all" or (self.pack == "wide" and wide):
                self._packed(graph, node, weight, value, packed)
                continue
            sgemm = self.pack == "sgemm" or (self.pack == "sgemm-wide" and wide)
            if not value.is_contiguous():
                if weight.target not in layouts:
                    name = f"{weight.target}_row_major"
                    module.register_buffer(name, value.contiguous())
                    with graph.inserting_before(weight):
                        layouts[weight.target] = graph.get_attr(name)
                    meta = dict(weight.meta)
                    if "val" in meta:
                        meta["val"] = meta["val"].contiguous()
                    layouts[weight.target].meta = meta
                node.replace_input_with(weight, layouts[weight.target])
            if node.target is aten.addmm.default or sgemm:
                bias, x, weight = node.args if node.target is aten.addmm.default else (None, *node.args)
                with graph.inserting_before(node):
                    product = graph.call_function(torch.ops.nas.dnnl_sgemm.default if sgemm else aten.mm.default,
                                                  (x, weight))
                    summed = product if bias is None else graph.call_function(aten.add.Tensor, (product, bias))
                product.meta, summed.meta = dict(node.meta), dict(node.meta)
                node.replace_all_uses_with(summed)
                graph.erase_node(node)
        graph.eliminate_dead_code()

    @staticmethod
    def _bmm_then_add(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
        """``baddbmm(bias, a, b)`` (``beta = alpha = 1``) as ``bmm(a, b) + bias``: the addition is fused into the
        kernel that reads the scores next (the attention's softmax), instead of ATen copying the bias, expanded over
        the beams, into the product's output first (the cross-attention's padding mask,
        :func:`nas.model.ops.attend_cached`). At batch 1, beam 4 a layer's ``baddbmm`` took 11.6 us, its ``bmm``
        4.7 (a 2-core AVX2 EPYC, ``torch.profiler``)."""
        bias, a, b = node.args
        with graph.inserting_before(node):
            product = graph.call_function(torch.ops.aten.bmm.default, (a, b))
            summed = graph.call_function(torch.ops.aten.add.Tensor, (product, bias))
        product.meta, summed.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(summed)
        graph.erase_node(node)

    def _packed(self, graph: torch.fx.Graph, node: torch.fx.Node, weight: torch.fx.Node, value: torch.Tensor,
                packed: dict) -> None:
        """``node`` (``x W (+ b)``) as oneDNN's product by ``W`` pre-packed for about :attr:`rows` rows."""
        if weight.target not in packed:
            name = f"{weight.target}_packed"
            dense = value.t().contiguous()  # [C_out, C_in], F.linear's layout
            graph.owning_module.register_buffer(name, torch.ops.mkldnn._reorder_linear_weight(dense, self.rows))
            with graph.inserting_before(weight):
                packed[weight.target] = graph.get_attr(name)
            packed[weight.target].meta = {**weight.meta, "val": weight.meta["val"].t().contiguous()} \
                if "val" in weight.meta else dict(weight.meta)  # the logical shape Inductor reads
        bias, x = (node.args[0], node.args[1]) if node.target is torch.ops.aten.addmm.default else (None, node.args[0])
        with graph.inserting_before(node):
            product = graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                          (x, packed[weight.target], bias, "none", [], ""))
        product.meta = dict(node.meta)
        node.replace_all_uses_with(product)
        graph.erase_node(node)

    def uuid(self) -> str:
        """Inductor's cache key of the pass."""
        return f"nas.export.aot.ProductLayout/4/{self.pack}/{self.rows}"
