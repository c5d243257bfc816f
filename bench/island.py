"""The island hook's cost: time inside ``island.step`` per inner step, and the island's memory.

A plain-JAX MLP of about ``--params`` float32 parameters (50M by default, 5M with ``--quick``) in
8 fragments, trained with optax AdamW by the user's own jitted step; one island in hook mode on an
embedded server (it creates the run; no aggregator, so no version arrives: this measures the
outgoing side, which is the hook's per-step work in steady state plus one rebase per fragment
when versions do arrive, measured separately as ``rebase_s``).

* ``hook_overhead``: mean time inside ``island.step`` over the mean inner step time without an
  island (target <= 1%).
* ``loop_overhead``: (inner step + hook with the island) over the inner step without one, minus 1.
  On this CPU-only machine the island's background work (outer gradients, freeing the previous
  step's buffers) runs on the same 2 cores as XLA's inner step, so it slows the step itself; on an
  accelerator island that work runs on the host while the device computes. Both are reported.
* ``island_memory_over_params``: peak RSS of the user's loop with the island minus the peak RSS of
  the same loop alone over as many steps, over the parameter bytes (target <= 2: the base copies,
  1x, and the error-feedback residuals, 0.5x in bfloat16 since the fifteenth round, 1x in float32). Both peaks are taken after ``gc.collect()`` and a reset of the
  kernel's peak counter (``/proc/self/clear_refs``), so the loop's own garbage is the same in
  both. (The first version subtracted the RSS at rest: the loop alone holds up to 3x the
  parameter bytes of garbage between collections, which that figure counted against the island.)

* ``hook_s_sync_max``: the longest ``island.step`` on the step after one with a fragment due (the
  step that used to wait while the island prepared that fragment's outer gradient; an island now
  does that in its side thread from a snapshot of the step's leaves, ``learner.core``).
* ``arrival_hook_s_max``: the longest ``island.step`` while a new version of every fragment is
  swapped in. The versions are handed to the island's core as its download would (pending, swap
  queued: ``learner.swap``), and the user's loop keeps stepping until every fragment has taken its
  version (``arrival_steps``); target <= 0.1 s. ``rebase_all_fragments_s`` is the plain path's cost
  for comparison: a get, rebase and put of every fragment on the calling thread.
* ``island_cpu_s`` / ``island_cpu_share``: CPU seconds of the island's own threads (its asyncio
  loop, worker and side threads, from ``/proc/self/task``) over the steps with the island, and
  that over the wall time of those steps: the background work that competes with the user's step
  on a CPU-only machine (the embedded server is another process, not counted).
* ``--cheap-step``: the user's step is one elementwise pass over the parameters instead of the
  MLP's AdamW step: on this CPU the island's work per fragment is then as long as the step or
  longer, as it is beside an accelerator's short steps (a GPU's 21 ms step at 1B).

* ``call_us_nothing_due`` (median, and ``_p90``): the time inside ``island.step`` for a plain-JAX
  MLP of about 10k parameters trained by its own jitted step (about a millisecond), on steps where
  no fragment is due and nothing arrived (target <= 50 us): the step is taken and served in the
  user's thread while the island's worker is parked (``learner.backends.HookBackend.exchange``);
  ``fast_path_share`` is how many of those calls took that path (the others found the worker still
  busy with the previous step, and waited for it), ``fast_call_us`` their median.

    python -m bench.island --quick --out island.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import gc
import os
import tempfile
import threading
import time

import numpy as np

from bench.common import finish, parser, peak_rss_mib, progress


def reset_peak() -> None:
    """Reset the kernel's peak RSS counter of this process (Linux; VmHWM restarts from VmRSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:  # a kernel without it (gVisor): the peaks then count from the start
        progress(f"peak RSS not reset ({e!r}): the memory figures are peaks since the start")


def _mlp(width: int, seed: int) -> dict:
    """4 dense layers of width x width (plain JAX): the model of both measurements."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(seed)
    return {f"l{i}": {"w": jax.random.normal(jax.random.fold_in(key, i), (width, width)) / np.sqrt(width),
                      "b": jnp.zeros(width)} for i in range(4)}


TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(prefixes: tuple[str, ...]) -> float:
    """CPU seconds (user + system) of this process's live threads whose names start with one of
    ``prefixes``."""
    total = 0
    for t in threading.enumerate():
        if t.native_id is None or not t.name.startswith(prefixes):
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / TICK


def inject_arrivals(island, delta: float = 1e-3) -> int:
    """Hand the island's core a new version of every fragment (its base plus ``delta``), as its
    download would, in the core's loop thread. Returns how many."""
    lr = island.learner

    async def go() -> int:
        for p in range(lr.P):
            v = lr.book.frags[p].base_version + 1
            lr.pending[p] = (v, np.asarray(lr.base[p], dtype=np.float32) + np.float32(delta))
            if hasattr(lr, "_queue_swap"):
                lr._queue_swap(p)
        return lr.P

    return asyncio.run_coroutine_threadsafe(go(), island._loop).result(60)


