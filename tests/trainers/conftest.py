"""Fixtures of the trainer tests that train a tiny supernet for a few steps."""

from __future__ import annotations

import pytest

from nas.builders import prepare_sweep_data
from nas.space import SweepSpec, parse_spec
from tests.conftest import tiny_spec_dict, use_tiny_data


@pytest.fixture(scope="module")
def prepared(multi30k, tiny_data, tmp_path_factory):
    """``(raw spec dict, prepared data)``: the tiny sweep with fp32 and 128-token batches, so that a step takes
    milliseconds on 2 cores (bf16 autocast is slow without AMX); ``train.steps`` left to :func:`spec_with`."""
    work = tmp_path_factory.mktemp("trainers")
    raw = use_tiny_data(tiny_spec_dict(multi30k, work), tiny_data)  # the session's data, not trained again
    raw["train"] = {k: v for k, v in raw["train"].items() if k != "steps"} | \
        {"max_tokens": 128, "precision": "fp32", "log_every": 1, "checkpoint_every": 2, "keep_last": 0}
    return raw, prepare_sweep_data(parse_spec({**raw, "train": {**raw["train"], "steps": 1}}), progress=False)


def spec_with(raw: dict, **train) -> SweepSpec:
    """The spec of ``raw`` with these ``train`` keys set."""
    return parse_spec({**raw, "train": {**raw["train"], **train}})
