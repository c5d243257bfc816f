"""Trust across rounds (aggregator.trust): agreement, scores, replays, the merge's weights (pure)."""

from __future__ import annotations

import numpy as np

from aggregator.contribution import Contribution
from aggregator.step import FragmentState, MergeSettings, merge_step
from aggregator.trust import (LearnerTrust, TrustSettings, TrustState, assess, reason_of, sample_index, summary,
                              trust_of)

N = 4000


def opposed(n: int = 10) -> LearnerTrust:
    """The record of a learner that pointed against the others n times."""
    lt = LearnerTrust()
    for _ in range(n):
        lt.observe(-1.0, 0.05)
    return lt


def honest_round(rng, k: int, common: np.ndarray, noise: float = 1.0) -> list[np.ndarray]:
    """k honest outer gradients: one shared direction plus each learner's own noise (cosine ~0.2-0.5)."""
    return [(common + noise * rng.standard_normal(N)).astype(np.float32) for _ in range(k)]


def test_sign_flipped_and_random_learners_lose_their_weight_honest_ones_keep_it():
    rng = np.random.default_rng(0)
    s = TrustSettings()
    st = TrustState()
    names = [f"l{i}" for i in range(8)]
    for r in range(30):
        common = rng.standard_normal(N)
        vs = honest_round(rng, 8, common)
        vs[0] = -vs[0]  # sign-flipped
        vs[1] = rng.standard_normal(N).astype(np.float32) * np.linalg.norm(vs[2]) / np.sqrt(N)  # random direction
        a = assess(st, names, vs, s)
        st = a.state
    assert a.factors[0] == 0.0  # a negation: out
    assert 0.0 <= a.factors[1] < 0.9  # no agreement on average: at most a part of its weight
    assert all(a.factors[2:] == 1.0)
    assert reason_of(st.learners["l0"], s) == "opposes"
    assert reason_of(st.learners["l1"], s) == "uncorrelated"
    assert all(reason_of(st.learners[x], s) == "" for x in names[2:])
    out = summary([st], s)
    assert out["l0"]["trust"] == 0.0 and out["l2"]["trust"] == 1.0 and out["l0"]["distrusted"] > 20


def test_a_replayed_vector_is_recognised_and_a_nearly_parallel_honest_one_is_not():
    rng = np.random.default_rng(1)
    s = TrustSettings()
    st = TrustState()
    names = ["a", "b", "c"]
    old = prev_b = None
    for r in range(6):
        vs = honest_round(rng, 3, rng.standard_normal(N))
        if r == 2:
            old = vs[0].copy()
        if r == 4:
            vs[1] = prev_b + np.float32(1e-3)  # nearly parallel to its previous round
        if r == 5:
            vs[0] = old.copy()
        prev_b = vs[1].copy()
        a = assess(st, names, vs, s)
        st = a.state
    assert a.replay == [True, False, False] and a.factors[0] == 0.0
    assert st.learners["a"].replays == 1 and st.learners["b"].replays == 0


def test_a_lone_contribution_carries_no_evidence_its_score_decides():
    rng = np.random.default_rng(2)
    s = TrustSettings()
    first = assess(TrustState(), ["a"], [rng.standard_normal(N).astype(np.float32)], s)
    assert first.agreements == [None] and first.z == [None] and first.factors[0] == 1.0
    low = TrustState({"a": opposed(), "b": LearnerTrust(), "c": LearnerTrust()})
    again = assess(low, ["a"], [rng.standard_normal(N).astype(np.float32)], s)
    assert again.z == [None] and again.factors[0] == 0.0
    assert again.state.learners["a"].to_dict()["s"] == low.learners["a"].to_dict()["s"]  # no evidence taken


