"""Ray Tune plumbing shared by the sweep's stages: experiment folders, restore after a kill, run configs.

Used by :mod:`nas.search.runner` (the supernet and search stages) and :mod:`nas.search.finetune`
(the ASHA fine-tune stage); it knows nothing of either.
"""

from __future__ import annotations

import functools
import json
import pickle
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ray import tune
from nas.console import make_console

from nas.search.stop import StopCallback
from nas.space import SweepSpec

__all__ = ["is_uri", "ray_dir", "restorable", "make_tuner", "run_config", "keep_idle_actors", "save_stopped_trials"]

console = make_console()


def is_uri(path: str | Path) -> bool:
    """Whether ``path`` is a URI (``s3://bucket/prefix?endpoint_override=...``) rather than a local folder."""
    return "://" in str(path)


def ray_dir(spec: SweepSpec, sweep_id: str, stage: str) -> Path | str:
    """The Ray Tune experiment folder of a sweep's ``train`` or ``search`` stage (named by the sweep id, so
    a sweep started afresh in the same folder never restores another one's experiment), under
    ``resources.storage_path`` (default ``<workdir>/<name>/ray``): a local folder, or a URI string
    when the storage is remote, its query kept last as pyarrow reads it
    (``s3://bucket/prefix/<sweep id>-<stage>?endpoint_override=host:8333&scheme=http``)."""
    from urllib.parse import urlsplit, urlunsplit

    name = f"{sweep_id}-{stage}"
    storage = spec.resources.storage_path
    if storage is None:
        return spec.run_dir.resolve() / "ray" / name
    if is_uri(storage):
        uri = urlsplit(storage)
        return urlunsplit(uri._replace(path=f"{uri.path.rstrip('/')}/{name}"))
    return Path(storage).expanduser().resolve() / name


def restorable(exp_dir: Path | str) -> bool:
    """Whether ``exp_dir`` (a local folder or a URI, see :func:`ray_dir`) holds a Ray Tune experiment to restore.

    An experiment-state file cut short by the kill is moved aside (``*.corrupt``) so that Ray restores
    from the previous one, and so is a searcher state newer than every readable trial list (``*.ahead``: a
    kill between Ray's uploads of the two); without any readable searcher state the experiment is moved aside
    (``<name>.unrestorable-<time>``) and starts afresh. Files are read, renamed and copied through pyarrow's
    filesystem for the folder, so the same rules hold on S3 (which has no renames: copy, then delete).
    """
    import fnmatch

    import pyarrow.fs
    from ray import cloudpickle

    if not tune.Tuner.can_restore(str(exp_dir)):
        return False
    uri = is_uri(exp_dir)
    fs, root = pyarrow.fs.FileSystem.from_uri(str(exp_dir) if uri else str(Path(exp_dir).resolve()))
    shown = (lambda path: f"{str(exp_dir).split('://')[0]}://{path}") if uri else (lambda path: path)

    def read(name: str) -> bytes:
        with fs.open_input_stream(f"{root}/{name}") as f:
            return f.read()

    def set_aside(name: str, suffix: str) -> None:
        fs.move(f"{root}/{name}", f"{root}/{name}{suffix}")

    try:
        pickle.loads(read("tuner.pkl"))
    except Exception as e:  # cut short while Tuner() wrote it: nothing ran yet
        console.print(f"[yellow]{shown(root + '/tuner.pkl')} is unreadable ({type(e).__name__}); starting the "
                      "Ray Tune experiment afresh[/yellow]")
        return False
    names = sorted(info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(root))
                   if info.type == pyarrow.fs.FileType.File)
    readers = {"experiment_state-*.json": lambda blob: json.loads(blob.decode("utf-8")),
               "search_gen_state-*.json": cloudpickle.loads,
               "basic-variant-state-*.json": cloudpickle.loads}  # the trials, then the searcher (ours or Ray's default)
    valid: dict[str, list[str]] = {}
    for pattern, reader in readers.items():
        valid[pattern] = []
        for name in fnmatch.filter(names, pattern):
            try:
                reader(read(name))
                valid[pattern].append(name)
            except Exception:  # cut short while Ray copied it to the experiment folder
                set_aside(name, ".corrupt")
                console.print(f"[yellow]moved aside a Ray state file cut short by the kill: "
                              f"{shown(root + '/' + name)}[/yellow]")

    def session(name: str) -> str:
        return name.split("-", 1)[1] if name.startswith("experiment_state") else name.rsplit("state-", 1)[1]

    if valid["experiment_state-*.json"]:  # a searcher state newer than the trials it goes with would skip trials
        newest = max(session(n) for n in valid["experiment_state-*.json"])
        for pattern in ("search_gen_state-*.json", "basic-variant-state-*.json"):
            for name in [n for n in valid[pattern] if session(n) > newest]:
                set_aside(name, ".ahead")
                valid[pattern].remove(name)
    searcher_state = valid["search_gen_state-*.json"] or valid["basic-variant-state-*.json"]
    if valid["experiment_state-*.json"] and not searcher_state:  # killed between Ray's two writes
        aside = f"{root.rstrip('/')}.unrestorable-{time.strftime('%Y%m%d-%H%M%S')}"
        if uri:
            pyarrow.fs.copy_files(root, aside, source_filesystem=fs, destination_filesystem=fs)
            fs.delete_dir(root)
        else:
            fs.move(root, aside)
        console.print(f"[yellow]{shown(aside)}: no readable search state; starting the Ray Tune experiment afresh "
                      "(the Optuna study keeps every trial)[/yellow]")
        return False
    return bool(valid["experiment_state-*.json"])


