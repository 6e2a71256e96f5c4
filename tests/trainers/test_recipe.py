"""The three-stage recipe's learning-rate schedule (Scalable Transformers App. A, Table 4): warm-up and
peak restart at each stage, checked against the formula of Vaswani et al. 2017 (sec. 5.3, eq. 3)."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.optim import make_scheduler


def _vaswani(step: int, warmup: int) -> float:
    """eq. 3 normalised to 1 at the end of the warm-up: min(step / warmup, sqrt(warmup / step)), step >= 1."""
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step))


def _rates(stage_steps, warmup, lr=1.0):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=lr)
    scheduler = make_scheduler(optimizer, warmup, stage_steps)
    rates = []
    for _ in range(sum(stage_steps)):
        rates.append(optimizer.param_groups[0]["lr"])  # the rate of this optimizer step
        optimizer.step()
        scheduler.step()
    return rates


def test_warm_up_and_peak_restart_at_each_stage():
    stages, warmup = [10, 6, 8], 4
    rates = _rates(stages, warmup)
    expected = [_vaswani(j, warmup) for n in stages for j in range(n)]
    assert rates == pytest.approx(expected)
    assert rates[10] == rates[16] == rates[0] == pytest.approx(1 / warmup)  # each stage starts warming up again
    assert rates[10 + warmup] == pytest.approx(1.0)  # and reaches the peak after its own warm-up


def test_one_stage_keeps_the_single_schedule():
    assert _rates([12], 4) == pytest.approx([_vaswani(j, 4) for j in range(12)])


def test_the_schedule_resumes_from_the_global_step():
    """A scheduler rebuilt from a checkpoint's state continues at the same rates (stage 2, step 3)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=1.0)
    scheduler = make_scheduler(optimizer, 4, [5, 5])
    for _ in range(8):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    optimizer2 = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = make_scheduler(optimizer2, 4, [5, 5])
    resumed.load_state_dict(state)
    optimizer2.param_groups[0]["lr"] = resumed.get_last_lr()[0]
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(_vaswani(3, 4))
