"""Settings of the aggregator, from ``DILOCO_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from aggregator.quorum import AUTO
from aggregator.shard_plan import AUTO as AUTO_SHARDS, SHARD_VALUES
from bus import codec, sparse
from bus.config import boolean, choice, integer, number, register, token, var


def fragment_range(s: str) -> str:
    """'all', 'N' or 'A-B' (inclusive)."""
    if s == "all":
        return s
    parts = s.split("-")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError("expected 'all', a fragment index N or a range A-B") from None
    if len(nums) not in (1, 2) or any(n < 0 for n in nums) or (len(nums) == 2 and nums[0] > nums[1]):
        raise ValueError("expected 'all', a fragment index N or a range A-B with A <= B")
    return s


def parse_fragments(spec: str, num_fragments: int) -> range:
    if spec == "all":
        return range(num_fragments)
    a, _, b = spec.partition("-")
    lo, hi = int(a), int(b or a)
    if hi >= num_fragments:
        raise ValueError(f"DILOCO_AGG_FRAGMENTS={spec!r}: the run has only {num_fragments} fragments")
    return range(lo, hi + 1)


def shards_value(s: str) -> int:
    """'auto' (AUTO_SHARDS) or an integer N >= 1."""
    if s.strip().lower() == "auto":
        return AUTO_SHARDS
    try:
        return integer(1, 4096)(s)
    except ValueError:
        raise ValueError("expected 'auto' or an integer N with 1 <= N <= 4096") from None


def shards_text(n: int) -> str:
    return "auto" if n == AUTO_SHARDS else str(n)


def quorum_text(k: int) -> str:
    """The setting of quorum ``k`` as DILOCO_QUORUM reads it (:func:`quorum_value`'s inverse)."""
    return "auto" if k == AUTO else str(k or "all")


def quorum_value(s: str) -> int:
    """'all' (0: every active learner), 'auto' (AUTO: rounds close on time) or an integer K >= 1."""
    if s.strip().lower() == "all":
        return 0
    if s.strip().lower() == "auto":
        return AUTO
    try:
        return integer(1, 100_000)(s)
    except ValueError:
        raise ValueError("expected 'all', 'auto' or an integer K with 1 <= K <= 100000") from None


@register("aggregator")
@dataclass(frozen=True)
class AggregatorConfig:
    aggregator_id: str = var("agg-0", token(), "this aggregator's id (metrics, consumer name)")
    embedded_monitor: bool = var(True, boolean(),
                                 "`diloco aggregator` also runs a membership monitor in its process (it competes "
                                 "for the leader lease with any other monitor): a run of an aggregator and islands "
                                 "needs no third process (false: run `diloco monitor` yourself)")
    agg_fragments: str = var("all", fragment_range, "fragments this process owns: all, N or A-B (disjoint per process)")
    agg_shards: int = var(AUTO_SHARDS, shards_value,
                          "shard workers of `diloco aggregator` (with DILOCO_AGG_FRAGMENTS=all): auto = one process per "
                          f"{SHARD_VALUES // 1_000_000}M parameters of the run, at most the usable cores less one and the "
                          "fragments, each owning whole fragments (one: the aggregator runs in its own process); N: "
                          "N processes (see docs/aggregator.md)",
                          show=shards_text)
    quorum: int = var(AUTO, quorum_value, "auto: rounds close on time (every active learner expected within half the "
                      "fastest contributor's sync period, at the pace it reports, is waited for, then the round "
                      "merges: one merge per round at equal speeds, no fast learner held back by a slow one); all: "
                      "once every active learner contributed; K: once K did, then the grace window (see "
                      "docs/aggregator.md)",
                      show=quorum_text)
    grace: str = var("adaptive", choice("fixed", "adaptive"), "how long to wait for more after the quorum")
    grace_seconds: float = var(1.0, number(0.0, 3600), "fixed grace window, and the cap of the adaptive one")
    grace_gamma: float = var(0.5, number(0.0, 0.999), "adaptive grace = min(cap, gamma x slack)")
    tau: int = var(2, integer(1, 1000), "steps of overlap a learner tolerates (for the adaptive grace)")
    merge: str = var("mean", choice("mean", "rda"),
                     "merge of outer gradients: weighted mean (timing-independent) or radial-directional")
    robust: str = var("none", choice("none", "clip", "trim"), "robust merge: clip norms to the median, or trimmed mean")
    clip_factor: float = var(3.0, number(0.0), "clip every contribution's norm to this x the median applied norm of "
                             "its fragment (bounded influence; 0: off)")
    clip_reference_steps: int = var(24, integer(1, 1_000_000),
                                    "before a fragment has 3 applied norms, clip to the geometric bound of this many "
                                    "inner steps (see docs/aggregator.md)")
    max_weight_ratio: float = var(4.0, number(0.0), "no merge weight above this x the median weight (0: off)")
    participation_window: float = var(30.0, number(0.0, 86400),
                                      "learners that contributed within this many seconds count in the participation "
                                      "scale even while the monitor calls them evicted (a learner that left counts until "
                                      "the monitor forgets it)")
    trust: str = var("observe", choice("off", "observe", "weigh"),
                     "trust across rounds: suspect a learner whose outer gradients oppose the others', agree with "
                     "nobody or replay its own (observe: verdicts in metrics and diloco status only; weigh: a "
                     "suspect merges at weight 0, for runs open to parties you do not control; see docs/security.md)")
    trust_rate: float = var(0.05, number(0.0, 1.0, lo_open=True),
                            "forgetting rate of the pairwise agreement records (about 1/rate merges of memory)")
    trust_oppose: float = var(0.75, number(0.0, 10.0, lo_open=True),
                              "a learner opposes the others when its median pairwise agreement is at most -this x "
                              "the typical agreement (and it agrees with nobody)")
    trust_nil: float = var(0.25, number(0.0, 1.0),
                           "a learner is a loner when its best pairwise agreement is at most this x the typical "
                           "agreement (uncorrelated: its own round-to-round agreement too)")
    trim_fraction: float = var(0.1, number(0.0, 0.49), "fraction trimmed at each end (robust=trim)")
    outer_lr: float = var(0.7, number(0.0, 100.0, lo_open=True), "outer Nesterov learning rate")
    outer_momentum: float = var(0.5, number(0.0, 0.999), "outer Nesterov momentum")
    momentum_open_rounds: int = var(1, integer(0, 1_000_000),
                                    "rounds outer optimizer: a contribution feeds the momentum only if its learner "
                                    "had seen the merge of all but at most this many of its own earlier rounds "
                                    "(open-loop backlog work is applied as plain SGD)")
    outer_momentum_dtype: str = var("float32", choice("float32", "bfloat16"),
                                    "dtype of the rounds optimizer's momentum trace (bfloat16: half its memory, "
                                    "2 bytes per value of the model; computed in float32 block by block, rounded "
                                    "where stored; taken by a fragment when it starts, a checkpoint keeps its own)")
    outer_optimizer: str = var("rounds", choice("rounds", "nesterov", "delayed"),
                               "rounds: Nesterov whose momentum advances once per round of work (M contributions), "
                               "however arrivals group; nesterov: once per merge; delayed: every N-th merge")
    delay_n: int = var(1, integer(1, 1000), "N of delayed Nesterov")
    scale_by_participation: bool = var(True, boolean(),
                                       "scale each merged outer gradient by contributions merged / participating "
                                       "learners (a round of per-arrival merges = one synchronous step)")
    staleness: str = var("polynomial", choice("constant", "polynomial", "hinge"), "staleness discount s(d)")
    staleness_a: float = var(0.5, number(0.0, 100.0), "a of (1+d)^-a, and slope of the hinge")
    staleness_b: int = var(4, integer(0), "b of the hinge: no discount up to b versions")
    max_staleness: int = var(16, integer(0), "reject contributions more than this many rounds behind (versions / active learners)")
    norm_outlier_factor: float = var(10.0, number(1.0, lo_open=False), "reject norms above k x median of accepted")
    norm_min_history: int = var(20, integer(1, 10_000),
                                "accepted norms of a fragment before the outlier check starts (past the LR warm-up)")
    require_membership: bool = var(True, boolean(),
                                   "accept only learners the monitor lists as active (false: anyone is active)")
    downlink_quantiser: str = var("fp32", choice(*codec.CODECS),
                                  "global versions: fp32 = whole; else this codec of the delta against a keyframe, or "
                                  "with DILOCO_DOWNLINK_CHAIN against the previous version (topk2 / topk4 only chained)")
    downlink_chain: bool = var(False, boolean(),
                               "send each global version against the previous one as learners reconstruct it (error "
                               "feedback on the way down; learners then download every version, and a learner "
                               "without the previous one takes the whole reconstruction from the keyframe subjects)")
    downlink_topk_k: int = var(256, integer(1, sparse.DEFAULT_CHUNK),
                               f"a topk downlink: values sent per chunk of {sparse.DEFAULT_CHUNK}")
    keyframe_every: int = var(64, integer(1, 1_000_000),
                              "quantised downlink: versions of a fragment between two whole fp32 keyframes")
    admission_wait: float = var(30.0, number(0.0, 3600),
                                "seconds a contribution is held while its learner is not admitted yet (unknown to "
                                "the members bucket, joining, rejoining or suspect) before it is rejected (0: reject at once)")
    admission_hold_mb: float = var(256.0, number(0.0),
                                   "MiB of contributions held for learners not admitted yet; beyond it they are rejected at once")
    checkpoint_every: int = var(32, integer(1, 100_000),
                                "versions of a fragment between two checkpoints of its whole state (in between, "
                                "each merge writes a small merge-log record; a restart replays at most twice this many)")
    checkpoint_seconds: float = var(60.0, number(1.0, 86400),
                                    "seconds after which a fragment with merges since its newest checkpoint is "
                                    "checkpointed (DILOCO_STREAM_MAX_AGE must be at least 4x this)")
    ack_wait: float = var(30.0, number(1.0), "seconds before JetStream redelivers an unacked chunk (crash recovery time)")
    agg_slowdown: float = var(1.0, number(1.0, 1000.0),
                          "benchmarks and tests: emulate an aggregator this many times slower (each intake and merge "
                          "is followed by a blocking pause of slowdown - 1 times its own duration)")
    provision: bool = var(True, boolean(),
                          "create missing streams and apply the limits sized from the run at start (false: the "
                          "streams must exist; `diloco auth init --strict` writes false, admin runs `diloco run "
                          "create --streams-only`)")

    def __post_init__(self) -> None:
        if self.outer_momentum_dtype != "float32" and self.outer_optimizer != "rounds":
            raise ValueError(f"DILOCO_OUTER_MOMENTUM_DTYPE={self.outer_momentum_dtype} applies to "
                             f"DILOCO_OUTER_OPTIMIZER=rounds only (not {self.outer_optimizer}, which keeps float32)")
        if self.downlink_quantiser in sparse.SPARSE and not self.downlink_chain:
            raise ValueError(f"DILOCO_DOWNLINK_QUANTISER={self.downlink_quantiser} needs DILOCO_DOWNLINK_CHAIN=true "
                             "(a sparse delta against a keyframe would drop most of the model's movement)")
