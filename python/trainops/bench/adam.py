"""The ``adam`` benchmark target: ``python -m trainops bench adam``.

One Adam step over N float32 parameters moves 28 bytes per parameter (reads x, g, v, h;
writes x, v, h), so every peer's GB/s is ``28 N / time``. Peers, interleaved in one
process for each size:

- trainops Adam in onnxruntime: IOBinding in place (the training case) and ``run()``
  (onnxruntime allocates the outputs), for each ``--threads``;
- the memory ceiling: ``com.trainops.bench::MemoryCeiling``, the same call with Adam's
  memory traffic and no arithmetic, in place on the same threads;
- the same Adam decomposed into standard ONNX ops in onnxruntime (IOBinding, preallocated
  outputs);
- numpy, in place with ``out=`` buffers (one thread);
- ``torch.optim.Adam(fused=True)`` when torch is installed (``torch.set_num_threads``);
- at the smallest size, a one-node ``Identity`` model with the same inputs, for the cost
  of an onnxruntime call.

``--sizes`` gives parameter counts (default 1e4 1e6 16e6 64e6); ``--tensors K`` splits
each size into K tensors of log-uniform sizes from 10k to 1M elements (a real model's
node); ``--plot FILE`` writes a PNG of throughput against N (needs matplotlib).

``--optimizers`` measures instead every optimizer and weight type against its own memory
ceiling in one run (:mod:`.optimizers`): Adam, Adagrad, Momentum (standard, Nesterov) in
float32, float16 and bfloat16, and MixedPrecisionAdam; it prints a summary table with a
ratio column, and ``--plot FILE`` then draws those ratios. The table in
``docs/performance/optimizers.md`` and ``docs/bench-adam.png`` come from ``python -m trainops bench adam --optimizers --sizes 16e6
--markdown --plot docs/bench-adam.png``.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import numpy as np

from ..onnx_defs import IR_VERSION, opset_imports
from .harness import Case, Peer, Target, ort_session
from .yardsticks import memory_ceiling_model

__all__ = ["TARGET", "build", "decomposed_model", "identity_model", "tensor_sizes", "plot"]

BYTES_PER_PARAM = 28  # reads x, g, v, h; writes x, v, h (float32)
ALPHA, BETA, EPS = 0.9, 0.999, 1e-6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], metavar="N",
                   help="intra_op_num_threads for onnxruntime and torch (default: 1 2)")
    p.add_argument("--tensors", type=int, default=1, metavar="K",
                   help="split each size into K tensors of 10k..1M elements (default: 1)")
    p.add_argument("--no-torch", action="store_true", help="leave torch out even if installed")
    p.add_argument("--torch-threads", type=int, metavar="N",
                   help="torch.set_num_threads for its peer (default: the largest --threads)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of GB/s against N")
    p.add_argument("--op", choices=["adam", "adagrad", "momentum"], default="adam",
                   help="the optimizer (adagrad and momentum move 20 bytes per parameter; only "
                        "trainops itself is measured for them: compare with adam's ceiling)")
    p.add_argument("--grad-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="gradient type with float32 weights (mixed precision: 26 bytes per "
                        "parameter; only trainops and the ceiling take part)")
    p.add_argument("--ort-spin", action="store_true", help="leave onnxruntime's spinning on")
    p.add_argument("--optimizers", action="store_true",
                   help="every optimizer (Adam, Adagrad, Momentum standard and nesterov) in "
                        "float32, float16 and bfloat16, and MixedPrecisionAdam, each against its "
                        "own MemoryCeiling in the same run (replaces the Adam peers)")


def tensor_sizes(n: int, k: int, seed: int = 0) -> list[int]:
    """``n`` parameters as ``k`` tensors: log-uniform sizes in [1e4, 1e6], scaled to sum
    to ``n`` (one tensor when ``k == 1``)."""
    if k <= 1:
        return [n]
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(np.log(1e4), np.log(1e6), k))
    sizes = np.maximum(1, np.floor(raw * n / raw.sum())).astype(int)
    sizes[-1] += n - int(sizes.sum())
    return [int(s) for s in sizes]


def decomposed_model(sizes: list[int]):
    """Adam as standard ONNX ops (opset 17), one chain per tensor, T > 0 precomputed into
    the rate input ``r`` (the bias correction is a scalar, not per-element work)."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    consts = {"alpha": ALPHA, "one_minus_alpha": 1 - ALPHA, "beta": BETA,
              "one_minus_beta": 1 - BETA, "eps": EPS}
    inits = [helper.make_tensor(k, f, [], [v]) for k, v in consts.items()]
    inputs = [helper.make_tensor_value_info("r", f, [])]
    outputs, nodes = [], []
    for i, n in enumerate(sizes, 1):
        x, g, v, h = (f"{p}_{i}" for p in "XGVH")
        inputs += [helper.make_tensor_value_info(name, f, [n]) for name in (x, g, v, h)]
        outputs += [helper.make_tensor_value_info(f"{p}_{i}_new", f, [n]) for p in "XVH"]
        t = lambda s: f"{s}_{i}"  # noqa: E731
        nodes += [
            helper.make_node("Mul", ["alpha", v], [t("av")]),
            helper.make_node("Mul", ["one_minus_alpha", g], [t("ag")]),
            helper.make_node("Add", [t("av"), t("ag")], [f"V_{i}_new"]),
            helper.make_node("Mul", [g, g], [t("gg")]),
            helper.make_node("Mul", ["beta", h], [t("bh")]),
            helper.make_node("Mul", ["one_minus_beta", t("gg")], [t("bgg")]),
            helper.make_node("Add", [t("bh"), t("bgg")], [f"H_{i}_new"]),
            helper.make_node("Sqrt", [f"H_{i}_new"], [t("sq")]),
            helper.make_node("Add", [t("sq"), "eps"], [t("den")]),
            helper.make_node("Div", [f"V_{i}_new", t("den")], [t("q")]),
            helper.make_node("Mul", ["r", t("q")], [t("step")]),
            helper.make_node("Sub", [x, t("step")], [f"X_{i}_new"]),
        ]
    graph = helper.make_graph(nodes, "adam_decomposed", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=opset_imports([""]))
    model.ir_version = IR_VERSION
    return model


