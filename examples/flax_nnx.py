"""A Flax NNX model through the island API: an MLP with Dropout, as NNX users write it.

The model is an ``nnx.Module`` whose ``nnx.Dropout(rngs=...)`` holds a typed PRNG key
(``key<fry>``) and a ``uint32`` count. The island takes the tree as NNX makes it: the state of
``graphdef, state = nnx.split(model)`` (``--tree state``, the usual functional NNX path) or the
module itself (``--tree module``; NNX modules are pytrees in Flax 0.12), both describe the same
run. The float leaves (``nnx.Param``) are synchronised; the dropout key and count stay on each
island (each island seeds its own dropout stream) and are never sent.

Run two islands against a NATS server and an aggregator started with ``DILOCO_MODEL=run``::

    diloco nats &                                       # or any JetStream server
    DILOCO_RUN=nnx DILOCO_MODEL=run DILOCO_REQUIRE_MEMBERSHIP=false diloco aggregator &
    python examples/flax_nnx.py --island a --tree module &
    python examples/flax_nnx.py --island b --mode train
    DILOCO_RUN=nnx diloco export --out nnx.npz

and load the result into the model as you build it::

    graphdef, like = nnx.split(make_model())
    model = nnx.merge(graphdef, load_params("nnx.npz", like))   # the key and count are like's

``tests/test_frameworks.py`` runs exactly this and checks that the held-out loss falls and that
the exported model, loaded back, holds the run's values and ``like``'s own key.
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


def _model_class():
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs):
            self.hidden1 = nnx.Linear(3, width, rngs=rngs)
            self.hidden2 = nnx.Linear(width, width, rngs=rngs)
            self.drop = nnx.Dropout(0.05, rngs=rngs)  # its key and count: local leaves
            self.out = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x, train: bool = False):
            h = jnp.tanh(self.hidden1(x))
            h = self.drop(jnp.tanh(self.hidden2(h)), deterministic=not train)
            return self.out(h)

    return MLP


def make_model(seed: int = 0, width: int = 32, dropout_seed: int = 0):
    """The NNX module: weights from ``seed`` (the run takes the creator's), dropout from ``dropout_seed``."""
    from flax import nnx

    return _model_class()(width, nnx.Rngs(params=seed, dropout=dropout_seed))


def split(model):
    """``(graphdef, state)``: the state is the tree an island takes."""
    from flax import nnx

    return nnx.split(model)


def loss_fn(model, x, y, train: bool = False):
    import jax.numpy as jnp

    return jnp.mean((model(x, train=train) - y) ** 2)


def held_out_loss(graphdef, tree, x, y) -> float:
    """The loss of ``tree`` (a state or a module), dropout off."""
    from flax import nnx

    model = tree if isinstance(tree, nnx.Module) else nnx.merge(graphdef, tree)
    return float(loss_fn(model, x, y))


def trainable(state):
    """The ``nnx.Param`` part of the state: what the optimizer and the gradient see."""
    from flax import nnx

    return state.filter(nnx.Param)


def make_train_step(graphdef, optimizer):
    """``train_step(state, opt_state, batch) -> (state, opt_state, loss)``: functional NNX (merge,
    step, split back), so the state handed to the island is never changed in place."""
    import jax
    import optax
    from flax import nnx

    @jax.jit
    def train_step(state, opt_state, batch):
        x, y = batch
        model = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, x, y, train=True))(model)
        params = nnx.state(model, nnx.Param)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        return nnx.state(model), opt_state, loss  # the dropout count moved on: local to this island

    return train_step


def batches(seed: int, batch: int = 64):
    x, y = make_data(seed, 4096)
    rng = np.random.default_rng(seed + 1)
    while True:
        idx = rng.integers(0, len(x), batch)
        yield x[idx], y[idx]


def main(argv=None) -> int:
    import optax
    from flax import nnx

    from learner.island import Island

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--island", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--mode", choices=("hook", "train"), default="hook")
    p.add_argument("--tree", choices=("state", "module"), default="state",
                   help="hand the island the nnx.State of nnx.split(model), or the module itself")
    p.add_argument("--sync-every", type=int, default=20)
    a = p.parse_args(argv)
    seed = sum(map(ord, a.island))
    lr = 3e-3
    optimizer = optax.adamw(lr, weight_decay=0.0)
    graphdef, state = split(make_model(dropout_seed=seed))  # same weights everywhere, own dropout
    train_step = make_train_step(graphdef, optimizer)
    held_x, held_y = make_data(12345, 1024)
    tree = nnx.merge(graphdef, state) if a.tree == "module" else state
    island = Island(tree, learner_id=a.island, tokens_per_step=64, max_inner_lr=lr,
                    sync_every=a.sync_every, num_fragments=4)
    params = island.params
    opt_state = optimizer.init(trainable(nnx.state(params) if a.tree == "module" else params))
    print(f"island {a.island}: joined, held-out loss {held_out_loss(graphdef, params, held_x, held_y):.4f}",
          flush=True)
    if a.mode == "train":
        if a.tree == "module":
            raise SystemExit("--mode train takes the state (--tree state): its train step is functional")
        params, opt_state = island.train(train_step, opt_state, batches(seed), steps=a.steps)
    else:
        for _, batch in zip(range(a.steps), batches(seed)):
            state = nnx.state(params) if a.tree == "module" else params
            state, opt_state, loss = train_step(state, opt_state, batch)
            params = island.step(nnx.merge(graphdef, state) if a.tree == "module" else state, loss=float(loss))
        island.close()
    st = island.stats  # what became of the work: final once closed
    print(f"island {a.island}: done, {island.step_count} steps, held-out loss "
          f"{held_out_loss(graphdef, params, held_x, held_y):.4f}; rounds sent {st['sent']}, merged "
          f"{st['merged']}, rejected {st['rejected_total']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
