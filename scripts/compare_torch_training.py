#!/usr/bin/env python3
"""Run the same training loop in PyTorch and with trainops.Trainer and print how far apart
they are: AdamW, gradient accumulation (loss / K), clip_grad_norm_ and a cosine schedule
with linear warmup (SequentialLR), on the MLP of tests/test_trainer.py, float32 on both
sides; then the schedules of trainops.optim.schedules against torch.optim.lr_scheduler.
Not part of CI (torch is not installed there); without torch it says so and exits 0.

    PYTHONPATH=python .venv/bin/python scripts/compare_torch_training.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

K, UPDATES, WARMUP, LR, WD, CLIP = 4, 25, 5, 0.02, 0.05, 1.0


def mlp_model(d=5, h=8, c=3, seed=0):
    """x -> MatMul w1 -> Add b1 -> Relu -> Gemm(w2, b2, transB) -> mean cross-entropy."""
    from onnx import TensorProto, helper, numpy_helper

    from trainops.onnx_defs import IR_VERSION, ONNX_OPSET

    rng = np.random.default_rng(seed)
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w1"], ["h"]), n("Add", ["h", "b1"], ["h1"]),
             n("Relu", ["h1"], ["a"]), n("Gemm", ["a", "w2", "b2"], ["logits"], transB=1),
             n("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), k)
             for k, s in [("w1", (d, h)), ("b1", (h,)), ("w2", (c, h)), ("b2", (c,))]]
    g = helper.make_graph(nodes, "mlp", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d]),
        helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    m.ir_version = IR_VERSION
    return m


def data(seed, n, d=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    return {"x": x, "t": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3).astype(np.int64)}


def initial_params(model):
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def torch_loop(p0, batches):
    import torch
    from torch.optim import lr_scheduler as L

    w = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in p0.items()}
    opt = torch.optim.AdamW(w.values(), lr=LR, weight_decay=WD)
    sched = L.SequentialLR(opt, [L.LinearLR(opt, 1 / 3, total_iters=WARMUP),
                                 L.CosineAnnealingLR(opt, UPDATES - WARMUP)], [WARMUP])
    losses, norms = [], []
    for i, f in enumerate(batches):
        x, t = torch.tensor(f["x"]), torch.tensor(f["t"])
        h = torch.relu(x @ w["w1"] + w["b1"])
        loss = torch.nn.functional.cross_entropy(h @ w["w2"].T + w["b2"], t)
        losses.append(loss.item())
        (loss / K).backward()
        if (i + 1) % K == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(w.values(), CLIP).item())
            opt.step()
            sched.step()
            opt.zero_grad()
    return losses, norms, {k: v.detach().numpy() for k, v in w.items()}


def trainops_loop(model, batches):
    from trainops import Trainer, optim
    from trainops.optim import schedules

    tr = Trainer(model, "loss", optim.AdamW(lr=LR, weight_decay=WD), threads=1,
                 clip_grad_norm=CLIP, accumulate=K, schedule=schedules.Cosine(UPDATES, WARMUP))
    losses, norms = [], []
    for i, f in enumerate(batches):
        losses.append(tr.step(f))
        if (i + 1) % K == 0:
            norms.append(tr.last_grad_norm)
    return losses, norms, tr.parameters()


def schedules_against_torch():
    import torch
    from torch.optim import lr_scheduler as L

    from trainops.optim import schedules as S

    cases = {
        "ConstantLR(0.5, 4)": (lambda o: L.ConstantLR(o, 0.5, 4),
                               S.Constant(factor=0.5, total_iters=4), 20),
        "LinearLR()": (lambda o: L.LinearLR(o), S.LinearWarmup(5), 20),
        "LinearLR(0.01, 1, 100)": (lambda o: L.LinearLR(o, 0.01, 1.0, 100),
                                   S.LinearWarmup(100, 0.01), 150),
        "CosineAnnealingLR(100, 1e-4)": (lambda o: L.CosineAnnealingLR(o, 100, 1e-4),
                                         S.Cosine(100, floor=1e-4), 101),
        "Sequential(LinearLR 10, Cosine 90)": (
            lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, total_iters=10),
                                         L.CosineAnnealingLR(o, 90, 1e-5)], [10]),
            S.Cosine(100, 10, 1e-5, 0.1), 101),
        "StepLR(7, 0.5)": (lambda o: L.StepLR(o, 7, 0.5), S.Step(7, 0.5), 60),
        "ExponentialLR(0.95)": (lambda o: L.ExponentialLR(o, 0.95), S.Exponential(0.95), 200),
        "OneCycleLR(0.3, 1000)": (lambda o: L.OneCycleLR(o, 0.3, 1000), S.OneCycle(0.3, 1000),
                                  1000),
        "OneCycleLR(linear, three_phase)": (
            lambda o: L.OneCycleLR(o, 0.3, 97, anneal_strategy="linear", three_phase=True),
            S.OneCycle(0.3, 97, anneal="linear", three_phase=True), 97),
        "LambdaLR(1 / (1 + s))": (lambda o: L.LambdaLR(o, lambda s: 1 / (1 + s)),
                                  S.Lambda(lambda s: 1 / (1 + s)), 50),
    }
    for name, (make, ours, n) in cases.items():
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.1)
        sched, ours = make(opt), ours.bind(0.1)
        worst = 0.0
        for s in range(n):
            lr = opt.param_groups[0]["lr"]
            worst = max(worst, abs(lr - ours(s)) / abs(lr))
            opt.step()
            sched.step()
        print(f"  {name:36s} {n:5d} steps, largest relative difference {worst:.1e}")


def main() -> int:
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to compare")
        return 0
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    batches = [data(seed=100 + i, n=16) for i in range(K * UPDATES)]
    model = mlp_model()
    tl, tn, tp = torch_loop(initial_params(model), batches)
    ol, on, op = trainops_loop(model, batches)
    rel = lambda a, b: float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))  # noqa: E731
    print(f"torch {torch.__version__}: {K * UPDATES} micro-batches, {UPDATES} updates "
          f"(AdamW, accumulate {K}, clip {CLIP}, cosine with {WARMUP} warmup)")
    print(f"  losses: largest relative difference {rel(ol, tl):.1e}")
    print(f"  total gradient norms: largest relative difference {rel(on, tn):.1e} "
          f"({sum(n > CLIP for n in tn)} of {UPDATES} updates clipped)")
    for k in tp:
        d = np.abs(op[k] - tp[k])
        print(f"  {k}: largest difference {d.max():.1e} (moved {np.abs(tp[k] - initial_params(model)[k]).max():.1e})")
    print("schedules against torch.optim.lr_scheduler (base lr 0.1):")
    schedules_against_torch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
