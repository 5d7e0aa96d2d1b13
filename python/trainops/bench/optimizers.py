"""``python -m trainops bench adam --optimizers``: every optimizer and weight type against
its own memory ceiling, measured in one run.

Rows (each in place through IOBinding, for each ``--threads``): Adam, Adagrad, Momentum
(standard and Nesterov) with float32, float16 and bfloat16 X/G/state, and
MixedPrecisionAdam (float32 X/V/H, float16 G). Each row's ceiling is
``com.trainops.bench::MemoryCeiling`` with the row's stream count (3 for Adam's X, V, H;
2 for Adagrad's X, H and Momentum's X, V) and element types, on the same threads, timed
interleaved with it; a row's ratio is its GB/s over its ceiling's. Bytes per parameter are
what a step must move: Adam 28 (reads x, g, v, h; writes x, v, h), Adagrad and Momentum 20,
halved with 16-bit types; MixedPrecisionAdam reads G twice (the finiteness verdict over every
gradient precedes every write), 2 + 2 + 24 = 28 with float16 G, against a ceiling that reads
it once (26): both in bytes per second.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np

from .harness import Case, Peer, Result, ort_session
from .yardsticks import memory_ceiling_model

__all__ = ["ROWS", "Row", "build_rows", "summary", "plot_rows"]


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class Row:
    """One optimizer row: ``op`` (adam, adagrad, momentum, nesterov, mixed), the weight type,
    the gradient type (default: the weight type) and the bytes a step moves per parameter."""

    op: str
    dtype: str
    g_dtype: str | None = None

    @property
    def streams(self) -> int:
        return 2 if self.op in ("adagrad", "momentum", "nesterov") else 3

    @property
    def groups(self) -> str:
        return {"adagrad": "XGH", "momentum": "XGV", "nesterov": "XGV"}.get(self.op, "XGVH")

    @property
    def bytes_per_param(self) -> int:
        x = _dtype(self.dtype).itemsize
        g = _dtype(self.g_dtype or self.dtype).itemsize
        per = g + (2 * self.streams) * x
        return per + g if self.op == "mixed" else per  # the verdict's pass over G

    @property
    def name(self) -> str:
        op = {"adam": "Adam", "adagrad": "Adagrad", "momentum": "Momentum",
              "nesterov": "Momentum nesterov", "mixed": "MixedPrecisionAdam"}[self.op]
        g = f", {self.g_dtype} G" if self.g_dtype else ""
        passes = " (2 passes over G)" if self.op == "mixed" else ""
        return f"{op} {self.dtype}{g}{passes}"

    def ceiling_name(self) -> str:
        g = f", {self.g_dtype} G" if self.g_dtype else ""
        return f"ceiling, {self.streams} streams {self.dtype}{g}"


ROWS: tuple[Row, ...] = tuple(
    [Row(op, dt) for op in ("adam", "adagrad", "momentum", "nesterov")
     for dt in ("float32", "float16", "bfloat16")]
    + [Row("mixed", "float32", "float16")])


def _model(row: Row, shapes: list[tuple[int]]):
    from ..models import adagrad_model, adam_model, mixed_precision_adam_model, momentum_model

    dt = _dtype(row.dtype)
    if row.op == "adam":
        return adam_model(shapes, dt, np.float32)
    if row.op == "adagrad":
        return adagrad_model(shapes, dt, np.float32)
    if row.op in ("momentum", "nesterov"):
        mode = "standard" if row.op == "momentum" else "nesterov"
        return momentum_model(shapes, dt, np.float32, alpha=0.9, beta=0.1, mode=mode,
                              norm_coefficient=0.0)
    return mixed_precision_adam_model(shapes, g_dtype=_dtype(row.g_dtype or "float16"))


class _States:
    """One set of X, G, V, H arrays (and OrtValues over them, no copies) per weight and
    gradient type, shared by every row of those types: the optimizers keep H >= 0 and G
    is never written, so each row stays finite whichever ran before it. The ceilings get
    their own set (``s += g`` would drive Adam's H negative)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.sets: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def get(self, dtype: str, g_dtype: str) -> list[dict[str, Any]]:
        key = (dtype, g_dtype)
        if key not in self.sets:
            rng = np.random.default_rng(len(self.sets) + 1)
            dt, gt = _dtype(dtype), _dtype(g_dtype)
            arrays = [{"X": rng.standard_normal(n, dtype=np.float32).astype(dt),
                       "G": (rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)).astype(gt),
                       "V": np.zeros(n, dt), "H": np.zeros(n, dt)} for n in self.sizes]
            self.sets[key] = [{p: (a, _ortvalue(a)) for p, a in t.items()} for t in arrays]
        return self.sets[key]


def _ortvalue(a: np.ndarray):
    """An OrtValue over ``a``'s buffer (bfloat16 through its bits: onnxruntime's
    ``ortvalue_from_numpy`` does not know ml_dtypes)."""
    import onnxruntime as ort

    if a.dtype.name == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), 16)  # BFLOAT16
    return ort.OrtValue.ortvalue_from_numpy(a)


def _bind(sess, tensors: list[dict[str, Any]], groups: str, scalars: dict[str, Any]):
    """An IOBinding of ``tensors`` in place: ``X_i_new`` bound to ``X_i``'s OrtValue..."""
    io = sess.io_binding()
    for name, v in scalars.items():
        io.bind_ortvalue_input(name, v)
    for i, t in enumerate(tensors, 1):
        for p in groups:
            io.bind_ortvalue_input(f"{p}_{i}", t[p][1])
        for p in groups.replace("G", ""):
            io.bind_ortvalue_output(f"{p}_{i}_new", t[p][1])
    return io


