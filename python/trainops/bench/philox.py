"""The ``philox`` benchmark target: ``python -m trainops bench philox``.

com.trainops::Philox in onnxruntime (through IOBinding and through ``run()``, for each
``--threads``) against randomgen's Philox4x32, numpy's PCG64 and a write-only memory
ceiling (memset) of the same byte count. ``--sizes`` are output bytes (default 1MiB
64MiB).
"""

from __future__ import annotations

import argparse

import numpy as np

from .harness import Case, Peer, Target, ort_session, size_label
from .yardsticks import ceiling_peers

__all__ = ["TARGET", "build"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], metavar="N",
                   help="intra_op_num_threads of the onnxruntime sessions (default: 1 2)")
    p.add_argument("--ort-spin", action="store_true",
                   help="leave onnxruntime's intra-op spinning on (default: off, so that a "
                        "session's spinning workers do not take a core from the peer timed "
                        "after it)")


def build(nbytes: int, args: argparse.Namespace) -> Case:
    """Peers writing ``nbytes`` of uint32: trainops' Philox through ``session.run`` and
    through IOBinding (preallocated output, state advanced in place) for each of
    ``args.threads``; randomgen's Philox4x32; numpy's PCG64; memset on 1 and 2 threads.
    The baseline is trainops IOBinding on 1 thread."""
    import onnxruntime as ort

    from ..models import philox_model

    n = nbytes // 4
    if n * 4 != nbytes:
        raise ValueError(f"philox: {nbytes} bytes is not a whole number of uint32 words")
    spin = bool(getattr(args, "ort_spin", False))
    model = philox_model([n])
    state = np.array([0x01234567, 0x89ABCDEF, 0, 0, 0xDEADBEEF, 0x12345678], np.uint32)
    peers: list[Peer] = []
    notes: list[str] = [f"onnxruntime intra-op spinning {'on' if spin else 'off'}"]
    for threads in args.threads:
        sess = ort_session(model, threads, getattr(args, "library", None), spin)
        # IOBinding: a preallocated, already touched output; `state` in and `state_out`
        # bound to one OrtValue, so the state advances in place; nothing allocated per call.
        io = sess.io_binding()
        st = ort.OrtValue.ortvalue_from_numpy(state.copy())
        out = ort.OrtValue.ortvalue_from_numpy(np.ones(n, np.uint32))
        io.bind_ortvalue_input("state", st)
        io.bind_ortvalue_output("output", out)
        io.bind_ortvalue_output("state_out", st)
        peers.append(Peer("trainops ORT IOBinding", lambda s=sess, b=io: s.run_with_iobinding(b),
                          threads, "run_with_iobinding, preallocated output, state in place",
                          keep=(st, out)))
        # run(): onnxruntime allocates the output and hands it back as a new numpy array.
        peers.append(Peer("trainops ORT run()", lambda s=sess: s.run(None, {"state": state}),
                          threads, "session.run with the shape attribute"))
    try:
        import randomgen

        eg = randomgen.ExtendedGenerator(randomgen.Philox(number=4, width=32))
        peers.append(Peer("randomgen Philox4x32", lambda: eg.uintegers(n, bits=32), 1,
                          "ExtendedGenerator(Philox(number=4, width=32)).uintegers(n, bits=32)"))
    except ImportError:
        notes.append("randomgen is not installed: its peer is left out")
    pcg = np.random.PCG64(12345)
    half = (n + 1) // 2
    peers.append(Peer("numpy PCG64", lambda: pcg.random_raw(half).view(np.uint32), 1,
                      "PCG64().random_raw(n/2).view(uint32)"))
    first = next((p for p in peers if p.name == "trainops ORT IOBinding"), peers[0])
    case = Case(f"Philox, {size_label(nbytes)} of uint32 output", nbytes, peers, first.label,
                notes)
    ceiling_peers(np.ones(n, np.uint32), case)
    return case


TARGET = Target("philox", "com.trainops::Philox against randomgen, numpy PCG64 and memset",
                build, add_arguments)
