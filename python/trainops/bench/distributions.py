"""The ``random`` benchmark target: ``python -m trainops bench random``.

Float32 uniform numbers and dropout, ``--sizes`` bytes of float32 output (default 1 MiB,
64 MiB), in one process: com.trainops::PhiloxUniform and PhiloxDropout (through IOBinding:
preallocated outputs, the state advanced in place) against the raw Philox bits of the same
byte count (com.trainops::Philox, the baseline on 1 thread), onnxruntime's own RandomUniform
and Dropout (training mode, ratio 0.5) for each ``--threads``, numpy's ``Generator.random``
(PCG64) and numpy's ``Generator`` on randomgen's Philox4x32, both into a preallocated array.

Targets: PhiloxUniform and PhiloxDropout at >= 80 % of the raw bits' throughput
on the same threads, and PhiloxUniform >= 5x onnxruntime's RandomUniform; the lines after
each table say how each target fared.
"""

from __future__ import annotations

import argparse

import numpy as np

from .harness import Case, Peer, Result, Target, ort_session, size_label

__all__ = ["TARGET", "build", "target_lines"]

RATIO = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], metavar="N",
                   help="intra_op_num_threads of the onnxruntime sessions (default: 1 2)")
    p.add_argument("--ort-spin", action="store_true",
                   help="leave onnxruntime's intra-op spinning on (default: off)")


