"""The README's and the docs' ``nas ...`` command lines and ``import nas`` Python blocks, run as written on a tiny
sweep (issue 30 item 8, issue 40).

Every fenced ``nas`` line runs in a shell (its quotes and redirections kept; a ``leaderboard``, ``export`` or
``report`` line without shell syntax in this process, with the words the shell would pass), and every fenced Python block that
imports ``nas`` runs whole in ``python -c`` (a block whose code, comments aside, was run already is not run again),
in page order, in one folder that holds ``search_spaces/quickstart.yaml`` (a tiny sweep named ``quickstart`` on a
Multi30k slice, with a trained supernet in place, whose first trial is the narrowest arch, the latency reference) and
``source.en``; each must exit 0, and a ``nas leaderboard`` table must show at least one trial. Two placeholders are
filled in: the example run id ``8c8fcb8f`` becomes a trial's id prefix, ``<retrain run id>`` the id the last
``nas retrain`` printed.

A page says how a block is tested with an HTML comment on the line before its fence, which the rendered page
hides: ``<!-- docs-test: help (why) -->`` checks each line's options against ``--help`` only (a long run; shell
blocks only), ``<!-- docs-test: skip (why) -->`` skips it (cluster, docker and GPU commands, which this machine
cannot run).
The reason is required. The whole run has a time cap (:data:`CAP_S`); a failure lists the seconds each command took.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import nas_cli, nas_env, sweep_with_supernet, tiny_spec_dict

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|console|python|)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*docs-test:\s*(run|help|skip)\s*(?:\((.+?)\))?\s*-->")
CAP_S = 1500
"""Seconds for the whole run: two tiny sweeps (and a resume of the second), five tiny retrains, the rest (197 s on 2
quiet CPU cores before the Python block ran)."""
EXAMPLE_RUN_ID = "8c8fcb8f"
RETRAIN_PLACEHOLDER = "<retrain run id>"


def marked_blocks(text: str) -> list[tuple[str, str | None, list[str]]]:
    """``(mode, reason, nas lines)`` for each shell fence of ``text``: ``mode`` from the marker on the line
    before the fence (``run`` without one), the ``nas`` lines without their trailing comments; and for each
    Python fence that imports ``nas``, ``("python", None, [its code as written])`` (``skip`` if so marked).

    Raises:
        ValueError: a ``help`` or ``skip`` marker without a reason in parentheses, a ``help`` marker on a
            Python fence.
    """
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        mode, reason = (marker.group(1), marker.group(2)) if marker else ("run", None)
        if mode != "run" and not reason:
            raise ValueError(f"docs-test: {mode} needs a reason in parentheses: {before.strip()}")
        if match.group(1) == "python":
            if mode == "help":
                raise ValueError(f"docs-test: help is for shell lines, not a Python block: {before.strip()}")
            if re.search(r"^import nas$", match.group(2), re.M):
                found.append(("python" if mode == "run" else mode, reason, [match.group(2)]))
            continue
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
    code = "import nas\n\nnas.leaderboard()  # a table\n"
    assert marked_blocks(f"```python\n{code}```\n```python\nimport json\n```\n"
                         f"<!-- docs-test: skip (a cluster) -->\n```python\n{code}```\n") == [
        ("python", None, [code]), ("skip", "a cluster", [code])]  # a block without `import nas` is no example
    with pytest.raises(ValueError, match="help is for shell lines"):
        marked_blocks(f"<!-- docs-test: help (long) -->\n```python\n{code}```\n")


def _quickstart_yaml() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text(encoding="utf-8"))


def test_readme_leaderboard_filters_by_the_quickstart_s_budget():
    """The README's ``--where`` filter and Pareto objectives use the metric of the quickstart's latency budget
    (``latency_ratio``): its trials take 69-108 ms on a 2-core CPU, so ``latency_ms<=20`` left an empty table."""
    from nas.space.constraints import parse_constraint

    budget = {parse_constraint(c).metric for c in _quickstart_yaml()["search"]["constraints"]}
    lines = [line for mode, _, lines in marked_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
             for line in lines if mode == "run" and line.startswith("nas leaderboard") and "--where" in line]
    assert lines, "the README has no `nas leaderboard --where` example"
    for line in lines:
        words = shlex.split(line)
        filtered = {re.split(r"[<>=!]", words[i + 1])[0] for i, w in enumerate(words) if w == "--where"}
        assert filtered <= budget, f"README: `{line}` filters on {filtered}, the quickstart's budget is {budget}"
        if "--plot" in words:
            assert "--objectives" in words and budget & {
                o.split(":")[0] for o in words[words.index("--objectives") + 1].split(",")}, line


def test_readme_python_sweep_is_a_new_sweep_not_the_quickstart_s():
    """The README's ``nas.sweep(..., overrides=...)`` changes settings, so it names a new sweep, as its ``--set``
    line does: under the quickstart's name it would resume the quickstart's sweep, which refuses changed settings
    (``SpecError``: "search.trials: 8 when the sweep started, now 4")."""
    blocks = [lines[0] for mode, _, lines in marked_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
              if mode == "python"]
    calls = [node for block in blocks for node in ast.walk(ast.parse(block)) if isinstance(node, ast.Call)
             and ast.unparse(node.func) == "nas.sweep"]
    assert calls, "the README's Python block has no nas.sweep call"
    for call in calls:
        overrides = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "overrides"), {})
        if overrides:
            assert overrides.get("name", _quickstart_yaml()["name"]) != _quickstart_yaml()["name"], (
                f"README: `{ast.unparse(call)}` resumes the quickstart's sweep with other settings; add a new "
                "\"name\" to its overrides")


def test_only_lines_without_shell_syntax_run_in_process():
    assert not needs_shell("nas leaderboard --where 'latency_ratio<=1.25' --pareto --plot front.png")
    assert not needs_shell('nas export --run-id abc --out "exported/a b"')
    assert needs_shell("nas translate exported/quickstart < source.en > hypotheses.de")
    assert needs_shell("nas leaderboard --experiment $EXP") and needs_shell("nas leaderboard | head")
    assert shlex.split("nas leaderboard --where 'latency_ratio<=1.25'")[3] == "latency_ratio<=1.25"


def test_every_cluster_or_docker_command_is_marked_skip():
    for page, mode, line, _ in commands():
        text = (ROOT / page).read_text(encoding="utf-8")
        block = next(m.group(2) for m in FENCE.finditer(text) if line in m.group(2))
        if re.search(r"docker|--address|ray://|cuda|gpu", block, re.I):
            assert mode == "skip", f"{page}: `{line}` is in a cluster/docker/GPU block without a docs-test: skip marker"


IN_PROCESS = ("leaderboard", "export", "report")
"""Commands that only read and write files and stores: a line of one of them without shell syntax runs in this
process (:func:`tests.conftest.nas_cli`, the same typer app), not in a ``python -m nas.cli`` that spends 3-5 s on
its imports."""
SHELL_SYNTAX = set("<>|&;$`*?~(){}")


def needs_shell(line: str) -> bool:
    """Whether ``line`` uses shell syntax outside its quotes (a redirection, a pipe, a variable, a glob): such a
    line runs in bash, as a reader's shell would run it."""
    quote = None
    for ch in line:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in SHELL_SYNTAX:
            return True
    return False


