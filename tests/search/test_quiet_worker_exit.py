"""A Ray worker stopped by SIGTERM inside a garbage-collection callback prints no "SystemExit" traceback into the
sweep's output (:func:`nas.search.ray_session.quiet_worker_exit`; seen in ``tests/test_e2e.py``'s sweep), while any
other exception Python cannot raise is still printed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

SCRIPT = textwrap.dedent("""
    import gc, os, signal, sys, weakref

    {setup}

    def ray_like_sigterm(signum, frame):  # Ray's worker handler: raise SystemExit wherever the worker is
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, ray_like_sigterm)

    class Held:
        pass

    def on_collect(_ref):  # a weakref callback (WeakSet._remove in the real case) that the signal lands in
        os.kill(os.getpid(), signal.SIGTERM)

    obj = Held()
    ref = weakref.ref(obj, on_collect)
    del obj
    gc.collect()

    class Broken:
        def __del__(self):
            raise ValueError("still printed")

    Broken()
    print("went on", flush=True)
""")


def _run(setup: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_without_the_hook_python_prints_the_ignored_system_exit_with_its_traceback():
    """The reference: the script reproduces the sweep's output (the test below can fail)."""
    done = _run("")
    assert done.returncode == 0 and "went on" in done.stdout, done.stderr
    assert "Exception ignored in" in done.stderr and "SystemExit: 1" in done.stderr and "Traceback" in done.stderr


def test_the_hook_drops_the_system_exit_and_keeps_other_unraisable_errors():
    done = _run("from nas.search.ray_session import quiet_worker_exit\nquiet_worker_exit()\nquiet_worker_exit()")
    assert done.returncode == 0 and "went on" in done.stdout, done.stderr
    assert "SystemExit" not in done.stderr, done.stderr
    assert "ValueError: still printed" in done.stderr, done.stderr  # other unraisable errors still reach stderr


def test_calling_it_again_keeps_one_wrapper(monkeypatch):
    from nas.search.ray_session import quiet_worker_exit

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    quiet_worker_exit()
    first = sys.unraisablehook
    quiet_worker_exit()
    assert sys.unraisablehook is first and first is not sys.__unraisablehook__


@pytest.mark.slow  # a local Ray start, 5-10 s
def test_every_worker_of_a_local_ray_started_by_nas_has_the_hook():
    """Not only the trainables that call it: a worker ``nas`` did not write (a plain Ray task here; Ray Train's
    controller in a sweep) gets the hook from the cluster's ``worker_process_setup_hook``. Fails without it."""
    code = ("import sys, ray\nfrom nas.search.ray_session import connect\nconnect(None)\n"
            "probe = ray.remote(lambda: bool(getattr(sys.unraisablehook, 'nas_quiet_exit', False)))\n"
            "print('hooked', ray.get(probe.remote()))\nray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hooked True" in done.stdout, done.stdout + done.stderr[-3000:]
