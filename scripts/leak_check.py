"""Leak check of the trainops library in onnxruntime, driven by scripts/leaks.

    python scripts/leak_check.py rss  [--runs 10000] [--bound-kib 2048] [--ops OP,...]
    python scripts/leak_check.py loop [--runs 200] [--ops OP,...]   # under valgrind
    python scripts/leak_check.py reload [--runs 10]           # under valgrind: load, use, unload
    python scripts/leak_check.py valgrind-report LOG          # definitely lost in libtrainops

``reload``: ``--runs`` times, a session with the library registered runs Adam and is dropped
with nothing else holding the library, so onnxruntime unloads it (dlclose) and the next
registration loads it afresh. ``rss``: every workload (each op's correct run, each op's failing run, and session
creation with a correct and a refused node) runs ``--runs`` times in this one process
(sessions: a twentieth as many); after a warm-up of a tenth of the runs the resident set may
grow by at most ``--bound-kib`` per workload. ``--ops`` limits the workloads to some ops
(``test_robustness.KITS`` names; the Adam-only extras run when Adam is among them). ``loop``: the same workloads, fewer times, for
valgrind. ``valgrind-report``: sums valgrind's "definitely lost" records whose stack has a
frame in libtrainops (crate ``trainops`` or ``trainops_kernels``), apart from what the library
keeps alive on purpose, which it lists separately.

Kept alive on purpose: the three custom-op domains (``register::create_domains``) and the op
descriptors they hold (``OpDescriptor::leak``), made on the first registration and kept in a
static for every later one (onnxruntime keeps pointers to them while any session lives).
They are still reachable while the library is loaded; when onnxruntime unloads the library
(dlclose, once the last SessionOptions/session holding it is gone) the static goes with it and
valgrind reports them as definitely lost, about 1.9 KB per load. Linking the library with
``-z nodelete`` keeps it mapped, so they are made once per process (0 bytes lost).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def workloads(library: str, ops=None):
    """(name, kind, callable) for every workload (of ``ops`` only, when given): kind "run" or
    "session"."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python")]
    import numpy as np

    import test_robustness as rb

    h = rb.Harness(library)
    out = []
    unknown = set(ops or ()) - set(rb.KITS)
    if unknown:
        raise SystemExit(f"unknown ops {sorted(unknown)}; known: {', '.join(rb.KITS)}")
    for op in ops or rb.KITS:
        if h.missing(op):
            print(f"  ({op} is not registered by this library: skipped)")
            continue
        sess = h.session(rb.good_model(op))
        feeds = rb.good_feeds(op)
        out.append((f"{op} run", "run", lambda s=sess, f=feeds: s.run(None, f)))
        bad_model, bad = bad_input(rb, op, feeds)
        bad_sess = h.session(bad_model) if bad_model is not None else sess

        def fail(s=bad_sess, f=bad):
            try:
                s.run(None, f)
            except Exception:  # noqa: BLE001 - the error is the point
                return
            raise AssertionError("the bad input ran")
        out.append((f"{op} error", "run", fail))
        out.append((f"{op} session", "session", lambda m=rb.good_model(op): h.session(m)))
        refused_model = refused_node(rb, op)
        if refused_model is not None:
            def refused_op(m=refused_model):
                try:
                    h.session(m)
                except Exception:  # noqa: BLE001
                    return
                raise AssertionError("the bad node loaded")
            out.append((f"{op} refused node", "session", refused_op))
    if ops and "Adam" not in ops:
        return out
    # Refused at kernel creation (a wrong-typed attribute) and an error through IOBinding.
    bad_attr = rb.opt_model(rb.KITS["Adam"], attrs={"alpha": "x"})

    def refused():
        try:
            h.session(bad_attr)
        except Exception:  # noqa: BLE001
            return
        raise AssertionError("the bad node loaded")
    out.append(("Adam refused node", "session", refused))
    # A node shape inference finds wrong (R int64): ONNX Runtime ignores and never frees the
    # status that callback returns, so the library must not make one (it once did).
    ill_typed = rb.opt_model(rb.KITS["Adam"], types={"R": np.int64})
    out.append(("Adam ill-typed node", "session", lambda: h.session(ill_typed)))
    sess = h.session(rb.good_model("Adam"))
    buf = np.zeros(64, np.float32)

    def overlap(s=sess):
        custom = {"X_1_new": rb.at("X_1_new", buf, 0, np.float32, rb.SHAPES[0]),
                  "V_1_new": rb.at("V_1_new", buf, 4, np.float32, rb.SHAPES[0])}
        try:
            rb.bound_run(h, s, rb.good_feeds("Adam"), custom)
        except Exception:  # noqa: BLE001
            return
        raise AssertionError("overlapping outputs ran")
    out.append(("Adam IOBinding overlap error", "run", overlap))
    return out


