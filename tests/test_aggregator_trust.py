"""Trust across rounds (aggregator.trust): pairwise evidence, replays, the merge's weights (pure).

The synthetic runs here give every learner ``common + group + own noise``: one shared direction per
round, one direction per data group (persistent across rounds, like a corpus of its own), and noise.
"""

from __future__ import annotations

import numpy as np

from aggregator.contribution import Contribution
from aggregator.step import FragmentState, MergeSettings, merge_step
from aggregator.trust import (MIN_SEEN, TrustSettings, TrustState, assess, clear, has_majority, sample_index,
                              summary)

N = 4000
WEIGH = TrustSettings(mode="weigh")


def honest_round(rng, k: int, common: np.ndarray, noise: float = 1.0) -> list[np.ndarray]:
    """k honest outer gradients: one shared direction plus each learner's own noise (cosine ~0.5)."""
    return [(common + noise * rng.standard_normal(N)).astype(np.float32) for _ in range(k)]


class Groups:
    """Learners in data groups: each round's vector is common + its group's direction + noise."""

    def __init__(self, rng, sizes: list[int], group: float = 1.0, common: float = 1.0, noise: float = 1.0):
        self.rng = rng
        self.dirs = [rng.standard_normal(N) for _ in sizes]
        self.of = [g for g, n in enumerate(sizes) for _ in range(n)]
        self.group, self.common, self.noise = group, common, noise

    def round(self) -> list[np.ndarray]:
        c = self.rng.standard_normal(N)
        return [(self.common * c + self.group * self.dirs[g] + self.noise * self.rng.standard_normal(N)).astype(np.float32)
                for g in self.of]


def negating_first(rng, k: int, rounds: int):
    """``rounds`` honest rounds of k learners, the first of them sending the negation of its own."""
    for _ in range(rounds):
        vs = honest_round(rng, k, rng.standard_normal(N))
        vs[0] = -vs[0]
        yield vs


def run_rounds(names: list[str], rounds, s: TrustSettings = WEIGH, st: TrustState | None = None):
    st = st or TrustState()
    out = []
    for v, vs in enumerate(rounds):
        a = assess(st, names, vs, s, version=v + 1)
        st = a.state
        out.append(a)
    return st, out


def test_sign_flipped_and_random_learners_are_named_and_weighed_out_honest_ones_keep_their_weight():
    rng = np.random.default_rng(0)
    names = [f"l{i}" for i in range(8)]

    def rounds():
        for _ in range(30):
            vs = honest_round(rng, 8, rng.standard_normal(N))
            vs[0] = -vs[0]  # sign-flipped
            vs[1] = rng.standard_normal(N).astype(np.float32) * np.linalg.norm(vs[2]) / np.sqrt(N)  # random direction
            yield vs

    st, out = run_rounds(names, rounds())
    a = out[-1]
    assert a.factors[0] == 0.0 and a.factors[1] == 0.0 and all(a.factors[2:] == 1.0)
    assert st.learners["l0"].reason == "opposes" and st.learners["l1"].reason == "uncorrelated"
    assert all(st.learners[x].reason == "" for x in names[2:])
    assert all(all(o.factors[2:] == 1.0) for o in out)  # no honest contribution below full weight, ever
    # evidence first: nobody is weighed before MIN_SEEN merges
    assert all(list(o.factors) == [1.0] * 8 for o in out[:MIN_SEEN - 1])
    sm = summary([st], WEIGH)
    assert sm["l0"]["trust"] == 0.0 and sm["l2"]["trust"] == 1.0 and sm["l0"]["distrusted"] > 20
    assert sm["l0"]["evidence"]["median"] < -0.5 and sm["l2"]["evidence"]["median"] > 0.5


def test_honest_groups_with_other_data_are_never_suspected():
    """Issue 39: two regions on other corpora (their group directions opposed: each region pulls the
    model its own way), or a region of one learner: different is not hostile."""
    rng = np.random.default_rng(1)
    for sizes, group in (([4, 4], 1.5), ([2, 2], 1.5), ([6, 2], 1.5), ([3, 1], 1.0), ([1, 1, 1, 1], 1.5)):
        g = Groups(rng, sizes, group=group)
        g.dirs[1] = -g.dirs[0] + 0.3 * g.dirs[1]  # the second region pulls against the first
        names = [f"l{i}" for i in range(sum(sizes))]
        st, out = run_rounds(names, (g.round() for _ in range(40)))
        assert all(all(o.factors == 1.0) for o in out), (sizes, [st.learners[x].evidence for x in names])
        assert not any(lt.reason for lt in st.learners.values()), sizes


