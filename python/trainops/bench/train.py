"""The ``train`` benchmark target (``python -m trainops bench train``): one training step
(forward, loss, backward, Adam) of each model family of :mod:`trainops.bench.train_models`
(an MLP with LayerNorm and GELU, the demo CNN, the CNN with BatchNorm, a transformer
encoder, a GRU classifier, a residual CNN) in trainops + ONNX Runtime
(:class:`trainops.Trainer`) against PyTorch eager on the same model (the same initial
weights), batch and thread count, and ``torch.compile`` with ``--compile`` (where it
works: a peer whose compilation fails is left out with the reason).

Every peer of a row runs in this process, interleaved: repetition ``r`` runs each peer's
``--steps`` steps in an order rotated by ``r``; each figure is the median time per step
over the repetitions, and the ratio is torch's time over trainops' (above 1: trainops is
faster). ``--profile``: the trainops step's time by op type (ONNX Runtime's profiler);
``--memory``: each peer's peak memory, one subprocess each (:mod:`.train_profile` says how).
PyTorch is optional; without it the torch columns say so. ``--providers EP`` (``webgpu``,
``openvino``, ...) trains on that execution provider instead and prints the step time and
the host<->device transfers per step (:mod:`.train_ep`).

    python -m trainops bench train --threads 1,2 --profile --memory --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

from .harness import Target, format_rows

__all__ = ["TARGET", "run", "main", "build_parser"]


def _trainops_peer(fam, threads: int, lr: float) -> Callable[[], Any]:
    from .. import optim
    from ..train import Trainer

    trainer = Trainer(fam.model, "loss", optim.Adam(lr=lr), params=fam.params, threads=threads)
    return lambda: trainer.step(fam.feeds)


def _torch_peer(fam, threads: int, lr: float, compiled: bool = False) -> Callable[[], Any]:
    import torch

    from .train_torch import torch_model

    torch.set_num_threads(threads)
    net = torch_model(fam)
    opt = torch.optim.Adam(net.parameters(), lr=lr, eps=1e-6)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, t = torch.from_numpy(fam.feeds["x"]), torch.from_numpy(fam.feeds["t"])
    fwd = torch.compile(net) if compiled else net

    def step():
        torch.set_num_threads(threads)  # process-wide in torch: set before every step
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(fwd(x), t)
        loss.backward()
        opt.step()
        return float(loss.detach())

    if compiled:
        step()  # compile now: a failure is the caller's to report
    return step


def _ort_training_peer(fam, threads: int, lr: float) -> Callable[[], Any]:
    """onnxruntime-training's on-device training API (``generate_artifacts``, ``Module``,
    ``Optimizer``; AdamW, its only Adam) on the same model: a peer measured by hand where
    onnxruntime-training is installed (it replaces onnxruntime in its environment)."""
    import tempfile

    import onnxruntime as ort
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from onnx import TensorProto, helper

    # Its gradient builder needs SoftmaxCrossEntropyLoss's log_prob output, so the model
    # ends at the logits and generate_artifacts adds its own cross-entropy loss.
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(fam.model)
    sce = m.graph.node[-1]
    assert sce.op_type == "SoftmaxCrossEntropyLoss"
    logits = sce.input[0]
    del m.graph.node[-1]
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["N", 10]))
    del m.graph.input[1:]  # the labels become the loss block's input
    for i, n in enumerate(m.graph.node):  # its LayerNormGrad reads the saved statistics
        if n.op_type == "LayerNormalization":
            n.output.extend(f"ortt/ln{i}/{k}" for k in ("mean", "inv_std")[len(n.output) - 1:])
    params = list(fam.params)
    ort.set_default_logger_severity(3)
    d = tempfile.mkdtemp(prefix="trainops-bench-ortt-")
    frozen = [i.name for i in m.graph.initializer if i.name not in params]
    artifacts.generate_artifacts(m, requires_grad=params, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=d)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    state = CheckpointState.load_checkpoint(f"{d}/checkpoint")
    module = Module(f"{d}/training_model.onnx", state, session_options=so)
    opt = Optimizer(f"{d}/optimizer_model.onnx", module)
    opt.set_learning_rate(lr)
    module.train()
    feeds = fam.feeds

    def step():
        loss = module(feeds["x"], feeds["t"])
        opt.step()
        module.lazy_reset_grad()
        return loss

    return step


def _measure(peers: dict[str, Callable[[], Any]], repeat: int, steps: int) -> dict[str, float]:
    names = list(peers)
    times: dict[str, list[float]] = {n: [] for n in names}
    for fn in peers.values():  # warm-up
        for _ in range(3):
            fn()
    for r in range(repeat):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            fn = peers[n]
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[n].append((time.perf_counter() - t0) / steps)
    return {n: statistics.median(v) for n, v in times.items()}


def build_parser() -> argparse.ArgumentParser:
    from .train_models import FAMILIES

    ap = argparse.ArgumentParser(prog="python -m trainops bench train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None,
                    help=f"comma-separated, of: {', '.join(FAMILIES)} (default: {DEFAULT_MODELS}; "
                         "with --providers: mlp,cnn,transformer)")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch size (default: each family's, train_models.DEFAULT_BATCH)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="steps per repetition")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    ap.add_argument("--compile", action="store_true",
                    help="add torch.compile (inductor) as a peer where it compiles")
    ap.add_argument("--profile", action="store_true",
                    help="the trainops step's time by op type (ONNX Runtime's profiler)")
    ap.add_argument("--top", type=int, default=8, help="op types shown by --profile")
    ap.add_argument("--memory", action="store_true",
                    help="peak memory of each peer (one subprocess each)")
    ap.add_argument("--ort-training", action="store_true",
                    help="add onnxruntime-training's Module+Optimizer as a peer (needs "
                         "onnxruntime-training installed in place of onnxruntime)")
    ap.add_argument("--providers", metavar="EP", default=None,
                    help="train on this execution provider instead (webgpu, openvino, or a "
                         "provider name): the step time and the host<->device transfers per "
                         "step (trainops.bench.train_ep), no torch peer")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    return ap


DEFAULT_MODELS = "mlp,bncnn,transformer,gru,resnet"
LABELS = {"torch": "torch eager", "compile": "torch.compile", "ort-training": "onnxruntime-training"}
NAMES = {"mlp": "MLP 256-512-512-10, LayerNorm+GELU", "cnn": "CNN (demo, 8x8 digits)",
         "bncnn": "CNN + BatchNorm (8x8 digits)", "transformer": "transformer encoder, 2 x d64",
         "gru": "GRU 64 classifier, seq 16", "resnet": "residual CNN, 3x32x32"}


def _peers(fam, threads, args, torch_version, notes):
    peers = {"trainops": _trainops_peer(fam, threads, args.lr)}
    if torch_version:
        peers["torch"] = _torch_peer(fam, threads, args.lr)
        if args.compile:
            try:
                peers["compile"] = _torch_peer(fam, threads, args.lr, compiled=True)
            except Exception as exc:  # noqa: BLE001  (any failure: the peer is left out)
                notes.append(f"torch.compile on {fam.name}: left out "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    if args.ort_training:
        peers["ort-training"] = _ort_training_peer(fam, threads, args.lr)
    return peers


# The op types whose time is matrix products (GEMMs, convolutions, recurrent cells and
# their gradients), in a trainops step's profile: torch eager's step time over theirs bounds
# the ratio trainops can reach without faster matrix products.
DENSE_OPS = frozenset({"Gemm", "MatMul", "FusedMatMul", "FusedGemm", "Conv", "FusedConv",
                       "ConvTranspose", "ConvWeightGrad", "ConvInputGrad", "BlockedMatMul", "GRU", "GRUGrad",
                       "GRUTrain", "LSTM", "LSTMGrad", "LSTMTrain", "RNN"})


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.providers:
        from .train_ep import EP_MODELS, run_providers

        args.models = args.models or EP_MODELS
        return run_providers(args)
    args.models = args.models or DEFAULT_MODELS
    import onnxruntime as ort

    from .host import loadavg
    from .train_models import family
    from .train_profile import op_breakdown, peak_memory

    torch_version = None
    if not args.no_torch:
        try:
            import torch

            torch_version = torch.__version__
        except ImportError:
            pass
    rows, notes = [], []
    load_before = loadavg()
    for model in args.models.split(","):
        fam = family(model, args.batch)
        batch = len(fam.feeds["t"])
        for threads in (int(t) for t in args.threads.split(",")):
            med = _measure(_peers(fam, threads, args, torch_version, notes), args.repeat, args.steps)
            row = {"model": model, "batch": batch, "threads": threads,
                   "ms": {k: v * 1e3 for k, v in med.items()}, "load": loadavg()}
            if args.profile:
                row["profile_us"] = op_breakdown(fam, threads)
            if args.memory:
                row["peak_mib"] = {p: (None if b is None else b / 2**20) for p in
                                   (["trainops"] + (["torch"] if torch_version else []))
                                   for b in [peak_memory(model, batch, p, threads)]}
            rows.append(row)
    others = [p for p in LABELS if any(p in r["ms"] for r in rows)]
    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{load_before} before, {loadavg()} after; "
              f"one training step (forward, loss, backward, Adam), median of {args.repeat} "
              f"x {args.steps} steps, peers interleaved in one process; onnxruntime "
              f"{ort.__version__}, torch {torch_version or 'not installed'}; BatchNorm in "
              "training mode (batch statistics) in both")
    cols = ["model", "batch", "threads", "trainops"]
    for p in others:
        cols += [LABELS[p], f"{LABELS[p]} / trainops"]
    if args.memory:
        cols += ["peak MiB trainops", "peak MiB torch"]
    table = []
    for r in rows:
        ms = r["ms"]
        line = [NAMES.get(r["model"], r["model"]), str(r["batch"]), str(r["threads"]),
                f"{ms['trainops']:.3f} ms"]
        for p in others:
            line += [f"{ms[p]:.3f} ms", f"{ms[p] / ms['trainops']:.2f}x"] if p in ms else ["n/a"] * 2
        if args.memory:
            line += ["n/a" if v is None else f"{v:.1f}" for v in
                     (r["peak_mib"].get("trainops"), r["peak_mib"].get("torch"))]
        table.append(line)
    print(header + ("\n" if args.markdown else ""))
    print(format_rows(cols, table, args.markdown))
    for n in notes:
        print(f"\n{n}")
    if args.profile:
        for r in rows:
            prof = r["profile_us"]
            total = prof["(total kernels)"]
            top = [(k, v) for k, v in prof.items() if not k.startswith("(")][:args.top]
            print(f"\ntrainops {r['model']}, {r['threads']} thread(s): kernels "
                  f"{total / 1e3:.3f} ms of a {prof['(session run)'] / 1e3:.3f} ms run: "
                  + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top))
            dense = sum(v for k, v in prof.items() if k in DENSE_OPS)
            if dense and "torch" in r["ms"]:
                print(f"  matrix-product ops {dense / 1e3:.3f} ms: torch eager / that = "
                      f"{r['ms']['torch'] * 1e3 / dense:.2f}x, the ratio were all else free")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows, "notes": notes}, f, indent=2)
    return 0


main = run

TARGET = Target("train", "one training step (forward, loss, backward, Adam): trainops.Trainer "
                "against PyTorch eager", command=run)

if __name__ == "__main__":
    sys.exit(run())
