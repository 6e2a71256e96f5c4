"""The README's and the docs' ``nas ...`` command lines, run as written on a tiny sweep (issue 30 item 8).

Every fenced ``nas`` line runs in a shell (its quotes and redirections kept), in page order, in one folder
that holds ``search_spaces/quickstart.yaml`` (a tiny sweep named ``quickstart`` on a Multi30k slice, with a
trained supernet in place) and ``source.en``; each must exit 0. Two placeholders are filled in: the example
run id ``8c8fcb8f`` becomes a trial's id prefix, ``<retrain run id>`` the id the last ``nas retrain`` printed.

A page says how a block is tested with an HTML comment on the line before its fence, which the rendered page
hides: ``<!-- docs-test: help (why) -->`` checks each line's options against ``--help`` only (a long run),
``<!-- docs-test: skip (why) -->`` skips it (cluster, docker and GPU commands, which this machine cannot run).
The reason is required. The whole run has a time cap (:data:`CAP_S`); a failure lists the seconds each command took.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import nas_env, sweep_with_supernet, tiny_spec_dict

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|console|)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*docs-test:\s*(run|help|skip)\s*(?:\((.+?)\))?\s*-->")
CAP_S = 1500
"""Seconds for the whole run: two tiny sweeps, four tiny retrains, the rest (197 s on 2 quiet CPU cores)."""
EXAMPLE_RUN_ID = "8c8fcb8f"
RETRAIN_PLACEHOLDER = "<retrain run id>"


def marked_blocks(text: str) -> list[tuple[str, str | None, list[str]]]:
    """``(mode, reason, nas lines)`` for each shell fence of ``text``: ``mode`` from the marker on the line
    before the fence (``run`` without one), the ``nas`` lines without their trailing comments.

    Raises:
        ValueError: a ``help`` or ``skip`` marker without a reason in parentheses.
    """
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        mode, reason = (marker.group(1), marker.group(2)) if marker else ("run", None)
        if mode != "run" and not reason:
            raise ValueError(f"docs-test: {mode} needs a reason in parentheses: {before.strip()}")
        lines = [_strip_comment(line) for line in match.group(2).splitlines() if line.strip().startswith("nas ")]
        if lines:
            found.append((mode, reason, lines))
    return found


def _strip_comment(line: str) -> str:
    """The command of ``line`` without its trailing ``# ...`` comment (a ``#`` inside quotes is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def commands() -> list[tuple[str, str, str, str | None]]:
    """``(page, mode, line, reason)`` for every fenced ``nas`` line of the README and the docs, in page order."""
    return [(str(page.relative_to(ROOT)), mode, line, reason)
            for page in PAGES for mode, reason, lines in marked_blocks(page.read_text(encoding="utf-8"))
            for line in lines]


def test_markers_are_read_and_need_a_reason():
    text = ("```bash\nnas sweep a.yaml   # train\n```\n<!-- docs-test: skip (cluster) -->\n```bash\nnas leaderboard\n```\n"
            "<!-- docs-test: help (long) -->\n```bash\necho x\nnas retrain a.yaml --arch 'enc[1 #2]'\n```\n")
    assert marked_blocks(text) == [("run", None, ["nas sweep a.yaml"]), ("skip", "cluster", ["nas leaderboard"]),
                                   ("help", "long", ["nas retrain a.yaml --arch 'enc[1 #2]'"])]
    with pytest.raises(ValueError, match="needs a reason"):
        marked_blocks("<!-- docs-test: skip -->\n```bash\nnas leaderboard\n```\n")


def test_every_cluster_or_docker_command_is_marked_skip():
    for page, mode, line, _ in commands():
        text = (ROOT / page).read_text(encoding="utf-8")
        block = next(m.group(2) for m in FENCE.finditer(text) if line in m.group(2))
        if re.search(r"docker|--address|ray://|cuda|gpu", block, re.I):
            assert mode == "skip", f"{page}: `{line}` is in a cluster/docker/GPU block without a docs-test: skip marker"


def _shell(line: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    command = f"{shlex.quote(sys.executable)} -m nas.cli {line[len('nas '):]}"
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_every_fenced_command_runs_on_a_tiny_sweep(multi30k, tiny_supernet, tmp_path):
    start = time.monotonic()
    raw = tiny_spec_dict(multi30k, tmp_path, name="quickstart", tracking={"experiment": "quickstart"},
                         retrain={"steps": 4, "checkpoint_every": 2})
    (tmp_path / "search_spaces").mkdir()
    sweep_with_supernet(raw, tmp_path, tiny_supernet).rename(tmp_path / "search_spaces" / "quickstart.yaml")
    (tmp_path / "source.en").write_text("A dog runs in the park .\nTwo men are talking .\n", encoding="utf-8")
    env = nas_env(tmp_path, COLUMNS="250")
    ran, retrain_id = [], None
    for page, mode, line, reason in commands():
        if mode == "skip":
            continue
        if mode == "help":
            words = shlex.split(line)
            command = words[1:3] if words[1] in ("space", "latency") else words[1:2]
            line = "nas " + " ".join(command) + " --help"
        if EXAMPLE_RUN_ID in line:
            line = line.replace(EXAMPLE_RUN_ID, _trial_prefix(tmp_path))
        if RETRAIN_PLACEHOLDER in line:
            assert retrain_id, f"{page}: `{line}` needs a `nas retrain` line before it"
            line = line.replace(RETRAIN_PLACEHOLDER, retrain_id[:8])
        left = CAP_S - (time.monotonic() - start)
        assert left > 0, f"over the {CAP_S} s cap before `{line}` ({page}); ran (s): {ran}"
        began = time.monotonic()
        try:
            proc = _shell(line, tmp_path, env, timeout=left)
        except subprocess.TimeoutExpired:
            pytest.fail(f"over the {CAP_S} s cap in `{line}` ({page}); ran (s): {ran}")
        assert proc.returncode == 0, f"{page}: `{line}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        ran.append((line, round(time.monotonic() - began)))
        found = re.search(r"MLflow run ([0-9a-f]{32})", proc.stdout)
        if line.startswith("nas retrain") and found:
            retrain_id = found.group(1)
    print("seconds per command:", ran)
    assert any(line.startswith("nas sweep search_spaces/quickstart.yaml") for line, _ in ran), ran
    hyps = (tmp_path / "hypotheses.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 2  # the translate example wrote one line a source line
    assert (tmp_path / "exported" / "quickstart" / "export.json").is_file()
    assert (tmp_path / "exported" / "retrained" / "export.json").is_file()
    assert (tmp_path / "front.png").stat().st_size > 0


def _trial_prefix(work: Path) -> str:
    """The id prefix (8 hex digits) of a finished trial of the quickstart experiment in ``work/mlflow.db``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("quickstart")
    runs = client.search_runs([experiment.experiment_id], "tags.`nas.role` = 'trial'")
    return runs[0].info.run_id[:8]
