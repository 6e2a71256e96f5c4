"""``scripts/quickstart.sh`` ends with the seconds of each stage (issue 40), read from the sweep's own lines as
they came (``exported/sweep.log``: each line prefixed with its epoch second) and from times taken around the
commands after the sweep."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "quickstart.sh"


def _program() -> str:
    """The awk program of the script's stage table."""
    match = re.search(r"^awk [^']*'(.*?)' exported/sweep\.log$", SCRIPT.read_text(), flags=re.M | re.S)
    assert match, f"{SCRIPT} has no stage-table awk program reading exported/sweep.log"
    return match.group(1)


def _table(tmp_path: Path, log: str, start: int, swept: int, exported: int, done: int) -> dict[str, int]:
    if shutil.which("awk") is None:
        pytest.skip("no awk on this machine")
    (tmp_path / "sweep.log").write_text(log)
    times = {"start": start, "swept": swept, "exported": exported, "done_s": done}
    args = [a for k, v in times.items() for a in ("-v", f"{k}={v}")]
    out = subprocess.run(["awk", *args, _program(), str(tmp_path / "sweep.log")], check=True, capture_output=True,
                         text=True).stdout
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S.*?)\s+(-?\d+)$", out, flags=re.M)}


def test_each_stage_runs_from_its_first_line_to_the_next_stages(tmp_path):
    log = """1000 prepared data in nas_runs/data/afcc: 29000 train pairs
1030 training the supernet (560 steps) -> nas_runs/quickstart/supernet
1031 (train_trial pid=1) step 8/560 joint loss 9.212 tok/s 796 lr 8.00e-05 10s, ETA 11m
1900 level 1: timing 40 archs on the fixed workload for the latency predictor
2000 level 1: latency predictor fitted on 32 archs, held-out MAPE 11.2%
2001 level 1: 100 x 10 candidates (0 done), valid_loss on 200 validation sentences, NSGA-II, batches of 50
2400 searching (level 2): 8 trials, 2 at a time, evolution on bleu, latency_ratio
"""
    assert _table(tmp_path, log, 995, 2500, 2520, 2545) == {
        "data": 35, "supernet": 870, "predictor samples": 101, "level 1": 399, "level 2": 100,
        "leaderboard, export": 20, "translate, score": 25}


def test_a_stage_the_sweep_skipped_takes_no_seconds(tmp_path):
    log = ("1000 reusing the trained supernet in nas_runs/quickstart/supernet\n"  # and the predictor: no timing
           "1001 level 1: 100 x 10 candidates (1000 done)\n1050 searching (level 2): 8 trials\n")
    table = _table(tmp_path, log, 1000, 1100, 1110, 1120)
    assert table == {"data": 0, "supernet": 0, "predictor samples": 1, "level 1": 49, "level 2": 50,
                     "leaderboard, export": 10, "translate, score": 10}


@pytest.mark.parametrize("line", ["training the supernet", "reusing the trained supernet", "level 1: timing ",
                                  "level 1: {ev.population} x {ev.generations} candidates", "searching"])
def test_the_lines_the_table_reads_are_the_ones_the_sweep_prints(line):
    sources = "".join(p.read_text() for p in (REPO / "nas" / "search").glob("*.py"))
    plain = re.sub(r"\[/?bold\]|\[/?green\]", "", sources)  # rich markup is not printed
    assert re.search(r'console\.print\(f?"' + re.escape(line), plain), line


def test_the_quickstart_keeps_freed_memory_as_the_benchmark_measured_it():
    """``benchmarks/bench_sandwich_step.py --allocators`` measured ``GLIBC_TUNED``; the script exports the same
    variables, and none with a ':' (Ray starts its workers with such a value cut at the first ':')."""
    import ast

    bench = (REPO / "benchmarks" / "bench_sandwich_step.py").read_text()
    tuned = ast.literal_eval(re.search(r"^GLIBC_TUNED = (\{.+\})$", bench, flags=re.M).group(1))
    assert tuned["MALLOC_MMAP_MAX_"] == "0"
    script = SCRIPT.read_text()
    exported = dict(re.findall(r"(MALLOC_[A-Z_]+_)=(\S+)", "\n".join(
        line for line in script.splitlines() if line.startswith("export "))))
    assert exported == tuned
    assert "GLIBC_TUNABLES" not in "\n".join(line for line in script.splitlines() if line.startswith("export "))