def test_two_contributions_with_one_distrusted_judge_it_by_the_other():
    rng = np.random.default_rng(6)
    s = TrustSettings()
    st = TrustState({"bad": opposed(), "good": LearnerTrust(), "other": LearnerTrust()}, [0.3] * 10)
    common = rng.standard_normal(N)
    good = (common + rng.standard_normal(N)).astype(np.float32)
    a = assess(st, ["good", "bad"], [good, (-common).astype(np.float32)], s)
    assert a.agreements[0] is None and a.factors[0] == 1.0  # its only reference is distrusted
    assert a.agreements[1] < 0 and a.factors[1] == 0.0


def test_scores_recover_when_a_learner_agrees_again_and_the_record_round_trips():
    rng = np.random.default_rng(3)
    s = TrustSettings()
    st = TrustState()
    names = ["a", "b", "c", "d"]
    for r in range(10):
        vs = honest_round(rng, 4, rng.standard_normal(N))
        vs[0] = -vs[0]
        st = assess(st, names, vs, s).state
    assert trust_of(st.learners["a"].score(), s) == 0.0
    for r in range(40):
        st = assess(st, names, honest_round(rng, 4, rng.standard_normal(N)), s).state
    assert trust_of(st.learners["a"].score(), s) == 1.0
    back = TrustState.from_dict(st.to_dict())
    assert back.to_dict() == st.to_dict()


def test_observe_and_off_modes_do_not_change_the_merge():
    rng = np.random.default_rng(4)
    vs = honest_round(rng, 4, rng.standard_normal(N))
    vs[0] = -vs[0]

    def run(mode: str):
        settings = MergeSettings(momentum=0.0, trust=TrustSettings(mode=mode))
        st = FragmentState.initial(0, 0, np.zeros(N, np.float32), settings)
        for r in range(12):
            cs = [Contribution("r", "m", f"l{i}", "i", 0, r, st.version, 8, 800, v, period=8)
                  for i, v in enumerate(honest_round(rng, 4, rng.standard_normal(N)))]
            cs[0] = Contribution("r", "m", "l0", "i", 0, r, st.version, 8, 800, -cs[0].vector, period=8)
            st = merge_step(st, cs, settings, scale=1.0, per_round=4)
        return st

    off, observe, weigh = run("off"), run("observe"), run("weigh")
    assert not off.trust.learners  # nothing measured
    assert observe.trust.learners["l0"].score() < 0  # measured, not applied
    assert weigh.last_trust[0] == 0.0 and weigh.last_trust[1:] == [1.0, 1.0, 1.0]


def test_a_distrusted_contribution_leaves_the_mean_and_the_step():
    rng = np.random.default_rng(5)
    settings = MergeSettings(momentum=0.0, lr=1.0, max_weight_ratio=0.0, clip_factor=0.0)
    st = FragmentState.initial(0, 0, np.zeros(N, np.float32), settings)
    st.trust = TrustState({"x": opposed(), "g0": LearnerTrust(), "g1": LearnerTrust()}, [0.3] * 10)
    good = [rng.standard_normal(N).astype(np.float32) for _ in range(2)]
    common = good[0] + good[1]
    cs = [Contribution("r", "m", "g0", "i", 0, 0, 0, 8, 800, (common + 0.3 * good[0]).astype(np.float32), period=8),
          Contribution("r", "m", "x", "i", 0, 0, 0, 8, 800, -common.astype(np.float32), period=8)]
    new = merge_step(st, cs, settings, scale=1.0, per_round=2)
    # the round is counted without x: of its 2 participants 1 is left, the honest one, whose vector is
    # the round's whole step (x lr 1, minus sign); without trust it would be half the mean of two
    assert new.last_trust == [1.0, 0.0]
    np.testing.assert_allclose(new.params, -cs[0].vector, rtol=1e-5, atol=1e-6)
    # a per-arrival merge of the honest one alone, x distrusted in the round: 1 of the 2 counts
    alone = merge_step(st, cs[:1], settings, scale=0.5, per_round=2)
    np.testing.assert_allclose(alone.params, -cs[0].vector, rtol=1e-5, atol=1e-6)


