"""``experiments/quickstart_schedule/level1_generations.py``'s 2-D hypervolume, against a count of grid cells."""

from __future__ import annotations

import random

from tests.conftest import load_script


def test_hypervolume_equals_the_dominated_area_counted_on_a_grid():
    hypervolume = load_script("experiments/quickstart_schedule/level1_generations.py").hypervolume
    rng = random.Random(0)
    for _ in range(20):
        points = [(rng.randrange(10), rng.randrange(10)) for _ in range(rng.randrange(1, 7))]
        ref = (8, 9)
        cells = sum(1 for x in range(10) for y in range(10) if x < ref[0] and y < ref[1]
                    and any(px <= x and py <= y for px, py in points))  # cell [x, x+1) x [y, y+1) dominated
        assert hypervolume(points, ref) == cells, points
    assert hypervolume([(9, 1)], (8, 9)) == 0  # outside the reference point