def test_a_liar_among_regions_is_named_and_the_honest_regions_are_not():
    rng = np.random.default_rng(2)
    g = Groups(rng, [4, 4], group=1.0)
    names = [f"l{i}" for i in range(8)]

    def rounds():
        for _ in range(40):
            vs = g.round()
            vs[0] = -vs[0]
            yield vs

    st, out = run_rounds(names, rounds())
    assert st.learners["l0"].reason == "opposes" and out[-1].factors[0] == 0.0
    assert all(all(o.factors[1:] == 1.0) for o in out)


def test_a_pair_that_agrees_only_with_each_other_is_honest():
    """The reference's "IID" runs: two learners whose shards hold other files agree with each other
    (0.47) and with the other six at about 0; the earlier rule flagged both."""
    rng = np.random.default_rng(3)
    names = [f"l{i}" for i in range(8)]

    def rounds():
        side = rng.standard_normal(N)
        for _ in range(40):
            vs = honest_round(rng, 8, rng.standard_normal(N))
            own = rng.standard_normal(N)
            vs[3] = (side + own + rng.standard_normal(N)).astype(np.float32)
            vs[4] = (side + own + rng.standard_normal(N)).astype(np.float32)
            yield vs

    st, out = run_rounds(names, rounds())
    assert all(all(o.factors == 1.0) for o in out)
    assert not any(lt.reason for lt in st.learners.values())


def test_a_replayed_vector_is_recognised_and_a_nearly_parallel_honest_one_is_not():
    rng = np.random.default_rng(4)
    names = ["a", "b", "c", "d"]
    st = TrustState()
    old = prev_b = None
    for r in range(8):
        vs = honest_round(rng, 4, rng.standard_normal(N))
        if r == 2:
            old = vs[0].copy()
        if r == 4:
            vs[1] = prev_b + np.float32(1e-3)  # nearly parallel to its previous round
        if r == 7:
            vs[0] = old.copy()
        prev_b = vs[1].copy()
        a = assess(st, names, vs, WEIGH, version=r + 1)
        st = a.state
    assert a.replay == [True, False, False, False] and a.factors[0] == 0.0 and all(a.factors[1:] == 1.0)
    assert st.learners["a"].replays == 1 and st.learners["b"].replays == 0
    # a bit-for-bit copy is never honest: its learner is suspected while the replay is recent
    assert st.learners["a"].reason == "replays" and st.learners["b"].reason == ""
    for r in range(8, 40):
        st = assess(st, names, honest_round(rng, 4, rng.standard_normal(N)), WEIGH, version=r + 1).state
    assert st.learners["a"].reason == ""


def test_fewer_than_three_learners_carry_no_evidence():
    """A liar and one honest learner point against each other: nobody can tell which lies."""
    rng = np.random.default_rng(5)
    st = TrustState()
    for v in range(12):
        common = rng.standard_normal(N)
        honest = (common + rng.standard_normal(N)).astype(np.float32)
        a = assess(st, ["liar", "honest"], [(-common).astype(np.float32), honest], WEIGH, version=v + 1)
        st = a.state
        assert list(a.factors) == [1.0, 1.0]
    assert not st.learners["liar"].reason and not st.learners["honest"].reason


def test_four_learners_name_a_negation_three_do_not():
    """Of three, the two honest learners agree with one learner and oppose one: the typical learner's
    typical agreement is 0, and nobody is judged. Of four, the negation stands out."""
    rng = np.random.default_rng(6)
    for k, named in ((3, ""), (4, "opposes")):
        def rounds():
            for _ in range(20):
                vs = honest_round(rng, k, rng.standard_normal(N))
                vs[0] = -vs[0]
                yield vs

        st, out = run_rounds(["liar"] + [f"h{i}" for i in range(k - 1)], rounds())
        assert st.learners["liar"].reason == named
        assert list(out[-1].factors) == [0.0 if named else 1.0] + [1.0] * (k - 1)


