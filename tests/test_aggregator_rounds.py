"""aggregator.rounds: a lock-step fragment ready to merge waits for the rest of its round, unless
waiting could only stall it (pure, no server)."""

from aggregator.rounds import held_for_round


def _merged(table):
    return lambda q, learner, inc: table.get((q, learner, inc))


def _round(learners, r, inc="i"):
    return {(name, inc, r) for name in learners}


def test_a_fragment_waits_while_the_last_learner_s_other_fragment_is_in_flight():
    # a, b, c sent round 5 of both fragments; c's fragment 1 has not arrived yet
    keys = {0: _round("abc", 5), 1: _round("ab", 5)}
    merged = _merged({(1, "c", "i"): 4})
    assert held_for_round({0}, {1: {"c"}}, keys, merged) == {0}
    # once it arrived both are ready, and nothing is held
    keys[1] = _round("abc", 5)
    assert held_for_round({0, 1}, {}, keys, merged) == set()


def test_a_learner_admitted_between_the_fragments_decisions_joins_the_round_of_both():
    # fragment 0 is ready with a and b; fragment 1 now also waits for n, just admitted (nothing sent)
    keys = {0: _round("ab", 7), 1: _round("ab", 7)}
    assert held_for_round({0}, {1: {"n"}}, keys, _merged({})) == {0}


def test_never_held_for_a_learner_that_waits_for_this_very_merge():
    # c's round 5 of fragment 1 is merged already; its round 6 of fragment 0 is buffered: it sends
    # fragment 1 again only after fragment 0 merged, so holding fragment 0 would stall both
    keys = {0: _round("ab", 9) | {("c", "i", 6)}, 1: _round("ab", 9)}
    merged = _merged({(1, "c", "i"): 6})
    assert held_for_round({0}, {1: {"c"}}, keys, merged) == set()
    # the same with c's fragment 1 round 6 not merged yet: in flight, so wait
    assert held_for_round({0}, {1: {"c"}}, keys, _merged({(1, "c", "i"): 5})) == {0}


def test_unpaired_fragments_merge_on_their_own():
    # decoupled learners (not lock-step: no keys) and fragments holding different rounds never wait
    assert held_for_round({0}, {1: {"c"}}, {0: set(), 1: set()}, _merged({})) == set()
    keys = {0: _round("ab", 3), 1: _round("ab", 2)}
    assert held_for_round({0}, {1: {"c"}}, keys, _merged({})) == set()


def test_nothing_is_held_for_a_fragment_that_waits_for_nobody_or_is_ready_itself():
    keys = {0: _round("ab", 1), 1: _round("ab", 1), 2: _round("ab", 1)}
    assert held_for_round({0, 1}, {2: set()}, keys, _merged({})) == set()
    assert held_for_round({0, 1, 2}, {}, keys, _merged({})) == set()
    # several ready fragments paired with one that waits: all of them wait
    assert held_for_round({0, 1}, {2: {"c"}}, keys, _merged({})) == {0, 1}
