"""``search.points_to_evaluate`` in the forms a user writes them: arch strings as ``nas retrain --arch`` reads them,
named archs, and ``{file: ...}`` files of named archs (relative to the sweep YAML), each checked against the space
when the YAML is loaded; and level 2's points of a two-level search (the user's archs first)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nas.space import SpecError, load_spec
from nas.space.arch import Arch
from nas.space.schema import ArchPoint
from nas.space.space import SearchSpace
from tests.conftest import REPO

DEPTH = REPO / "search_spaces" / "quickstart_depth.yaml"
TINY_S = "enc[128/256 128/256] dec[128/256 128/256]"
TINY = "enc[128/256 128/256 128/256 128/256] dec[128/256 128/256 128/256 128/256]"
TINY_L = " ".join(["128/256"] * 6)
TINY_L = f"enc[{TINY_L}] dec[{TINY_L}]"


def _sweep(tmp_path: Path, points: list, **search) -> Path:
    """quickstart_depth.yaml (encoder 2-6 layers, decoder 1-4; widths 64/128, FFN 256/512, branches 1/2) with these
    points, written into ``tmp_path``."""
    raw = yaml.safe_load(DEPTH.read_text(encoding="utf-8"))
    raw["search"] = {**raw["search"], "points_to_evaluate": points, **search}
    path = tmp_path / "sweep.yaml"
    path.write_text("# nas sweep sweep.yaml\n" + yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path


def _baselines(folder: Path, **archs: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "baselines.yaml"
    path.write_text("".join(f'{name}: "{arch}"\n' for name, arch in archs.items()), encoding="utf-8")
    return path


def test_an_arch_string_is_scored_as_that_arch(tmp_path):
    spec = load_spec(_sweep(tmp_path, ["narrowest", TINY_S]), check_files=False)
    space = SearchSpace.from_spec(spec)
    narrowest, tiny_s = space.point_params(spec.search.points_to_evaluate)
    assert space.from_params(narrowest) == space.narrowest()
    assert space.from_params(tiny_s) == Arch.parse(TINY_S)
    assert spec.search.point_names() == ["narrowest", "points_to_evaluate.1"]
    assert spec.search.arch_points() == [1]


def test_a_file_of_named_archs_relative_to_the_sweep_yaml_becomes_named_points_in_its_place(tmp_path):
    _baselines(tmp_path / "baselines", **{"Tiny-S": TINY_S, "Transformer-Tiny": TINY})
    path = _sweep(tmp_path, ["narrowest", {"file": "baselines/baselines.yaml"}, {"name": "mine", "arch": TINY_S}],
                  trials=12)
    spec = load_spec(path, check_files=False)
    points = spec.search.points_to_evaluate
    assert points[1:] == [ArchPoint(name="Tiny-S", arch=TINY_S), ArchPoint(name="Transformer-Tiny", arch=TINY),
                          ArchPoint(name="mine", arch=TINY_S)]
    assert spec.search.point_names() == ["narrowest", "Tiny-S", "Transformer-Tiny", "mine"]
    assert spec.search.arch_points() == [1, 2, 3]
    space = SearchSpace.from_spec(spec)
    assert [space.from_params(p) for p in space.point_params(points[1:])] == \
        [Arch.parse(TINY_S), Arch.parse(TINY), Arch.parse(TINY_S)]


def test_the_saved_copy_holds_the_file_s_archs_so_a_resume_needs_no_file(tmp_path):
    baselines = _baselines(tmp_path, tiny=TINY)
    path = _sweep(tmp_path, [{"file": "baselines.yaml"}])
    spec = load_spec(path, check_files=False)
    copy = tmp_path / "runs" / "sweep.yaml"  # where nas sweep saves it: another folder
    copy.parent.mkdir()
    copy.write_text(spec.yaml_text(path), encoding="utf-8")
    baselines.unlink()
    assert copy.read_text().startswith(f"# {path} with search.points_to_evaluate's files ({baselines}) inlined\n")
    assert load_spec(copy, check_files=False).model_dump() == spec.model_dump()


def test_the_shipped_baselines_of_quickstart_depth_are_its_two_in_space_ones():
    spec = load_spec(DEPTH, check_files=False, overrides=[
        "search.points_to_evaluate=[narrowest, middle, {file: baselines/quickstart_depth.yaml}]"])
    names = spec.search.point_names()
    assert [names[i] for i in spec.search.arch_points()] == ["Tiny-S", "Transformer-Tiny"]
    comment = [line for line in (REPO / "search_spaces" / "baselines" / "quickstart_depth.yaml").read_text().splitlines()
               if line.startswith("#")]
    assert any("Tiny-L" in line for line in comment)  # left out, and said so
    space = SearchSpace.from_spec(spec)
    with pytest.raises(ValueError, match=r"decoder\.layers=6 is not one of this space's choices \[1, 2, 3, 4\]"):
        space.point_params([TINY_L])


def test_an_arch_of_a_file_outside_the_space_names_the_file_the_name_the_choice_and_the_fix(tmp_path):
    baselines = _baselines(tmp_path, **{"Tiny-S": TINY_S, "Tiny-L": TINY_L})
    path = _sweep(tmp_path, ["narrowest", {"file": "baselines.yaml"}])
    with pytest.raises(SpecError) as err:
        load_spec(path, check_files=False)
    message = str(err.value)
    assert message.startswith(f"{path}: search.points_to_evaluate.1: Tiny-L of point file {baselines} ")
    assert "decoder.layers=6 is not one of this space's choices [1, 2, 3, 4]" in message
    assert f"fix or remove Tiny-L in {baselines}, or widen space.*" in message


@pytest.mark.parametrize("arch, choice", [
    ("enc[128/256 128/256] dec[128/256x3]", "decoder.branches.0=3 is not one of this space's choices [1, 2]"),
    ("enc[128/256 128/256] dec[96/256]", "decoder.width.0=96 is not one of this space's choices [64, 128]"),
    ("C64 enc[64/256 64/256] dec[64/256]", "model_width=64: this space has no model_width choice"),
])
def test_an_arch_string_outside_the_space_names_the_choice(tmp_path, arch, choice):
    path = _sweep(tmp_path, [arch])
    with pytest.raises(SpecError, match=r"search\.points_to_evaluate\.0: the arch .* is outside the space") as err:
        load_spec(path, check_files=False)
    assert choice in str(err.value)


def test_a_choice_the_space_fixes_is_named_with_the_value_it_has(tmp_path):
    """A dimension of one value is no Optuna parameter: the arch is rebuilt from its parameters and compared."""
    raw = yaml.safe_load(DEPTH.read_text(encoding="utf-8"))
    raw["space"]["ffn_width"] = {"values": [512], "per_layer": True}
    raw["search"]["points_to_evaluate"] = [TINY_S]
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    with pytest.raises(SpecError, match=r"encoder\.ffn_width\.0=256: this space fixes ffn_width at 512"):
        load_spec(path, check_files=False)


def test_a_missing_point_file_names_the_key_the_file_and_the_fix(tmp_path):
    path = _sweep(tmp_path, ["narrowest", {"file": "nope.yaml"}])
    with pytest.raises(SpecError) as err:
        load_spec(path, check_files=False)
    assert str(err.value) == (
        f"{path}: search.points_to_evaluate.1: point file not found: {tmp_path / 'nope.yaml'} (a relative path is "
        "read from the sweep YAML's folder); fix the path, or create the file and write it as NAME: ARCH lines, "
        'e.g. tiny: "enc[128/256 128/256] dec[128/256 128/256]"')


@pytest.mark.parametrize("text, message", [
    ("", "holds no named archs"),
    ("- enc[128/256] dec[128/256]\n", "holds no named archs"),
    ('tiny: "enc[128/256 128/256] dec[128/256x]"\n', "tiny: arch 'enc[128/256 128/256] dec[128/256x]'"),
    ('"two words": "enc[128/256 128/256] dec[128/256]"\n', "name 'two words' must be 1-64 letters"),
    ('tiny: "enc[128/256 128/256] dec[128/256]"\ntiny: "enc[64/256 64/256] dec[64/256]"\n', "duplicate key 'tiny'"),
    ("tiny: [\n", "malformed YAML"),
])
def test_a_malformed_point_file_is_named_with_what_is_wrong(tmp_path, text, message):
    (tmp_path / "baselines.yaml").write_text(text, encoding="utf-8")
    path = _sweep(tmp_path, [{"file": "baselines.yaml"}])
    with pytest.raises(SpecError, match=r"search\.points_to_evaluate\.0: .*point file") as err:
        load_spec(path, check_files=False)
    assert message in str(err.value)


@pytest.mark.parametrize("points, message", [
    (["narowest"], "search.points_to_evaluate.0: 'narowest' is not a point (did you mean 'narrowest'?); write widest"),
    (["enc[128/256 128/256] dec[128/256"], "search.points_to_evaluate.0: arch 'enc[128/256 128/256] dec[128/256'"),
    ([{"name": "tiny"}], "search.points_to_evaluate.0: a named arch is {name: NAME, arch: ARCH}, with nothing else "
                         "(missing arch)"),
    ([{"name": "narrowest", "arch": TINY_S}], "name 'narrowest' is a reference sub-Transformer's"),
    ([{"name": "a", "arch": TINY_S}, {"name": "a", "arch": TINY}], "points_to_evaluate.1: the name 'a' is taken by "
                                                                   "points_to_evaluate.0"),
    ([{"file": "b.yaml", "name": "x"}], "search.points_to_evaluate.0: a point file entry is {file: FILE.yaml} alone"),
])
def test_a_malformed_point_is_a_spec_error_naming_it(tmp_path, points, message):
    with pytest.raises(SpecError) as err:
        load_spec(_sweep(tmp_path, points), check_files=False)
    assert message in str(err.value)


def test_level2_scores_the_user_s_archs_first_then_level1_s_other_archs(tmp_path):
    from nas.search.level1 import level2_points

    spec = load_spec(_sweep(tmp_path, ["narrowest", TINY_S, {"name": "tiny", "arch": TINY}], trials=4),
                     check_files=False)
    space = SearchSpace.from_spec(spec)
    tiny_s, tiny = space.point_params([TINY_S, TINY])
    level1 = [space.params_of(space.widest()), tiny, space.params_of(space.middle()), space.params_of(space.narrowest())]
    points, names = level2_points(spec, space, level1)
    assert points == [tiny_s, tiny, space.params_of(space.widest()), space.params_of(space.middle())]
    assert names == ["points_to_evaluate.1", "tiny", None, None]
