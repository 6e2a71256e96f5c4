"""``nas.model.ops.dropout`` on the CPU (16-bit keep masks) against the definition of inverted dropout (Srivastava
et al. 2014): the rate within binomial bounds, independent elements, the scaling, the gradient, the seed."""

from __future__ import annotations

import math

import pytest
import torch

from nas.model.ops import DROPOUT_LEVELS, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_the_rate_and_the_element_positions_are_uniform(p):
    torch.manual_seed(0)
    n = 400_000
    kept = keep_mask((n // 8, 8), p).float()
    want = 1 - round(p * DROPOUT_LEVELS) / DROPOUT_LEVELS
    sd = math.sqrt(want * (1 - want) / n)
    assert abs(float(kept.mean()) - want) < 5 * sd
    # every position of the 4 draws cut from one 64-bit word, and every column, keeps at the same rate
    for position in range(4):
        column = kept.view(-1, 4)[:, position]
        assert abs(float(column.mean()) - want) < 5 * math.sqrt(want * (1 - want) / column.numel())
    # neighbours are independent: P(both kept) = P(kept)^2
    pairs = kept.view(-1, 2)
    both = float((pairs[:, 0] * pairs[:, 1]).mean())
    assert abs(both - want ** 2) < 5 * math.sqrt(want ** 2 * (1 - want ** 2) / pairs.size(0))


def test_kept_elements_are_scaled_and_the_rest_zero_with_the_matching_gradient():
    torch.manual_seed(1)
    x = (torch.rand(64, 33) + 0.5).requires_grad_()  # no zeros of its own
    y = dropout(x, 0.25)
    kept = y.detach() != 0
    assert 0 < int(kept.sum()) < x.numel()
    torch.testing.assert_close(y.detach()[kept], x.detach()[kept] / 0.75)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.float() / 0.75)


def test_the_seed_fixes_the_mask_and_p_zero_draws_nothing():
    x = torch.ones(10, 10)
    torch.manual_seed(3)
    a = dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.5), a)
    state = torch.get_rng_state()
    assert dropout(x, 0.0) is x
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_dtype_and_shape_are_kept_and_a_bad_rate_is_named():
    x = torch.ones(3, 5, 7, dtype=torch.bfloat16)
    y = dropout(x, 0.1)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert keep_mask((0, 4), 0.1).shape == (0, 4)
    with pytest.raises(ValueError, match="p=1.5"):
        keep_mask((2,), 1.5)
