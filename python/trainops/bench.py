"""Benchmarks: ``python -m trainops bench <target> [options]``.

Not tests: timings depend on the machine and on whatever else runs on it. Each target
builds, for every output size, a :class:`Case`: a list of :class:`Peer` callables that do
the same amount of work (``nbytes`` of output) and the name of the peer the others are
compared with. :func:`measure` times all peers of a case in one process, interleaved
(repetition ``r`` runs every peer once, in an order rotated by ``r``, each right after an
untimed call of its own), after a warm-up; each peer's figure is the median over the
repetitions. :func:`format_table` prints the medians, GB/s (10^9 bytes of output per
second) and the ratio to the baseline.

Targets:
  philox   com.trainops::Philox in onnxruntime against randomgen's Philox4x32, numpy's
           PCG64 and a write-only memory ceiling (memset) of the same byte count

A new target is a function ``(nbytes, args) -> Case`` registered with :func:`target`;
its own options go in ``add_arguments``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Peer", "Case", "Result", "Target", "TARGETS", "target", "measure", "format_table",
    "parse_size", "size_label", "MemsetPair", "ceiling_peers", "CpuMeter", "environment",
    "run", "build_parser", "main",
]


@dataclass
class Peer:
    """One contender: ``run()`` does one call's work (its return value is dropped)."""

    name: str
    run: Callable[[], Any]
    threads: int = 1
    note: str = ""
    keep: Any = None  # whatever ``run`` needs kept alive (buffers, OrtValues)

    @property
    def label(self) -> str:
        return f"{self.name}, {self.threads} thread{'s' if self.threads != 1 else ''}"


@dataclass
class Case:
    """Peers doing the same work: ``nbytes`` of output per call; ``baseline`` is the
    :attr:`Peer.label` the others are compared with."""

    title: str
    nbytes: int
    peers: list[Peer]
    baseline: str
    notes: list[str] = field(default_factory=list)
    cleanup: list[Callable[[], None]] = field(default_factory=list)  # run after measuring


@dataclass
class Result:
    """One peer's timings in one case, seconds per call."""

    case: str
    nbytes: int
    peer: str
    threads: int
    number: int  # calls per repetition
    seconds: list[float]
    baseline: str
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0.05 = 5 %)."""
        if len(self.seconds) < 4:
            return (max(self.seconds) - min(self.seconds)) / self.median
        q = statistics.quantiles(self.seconds, n=4)
        return (q[2] - q[0]) / self.median

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / 1e9


def _call(fn: Callable[[], Any], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def measure(case: Case, repeat: int = 15, warmup: int = 3, min_time: float = 0.01,
            settle: int = 1) -> list[Result]:
    """Times every peer of ``case``: ``warmup`` untimed calls each, then ``repeat``
    interleaved repetitions of ``number`` calls, ``number`` chosen per peer so that a
    repetition lasts at least ``min_time`` seconds. Each repetition is preceded by
    ``settle`` untimed calls of the same peer, so that every peer is timed in its own
    steady state (its buffers as warm as they get) whatever peer ran before it: without
    that, a peer that follows one writing another buffer of the same size finds its own
    evicted, and one that follows a peer sharing its buffer finds it warm. Garbage
    collection is off while timing."""
    peers = case.peers
    numbers = []
    for p in peers:
        for _ in range(max(warmup, 1)):
            p.run()
        once = _call(p.run, 1)
        numbers.append(max(1, math.ceil(min_time / once)) if once > 0 else 1000)
    seconds: list[list[float]] = [[] for _ in peers]
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeat):
            for k in range(len(peers)):
                i = (k + r) % len(peers)
                for _ in range(settle):
                    peers[i].run()
                seconds[i].append(_call(peers[i].run, numbers[i]))
    finally:
        if gc_was_on:
            gc.enable()
    return [Result(case.title, case.nbytes, p.label, p.threads, n, s, case.baseline, p.note)
            for p, n, s in zip(peers, numbers, seconds)]


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def format_table(results: Sequence[Result], markdown: bool = False) -> str:
    """A table per case: peer, threads, median time per call, GB/s, ratio to the baseline
    (higher is faster), and the spread (interquartile range / median)."""
    out: list[str] = []
    cases: dict[str, list[Result]] = {}
    for r in results:
        cases.setdefault(r.case, []).append(r)
    for title, rows in cases.items():
        base = next((r for r in rows if r.peer == rows[0].baseline), None)
        header = ["peer", "threads", "time/call", "GB/s", "ratio", "spread"]
        body = []
        for r in rows:
            ratio = f"{r.gbps / base.gbps:.2f}x" if base else "-"
            body.append([r.peer, str(r.threads), _fmt_time(r.median), f"{r.gbps:.2f}", ratio,
                         f"{100 * r.spread:.0f}%"])
        caption = (f"{title}: median of {len(rows[0].seconds)}; ratio = GB/s over "
                   f"{rows[0].baseline}'s; spread = interquartile range / median")
        if markdown:
            out.append(f"**{caption}**\n")
            out.append("| " + " | ".join(header) + " |")
            out.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
            out += ["| " + " | ".join(row) + " |" for row in body]
        else:
            out.append(caption)
            widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
            for row in [header] + body:
                cells = [row[0].ljust(widths[0])]
                cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
                out.append("  ".join(cells).rstrip())
        notes: dict[str, set[str]] = {}
        for r in rows:
            if r.note:
                notes.setdefault(r.peer.rsplit(", ", 1)[0], set()).add(r.note)
        lines = [f"- {peer}: {'; '.join(sorted(n))}" for peer, n in notes.items()]
        out += ["", *lines] if lines else []
        out.append("")
    return "\n".join(out).rstrip() + "\n"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(text: str) -> int:
    """``"4096"``, ``"1MiB"``, ``"64 MiB"``, ``"1e6"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 1MiB, 64MiB)")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 1 or n != int(n):
        raise argparse.ArgumentTypeError(f"not a whole positive number of bytes: {text!r}")
    return int(n)