def identity_model(sizes: list[int]):
    """A one-node-per-output Identity model with Adam's inputs and outputs."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("R", f, []),
              helper.make_tensor_value_info("T", TensorProto.INT64, [])]
    outputs, nodes = [], []
    for i, n in enumerate(sizes, 1):
        inputs += [helper.make_tensor_value_info(f"{p}_{i}", f, [n]) for p in "XGVH"]
        for p in "XVH":
            outputs.append(helper.make_tensor_value_info(f"{p}_{i}_new", f, [n]))
            nodes.append(helper.make_node("Identity", [f"{p}_{i}"], [f"{p}_{i}_new"]))
    model = helper.make_model(helper.make_graph(nodes, "identity", inputs, outputs),
                              opset_imports=opset_imports([""]))
    model.ir_version = IR_VERSION
    return model


def _grad_type(name: str):
    """(numpy dtype, bytes per parameter moved) for a gradient type name."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16), 26
    return np.dtype(name), 26 if name == "float16" else BYTES_PER_PARAM


def _state(sizes: list[int], seed: int = 1, grad=np.float32) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"X": rng.standard_normal(n, dtype=np.float32),
             "G": (rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)).astype(grad),
             "V": np.zeros(n, np.float32), "H": np.zeros(n, np.float32)} for n in sizes]


def _bound(sess, state, in_place: bool, extra: Optional[dict[str, np.ndarray]] = None,
           groups: str = "XGVH", rewrites: str = "XVH"):
    """An IOBinding of ``state`` (tensor ``i`` is ``X_i``...), outputs bound to the inputs'
    own OrtValues (``in_place``) or to preallocated, touched ones."""
    import onnxruntime as ort

    io, keep = sess.io_binding(), []

    def value(a):
        v = ort.OrtValue.ortvalue_from_numpy(a)
        keep.append(v)
        return v

    for name, a in (extra or {}).items():
        io.bind_ortvalue_input(name, value(a))
    for i, t in enumerate(state, 1):
        vals = {p: value(t[p].copy()) for p in groups}
        for p, v in vals.items():
            io.bind_ortvalue_input(f"{p}_{i}", v)
        for p in rewrites:
            out = vals[p] if in_place else value(np.ones_like(t[p]))
            io.bind_ortvalue_output(f"{p}_{i}_new", out)
    return io, keep