def _shell(line: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    words = shlex.split(line)
    if words[1] in IN_PROCESS and not needs_shell(line):  # the same words bash would pass
        return nas_cli(words[1:], env, cwd)
    command = f"{shlex.quote(sys.executable)} -m nas.cli {line[len('nas '):]}"
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_every_fenced_command_runs_on_a_tiny_sweep(multi30k, tiny_supernet, tmp_path):
    start = time.monotonic()
    raw = tiny_spec_dict(multi30k, tmp_path, name="quickstart", tracking={"experiment": "quickstart"},
                         retrain={"steps": 4, "checkpoint_every": 2})
    # the first trial is the latency reference itself (ratio about 1): a `--where 'latency_ratio<=1.25'` finds it
    raw["search"]["points_to_evaluate"] = ["narrowest"]
    (tmp_path / "search_spaces").mkdir()
    sweep_with_supernet(raw, tmp_path, tiny_supernet).rename(tmp_path / "search_spaces" / "quickstart.yaml")
    (tmp_path / "source.en").write_text("A dog runs in the park .\nTwo men are talking .\n", encoding="utf-8")
    env = nas_env(tmp_path, COLUMNS="250")
    ran, retrain_id, python_run = [], None, set()
    for page, mode, line, reason in commands():
        if mode == "skip":
            continue
        if mode == "python":
            _run_python_block(page, line, tmp_path, env, start, ran, python_run)
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
        if line.startswith("nas leaderboard") and "--format" not in line:  # a table: it shows a trial
            assert any(prefix in proc.stdout for prefix in _trial_prefixes(tmp_path)), (
                f"{page}: `{line}` printed no trial:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
        found = re.search(r"MLflow run ([0-9a-f]{32})", proc.stdout)
        if line.startswith("nas retrain") and found:
            retrain_id = found.group(1)
    print("seconds per command:", ran)
    assert any(line.startswith("nas sweep search_spaces/quickstart.yaml") for line, _ in ran), ran
    assert "README.md Python block" in dict(ran), ran
    hyps = (tmp_path / "hypotheses.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 2  # the translate example wrote one line a source line
    assert (tmp_path / "exported" / "quickstart" / "export.json").is_file()
    assert (tmp_path / "exported" / "retrained" / "export.json").is_file()
    assert (tmp_path / "front.png").stat().st_size > 0


def _run_python_block(page: str, code: str, cwd: Path, env: dict[str, str], start: float, ran: list,
                      done: set[str]) -> None:
    """Run the Python block ``code`` as written (``python -c``) unless a block with the same code, comments
    aside, ran before (``done``); it must exit 0 within what is left of :data:`CAP_S`."""
    key = "\n".join(_strip_comment(line) for line in code.splitlines() if _strip_comment(line))
    if key in done:
        return
    done.add(key)
    left = CAP_S - (time.monotonic() - start)
    assert left > 0, f"over the {CAP_S} s cap before the Python block of {page}; ran (s): {ran}"
    began = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=left)
    except subprocess.TimeoutExpired:
        pytest.fail(f"over the {CAP_S} s cap in the Python block of {page}; ran (s): {ran}")
    assert proc.returncode == 0, f"{page}: its Python block exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    ran.append((f"{page} Python block", round(time.monotonic() - began)))


def _trial_prefixes(work: Path) -> set[str]:
    """The id prefixes (8 hex digits, as a leaderboard table shows them) of every trial in ``work/mlflow.db``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    ids = [e.experiment_id for e in client.search_experiments()]
    return {r.info.run_id[:8] for r in client.search_runs(ids, "tags.`nas.role` = 'trial'", max_results=5000)}


def _trial_prefix(work: Path) -> str:
    """The id prefix (8 hex digits) of a finished trial of the quickstart experiment in ``work/mlflow.db``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("quickstart")
    runs = client.search_runs([experiment.experiment_id], "tags.`nas.role` = 'trial'")
    return runs[0].info.run_id[:8]
