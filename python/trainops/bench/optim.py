"""The ``optim`` benchmark target: ``python -m trainops bench optim``.

PyTorch-style optimizers of ``com.trainops`` against their own memory ceiling and against
PyTorch: each row (:data:`ROWS`) in place through IOBinding, for each ``--threads``, timed
interleaved with its ceiling (``com.trainops.bench::MemoryCeiling`` of the row's traffic,
same threads) and with ``torch.optim``'s fused CPU step when torch is importable. ``--sizes``
are parameter counts (default 16e6).

Rows (:data:`ROWS`; one more is one more :class:`Row`):

- AdamW float32 (reads x, g, m, v; writes x, m, v: 28 bytes per parameter, the traffic of
  ``MemoryCeiling streams=3``), with torch's fused AdamW as its peer;
- AdamWBf16State (``com.trainops::AdamWBf16State``: x read and written 8, g 4, bfloat16 m
  and v read and written 8: 20 bytes per parameter, exactly ``MemoryCeiling streams=2``'s
  float32 X, G, H);
- AdamW8bit (``com.trainops::AdamW8bit``: x 8, g 4, codes read and written 4, scales 16 per
  256: 16.06 bytes per parameter). No ``MemoryCeiling`` layout moves 16 bytes (the kernels
  crate's ``ceiling_8bit`` is not an op): its ceiling is the nearest above,
  ``streams=2`` float32 (20 bytes per parameter), so its ratio over that ceiling
  understates its fraction of a 16-byte ceiling by up to 20/16 (the GB/s columns count each
  peer's own bytes).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .harness import Case, Peer, Target, ort_session
from .yardsticks import memory_ceiling_model

__all__ = ["TARGET", "ROWS", "Row", "build", "float_ceiling"]


def _ortvalues(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    from ..bfloat16 import to_ortvalue

    # to_ortvalue: bfloat16 arrays through a uint16 view, sharing memory like the rest
    return {k: to_ortvalue(a) for k, a in arrays.items()}


def _bind(sess, values: dict[str, Any], rewritten: list[str]):
    """An IOBinding of every input to ``values``, and of each ``<name>_new`` in
    ``rewritten`` to its input's own OrtValue (in place)."""
    io = sess.io_binding()
    for name, v in values.items():
        io.bind_ortvalue_input(name, v)
    for name in rewritten:
        io.bind_ortvalue_output(f"{name}_new", values[name])
    return io


def float_ceiling(n: int, streams: int = 3) -> tuple[Any, dict[str, np.ndarray], list[str]]:
    """``MemoryCeiling`` over one float32 tensor of ``n``: (model, input arrays, rewritten
    inputs). ``streams=3`` moves Adam's and AdamW's bytes (x, g, two state tensors)."""
    model = memory_ceiling_model([(n,)], streams=streams)
    arrays = {"R": np.array(1e-3, np.float32), "T": np.array(1, np.int64),
              "X_1": np.zeros(n, np.float32), "G_1": np.full(n, 1e-7, np.float32),
              "V_1": np.zeros(n, np.float32), "H_1": np.zeros(n, np.float32)}
    if streams == 2:
        del arrays["V_1"]
    return model, arrays, [k for k in arrays if k[0] in "XVH"]


@dataclass(frozen=True)
class Row:
    """One optimizer row: ``model(n)`` and ``state(n)`` (every input array, by name, of a
    node over one tensor of ``n`` parameters), the inputs it rewrites, the bytes a step moves
    per parameter, its ceiling (``ceiling(n)`` as :func:`float_ceiling`) and, optionally,
    ``torch(n)``: a PyTorch step doing the same update (or None when it has none), and
    ``ceiling_bytes_per_param`` when the ceiling moves other bytes than the row."""

    name: str
    model: Callable[[int], Any]
    state: Callable[[int], dict[str, np.ndarray]]
    rewritten: tuple[str, ...]
    bytes_per_param: int
    ceiling: Callable[[int], tuple[Any, dict[str, np.ndarray], list[str]]] = float_ceiling
    torch: Callable[[int], tuple[Callable[[], Any], Any, str]] | None = None
    ceiling_bytes_per_param: int | None = None  # the ceiling's traffic, if not the row's


def _adamw_model(n: int):
    from ..models import adamw_model

    return adamw_model([(n,)], np.float32)


def _adamw_state(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"R": np.array(1e-3, np.float32), "T": np.array(1, np.int64),
            "X_1": rng.standard_normal(n, dtype=np.float32),
            "G_1": rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3),
            "M_1": np.zeros(n, np.float32), "V_1": np.zeros(n, np.float32)}


def _torch_adamw(n: int):
    """``torch.optim.AdamW(fused=True)`` on one float32 tensor of ``n``: (step, keep, note)."""
    import torch

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()  # creates the state
    return opt.step, (p, opt), f"torch {torch.__version__} AdamW(fused=True), CPU"


