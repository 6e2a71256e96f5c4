"""Model files (issue 15): a crash between writing the weights and the config never yields a silently
mismatched pair."""

from __future__ import annotations

import json

import pytest
import torch

import nas.model.io as model_io
from nas.errors import NasError
from nas.model import SuperTransformer
from nas.model.io import load_model, save_model
from nas.space.arch import Arch, StackArch

MAXIMA = Arch(StackArch((32, 32), (64, 64)), StackArch((32, 32), (64, 64)))


def _model(heads: int, seed: int) -> SuperTransformer:
    torch.manual_seed(seed)
    return SuperTransformer(50, 32, heads, MAXIMA, max_positions=64).eval()


def _crash_before_the_config(monkeypatch) -> None:
    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed between the two writes")

    monkeypatch.setattr(model_io, "atomic_write_text", crash)


def test_new_weights_beside_an_old_config_are_refused(tmp_path, monkeypatch):
    """heads=2 then heads=4: the same tensor shapes, so before the fix the new weights loaded silently into the
    old architecture."""
    save_model(_model(heads=2, seed=0), tmp_path, "supernet")
    _crash_before_the_config(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save_model(_model(heads=4, seed=1), tmp_path, "supernet")
    assert json.loads((tmp_path / "supernet.json").read_text())["heads"] == 2  # the old config stayed
    with pytest.raises(NasError, match=r"supernet\.safetensors and .*supernet\.json do not belong together .*heads"):
        load_model(tmp_path, "supernet")


def test_new_weights_beside_an_equal_config_load(tmp_path, monkeypatch):
    """A checkpoint of the same architecture: the pair is consistent, so the new weights load."""
    save_model(_model(heads=2, seed=0), tmp_path)
    _crash_before_the_config(monkeypatch)
    new = _model(heads=2, seed=1)
    with pytest.raises(KeyboardInterrupt):
        save_model(new, tmp_path)
    loaded = load_model(tmp_path)
    for key, value in new.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


def test_a_complete_save_round_trips(tmp_path):
    model = _model(heads=4, seed=3)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config() == model.config()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
