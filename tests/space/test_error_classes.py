"""User-given archs and predictor files that are wrong raise the bad-input family (:class:`nas.errors.NasError`:
one line, exit 2 in the CLI), not a bare ``ValueError`` or ``JSONDecodeError``, which the CLI treats as bugs."""

import pytest

from nas.errors import ArchError, NasError, PredictorFileError
from nas.space.arch import Arch, StackArch
from nas.space.predictor_file import read_predictor_meta


def test_an_arch_dict_without_a_stack_is_bad_input():
    with pytest.raises(ArchError, match="missing key 'decoder'") as err:
        Arch.from_dict({"encoder": {"width": [8], "ffn_width": [16]}})
    assert isinstance(err.value, NasError)


def test_an_arch_beyond_the_supernet_names_the_choice():
    big = Arch(StackArch((16,), (32,)), StackArch((16,), (32,)))
    wide = Arch(StackArch((16,), (64,)), StackArch((16,), (32,)))
    with pytest.raises(ArchError, match=r"arch.encoder.ffn_width\[0\]=64 exceeds the supernet's 32"):
        wide.check_within(big)


def test_a_layer_value_below_one_is_bad_input():
    with pytest.raises(ArchError, match=r"width\[0\]=0 must be >= 1"):
        StackArch((0,), (8,))


def test_a_predictor_sidecar_that_is_not_json_is_bad_input(tmp_path):
    (tmp_path / "p.safetensors").write_bytes(b"")
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(PredictorFileError, match=r"p.json is not JSON .*refit with `nas latency fit`"):
        read_predictor_meta(tmp_path / "p.safetensors")
