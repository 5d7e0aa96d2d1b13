"""The ``distributed`` benchmark target (``python -m trainops bench distributed``):
data-parallel scaling of :class:`trainops.Trainer` over MPI on this machine.

For each process count (default 1 2 4) it starts ``mpirun -n N`` on this module's worker;
each rank trains the model on its own batch of ``--batch`` samples (weak scaling: the
global batch grows with N), with the gradients averaged by Allreduce and, interleaved
with it in the same processes, with the optimizer state sharded (ReduceScatter +
Allgather). Rank 0 reports the median step time over ``--repeat`` repetitions of
``--steps`` steps, samples/s (N x batch per step), the speed-up over one process, and the
share of the step spent in collectives (waiting included: a collective ends when the
slowest rank arrives). Process counts above the core count are marked oversubscribed:
their ranks take turns on the cores, so they measure overhead, not scaling.

Different process counts cannot run in one process: each row is its own MPI job, run one
after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import numpy as np

from .harness import Target, format_rows

__all__ = ["TARGET", "run", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainops bench distributed",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], metavar="N",
                    help="MPI process counts (default: 1 2 4)")
    ap.add_argument("--models", default="mlp,cnn", help="comma-separated model families of bench train (trainops.bench.train_models): mlp, cnn, ...")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=10, help="steps per repetition")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads per rank (default: cores / local ranks)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per MPI job")
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return ap


def _worker(args) -> int:
    from mpi4py import MPI

    from .. import optim
    from ..train import Trainer
    from .train_models import family

    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    out = {}
    for model in args.models.split(","):
        fam = family(model, args.batch, seed=rank)  # each rank: its own shard of data
        feeds = fam.feeds
        variants = {}
        for shard in (False, True):
            variants[shard] = Trainer(family(model, args.batch).model, "loss",
                                      optim.Adam(lr=1e-3), params=fam.params,
                                      threads=args.threads, comm=comm, shard_optimizer=shard)
        times = {s: [] for s in variants}
        comm_share = {s: [] for s in variants}
        for tr in variants.values():  # warm-up
            for _ in range(3):
                tr.step(feeds)
        for r in range(args.repeat):
            for shard in (r % 2 == 0, r % 2 == 1):  # alternate which goes first
                tr = variants[shard]
                tm0 = dict(tr.timings)
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    tr.step(feeds)
                dt = (time.perf_counter() - t0) / args.steps
                times[shard].append(dt)
                c = (tr.timings["communication"] - tm0["communication"]) / args.steps
                comm_share[shard].append(c / dt)
        params = sum(v.size for v in variants[False].parameters().values())
        for shard, tr in variants.items():
            t = statistics.median(times[shard])
            share = statistics.median(comm_share[shard])
            # rank 0 reports the slowest rank's step time
            t = comm.allreduce(t, op=MPI.MAX)
            share = comm.allreduce(share, op=MPI.MAX)
            out[f"{model}/{'sharded' if shard else 'allreduce'}"] = {
                "model": model, "sharded": shard, "procs": n, "batch": args.batch,
                "threads": tr.threads, "step_s": t, "samples_per_s": n * args.batch / t,
                "comm_share": share, "params": int(params),
                "grad_bytes": int(params) * 4,
                "state_bytes": tr.memory()["optimizer_state"],
            }
    if rank == 0:
        with open(args.worker, "w") as f:
            json.dump(out, f)
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    from ..distributed import mpi_env, mpirun_command
    from .host import loadavg

    cores = os.cpu_count() or 1
    rows = []
    env = mpi_env()
    env.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    load_before = loadavg()
    for n in args.procs:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "out.json")
            cmd = mpirun_command(n, ["-m", "trainops.bench.distributed", "--worker", path,
                                     "--models", args.models, "--batch", str(args.batch),
                                     "--steps", str(args.steps), "--repeat", str(args.repeat)]
                                 + (["--threads", str(args.threads)] if args.threads else []))
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                   timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"error: mpirun -n {n} did not finish in {args.timeout:g} s",
                      file=sys.stderr)
                return 1
            if p.returncode != 0:
                print(f"error: mpirun -n {n} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}",
                      file=sys.stderr)
                return 1
            with open(path) as f:
                rows += list(json.load(f).values())
    base = {(r["model"], r["sharded"]): r for r in rows if r["procs"] == args.procs[0]}
    names = {"mlp": "MLP 256-512-512-10", "cnn": "CNN (demo)"}
    header = ["model", "gradients", "processes", "threads/rank", "global batch", "step",
              "samples/s", f"vs {args.procs[0]} proc", "collective share",
              "optimizer state/rank"]
    table = []
    for r in sorted(rows, key=lambda r: (r["model"], r["sharded"], r["procs"])):
        b = base.get((r["model"], r["sharded"]))
        over = " (oversubscribed)" if r["procs"] * r["threads"] > cores else ""
        table.append([names.get(r["model"], r["model"]),
                      "ReduceScatter+Allgather (ZeRO-1)" if r["sharded"] else "Allreduce",
                      f"{r['procs']}{over}", str(r["threads"]), str(r["procs"] * r["batch"]),
                      f"{r['step_s'] * 1e3:.2f} ms", f"{r['samples_per_s']:.0f}",
                      f"{r['samples_per_s'] / b['samples_per_s']:.2f}x" if b else "-",
                      f"{100 * r['comm_share']:.0f}%", f"{r['state_bytes'] / 1024:.1f} KiB"])
    import onnxruntime as ort

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cores} cores; onnxruntime "
          f"{ort.__version__}; load average before {load_before}, after {loadavg()}")
    print(f"data-parallel Trainer over MPI (Open MPI, shared memory), Adam; {args.batch} "
          f"samples per rank per step; median of {args.repeat} x {args.steps} steps, the "
          "slowest rank's; collective share: time in collectives (waiting for the slowest "
          "rank included) over the step" + ("\n" if args.markdown else ""))
    print(format_rows(header, table, args.markdown, left=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cores": cores}, f, indent=1)
    return 0


TARGET = Target("distributed", "data-parallel scaling over MPI: step time, samples/s and the "
                "collectives' share for 1, 2, 4 processes", command=run)

if __name__ == "__main__":
    sys.exit(run())