def _numpy_step(state, r: float):
    scratch = [np.empty_like(t["X"]) for t in state]
    a, oa, b, ob, eps = (np.float32(c) for c in (ALPHA, 1 - ALPHA, BETA, 1 - BETA, EPS))
    r = np.float32(r)

    def step():
        for t, s in zip(state, scratch):
            x, g, v, h = t["X"], t["G"], t["V"], t["H"]
            np.multiply(v, a, out=v)
            v += oa * g
            np.multiply(g, g, out=s)
            s *= ob
            np.multiply(h, b, out=h)
            h += s
            np.sqrt(h, out=s)
            s += eps
            np.divide(v, s, out=s)
            s *= r
            x -= s
    return step, scratch


def _torch_peers(sizes: list[int], threads: int) -> tuple[list[Peer], list[str]]:
    try:
        import torch
    except ImportError:
        return [], ["torch is not installed: torch.optim.Adam(fused=True) is left out"]
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel()) * 1e-3
    opt = torch.optim.Adam(params, lr=1e-3, betas=(ALPHA, BETA), eps=EPS, fused=True)
    opt.step()  # creates the state
    # torch's thread count is process-wide and changing it per call costs milliseconds, so
    # torch runs on one count, set once.
    torch.set_num_threads(threads)
    peers = [Peer("torch Adam(fused=True)", opt.step, threads,
                  f"torch {torch.__version__}, CPU, set_num_threads({threads})", keep=(params, opt))]
    return peers, []


def build(n: int, args: argparse.Namespace) -> Case:
    """Peers updating ``n`` float32 parameters (``--sizes`` are parameter counts here)."""
    from ..models import adam_model

    sizes = tensor_sizes(n, getattr(args, "tensors", 1))
    if getattr(args, "optimizers", False):
        from .optimizers import build_rows

        return build_rows(n, sizes, args)
    op = getattr(args, "op", "adam")
    if op != "adam":
        return _other_optimizer_case(op, n, sizes, args)
    grad, per_param = _grad_type(getattr(args, "grad_dtype", "float32"))
    mixed = grad != np.float32
    state = _state(sizes, grad=grad)
    spin = bool(getattr(args, "ort_spin", False))
    library = getattr(args, "library", None)
    r, t = np.array(1e-3, np.float32), np.array(1, np.int64)
    scalars = {"R": r, "T": t}
    peers: list[Peer] = []
    notes = [f"{len(sizes)} tensor{'s' if len(sizes) > 1 else ''}, {n} float32 parameters with "
             f"{grad.name} gradients, {per_param} bytes moved per parameter; onnxruntime "
             f"spinning {'on' if spin else 'off'}"]
    shapes = [(s,) for s in sizes]
    g_dtype = grad if mixed else None
    ceiling = memory_ceiling_model(shapes, g_dtype=g_dtype)
    for threads in args.threads:
        sess = ort_session(adam_model(shapes, g_dtype=g_dtype), threads, library, spin)
        io, keep = _bound(sess, state, True, scalars)
        peers.append(Peer("trainops Adam, IOBinding in place", lambda s=sess, b=io: s.run_with_iobinding(b),
                          threads, "X/V/H outputs bound to their inputs", keep=keep))
        feeds = dict(scalars, **{f"{p}_{i}": st[p] for i, st in enumerate(state, 1) for p in "XGVH"})
        peers.append(Peer("trainops Adam, run()", lambda s=sess, f=feeds: s.run(None, f), threads,
                          "onnxruntime allocates the outputs"))
        csess = ort_session(ceiling, threads, library, spin)
        cio, ckeep = _bound(csess, state, True, scalars)
        peers.append(Peer("memory ceiling (MemoryCeiling op)", lambda s=csess, b=cio: s.run_with_iobinding(b),
                          threads, "x += g, v += g, h += g in place: Adam's traffic", keep=ckeep))
        if mixed:  # the other peers take float32 gradients only
            continue
        dsess = ort_session(decomposed_model(sizes), threads, library, spin)
        dio, dkeep = _bound(dsess, state, False, {"r": r})
        peers.append(Peer("decomposed ONNX Adam", lambda s=dsess, b=dio: s.run_with_iobinding(b), threads,
                          "12 standard ops per tensor, preallocated outputs", keep=dkeep))
    if n <= 100_000 and not mixed:
        isess = ort_session(identity_model(sizes), 1, library, spin)
        iio, ikeep = _bound(isess, state, False, scalars)
        peers.append(Peer("Identity model, same inputs", lambda s=isess, b=iio: s.run_with_iobinding(b), 1,
                          "the cost of an onnxruntime call with Adam's inputs", keep=ikeep))
    if not mixed:
        step, scratch = _numpy_step(_state(sizes, seed=2), 1e-3)
        peers.append(Peer("numpy, in place", step, 1, "ufuncs with out=", keep=scratch))
    if not mixed and not getattr(args, "no_torch", False):
        tpeers, tnotes = _torch_peers(sizes, getattr(args, "torch_threads", None) or max(args.threads))
        peers += tpeers
        notes += tnotes
    base = next(p.label for p in peers if p.name.startswith("trainops Adam, IOBinding") and p.threads == max(args.threads))
    title = f"Adam, {n:,} parameters in {len(sizes)} tensor{'s' if len(sizes) > 1 else ''}"
    if mixed:
        title += f", {grad.name} gradients"
    return Case(title, per_param * n, peers, base, notes)


