"""The docs build (issue 30): ``mkdocs build --strict`` over ``docs/`` (a broken link, a missing page in the nav or
an API reference that does not resolve fails), the API reference renders ``nas.__all__`` without reST roles, the
README stays short and keeps the deviations table that ``docs/papers.md`` repeats."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_mkdocs_builds_strict(site):
    assert (site / "index.html").is_file() and (site / "api" / "index.html").is_file()


def test_the_api_reference_covers_the_public_api_in_plain_text(site):
    import nas

    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in nas.__all__:
        target = "export_trial" if name == "export" else name
        assert re.search(rf'id="[\w.]*\b{target}"', html), f"nas.{name} is not in docs/api.md"
    text = re.sub(r"<[^>]+>", "", html)
    assert not re.search(r":(class|func|meth|mod|data|attr|exc):", text), "reST roles in the API reference"


def test_the_readme_is_short_and_its_deviation_table_is_the_docs_one():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES

    def table(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("| ") and line.count("|") == 5]

    rows = table(readme)
    papers = table((ROOT / "docs" / "papers.md").read_text(encoding="utf-8"))
    assert papers and all(row in rows for row in papers)
