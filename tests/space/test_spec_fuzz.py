"""Hypothesis-generated bad sweep YAMLs: every mutation of a shipped, valid file either loads or raises SpecError
with a few lines that each name a key path; never KeyError, TypeError, AttributeError or another traceback."""

from __future__ import annotations

import copy
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nas.space import SpecError, SweepSpec, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
BASES = {p.name: yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted((REPO / "search_spaces").glob("*.yaml"))}
SOURCE = "fuzz.yaml"
TOP_KEYS = tuple(SweepSpec.model_fields)
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

Path_ = tuple[Any, ...]


def paths(node: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every key path of a parsed YAML document (mapping keys and list indices), the root included."""
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += paths(value, (*prefix, i))
    return out


def get(doc: Any, path: Path_) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def set_at(doc: Any, path: Path_, value: Any) -> Any:
    """``doc`` with the node at ``path`` replaced (the root when ``path`` is empty)."""
    if not path:
        return value
    get(doc, path[:-1])[path[-1]] = value
    return doc


def misspell(key: str, draw) -> str:
    """A typo of ``key``: a letter dropped, doubled, swapped or replaced."""
    if not key:
        return "x"
    i = draw(st.integers(0, len(key) - 1))
    kind = draw(st.sampled_from(["drop", "double", "swap", "replace", "case"]))
    if kind == "drop" and len(key) > 1:
        return key[:i] + key[i + 1:]
    if kind == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2:]
    if kind == "replace":
        return key[:i] + draw(st.sampled_from("aeiouxz_-")) + key[i + 1:]
    if kind == "case":
        return key.upper()
    return key[:i] + key[i] + key[i:]


scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(10 ** 20), max_value=10 ** 20),
    st.sampled_from([-1, 0, 1, 2, 3, 4, 7, 64, 2 ** 31, 10 ** 12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["prime", "sequential", "model_width", "bleu", "maximize", "joint", "postgresql://x@h/db",
                     "[/x]", "a\nb", "", "1e3", "true"]),
)
odd_keys = st.one_of(st.sampled_from(["a\nb", "int", "str", "list[int]", " values", "", "<<"]),
                     st.sampled_from([0, -1, 256, True, None]), st.text(max_size=6))
"""Keys a typo or a paste can produce: newlines, pydantic's union pseudo keys, numbers, booleans, null."""
junk = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-3, 300)), children,
                                               max_size=4)),
    max_leaves=10,
)