def _other_optimizer_case(op: str, n: int, sizes: list[int], args: argparse.Namespace) -> Case:
    """Adagrad or Momentum in place and through run() (20 bytes per parameter: reads x, g and
    h or v; writes x and h or v), for a row next to Adam's."""
    from ..models import adagrad_model, momentum_model

    shapes = [(s,) for s in sizes]
    if op == "adagrad":
        model, groups, rewrites = adagrad_model(shapes), "XGH", "XH"
    else:
        model = momentum_model(shapes, alpha=0.9, beta=0.1, mode="standard", norm_coefficient=0.0)
        groups, rewrites = "XGV", "XV"
    state = _state(sizes)
    scalars = {"R": np.array(1e-3, np.float32), "T": np.array(1, np.int64)}
    spin, library = bool(getattr(args, "ort_spin", False)), getattr(args, "library", None)
    peers = []
    for threads in args.threads:
        sess = ort_session(model, threads, library, spin)
        io, keep = _bound(sess, state, True, scalars, groups, rewrites)
        peers.append(Peer(f"trainops {op}, IOBinding in place", lambda s=sess, b=io: s.run_with_iobinding(b),
                          threads, "outputs bound to their inputs", keep=keep))
        feeds = dict(scalars, **{f"{p}_{i}": st[p] for i, st in enumerate(state, 1) for p in groups})
        peers.append(Peer(f"trainops {op}, run()", lambda s=sess, f=feeds: s.run(None, f), threads,
                          "onnxruntime allocates the outputs"))
    base = next(p.label for p in peers if "IOBinding" in p.name and p.threads == max(args.threads))
    notes = [f"{n} float32 parameters, 20 bytes moved per parameter; compare GB/s with adam's "
             "memory ceiling at the same size"]
    return Case(f"{op}, {n:,} parameters in {len(sizes)} tensor(s)", 20 * n, peers, base, notes)


def plot(results: list[Any], path: str) -> None:
    """GB/s against N for each peer (log-log), from ``measure`` results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        series.setdefault(r.peer, []).append((r.nbytes // BYTES_PER_PARAM, r.gbps))
    fig, ax = plt.subplots(figsize=(8, 5))
    for peer, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=peer)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (float32)")
    ax.set_ylabel(f"GB/s ({BYTES_PER_PARAM} bytes moved per parameter)")
    ax.set_title("One Adam step: throughput against size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _after(results: list[Any], args: argparse.Namespace) -> None:
    rows = getattr(args, "optimizers", False)
    if rows:
        from .optimizers import plot_rows, summary

        print(summary(results))
    if getattr(args, "plot", None):
        try:
            (plot_rows if rows else plot)(results, args.plot)
            print(f"plot written to {args.plot}")
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib): no plot written")


TARGET = Target("adam",
                "Adam in onnxruntime against the memory ceiling, decomposed ONNX, numpy, torch",
                build, add_arguments, ("1e4", "1e6", "16e6", "64e6"), _after)
