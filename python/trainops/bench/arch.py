"""The ``arch`` benchmark target (``python -m trainops bench arch``): one full training step
(forward, cross-entropy, backward, AdamW on every parameter) of the architectures people
fine-tune, at realistic sizes (:data:`.arch_models.ARCHS`: resnet18, efficientnet_b0,
mobilenet_v3_small, a two-stage ConvNeXt, a ViT, a BERT-base-shaped encoder, a
SmolLM-360M-shaped Llama, an LSTM classifier), exported as a user exports them (the torch
bridge, ``trainops.torch.export``), in trainops (:class:`trainops.Trainer`) against PyTorch
eager and ``torch.compile``, each against the step's **FLOP bound**: its products'
multiply-adds (forward, input and weight gradients, counted on the exported graph) at this
machine's float32 GEMM rate (the best of ONNX Runtime's MLAS and the ``gemm`` crate on a
2048^3 product, measured in the same run at the same thread count; :mod:`.arch_bound` says
exactly what is counted). ``bound ms = 2 x step MACs / rate``; a peer's fraction of the
bound is ``bound ms / its step ms`` (1 would be every product at the GEMM rate and
everything else free).

Every (architecture, peer, thread count) runs in a subprocess of its own, so that its peak
resident memory (Linux's ``VmHWM``: the whole process, the Python runtime, the libraries
and, for torch.compile, the compiler's own process included; its worker processes not) is
its own; each
child times ``--warmup`` untimed then ``--steps`` timed steps and reports the median
(torch.compile's first two steps, its compilation, are untimed on top). The exports are
made once by ``--torch-python`` (an interpreter with torch, torchvision and transformers;
default: this one) into ``--cache-dir``; without torch there, the exports must already be
cached and the torch columns say n/a. ``--profile``: the trainops step's time by op type
(ONNX Runtime's profiler), one more child per architecture at the first thread count.

    python -m trainops bench arch --torch-python /path/to/torch/python --markdown
    python -m trainops bench arch --archs resnet18,bert --threads 1 --steps 2   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .arch_models import ARCHS, EPS, LR, SEED, WEIGHT_DECAY
from .children import package_versions, profile_step, spawn, timed
from .harness import Target, format_rows

__all__ = ["TARGET", "run", "build_parser", "PEERS", "format_report"]

PEERS = ("trainops", "eager", "compile")


def _trainer(name: str, path: str, threads: int):
    from .. import Trainer, losses, optim

    loss = losses.cross_entropy("output", class_axis=ARCHS[name]["class_axis"],
                                ignore_index=-100)
    return Trainer(path, loss,
                   optimizer=optim.AdamW(lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS),
                   threads=threads, seed=SEED)


def _trainops_child(name: str, path: str, threads: int, warmup: int, steps: int) -> dict:
    from .arch_models import batch_data

    feeds = batch_data(name)
    t0 = time.perf_counter()
    try:
        trainer = _trainer(name, path, threads)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return {"error": f"failed: {type(exc).__name__}: {first}"}
    build_s = time.perf_counter() - t0
    res = timed(lambda: trainer.step(feeds), warmup, steps)
    res["build_s"] = build_s
    return res


def _profile_child(name: str, path: str, threads: int, steps: int) -> dict:
    """Microseconds per step by op type of the trainops step (ONNX Runtime's profiler on a
    second session of the trainer's step graph; each node's median over the steps, summed
    by op type), largest first."""
    from .arch_models import batch_data

    feeds = batch_data(name)
    trainer = _trainer(name, path, threads)
    graph, frozen = trainer.step_graph, getattr(trainer, "_frozen", None)
    del trainer  # its session's memory
    return profile_step(graph, frozen, feeds, LR, threads, steps)


def _spawn(python: str, call: str, timeout: float, env_extra: dict | None = None) -> dict:
    """:func:`.children.spawn` of ``call`` over this target's three modules."""
    return spawn(python, "arch, arch_models, arch_bound", call, timeout, env_extra)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainops bench arch",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHS),
                    help=f"comma-separated, of: {', '.join(ARCHS)} (default: all)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="comma-separated, of: trainops, eager, compile (default: all)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per child")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per child (median)")
    ap.add_argument("--gemm-n", type=int, default=2048, help="the GEMM rate's square size")
    ap.add_argument("--gemm-reps", type=int, default=5, help="timed GEMMs (the best counts)")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(),
                                                        "trainops-bench-arch"),
                    help="where the ONNX exports are cached")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="an interpreter with torch, torchvision and transformers (the "
                         "exports and the torch peers; default: this one)")
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    ap.add_argument("--profile", action="store_true",
                    help="the trainops step's time by op type, per architecture")
    ap.add_argument("--top", type=int, default=5, help="op types shown by --profile")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per child")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    return ap


