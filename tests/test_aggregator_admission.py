"""AdmissionHold (pure): contributions of learners the monitor has not admitted yet."""

import pytest

from aggregator.admission import AdmissionHold


def test_unknown_learner_is_held_and_released_in_arrival_order_once_active():
    h = AdmissionHold(wait=10, max_bytes=1000)
    assert h.offer("a1", "new", None, 100, now=0.0)
    assert h.offer("b1", "other", "joining", 100, now=0.5)
    assert h.offer("a2", "new", None, 100, now=1.0)
    states = {"new": None, "other": "joining"}
    assert h.sweep(states.get, now=2.0) == [] and len(h) == 3
    states["new"] = "active"
    out = h.sweep(states.get, now=2.0)
    assert [x.item for x in out] == ["a1", "a2"] and [x.since for x in out] == [0.0, 1.0]
    assert [x.item for x in h.items] == ["b1"] and h.nbytes == 100


@pytest.mark.parametrize("state", [None, "joining", "rejoining", "suspect"])
def test_every_state_that_can_still_become_active_is_held(state):
    assert AdmissionHold(5, 10).offer("x", "l", state, 1, now=0.0)


@pytest.mark.parametrize("state", ["evicted", "active", "left", "weird"])
def test_evicted_or_other_states_are_never_held(state):
    assert not AdmissionHold(5, 10).offer("x", "l", state, 1, now=0.0)


def test_wait_runs_out_and_is_not_restarted_by_a_second_offer():
    h = AdmissionHold(wait=3, max_bytes=10)
    assert h.offer("x", "l", None, 1, now=0.0)
    assert h.sweep(lambda _: None, now=2.9) == []
    assert h.next_deadline() == 3.0
    out = h.sweep(lambda _: None, now=3.0)
    assert [x.item for x in out] == ["x"] and len(h) == 0 and h.nbytes == 0
    # handed back still unadmitted, with its first time: refused (the caller rejects it)
    assert not h.offer("x", "l", None, 1, now=3.0, since=out[0].since)
    assert h.next_deadline() is None


def test_an_eviction_meanwhile_hands_the_item_back_at_once():
    h = AdmissionHold(wait=100, max_bytes=10)
    h.offer("x", "l", "suspect", 1, now=0.0)
    assert [x.item for x in h.sweep({"l": "evicted"}.get, now=0.1)] == ["x"]


def test_bytes_are_bounded_and_zero_wait_holds_nothing():
    h = AdmissionHold(wait=10, max_bytes=250)
    assert h.offer("a", "l", None, 100, now=0) and h.offer("b", "l", None, 100, now=0)
    assert not h.offer("c", "l", None, 100, now=0)  # would exceed 250
    assert h.nbytes == 200
    assert not AdmissionHold(wait=0, max_bytes=10**9).offer("a", "l", None, 1, now=0)
    with pytest.raises(ValueError):
        AdmissionHold(wait=-1, max_bytes=0)
