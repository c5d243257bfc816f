"""A classifier through the island API: an MLP on scikit-learn's handwritten digits (8 x 8 images).

A data set that a package ships (``sklearn.datasets.load_digits``: 1,797 images, 10 classes), split
once into a training part and a held-out part; each island trains on its own shard of the training
part, as islands in different regions would hold different data. Run two islands against a NATS
server and an aggregator started with ``DILOCO_MODEL=run``::

    diloco nats &                                       # or any JetStream server
    DILOCO_RUN=digits DILOCO_MODEL=run DILOCO_REQUIRE_MEMBERSHIP=false diloco aggregator &
    python examples/digits.py --island 0 --of 2 --steps 500 &
    python examples/digits.py --island 1 --of 2 --steps 500
    DILOCO_RUN=digits diloco export --out digits.npz

``python -m bench.collab`` trains it (and ``examples/regression.py``) as one island alone, as two
islands, and as one process over all the data, to check that collaborating never hurts a model.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

HELDOUT = 397  # images kept aside (the rest, 1,400, are the training part)


def load(seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(train x, train y), (held-out x, held-out y): pixels scaled to [0, 1], one fixed shuffle."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return (x[HELDOUT:], y[HELDOUT:]), (x[:HELDOUT], y[:HELDOUT])


def shard(data: tuple[np.ndarray, np.ndarray], index: int, of: int) -> tuple[np.ndarray, np.ndarray]:
    """Island ``index``'s share of the training part (every ``of``-th example)."""
    x, y = data
    return x[index::of], y[index::of]


def init_params(seed: int = 0, width: int = 64):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": jax.random.normal(k1, (64, width)) / 8.0, "b1": jnp.zeros(width),
            "w2": jax.random.normal(k2, (width, 10)) / np.sqrt(width), "b2": jnp.zeros(10)}


def loss_fn(params, x, y):
    import jax
    import jax.numpy as jnp

    logits = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def accuracy(params, x, y) -> float:
    import jax

    logits = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return float(np.mean(np.asarray(logits).argmax(axis=1) == y))


def make_train_step(optimizer):
    import jax
    import optax

    @jax.jit
    def train_step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def batches(data: tuple[np.ndarray, np.ndarray], seed: int, batch: int = 32):
    x, y = data
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(x), batch)
        yield x[idx], y[idx]


def main(argv=None) -> int:
    import optax

    from learner.island import Island

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--island", type=int, required=True, help="this island's index (its data shard)")
    p.add_argument("--of", type=int, default=2, help="islands (shards of the training part)")
    p.add_argument("--steps", type=int, default=500)
    a = p.parse_args(argv)
    lr = 3e-3
    optimizer = optax.adamw(lr, weight_decay=0.0)
    train_step = make_train_step(optimizer)
    train, (hx, hy) = load()
    island = Island(init_params(), learner_id=f"digits-{a.island}", tokens_per_step=32, max_inner_lr=lr)
    params = island.params
    opt_state = optimizer.init(params)
    for _, batch in zip(range(a.steps), batches(shard(train, a.island, a.of), seed=100 + a.island)):
        params, opt_state, loss = train_step(params, opt_state, batch)
        params = island.step(params, loss=float(loss))
    island.close()
    print(f"island {a.island}: {island.step_count} steps, held-out loss {float(loss_fn(params, hx, hy)):.4f}, "
          f"accuracy {accuracy(params, hx, hy):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
