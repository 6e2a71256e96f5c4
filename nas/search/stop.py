"""Stopping a sweep: Ctrl-C (SIGINT) and SIGTERM end it between two steps of Ray Tune's loop, never inside a
write, and raise :class:`~nas.search.failures.SweepStopped`.

A signal that raised where it landed could land inside an MLflow query: seen in a test, SQLAlchemy's
interrupted session then kept the SQLite store locked, and marking the sweep's runs KILLED failed with
"database is locked". Ray Tune's own SIGINT handler stops at a safe point but returns from ``Tuner.fit`` as if
the stage were done (the sweep went on to its next stage) and advises ``Tuner.restore(...)``; it is turned off
(``TUNE_DISABLE_SIGINT_HANDLER``, by :func:`handle_stop_signals`). So while a Tune experiment runs (:func:`fit`), a
signal is only recorded, and :class:`StopCallback`, which :func:`nas.search.tune.run_config` adds to every
experiment, raises at the next step of the loop. Elsewhere (data preparation, between stages) it raises at
once. A second signal while the first waits raises at once too.

Without this module's handler SIGTERM reached Ray's C++ failure handler (installed by ``ray.init``), which
printed a stack trace and aborted the driver (exit 134), the sweep's runs left RUNNING.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable

from ray import tune

from nas.search.failures import SweepStopped

__all__ = ["StopCallback", "fit", "handle_stop_signals", "raise_if_stopped"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state: dict[str, Any] = {"fitting": 0, "signal": None}  # experiments running now; the signal waiting, if any


def _on_signal(signum: int, frame: object) -> None:
    if _state["fitting"] and _state["signal"] is None:
        _state["signal"] = signum  # StopCallback raises at the loop's next step
        return
    _state["signal"] = None
    raise SweepStopped(signum)


def raise_if_stopped() -> None:
    """Raise :class:`SweepStopped` when a stop signal is waiting (and clear it)."""
    signum, _state["signal"] = _state["signal"], None
    if signum is not None:
        raise SweepStopped(signum)


class StopCallback(tune.Callback):
    """Ray Tune callback: raises the waiting stop signal as :class:`SweepStopped` at the start of a step of
    Tune's loop (``on_step_begin``), where no trial result or MLflow write is half done. Tune's loop lets it
    through (it catches ``Exception``; ``SweepStopped`` is a ``KeyboardInterrupt``) without a final snapshot of
    the experiment: a resume restores the last periodic one, as after a kill."""

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        raise_if_stopped()


def fit(runner: Any) -> Any:
    """``runner.fit()`` (a ``tune.Tuner`` whose run config holds a :class:`StopCallback`) with stop signals
    deferred to the loop's next step; a signal that came as the experiment ended is raised after it.

    Raises:
        SweepStopped: SIGINT or SIGTERM while the handlers of :func:`handle_stop_signals` were installed.
    """
    _state["fitting"] += 1
    try:
        result = runner.fit()
    finally:
        _state["fitting"] -= 1
    raise_if_stopped()
    return result


def handle_stop_signals() -> Callable[[], None]:
    """Make SIGINT and SIGTERM raise :class:`SweepStopped` (deferred inside :func:`fit`) until the returned
    function is called, which puts the previous handlers back. Nothing is changed off the main thread, where
    Python can't set a handler. Call it after ``ray.init``, which sets its own SIGTERM handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")  # read by each Tuner.fit, a Ray started earlier too
    previous: dict[int, Callable | int | None] = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _state["signal"] = None

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        _state["signal"] = None
    return restore
