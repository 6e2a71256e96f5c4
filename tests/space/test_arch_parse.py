"""Arch.parse: the exact inverse of Arch.summary (and of Arch.to_json), with one-line errors naming the bad token."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from nas.errors import ArchError
from nas.space import SearchSpace, load_spec
from nas.space.arch import UNIT_BIASES, Arch, StackArch

SPACES = sorted((Path(__file__).resolve().parents[2] / "search_spaces").glob("*.yaml"))
VALID_EXAMPLE = "e.g. 'enc[128/256 128/256] dec[128/256]'"
"""The start of the valid example every parse error shows."""


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.stem)
def test_summary_of_random_archs_of_every_search_space_parses_back_to_the_same_arch(path):
    space = SearchSpace.from_spec(load_spec(path, check_files=False))
    archs = [space.sample(random.Random(seed)) for seed in range(50)] + [space.widest(), space.narrowest()]
    for arch in archs:
        assert Arch.parse(arch.summary()) == arch, arch.summary()
        assert Arch.parse(arch.to_json()) == arch


def test_random_archs_cover_every_summary_feature():
    """The round trip above sees each token form at least once (width, branches, paths, Prime with and without
    kernels, units with a bias and sequential dependency)."""
    summaries = " ".join(SearchSpace.from_spec(load_spec(path, check_files=False)).sample(random.Random(seed)).summary()
                         for path in SPACES for seed in range(50))
    for token in ("C", "x", "p", "P-", "P3", ",", "u", "-mixed", "-seq"):
        assert token in summaries, token


@pytest.mark.parametrize("bias", [b for b in UNIT_BIASES if b != "identity"])
@pytest.mark.parametrize("dependency", ["independent", "sequential"])
def test_every_unit_bias_and_dependency_round_trips(bias, dependency):
    stack = StackArch(width=(64, 32), ffn_width=(256, 128), units=(3, 1), unit_bias=(bias, "identity"),
                      unit_dependency=(dependency, "independent"))
    arch = Arch(stack, stack, model_width=64)
    assert Arch.parse(arch.summary()) == arch


EXPECTED = {
    "enc[128/256 128/256] dec[128/256]": Arch(
        encoder=StackArch(width=(128, 128), ffn_width=(256, 256)),
        decoder=StackArch(width=(128,), ffn_width=(256,))),
    "C64 enc[128/512x2 64/256p2] dec[128/512P3,15u2-swap-seq]": Arch(
        encoder=StackArch(width=(128, 64), ffn_width=(512, 256), branches=(2, 1), paths=(1, 2)),
        decoder=StackArch(width=(128,), ffn_width=(512,), layout=("prime",), kernels=((3, 15),), units=(2,),
                          unit_bias=("swap",), unit_dependency=("sequential",)),
        model_width=64),
    "enc[96/384P- 32/64x4u3-mask] dec[32/64P7u2 96/384x2p3u4-seq]": Arch(
        encoder=StackArch(width=(96, 32), ffn_width=(384, 64), branches=(1, 4), layout=("prime", "sequential"),
                          kernels=((), ()), units=(1, 3), unit_bias=("identity", "mask")),
        decoder=StackArch(width=(32, 96), ffn_width=(64, 384), branches=(1, 2), paths=(1, 3),
                          layout=("prime", "sequential"), kernels=((7,), ()), units=(2, 4),
                          unit_dependency=("independent", "sequential"))),
    "enc[64/256 64/256] dec[64/256x2e2P3u2-seq 64/256p2e3]": Arch(  # HAT: decoder layers attend to 2 and 3
        encoder=StackArch(width=(64, 64), ffn_width=(256, 256)),
        decoder=StackArch(width=(64, 64), ffn_width=(256, 256), branches=(2, 1), paths=(1, 2),
                          layout=("prime", "sequential"), kernels=((3,), ()), units=(2, 1),
                          unit_dependency=("sequential", "independent"), encoder_attention=(2, 3))),
}


@pytest.mark.parametrize("text", list(EXPECTED))
def test_hand_written_summaries_parse_to_the_literal_arch(text):
    assert Arch.parse(text) == EXPECTED[text]
    assert EXPECTED[text].summary() == text


def test_whitespace_around_tokens_and_json_are_accepted():
    expected = EXPECTED["C64 enc[128/512x2 64/256p2] dec[128/512P3,15u2-swap-seq]"]
    assert Arch.parse("  C64\tenc [ 128/512x2   64/256p2 ]\n dec[ 128/512P3,15u2-swap-seq ]  ") == expected
    assert Arch.parse("\n " + expected.to_json() + " ") == expected
    assert Arch.parse(dataclasses.replace(expected, model_width=None).summary()).model_width is None


@pytest.mark.parametrize("text, token", [
    ("enc[128] dec[128/256]", "'128'"),
    ("enc[128/256]", "dec[...]"),
    ("enc[128/256x0] dec[128/256]", "x0"),
    ("enc[128/256] dec[128/256u0]", "'128/256u0'"),
    ("x0", "'x0'"),
    ("garbage", "'garbage'"),
    ("", "''"),
    ("dec[128/256] enc[128/256]", "'dec[128/256]'"),
    ("enc[] dec[128/256]", "'enc[]'"),
    ("enc[128/256 dec[128/256]", "'dec[128/256]'"),
    ("enc[128/256] dec[128/256", "'dec['"),
    ("enc[128/256] dec[128/256] extra", "'extra'"),
    ("C0 enc[128/256] dec[128/256]", "'C0'"),
    ("Cx enc[128/256] dec[128/256]", "'Cx'"),
    ("enc[128/256P4] dec[128/256]", "P4"),
    ("enc[128/256p2P3] dec[128/256]", "p2"),
    ("enc[128/256u2-noise] dec[128/256]", "'128/256u2-noise'"),
    ("enc[128/256] dec[128/256/512]", "'128/256/512'"),
    ('{"encoder": {"width": [128]', "JSON"),
    ('{"encoder": {"width": ["wide"], "ffn_width": [256]}, "decoder": {"width": [1], "ffn_width": [1]}}', "'wide'"),
    ('{"decoder": {"width": [128], "ffn_width": [256]}}', "'encoder'"),
])
def test_malformed_text_raises_one_line_arch_error_naming_the_token_with_a_valid_example(text, token):
    with pytest.raises(ArchError) as info:
        Arch.parse(text)
    message = str(info.value)
    assert token in message, message
    assert "\n" not in message
    assert VALID_EXAMPLE in message, message
