"""Level 1 scores an arch once: a candidate NSGA-II proposes again takes the score stored with its ``arch_id``
(``nas.search.level1.scores_once``, ``scored_before``); the score is deterministic (``tests/eval/test_validation.py``
scores each arch twice and gets equal figures)."""

from __future__ import annotations

import json
import random

from nas.search.level1 import scored_before, scores_once
from tests.eval.latency.conftest import tiny_space


def test_each_distinct_arch_is_scored_once_and_repeats_get_its_score():
    space, _ = tiny_space()
    rng = random.Random(0)
    distinct = [space.sample(rng) for _ in range(4)]
    archs = [distinct[0], distinct[1], distinct[0], distinct[2], distinct[1], distinct[3]]
    calls = []

    def score(arch):
        calls.append(arch.arch_id)
        return float(len(calls))  # a different value per call: a second call would show

    known = {}
    got = scores_once(archs, score, known)
    assert len(calls) == len({a.arch_id for a in distinct}) == 4
    assert got == [1.0, 2.0, 1.0, 3.0, 2.0, 4.0]
    assert scores_once([distinct[3], distinct[2]], score, known) == [4.0, 3.0] and len(calls) == 4


def test_stored_batches_give_their_scores_and_rows_without_ids_or_torn_files_are_skipped(tmp_path):
    (tmp_path / "00000.json").write_text(json.dumps([{"number": 0, "score": 2.5, "arch_id": "a"},
                                                     {"number": 1, "score": 3.0}]))  # stored before arch_id was
    (tmp_path / "00050.json").write_text(json.dumps([{"number": 50, "score": 1.5, "arch_id": "b"}]))
    (tmp_path / "00100.json").write_text("[{\"number\": 1")
    assert scored_before(tmp_path) == {"a": 2.5, "b": 1.5}
    assert scored_before(tmp_path / "absent") == {}
