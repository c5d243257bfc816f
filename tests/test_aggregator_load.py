"""The aggregator's busy share and when it says it is saturated (aggregator.load, pure)."""

import pytest

from aggregator.load import KEEPING_UP, SATURATED, BusyMeter, PhaseClock, saturation_change


def test_busy_share_over_a_sliding_window():
    m = BusyMeter(window=10.0)
    assert m.share(5.0) == 0.0  # nothing done yet
    for t in range(1, 21):  # 0.5 s of work every second, for 20 s
        m.add(float(t), 0.5)
    assert m.share(20.0) == pytest.approx(0.5, abs=0.06)
    for t in range(21, 31):  # then busy all the time
        m.add(float(t), 1.0)
    assert m.share(30.0) == pytest.approx(1.0, abs=0.01)
    assert m.share(100.0) == 0.0  # idle since: the window forgets
    early = BusyMeter(window=10.0)
    early.add(1.0, 1.0)  # the first second busy: judged over the time since the first work
    assert early.share(1.0) == pytest.approx(1.0)


def test_saturation_is_said_once_per_change_with_hysteresis_and_only_over_a_whole_window():
    assert saturation_change(0.95, False, full_window=False) is None  # start-up compiles are no verdict
    assert saturation_change(SATURATED, False, full_window=True) is True
    assert saturation_change(0.99, True, full_window=True) is None  # said already
    assert saturation_change(0.8, True, full_window=True) is None  # between the two thresholds: unchanged
    assert saturation_change(KEEPING_UP - 0.01, True, full_window=True) is False
    assert saturation_change(0.5, False, full_window=True) is None


def test_the_loop_clock_books_each_lap_to_its_phase():
    c = PhaseClock()
    c.lap("other", 10.0)  # the start: nothing booked
    assert c.totals == {}
    c.lap("poll", 10.5)
    c.lap("intake", 10.75)
    c.lap("poll", 11.0)
    c.lap("publish", 11.0)  # an empty lap
    assert c.totals == {"poll": 0.75, "intake": 0.25, "publish": 0.0}
    assert sum(c.totals.values()) == 1.0  # every second since the start, once
    c.lap("merge", 10.9)  # a clock that went back books nothing
    assert c.rounded()["merge"] == 0.0
