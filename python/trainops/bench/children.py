"""What the benchmark targets that run each figure in a child process share (``lora``,
``arch``): starting a child and reading its JSON result (:func:`spawn`), asking an
interpreter for its packages' versions (:func:`package_versions`), timing a training step in the
child (:func:`timed`) and profiling the trainops step by op type (:func:`profile_step`).
Standard library only at import: the torch interpreter's children import it too."""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import tempfile
import time

from .host import peak_mib

__all__ = ["package_versions", "profile_step", "spawn", "timed"]


def spawn(python: str, modules: str, call: str, timeout: float,
          env_extra: dict | None = None) -> dict:
    """Runs ``call`` (an expression over ``trainops.bench``'s ``modules``, comma-separated)
    in a fresh ``python`` with this package on its path; its JSON result, or
    ``{"error": ...}``."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    code = (f"import json; from trainops.bench import {modules}; "
            f"print('RESULT ' + json.dumps({call}))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    except OSError as exc:
        return {"error": f"{python}: {exc}"}
    for line in r.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def package_versions(python: str, packages: list[str]) -> str | None:
    """``python``'s versions of ``packages``, space-separated, or None when it lacks one
    (or is no interpreter)."""
    code = (f"import {', '.join(packages)}; "
            f"print({', '.join(p + '.__version__' for p in packages)})")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    except OSError:  # no such interpreter
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def timed(step, warmup: int, steps: int) -> dict:
    """``warmup`` untimed then ``steps`` timed calls of ``step`` (returning the loss): the
    median milliseconds, every time, the losses and this process's peak resident MiB."""
    losses, times = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(float(step()))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * statistics.median(times), "times_ms": [1e3 * t for t in times],
            "losses": losses, "peak_mib": peak_mib()}


def profile_step(graph, frozen, feeds: dict, lr: float, threads: int, steps: int) -> dict:
    """Microseconds per step by op type of a trainer's step: ONNX Runtime's profiler on a
    session of its step ``graph`` (and ``frozen``, the weights it holds outside, or None),
    one untimed step then ``steps``; each node's median over the steps, summed by op
    type, largest first. The caller drops the trainer first (its session's memory)."""
    from ..train.runtime import StepRuntime

    prefix = os.path.join(tempfile.mkdtemp(prefix="trainops-bench-prof-"), "step")

    def configure(so):
        so.enable_profiling = True
        so.profile_file_prefix = prefix

    rt = StepRuntime(graph, threads, configure=configure, frozen=frozen)
    rt.run(feeds, lr, 1)  # warm-up, skipped below
    for t in range(2, 2 + steps):
        rt.run(feeds, lr, t)
    prof = rt.session.end_profiling()
    with open(prof) as f:
        events = json.load(f)
    os.remove(prof)
    runs = [e for e in events if e.get("name") == "model_run"]
    after = runs[0]["ts"] + runs[0]["dur"]
    per_node = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["ts"] > after and e["name"].endswith("_kernel_time"):
            per_node[(e.get("args", {}).get("op_name", "?"), e["name"])].append(e["dur"])
    by_op: collections.Counter = collections.Counter()
    for (op, _), durs in per_node.items():
        by_op[op] += statistics.median(durs) * len(durs) / steps
    return {"by_op_us": dict(by_op.most_common()), "kernels_us": sum(by_op.values()),
            "run_us": statistics.median(e["dur"] for e in runs[1:])}
