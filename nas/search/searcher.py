"""Ray Tune searcher whose state is the Optuna study itself, so a killed driver resumes exactly.

Ray's own ``OptunaSearch`` keeps its ``trial id -> Optuna trial`` map in a pickle that Ray writes every
few seconds; a driver killed in between leaves Optuna trials that Ray never heard of (RUNNING forever)
or Ray trials whose completion Optuna never got. Here the durable storage (a journal file or PostgreSQL)
is the single source of truth:

- every Ray trial carries its Optuna trial number in its config (``optuna_trial``), which Ray persists
  with the trial, so a restored Ray trial finds its Optuna trial again;
- on the first step after a restore, :class:`OptunaSync` hands the restored Ray trials to
  :meth:`DurableOptunaSearch.sync`, which tells Optuna what Ray already knows (completed / errored);
- an Optuna trial asked before the kill whose Ray trial was never persisted (an *orphan*) is given to
  the next new Ray trial instead of asking Optuna again, so Optuna and Ray end with ``search.trials``
  trials each, and nothing is sampled twice; a trial that even finished (COMPLETE or FAIL) between two
  of Ray's checkpoints gets a Ray trial that only replays its stored result (or its error);
- :meth:`DurableOptunaSearch.suggest` returns ``FINISHED`` once the study holds ``search.trials``
  trials (Ray's ``num_samples`` is left unbounded), and limits concurrency itself (no
  ``ConcurrencyLimiter``, whose pickled live-trial set can go stale across a kill);
- a trial is told at most once: a completion repeated after a restore is ignored;
- a storage outage (PostgreSQL restarting) is waited out: every call that Ray makes into the searcher is
  retried whole for up to ``$NAS_BACKEND_RETRY_S`` seconds (:func:`nas.search.retry.retry_storage`), which is
  safe because each one reads the study before it writes (a tell already applied is skipped, a trial asked
  just before the connection dropped is adopted as an orphan).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune import Callback
from ray.tune.search import Searcher

from nas import faults
from nas.builders import build_sampler
from nas.redact import redact_url
from nas.search.retry import retry_storage
from nas.space import SearchSpec, SpecError

__all__ = ["DurableOptunaSearch", "OptunaSync", "StudyRef", "study_trials", "OPTUNA_TRIAL_KEY", "FINISHED_KEY",
           "ERROR_KEY", "POINT_KEY", "CONTROL_KEYS", "ATTR_ERROR", "ATTR_RAY_TRIAL", "ATTR_POINT"]

OPTUNA_TRIAL_KEY = "optuna_trial"
"""Key of the Optuna trial number in a Ray trial's config (stripped before the arch is built)."""
FINISHED_KEY = "optuna_finished"
"""Config key of a Ray trial standing in for an Optuna trial that finished before a kill lost its Ray trial:
the Optuna state (``COMPLETE`` or ``FAIL``); the trial replays the stored result or re-raises the error."""
ERROR_KEY = "optuna_error"
"""Config key: the recorded error of such a ``FAIL`` trial."""
POINT_KEY = "nas_point"
"""Config key of a trial enqueued from ``search.points_to_evaluate``: the point's name (the MLflow tag ``nas.point``)."""
CONTROL_KEYS = (OPTUNA_TRIAL_KEY, FINISHED_KEY, ERROR_KEY, POINT_KEY)
"""Config keys that are not arch parameters."""
ATTR_RAY_TRIAL = "ray_trial_id"
"""Optuna user attribute: the Ray trial id the trial was first asked for."""
ATTR_ERROR = "error"
"""Optuna user attribute of a failed trial: its exception line."""
ATTR_POINT = "point"
"""Optuna user attribute of a trial enqueued from ``search.points_to_evaluate``: the point's name, set when it is
enqueued, so that it survives a kill between the enqueue and the Ray trial."""

_OPEN = (TrialState.RUNNING, TrialState.WAITING)
_retried = retry_storage(lambda searcher: searcher.study_ref.location)
"""Decorator of the searcher's entry points: retry the whole call while the study's database is unreachable."""


_REAL_URLS: dict[str, str] = {}
"""Redacted storage URL -> the URL with its password, for this process (see :meth:`StudyRef.__getstate__`)."""


