"""A second model through the island API: an MLP regressing y = sin(3 x0) + x1 * x2 + noise.

Another architecture (a 2-hidden-layer MLP with a bfloat16 output layer and an int32 step counter
that is never synced) and another task (regression on data it makes, each island its own slice).
Run two islands against a NATS server and an aggregator started with ``DILOCO_MODEL=run``::

    diloco nats &                                       # or any JetStream server
    DILOCO_RUN=reg DILOCO_MODEL=run diloco aggregator &   # it embeds the membership monitor
    python examples/regression.py --island a --steps 600 &
    python examples/regression.py --island b --steps 600
    DILOCO_RUN=reg diloco export --out reg.npz

``tests/test_island.py`` runs exactly this and checks that the held-out loss falls and that the
exported model, loaded back, gives the loss this script reports.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def make_data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(n, 3)).astype(np.float32)
    y = (np.sin(3 * x[:, 0]) + x[:, 1] * x[:, 2] + 0.05 * rng.standard_normal(n)).astype(np.float32)
    return x, y[:, None]


def init_params(seed: int = 0, width: int = 32):
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "hidden": [
            {"w": jax.random.normal(k1, (3, width)) * 0.5, "b": jnp.zeros(width)},
            {"w": jax.random.normal(k2, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)},
        ],
        "out": {"w": (jax.random.normal(k3, (width, 1)) / np.sqrt(width)).astype(jnp.bfloat16),
                "b": jnp.zeros(1, jnp.bfloat16)},
        "seen": jnp.zeros((), jnp.int32),  # not a float: stays on each island
    }


def predict(params, x):
    import jax.numpy as jnp

    h = x
    for layer in params["hidden"]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return h @ params["out"]["w"].astype(jnp.float32) + params["out"]["b"].astype(jnp.float32)


def loss_fn(params, x, y):
    import jax.numpy as jnp

    return jnp.mean((predict(params, x) - y) ** 2)


def trainable(params):
    """The float part of the tree: what the optimizer and the gradient see."""
    return {"hidden": params["hidden"], "out": params["out"]}


def make_train_step(optimizer):
    import jax
    import optax

    @jax.jit
    def train_step(params, opt_state, batch):
        x, y = batch
        t = trainable(params)
        loss, grads = jax.value_and_grad(loss_fn)(t, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, t)
        t = optax.apply_updates(t, updates)
        return {**t, "seen": params["seen"] + 1}, opt_state, loss

    return train_step


def batches(seed: int, batch: int = 64):
    x, y = make_data(seed, 4096)
    rng = np.random.default_rng(seed + 1)
    while True:
        idx = rng.integers(0, len(x), batch)
        yield x[idx], y[idx]


def main(argv=None) -> int:
    import optax

    from learner.island import Island

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--island", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--mode", choices=("hook", "train"), default="hook")
    a = p.parse_args(argv)
    seed = sum(map(ord, a.island))
    lr = 3e-3
    optimizer = optax.adamw(lr, weight_decay=0.0)
    train_step = make_train_step(optimizer)
    held_x, held_y = make_data(12345, 1024)
    island = Island(init_params(), learner_id=a.island, tokens_per_step=64, max_inner_lr=lr,
                    sync_every=20, num_fragments=4)
    params = island.params
    opt_state = optimizer.init(trainable(params))
    print(f"island {a.island}: joined, held-out loss {float(loss_fn(params, held_x, held_y)):.4f}", flush=True)
    if a.mode == "train":
        params, opt_state = island.train(train_step, opt_state, batches(seed), steps=a.steps)
    else:
        for _, batch in zip(range(a.steps), batches(seed)):
            params, opt_state, loss = train_step(params, opt_state, batch)
            params = island.step(params, loss=float(loss))
        island.close()
    st = island.stats  # what became of the work: final once closed
    m = island.metrics()
    print(f"island {a.island}: done, {island.step_count} steps, held-out loss "
          f"{float(loss_fn(params, held_x, held_y)):.4f}; rounds sent {st['sent']}, merged {st['merged']}, "
          f"rejected {st['rejected_total']}; syncs deferred {m.get('deferred_syncs')}, sent by the valve "
          f"{m.get('window_valve')}, staleness {m.get('staleness')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
