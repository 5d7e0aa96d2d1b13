"""The measuring machinery every benchmark target shares, and the command line.

A target builds, for every output size, a :class:`Case`: a list of :class:`Peer`
callables that do the same amount of work (``nbytes`` of output) and the name of the peer
the others are compared with. :func:`measure` times all peers of a case in one process,
interleaved (repetition ``r`` runs every peer once, in an order rotated by ``r``, each
right after an untimed call of its own), after a warm-up; each peer's figure is the median
over the repetitions. :func:`format_table` prints the medians, GB/s (10^9 bytes of output
per second) and the ratio to the baseline. :func:`main` is ``python -m trainops bench``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .host import CpuMeter, environment, loadavg

__all__ = [
    "Peer", "Case", "Result", "Target", "measure", "format_table", "format_rows", "parse_size",
    "size_label", "ort_session", "build_parser", "run", "main",
]


@dataclass
class Peer:
    """One contender: ``run()`` does one call's work (its return value is dropped)."""

    name: str
    run: Callable[[], Any]
    threads: int = 1
    note: str = ""
    keep: Any = None  # whatever ``run`` needs kept alive (buffers, OrtValues)
    nbytes: int | None = None  # bytes per call, when not the case's
    baseline: str | None = None  # the label this peer's ratio is over, when not the case's

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
    return [Result(case.title, p.nbytes or case.nbytes, p.label, p.threads, n, s,
                   p.baseline or case.baseline, p.note)
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
        by_label = {r.peer: r for r in rows}
        own = len({r.baseline for r in rows}) > 1  # each row against its own baseline
        header = ["peer", "threads", "time/call", "GB/s", "ratio", "spread"]
        body = []
        for r in rows:
            base = by_label.get(r.baseline)
            ratio = f"{r.gbps / base.gbps:.2f}x" if base else "-"
            body.append([r.peer, str(r.threads), _fmt_time(r.median), f"{r.gbps:.2f}", ratio,
                         f"{100 * r.spread:.0f}%"])
        over = "its own baseline's (the row's note)" if own else f"{rows[0].baseline}'s"
        caption = (f"{title}: median of {len(rows[0].seconds)}; ratio = GB/s over "
                   f"{over}; spread = interquartile range / median")
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


def format_rows(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False,
                left: int = 1) -> str:
    """A plain table of strings (for targets with their own command line): the first
    ``left`` columns left-aligned, the others right-aligned; markdown or padded text."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "---|" * left + "---:|" * (len(header) - left)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                 for r in [header, *rows]]
    return "\n".join(lines)


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


@dataclass
class Target:
    """A benchmark target: ``build(nbytes, args)`` makes the :class:`Case` of one size;
    ``add_arguments`` adds the target's own options; ``after`` runs on all the results
    (e.g. a plot).

    A target whose work is not "``nbytes`` of output per call" (a training step, a
    multi-process run) gives ``command`` instead of ``build``: its own command line,
    ``command(argv) -> exit status``, to which ``python -m trainops bench <name> ...``
    hands the rest of its arguments (it still measures peers in one process, interleaved,
    and reports ratios)."""

    name: str
    help: str
    build: Callable[[int, argparse.Namespace], Case] | None = None
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    default_sizes: tuple[str, ...] = ("1MiB", "64MiB")
    after: Callable[[list[Result], argparse.Namespace], None] | None = None
    command: Callable[[Sequence[str]], int] | None = None

    def __post_init__(self) -> None:
        if (self.build is None) == (self.command is None):
            raise ValueError(f"target {self.name!r}: give exactly one of build and command")


def ort_session(model: Any, threads: int, library: str | None, spin: bool):
    """A CPU session of ``model`` with the library registered, ``threads`` intra-op
    threads and onnxruntime's intra-op spinning on or off."""
    import onnxruntime as ort

    from ..models import session_options

    so = session_options(threads, library, log_severity_level=3)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


# --- command line ------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """``python -m trainops bench``'s parser: a subcommand per target of the table in
    :mod:`trainops.bench`, with the common options and the target's own."""
    from . import targets

    parser = argparse.ArgumentParser(
        prog="python -m trainops bench",
        description="Throughput benchmarks (not tests: timings are noisy). Every peer of a "
                    "size runs in this process, interleaved; figures are medians.")
    sub = parser.add_subparsers(dest="target", metavar="target")
    sub.required = True
    for t in targets().values():
        if t.command is not None:  # its own command line: main() hands it the arguments
            sub.add_parser(t.name, help=t.help, add_help=False)
            continue
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
    from . import load_target

    t = load_target(args.target)
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
    """``python -m trainops bench <target> [options]``: prints the environment, then a
    table per size (or JSON); 0 on success, 2 on a usage error."""
    from . import TARGETS, load_target

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TARGETS:
        command = load_target(argv[0]).command
        if command is not None:
            return command(argv[1:])
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
    env["load_before"] = loadavg()
    say(f"{env['date']}; {env['cpu']} ({env.get('simd', '')}), {env['cores']} cores; "
        f"Python {env['python']}, numpy {env['numpy']}, onnxruntime {env['onnxruntime']}, "
        f"randomgen {env['randomgen']}")
    say(f"library {env['library']}")
    say(f"load average before: {env['load_before']}")
    t0 = time.perf_counter()
    meter = CpuMeter()
    results, notes = run(args)
    after = load_target(args.target).after
    if after:
        after(results, args)
    others = meter.others()
    env["load_after"] = loadavg()
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

