"""The ``train`` benchmark target (``python -m trainops bench train``): one training step (forward, loss, backward, Adam) of an MLP and of the demo
CNN in trainops + ONNX Runtime (:class:`trainops.Trainer`) against PyTorch eager on the
same model (the same initial weights), batch and thread count.

Every peer of a row runs in this process, interleaved: repetition ``r`` runs each peer's
``--steps`` steps in an order rotated by ``r``; each figure is the median time per step
over the repetitions, and the ratio is torch's time over trainops' (above 1: trainops is
faster). PyTorch is optional; without it the torch columns say so.

    python -m trainops bench train --threads 1,2 --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from .harness import Target, format_rows

__all__ = ["TARGET", "run", "main", "build_parser"]

MLP_SIZES = (256, 512, 512, 10)


def _data(model: str, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == "mlp":
        x = rng.standard_normal((batch, MLP_SIZES[0])).astype(np.float32)
    else:
        from ..demos.train import digits

        x, _ = digits(batch, seed)
    return {"x": x, "t": rng.integers(0, 10, batch).astype(np.int64)}


def _onnx_model(model: str):
    from ..demos.train import cnn_model, mlp_model

    return mlp_model(sizes=MLP_SIZES) if model == "mlp" else cnn_model()


def _trainops_peer(model: str, batch: int, threads: int, lr: float) -> Callable[[], Any]:
    from .. import optim
    from ..train import Trainer

    trainer = Trainer(_onnx_model(model), "loss", optim.Adam(lr=lr), threads=threads)
    feeds = _data(model, batch)
    return lambda: trainer.step(feeds)


def _torch_peer(model: str, batch: int, threads: int, lr: float) -> Callable[[], Any]:
    import torch
    from onnx import numpy_helper

    w = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy())
         for i in _onnx_model(model).graph.initializer}
    nn = torch.nn
    if model == "mlp":
        layers = []
        for i in range(len(MLP_SIZES) - 1):
            lin = nn.Linear(MLP_SIZES[i], MLP_SIZES[i + 1])
            with torch.no_grad():
                lin.weight.copy_(w[f"fc{i}.w"].T)
                lin.bias.copy_(w[f"fc{i}.b"])
            layers.append(lin)
            if i < len(MLP_SIZES) - 2:
                layers.append(nn.ReLU())
        net = nn.Sequential(*layers)
    else:
        c1 = nn.Conv2d(1, 8, 3, padding=1)
        c2 = nn.Conv2d(8, 16, 3, padding=1)
        fc = nn.Linear(64, 10)
        with torch.no_grad():
            for mod, name in ((c1, "conv1"), (c2, "conv2"), (fc, "fc")):
                mod.weight.copy_(w[f"{name}.w"])
                mod.bias.copy_(w[f"{name}.b"])
        net = nn.Sequential(c1, nn.ReLU(), nn.MaxPool2d(2), c2, nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), fc)
    opt = torch.optim.Adam(net.parameters(), lr=lr, eps=1e-6)
    loss_fn = nn.CrossEntropyLoss()
    d = _data(model, batch)
    x, t = torch.from_numpy(d["x"]), torch.from_numpy(d["t"])

    def step():
        torch.set_num_threads(threads)  # process-wide in torch: set before every step
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), t)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _ort_training_peer(model: str, batch: int, threads: int, lr: float) -> Callable[[], Any]:
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
    m = _onnx_model(model)
    sce = m.graph.node[-1]
    assert sce.op_type == "SoftmaxCrossEntropyLoss"
    logits = sce.input[0]
    del m.graph.node[-1]
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["N", 10]))
    del m.graph.input[1:]  # the labels become the loss block's input
    params = [i.name for i in m.graph.initializer]
    ort.set_default_logger_severity(3)
    d = tempfile.mkdtemp(prefix="trainops-bench-ortt-")
    artifacts.generate_artifacts(m, requires_grad=params, frozen_params=[],
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
    feeds = _data(model, batch)

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
    ap = argparse.ArgumentParser(prog="python -m trainops bench train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="steps per repetition")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    ap.add_argument("--ort-training", action="store_true",
                    help="add onnxruntime-training's Module+Optimizer as a peer (needs "
                         "onnxruntime-training installed in place of onnxruntime)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    return ap


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import onnxruntime as ort

    torch_version = None
    if not args.no_torch:
        try:
            import torch

            torch_version = torch.__version__
        except ImportError:
            pass
    rows = []
    for model in args.models.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            peers = {"trainops": _trainops_peer(model, args.batch, threads, args.lr)}
            if torch_version:
                peers["torch"] = _torch_peer(model, args.batch, threads, args.lr)
            if args.ort_training:
                peers["ort-training"] = _ort_training_peer(model, args.batch, threads, args.lr)
            med = _measure(peers, args.repeat, args.steps)
            rows.append({"model": model, "batch": args.batch, "threads": threads,
                         "ms": {k: v * 1e3 for k, v in med.items()}})
    others = [p for p in ("torch", "ort-training") if any(p in r["ms"] for r in rows)]
    from .host import loadavg

    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{loadavg()}; "
              f"one training step (forward, loss, backward, optimizer), median of {args.repeat} "
              f"x {args.steps} steps, peers interleaved in one process; onnxruntime "
              f"{ort.__version__}, torch {torch_version or 'not installed'}")
    if "ort-training" in others:
        header += "; onnxruntime-training's Module + Optimizer (AdamW)"
    labels = {"torch": "torch eager", "ort-training": "onnxruntime-training"}
    names = {"mlp": "MLP " + "-".join(map(str, MLP_SIZES)), "cnn": "CNN (demo, 8x8 digits)"}
    cols = ["model", "batch", "threads", "trainops"]
    for p in others:
        cols += [labels[p], f"{labels[p]} / trainops"]
    table = []
    for r in rows:
        ms = r["ms"]
        line = [names[r["model"]], str(r["batch"]), str(r["threads"]), f"{ms['trainops']:.3f} ms"]
        for p in others:
            line += [f"{ms[p]:.3f} ms", f"{ms[p] / ms['trainops']:.2f}x"] if p in ms else ["n/a"] * 2
        table.append(line)
    print(header + ("\n" if args.markdown else ""))
    print(format_rows(cols, table, args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=2)
    return 0


main = run

TARGET = Target("train", "one training step (forward, loss, backward, Adam): trainops.Trainer "
                "against PyTorch eager", command=run)

if __name__ == "__main__":
    sys.exit(run())