def test_the_sample_covers_large_fragments_with_a_fixed_stride():
    idx = sample_index(10_000_000)
    assert len(idx) <= 1 << 16 and idx[0] == 0 and idx[-1] >= 10_000_000 - 200 * 16
    assert len(sample_index(100)) == 100
    # what the trust check reads (strided runs, no gather) is exactly those coordinates
    from aggregator.trust import samples

    rng = np.random.default_rng(3)
    for n in (100, 1 << 16, (1 << 16) + 1, 1_000_003):
        vs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        np.testing.assert_array_equal(samples(vs), np.stack([v[sample_index(n)] for v in vs]))


def test_learners_that_agree_merge_exactly_as_without_trust():
    """A clean run's merges (every learner sharing the direction, each with its own noise) are the
    same bit for bit with trust weighing and with trust off."""
    rng = np.random.default_rng(7)
    rounds = [honest_round(rng, 4, rng.standard_normal(N)) for _ in range(25)]

    def run(mode: str) -> FragmentState:
        settings = MergeSettings(trust=TrustSettings(mode=mode))
        st = FragmentState.initial(0, 0, np.zeros(N, np.float32), settings)
        for r, vs in enumerate(rounds):
            cs = [Contribution("r", "m", f"l{i}", "i", 0, r, st.version, 8, 800, 1e-3 * v, period=8)
                  for i, v in enumerate(vs)]
            st = merge_step(st, cs, settings, scale=1.0, per_round=4)
        return st

    weigh = run("weigh")
    np.testing.assert_array_equal(weigh.params, run("off").params)
    assert min(lt.score() for lt in weigh.trust.learners.values()) > 0.5


def test_status_shows_each_learners_trust_and_names_the_suspects():
    from monitor.status import merge_trust, render_status, trust_cell

    a = {"l0": {"score": -0.6, "trust": 0.0, "reason": "opposes", "distrusted": 40}, "l1": {"score": 0.9, "trust": 1.0,
                                                                                          "reason": ""}}
    b = {"l0": {"score": 0.1, "trust": 0.0, "reason": "uncorrelated", "distrusted": 3},
         "l1": {"score": 0.45, "trust": 0.833, "reason": "weak"}}
    merged = merge_trust({"agg-0": a, "agg-1": b})  # the least trusting aggregator's record per learner
    assert merged["l0"]["reason"] == "opposes" and merged["l1"]["reason"] == "weak"
    assert trust_cell(merged["l0"]) == "0.00 opposes" and trust_cell(None) == "-"
    now = 1000.0
    member = {"region": "eu", "state": "active", "since": now - 5, "last_seen": now - 1, "step": 10, "reason": ""}
    st = {"run": "r", "ts": now, "server": {"url": "nats://x", "version": "2", "max_payload": 1 << 20},
          "jetstream": {"streams": 4, "consumers": 1, "storage": 0, "memory": 0},
          "leader": None, "manifest": None, "versions": None, "streams": {},
          "membership": {"counts": {"active": 2}, "members": [{**member, "learner": "l0"}, {**member, "learner": "l1"}]},
          "trust": merged}
    text = render_status(st)
    assert "TRUST" in text and "0.00 opposes" in text and "0.83 weak" in text
    assert "suspects   l0 (opposes, score -0.6, 40 merged at weight 0), l1 (weak" in text


def test_without_a_trusted_majority_nobody_is_weighed_down_and_scores_can_recover():
    """The absorbing state bench.soak found: every contributor of a fragment at weight 0 made each
    contribution a comparison with nothing, and the fragment never moved again."""
    rng = np.random.default_rng(8)
    s = TrustSettings()
    names = ["a", "b", "c", "d"]
    st = TrustState({x: opposed() for x in names})
    a = assess(st, names, honest_round(rng, 4, rng.standard_normal(N)), s)
    assert list(a.factors) == [1.0] * 4 and all(x is not None for x in a.agreements)
    for _ in range(40):
        a = assess(a.state, names, honest_round(rng, 4, rng.standard_normal(N)), s)
    assert all(trust_of(lt.score(), s) == 1.0 for lt in a.state.learners.values())
    # one of three distrusted is a minority: it is weighed down (by its score)
    st = TrustState({"a": opposed(), "b": LearnerTrust(), "c": LearnerTrust()})
    vs = honest_round(rng, 3, rng.standard_normal(N))
    assert list(assess(st, ["a", "b", "c"], vs, s).factors) == [0.0, 1.0, 1.0]