def out_of_range(value: Any) -> list[Any]:
    """Numbers near and past the limits of a numeric leaf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [-1, 0, 10 ** 9]
    return [-value, 0, value + 1, value * 1000, -1, 0.5, math.nan, math.inf, 10 ** 30]


OPS = ("drop", "misspell", "add_key", "add_key", "junk", "range", "wrap", "unwrap", "retype")


@st.composite
def mutated(draw) -> dict:
    """A shipped sweep YAML with 1-4 mutations: keys dropped, misspelled or added (typos, odd keys), wrong types,
    out-of-range numbers, nested junk, sections swapped between mappings and lists."""
    doc: Any = copy.deepcopy(BASES[draw(st.sampled_from(sorted(BASES)))])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(OPS))
        every = paths(doc)
        if op == "add_key":
            every = [p for p in every if isinstance(get(doc, p), dict)] or every
        path = draw(st.sampled_from(every))
        node = get(doc, path)
        if op == "drop" and path:
            del get(doc, path[:-1])[path[-1]]
        elif op == "misspell" and path and isinstance(path[-1], str):
            parent = get(doc, path[:-1])
            parent[misspell(path[-1], draw)] = parent.pop(path[-1])
        elif op == "add_key" and isinstance(node, dict):
            known = [k for k in node if isinstance(k, str)] or ["x"]
            key = misspell(draw(st.sampled_from(known)), draw) if draw(st.booleans()) else draw(odd_keys)
            node[key] = draw(junk)
        elif op == "junk":
            doc = set_at(doc, path, draw(junk))
        elif op == "range":
            doc = set_at(doc, path, draw(st.sampled_from(out_of_range(node))))
        elif op == "wrap":
            doc = set_at(doc, path, [node])
        elif op == "unwrap" and isinstance(node, (list, dict)) and node:
            doc = set_at(doc, path, next(iter(node.values())) if isinstance(node, dict) else node[0])
        elif op == "retype":
            doc = set_at(doc, path, str(node) if not isinstance(node, str) else draw(st.sampled_from([1, [node], {node: 1}])))
    return doc


def assert_one_line_per_problem(message: str) -> None:
    """A SpecError message: a few lines, each ``fuzz.yaml: ...`` naming a key path of the schema."""
    lines = message.splitlines()
    assert 1 <= len(lines) <= 12, message
    for line in lines:
        assert line.startswith(f"{SOURCE}: "), message
        assert "Traceback" not in line, message
        assert re.search(r"\b(" + "|".join(TOP_KEYS) + r")\b", line) or "<top level>" in line, \
            f"no key path named in: {line!r}"


@FUZZ
@given(doc=mutated())
def test_a_mutated_sweep_yaml_loads_or_raises_spec_error_naming_the_key_path(doc):
    try:
        spec = parse_spec(doc, SOURCE)
    except SpecError as e:
        assert_one_line_per_problem(str(e))
    else:
        assert isinstance(spec, SweepSpec)


def test_the_mutations_hit_errors_and_valid_files(tmp_path):
    """The generator is not vacuous: it yields both accepted specs and SpecErrors of several kinds."""
    outcomes: set[str] = set()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(doc=mutated())
    def collect(doc):
        try:
            parse_spec(doc, SOURCE)
            outcomes.add("ok")
        except SpecError as e:
            text = str(e)
            outcomes.update(kind for kind in ("unknown key", "required key is missing", "Input should be",
                                              "did you mean", "above") if kind in text)

    collect()
    assert {"ok", "unknown key", "required key is missing", "Input should be", "did you mean"} <= outcomes, outcomes


# ---- the YAML text itself ----------------------------------------------------------------------

_TEXTS = {name: (REPO / "search_spaces" / name).read_text(encoding="utf-8") for name in sorted(BASES)}
_WORK = Path(tempfile.mkdtemp(prefix="nas-spec-fuzz-"))


@st.composite
def mangled_text(draw) -> str:
    """A shipped YAML with characters that matter to YAML inserted, lines deleted or indented with tabs."""
    text = _TEXTS[draw(st.sampled_from(sorted(_TEXTS)))]
    for _ in range(draw(st.integers(1, 3))):
        lines = text.splitlines()
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["insert", "delete", "tab", "dedent", "duplicate"]))
        if op == "insert":
            j = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:j] + draw(st.text(alphabet=":{}[]-,&*!|>'\"#%@` \t?", min_size=1, max_size=3)) \
                + lines[i][j:]
        elif op == "delete":
            del lines[i]
        elif op == "tab":
            lines[i] = "\t" + lines[i]
        elif op == "dedent":
            lines[i] = lines[i].lstrip()
        else:
            lines.insert(i, lines[i])
        text = "\n".join(lines) + "\n"
    return text


@FUZZ
@given(text=mangled_text())
def test_a_mangled_yaml_text_loads_or_raises_spec_error_with_the_file(text):
    path = _WORK / SOURCE
    path.write_text(text, encoding="utf-8")
    try:
        load_spec(path, check_files=False)
    except SpecError as e:
        message = str(e)
        lines = message.splitlines()
        assert 1 <= len(lines) <= 12, message
        assert all(line.startswith(f"{path}:") for line in lines), message
        if "malformed YAML" in message:
            assert re.search(rf"^{re.escape(str(path))}: line \d+, column \d+: malformed YAML: ", message), message


@pytest.mark.parametrize("text, expected", [
    ("name: a\nname: b\n", r"line 2, column 1: malformed YAML: duplicate key 'name' \(first at line 1\)"),
    ("name: a\nsupernet: {model_dim: 8, model_dim: 16}\n", r"line 2, column 26: malformed YAML: duplicate key 'model_dim'"),
    ("base: &b {heads: 2}\nsupernet: {<<: *b, heads: 4}\n", r"base: unknown key"),  # a merge key may be overridden
])
def test_a_repeated_key_is_an_error_with_both_lines(text, expected, tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError, match=expected):
        load_spec(path, check_files=False)
