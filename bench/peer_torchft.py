"""One torchft replica group (one process, rank 0 of 1) for ``bench.peers``; runs in the PEER venv.

This file imports torch and torchft, which are not dependencies of the project: ``bench.peers``
builds a venv with the CPU torch and torchft and starts this file with that venv's python. Nothing
in the project imports it.

A replica is what torchft's own DiLoCo example builds (torchft/_test/diloco_trainer.py): its own
``TCPStore``, a ``Manager`` (``use_async_quorum=False``, as DiLoCo requires; ``init_sync=False``, so
step 0 needs no state copy) over ``ProcessGroupGloo``, and ``DiLoCo(manager, fragments, inner,
outer, sync_every=H)``: Streaming DiLoCo, one fragment synced every H/P inner steps, each fragment
every H. Two kinds of compute:

* ``synthetic``: P fragments of ``--params``/P float32 values; an inner step sleeps
  ``--step-time`` and takes an SGD step on a random gradient (bench.goodput's synthetic learners
  sleep the same and move real fragment vectors);
* ``model``: the project's built-in transformer, written again in PyTorch with the same parameter
  names and shapes (``learner/model.py``), from the same version-0 parameters (``--init``, an
  ``.npz`` the parent writes), on batches the parent cut from the same corpus (``--data``), with
  the learners' AdamW settings and schedule and the aggregator's outer Nesterov.

Events go to ``--events`` as JSON lines (wall time ``t``): ``ready`` (the manager is up), ``step``
(the first inner step), ``sync`` (each fragment sync: ``frag``, ``commit``, ``steps`` = inner steps
this process took since that fragment's previous sync attempt, ``mstep`` = the manager's step
before it, ``part`` = whether this replica's pseudo-gradient was in the allreduce, ``n`` = the
participants; ``at`` = this process's inner steps so far; ``heal`` = the first sync after this
process took a peer's state, whose pseudo-gradient is the peer's), ``heal`` (the state copy),
``done``. ``--save`` writes the global parameters (each fragment's last committed
copy) as an ``.npz`` with the project's keys.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--kind", choices=("synthetic", "model"), default="synthetic")
    p.add_argument("--steps", type=int, default=0, help="inner steps of this process (0: until killed)")
    p.add_argument("--H", type=int, default=10)
    p.add_argument("--P", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--params", type=int, default=100_000, help="synthetic: parameters in all")
    p.add_argument("--timeout", type=float, default=60.0, help="manager and gloo timeouts, seconds (torchft's default)")
    p.add_argument("--init", default=None, help="model: version-0 parameters (.npz, the project's keys)")
    p.add_argument("--data", default=None, help="model: int32 batches [steps, B, T+1] (.npy)")
    p.add_argument("--spec", default=None, help="model: JSON {d_model, n_layers, n_heads, d_ff, seq_len}")
    p.add_argument("--opt", default=None, help="model: JSON {lr, warmup, total, wd, clip, outer_lr, outer_momentum}")
    p.add_argument("--save", default=None, help="model: write the global parameters here at the end (.npz)")
    a = p.parse_args()

    events = open(a.events, "a", buffering=1)

    def emit(kind: str, **kw) -> None:
        events.write(json.dumps({"e": kind, "t": time.time(), "replica": a.replica, "pid": os.getpid(), **kw}) + "\n")

    emit("exec")
    import numpy as np
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    torch.manual_seed(a.replica)

    if a.kind == "model":
        spec, opt = json.loads(a.spec), json.loads(a.opt)
        init = dict(np.load(a.init))
        model = Transformer(spec, init, torch, nn)
        names = list(init)
        groups = fragment_groups(names, spec["n_layers"], a.P)
        decay = [model.p[k.replace("/", "__")] for k in names if init[k].ndim >= 2]
        no_decay = [model.p[k.replace("/", "__")] for k in names if init[k].ndim < 2]
        inner = torch.optim.AdamW([{"params": decay, "weight_decay": opt["wd"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=opt["lr"], betas=(0.9, 0.95), eps=1e-8)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda t: schedule(t, opt["warmup"], opt["total"]))
        batches = np.load(a.data, mmap_mode="r")
        outer_lr, outer_m = opt["outer_lr"], opt["outer_momentum"]
    else:
        n = max(1, a.params // a.P)
        model = nn.Module()
        model.p = nn.ParameterDict({f"f{i}": nn.Parameter(torch.zeros(n)) for i in range(a.P)})  # type: ignore[assignment]
        groups = [[f"f{i}"] for i in range(a.P)]
        inner = torch.optim.SGD(model.parameters(), lr=1e-3)
        sched = None
        outer_lr, outer_m = 0.7, 0.5
    frags = []
    for g in groups:
        m = nn.Module()
        m.p = nn.ParameterDict({k.replace("/", "__"): model.p[k.replace("/", "__")] for k in g})  # type: ignore[assignment]
        frags.append(m)
    outer = [torch.optim.SGD(f.parameters(), lr=outer_lr, momentum=outer_m, nesterov=True) for f in frags]

    def state_dict():  # what a healing replica copies from a peer (the schedule too, as a careful user would)
        return {"model": model.state_dict(), "inner": inner.state_dict(),
                "sched": sched.state_dict() if sched is not None else None}

    def load_state_dict(sd) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        if sched is not None and sd.get("sched") is not None:
            sched.load_state_dict(sd["sched"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=a.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=t), min_replica_size=1, use_async_quorum=False,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica_{a.replica}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=a.lighthouse, hostname="127.0.0.1", init_sync=False, timeout=t, quorum_timeout=t, connect_timeout=t)
    diloco = DiLoCo(manager, frags, inner, outer, sync_every=a.H)
    steps = [0]
    last = [0] * a.P
    healed = [False]
    apply_heal = manager._apply_pending_state_dict

    def heal() -> None:  # this process takes a peer's state: what it trained before is overwritten
        apply_heal()
        healed[0] = True
        last[:] = [steps[0]] * a.P
        emit("heal", at=steps[0], mstep=manager.current_step())

    manager._apply_pending_state_dict = heal  # type: ignore[method-assign]
    for i, f in enumerate(diloco._fragments):
        orig = f.perform_sync

        def logged(orig=orig, i=i):
            mstep = manager.current_step()
            part, n_part = manager.is_participating(), manager.num_participants()
            # the first sync after a heal sends the peer's pseudo-gradient (copied with its state): not ours
            was_heal, healed[0] = healed[0], False
            ok = bool(orig())
            emit("sync", frag=i, commit=ok, steps=steps[0] - last[i], at=steps[0], mstep=mstep, part=bool(part),
                 n=int(n_part), heal=was_heal)
            last[i] = steps[0]
            return ok

        f.perform_sync = logged  # type: ignore[method-assign]
    emit("ready")
    loss_fn = nn.functional.cross_entropy
    with diloco:
        while a.steps == 0 or steps[0] < a.steps:
            if a.kind == "model":
                b = torch.from_numpy(np.asarray(batches[steps[0] % len(batches)], dtype=np.int64))
                logits = model(b[:, :-1])
                loss = loss_fn(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
                inner.zero_grad()
                loss.backward()
                if opt["clip"]:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), opt["clip"])
            else:
                time.sleep(a.step_time)
                for q in model.parameters():
                    q.grad = torch.randn_like(q)
            steps[0] += 1  # before the step: its post-hook may sync, and that sync covers this step
            inner.step()
            if sched is not None:
                sched.step()
            if steps[0] == 1:
                emit("step")
    if a.save:
        out = {}
        for f, g in zip(diloco._fragments, groups):
            for k in g:
                out[k] = f.original_parameters["p." + k.replace("/", "__")].detach().numpy().copy()
        np.savez(a.save, **out)
    emit("done", steps=steps[0], mstep=manager.current_step())
    events.close()
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)


def fragment_groups(names: list[str], n_layers: int, P: int) -> list[list[str]]:
    """The parameters in P contiguous groups in the model's order: whole tensors (torchft fragments
    are modules), cut where the running size passes each k/P of the blocks."""
    per = [[k for k in names if k.startswith(f"blocks/{i}/")] for i in range(n_layers)]
    head = [k for k in names if not k.startswith("blocks/")]
    groups: list[list[str]] = [[] for _ in range(P)]
    for i, blk in enumerate(per):
        groups[min(P - 1, i * P // max(1, n_layers))].extend(blk)
    groups[0] = head + groups[0]
    return [g for g in groups if g] if all(groups) else _even(names, P)


def _even(names: list[str], P: int) -> list[list[str]]:
    k = math.ceil(len(names) / P)
    return [names[i:i + k] for i in range(0, len(names), k)]


def schedule(t: int, warmup: int, total: int, end: float = 0.1) -> float:
    """optax.warmup_cosine_decay_schedule(0, 1, warmup, total, end) (learner/inner.make_schedule)."""
    if t < warmup:
        return t / warmup
    frac = min(1.0, (t - warmup) / max(1, total - warmup))
    return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * frac))


def Transformer(spec: dict, init: dict, torch, nn):
    """learner/model.py in PyTorch: the same names, shapes and arithmetic (RMSNorm eps 1e-6, tanh
    GELU, causal softmax with finfo.min, tied embeddings)."""
    F = nn.functional

    class _T(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.ParameterDict()
            self._names = list(init)
            for k, v in init.items():
                self.p[k.replace("/", "__")] = nn.Parameter(torch.from_numpy(v.copy()))

        def __getitem__(self, k: str):
            return self.p[k.replace("/", "__")]

        def forward(self, x):
            b, t = x.shape
            d, nh = spec["d_model"], spec["n_heads"]
            hd = d // nh

            def norm(h, s):
                return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * s

            h = self["embed"][x] + self["pos_embed"][:t]
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            for i in range(spec["n_layers"]):
                pre = f"blocks/{i}/"
                z = norm(h, self[pre + "attn_norm"]) @ self[pre + "attn_qkv"]
                q, k, v = (u.reshape(b, t, nh, hd).transpose(1, 2) for u in z.split(d, dim=-1))
                s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
                o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
                h = h + o @ self[pre + "attn_out"]
                z = norm(h, self[pre + "mlp_norm"]) @ self[pre + "mlp_in"]
                h = h + F.gelu(z, approximate="tanh") @ self[pre + "mlp_out"]
            h = norm(h, self["final_norm"])
            return h @ (self["embed"].T if "unembed" not in self._names else self["unembed"])

    return _T()


if __name__ == "__main__":
    main()