def bad_input(rb, op, feeds):
    """(a model to run it in, or None for the op's correct one; feeds) that the op refuses."""
    import numpy as np

    kit = rb.KITS[op]
    if kit.optimizer:
        return None, {**feeds, "X_1": np.zeros((3, 3), np.float32)}
    if op in ("Philox", "PhiloxUniform", "PhiloxNormal"):
        return None, {**feeds, "state": np.zeros(5, np.uint32)}
    if op == "PhiloxDropout":  # a ratio outside [0, 1) in training mode
        return None, {**feeds, "ratio": np.array(1.5, np.float32)}
    if op == "DynamicLossScale":
        return None, {**feeds, "scale": np.ones(2, np.float32)}
    # AllFinite: an int32 tensor.
    return rb.all_finite_model((np.float32, np.int32)), {"X_1": np.zeros(3, np.float32),
                                                         "X_2": np.zeros(3, np.int32)}


def refused_node(rb, op):
    """A node of ``op`` refused when the session is made (kernel creation), or None."""
    if op in ("PhiloxUniform", "PhiloxNormal"):
        return rb.dist_model(op, attrs={"dtype": 6})
    return None


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["rss", "loop", "reload", "valgrind-report"])
    ap.add_argument("log", nargs="?")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--bound-kib", type=int, default=2048)
    ap.add_argument("--library", default=None)
    ap.add_argument("--ops", default=None, help="comma-separated ops (default: every registered op)")
    args = ap.parse_args(argv)
    if args.mode == "valgrind-report":
        return valgrind_report(args.log)
    sys.path.insert(0, str(ROOT / "python"))
    import trainops

    library = args.library or trainops.get_library_path()
    if args.mode == "reload":
        return reload(library, args.runs or 10)
    runs = args.runs or (10_000 if args.mode == "rss" else 200)
    failed = 0
    total = 0
    worst = (0, "")
    print(f"library: {library}; {runs} runs per workload (sessions: {max(1, runs // 20)})")
    for name, kind, fn in workloads(library, args.ops.split(",") if args.ops else None):
        n = runs if kind == "run" else max(1, runs // 20)
        warm = max(1, n // 10)
        for _ in range(warm):
            fn()
        before = rss_kib()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        growth = rss_kib() - before
        total += n + warm
        worst = max(worst, (growth, name))
        if args.mode == "rss":
            bad = growth > args.bound_kib
            failed += bad
            print(f"  {name:36s} {n:6d} x  {time.perf_counter() - t0:6.2f} s  RSS growth {growth:6d} KiB"
                  f"{'  > bound' if bad else ''}")
    print(f"runs: {total}")
    if args.mode == "rss":
        print(f"RSS: {failed} workload(s) grew by more than {args.bound_kib} KiB after warm-up; "
              f"largest growth {worst[0]} KiB ({worst[1]})")
    return 1 if failed else 0


def reload(library: str, cycles: int) -> int:
    import gc

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python")]
    import test_robustness as rb

    h = rb.Harness(library)
    for _ in range(cycles):
        sess = h.session(rb.good_model("Adam"))
        h.assert_usable("Adam", sess)
        del sess
        gc.collect()
        mapped = any("libtrainops" in line or Path(library).name in line for line in open("/proc/self/maps"))
    print(f"reload: {cycles} load/run/unload cycles; library still mapped after the last: {mapped}")
    return 0


KEPT_ON_PURPOSE = re.compile(r"trainops::register::create_domains|OpDescriptor(>)?::leak")


def valgrind_report(log: str) -> int:
    """Sums the "definitely lost" records of a valgrind log with a frame in libtrainops;
    exit status 1 when any is not one of the allocations kept on purpose."""
    text = Path(log).read_text(errors="replace")
    head = re.compile(r"([\d,]+) (?:\(([\d,]+) direct, ([\d,]+) indirect\) )?bytes in ([\d,]+) blocks are definitely lost")
    leaked = kept = 0
    records = kept_records = 0
    for record in re.split(r"\n==\d+== \n", text):
        m = head.search(record)
        if not m:
            continue
        frames = [line for line in record.splitlines() if re.search(r"\bby 0x|\bat 0x", line)]
        if not any(re.search(r"trainops(_kernels)?::|libtrainops", f) for f in frames):
            continue
        size = int(m.group(1).replace(",", ""))
        if any(KEPT_ON_PURPOSE.search(f) for f in frames):
            kept += size
            kept_records += 1
            continue
        leaked += size
        records += 1
        print("\n".join(record.splitlines()[:30]))
    summary = re.search(r"definitely lost: ([\d,]+) bytes in ([\d,]+) blocks", text)
    total = summary.group(1) if summary else "?"
    print(f"valgrind: definitely lost in libtrainops: {leaked} bytes in {records} records; "
          f"kept on purpose (domains and op descriptors, orphaned when the library is unloaded): "
          f"{kept} bytes in {kept_records} records; whole process, onnxruntime and Python "
          f"included: {total} bytes direct")
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
