"""What ``python -m trainops bench train`` reports beside the step times: where a
trainops step spends its time (ONNX Runtime's profiler, by op type) and the peak memory
of each peer.

**Per-op breakdown.** A second session of the same step graph with
``SessionOptions.enable_profiling`` runs ``steps`` steps; the profile's ``*_kernel_time``
events (one per node run) give each node's median time over the steps (robust to the
preemptions of a shared machine), summed by ``op_name``.
Profiling adds a little per node; the shares, not the absolute times, are the point.

**Peak memory.** tracemalloc sees only Python's allocator, not ONNX Runtime's arena nor
torch's allocator, so each peer runs in a subprocess of its own: after its imports and
a warm-up run of the same peer at batch 1 (so that code pages and JIT kernels are already
resident), the process resets its resident-set high-water mark (``/proc/self/clear_refs``
``5``), notes its RSS, builds the peer (session or module, optimizer), runs the steps and
reads ``VmHWM``. The figure is the high water minus that baseline: weights, optimizer
state, activations, gradients, workspace and the session's own structures (for trainops,
ONNX Runtime's arena and the initializers it copied). Linux only; elsewhere: n/a.

Both children run with glibc's ``MALLOC_MMAP_THRESHOLD_=65536`` and
``MALLOC_TRIM_THRESHOLD_=0``: every block of 64 KiB or more is its own mapping, returned
on free. With glibc's default (a threshold that rises after each free, so that blocks the
warm-up freed stay resident and are reused unseen) the same child measured 2.4 or 8.5 MiB
for the MLP from one run to the next; with these settings repeated runs agree within 1%.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys

__all__ = ["op_breakdown", "peak_memory", "optimized_model"]


def op_breakdown(fam, threads: int, steps: int = 20) -> dict[str, float]:
    """Microseconds per step by op type of one trainops step of family ``fam`` (sorted,
    largest first); ``"(total kernels)"`` and ``"(session run)"`` are the sums."""
    import tempfile

    from .. import optim
    from ..train import Trainer
    from ..train.runtime import StepRuntime

    trainer = Trainer(fam.model, "loss", optim.Adam(lr=1e-3), params=fam.params, threads=threads)
    prefix = os.path.join(tempfile.mkdtemp(prefix="trainops-bench-prof-"), "step")

    def configure(so):
        so.enable_profiling = True
        so.profile_file_prefix = prefix

    rt = StepRuntime(trainer.step_graph, threads, configure=configure)
    for t in range(1, 4):  # warm-up: also profiled, so skipped below by count
        rt.run(fam.feeds, 1e-3, t)
    for t in range(4, 4 + steps):
        rt.run(fam.feeds, 1e-3, t)
    path = rt.session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    runs = [e for e in events if e.get("name") == "model_run"]
    skip_until = runs[2]["ts"] + runs[2]["dur"] if len(runs) > 3 else -1
    kernels = [e for e in events if e.get("cat") == "Node" and e["ts"] > skip_until
               and e.get("name", "").endswith("_kernel_time")]
    # a control-flow node's time includes its body's nodes, which are events too: count
    # each body node once, in its Scan / Loop / If
    bodies = [(e["ts"], e["ts"] + e["dur"]) for e in kernels
              if e.get("args", {}).get("op_name") in ("Scan", "Loop", "If")]
    per_node: dict = collections.defaultdict(list)
    for e in kernels:
        if any(a <= e["ts"] and e["ts"] + e["dur"] <= b and (a, b) != (e["ts"], e["ts"] + e["dur"])
               for a, b in bodies):
            continue
        per_node[(e.get("args", {}).get("op_name", "?"), e["name"])].append(e["dur"])
    # each node's median over the steps (a preempted run of one node, tens of ms on a
    # loaded machine, does not count), summed by op type; a body node runs many times a
    # step: its sum over the step's runs
    by_op: collections.Counter = collections.Counter()
    for (op, _), durs in per_node.items():
        by_op[op] += statistics.median(durs) * len(durs) / steps
    out = dict(by_op.most_common())
    out["(total kernels)"] = sum(by_op.values())
    out["(session run)"] = statistics.median(e["dur"] for e in runs[3:]) if len(runs) > 3 else 0.0
    try:
        os.remove(path)
    except OSError:
        pass
    return out


def optimized_model(fam, threads: int, path: str):
    """Write the optimised step graph ONNX Runtime runs (``optimized_model_filepath``)
    for family ``fam`` to ``path``; returns the node count by op type."""
    import onnx

    from .. import optim
    from ..train import Trainer
    from ..train.runtime import StepRuntime

    trainer = Trainer(fam.model, "loss", optim.Adam(lr=1e-3), params=fam.params, threads=threads)
    StepRuntime(trainer.step_graph, threads,
                configure=lambda so: setattr(so, "optimized_model_filepath", path))
    m = onnx.load(path, load_external_data=False)
    return collections.Counter(n.op_type for n in m.graph.node)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _child(model: str, batch: int, peer: str, threads: int, steps: int) -> dict:
    """In the subprocess: the high-water RSS delta (bytes) of building ``peer`` and
    running ``steps`` steps, after a warm-up run of the same peer at batch 1 (which
    faults in both stacks' code and JIT kernels, so that the figure is data)."""
    import gc

    from .train_models import family

    if peer == "trainops":
        from .. import optim
        from ..train import Trainer

        def train(fam):
            trainer = Trainer(fam.model, "loss", optim.Adam(lr=1e-3), params=fam.params,
                              threads=threads)
            for _ in range(steps):
                trainer.step(fam.feeds)
    else:
        import torch

        from .train_torch import torch_model

        torch.set_num_threads(threads)

        def train(fam):
            x, t = torch.from_numpy(fam.feeds["x"]), torch.from_numpy(fam.feeds["t"])
            net = torch_model(fam)
            opt = torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-6)
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(net(x), t).backward()
                opt.step()

    train(family(model, 1))
    fam = family(model, batch)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    train(fam)
    return {"peak_bytes": (_status_kb("VmHWM") - base) * 1024}


def peak_memory(model: str, batch: int, peer: str, threads: int, steps: int = 5) -> int | None:
    """Peak resident memory (bytes) that ``peer`` (``trainops`` or ``torch``) adds to its
    own process for ``steps`` steps of ``model``; None where it cannot be measured."""
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    code = ("import json, sys; from trainops.bench.train_profile import _child; "
            f"print(json.dumps(_child({model!r}, {batch}, {peer!r}, {threads}, {steps})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode != 0:
        print(f"bench train: peak memory of {peer} on {model} failed:\n{r.stderr[-2000:]}",
              file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["peak_bytes"]