def test_verdicts_fade_when_a_learner_agrees_again_and_the_record_round_trips():
    rng = np.random.default_rng(7)
    names = ["a", "b", "c", "d"]

    st, _ = run_rounds(names, negating_first(rng, 4, 15))
    assert st.learners["a"].reason == "opposes"
    st, out = run_rounds(names, (honest_round(rng, 4, rng.standard_normal(N)) for _ in range(60)), st=st)
    assert st.learners["a"].reason == "" and out[-1].factors[0] == 1.0
    # as the checkpoint stores it (msgpack: plain Python values only; a numpy bool in the record
    # failed every checkpoint of a run and stalled its merges)
    import msgpack

    back = TrustState.from_dict(msgpack.unpackb(msgpack.packb(st.to_dict(), use_bin_type=True), raw=False,
                                                strict_map_key=False))
    assert back.to_dict() == st.to_dict() and back.judging is True
    # an earlier rule's record (its mean agreement per learner) starts over, it does not fail
    assert TrustState.from_dict({"l": {"x": {"s": [1, 1, 1, 1], "seen": 3}}, "a": [0.3]}).to_dict() == TrustState().to_dict()


def test_clear_forgets_a_learner_and_its_pairs():
    rng = np.random.default_rng(8)
    names = ["a", "b", "c", "d"]

    st, _ = run_rounds(names, negating_first(rng, 4, 15))
    cleared = clear(st, "a", 7)
    assert "a" not in cleared.learners and not any("a" in k for k in cleared.pairs)
    assert cleared.cleared == {"a": 7} and "a" in st.learners  # pure
    # measured afresh: it is trusted for its first MIN_SEEN merges
    a = assess(cleared, names, [-v for v in honest_round(rng, 4, rng.standard_normal(N))][:1]
               + honest_round(rng, 3, rng.standard_normal(N)), WEIGH, version=20)
    assert a.factors[0] == 1.0
    assert TrustState.from_dict(cleared.to_dict()).cleared == {"a": 7}


def test_observe_and_off_modes_do_not_change_the_merge():
    rng = np.random.default_rng(9)

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
    assert observe.trust.learners["l0"].reason == "opposes" and observe.last_trust == [1.0] * 4  # named, not applied
    assert weigh.last_trust[0] == 0.0 and weigh.last_trust[1:] == [1.0, 1.0, 1.0]


def suspect_state(names: list[str], liar: str, rounds: int = 12, seed: int = 10) -> TrustState:
    """A fragment's record after ``rounds`` merges in which ``liar`` sent negations."""
    rng = np.random.default_rng(seed)

    def gen():
        for _ in range(rounds):
            vs = honest_round(rng, len(names), rng.standard_normal(N))
            vs[names.index(liar)] = -vs[names.index(liar)]
            yield vs

    st, _ = run_rounds(names, gen())
    assert st.learners[liar].reason == "opposes"
    return st


def test_a_distrusted_contribution_leaves_the_mean_and_the_step():
    rng = np.random.default_rng(11)
    settings = MergeSettings(momentum=0.0, lr=1.0, max_weight_ratio=0.0, clip_factor=0.0, trust=WEIGH)
    st = FragmentState.initial(0, 0, np.zeros(N, np.float32), settings)
    st.trust = suspect_state(["x", "g0", "g1", "g2"], "x")
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
    """A clean run's merges are the same bit for bit with trust weighing and with trust off."""
    rng = np.random.default_rng(12)
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
    assert not any(lt.reason for lt in weigh.trust.learners.values())
    assert all(lt.evidence["median"] > 0.5 for lt in weigh.trust.learners.values())