def test_a_pair_of_contributions_is_no_evidence_against_either():
    """Under load the first merges of a run can hold two: a liar and one honest learner point
    against each other, and scoring them both -1 weighed the honest one down (the system test)."""
    rng = np.random.default_rng(9)
    s = TrustSettings()
    st = TrustState()
    for _ in range(6):
        common = rng.standard_normal(N)
        honest = (common + rng.standard_normal(N)).astype(np.float32)
        st = assess(st, ["liar", "honest"], [(-common).astype(np.float32), honest], s).state
    assert st.learners["honest"].seen == 0 and st.learners["liar"].seen == 0
    assert trust_of(st.learners["honest"].score(), s) == 1.0


def test_a_learners_own_other_round_in_the_merge_is_no_witness_for_it():
    """A merge can hold two rounds of one learner: the liar's two negations agree with each other,
    and must still be judged by the other learners only."""
    rng = np.random.default_rng(10)
    s = TrustSettings()
    st = TrustState()
    names = ["liar", "liar", "a", "b", "c", "d", "e"]
    for _ in range(5):
        common = rng.standard_normal(N)
        vs = honest_round(rng, 7, common)
        vs[0], vs[1] = -vs[0], -vs[1]
        a = assess(st, names, vs, s)
        st = a.state
    assert a.agreements[0] < 0 and a.agreements[1] < 0
    assert list(a.factors) == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_a_distrusted_learners_claimed_tokens_do_not_set_the_honest_step():
    """The review's case: with the kept share taken from the weights, a liar at weight 0 that claimed
    more tokens shrank the honest learners' step (0.57x at 1600 tokens), fewer enlarged it (1.33x)."""
    rng = np.random.default_rng(11)
    settings = MergeSettings(momentum=0.0, lr=1.0, max_weight_ratio=0.0, clip_factor=0.0)
    common = rng.standard_normal(N)
    vs = honest_round(rng, 3, common)

    def step(liar_tokens: int) -> np.ndarray:
        st = FragmentState.initial(0, 0, np.zeros(N, np.float32), settings)
        st.trust = TrustState({"x": opposed(), "a": LearnerTrust(), "b": LearnerTrust(), "c": LearnerTrust()},
                              [0.3] * 10)
        cs = [Contribution("r", "m", n, "i", 0, 0, 0, 8, 800, v, period=8) for n, v in zip("abc", vs)]
        cs.append(Contribution("r", "m", "x", "i", 0, 0, 0, 8, liar_tokens, (-common).astype(np.float32), period=8))
        return merge_step(st, cs, settings, scale=1.0, per_round=4).params

    ref = step(800)
    np.testing.assert_allclose(step(100), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(step(1600), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ref, -np.mean(vs, axis=0), rtol=1e-4, atol=1e-5)  # the 3 honest ones' whole round


def test_each_other_learner_counts_once_in_a_reference():
    """A liar's two rounds in one merge must not outweigh two honest learners in an honest one's
    reference (the system test: honest learners averaged z -0.4 and were weighed down 16 times)."""
    rng = np.random.default_rng(12)
    s = TrustSettings()
    common = rng.standard_normal(N)
    vs = honest_round(rng, 3, common) + [(-common + rng.standard_normal(N)).astype(np.float32) for _ in range(2)]
    a = assess(TrustState(), ["a", "b", "c", "liar", "liar"], vs, s)
    assert min(a.agreements[:3]) > 0.2 and max(a.agreements[3:]) < -0.2