def _parse_list(text: str, allowed, what: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    for t in out:
        if t not in allowed:
            raise SystemExit(f"bench arch: --{what}: {t!r}: expected one of "
                             f"{', '.join(allowed)}")
    return out


def _parse_threads(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"bench arch: --threads: {text!r}: expected positive integers, "
                         "comma-separated")
    return out


def _rates(args, threads: list[int], torch_ok: bool, say) -> dict:
    """GFLOP/s of a ``--gemm-n`` cube per thread count: MLAS (inputs, prepacked), the gemm
    crate, numpy and torch (reference), and ``best`` (MLAS's or the crate's, the bound's)."""
    n, reps, out = args.gemm_n, args.gemm_reps, {}
    for th in threads:
        say(f"GEMM rate, {th} thread(s) ...")
        blas = {k: str(th) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                     "MKL_NUM_THREADS")}
        mlas = _spawn(sys.executable, f"arch_bound.mlas_child({th}, {n}, {reps})", args.timeout)
        crate = _spawn(sys.executable, f"arch_bound.gemm_crate_child({th}, {n}, {reps})",
                       args.timeout)
        npy = _spawn(sys.executable, f"arch_bound.numpy_child({th}, {n}, {reps})",
                     args.timeout, blas)
        tch = (_spawn(args.torch_python, f"arch_models.torch_gemm_child({th}, {n}, {reps})",
                      args.timeout, blas) if torch_ok else {"error": "torch not installed"})
        r = {"mlas_inputs": mlas.get("inputs"), "mlas_prepacked": mlas.get("prepacked"),
             "gemm_crate": crate.get("gflops"), "numpy": npy.get("gflops"),
             "torch": tch.get("gflops"),
             "errors": {k: v["error"] for k, v in (("mlas", mlas), ("gemm_crate", crate),
                                                   ("numpy", npy), ("torch", tch))
                        if "error" in v}}
        cands = {k: r[k] for k in ("mlas_inputs", "mlas_prepacked", "gemm_crate") if r[k]}
        r["best"], r["best_of"] = ((max(cands.values()), max(cands, key=cands.get))
                                   if cands else (None, None))
        out[th] = r
    return out


