"""An Equinox model through the island API: an ``eqx.nn.MLP`` handed to the island as it is.

An Equinox module is a pytree whose leaves are its arrays *and* its other fields: ``eqx.nn.MLP``
holds its activation functions (``jax.nn.relu`` is a ``custom_jvp``) as leaves. No
``eqx.partition`` is needed: the island synchronises the float arrays and keeps every other leaf
(functions, Python scalars, PRNG keys) on each island, never sent. The train step is the usual
``eqx.filter_jit`` / ``eqx.filter_value_and_grad`` / ``eqx.apply_updates`` one.

(The file is not named ``equinox.py``: run as a script, that name would shadow the package.)

Run two islands against a NATS server and an aggregator started with ``DILOCO_MODEL=run``::

    diloco nats &                                       # or any JetStream server
    DILOCO_RUN=eqx DILOCO_MODEL=run DILOCO_REQUIRE_MEMBERSHIP=false diloco aggregator &
    python examples/equinox_mlp.py --island a &
    python examples/equinox_mlp.py --island b --mode train
    DILOCO_RUN=eqx diloco export --out eqx.npz

and load the result into the model as you build it: ``load_params("eqx.npz", make_model())``
(its activation functions are the very ones of the model you pass).

``tests/test_frameworks.py`` runs exactly this and checks that the held-out loss falls and that
the exported model, loaded back, holds the run's values and the functions of ``like``.
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


def make_model(seed: int = 0, width: int = 32):
    import equinox as eqx
    import jax

    # activation and final_activation are leaves of the module (functions): local to each island
    return eqx.nn.MLP(3, 1, width, 2, activation=jax.nn.relu, key=jax.random.key(seed))


def loss_fn(model, x, y):
    import jax
    import jax.numpy as jnp

    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def trainable(model):
    """The array part of the module: what the optimizer sees."""
    import equinox as eqx

    return eqx.filter(model, eqx.is_array)


def make_train_step(optimizer):
    import equinox as eqx

    @eqx.filter_jit
    def train_step(model, opt_state, batch):
        x, y = batch
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, trainable(model))
        return eqx.apply_updates(model, updates), opt_state, loss

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
    p.add_argument("--sync-every", type=int, default=20)
    a = p.parse_args(argv)
    seed = sum(map(ord, a.island))
    lr = 3e-3
    optimizer = optax.adamw(lr, weight_decay=0.0)
    train_step = make_train_step(optimizer)
    held_x, held_y = make_data(12345, 1024)
    island = Island(make_model(), learner_id=a.island, tokens_per_step=64, max_inner_lr=lr,
                    sync_every=a.sync_every, num_fragments=4)
    model = island.params  # an eqx.nn.MLP, the run's current weights
    opt_state = optimizer.init(trainable(model))
    print(f"island {a.island}: joined, held-out loss {float(loss_fn(model, held_x, held_y)):.4f}", flush=True)
    if a.mode == "train":
        model, opt_state = island.train(train_step, opt_state, batches(seed), steps=a.steps)
    else:
        for _, batch in zip(range(a.steps), batches(seed)):
            model, opt_state, loss = train_step(model, opt_state, batch)
            model = island.step(model, loss=float(loss))
        island.close()
    st = island.stats  # what became of the work: final once closed
    print(f"island {a.island}: done, {island.step_count} steps, held-out loss "
          f"{float(loss_fn(model, held_x, held_y)):.4f}; rounds sent {st['sent']}, merged {st['merged']}, "
          f"rejected {st['rejected_total']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
