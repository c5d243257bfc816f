"""One reference run's configuration (``simulation.reference``): ``RefConfig``, whose defaults are the
roles' own settings, the model presets, the quorum a mode implies and seeded failure traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MODES = ("dp", "sync", "streaming", "decoupled")
BYZANTINE = ("", "sign", "random", "replay", "corrupt")
#: the built-in model's ``small`` preset (bench.runs.SMALL_MODEL, diloco up --model-preset small; 119,104
#: parameters) and a tinier one for quick runs and tests (17,504 parameters)
SMALL_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "seq_len": 64}
TINY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32}


def _default(cls, name: str):
    """The default of a role's setting: the reference follows the roles' defaults, never a copy."""
    return cls.__dataclass_fields__[name].default


def _L(name: str):
    from learner.config import LearnerConfig

    return _default(LearnerConfig, name)


def _MODEL(name: str):
    from learner.config import ModelConfig

    return _default(ModelConfig, name)


def _A(name: str):
    from aggregator.config import AggregatorConfig

    return _default(AggregatorConfig, name)


@dataclass(frozen=True)
class RefConfig:
    """One reference run. Inner settings are ``learner.config``'s, outer settings the aggregator's."""

    mode: str = "decoupled"
    M: int = 2
    steps: int = 200  # inner steps per learner (dp: steps of batch M x batch)
    # decoupled and streaming: each learner's own inner steps, its learning-rate schedule spanning
    # them (a budget shared by speed: bench.quorum's ``budget`` speeds); None: ``steps`` each
    learner_steps: tuple[int, ...] | None = None
    # decoupled and streaming: each learner's own sync period (Dynamic Local Updates at a fixed speed,
    # DILOCO_DYNAMIC_H: a slower learner syncs after fewer steps); None: ``H`` each
    learner_periods: tuple[float, ...] | None = None
    batch: int = 8  # sequences per learner step
    # model: the built-in transformer (learner.config.ModelConfig fields), or ``island`` (below)
    model: dict = field(default_factory=lambda: dict(SMALL_MODEL))
    seed: int = 0  # version 0
    corpus: str = ""  # DILOCO_DATA: empty = the Python standard library's sources; a text file or folder
    # non-IID runs: one corpus per group of learners (the same kinds of source as ``corpus``; "" is the
    # standard library), learner m in group m * len(corpora) // M; the held-out loss is the mean over
    # the groups' held-out batches. Empty: every learner samples ``corpus`` (IID)
    corpora: tuple[str, ...] = ()
    data_seed: int = 0
    # the learners' incarnations: given, each samples its batches as a ``diloco learner`` process of
    # that incarnation does (``learner.loop.batch_seed``), so a system run can be replayed
    # (bench.fidelity); None: bench.dp's samplers, the same as data-parallel's
    incarnations: tuple[str, ...] | None = None
    # inner (AdamW, learner.inner): the learner's defaults
    lr: float = _L("inner_lr")  # 0: the learner's default by width, inner optimizer and M (learner.config.auto_inner_lr)
    warmup: int = _L("warmup_steps")  # -1: the learner's DILOCO_WARMUP_FRACTION of the schedule
    total_steps: int | None = None  # cosine schedule length (None: steps)
    weight_decay: float = _L("weight_decay")
    clip_norm: float = _L("clip_norm")
    inner_optimizer: str = _L("inner_optimizer")  # adamw or muon (learner.inner)
    muon_rms: float = _L("muon_rms")  # Muon's update RMS as a share of the rate
    # outer schedule: the learner's and the model's defaults
    H: int = _L("sync_every")
    P: int = _MODEL("num_fragments")
    quantiser: str = _L("quantiser")
    error_feedback: bool = _L("error_feedback")
    feedback_decay: float = _L("feedback_decay")
    residual_dtype: str = _L("residual_dtype")
    topk_chunk: int = _L("topk_chunk")
    topk_k: int = _L("topk_k")
    on_arrival: str = _L("on_arrival")
    mix_alpha: float = _L("mix_alpha")
    fetch: str = _L("fetch")
    fetch_delay: int = _L("fetch_delay")  # -1: H/4 (the default before the fourteenth round)
    # the learners' sync window and hold (DILOCO_SYNC_WINDOW, DILOCO_SYNC_HOLD; decoupled only):
    # a sync deferred while the learner's previous round of the fragment is not merged, and inner
    # steps held once one waited that many periods, at most sync_timeout (virtual) seconds. Off (0)
    # unless set: the reference's recorded figures were made without them
    sync_window: int = 0
    sync_hold: int = 0
    sync_timeout: float = _L("sync_timeout")
    final_sync: bool = _L("final_sync")
    # aggregator: its defaults, except the quorum (None: K = M, every learner; -1: on time,
    # aggregator.quorum.AUTO, the role default since the seventh round: at equal step times both
    # give the same loss within 0.01%, docs/BENCHMARKS.md, so the recorded figures stand) and the
    # grace window (fixed, in virtual seconds)
    K: int | None = None
    grace: float = 0.0
    merge: str = _A("merge")
    outer_optimizer: str = _A("outer_optimizer")
    outer_lr: float = _A("outer_lr")
    outer_momentum: float = _A("outer_momentum")
    outer_momentum_dtype: str = _A("outer_momentum_dtype")
    delay_n: int = _A("delay_n")
    staleness: str = _A("staleness")
    staleness_a: float = _A("staleness_a")
    staleness_b: int = _A("staleness_b")
    max_staleness: int = _A("max_staleness")
    norm_outlier_factor: float = _A("norm_outlier_factor")
    norm_min_history: int = _A("norm_min_history")
    scale_by_participation: bool = _A("scale_by_participation")
    clip_factor: float = _A("clip_factor")
    trust: str = _A("trust")
    trust_rate: float = _A("trust_rate")
    trust_oppose: float = _A("trust_oppose")
    trust_nil: float = _A("trust_nil")
    momentum_open_rounds: int = _A("momentum_open_rounds")
    downlink: str = _A("downlink_quantiser")
    keyframe_every: int = _A("keyframe_every")
    # the chained downlink (bus.downlink.encode_chain: each version against the previous
    # reconstruction, error feedback on the way down; the roles do not publish it yet), and a sparse
    # downlink codec's values per chunk (its chunk: topk_chunk)
    downlink_chain: bool = False
    down_k: int = _L("topk_k")
    # timing (virtual seconds) and faults
    step_times: tuple[float, ...] | None = None  # per learner; None: 1.0 each
    # each step's time drawn around its learner's: a log-normal factor of this coefficient of
    # variation (mean 1), seeded by ``data_seed``; what eight learners sharing two cores see end to
    # end (docs/BENCHMARKS.md, twentieth round). 0: every step exactly its step time
    step_jitter: float = 0.0
    # the phase lock (learner.loop.phase_shift): each learner moves its syncs by this share of its
    # lead over the round's phase (every syncing learner's last arrival: aggregator.quorum.round_phases)
    # per round. 0 (off) here, unlike the roles (DILOCO_PHASE_LOCK=1.0 since the twenty-second round):
    # the recorded figures were made without it, and learners that start together at exact step
    # times stay in phase, where it moves next to nothing (docs/BENCHMARKS.md, twenty-second round)
    phase_lock: float = 0.0
    up_delay: float = 0.0  # a contribution's send -> arrival at the aggregator
    down_delay: float = 0.0  # a merge -> the version at every learner (download included)
    failures: tuple[tuple[int, float, float], ...] = ()  # (learner, down at, back at)
    # the aggregator down (down at, back at): contributions wait in the stream, no version is
    # published, learners train on alone; at ``back at`` the backlog arrives in order
    agg_outages: tuple[tuple[float, float], ...] = ()
    # evaluation
    eval_points: int = 8  # held-out loss of the global model at this many points (and the end)
    eval_batches: int = 8
    eval_batch_size: int = 16
    # Byzantine learners (issue 29): these learners' contributions pass every check but lie:
    # ``sign`` sends the negation of what it trained, ``random`` a random direction at the median
    # honest norm of the fragment, ``replay`` one of its own earlier whole-round vectors again as a
    # new round, ``corrupt`` trains on shuffled tokens (its outer gradients are honest about that)
    byzantine: str = ""
    byzantine_learners: tuple[int, ...] = (0,)
    byzantine_seed: int = 0
    # the floor of any defence that can only leave a learner out: the byzantine learners train (their
    # compute is spent) but an oracle drops all they send and counts them out of every round
    byzantine_oracle: bool = False
    # record every merge's cosines between its contributions (the trust check's inputs; bench.noniid)
    record_trust: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.M < 1 or self.steps < 1 or self.batch < 1 or self.H < 1 or self.P < 1:
            raise ValueError("M, steps, batch, H and P must be >= 1")
        if self.learner_steps is not None and (len(self.learner_steps) != self.M or min(self.learner_steps) < 1
                                               or self.mode not in ("decoupled", "streaming")):
            raise ValueError(f"learner_steps needs {self.M} values >= 1, in decoupled or streaming mode, "
                             f"got {self.learner_steps} in {self.mode}")
        if self.learner_periods is not None and (len(self.learner_periods) != self.M or min(self.learner_periods) < 1
                                                 or self.mode not in ("decoupled", "streaming")):
            raise ValueError(f"learner_periods needs {self.M} values >= 1, in decoupled or streaming mode, "
                             f"got {self.learner_periods} in {self.mode}")
        if self.step_times is not None and len(self.step_times) != self.M:
            raise ValueError(f"step_times needs {self.M} values, got {len(self.step_times)}")
        if self.byzantine not in BYZANTINE:
            raise ValueError(f"byzantine must be one of {BYZANTINE}, got {self.byzantine!r}")
        if self.incarnations is not None and len(self.incarnations) != self.M:
            raise ValueError(f"incarnations needs {self.M} values, got {len(self.incarnations)}")


def run_steps(cfg: RefConfig) -> int:
    """Inner steps of the whole run: every learner's (dp: its own steps)."""
    if cfg.mode == "dp":
        return cfg.steps
    return sum(cfg.learner_steps) if cfg.learner_steps else cfg.steps * cfg.M


def quorum(cfg: RefConfig) -> int:
    if cfg.mode in ("sync", "streaming"):
        return cfg.M
    return cfg.M if cfg.K is None else cfg.K


def failure_trace(seed: int, M: int, horizon: float, rate: float, mean_down: float) -> tuple[tuple[int, float, float], ...]:
    """A seeded fault trace: per learner, failures as a Poisson process of ``rate`` per virtual second
    over ``horizon``, each down for an exponential time of mean ``mean_down``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    out = []
    for m in range(M):
        t = 0.0
        while True:
            t += float(rng.exponential(1.0 / rate)) if rate > 0 else horizon
            if t >= horizon:
                break
            d = float(rng.exponential(mean_down))
            out.append((m, round(t, 3), round(t + d, 3)))
            t += d
    return tuple(sorted(out, key=lambda x: (x[1], x[0])))
