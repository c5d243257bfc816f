"""Collaboration never hurts a user's model (issue 24): with the defaults, two islands of N steps each
train a model no worse than one island alone of N steps, on both examples of the repository
(``bench.collab``: the in-process reference, seeds fixed, deterministic)."""

from __future__ import annotations

import pytest

from bench.collab import compare


@pytest.mark.parametrize("name,steps", [("regression", 300), ("digits", 300)])
def test_two_islands_are_no_worse_than_one_alone(name, steps):
    r = compare(name, steps)
    assert r["two_rejected"] == {}
    assert r["two"] <= r["alone"], r
    # and the comparison can tell: a model that learnt nothing more is worse than either
    assert r["alone"] < 0.9 * r["plain_n"] or r["two"] < r["plain_n"], r