def _stock_models(n: int):
    """onnxruntime's own RandomUniform and Dropout (training mode) over ``n`` floats."""
    from onnx import TensorProto, helper

    from ..onnx_defs import IR_VERSION, opset_imports

    def model(nodes, inputs, outputs):
        m = helper.make_model(helper.make_graph(nodes, "stock", inputs, outputs),
                              opset_imports=opset_imports([""]), producer_name="trainops")
        m.ir_version = IR_VERSION
        return m

    vi = helper.make_tensor_value_info
    uniform = model([helper.make_node("RandomUniform", [], ["output"], shape=[n], dtype=1)],
                    [], [vi("output", TensorProto.FLOAT, [n])])
    dropout = model([
        helper.make_node("Constant", [], ["ratio"],
                         value=helper.make_tensor("r", TensorProto.FLOAT, [], [RATIO])),
        helper.make_node("Constant", [], ["training"],
                         value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        helper.make_node("Dropout", ["data", "ratio", "training"], ["output"]),
    ], [vi("data", TensorProto.FLOAT, [n])], [vi("output", TensorProto.FLOAT, [n])])
    return uniform, dropout


def build(nbytes: int, args: argparse.Namespace) -> Case:
    """Peers writing ``nbytes`` of float32 (uint32 for the raw bits); the baseline is the
    raw Philox bits through IOBinding on 1 thread (or the first ``--threads``)."""
    import onnxruntime as ort

    from ..models import philox_model
    from ..random import dropout_model, state, uniform_model

    n = nbytes // 4
    if n * 4 != nbytes:
        raise ValueError(f"random: {nbytes} bytes is not a whole number of float32 elements")
    spin = bool(getattr(args, "ort_spin", False))
    library = getattr(args, "library", None)
    stock_uniform, stock_dropout = _stock_models(n)
    data = np.ones(n, np.float32)
    ratio = np.array(RATIO, np.float32)
    training = np.array(True)
    peers: list[Peer] = []
    notes = [f"onnxruntime intra-op spinning {'on' if spin else 'off'}; dropout ratio {RATIO}, "
             "training mode, no mask output; trainops ops through IOBinding with the state "
             "advanced in place, onnxruntime's into preallocated outputs"]

    def bound(sess, inputs, outputs, state_value=None):
        io = sess.io_binding()
        for name, value in inputs.items():
            io.bind_ortvalue_input(name, value)
        for name, value in outputs.items():
            io.bind_ortvalue_output(name, value)
        if state_value is not None:
            io.bind_ortvalue_input("state", state_value)
            io.bind_ortvalue_output("state_out", state_value)
        return io

    value = ort.OrtValue.ortvalue_from_numpy
    for threads in args.threads:
        st = value(state(20240601))
        bits = value(np.ones(n, np.uint32))
        out_u = value(np.ones(n, np.float32))
        out_d = value(np.ones(n, np.float32))
        out_su = value(np.ones(n, np.float32))
        out_sd = value(np.ones(n, np.float32))
        ins = {"data": value(data), "ratio": value(ratio), "training_mode": value(training)}
        cases = [
            ("trainops Philox bits", philox_model([n]), {}, {"output": bits}, True,
             "com.trainops::Philox, uint32 words: the throughput to match"),
            ("trainops PhiloxUniform", uniform_model([n], np.float32), {}, {"output": out_u}, True,
             "com.trainops::PhiloxUniform, float32"),
            ("trainops PhiloxDropout", dropout_model(np.float32, mask=False, shape=[n]), ins,
             {"output": out_d}, True, "com.trainops::PhiloxDropout, float32 data"),
            ("onnxruntime RandomUniform", stock_uniform, {}, {"output": out_su}, False,
             "onnxruntime's own RandomUniform, float32"),
            ("onnxruntime Dropout", stock_dropout, {"data": ins["data"]}, {"output": out_sd}, False,
             "onnxruntime's own Dropout, training mode"),
        ]
        for name, model, inputs, outputs, with_state, note in cases:
            sess = ort_session(model, threads, library, spin)
            io = bound(sess, inputs, outputs, st if with_state else None)
            peers.append(Peer(name, lambda s=sess, b=io: s.run_with_iobinding(b), threads, note,
                              keep=(st, inputs, outputs)))
    buf = np.ones(n, np.float32)
    gen = np.random.default_rng(12345)
    peers.append(Peer("numpy Generator.random", lambda: gen.random(n, dtype=np.float32, out=buf),
                      1, "default_rng().random(n, dtype=float32, out=...) (PCG64)"))
    try:
        import randomgen

        rg = np.random.Generator(randomgen.Philox(number=4, width=32))
        buf2 = np.ones(n, np.float32)
        peers.append(Peer("randomgen Philox4x32", lambda: rg.random(n, dtype=np.float32, out=buf2),
                          1, "Generator(randomgen.Philox(number=4, width=32)).random(n, float32)"))
    except ImportError:
        notes.append("randomgen is not installed: its peer is left out")
    baseline = peers[0].label
    return Case(f"Random float32, {size_label(nbytes)} of output", nbytes, peers, baseline, notes)


def target_lines(results: list[Result]) -> list[str]:
    """How the issue's targets fared, per case and thread count."""
    lines = []
    by_case: dict[str, dict[str, Result]] = {}
    for r in results:
        by_case.setdefault(r.case, {})[r.peer] = r
    for case, peers in by_case.items():
        threads = sorted({r.threads for r in peers.values() if r.peer.startswith("trainops")})
        for t in threads:
            label = f"{t} thread{'s' if t != 1 else ''}"
            get = peers.get
            bits, uni, drop = (get(f"trainops Philox bits, {label}"), get(f"trainops PhiloxUniform, {label}"),
                               get(f"trainops PhiloxDropout, {label}"))
            stock = get(f"onnxruntime RandomUniform, {label}")
            if not (bits and uni and drop and stock):
                continue
            u, d = bits.median / uni.median, bits.median / drop.median
            s = stock.median / uni.median

            def verdict(ok):
                return "met" if ok else "MISSED"

            lines.append(f"{case}, {label}: uniform {u:.0%} of raw bits ({verdict(u >= 0.8)}), "
                         f"dropout {d:.0%} ({verdict(d >= 0.8)}), uniform {s:.1f}x onnxruntime "
                         f"RandomUniform ({verdict(s >= 5)})")
    return lines


def after(results: list[Result], args: argparse.Namespace) -> None:
    print()
    print("targets: PhiloxUniform and PhiloxDropout >= 80% of the raw Philox bits' throughput; "
          "PhiloxUniform >= 5x onnxruntime's RandomUniform")
    for line in target_lines(results):
        print("  " + line)


TARGET = Target("random", "PhiloxUniform and PhiloxDropout against the raw bits, onnxruntime's "
                "RandomUniform/Dropout, numpy and randomgen", build, add_arguments, after=after)