def size_label(nbytes: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= k and nbytes % k == 0:
            return f"{nbytes // k} {unit}"
    return f"{nbytes} B"


# --- shared peers ------------------------------------------------------------------------

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


# --- targets -----------------------------------------------------------------------------

@dataclass
class Target:
    """A benchmark target: ``build(nbytes, args)`` makes the :class:`Case` of one size."""

    name: str
    help: str
    build: Callable[[int, argparse.Namespace], Case]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    default_sizes: tuple[str, ...] = ("1MiB", "64MiB")
    after: Callable[[list[Result], argparse.Namespace], None] | None = None  # e.g. a plot


TARGETS: dict[str, Target] = {}


def target(name: str, help: str, add_arguments=None, default_sizes=("1MiB", "64MiB")):
    """Registers ``fn(nbytes, args) -> Case`` as benchmark target ``name``."""
    def register(fn: Callable[[int, argparse.Namespace], Case]):
        TARGETS[name] = Target(name, help, fn, add_arguments, tuple(default_sizes))
        return fn
    return register


def _philox_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], metavar="N",
                   help="intra_op_num_threads of the onnxruntime sessions (default: 1 2)")
    p.add_argument("--ort-spin", action="store_true",
                   help="leave onnxruntime's intra-op spinning on (default: off, so that a "
                        "session's spinning workers do not take a core from the peer timed "
                        "after it)")


def _ort_session(model: Any, threads: int, library: str | None, spin: bool):
    import onnxruntime as ort

    from .models import session_options

    so = session_options(threads, library, log_severity_level=3)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


@target("philox", "com.trainops::Philox against randomgen, numpy PCG64 and memset",
        _philox_arguments)
def philox_case(nbytes: int, args: argparse.Namespace) -> Case:
    """Peers writing ``nbytes`` of uint32: trainops' Philox through ``session.run`` and
    through IOBinding (preallocated output, state advanced in place) for each of
    ``args.threads``; randomgen's Philox4x32; numpy's PCG64; memset on 1 and 2 threads.
    The baseline is trainops IOBinding on 1 thread."""
    import onnxruntime as ort

    from .models import philox_model

    n = nbytes // 4
    if n * 4 != nbytes:
        raise ValueError(f"philox: {nbytes} bytes is not a whole number of uint32 words")
    spin = bool(getattr(args, "ort_spin", False))
    model = philox_model([n])
    state = np.array([0x01234567, 0x89ABCDEF, 0, 0, 0xDEADBEEF, 0x12345678], np.uint32)
    peers: list[Peer] = []
    notes: list[str] = [f"onnxruntime intra-op spinning {'on' if spin else 'off'}"]
    for threads in args.threads:
        sess = _ort_session(model, threads, getattr(args, "library", None), spin)
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


# --- command line ------------------------------------------------------------------------

