"""Ray's notices that a `nas` user has nothing to act on are dropped from the sweep's output: Ray Tune's own
``warn_if_slow`` (seen in a fresh-clone quickstart: "The `callbacks.on_step_begin` operation took 0.650 s,
which may be a performance bottleneck.") and the local cluster's token-authentication notice. Each is raised
through the real Ray logger that emits it, with a handler of the test's on that logger."""

from __future__ import annotations

import logging

import pytest


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def tune_util_records(monkeypatch):
    """Ray Tune's ``warn_if_slow`` made to fire at once (its start-up grace period and threshold patched), and
    the records its logger handles."""
    from ray.tune.utils import util

    monkeypatch.setattr(util, "START_OF_TIME", util.time.time() - 3600)
    logger = logging.getLogger(util.__name__)
    handler = _Records()
    saved = list(logger.filters), logger.level, logger.disabled
    logger.filters[:] = []  # a sweep run earlier in this process installed the filter already
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    logger.addHandler(handler)
    yield util, handler
    logger.removeHandler(handler)
    logger.filters[:], logger.level, logger.disabled = saved


def _slow(util) -> None:
    with util.warn_if_slow("callbacks.on_step_begin", threshold=1e-9):
        util.time.sleep(0.001)


def test_tunes_slow_operation_warning_is_dropped(tune_util_records):
    from nas.search.ray_session import quiet_ray_notices

    util, handler = tune_util_records
    _slow(util)  # the real warning, before the filter
    assert len(handler.messages) == 1 and "performance bottleneck" in handler.messages[0], handler.messages
    quiet_ray_notices()
    quiet_ray_notices()  # a second sweep in the process adds no second filter
    _slow(util)
    assert len(handler.messages) == 1, handler.messages
    util.logger.warning("another Tune warning")  # the rest of the logger's records still pass
    assert handler.messages[-1] == "another Tune warning"


def test_the_token_authentication_notice_is_dropped_and_nothing_else():
    from nas.search.ray_session import RAY_NOTICES, quiet_ray_notices

    name = "ray._private.authentication.authentication_token_setup"
    assert name in dict(RAY_NOTICES)
    logger = logging.getLogger(name)
    handler, saved = _Records(), (list(logger.filters), logger.level, logger.disabled)
    logger.filters[:] = []  # a sweep run earlier in this process installed the filter already
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    logger.addHandler(handler)
    try:
        quiet_ray_notices()
        logger.warning("Token authentication is enabled for this Ray cluster. ...")
        logger.warning("Token authentication failed: no token")
        assert handler.messages == ["Token authentication failed: no token"]
    finally:
        logger.removeHandler(handler)
        logger.filters[:], logger.level, logger.disabled = saved
