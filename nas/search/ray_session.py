"""Starting or joining Ray for a sweep: quiet output (no Ray Tune banners, colour codes in a log or notices with
nothing to act on), the cluster's resources checked against the YAML."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import ray

from nas.data import EncodersFactory
from nas.search.ray_encode import RayEncoders
from nas.space import SpecError, SweepSpec

__all__ = ["RAY_NOTICES", "cluster_encoders", "connect", "init_ray", "quiet_ray_notices", "quiet_worker_exit"]


class _DropNotice(logging.Filter):
    """A logging filter that drops the records whose message contains ``text`` (a notice of Ray's that a `nas`
    user has nothing to act on)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


RAY_NOTICES = (
    # a new local Ray turns token authentication on and says so in a WARNING each start: the security stays, the
    # line goes (RAY_AUTH_MODE set now would come too late: Ray read its config when imported)
    ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this Ray cluster"),
    # Tune's warn_if_slow: "The `callbacks.on_step_begin` operation took 0.650 s, which may be a performance
    # bottleneck." (the MLflow callback's writes on a busy 2-core machine; its threshold was read at import)
    ("ray.tune.utils.util", "which may be a performance bottleneck"),
)
"""(logger, text): the Ray log records :func:`quiet_ray_notices` drops."""


def quiet_ray_notices() -> None:
    """Drop :data:`RAY_NOTICES` from Ray's loggers in this process (once: a filter already there is kept)."""
    for name, text in RAY_NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.text == text for f in logger.filters):
            logger.addFilter(_DropNotice(text))


def _drop_exit_unraisable(hook):
    """``sys.unraisablehook`` that drops a ``SystemExit`` and passes anything else to ``hook``."""
    def unraisable(info) -> None:
        if info.exc_type is not None and issubclass(info.exc_type, SystemExit):
            return
        hook(info)
    unraisable.nas_quiet_exit = True
    return unraisable


def quiet_worker_exit() -> None:
    """In a Ray worker (call it at a trainable's start; once is enough, again is harmless): a ``SystemExit`` that
    Python cannot raise is dropped silently instead of printed with its traceback.

    When a sweep's trials end, Ray stops their actors with SIGTERM, and Ray's handler raises ``SystemExit`` wherever
    the worker is. Inside a garbage-collection callback (a ``WeakSet``'s ``_remove``), Python cannot raise it and
    prints "Exception ignored in: ... Traceback ... SystemExit: 1" instead; Ray forwards that to the sweep's output
    after its leaderboard, though nothing failed (seen in ``tests/test_e2e.py``'s sweep on 2026-12-01). The exit
    was ignored either way (the worker goes on until Ray ends it); only the print goes. Any other exception Python
    cannot raise is still printed by the hook that was there.
    """
    if not getattr(sys.unraisablehook, "nas_quiet_exit", False):
        sys.unraisablehook = _drop_exit_unraisable(sys.unraisablehook)


def connect(address: str | None) -> bool:
    """Start (or join) Ray unless it runs in this process already; returns whether this call connected."""
    if ray.is_initialized():
        return False
    # Ray Tune's new output engine prints a configuration table, "Number of trials 9223372036854775807" for a
    # searcher-driven run and a TensorBoard hint for every Tuner.fit, whatever the verbosity: the legacy engine
    # at verbose=0 (tune.run_config) prints nothing, and the sweep prints its own lines
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if not sys.stderr.isatty():  # the workers' lines reach a log: no colour codes around their "(pid=...)" prefix
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    quiet_ray_notices()
    kwargs = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=True)
    if address:
        ray.init(address=address, **kwargs)
    else:
        # a new local Ray, never a stray running one; every worker it starts drops the "SystemExit" Ray's SIGTERM
        # handler raises where Python cannot (quiet_worker_exit), Ray's own actors too (Ray Train's controller and
        # workers, before a trainable runs): one printed it after the leaderboard of tests/test_e2e.py's sweep
        ray.init(address="local", num_cpus=os.cpu_count(),
                 runtime_env={"worker_process_setup_hook": "nas.search.ray_session.quiet_worker_exit"}, **kwargs)
    return True


def cluster_encoders(address: str, connected: list[bool]) -> EncodersFactory:
    """``--address``: the data's shards are encoded on the cluster (:class:`~nas.search.ray_encode.RayEncoders`),
    connecting to it only when there is something to encode (``connected`` records whether that connected)."""
    def make(model: Path, work: Path, max_len: int) -> RayEncoders:
        connected.append(connect(address))
        return RayEncoders(model, work, max_len)
    return make


def init_ray(spec: SweepSpec, address: str | None, connected: bool = False) -> bool:
    """Start (or join) Ray; returns whether we started it (``connected``: the data preparation did). Raises
    SpecError when resources can't fit."""
    if not connect(address) and not connected:
        return False
    cpus = ray.cluster_resources().get("CPU", 0)
    res = spec.resources
    for key, need in (("resources.cpu", res.cpu), ("search.cpu_per_trial", spec.search.cpu_per_trial),
                      ("resources.workers x resources.cpu", res.workers * res.cpu)):
        if need > cpus:
            ray.shutdown()
            raise SpecError(f"{key}={need:g} but the Ray cluster has {cpus:g} CPUs; lower {key}")
    gpus = ray.cluster_resources().get("GPU", 0)
    if spec.search.gpu_per_trial > gpus:
        ray.shutdown()
        raise SpecError(f"search.gpu_per_trial={spec.search.gpu_per_trial:g} but the Ray cluster has {gpus:g} GPUs; "
                        f"set search.gpu_per_trial: 0 or join a cluster with GPUs (--address)")
    if res.gpu * res.workers > gpus:
        ray.shutdown()
        raise SpecError(f"resources.workers x resources.gpu={res.gpu * res.workers:g} but the Ray cluster has "
                        f"{gpus:g} GPUs; lower resources.gpu or resources.workers")
    return True
