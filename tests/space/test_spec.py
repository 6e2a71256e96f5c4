"""Tests for the sweep YAML (nas.space.schema, nas.space.loader) and the `nas space` / `nas sweep` CLI on bad and good files."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nas.cli import app
from nas.space.arch import Arch
from nas.space.space import SearchSpace, format_count
from nas.space import SpecError, load_spec

REPO = Path(__file__).resolve().parents[2]
SWEEP_FILES = sorted((REPO / "search_spaces").glob("*.yaml"))
BAD_SPECS = sorted((REPO / "tests" / "bad_specs").glob("*.yaml"))
QUICKSTART = "search_spaces/quickstart.yaml"


def expected_fragment(path: Path) -> str:
    """The message fragment a bad spec promises in its first line: ``# expect: FRAGMENT``."""
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# expect: "), f"{path} must start with '# expect: <message fragment>'"
    return first.removeprefix("# expect: ").strip()


def squash(text: str) -> str:
    """Drop all whitespace, so a message the console wrapped at 80 columns still matches."""
    return "".join(text.split())


@pytest.fixture
def in_repo(monkeypatch) -> Path:
    """Run from the repository root: the YAMLs' data paths are relative to it."""
    monkeypatch.chdir(REPO)
    return REPO


def test_the_repository_ships_sweep_files():
    assert len(SWEEP_FILES) >= 1


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.name)
def test_each_shipped_sweep_file_loads_with_its_data_files(path, in_repo):
    spec = load_spec(path)
    assert spec.name
    for split in (spec.data.train, spec.data.valid):
        assert split.src.is_file() and split.tgt.is_file()


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.name)
def test_each_shipped_sweep_file_starts_with_the_command_that_runs_it(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(f"# nas sweep search_spaces/{path.name}")


def test_the_bad_spec_corpus_covers_every_error_kind():
    names = {p.stem for p in BAD_SPECS}
    assert {"unknown_top_level_key", "unknown_supernet_key", "unknown_space_key", "wrong_type_train_steps",
            "width_above_model_dim", "width_not_divisible_by_heads", "empty_values", "duplicated_values",
            "missing_model_dim", "malformed_yaml", "unknown_metric", "top_level_list", "missing_data_file"} <= names


@pytest.mark.parametrize("path", BAD_SPECS, ids=lambda p: p.stem)
def test_bad_spec_raises_spec_error_naming_the_file_and_the_problem(path, in_repo):
    fragment = expected_fragment(path)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert fragment in message
    assert str(path) in message


def test_unknown_nested_key_suggests_the_closest_allowed_key(in_repo):
    with pytest.raises(SpecError, match=r"supernet\.model_dimm: unknown key \(did you mean 'model_dim'\?\)"):
        load_spec(REPO / "tests" / "bad_specs" / "unknown_supernet_key.yaml")


def test_width_above_model_dim_names_both_keys(in_repo):
    with pytest.raises(SpecError) as info:
        load_spec(REPO / "tests" / "bad_specs" / "width_above_model_dim.yaml")
    assert "space.width" in str(info.value) and "supernet.model_dim" in str(info.value)


def test_malformed_yaml_reports_the_line_number(in_repo):
    with pytest.raises(SpecError, match=r"line \d+"):
        load_spec(REPO / "tests" / "bad_specs" / "malformed_yaml.yaml")


def test_missing_data_file_names_the_key_and_the_path(in_repo):
    with pytest.raises(SpecError) as info:
        load_spec(REPO / "tests" / "bad_specs" / "missing_data_file.yaml")
    assert "data.train.src" in str(info.value)
    assert "../shared/data/multi30k/train.xx.gz" in str(info.value)


def test_missing_data_file_is_accepted_without_file_checks(in_repo):
    spec = load_spec(REPO / "tests" / "bad_specs" / "missing_data_file.yaml", check_files=False)
    assert spec.data.train.src == Path("../shared/data/multi30k/train.xx.gz")


def test_unreadable_sweep_file_raises_spec_error_with_its_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="cannot read sweep file") as info:
        load_spec(missing)
    assert str(missing) in str(info.value)


