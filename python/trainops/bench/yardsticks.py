"""Yardsticks: peers that do a target's memory traffic and nothing else, so that a result
reads as a fraction of what the machine can move.

- :func:`ceiling_peers`: write-only ``memset`` of the output's byte count, on one thread
  and on two (:class:`MemsetPair`);
- :func:`memory_ceiling_model`: ``com.trainops.bench::MemoryCeiling``, an Adam node's
  inputs and outputs and its memory traffic with no arithmetic.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..onnx_defs import BENCH_DOMAIN, opset_imports
from .harness import Case, Peer

__all__ = ["MemsetPair", "ceiling_peers", "memory_ceiling_model"]


class MemsetPair:
    """Write-only yardstick on two threads: the calling thread and one persistent worker
    each ``memset`` half of a buffer. ctypes releases the GIL for the call, so the halves
    are written in parallel (:meth:`overlap` checks that they were)."""

    def __init__(self, address: int, nbytes: int):
        self.address, self.nbytes = address, nbytes
        self.half = (nbytes // 2) & ~63
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._stop = False
        self.spans: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]
        self._worker = threading.Thread(target=self._loop, name="memset-pair", daemon=True)
        self._worker.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._stop:
                return
            t0 = time.perf_counter()
            ctypes.memset(self.address + self.half, 0, self.nbytes - self.half)
            self.spans[1] = (t0, time.perf_counter())
            self._done.release()

    def __call__(self) -> None:
        self._go.release()
        t0 = time.perf_counter()
        ctypes.memset(self.address, 0, self.half)
        self.spans[0] = (t0, time.perf_counter())
        self._done.acquire()

    def overlap(self, tries: int = 7) -> float:
        """The median, over ``tries`` calls, of the fraction of the shorter half's time
        during which both halves were being written (0: one after the other, 1: fully
        parallel)."""
        fractions = []
        for _ in range(tries):
            self()
            (a0, a1), (b0, b1) = self.spans
            shorter = min(a1 - a0, b1 - b0)
            fractions.append(max(0.0, min(a1, b1) - max(a0, b0)) / shorter if shorter > 0 else 0.0)
        return statistics.median(fractions)

    def close(self) -> None:
        """Ends the worker thread."""
        if self._worker.is_alive():
            self._stop = True
            self._go.release()
            self._worker.join()


def ceiling_peers(buf: np.ndarray, case: Case, check: bool = True) -> None:
    """Adds the write-only memory ceiling for ``buf.nbytes`` to ``case``: ``memset`` into
    the preallocated (and already touched) ``buf`` on one thread and on two."""
    address, nbytes = buf.ctypes.data, buf.nbytes
    pair = MemsetPair(address, nbytes)
    case.cleanup.append(pair.close)
    if check:
        overlap = pair.overlap()
        case.notes.append(f"2-thread memset: the two halves were written at the same time "
                          f"for {100 * overlap:.0f}% of the shorter one's time (100% = fully "
                          f"parallel; thread hand-off costs tens of µs, which small sizes show)")
    case.peers += [
        Peer("write-only memset", lambda: ctypes.memset(address, 0, nbytes), 1,
             "ctypes.memset into a preallocated buffer", keep=buf),
        Peer("write-only memset", pair, 2, "two Python threads, half each (GIL released)",
             keep=buf),
    ]



def memory_ceiling_model(shapes: Sequence[Any], g_dtype: Any = None, *, streams: int = 3,
                         dtype: Any = np.float32):
    """``com.trainops.bench::MemoryCeiling`` over tensors of ``shapes``: the model of
    :func:`trainops.models.adam_model` (``streams=3``: ``x += g, v += g, h += g`` in place,
    Adam's traffic) or of :func:`trainops.models.adagrad_model` (``streams=2``: ``X, G, H``,
    Adagrad's and Momentum's traffic) with the op swapped, X and the streams of ``dtype``
    (float32, float16 or bfloat16; R stays float32), G of ``g_dtype`` (default ``dtype``)."""
    from onnx import helper

    from ..models import adagrad_model, adam_model

    make = {3: adam_model, 2: adagrad_model}[streams]
    model = make(shapes, dtype, np.float32, g_dtype=g_dtype)
    node = model.graph.node[0]
    node.op_type = "MemoryCeiling"
    node.domain = BENCH_DOMAIN
    del node.attribute[:]
    if streams != 3:
        node.attribute.append(helper.make_attribute("streams", streams))
    model.opset_import.extend(opset_imports([BENCH_DOMAIN]))
    return model