def _node_model(op: str, specs: dict[str, tuple[Any, tuple[int, ...]]], outputs: list[str],
                **attrs):
    """A one-node ``com.trainops`` model: inputs of ``specs`` (name -> (numpy dtype,
    shape)), outputs ``<name>_new`` of ``outputs``, each like its input."""
    from onnx import helper

    from ..onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

    def info(name, spec):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(spec[0]),
                                             list(spec[1]))

    node = helper.make_node(op, list(specs), [f"{k}_new" for k in outputs],
                            domain=TRAINOPS_DOMAIN, **attrs)
    graph = helper.make_graph([node], op, [info(k, v) for k, v in specs.items()],
                              [info(f"{k}_new", specs[k]) for k in outputs])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def _specs(state: Callable[[int], dict[str, np.ndarray]], n: int) -> dict:
    """``state(n)``'s (dtype, shape) by name, from ``state(1)`` (no arrays of ``n``)."""
    return {k: (a.dtype, a.shape if a.ndim == 0 else
                ((-(-n // 256),) if "absmax" in k else (n,)))
            for k, a in state(1).items()}


_BF16_REWRITTEN = ("X_1", "M_1", "V_1")
_8BIT_REWRITTEN = ("X_1", "M_q_1", "M_absmax_1", "V_q_1", "V_absmax_1")


def _bf16_state(n: int) -> dict[str, np.ndarray]:
    from ..onnx_defs import bfloat16_dtype

    s = _adamw_state(n)
    s["M_1"] = np.zeros(n, bfloat16_dtype())
    s["V_1"] = np.zeros(n, bfloat16_dtype())
    return s


def _bf16_model(n: int):
    return _node_model("AdamWBf16State", _specs(_bf16_state, n), list(_BF16_REWRITTEN),
                       seed=1)


def _8bit_state(n: int) -> dict[str, np.ndarray]:
    from ..quantized import zero_state

    s = _adamw_state(n)
    del s["M_1"], s["V_1"]
    s.update({f"{k}_1": v for k, v in zero_state((n,)).items()})
    return s


def _8bit_model(n: int):
    return _node_model("AdamW8bit", _specs(_8bit_state, n), list(_8BIT_REWRITTEN))


def _ceiling2(n: int):
    return float_ceiling(n, streams=2)


ROWS: tuple[Row, ...] = (
    Row("AdamW float32", _adamw_model, _adamw_state, ("X_1", "M_1", "V_1"), 28,
        torch=_torch_adamw),
    Row("AdamWBf16State", _bf16_model, _bf16_state, _BF16_REWRITTEN, 20, ceiling=_ceiling2),
    Row("AdamW8bit", _8bit_model, _8bit_state, _8BIT_REWRITTEN, 16, ceiling=_ceiling2,
        ceiling_bytes_per_param=20),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], metavar="N",
                   help="intra_op_num_threads for onnxruntime, set_num_threads for torch "
                        "(default: 1 2)")
    p.add_argument("--no-torch", action="store_true", help="leave torch out even if installed")
    p.add_argument("--ort-spin", action="store_true", help="leave onnxruntime's spinning on")


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def build(n: int, args: argparse.Namespace, rows: tuple[Row, ...] = ROWS) -> Case:
    """Every row, its ceiling and its torch peer, for each ``args.threads``, on ``n``
    parameters. A row's ratio is over its ceiling; a torch peer's over its row."""
    spin, library = bool(getattr(args, "ort_spin", False)), getattr(args, "library", None)
    use_torch = not getattr(args, "no_torch", False) and _torch_available()
    notes = [f"{n:,} parameters in one tensor, in place; each row's ratio is over its own "
             "ceiling (MemoryCeiling of its traffic, same threads), a torch peer's over its row; "
             f"onnxruntime spinning {'on' if spin else 'off'}"]
    if not use_torch:
        notes.append("torch is not installed (or --no-torch): the torch peers are left out")
    else:
        notes.append("torch's thread count is process-wide: its peer sets it on each call "
                     "(the untimed call before each repetition absorbs the change)")
    peers: list[Peer] = []
    for row in rows:
        state = _ortvalues(row.state(n))
        cmodel, carrays, crewritten = row.ceiling(n)
        cstate = _ortvalues(carrays)
        torch_step = row.torch(n) if (use_torch and row.torch) else None
        for threads in args.threads:
            csess = ort_session(cmodel, threads, library, spin)
            cio = _bind(csess, cstate, crewritten)
            cbytes = row.ceiling_bytes_per_param or row.bytes_per_param
            ceiling = Peer(f"ceiling of {row.name}", lambda s=csess, b=cio: s.run_with_iobinding(b),
                           threads, f"MemoryCeiling: {cbytes} bytes/param"
                           + ("" if cbytes == row.bytes_per_param else
                              f" (the nearest to the row's {row.bytes_per_param})"),
                           keep=(csess, cio, cstate), nbytes=cbytes * n)
            ceiling.baseline = ceiling.label
            sess = ort_session(row.model(n), threads, library, spin)
            io = _bind(sess, state, list(row.rewritten))
            ours = Peer(f"trainops {row.name}", lambda s=sess, b=io: s.run_with_iobinding(b),
                        threads, f"{row.bytes_per_param} bytes/param, IOBinding in place",
                        keep=(sess, io, state), nbytes=row.bytes_per_param * n,
                        baseline=ceiling.label)
            peers += [ceiling, ours]
            if torch_step is not None:
                import torch

                step, keep, note = torch_step

                def call(t=threads, step=step):
                    torch.set_num_threads(t)
                    step()

                peers.append(Peer(f"torch {row.name}", call, threads, note, keep=keep,
                                  nbytes=row.bytes_per_param * n, baseline=ours.label))
    return Case(f"optimizers, {n:,} parameters", 28 * n, peers, peers[1].label, notes)


TARGET = Target("optim",
                "PyTorch-style optimizers (AdamW; AdamW with bfloat16 and 8-bit state) against "
                "their MemoryCeiling and torch's fused step",
                build, add_arguments, ("16e6",))
