"""``--set KEY.PATH=VALUE`` overrides (nas sweep / nas train): applied to the YAML before validation."""

import pytest

from nas.space import SpecError, load_spec
from nas.space.loader import apply_overrides
from tests.conftest import REPO

YAML = REPO / "search_spaces" / "quickstart.yaml"


def test_values_are_read_as_yaml_and_set_in_order_without_changing_the_input():
    raw = {"train": {"steps": 560}, "space": {"width": {"values": [64, 128]}}}
    out = apply_overrides(raw, ["train.steps=2", "space.width.values=[64]", "train.steps=3", "search.trials=1",
                                "tracking.experiment=x y"], "f.yaml")
    assert out == {"train": {"steps": 3}, "space": {"width": {"values": [64]}}, "search": {"trials": 1},
                   "tracking": {"experiment": "x y"}}
    assert raw == {"train": {"steps": 560}, "space": {"width": {"values": [64, 128]}}}


def test_the_spec_keeps_the_effective_yaml_which_loads_back_to_the_same_spec(tmp_path):
    spec = load_spec(YAML, check_files=False, overrides=["train.steps=2", "search.trials=3"])
    assert (spec.train.steps, spec.search.trials) == (2, 3)
    copy = tmp_path / "copy.yaml"
    copy.write_text(spec.yaml_text(YAML))
    assert copy.read_text().startswith(f"# {YAML} with --set train.steps=2 --set search.trials=3\n")
    assert load_spec(copy, check_files=False).model_dump() == spec.model_dump()
    plain = load_spec(YAML, check_files=False)
    assert plain.yaml_text(YAML) == YAML.read_text() and plain.train.steps == 440


@pytest.mark.parametrize("item, message", [
    ("train.steps", "--set train.steps: expected KEY.PATH=VALUE, e.g. --set train.steps=2"),
    ("=2", "expected KEY.PATH=VALUE"),
    ("train..steps=2", "expected KEY.PATH=VALUE"),
    ("train.steps=[1", "--set train.steps=[1: the value is not valid YAML"),
    ("name.x=1", "--set name.x=1: name is not a section (a mapping) in the YAML, so it has no key 'x'"),
    ("train.stepz=2", "(with --set train.stepz=2): train.stepz: unknown key (did you mean 'steps'?)"),
    ("train.steps=-1", "train.steps"),
])
def test_a_bad_override_is_a_spec_error_naming_it(item, message):
    with pytest.raises(SpecError) as err:
        load_spec(YAML, check_files=False, overrides=[item])
    assert message in str(err.value)
