#!/usr/bin/env python3
"""Train models exported from PyTorch with trainops and with PyTorch itself, and compare the
losses step by step (not CI: torch is not installed there).

Models: a batch-first GRU and an LSTM classifier, a Conv-BatchNorm CNN exported with
``training=TrainingMode.TRAINING`` (BatchNorm trains on batch statistics and updates its
running statistics in both), and ``nn.TransformerEncoder`` exported with the classic
(TorchScript) exporter. Each is exported WITHOUT its loss (the logits), trained by
``Trainer(model, losses.cross_entropy(...))`` for 20 ONNX Adam steps on fresh random batches,
and by torch in float32 with ONNX's Adam formula written in torch (see training-notes.md:
torch's own Adam differs). Prints the largest loss difference per model (and for the CNN the
running statistics'); exits 1 above 1e-4.

    PYTHONPATH=python /work/torchvenv/bin/python scripts/compare_torch_models.py
"""

from __future__ import annotations

import io
import math
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

STEPS, LR, BATCH = 20, 1e-3, 8


def models():
    import torch
    nn = torch.nn

    class RNN(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.rnn = getattr(nn, kind)(5, 16, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y[:, -1])

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(8)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.enc(x).mean(dim=1))

    yield "GRU", RNN("GRU"), (BATCH, 7, 5)
    yield "LSTM", RNN("LSTM"), (BATCH, 7, 5)
    yield "BatchNorm CNN (TrainingMode.TRAINING)", CNN(), (BATCH, 3, 6, 6)
    yield "TransformerEncoder (classic exporter)", Encoder(), (BATCH, 5, 16)


def export(net, shape):
    import onnx
    import torch
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(shape),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["logits"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return onnx.load_from_string(buf.getvalue())


def onnx_adam_step(params, state, t, lr, alpha=0.9, beta=0.999, eps=1e-6):
    """ONNX Adam (onnx.reference's op_adam), in torch."""
    import torch
    with torch.no_grad():
        rate = lr * math.sqrt(1 - beta ** t) / (1 - alpha ** t)
        for p in params:
            v, h = state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
            v.mul_(alpha).add_(p.grad, alpha=1 - alpha)
            h.mul_(beta).addcmul_(p.grad, p.grad, value=1 - beta)
            p.sub_(rate * v / (h.sqrt() + eps))


def main() -> int:
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to compare")
        return 0
    from trainops import Trainer, losses, optim

    worst = 0.0
    for name, net, shape in models():
        torch.manual_seed(0)
        for m in net.modules():  # fresh, distinct weights
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        net.train()
        model = export(net, shape)
        trainer = Trainer(model, losses.cross_entropy("logits"), optim.Adam(lr=LR), seed=0)
        rng = np.random.default_rng(1)
        state, diffs = {}, []
        for t in range(1, STEPS + 1):
            x = rng.standard_normal(shape).astype(np.float32)
            y = rng.integers(0, 4, BATCH)
            got = trainer.step({"x": x, "labels": y})
            net.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
            loss.backward()
            onnx_adam_step([p for p in net.parameters()], state, t, LR)
            diffs.append(abs(got - loss.item()))
        line = f"{name}: {len(trainer.param_names)} params, max |loss diff| over {STEPS} " \
               f"steps {max(diffs):.2e} (final loss {loss.item():.4f})"
        if trainer.running_stats():
            bn = net.bn
            stats = trainer.running_stats()
            rm = next(v for k, v in stats.items() if v.shape == bn.running_mean.shape
                      and "mean" in k)
            rv = next(v for k, v in stats.items() if v.shape == bn.running_var.shape
                      and "var" in k)
            dm = float(np.abs(rm - bn.running_mean.numpy()).max())
            dv = float(np.abs(rv - bn.running_var.numpy()).max())
            line += f"; running mean/var max diff {dm:.2e}/{dv:.2e}"
            worst = max(worst, dm, dv)
        print(line)
        worst = max(worst, max(diffs))
    print(f"worst: {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
