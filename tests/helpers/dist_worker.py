"""Run under mpirun by tests/test_distributed.py: trains the test MLP data-parallel on this
rank's shard of a fixed global batch and writes what it saw to <out>/<tag>_rank<r>.npz.

    mpirun -n N python dist_worker.py OUT SCENARIO [options]

Scenarios: ``train`` (plain and sharded, each twice: per step the loss, the flat
parameters and the flat optimizer state, gathered from the ranks where sharded),
``dropout`` (the MLP with a Dropout, seeded, plain and sharded, each twice: per step the
loss, the flat parameters and this rank's Philox state; and the default seed), ``mismatch [seed]`` (rank 1 builds another model, or is given another seed), ``hang`` (rank 1 stops itself with SIGSTOP at step 2; the others must raise
CollectiveTimeout), ``kill`` (rank 1 is killed with SIGKILL at step 2).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from trainops import optim  # noqa: E402
from trainops.demos.train import mlp_model  # noqa: E402
from trainops.distributed import CollectiveTimeout, abort  # noqa: E402
from trainops import Trainer  # noqa: E402

SIZES = (8, 16, 16, 3)  # 467 parameters: not a multiple of 2 or 4, so shards are padded
B = 6  # per-rank batch
STEPS = 4


def global_batches(n: int, steps: int = STEPS, seed: int = 7):
    """The global batches of every step (n*B rows each), the same on every rank."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((n * B, SIZES[0])).astype(np.float32),
             "t": rng.integers(0, SIZES[-1], n * B).astype(np.int64)} for _ in range(steps)]


def make_optimizer(name: str):
    return {"adam": optim.Adam(lr=0.05), "momentum": optim.Momentum(lr=0.1),
            "adagrad": optim.Adagrad(lr=0.1)}[name]


DROP_RATIO = 0.4
DROP_SEED = 2024


def dropout_model():
    """The test MLP with a Dropout (ratio DROP_RATIO) after its first Relu, at position
    DROP_INDEX of graph.node."""
    from onnx import helper, numpy_helper

    m = mlp_model(sizes=SIZES)
    g = m.graph
    i = next(k for k, n in enumerate(g.node) if n.op_type == "Relu")
    relu_out = g.node[i].output[0]
    for n in g.node:
        for j, name in enumerate(n.input):
            if name == relu_out:
                n.input[j] = "dropped"
    g.node.insert(i + 1, helper.make_node("Dropout", [relu_out, "drop_ratio"], ["dropped"]))
    g.initializer.append(numpy_helper.from_array(np.array(DROP_RATIO, np.float32), "drop_ratio"))
    return m


DROP_INDEX = 3  # MatMul, Add, Relu, Dropout


def flat_optimizer_state(tr, comm) -> dict:
    """The optimizer state as one process holds it, each state (V, H) flat in parameter
    order: a sharded trainer's slices gathered from every rank (its flat buffer is the
    parameters in that order, padded at the end)."""
    st, out = tr.optimizer_state(), {}
    total = sum(v.size for v in tr.parameters().values())
    for s in tr.optimizer.state:
        if f"trainops/{s}/shard" in st:
            out[s] = np.concatenate(comm.allgather(st[f"trainops/{s}/shard"]))[:total]
        else:
            out[s] = np.concatenate([st[f"trainops/{s}/{p}"].reshape(-1) for p in tr.param_names])
    return out


def train(comm, shard: bool, opt: str, steps: int = STEPS, hook=None, timeout=None,
          model=None, seed=None):
    n, r = comm.Get_size(), comm.Get_rank()
    tr = Trainer(model or mlp_model(sizes=SIZES), "loss", make_optimizer(opt), threads=1,
                 comm=comm, shard_optimizer=shard, collective_timeout=timeout, seed=seed)
    losses, params, states, opt_states = [], [], [], []
    for k, batch in enumerate(global_batches(n, steps)):
        if hook:
            hook(k)
        losses.append(tr.step({name: v[r * B:(r + 1) * B] for name, v in batch.items()}))
        params.append(np.concatenate([v.reshape(-1) for v in tr.parameters().values()]))
        states.append([tr._arrays[name].copy() for name, _, _ in tr._rng])
        opt_states.append(flat_optimizer_state(tr, comm))
    tr.states = np.array(states, np.uint32)
    tr.opt_states = {s: np.array([o[s] for o in opt_states]) for s in tr.optimizer.state}
    return tr, np.array(losses), np.array(params)


def main() -> int:
    from mpi4py import MPI  # here, not at import: tests import this module for its data

    out, scenario = Path(sys.argv[1]), sys.argv[2]
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    if scenario == "train":
        opt = sys.argv[3] if len(sys.argv) > 3 else "adam"
        res = {}
        for shard in (False, True):
            for rep in (0, 1):
                tr, losses, params = train(comm, shard, opt)
                key = f"shard{int(shard)}_rep{rep}"
                res[f"{key}_losses"] = losses
                res[f"{key}_params"] = params
                for name, v in tr.opt_states.items():  # per step, flat as params
                    res[f"{key}_state_{name}"] = v
                mem = tr.memory()
                res[f"{key}_state_bytes"] = np.array(mem["optimizer_state"])
                if not shard and rep == 0 and r == n - 1:
                    tr.save(out / f"ckpt_{opt}_n{n}.npz")  # the last rank's: all hold all
        np.savez(out / f"train_{opt}_n{n}_rank{r}.npz", **res)
        return 0
    if scenario == "dropout":
        res = {}
        for shard in (False, True):
            for rep in (0, 1):
                tr, losses, params = train(comm, shard, "adam", model=dropout_model(),
                                           seed=DROP_SEED)
                key = f"shard{int(shard)}_rep{rep}"
                res[f"{key}_losses"] = losses
                res[f"{key}_params"] = params
                res[f"{key}_states"] = tr.states
                if not shard and rep == 0 and r == 0:
                    tr.save(out / "dropout_ckpt_rank0.npz")
        unseeded = Trainer(dropout_model(), "loss", optim.Adam(), threads=1, comm=comm)
        res["default_seed"] = np.array(unseeded.seed, np.uint64)
        np.savez(out / f"dropout_n{n}_rank{r}.npz", **res)
        return 0
    if scenario == "mismatch":  # rank 1 builds another model: every rank refuses it
        sizes = SIZES if r != 1 else (8, 17, 16, 3)
        try:
            if sys.argv[3:] == ["seed"]:  # the same Dropout model, rank 1 another seed
                Trainer(dropout_model(), "loss", optim.Adam(), threads=1, comm=comm,
                        seed=DROP_SEED + (r == 1))
            else:
                Trainer(mlp_model(sizes=sizes), "loss", optim.Adam(), threads=1, comm=comm)
        except ValueError as exc:
            print(f"ValueError: {exc}", flush=True)
            return 0
        print(f"rank {r}: no error", flush=True)
        return 1
    if scenario in ("hang", "kill"):
        sig = signal.SIGSTOP if scenario == "hang" else signal.SIGKILL

        def hook(k):
            if k == 2 and r == 1:
                print(f"rank 1: {signal.Signals(sig).name} at step {k + 1}", flush=True)
                os.kill(os.getpid(), sig)

        try:
            train(comm, False, "adam", steps=50, hook=hook, timeout=float(sys.argv[3]))
        except CollectiveTimeout as exc:
            print(f"CollectiveTimeout: {exc}", flush=True)
            abort(comm, 3)
        print(f"rank {r}: finished without an error", flush=True)
        return 0
    raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    sys.exit(main())