def store_for(n_params: int, fragments: int = 8) -> int:
    """The embedded server's JetStream file store for a run of ``n_params``: the default, or what
    the run's streams reserve (sized from the model: 65 GiB at 1B parameters) and 5% more."""
    from bus.config import CommonConfig
    from bus.server import DEFAULT_MAX_FILE_STORE
    from bus.streams import Limits

    lim = Limits.for_run(CommonConfig(), [n_params // fragments] * fragments)
    return max(DEFAULT_MAX_FILE_STORE, int(sum(lim.reserved().values()) * 1.05))


def small_call_cost(url: str, steps: int = 400) -> dict:
    """island.step on a 10k-parameter model, no fragment due (H far beyond the steps), no arrivals."""
    import jax
    import jax.numpy as jnp
    import optax

    from learner.island import Island

    width = 50
    params = _mlp(width, 1)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    opt = optax.adamw(1e-3)
    st = opt.init(params)

    @jax.jit
    def train_step(pr, st, x):
        def loss_fn(pr):
            h = x
            for i in range(4):
                h = jnp.tanh(h @ pr[f"l{i}"]["w"] + pr[f"l{i}"]["b"])
            return jnp.mean(h ** 2)
        loss, g = jax.value_and_grad(loss_fn)(pr)
        u, st = opt.update(g, st, pr)
        return optax.apply_updates(pr, u), st, loss

    x = jnp.ones((64, width))
    params, st, loss = train_step(params, st, x)
    jax.block_until_ready(params)
    island = Island(params, run="bench-small", learner_id="s0", nats_url=url, sync_every=10 * steps,
                    num_fragments=4, max_inner_lr=1e-3, env={"DILOCO_LOG_LEVEL": "warning"})
    params = island.params
    hook, inner = [], []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            params, st, loss = train_step(params, st, x)
            jax.block_until_ready(params)
            t1 = time.perf_counter()
            before = island._backend.fast_steps
            params = island.step(params, loss=loss)  # a JAX scalar, as the README's loop passes it
            t2 = time.perf_counter()
            inner.append(t1 - t0)
            hook.append((t2 - t1, island._backend.fast_steps > before))
    finally:
        island.close(final_sync=False)
    calls = [h for h, _ in hook[20:]]  # after the first steps (compilation, joining)
    fast = [h for h, f in hook[20:] if f] or [float("nan")]
    return {"small_params": int(n), "small_inner_step_s": round(float(np.median(inner)), 6),
            "call_us_nothing_due": round(float(np.median(calls)) * 1e6, 1),
            "call_us_nothing_due_p90": round(float(np.percentile(calls, 90)) * 1e6, 1),
            "fast_path_share": round(sum(1 for _, f in hook[20:] if f) / len(calls), 3),
            "fast_call_us": round(float(np.median(fast)) * 1e6, 1)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--fragments", type=int, default=8)
    p.add_argument("--cheap-step", action="store_true",
                   help="the user's step is one elementwise pass over the parameters (an accelerator's ratio)")
    a = p.parse_args()
    target = 5e6 if a.quick else a.params
    steps = 24 if a.quick else a.steps

    import jax
    import jax.numpy as jnp
    import optax

    from bus.server import EmbeddedServer
    from learner.island import Island

    width = int(np.sqrt(target / 4))
    params = _mlp(width, 0)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)

    def loss_fn(pr, x):
        h = x
        for i in range(4):
            h = jnp.tanh(h @ pr[f"l{i}"]["w"] + pr[f"l{i}"]["b"])
        return jnp.mean(h ** 2)

    @jax.jit
    def train_step(pr, st, x):
        loss, g = jax.value_and_grad(loss_fn)(pr, x)
        u, st = opt.update(g, st, pr)
        return optax.apply_updates(pr, u), st, loss

    if a.cheap_step:
        @jax.jit
        def train_step(pr, st, x):  # noqa: F811 (the cheap step replaces the MLP's)
            new = jax.tree_util.tree_map(lambda w: w - 1e-4 * jnp.tanh(w), pr)
            return new, st, jnp.mean(x)

    x = jnp.ones((32, width))
    params, opt_state, loss = train_step(params, opt_state, x)  # compile
    jax.block_until_ready(params)

    def alone(k: int) -> list[float]:
        nonlocal params, opt_state
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            params, opt_state, loss = train_step(params, opt_state, x)
            jax.block_until_ready(params)
            out.append(time.perf_counter() - t0)
        return out

    gc.collect()
    reset_peak()
    t_inner = alone(steps)
    peak_alone = peak_rss_mib()
    progress(f"{n_params / 1e6:.1f}M params, inner step {np.mean(t_inner):.3f} s, peak alone {peak_alone:.0f} MiB")

    with tempfile.TemporaryDirectory() as tmp:
        srv = EmbeddedServer(store_dir=os.path.join(tmp, "store"), log_file=os.path.join(tmp, "nats.log"),
                             max_file_store=store_for(n_params))
        srv.start()
        try:
            gc.collect()
            reset_peak()
            island = Island(params, run="bench", learner_id="b0", nats_url=srv.url, sync_every=24,
                            num_fragments=a.fragments, max_inner_lr=1e-3, env={"DILOCO_LOG_LEVEL": "warning"})
            params = island.params
            ours = (f"island-{island.cfg.learner_id}", f"inner-{island.cfg.learner_id}",
                    f"side-{island.cfg.learner_id}")
            hook, inner, after_sync = [], [], []

            def begun(book=island.learner.book) -> int:  # syncs begun so far (a round advances when its
                return sum(f.next_round for f in book.frags)  # outer gradient is started)

            cpu0, wall0, rounds = thread_cpu_s(ours), time.perf_counter(), begun()
            for i in range(steps):
                t0 = time.perf_counter()
                params, opt_state, loss = train_step(params, opt_state, x)
                jax.block_until_ready(params)
                t1 = time.perf_counter()
                now = begun()  # a sync begun since the last call: this call is the one it could hold
                params = island.step(params, loss=float(loss))
                t2 = time.perf_counter()
                inner.append(t1 - t0)
                hook.append(t2 - t1)
                if now > rounds:
                    after_sync.append(t2 - t1)
                rounds = now
            island_cpu = thread_cpu_s(ours) - cpu0
            loop_wall = time.perf_counter() - wall0
            peak = peak_rss_mib()
            # a new version of every fragment arrives: the steps go on until each is swapped in
            merged0 = sum(f.base_version for f in island.learner.book.frags)
            arrived = inject_arrivals(island)
            arrival = []
            for _ in range(40):
                t0 = time.perf_counter()
                params, opt_state, loss = train_step(params, opt_state, x)
                jax.block_until_ready(params)
                t1 = time.perf_counter()
                params = island.step(params, loss=float(loss))
                arrival.append(time.perf_counter() - t1)
                if sum(f.base_version for f in island.learner.book.frags) >= merged0 + arrived:
                    break
            # the plain path for comparison: a get, rebase and put of every fragment on this thread
            t0 = time.perf_counter()
            for p in range(island.learner.P):
                island._tree.set_fragment(p, island._tree.get_fragment(p))
            rebase = time.perf_counter() - t0
            island.close(final_sync=False)
            del island
            t_inner += alone(6)  # the step alone again, after: the machine's drift
            small = small_call_cost(srv.url, 200 if a.quick else 400)
            progress(str(small))
        finally:
            srv.close()
    res = {"params": int(n_params), "fragments": a.fragments, "steps": steps, "cheap_step": a.cheap_step,
           "inner_step_s": round(float(np.mean(inner)), 5), "hook_s_mean": round(float(np.mean(hook)), 6),
           "hook_s_max": round(float(np.max(hook)), 6), "hook_s": [round(h, 4) for h in hook],
           "hook_s_sync_max": round(float(np.max(after_sync)), 6) if after_sync else None,
           "arrival_steps": len(arrival), "arrival_hook_s_max": round(float(np.max(arrival)), 4),
           "arrival_hook_s": [round(h, 4) for h in arrival],
           "island_cpu_s": round(island_cpu, 2), "island_cpu_share": round(island_cpu / loop_wall, 4),
           "inner_step_alone_s": round(float(np.mean(t_inner)), 5),
           "hook_overhead": round(float(np.mean(hook) / np.mean(t_inner)), 5),
           "loop_overhead": round(float((np.mean(inner) + np.mean(hook)) / np.mean(t_inner) - 1), 4),
           "rebase_all_fragments_s": round(rebase, 4),
           "peak_alone_mib": round(peak_alone, 1), "peak_island_mib": round(peak, 1),
           "island_memory_over_params": round((peak - peak_alone) * 2**20 / (4 * n_params), 3), **small}
    finish(res, a.out)


if __name__ == "__main__":
    main()