def environment(library: str | None = None) -> dict[str, Any]:
    """Date, machine and versions, for the table's header and the JSON."""
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        if m:
            env["cpu"] = m.group(1).strip()
        flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
        if flags:
            have = set(flags.group(1).split())
            env["simd"] = " ".join(f for f in ("avx2", "avx512f") if f in have)
    except OSError:
        pass
    for mod in ("onnxruntime", "randomgen"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if library is None:
        try:
            from . import get_library_path

            library = get_library_path()
        except FileNotFoundError:
            library = None
    env["library"] = library
    return env


class CpuMeter:
    """CPU time used by other processes while a benchmark runs, in cores on average (from
    ``/proc/stat`` minus this process's own time): the noise figure of a shared machine.
    ``None`` where ``/proc/stat`` is not readable."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / tick
        own = sum(os.times()[:4])
        return time.monotonic(), busy, own

    def others(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        wall = end[0] - self._start[0]
        return max(0.0, (end[1] - self._start[1]) - (end[2] - self._start[2])) / wall


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainops bench",
        description="Throughput benchmarks (not tests: timings are noisy). Every peer of a "
                    "size runs in this process, interleaved; figures are medians.")
    sub = parser.add_subparsers(dest="target", metavar="target")
    sub.required = True
    for t in TARGETS.values():
        p = sub.add_parser(t.name, help=t.help, description=t.help)
        p.add_argument("--sizes", type=parse_size, nargs="+", metavar="SIZE",
                       default=[parse_size(s) for s in t.default_sizes],
                       help=f"output bytes per call (default: {' '.join(t.default_sizes)})")
        p.add_argument("--repeat", type=int, default=15, help="repetitions (default: 15)")
        p.add_argument("--warmup", type=int, default=3, help="untimed calls per peer (default: 3)")
        p.add_argument("--min-time", type=float, default=0.01, metavar="S",
                       help="least seconds per repetition of a peer (default: 0.01)")
        p.add_argument("--settle", type=int, default=1, metavar="N",
                       help="untimed calls of a peer right before each of its repetitions "
                            "(default: 1; 0 times each peer in whatever cache state the "
                            "peer before it left)")
        p.add_argument("--library", metavar="PATH",
                       help="custom-op library (default: trainops.get_library_path())")
        p.add_argument("--markdown", action="store_true", help="print markdown tables")
        p.add_argument("--json", metavar="FILE",
                       help="also write the results as JSON to FILE ('-': stdout, no table)")
        if t.add_arguments:
            t.add_arguments(p)
    return parser


def run(args: argparse.Namespace) -> tuple[list[Result], dict[str, list[str]]]:
    """Builds and measures ``args.target`` for every size in ``args.sizes``, one size at a
    time; returns the results and each case's notes."""
    t = TARGETS[args.target]
    results: list[Result] = []
    notes: dict[str, list[str]] = {}
    for nbytes in args.sizes:
        case = t.build(nbytes, args)
        try:
            results += measure(case, repeat=args.repeat, warmup=args.warmup,
                               min_time=args.min_time, settle=args.settle)
        finally:
            for f in case.cleanup:
                f()
        notes[case.title] = case.notes
    return results, notes


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeat < 1:
        print("error: --repeat must be at least 1", file=sys.stderr)
        return 2
    try:
        env = environment(args.library)
    except Exception as exc:  # pragma: no cover - environment() only reads
        env = {"error": str(exc)}
    if env.get("library") is None:
        print("error: the trainops library was not found (give --library or set "
              "TRAINOPS_LIBRARY)", file=sys.stderr)
        return 2
    args.library = env["library"]
    to_stdout = args.json == "-"
    say = (lambda *a: None) if to_stdout else print
    env["load_before"] = _loadavg()
    say(f"{env['date']}; {env['cpu']} ({env.get('simd', '')}), {env['cores']} cores; "
        f"Python {env['python']}, numpy {env['numpy']}, onnxruntime {env['onnxruntime']}, "
        f"randomgen {env['randomgen']}")
    say(f"library {env['library']}")
    say(f"load average before: {env['load_before']}")
    t0 = time.perf_counter()
    meter = CpuMeter()
    results, notes = run(args)
    if TARGETS[args.target].after:
        TARGETS[args.target].after(results, args)
    others = meter.others()
    env["load_after"] = _loadavg()
    env["other_processes_cores"] = None if others is None else round(others, 2)
    env["seconds"] = round(time.perf_counter() - t0, 1)
    busy = "n/a" if others is None else f"{others:.2f}"
    say(f"load average after: {env['load_after']}; other processes used {busy} of "
        f"{env['cores']} cores on average during the run; {env['seconds']} s")
    say()
    say(format_table(results, markdown=args.markdown))
    for title, lines in notes.items():
        for line in lines:
            say(f"{title}: {line}")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "target"}
        doc = {"target": args.target, "environment": env, "options": options,
               "notes": notes,
               "results": [dict(asdict(r), median=r.median, gbps=r.gbps, spread=r.spread)
                           for r in results]}
        text = json.dumps(doc, indent=1)
        if to_stdout:
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