def save_stopped_trials() -> None:
    """Make Ray Tune write a trial's new status to its experiment state whenever it stops the trial.

    Ray Tune 2.x writes a trial's JSON state to ``experiment_state-*.json`` only for trials marked since the last
    write (``TuneController._mark_trial_to_checkpoint``). ``TuneController._schedule_trial_stop`` sets the trial
    ERROR (or TERMINATED) but returns before marking it when the trial has no live actor any more, which is always
    the case for a trial whose worker died: the actor manager handles a ``RayActorError`` by cleaning up the actor
    first, then calls the train task's error callback. If the experiment state was written after the trial started
    (every few seconds), the trial stays RUNNING on disk, and ``ExperimentAnalysis``, ``Tuner.restore`` and
    ``nas sweep --resume`` read it back as PENDING: the resumed sweep would run a failed trial again. The wrapper
    marks the trial after every stop (marking only adds it to the set written next). Idempotent; with a Ray
    without that private method it does nothing.
    """
    from ray.tune.execution.tune_controller import TuneController

    stop = getattr(TuneController, "_schedule_trial_stop", None)
    if stop is None or not hasattr(TuneController, "_mark_trial_to_checkpoint"):
        return  # a Ray Tune without them: nothing to mend
    if getattr(stop, "_nas_saves_status", False):
        return  # wrapped already

    @functools.wraps(stop)
    def schedule_trial_stop(self, trial, exception=None):
        stop(self, trial, exception=exception)
        self._mark_trial_to_checkpoint(trial)

    schedule_trial_stop._nas_saves_status = True
    TuneController._schedule_trial_stop = schedule_trial_stop


def make_tuner(trainable, exp_dir: Path | str, *, restart_errored: bool, **new_run) -> tuple[tune.Tuner, bool]:
    """``Tuner.restore`` of ``exp_dir`` when it holds an experiment, else a new ``Tuner`` (``new_run``); either
    way a stopped trial's status reaches the experiment state (:func:`save_stopped_trials`)."""
    save_stopped_trials()
    if restorable(exp_dir):
        return tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True,
                                  resume_errored=False, restart_errored=restart_errored), True
    return tune.Tuner(trainable, **new_run), False


def run_config(exp_dir: Path | str, callbacks: list, max_failures: int) -> tune.RunConfig:
    """Ray Tune's run config for the experiment folder ``exp_dir`` (a local path or a URI, see :func:`ray_dir`)."""
    from urllib.parse import urlsplit, urlunsplit

    if is_uri(exp_dir):  # s3://bucket/prefix/name?query -> (s3://bucket/prefix?query, name)
        uri = urlsplit(str(exp_dir))
        parent, _, name = uri.path.rstrip("/").rpartition("/")
        storage = urlunsplit(uri._replace(path=parent))
    else:
        storage, name = str(Path(exp_dir).parent), Path(exp_dir).name
    return tune.RunConfig(name=name, storage_path=storage, callbacks=[*callbacks, StopCallback()],
                          failure_config=tune.FailureConfig(max_failures=max_failures), verbose=0)


def _idle_actor_cache(keep: int):
    """A subclass of Ray Tune's actor cache (``ray.tune.utils.object_cache._ObjectCache``) that keeps up to ``keep``
    idle actors, instead of one, while no trial is staged (see :func:`keep_idle_actors`)."""
    from ray.tune.utils.object_cache import _ObjectCache

    class IdleActorCache(_ObjectCache):
        def _none_expected(self) -> bool:
            return not any(v for v in self._max_num_objects.values())

        def cache_object(self, key, obj) -> bool:
            if (len(self._cached_objects[key]) >= self._max_num_objects[key] and self._none_expected()
                    and 0 < self._num_cached_objects < keep):
                self._cached_objects[key].append(obj)  # Ray's rule would stop it: one idle actor at most
                self._num_cached_objects += 1
                return True
            return super().cache_object(key, obj)

        def flush_cached_objects(self, force_all: bool = False):
            if not force_all and self._none_expected() and self._num_cached_objects <= keep:
                return  # nothing staged yet: the next generation's trials take them
            yield from super().flush_cached_objects(force_all=force_all)

    return IdleActorCache


@contextmanager
def keep_idle_actors(keep: int) -> Iterator[None]:
    """Inside: a Ray Tune loop started in this process (``reuse_actors=True``) keeps up to ``keep`` finished trials'
    actors for the next trials while none is staged, where Ray Tune 2.x keeps one.

    Level 1 asks NSGA-II for a generation only once the previous one is complete, so at each generation's end all
    its ``max_concurrent`` workers wait with no trial to stage. Ray Tune's actor cache
    (``_ObjectCache(may_keep_one=True)`` in ``ray.tune.execution.tune_controller``) then keeps one idle actor and
    stops the others, and the next generation starts new worker processes, each importing torch and loading the
    supernet again: 9 of the quickstart's 10 generations started one (7.5 s each on a 2-core AVX2 VM, while the
    other worker waited). Kept actors hold their trial's resources, which only the same Tuner's next trials (the
    same resources) ask for; Ray Tune flushes them all once the searcher is finished. Ray Tune's private class is
    replaced for the ``with`` block only (the loop reads the name once, when ``Tuner.fit`` builds its controller).

    Raises:
        ValueError: ``keep`` below 1.
    """
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    from ray.tune.execution import tune_controller

    before = tune_controller._ObjectCache
    tune_controller._ObjectCache = _idle_actor_cache(keep)
    try:
        yield
    finally:
        tune_controller._ObjectCache = before