def test_non_utf8_sweep_file_raises_spec_error(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(SpecError, match="latin1.yaml"):
        load_spec(latin1)


# ---- CLI ----------------------------------------------------------------------------------------

runner = CliRunner()


@pytest.mark.parametrize("path", BAD_SPECS, ids=lambda p: p.stem)
def test_cli_sweep_on_a_bad_file_exits_2_and_prints_the_problem(path, in_repo):
    result = runner.invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2, result.output
    assert squash(expected_fragment(path)) in squash(result.output)
    assert squash(str(path)) in squash(result.output)


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch) -> Path:
    """An empty working folder as the current directory, beside a ``shared`` link to the repository's, so the
    YAMLs' ``../shared/data`` paths resolve; no backend chosen by the environment."""
    for var in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "shared").symlink_to((REPO.parent / "shared").resolve(), target_is_directory=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize("path", BAD_SPECS, ids=lambda p: p.stem)
def test_cli_sweep_on_a_bad_file_prints_one_error_line_and_writes_nothing(path, empty_cwd):
    result = runner.invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected_fragment(path) in lines[0] and str(path) in lines[0], lines[0]
    assert sorted(p.name for p in empty_cwd.iterdir()) == []  # no nas_runs/, mlflow.db, mlruns/ or anything else
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "Ray was started"


def test_cli_sweep_names_several_problems_of_a_file_in_one_line(empty_cwd):
    bad = empty_cwd.parent / "two_problems.yaml"
    bad.write_text("name: two\ntrain: {steps: many}\nsupernet: {model_dim: 64, model_dimm: 32, extra: 1}\n",
                   encoding="utf-8")
    result = runner.invoke(app, ["sweep", str(bad)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {bad}: ") and lines[0].count(str(bad)) == 1, lines[0]
    for fragment in ("supernet.model_dimm: unknown key", "supernet.extra: unknown key", "train.steps: "):
        assert fragment in lines[0], lines[0]
    assert "; " in lines[0] and sorted(p.name for p in empty_cwd.iterdir()) == []


def test_a_misspelt_key_is_named_once_not_also_as_a_missing_key(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("name: typo\nsupernet: {model_dimm: 64}\n", encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(bad, check_files=False)
    assert "supernet.model_dimm: unknown key (did you mean 'model_dim'?)" in str(info.value)
    assert "supernet.model_dim: required key is missing" not in str(info.value)


@pytest.mark.parametrize("path", [p for p in BAD_SPECS if p.stem not in ("missing_data_file", "latency_predictor_missing")],
                         ids=lambda p: p.stem)  # files are checked by `nas sweep`, not by `nas space show`
def test_cli_space_show_on_a_bad_file_exits_2_and_prints_the_problem(path, in_repo):
    result = runner.invoke(app, ["space", "show", str(path)])
    assert result.exit_code == 2, result.output
    assert squash(expected_fragment(path)) in squash(result.output)


@pytest.mark.parametrize("command", [["sweep"], ["space", "show"]], ids=" ".join)
def test_cli_prints_the_key_path_of_a_nested_unknown_key(command, in_repo):
    result = runner.invoke(app, [*command, "tests/bad_specs/unknown_supernet_key.yaml"])
    assert result.exit_code == 2
    assert "supernet.model_dimm" in result.output
    assert "model_dim" in result.output


def test_cli_prints_a_bad_value_that_looks_like_markup_verbatim(tmp_path):
    bad = tmp_path / "markup.yaml"
    bad.write_text('name: x\ntrain: {steps: "[/x]"}\n', encoding="utf-8")
    result = runner.invoke(app, ["space", "show", str(bad)])
    assert result.exit_code == 2
    assert "(got '[/x]')" in result.output


def test_cli_space_show_prints_the_number_of_sub_transformers_and_parameters(in_repo):
    spec = load_spec(QUICKSTART)
    count = format_count(SearchSpace.from_spec(spec).size())
    result = runner.invoke(app, ["space", "show", QUICKSTART])
    assert result.exit_code == 0, result.output
    assert f"sub-Transformers: {count}" in result.output
    assert "M parameters" in result.output
    assert "quickstart: search space" in result.output


def test_format_count_groups_thousands_and_uses_powers_of_ten_for_huge_counts():
    assert format_count(331_776) == "331,776"
    assert format_count(3 * 10 ** 12) == "~3.0e+12 (10^12.5)"


def sample_cli(seed: int) -> str:
    result = runner.invoke(app, ["space", "sample", QUICKSTART, "--seed", str(seed)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_cli_space_sample_prints_an_arch_within_the_supernet(in_repo):
    spec = load_spec(QUICKSTART)
    space = SearchSpace.from_spec(spec)
    arch = Arch.from_json(sample_cli(3))
    arch.check_within(space.supernet_maxima(spec))
    assert arch == space.sample(random.Random(3))


def test_cli_space_sample_is_reproducible_for_a_seed(in_repo):
    assert sample_cli(3) == sample_cli(3)
    outputs = {sample_cli(seed) for seed in range(6)}
    assert len(outputs) > 1


def test_unknown_key_inside_a_list_item_gets_a_suggestion(tmp_path):
    bad = tmp_path / "metric.yaml"
    bad.write_text((REPO / QUICKSTART).read_text(encoding="utf-8").replace("metrics: [{name: bleu", "metrics: [{nme: bleu"), encoding="utf-8")
    with pytest.raises(SpecError, match=r"search\.metrics\.0\.nme: unknown key \(did you mean 'name'\?\)"):
        load_spec(bad, check_files=False)


def test_paper_defaults_drop_branch_only_with_branches_and_p_beta_085(in_repo):
    """MAT drop-branch (rho 0.1) only in a space with branches; MUTE p_beta = 0.85 (sec. 3.2)."""
    no_branches = load_spec(REPO / "search_spaces" / "multipath.yaml")
    assert no_branches.max_branches == 1 and no_branches.drop_branch == 0.0
    with_branches = load_spec(REPO / "search_spaces" / "mat.yaml")
    assert with_branches.max_branches > 1 and with_branches.drop_branch == 0.1
    assert load_spec(REPO / "search_spaces" / "mute.yaml").train.unit_bias_rate == 0.85