def build_rows(n: int, sizes: list[int], args: argparse.Namespace, rows=ROWS) -> Case:
    """The case of every row in ``rows`` and its ceiling, for each ``args.threads``."""
    import onnxruntime as ort

    shapes = [(s,) for s in sizes]
    spin, library = bool(getattr(args, "ort_spin", False)), getattr(args, "library", None)
    ov = ort.OrtValue.ortvalue_from_numpy
    scalar_arrays = {"R": np.array(1e-3, np.float32), "T": np.array(1, np.int64),
                     "loss_scale": np.array(1024.0, np.float32)}
    scalars = {k: ov(v) for k, v in scalar_arrays.items()}
    ours, theirs = _States(sizes), _States(sizes)
    peers: list[Peer] = []
    ceilings: dict[tuple[str, int], str] = {}
    for threads in args.threads:
        for row in rows:
            g = row.g_dtype or row.dtype
            key = (row.ceiling_name(), threads)
            if key not in ceilings:
                csess = ort_session(memory_ceiling_model(shapes, _dtype(g), streams=row.streams,
                                                         dtype=_dtype(row.dtype)),
                                    threads, library, spin)
                groups = "XGVH" if row.streams == 3 else "XGH"
                cio = _bind(csess, theirs.get(row.dtype, g), groups, {"R": scalars["R"], "T": scalars["T"]})
                per = row.bytes_per_param - (_dtype(g).itemsize if row.op == "mixed" else 0)
                peer = Peer(row.ceiling_name(), lambda s=csess, b=cio: s.run_with_iobinding(b),
                            threads, f"MemoryCeiling streams={row.streams}: {per} bytes/param",
                            keep=(csess, cio), nbytes=per * n)
                peer.baseline = peer.label
                ceilings[key] = peer.label
                peers.append(peer)
            sess = ort_session(_model(row, shapes), threads, library, spin)
            names = {"R", "T", "loss_scale"} if row.op == "mixed" else {"R", "T"}
            io = _bind(sess, ours.get(row.dtype, g), row.groups,
                       {k: v for k, v in scalars.items() if k in names})
            if row.op == "mixed":
                io.bind_output("finite")
            peers.append(Peer(row.name, lambda s=sess, b=io: s.run_with_iobinding(b), threads,
                              f"{row.bytes_per_param} bytes/param; ratio over {ceilings[key]}",
                              keep=(sess, io), nbytes=row.bytes_per_param * n,
                              baseline=ceilings[key]))
    notes = [f"{n} parameters in {len(sizes)} tensor(s), in place; each row's ratio is over its "
             "own ceiling (MemoryCeiling with its stream count and types), timed interleaved",
             "MixedPrecisionAdam reads G twice (its finiteness verdict precedes every write): "
             "28 bytes/param, against a ceiling reading it once (26)"]
    base = peers[1].label
    case = Case(f"every optimizer against its own ceiling, {n:,} parameters", 28 * n, peers, base,
                notes)
    case.cleanup.append(lambda: (ours.sets.clear(), theirs.sets.clear()))
    return case


def summary(results: list[Result], markdown: bool = True) -> str:
    """A row per optimizer row: bytes/param, then GB/s and ratio to its own ceiling for each
    thread count."""
    by = {(r.case, r.peer): r for r in results}
    threads = sorted({r.threads for r in results})
    lines = ["| row | B/param | " + " | ".join(f"{t} thr GB/s | {t} thr / ceiling" for t in threads) + " |",
             "|---|---:|" + "---:|---:|" * len(threads)]
    seen: list[str] = []
    for r in results:
        name = r.peer.rsplit(", ", 1)[0]
        if name not in seen:
            seen.append(name)
    for name in seen:
        cells = []
        per = None
        for t in threads:
            r = next((x for x in results if x.peer.rsplit(", ", 1)[0] == name and x.threads == t), None)
            if r is None:
                cells += ["-", "-"]
                continue
            per = r.nbytes
            base = by.get((r.case, r.baseline))
            is_ceiling = r.baseline == r.peer
            ratio = "ceiling" if is_ceiling else (f"{r.gbps / base.gbps:.2f}" if base else "-")
            cells += [f"{r.gbps:.1f}", ratio]
        n = next(x for x in results if x.peer.rsplit(", ", 1)[0] == name)
        size = int(n.case.rsplit(", ", 1)[1].split()[0].replace(",", ""))
        lines.append(f"| {name} | {round((per or 0) / size)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_rows(results: list[Result], path: str) -> None:
    """Each optimizer row's GB/s over its own ceiling's, one bar per thread count, with the
    90% target marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.baseline != r.peer]
    by = {(r.case, r.peer): r for r in results}
    names: list[str] = []
    for r in rows:
        if r.peer.rsplit(", ", 1)[0] not in names:
            names.append(r.peer.rsplit(", ", 1)[0])
    threads = sorted({r.threads for r in rows})
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(names) + 1.5))
    height = 0.8 / max(len(threads), 1)
    for k, t in enumerate(threads):
        vals = []
        for name in names:
            r = next((x for x in rows if x.peer.rsplit(", ", 1)[0] == name and x.threads == t), None)
            base = by.get((r.case, r.baseline)) if r else None
            vals.append(r.gbps / base.gbps if r and base else 0.0)
        ax.barh([i + k * height for i in range(len(names))], vals, height,
                label=f"{t} thread{'s' if t != 1 else ''}")
    ax.axvline(0.9, color="k", linestyle="--", linewidth=1, label="target 0.9")
    ax.set_yticks([i + height * (len(threads) - 1) / 2 for i in range(len(names))])
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s over its own MemoryCeiling's (same run)")
    ax.set_title(rows[0].case if rows else "optimizers")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
