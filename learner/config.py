"""Settings of the model (shared by every role of a run) and of a learner, from ``DILOCO_*``."""

from __future__ import annotations

from dataclasses import dataclass

from bus import codec, sparse
from bus.config import boolean, choice, integer, number, register, text, token, var


#: the built-in model's peak AdamW learning rate at d_model 64 (measured: data-parallel sweeps,
#: docs/learner.md "Defaults")
AUTO_LR_AT_64 = 0.008
#: Muon's default rate is AdamW's times the learners expected over 2, from 1 to this (measured: data-parallel
#: and Decoupled DiLoCo sweeps at M = 2, 4, 8, docs/BENCHMARKS.md "Thirteenth round")
MUON_LR_SCALE_MAX = 3.0
INNER_OPTIMIZERS = ("adamw", "muon")


def auto_inner_lr(d_model: int, optimizer: str, learners: int) -> float:
    """The built-in model's default peak learning rate: AdamW 0.008 at d_model <= 64, then 1/width
    (0.004 at 128, the default model); Muon that times ``learners`` / 2, at least 1 and at most
    ``MUON_LR_SCALE_MAX`` (``learners``: DILOCO_NUM_LEARNERS, the islands expected). DiLoCo's best
    Muon rate rose with M at 20 tokens per parameter, where a learner's steps fall as M grows (it
    follows both). Swept at width 64 (Muon; AdamW at 64 and 128), two rates tried at 96; wider models
    follow the 1/width rule of Adam on transformers (Muon's update is scaled to AdamW's RMS), not a
    measurement here."""
    if optimizer not in INNER_OPTIMIZERS:
        raise ValueError(f"inner optimizer must be one of {INNER_OPTIMIZERS}, got {optimizer!r}")
    rate = AUTO_LR_AT_64 * min(1.0, 64.0 / max(1, int(d_model)))
    if optimizer == "muon":
        rate *= min(MUON_LR_SCALE_MAX, max(1.0, int(learners) / 2))
    return rate


def warmup_for(warmup_steps: int, total_steps: int, fraction: float) -> int:
    """``warmup_steps`` if >= 0, else ``fraction`` of ``total_steps`` (rounded down, below the total)."""
    if warmup_steps >= 0:
        return warmup_steps
    return max(0, min(int(fraction * total_steps), total_steps - 1))


@register("model")
@dataclass(frozen=True)
class ModelConfig:
    """The built-in model's architecture and the run's fragmentation. Whoever creates a built-in run
    (a learner, ``diloco run create``, ``diloco up``) makes version 0 and the manifest from them;
    learners refuse to start when their hash differs. The aggregator and the monitor need none of
    them: they follow the run's manifest."""

    model: str = var("builtin", choice("builtin", "run"),
                     "`diloco aggregator` with builtin: create a run of the built-in transformer (the variables "
                     "below) if there is none; run: only follow what the run's creator made (an island, `diloco "
                     "run create --init`). The aggregator itself merges whatever the manifest describes")
    d_model: int = var(128, integer(8, 65536), "model width")
    n_layers: int = var(4, integer(1, 1024), "transformer blocks")
    n_heads: int = var(4, integer(1, 1024), "attention heads (must divide DILOCO_D_MODEL)")
    d_ff: int = var(512, integer(8, 1 << 20), "MLP hidden width")
    seq_len: int = var(128, integer(8, 1 << 16), "context length in tokens")
    tied_embeddings: bool = var(True, boolean(), "share input embedding and output projection")
    seed: int = var(0, integer(0, 2**31 - 1), "seed of the initial parameters (version 0)")
    num_fragments: int = var(8, integer(1, 4096), "fragments P the parameters are split into")
    max_imbalance: float = var(1.1, number(1.0, 2.0), "largest fragment over the ideal size (<= 4/3)")
    max_inner_lr: float = var(0.03, number(0.0, 10.0, lo_open=True),
                              "declared in the manifest: the highest peak inner learning rate any learner may use; "
                              "bounds the norm of an outer gradient (set it to your peak DILOCO_INNER_LR)")
    max_batch_size: int = var(1024, integer(1, 1 << 20),
                              "declared in the manifest: the most sequences one inner step of any learner may use "
                              "(x DILOCO_SEQ_LEN bounds the tokens a contribution may claim per step)")

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"DILOCO_D_MODEL={self.d_model} must be divisible by DILOCO_N_HEADS={self.n_heads}")

    @property
    def max_tokens_per_step(self) -> int:
        return self.max_batch_size * self.seq_len

    def spec(self):
        from learner.spec import ModelSpec

        return ModelSpec(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, d_ff=self.d_ff,
                         seq_len=self.seq_len, tied_embeddings=self.tied_embeddings)


