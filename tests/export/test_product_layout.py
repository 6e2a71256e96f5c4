"""``nas.export.aot_products.ProductLayout``, the AOT packages' graph pass: a product by a frozen weight becomes ``mm`` by a
row-major copy of the weight, with the bias added after it, or (``pack``) oneDNN's product by a pre-packed weight,
and the graph computes what ``F.linear`` does (the reference, eager). The graph is one as Inductor's freezing leaves it: the weights are ``get_attr`` constants,
``F.linear``'s transposed views. That the compiled packages hold no ``addmm`` is checked in ``test_aot.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from nas.export.aot_products import ProductLayout

aten = torch.ops.aten


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(12, 8, generator=g), "b1": torch.randn(12, generator=g),
            "w2": torch.randn(6, 12, generator=g), "b2": torch.randn(6, generator=g)}


def _reference(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """Two layers with a bias, one without (its weight also summed), and a product of two activations."""
    h = torch.relu(F.linear(x, w["w1"], w["b1"]))  # [b, 12]
    out = F.linear(h, w["w2"], w["b2"]) + F.linear(h, w["w2"]) + w["w2"].sum()  # [b, 6]
    return out + (h @ h.t()).sum(-1, keepdim=True)


def _frozen_graph(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.fx.GraphModule:
    """``_reference`` in ATen ops with the weights as constants (``addmm``/``mm`` by the transposed views)."""
    w1t, w2t = w["w1"].t(), w["w2"].t()

    def layers(x):
        h = torch.relu(torch.addmm(w["b1"], x, w1t))
        out = torch.addmm(w["b2"], h, w2t) + torch.mm(h, w2t) + w2t.sum()
        return out + (h @ h.t()).sum(-1, keepdim=True)
    return make_fx(layers)(x)


def _products(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (aten.addmm.default, aten.mm.default)]


def test_products_by_weights_read_row_major_copies_and_add_the_bias_after():
    w, x = _weights(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    gm = _frozen_graph(w, x)
    assert sum(n.target is aten.addmm.default for n in _products(gm)) == 2  # what the pass changes
    ProductLayout()(gm.graph)
    gm.recompile()
    products = _products(gm)
    assert [n.target for n in products] == [aten.mm.default] * 4  # no addmm left
    by_weight = [n for n in products if n.args[1].op == "get_attr"]
    assert len(by_weight) == 3 and all(getattr(gm, n.args[1].target).is_contiguous() for n in by_weight)
    activations = [n for n in products if n.args[1].op != "get_attr"]
    assert len(activations) == 1 and activations[0].args[1].target is aten.t.default  # h @ h.t() as it was
    summed = next(n for n in gm.graph.nodes if n.target is aten.sum.default).args[0]
    assert not getattr(gm, summed.target).is_contiguous()  # the sum reads the original constant
    torch.testing.assert_close(gm(x), _reference(x, w), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("pack, packed_products", [("all", 3), ("wide", 0)])
def test_packed_products_compute_what_f_linear_does(pack, packed_products):
    """``pack="all"``: every product by a weight is oneDNN's by the packed weight, the bias passed in; ``"wide"``:
    only those at least ``PACK_WIDE`` wide (none here: 12 and 6 wide), the rest as without packing."""
    w, x = _weights(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    gm = _frozen_graph(w, x)
    ProductLayout(pack, rows=4)(gm.graph)
    gm.recompile()
    linear = [n for n in gm.graph.nodes if n.target is torch.ops.mkldnn._linear_pointwise.default]
    assert len(linear) == packed_products
    assert len(_products(gm)) == 4 - packed_products  # h @ h.t() stays an mm
    assert all(getattr(gm, n.args[1].target).is_mkldnn for n in linear)
    torch.testing.assert_close(gm(x), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_an_unknown_packing_is_refused():
    with pytest.raises(ValueError, match="pack='some'"):
        ProductLayout("some")


@pytest.mark.parametrize("pack, sgemm_products", [("sgemm", 3), ("sgemm-wide", 1)])
def test_sgemm_products_compute_what_f_linear_does(monkeypatch, pack, sgemm_products):
    """``pack="sgemm"``: every product by a weight becomes ``nas::dnnl_sgemm`` (oneDNN's sgemm in a package,
    ``nas.export.sgemm``) by the row-major copy, the bias added after it; ``"sgemm-wide"``: only those at least
    ``PACK_WIDE`` wide (set to 12 here: ``w1``'s product; the two 6 wide by ``w2`` stay MKL's ``mm``)."""
    from nas.export import aot_products

    monkeypatch.setattr(aot_products, "PACK_WIDE", 12)  # w1's product (12 wide) is wide, w2's (6) are not
    w, x = _weights(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    gm = _frozen_graph(w, x)
    ProductLayout(pack)(gm.graph)
    gm.recompile()
    sgemm = [n for n in gm.graph.nodes if n.target is torch.ops.nas.dnnl_sgemm.default]
    assert len(sgemm) == sgemm_products
    assert all(getattr(gm, n.args[1].target).is_contiguous() for n in sgemm)  # row-major [C_in, C_out]
    assert not any(n.target is aten.addmm.default for n in gm.graph.nodes)
    assert len(_products(gm)) == 4 - len(sgemm)  # h @ h.t() and the narrow ones stay mm
    torch.testing.assert_close(gm(x), _reference(x, w), rtol=1e-6, atol=1e-5)


def test_baddbmm_becomes_bmm_then_the_addition_of_its_bias():
    # the cross-attention's scores with the padding mask expanded over the beams (nas.model.ops.attend_cached):
    # the reference is the eager baddbmm; after the pass no baddbmm is left, only bmm and an addition
    g = torch.Generator().manual_seed(3)
    q, kt = torch.randn(6, 4, 8, generator=g), torch.randn(6, 8, 5, generator=g)
    mask = torch.zeros(6, 1, 5).masked_fill(torch.rand(6, 1, 5, generator=g) < 0.3, float("-inf"))

    def scores(q, kt, mask):
        return torch.softmax(torch.baddbmm(mask.expand(6, 4, 5), q, kt), -1)
    gm = make_fx(scores)(q, kt, mask)
    assert any(n.target is aten.baddbmm.default for n in gm.graph.nodes)
    ProductLayout()(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.baddbmm.default not in targets and aten.bmm.default in targets and aten.add.Tensor in targets
    torch.testing.assert_close(gm(q, kt, mask), scores(q, kt, mask), rtol=1e-6, atol=1e-6)