def _f(x, fmt: str = "{:.0f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _cell(res: dict | None) -> tuple[float | None, str]:
    """A peer's step ms and its table text (the failure, or n/a, where it has none)."""
    if res is None:
        return None, "n/a"
    if "ms" in res:
        return res["ms"], f"{res['ms']:.0f}"
    return None, res.get("na") or res.get("error") or "n/a"


def format_report(report: dict, markdown: bool = False) -> str:
    """The tables of a run's ``report`` (the JSON's ``rates``, ``archs`` and ``results``):
    the GEMM rates, the architectures' products and the steps against the bound."""
    out = []
    rates = report["rates"]
    rrows = [[str(th), _f(r.get("mlas_inputs")), _f(r.get("mlas_prepacked")),
              _f(r.get("gemm_crate")), _f(r.get("numpy")), _f(r.get("torch")),
              f"{_f(r.get('best'))} ({r.get('best_of') or 'n/a'})"]
             for th, r in sorted(rates.items(), key=lambda kv: int(kv[0]))]
    out.append(format_rows(["threads", "MLAS GFLOP/s", "MLAS prepacked", "gemm crate",
                            "numpy", "torch", "bound's rate"], rrows, markdown))
    arows = []
    for name, a in report["archs"].items():
        if "macs" not in a:
            arows.append([name, a.get("error") or a.get("macs_error", "?"), "", "", ""])
            continue
        m = a["macs"]
        shares = ", ".join(f"{op} {100 * v / m['step']:.0f}%" for op, v in m["by_op"].items())
        what = ARCHS[name]["what"] if name in ARCHS else ""
        arows.append([name, what, f"{m['forward'] / 1e9:.2f}", f"{m['step'] / 1e9:.2f}", shares])
    out.append(format_rows(["arch", "what", "forward GMAC", "step GMAC", "step MACs by op"],
                           arows, markdown, left=2))
    rows = []
    for r in report["results"]:
        name, th = r["arch"], r["threads"]
        a = report["archs"].get(name, {})
        rate = rates.get(th, rates.get(str(th), {})).get("best")
        bound = 2 * a["macs"]["step"] / (rate * 1e9) * 1e3 if "macs" in a and rate else None
        ms = {}
        cells = []
        for peer in PEERS:
            ms[peer], text = _cell(r.get(peer))
            frac = f" ({bound / ms[peer]:.2f})" if bound and ms[peer] else ""
            cells.append(text + frac)
        ratios = [f"{ms[p] / ms['trainops']:.2f}x" if ms[p] and ms["trainops"] else "n/a"
                  for p in ("eager", "compile")]
        mib = " / ".join(_f((r.get(p) or {}).get("peak_mib")) for p in PEERS)
        rows.append([name, str(th), _f(bound), *cells, *ratios, mib])
    out.append(format_rows(["arch", "threads", "bound ms", "trainops ms (of bound)",
                            "eager ms (of bound)", "compile ms (of bound)", "eager / trainops",
                            "compile / trainops", "peak MiB trainops / eager / compile"],
                           rows, markdown))
    return "\n\n".join(out)


def run(argv=None) -> int:
    import onnx

    from .arch_bound import count_macs
    from .arch_models import batch_data
    from .host import environment, loadavg

    args = build_parser().parse_args(argv)
    names = _parse_list(args.archs, list(ARCHS), "archs")
    peers = _parse_list(args.peers, PEERS, "peers")
    threads = _parse_threads(args.threads)
    versions = None if args.no_torch else package_versions(
        args.torch_python, ["torch", "torchvision", "transformers"])
    os.makedirs(args.cache_dir, exist_ok=True)
    env, load_before, t_start = environment(), loadavg(), time.perf_counter()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True))
    rates = _rates(args, threads, bool(versions), say)
    archs: dict = {}
    for name in names:
        path = os.path.join(args.cache_dir, f"{name}.bridge.onnx")
        if not os.path.exists(path):
            if not versions:
                archs[name] = {"error": f"not cached ({path}) and no torch to export it"}
                continue
            say(f"exporting {name} ...")
            res = _spawn(args.torch_python, f"arch_models.export_child({name!r}, {path!r})",
                         args.timeout)
            if "error" in res:
                archs[name] = {"error": f"export failed: {res['error']}"}
                continue
        feeds = {k: v for k, v in batch_data(name).items() if k != "labels"}
        archs[name] = {"path": path}
        try:
            archs[name]["macs"] = count_macs(onnx.load(path), feeds)
        except Exception as exc:  # noqa: BLE001 - the steps still run; no bound
            archs[name]["macs_error"] = f"counting its products failed: {exc}"
    results = []
    for name in names:
        if "path" not in archs[name]:
            continue
        path = archs[name]["path"]
        for th in threads:
            row: dict = {"arch": name, "threads": th}
            none = {"na": "torch not installed"}
            for peer in PEERS:
                if peer not in peers:
                    row[peer] = None
                    continue
                say(f"{name}: {peer}, {th} thread(s) ...")
                if peer == "trainops":
                    row[peer] = _spawn(sys.executable, f"arch._trainops_child({name!r}, "
                                       f"{path!r}, {th}, {args.warmup}, {args.steps})",
                                       args.timeout)
                elif versions:
                    row[peer] = _spawn(
                        args.torch_python, f"arch_models.torch_child({name!r}, {th}, "
                        f"{args.warmup}, {args.steps}, {peer == 'compile'})", args.timeout,
                        {"OMP_NUM_THREADS": str(th)})
                else:
                    row[peer] = none
            results.append(row)
    profiles = {}
    if args.profile:
        for name in names:
            if "path" in archs[name]:
                say(f"profiling {name} ...")
                profiles[name] = _spawn(sys.executable, f"arch._profile_child({name!r}, "
                                        f"{archs[name]['path']!r}, {threads[0]}, "
                                        f"{max(args.steps, 2)})", args.timeout)
    report = {"rates": rates, "archs": archs, "results": results}
    header = (f"{env['date']}; {env['cpu']}, {env['cores']} cores; load average "
              f"{load_before} before, {loadavg()} after; "
              f"{time.perf_counter() - t_start:.0f} s; onnxruntime {env['onnxruntime']}, "
              f"torch/torchvision/transformers {versions or 'not installed'}; "
              f"library {env['library']}\n"
              f"One training step (cross-entropy, AdamW on every parameter), exported by "
              f"trainops.torch.export; step ms = median of {args.steps} after {args.warmup} "
              f"warm-up (torch.compile: 2 more, its compilation); bound ms = 2 x step MACs / "
              f"the best {args.gemm_n}^3 float32 GEMM rate at that thread count (MLAS or the "
              f"gemm crate); (of bound) = bound ms / step ms; eager / trainops = torch ms / "
              f"trainops ms (above 1: trainops faster); peak MiB = each child's peak RSS (VmHWM)")
    print(header + ("\n" if args.markdown else ""))
    print(format_report(report, args.markdown))
    if profiles:
        print()
        for name, p in profiles.items():
            if "by_op_us" not in p:
                print(f"{name}: profile failed: {p.get('error')}")
                continue
            total = p["kernels_us"]
            top = list(p["by_op_us"].items())[:args.top]
            print(f"{name}, {threads[0]} thread(s): kernels {total / 1e3:.0f} ms of a "
                  f"{p['run_us'] / 1e3:.0f} ms run: "
                  + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in top)
                  + ("  \n" if args.markdown else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "environment": env, "options": vars(args),
                       **report, "profiles": profiles}, f, indent=1)
    return 0


main = run

TARGET = Target("arch", "one training step of resnet18, efficientnet_b0, mobilenet_v3_small, "
                "ConvNeXt, ViT, BERT, Llama and an LSTM exported by the torch bridge: trainops "
                "against PyTorch eager and torch.compile and the step's FLOP bound",
                command=run)

if __name__ == "__main__":
    sys.exit(run())