@register("learner")
@dataclass(frozen=True)
class LearnerConfig:
    learner_id: str = var("learner-0", token(), "this learner's id (unique in the run; a subject token)")
    mode: str = var("async", choice("async", "sync", "synthetic"),
                    "async: Decoupled DiLoCo; sync: wait for the version with our contribution; "
                    "synthetic: sleep DILOCO_STEP_TIME per step with pseudo-gradients (system tests)")
    compute: str = var("model", choice("model", "synthetic"),
                       "model: the JAX transformer; synthetic: sleep DILOCO_STEP_TIME per step with pseudo-gradients "
                       "(any mode; DILOCO_MODE=synthetic is async + synthetic)")
    sync_every: int = var(12, integer(1, 1_000_000), "H: inner steps between two syncs of the same fragment")
    sync_window: int = var(1, integer(0, 1_000_000),
                           "rounds of a fragment sent and not yet merged into this learner's base before its next sync "
                           "of that fragment is deferred (the steps go out with the deferred sync; bounds staleness "
                           "when the aggregator falls behind; 0: never defer)")
    sync_hold: int = var(1, integer(0, 1_000_000),
                         "periods a sync deferred by the window may wait before this learner holds its inner steps "
                         "until the aggregator merged its previous round (at most DILOCO_SYNC_TIMEOUT s; then it "
                         "trains on): a lagging aggregator costs speed, not the model (0: never hold)")
    phase_lock: float = var(1.0, number(0.0, 1.0),
                            "the phase lock: the share of its lead over the other learners' phase of the round at the "
                            "aggregator (each merge's head states it) by which this learner moves its syncs per round, "
                            "so that the learners' rounds reach the aggregator together, whenever each started and "
                            "however its period was set (0: off; not in DILOCO_MODE=sync)")
    on_arrival: str = var("rebase", choice("rebase", "mix"),
                          "rebase: theta <- global + (theta - base), keeping local progress since the last sync; "
                          "mix: theta <- a*theta + (1-a)*global (DILOCO_MIX_ALPHA)")
    mix_alpha: float = var(0.0, number(0.0, 0.999), "DILOCO_ON_ARRIVAL=mix: weight a of the local parameters (0 overwrites)")
    fetch: str = var("round", choice("round", "every"),
                     "round: download a fragment once per own sync, the newest version DILOCO_FETCH_DELAY steps "
                     "after it; every: each new version (sync mode always does)")
    fetch_delay: int = var(1, integer(-1), "fetch=round: inner steps from a sync to the download, at the earliest, of "
                           "the version that holds the round just sent (-1: H/4, the default before the fourteenth round)")
    final_sync: bool = var(True, boolean(), "on reaching the step budget, send every fragment's unsent steps before exiting")
    final_wait: float = var(30.0, number(0.0, 86400),
                            "after the final sync, seconds to wait until the aggregator merged (or rejected) every "
                            "outer gradient sent, then say what became of them (0: do not wait)")
    warn_unadmitted_after: float = var(10.0, number(0.1, 86400),
                                       "warn when the monitor has not admitted this learner this many seconds after "
                                       "its first outer gradient (its work is held, then rejected)")
    dynamic_h: bool = var(True, boolean(),
                          "Dynamic Local Updates: sync every v / v_max x H steps, a real number (v: the pace of the active "
                          "learners, tokens/s of their inner steps, from the members bucket a monitor keeps), so a "
                          "slower learner's round lasts as long as the fastest's; H without a monitor, at equal paces "
                          "and in DILOCO_MODE=sync (its rounds wait for every learner anyway)")
    quantiser: str = var("int8", choice(*codec.CODECS), "outer-gradient codec: a dense quantiser, or topk2 / topk4 "
                         "(the DILOCO_TOPK_K largest of each DILOCO_TOPK_CHUNK values, 2 or 4 bits each, the rest "
                         "kept by error feedback)")
    error_feedback: bool = var(True, boolean(), "keep the quantisation residual and add it to the next sync")
    residual_dtype: str = var("auto", choice("auto", *codec.STORAGE_DTYPES),
                              "dtype of the error-feedback residual kept per fragment (auto: bfloat16 for a dense "
                              "quantiser and 3 or more fragments, half the memory of float32; float32 for the topk "
                              "codecs and 1-2 fragments)")
    feedback_decay: float = var(1.0, number(0.0, 1.0), "error-feedback decay: the residual kept is multiplied by "
                                "this before it joins the next outer gradient (SparseLoCo used 0.95)")
    topk_chunk: int = var(sparse.DEFAULT_CHUNK, integer(2, sparse.MAX_CHUNK), "topk codecs: values per chunk")
    topk_k: int = var(sparse.DEFAULT_K, integer(1, sparse.MAX_CHUNK), "topk codecs: values sent per chunk "
                      "(64 of 4096: 1.56%)")
    batch_size: int = var(16, integer(1, 1 << 20), "sequences per inner step")
    inner_lr: float = var(0.0, number(0.0, 10.0), "peak inner learning rate of the built-in model (0: by its width, "
                          "inner optimizer and learners: AdamW 0.008 x 64 / DILOCO_D_MODEL at most 0.008, Muon that x "
                          "DILOCO_NUM_LEARNERS / 2 between 1 and 3; an island's optimizer is its own)",
                          show=lambda v: v or "auto")
    warmup_steps: int = var(-1, integer(-1), "linear warm-up steps (-1: DILOCO_WARMUP_FRACTION of DILOCO_TOTAL_STEPS)")
    warmup_fraction: float = var(0.1, number(0.0, 0.9), "warm-up as a share of the schedule, when DILOCO_WARMUP_STEPS "
                                 "is -1 (DiLoCo needs a longer one than data-parallel: docs/learner.md)")
    total_steps: int = var(1000, integer(1), "steps of the cosine schedule (and the run, unless DILOCO_MAX_STEPS)")
    max_steps: int = var(0, integer(0), "stop after this many inner steps (0: DILOCO_TOTAL_STEPS)")
    inner_optimizer: str = var("muon", choice(*INNER_OPTIMIZERS), "the built-in model's inner optimizer: muon (Muon on "
                               "the hidden matrices at AdamW's update RMS, AdamW on the rest: learner.inner; "
                               "docs/learner.md, Defaults) or adamw; an island's optimizer is its own")
    muon_rms: float = var(0.2, number(0.01, 1.0), "Muon's update RMS per hidden matrix, as a share of the inner "
                          "learning rate (0.2: AdamW's typical update RMS, so the same rate; DILOCO_INNER_OPTIMIZER=muon)")
    weight_decay: float = var(0.1, number(0.0, 10.0), "AdamW weight decay")
    clip_norm: float = var(1.0, number(0.0), "global gradient-norm clip (0: off)")
    data: str = var("", text(), "corpus: empty = Python stdlib sources; a text file/folder; or a uint16 .bin")
    data_max_bytes: int = var(8 * 1024 * 1024, integer(1024), "bytes of the corpus to load")
    data_seed: int = var(0, integer(0, 2**31 - 1), "seed of this learner's batch sampling")
    resume: bool = var(True, boolean(),
                       "a learner started with an id that trained in this run before resumes where the run holds its "
                       "work: step, learning-rate schedule, remaining budget, data position (false: start over)")
    resume_warmup: int = var(50, integer(0, 1_000_000),
                             "a resumed learner's fresh AdamW: ramp its learning rate up linearly over this many steps "
                             "to the schedule's rate at its step (0: at once; bench.restart measured 50 against 0)")
    shard_index: int = var(-1, integer(-1), "this learner's data shard (-1: derived from DILOCO_LEARNER_ID)")
    num_shards: int = var(0, integer(0), "data shards (0: DILOCO_NUM_LEARNERS)")
    num_learners: int = var(4, integer(1, 100_000), "learners expected in the run (for data sharding, and the "
                            "built-in model's default Muon rate: DILOCO_INNER_LR)")
    heartbeat_interval: float = var(1.0, number(0.05, 60), "seconds between heartbeats")
    step_time: float = var(0.05, number(0.0, 3600), "synthetic mode: seconds per inner step")
    slowdown: float = var(1.0, number(1.0, 1000), "emulate slower hardware: each step takes this factor longer "
                          "(the factor stretches the machine's scheduling noise too: DILOCO_MIN_STEP_TIME keeps one pace)")
    min_step_time: float = var(0.0, number(0.0, 3600),
                               "emulate hardware of a set speed: each inner step takes at least this many seconds, "
                               "what is left of it waited out, so the steps keep one pace whatever the machine's "
                               "load (0: off; built-in model only)")
    sync_timeout: float = var(120.0, number(0.1), "sync mode: seconds to wait for the merged version; async mode: "
                              "the longest hold (DILOCO_SYNC_HOLD)")
    start_with: int = var(0, integer(0, 100_000),
                          "before the first inner step, wait until this many learners (this one included) are active "
                          "in the run, so they start in step (0: start at once; needs a monitor)")
    start_wait: float = var(300.0, number(0.0, 86400), "DILOCO_START_WITH: seconds to wait before starting anyway")
    manifest_timeout: float = var(300.0, number(0.1), "seconds to wait at start for the run's manifest (its creator)")
    create_run: bool = var(True, boolean(),
                           "create the run if it has none (version 0 of the built-in model from DILOCO_SEED; an "
                           "island: its own parameters); false under auth, where only the aggregator may write version 0 "
                           "(`diloco auth init` writes false into learners' env files)")

    def __post_init__(self) -> None:
        if self.topk_k > self.topk_chunk:
            raise ValueError(f"DILOCO_TOPK_K={self.topk_k} must be <= DILOCO_TOPK_CHUNK={self.topk_chunk}")
        if not self.synthetic and self.warmup >= self.total_steps:
            raise ValueError(f"DILOCO_WARMUP_STEPS={self.warmup_steps} must be < DILOCO_TOTAL_STEPS={self.total_steps}")

    @property
    def follows_pace(self) -> bool:
        """Dynamic Local Updates in force: DILOCO_DYNAMIC_H, and a mode with a period of its own to set
        (synchronous rounds wait for every learner, and their learners must stay in phase)."""
        return self.dynamic_h and self.mode != "sync"

    def lr_for(self, d_model: int | None, learners: int | None = None) -> float:
        """The peak inner learning rate in force: DILOCO_INNER_LR, or (0) the built-in model's by its
        width, inner optimizer and ``learners`` (DILOCO_NUM_LEARNERS unless given; :func:`auto_inner_lr`);
        0 when there is no built-in model (an island: its own optimizer)."""
        if self.inner_lr > 0:
            return self.inner_lr
        n = self.num_learners if learners is None else learners
        return auto_inner_lr(d_model, self.inner_optimizer, n) if d_model else 0.0

    @property
    def warmup(self) -> int:
        """Warm-up steps in force: DILOCO_WARMUP_STEPS, or DILOCO_WARMUP_FRACTION of the schedule."""
        return warmup_for(self.warmup_steps, self.total_steps, self.warmup_fraction)

    @property
    def synthetic(self) -> bool:
        """Synthetic compute (no JAX): DILOCO_MODE=synthetic or DILOCO_COMPUTE=synthetic."""
        return self.mode == "synthetic" or self.compute == "synthetic"

    def fetch_delay_for(self, period: float) -> int:
        """DILOCO_FETCH_DELAY (default 1), or period/4 (at least 1) when it is -1."""
        return self.fetch_delay if self.fetch_delay >= 0 else max(1, int(period) // 4)

    @property
    def steps_to_run(self) -> int:
        """Inner steps this process runs before it stops: DILOCO_MAX_STEPS, else DILOCO_TOTAL_STEPS."""
        return self.max_steps or self.total_steps


@register("eval")
@dataclass(frozen=True)
class EvalConfig:
    """The evaluator (``diloco eval``): held-out loss of the newest global model.

    It reads the corpus settings of the learners (``DILOCO_DATA``, ``DILOCO_DATA_MAX_BYTES``), so
    its held-out split is the one no learner trains on: give it the same values as the learners.
    """

    eval_id: str = var("eval-0", token(), "the evaluator's id (metrics subject token)")
    eval_interval: float = var(10.0, number(0.05, 86400), "seconds between evaluations (only when versions changed)")
    eval_batches: int = var(4, integer(1, 100_000), "held-out batches per evaluation")
    eval_batch_size: int = var(16, integer(1, 1 << 20), "sequences per held-out batch")
