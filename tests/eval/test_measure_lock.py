"""The node-wide measurement lock: no latency measurement overlaps another one or any scoring work, in real
processes scoring a real (tiny, untrained) supernet on Multi30k; a killed holder releases it; a waiting
measurement goes before later scorers."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from nas.eval.measure_lock import Hold, MeasureLock
from tests.conftest import REPO, tiny_spec_dict

WORKERS = 3


def _spec(multi30k: Path, work: Path):
    from nas.space import parse_spec

    raw = tiny_spec_dict(multi30k, work, search={"beam_size": 2, "valid_sentences": 6, "latency_sentences": 3,
                                                 "latency_repeats": 2, "cpu_per_trial": 1})
    return parse_spec(raw)


def _score_in_a_process(multi30k: str, work: str, locks: str, barrier) -> list[tuple[int, str, float, float]]:
    """One trial process: score the widest and the narrowest sub-Transformer with the real lock in ``locks``,
    starting together with the other processes; returns its holds as (pid, mode, start_s, end_s)."""
    import torch

    from nas.builders import build_space, prepare_sweep_data
    from nas.model.io import load_model
    from nas.search.trials import score_arch

    torch.set_num_threads(1)
    spec = _spec(Path(multi30k), Path(work))
    data = prepare_sweep_data(spec, progress=False)  # cached by the test
    model = load_model(Path(work) / "supernet", "supernet")
    space = build_space(spec)
    lock = MeasureLock(locks)
    barrier.wait(timeout=120)
    for arch in (space.widest(), space.narrowest()):
        metrics = score_arch(model, arch, spec, data, lock=lock)
        assert metrics["latency_ms"] > 0
    return [(h.pid, h.mode, h.start_s, h.end_s) for h in lock.holds]


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_no_latency_measurement_overlaps_another_or_any_scoring(multi30k, tmp_path):
    from nas.builders import build_supernet, prepare_sweep_data
    from nas.model.io import save_model

    spec = _spec(multi30k, tmp_path)
    data = prepare_sweep_data(spec, progress=False)
    save_model(build_supernet(spec, data.vocab_size), tmp_path / "supernet", "supernet")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(WORKERS, mp_context=ctx) as pool:
        barrier = manager.Barrier(WORKERS)
        futures = [pool.submit(_score_in_a_process, str(multi30k), str(tmp_path), str(tmp_path / "locks"), barrier)
                   for _ in range(WORKERS)]
        holds = [Hold(mode, pid, start, end) for f in futures for pid, mode, start, end in f.result(timeout=600)]
    assert len({h.pid for h in holds}) == WORKERS
    exclusive = [h for h in holds if h.mode == "exclusive"]
    shared = [h for h in holds if h.mode == "shared"]
    assert len(exclusive) == len(shared) == 2 * WORKERS  # one measurement and one scoring hold per arch
    # the processes really scored at once (else the test proves nothing) ...
    assert any(a.overlaps(b) for a in shared for b in shared if a.pid != b.pid)
    # ... yet every measurement ran alone: no other measurement and no scoring overlapped it
    clashes = [(e, h) for e in exclusive for h in holds if h is not e and e.overlaps(h)]
    assert not clashes, "\n".join(f"{e} overlaps {h}" for e, h in clashes)


def test_a_killed_holder_releases_the_lock_and_the_files_stay(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from nas.eval.measure_lock import MeasureLock\n"
         "with MeasureLock(sys.argv[1]).exclusive():\n    print('held', flush=True); time.sleep(600)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = MeasureLock(tmp_path)
        acquired = threading.Event()

        def score() -> None:
            with lock.shared():
                acquired.set()

        waiter = threading.Thread(target=score, daemon=True)
        waiter.start()
        assert not acquired.wait(1.0)  # blocked by the holder
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait(timeout=30)
        assert acquired.wait(30.0)
        waiter.join(30)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["measure.gate", "measure.lock"]
    assert lock.holds[0].mode == "shared" and lock.holds[0].end_s is not None


def test_a_waiting_measurement_goes_before_later_scorers(tmp_path):
    """A scorer holds the lock shared; a measurement asks for it, then a second scorer: the second scorer
    waits behind the measurement (a stream of overlapping scorers cannot starve it)."""
    lock = MeasureLock(tmp_path)
    first_in = threading.Event()

    def first() -> None:
        with lock.shared():
            first_in.set()
            time.sleep(1.5)

    def measure() -> None:
        with lock.exclusive():
            time.sleep(0.2)

    def second() -> None:
        with lock.shared():
            pass

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_in.wait(30)
    for target in (measure, second):
        time.sleep(0.4)
        threads.append(threading.Thread(target=target))
        threads[-1].start()
    for t in threads:
        t.join(60)
    scored, measured, later = lock.holds
    assert (scored.mode, measured.mode, later.mode) == ("shared", "exclusive", "shared")
    assert scored.end_s <= measured.start_s and measured.end_s <= later.start_s


def test_hold_overlap_is_strict_and_an_open_hold_extends_to_now():
    a, b = Hold("exclusive", 1, 10.0, 11.0), Hold("shared", 2, 11.0, 12.0)
    assert not a.overlaps(b) and not b.overlaps(a)
    assert a.overlaps(Hold("shared", 2, 10.5, 10.6)) and Hold("shared", 3, 5.0, None).overlaps(b)


@pytest.mark.parametrize("folder", ["env", "argument"])
def test_the_lock_folder_is_nas_lock_dir_or_the_argument(tmp_path, monkeypatch, folder):
    monkeypatch.setenv("NAS_LOCK_DIR", str(tmp_path / "env"))
    lock = MeasureLock(tmp_path / "argument") if folder == "argument" else MeasureLock()
    with lock.exclusive():
        pass
    assert (tmp_path / folder / "measure.lock").is_file()
    assert (tmp_path / folder).stat().st_mode & 0o777 == 0o700