@dataclass(frozen=True)
class StudyRef:
    """Where a sweep's Optuna study lives: ``storage_url`` (PostgreSQL, Optuna ``RDBStorage``) or, when
    None, the journal file ``journal`` (Optuna ``JournalFileBackend``); ``study_name`` is the sweep id.

    Pickled (Ray keeps the searcher in ``tuner.pkl``) with the URL's password masked; unpickled in the
    driver that built it, it gets the password back, elsewhere it cannot connect.
    """

    study_name: str
    journal: Path
    storage_url: str | None = None

    def __post_init__(self) -> None:
        if self.storage_url is not None:
            _REAL_URLS[redact_url(self.storage_url)] = self.storage_url

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if state.get("storage_url") is not None:
            state["storage_url"] = redact_url(state["storage_url"])
        return state

    def __setstate__(self, state: dict) -> None:
        url = state.get("storage_url")
        for key, value in {**state, "storage_url": _REAL_URLS.get(url, url)}.items():
            object.__setattr__(self, key, value)

    def storage(self) -> optuna.storages.BaseStorage:
        """Open the storage (the journal file's folder is created).

        Raises:
            SpecError: PostgreSQL does not answer or refuses the connection, or its driver is not installed
                (names the redacted URL and the fix).
        """
        if self.storage_url is None:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(self.journal)))
        try:
            return optuna.storages.RDBStorage(self.storage_url, engine_kwargs={"pool_pre_ping": True})
        except ImportError as e:
            raise SpecError(f"tracking.optuna_storage={redact_url(self.storage_url)} needs a PostgreSQL driver "
                            f"({e}); pip install 'psycopg[binary]' (or psycopg2-binary for postgresql+psycopg2://)") from e
        except Exception as e:  # sqlalchemy OperationalError / ArgumentError, psycopg errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpecError(f"tracking.optuna_storage: cannot open the Optuna study storage at "
                            f"{redact_url(self.storage_url)}: {first}; check that PostgreSQL is running and the "
                            "database exists (CREATE DATABASE ...)") from e

    @property
    def location(self) -> str:
        """The storage for messages: the journal path or the redacted URL."""
        return str(self.journal) if self.storage_url is None else redact_url(self.storage_url)

    def load(self, directions: Sequence[str] | None = None,
             sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
        """Create the study or load it if it exists (``directions`` are used only to create it).

        Raises:
            SpecError: see :meth:`storage`.
            KeyError: ``directions`` is None and there is no such study.
        """
        storage = self.storage()
        if directions is None:
            return optuna.load_study(study_name=self.study_name, storage=storage, sampler=sampler)
        return optuna.create_study(study_name=self.study_name, storage=storage, sampler=sampler,
                                   directions=list(directions), load_if_exists=True)


@retry_storage(lambda ref: ref.location)
def study_trials(ref: StudyRef) -> list[optuna.trial.FrozenTrial]:
    """Every trial of the study ``ref`` names, by number, read again through a database outage
    (:func:`~nas.search.retry.retry_storage`). Raises KeyError when there is no such study."""
    return ref.load().get_trials(deepcopy=False)


def _point_config(user_attrs: dict[str, Any]) -> dict[str, str]:
    """The :data:`POINT_KEY` config entry of a trial enqueued from a named point (empty for a sampled one)."""
    name = user_attrs.get(ATTR_POINT)
    return {POINT_KEY: str(name)} if name else {}


class DurableOptunaSearch(Searcher):
    """A Ray Tune searcher over a define-by-run Optuna space whose only state is the Optuna study.

    Args:
        space: callable that suggests the arch's parameters on an ``optuna.Trial`` (define-by-run).
        study: where the study is (created on first use, loaded when it exists).
        search: the YAML's ``search`` section: ``trials`` (total, over every driver that resumes the sweep),
            ``max_concurrent``, ``metrics`` (Optuna objectives, in order), ``constraints`` (told with
            ``Trial.set_constraint`` before the values, so the samplers and ``study.best_trials`` see them),
            ``method`` and ``seed``.
        points: Optuna parameters of the first trials (``search.points_to_evaluate`` resolved by
            :meth:`nas.space.space.SearchSpace.point_params`): trial ``i < len(points)`` is enqueued with
            ``points[i]`` (``study.enqueue_trial``; parameters left out are sampled).
        point_names: the name of each point (:meth:`nas.space.SearchSpec.point_names`; None: unnamed), kept as the
            enqueued trial's user attribute :data:`ATTR_POINT` and given to its Ray trial as config key
            :data:`POINT_KEY` (the callback tags the MLflow run ``nas.point``).

    Use it with ``num_samples=-1`` and an :class:`OptunaSync` callback holding the same object.
    """

    def __init__(self, space: Callable[[optuna.Trial], Any], study: StudyRef, search: SearchSpec,
                 points: Sequence[dict[str, Any]] = (), point_names: Sequence[str | None] = ()) -> None:
        names = [m.name for m in search.metrics]
        modes = ["max" if m.goal == "maximize" else "min" for m in search.metrics]
        super().__init__(metric=names[0] if len(names) == 1 else None, mode=modes[0] if len(modes) == 1 else None)
        self.space, self.study_ref, self.search = space, study, search
        self.objectives = names
        self.directions = ["maximize" if m == "max" else "minimize" for m in modes]
        self.constraints = search.parsed_constraints()
        self.points = [dict(p) for p in points]
        self.point_names = list(point_names) + [None] * (len(self.points) - len(point_names))
        self._reset()

    def _reset(self) -> None:
        self._study: optuna.Study | None = None
        self._known: dict[str, int] = {}  # Ray trial id -> Optuna trial number (restored and new trials)
        self._live: set[str] = set()  # Ray trials suggested or restored and not yet complete
        self._errors: dict[str, int] = {}  # errored Ray trials waiting for their message (OptunaSync)
        self.synced = False

    def __getstate__(self) -> dict:  # Ray pickles the searcher into tuner.pkl: keep only the settings
        state = self.__dict__.copy()
        for key in ("_study", "_known", "_live", "_errors", "synced"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("points", [])  # a tuner.pkl written before points and constraints existed
        state.setdefault("point_names", [None] * len(state["points"]))
        state.setdefault("constraints", [])
        self.__dict__.update(state)
        self._reset()

    # Ray's searcher checkpoint would be a second, possibly stale, copy of the study: none is written.
    def save_to_dir(self, checkpoint_dir: str, session_str: str = "default") -> None:
        pass

    def restore_from_dir(self, checkpoint_dir: str) -> None:
        pass

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec) -> bool:
        return True  # metrics and space come from the YAML

    @property
    def study(self) -> optuna.Study:
        if self._study is None:
            study = self.study_ref.load(self.directions)
            study.sampler = build_sampler(self.search, seed_offset=len(study.get_trials(deepcopy=False)))
            self._study = study
        return self._study

    def _trials(self) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False)  # ordered by number

    # ------------------------------------------------------------------ restore

    @_retried
    def sync(self, ray_trials: Sequence[Any]) -> None:
        """Adopt the Ray trials of a restored experiment (call once, before the first ``suggest``).

        A restored trial that Ray saw complete (or error) but Optuna did not hear of is told now, from
        its last result (or error file); an unfinished one counts as live.
        """
        by_number = {t.number: t for t in self._trials()}
        for trial in ray_trials:
            number = trial.config.get(OPTUNA_TRIAL_KEY)
            if number is None or number not in by_number:
                continue
            self._known[trial.trial_id] = number
            frozen = by_number[number]
            if trial.status == "TERMINATED":
                if frozen.state in _OPEN:
                    self._tell(number, trial.last_result or {})
            elif trial.status == "ERROR":
                if frozen.state in _OPEN:
                    self._fail(number, error_line(getattr(trial, "error_file", None)))
            else:
                self._live.add(trial.trial_id)
        self.synced = True

    # ------------------------------------------------------------------ Searcher API

    @_retried
    def suggest(self, trial_id: str) -> dict | str | None:
        if not self.synced:
            raise RuntimeError("DurableOptunaSearch.suggest before sync(): add OptunaSync(searcher) to the "
                               "RunConfig callbacks (it hands over the restored Ray trials)")
        if len(self._live) >= self.search.max_concurrent:
            return None
        trials = self._trials()
        assigned = set(self._known.values())
        unknown = [t for t in trials if t.number not in assigned]  # Ray lost them with the kill
        orphans = [t for t in unknown if t.state in _OPEN]
        if unknown and not orphans:  # finished between two Ray checkpoints: a Ray trial that replays it
            frozen = unknown[0]
            self._known[trial_id] = frozen.number
            self._live.add(trial_id)
            extra = {ERROR_KEY: str(frozen.user_attrs.get(ATTR_ERROR, ""))} if frozen.state == TrialState.FAIL else {}
            return {**frozen.params, OPTUNA_TRIAL_KEY: frozen.number, FINISHED_KEY: frozen.state.name, **extra,
                    **_point_config(frozen.user_attrs)}
        if orphans and orphans[0].state == TrialState.WAITING:  # enqueued just before a kill: ask pops it
            trial = self.study.ask()
        elif orphans:  # asked before a kill, never persisted by Ray: this new Ray trial takes it over
            trial = optuna.trial.Trial(self.study, orphans[0]._trial_id)
        elif len(trials) >= self.search.trials:
            return Searcher.FINISHED
        else:
            if len(trials) < len(self.points):  # a starting point: enqueued, then popped by ask
                name = self.point_names[len(trials)]
                self.study.enqueue_trial(self.points[len(trials)], user_attrs={ATTR_POINT: name} if name else None)
            trial = self.study.ask()
        trial.set_user_attr(ATTR_RAY_TRIAL, trial_id)
        self.space(trial)  # on an orphan: returns the params it has, samples those a kill cut short
        number, params = trial.number, dict(trial.params)
        self._known[trial_id] = number
        self._live.add(trial_id)
        return {**params, OPTUNA_TRIAL_KEY: number, **_point_config(trial.user_attrs)}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self._live.discard(trial_id)
        number = self._known.get(trial_id)
        if number is None:
            return
        if error:
            self._errors[trial_id] = number  # told by OptunaSync.on_trial_error, which has the message
        else:
            self._tell(number, result or {})

    # ------------------------------------------------------------------ telling Optuna

    def fail(self, trial_id: str, message: str) -> None:
        """Tell Optuna that the Ray trial ``trial_id`` failed, with its error line (at most once)."""
        number = self._errors.pop(trial_id, self._known.get(trial_id))
        if number is not None:
            self._fail(number, message)

    def flush(self) -> None:
        """Fail the errored trials whose message never came."""
        for trial_id in list(self._errors):
            self.fail(trial_id, "failed; see the Ray trial logs")

    @_retried
    def _tell(self, number: int, result: dict) -> None:
        frozen = self._trials()[number]
        if frozen.state not in _OPEN:
            return  # told before the driver was killed
        values = [result.get(name) for name in self.objectives]
        bad = [f"{n}={v}" for n, v in zip(self.objectives, values)
               if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)]
        if bad:
            self._fail(number, f"objective missing or not finite: {', '.join(bad)}")
            return
        if self.constraints:
            trial = optuna.trial.Trial(self.study, frozen._trial_id)
            for c in self.constraints:
                if c.key in frozen.constraints:  # set before a kill cut the tell short
                    continue
                value = result.get(c.metric)
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                trial.set_constraint(c.key, c.violation(float(value)) if ok else math.inf)  # missing: infeasible
        self.study.tell(number, [float(v) for v in values])
        faults.kill_point("after_tell")  # tests only: a kill after Optuna's tell, before the MLflow run ends

    @_retried
    def _fail(self, number: int, message: str) -> None:
        frozen = self._trials()[number]
        if frozen.state not in _OPEN:
            return
        # FrozenTrial has no public setter; the storage call is what optuna.Trial.set_user_attr does.
        self.study._storage.set_trial_user_attr(frozen._trial_id, ATTR_ERROR, message[:2000])
        self.study.tell(number, state=TrialState.FAIL)

    @_retried
    def fail_open_trials(self, message: str) -> list[int]:
        """Fail every Optuna trial still RUNNING or WAITING (after ``fit``: their Ray trial was lost)."""
        numbers = [t.number for t in self._trials() if t.state in _OPEN]
        for number in numbers:
            self._fail(number, message)
        return numbers


class OptunaSync(Callback):
    """Driver-side callback that keeps :class:`DurableOptunaSearch` in step with Ray's trial list.

    Ray pickles the callbacks and the searcher together into ``tuner.pkl``, so after ``Tuner.restore``
    this callback still holds the searcher that Ray uses.
    """

    def __init__(self, searcher: DurableOptunaSearch) -> None:
        self.searcher = searcher

    def on_step_begin(self, iteration: int, trials: list, **info) -> None:
        if not self.searcher.synced:  # the first step: Ray has restored its trials, asked for none yet
            self.searcher.sync(trials)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self.searcher.fail(trial.trial_id, error_line(getattr(trial, "error_file", None)))

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        self.searcher.flush()


def error_line(error_file: str | None) -> str:
    """The exception line of a Ray trial's error file (its full traceback stays in the file)."""
    try:
        lines = [line for line in Path(error_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, TypeError):
        return "failed; see the Ray trial logs"
    return f"{lines[-1].strip() if lines else 'failed'} ({error_file})"