def test_status_shows_each_learners_trust_and_the_suspects_evidence():
    from monitor.status import merge_trust, render_status, trust_cell

    ev = {"median": -1.2, "best": -0.9, "partner": "l1", "own": 0.8, "pairs": 3}
    a = {"l0": {"score": -1.2, "trust": 0.0, "reason": "opposes", "evidence": ev, "distrusted": 40,
                "suspected_on": 4, "fragments": 4, "weighed": True},
         "l1": {"score": 0.9, "trust": 1.0, "reason": "", "weighed": True}}
    b = {"l0": {"score": 0.1, "trust": 1.0, "reason": "", "weighed": True},
         "l1": {"score": 0.02, "trust": 0.0, "reason": "uncorrelated", "suspected_on": 1, "fragments": 4,
                "evidence": {"median": 0.02, "best": 0.05, "partner": "l0", "own": 0.01}, "weighed": True}}
    merged = merge_trust({"agg-0": a, "agg-1": b})  # the least trusting aggregator's record per learner
    assert merged["l0"]["reason"] == "opposes" and merged["l1"]["reason"] == "uncorrelated"
    assert trust_cell(merged["l0"]) == "0.00 opposes" and trust_cell(None) == "-"
    assert trust_cell({**merged["l0"], "weighed": False}) == "1.00 opposes (observed)"
    now = 1000.0
    member = {"region": "eu", "state": "active", "since": now - 5, "last_seen": now - 1, "step": 10, "reason": ""}
    st = {"run": "r", "ts": now, "server": {"url": "nats://x", "version": "2", "max_payload": 1 << 20},
          "jetstream": {"streams": 4, "consumers": 1, "storage": 0, "memory": 0},
          "leader": None, "manifest": None, "versions": None, "streams": {},
          "membership": {"counts": {"active": 2}, "members": [{**member, "learner": "l0"}, {**member, "learner": "l1"}]},
          "trust": merged}
    text = render_status(st, width=400)
    assert "TRUST" in text and "0.00 opposes" in text and "0.00 uncorrelated" in text
    assert ("suspects   l0 (opposes, median -1.2, best -0.9 (l1), own 0.8, on 4/4 fragments, 40 merged at weight 0)"
            in text)
    assert "diloco trust clear" in text


def test_when_half_the_learners_are_suspected_nobody_is_weighed_down():
    """The measure itself is in doubt then (the absorbing state bench.soak found under an earlier
    rule: every contributor of a fragment at weight 0, and the fragment never moved again)."""
    rng = np.random.default_rng(13)
    names = ["a", "b", "c", "d"]

    def rounds():
        for _ in range(20):
            common = rng.standard_normal(N)
            yield [(common + rng.standard_normal(N)).astype(np.float32), (common + rng.standard_normal(N)).astype(np.float32),
                   (-common + rng.standard_normal(N)).astype(np.float32), (-common + rng.standard_normal(N)).astype(np.float32)]

    st, out = run_rounds(names, rounds())
    assert not has_majority(st) or not any(lt.reason for lt in st.learners.values())
    assert all(all(o.factors == 1.0) for o in out)


def test_a_learners_own_other_round_in_the_merge_is_no_witness_for_it():
    """A merge can hold two rounds of one learner: the liar's two negations agree with each other,
    and it must still be judged by the other learners only."""
    rng = np.random.default_rng(14)
    names = ["liar", "liar", "a", "b", "c", "d", "e"]

    def rounds():
        for _ in range(10):
            vs = honest_round(rng, 7, rng.standard_normal(N))
            vs[0], vs[1] = -vs[0], -vs[1]
            yield vs

    st, out = run_rounds(names, rounds())
    assert list(out[-1].factors) == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert st.learners["liar"].evidence["pairs"] == 5


def test_a_distrusted_learners_claimed_tokens_do_not_set_the_honest_step():
    """The review's case: with the kept share taken from the weights, a liar at weight 0 that claimed
    more tokens shrank the honest learners' step (0.57x at 1600 tokens), fewer enlarged it (1.33x)."""
    rng = np.random.default_rng(15)
    settings = MergeSettings(momentum=0.0, lr=1.0, max_weight_ratio=0.0, clip_factor=0.0, trust=WEIGH)
    common = rng.standard_normal(N)
    vs = honest_round(rng, 3, common)
    suspect = suspect_state(["x", "a", "b", "c"], "x")

    def step(liar_tokens: int) -> np.ndarray:
        st = FragmentState.initial(0, 0, np.zeros(N, np.float32), settings)
        st.trust = suspect
        cs = [Contribution("r", "m", n, "i", 0, 0, 0, 8, 800, v, period=8) for n, v in zip("abc", vs)]
        cs.append(Contribution("r", "m", "x", "i", 0, 0, 0, 8, liar_tokens, (-common).astype(np.float32), period=8))
        return merge_step(st, cs, settings, scale=1.0, per_round=4).params

    ref = step(800)
    np.testing.assert_allclose(step(100), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(step(1600), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ref, -np.mean(vs, axis=0), rtol=1e-4, atol=1e-5)  # the 3 honest ones' whole round
