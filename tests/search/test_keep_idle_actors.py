"""nas.search.tune.keep_idle_actors: Ray Tune's actor cache keeps up to ``keep`` idle actors while no trial is staged
(Ray Tune keeps one), gives them to the next staged trials, and flushes them all when the search is over; the real
loop's check is in ``tests/search/test_interrupt.py`` (level 1's generations reuse their workers)."""

from __future__ import annotations

import pytest
from ray.tune.execution import tune_controller
from ray.tune.utils.object_cache import _ObjectCache

from nas.search.tune import keep_idle_actors

KEY = "1 CPU"


def _cache() -> _ObjectCache:
    return tune_controller._ObjectCache(may_keep_one=True)  # as TuneController.__init__ builds it


def test_rays_own_cache_keeps_one_idle_actor():
    """What the context manager changes: without it, the second idle actor is not cached (Ray stops it)."""
    cache = _cache()
    assert cache.cache_object(KEY, "a") and not cache.cache_object(KEY, "b")
    assert list(cache.flush_cached_objects()) == []  # the one kept


def test_inside_the_cache_keeps_up_to_keep_idle_actors_and_flushes_them_at_the_end():
    with keep_idle_actors(2):
        cache = _cache()
    assert type(_cache()) is _ObjectCache  # restored after the block
    assert cache.cache_object(KEY, "a") and cache.cache_object(KEY, "b")
    assert not cache.cache_object(KEY, "c")  # over keep
    assert list(cache.flush_cached_objects()) == [] and cache.num_cached_objects == 2  # none staged: both kept
    cache.increase_max(KEY)  # one trial staged: it takes one, and the other is no longer needed
    assert cache.pop_cached_object(KEY) == "a"
    cache.decrease_max(KEY)
    assert cache.num_cached_objects == 1 and cache.has_cached_object(KEY)
    assert list(cache.flush_cached_objects(force_all=True)) == ["b"]  # the searcher finished: all stopped
    assert cache.num_cached_objects == 0


def test_a_staged_trial_still_gets_rays_rule():
    """With trials staged, the cache holds as many as they need (Ray's rule) and flushes the rest."""
    with keep_idle_actors(3):
        cache = _cache()
    cache.increase_max(KEY, 1)
    assert cache.cache_object(KEY, "a")
    assert not cache.cache_object(KEY, "b")  # Ray's rule: one staged trial, one actor; b is stopped
    cache.decrease_max(KEY, 1)
    cache.cache_object(KEY, "b")
    assert cache.num_cached_objects == 2
    cache.increase_max(KEY, 1)  # a trial staged again: one actor needed, the other flushed
    assert list(cache.flush_cached_objects()) == ["a"] and cache.num_cached_objects == 1


def test_keep_below_one_is_refused():
    with pytest.raises(ValueError, match="keep=0"):
        with keep_idle_actors(0):
            pass
