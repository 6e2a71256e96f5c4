"""The README's and the docs' examples stay true (issue 30): every YAML snippet validates when merged into the
quickstart's YAML, and every ``nas ...`` command line names a command that exists with options its ``--help``
lists. (The commands are checked against their parsers, not run: a sweep per example would cost minutes.)"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nas.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
GROUPS = ("space", "latency")
"""Commands with subcommands: ``nas space show``, ``nas latency fit``."""


def _blocks(lang: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for kind, body in FENCE.findall(page.read_text(encoding="utf-8")):
            if kind == lang or (lang == "bash" and kind in ("", "sh", "console")):
                found.append((f"{page.relative_to(ROOT)}", body))
    return found


def _merge(base: dict, snippet: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in snippet.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


YAMLS = _blocks("yaml")
COMMANDS = sorted({(page, line.split("#")[0].strip()) for page, body in _blocks("bash")
                   for line in body.splitlines() if line.strip().startswith("nas ")})


def test_the_pages_have_examples():
    assert len(YAMLS) >= 3 and len(COMMANDS) >= 10


@pytest.mark.parametrize("page, snippet", YAMLS, ids=[f"{p}#{i}" for i, (p, _) in enumerate(YAMLS)])
def test_every_yaml_snippet_validates_in_the_quickstart(page, snippet):
    from nas.space import parse_spec

    base = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text(encoding="utf-8"))
    raw = yaml.safe_load(snippet)
    assert isinstance(raw, dict), f"{page}: a YAML snippet that is not a mapping"
    if "supernet" not in raw and "space" in raw:  # a space alone: in the unified supernet, which has every family
        home = "scalable_type1.yaml" if "model_width" in raw["space"] else "unified.yaml"
        base = {**yaml.safe_load((ROOT / "search_spaces" / home).read_text()), "space": {}}
    if "stages" in raw.get("train", {}):  # the stages' sum is train.steps when it is left out
        base["train"].pop("steps", None)
    parse_spec(_merge(base, raw), f"{page} snippet")


@pytest.mark.parametrize("page, line", COMMANDS, ids=[line for _, line in COMMANDS])
def test_every_command_line_uses_options_its_help_lists(page, line):
    words = shlex.split(line.replace("<", " < ").replace(">", " > "))
    command = words[1:3] if words[1] in GROUPS else words[1:2]
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, f"{page}: `{line}`: no command nas {' '.join(command)}"
    options = [w.split("=")[0] for w in words if w.startswith("--")]
    missing = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", result.output)]
    assert not missing, f"{page}: `{line}` uses {missing}, which nas {' '.join(command)} --help does not list"
