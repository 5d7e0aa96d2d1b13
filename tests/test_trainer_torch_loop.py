"""The Trainer against a PyTorch loop: a PyTorch training loop with AdamW, gradient
accumulation, clip_grad_norm_ and a cosine schedule with warmup, and the same loop with
the Trainer (README, "From a PyTorch loop"), against a numpy float64 re-implementation of
PyTorch's math (the loop below, written from torch's documented formulas). No torch
needed; scripts/compare_torch_training.py runs torch itself where it is installed.

    # PyTorch                                        # trainops
    opt = torch.optim.AdamW(params, lr, weight_decay=wd)
    sched = SequentialLR(opt, [LinearLR(opt, 1/3, total_iters=W),
                               CosineAnnealingLR(opt, S - W)], [W])
    for i, (x, t) in enumerate(batches):             trainer = Trainer(model, "loss",
        loss = loss_fn(model(x), t) / K                  optim.AdamW(lr, weight_decay=wd),
        loss.backward()                                  clip_grad_norm=C, accumulate=K,
        if (i + 1) % K == 0:                             schedule=Cosine(S, W))
            clip_grad_norm_(params, C)               for x, t in batches:
            opt.step(); sched.step()                     trainer.step({"x": x, "t": t})
            opt.zero_grad()
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from test_trainer import data, initial_params, mlp_model, numpy_loss_and_grads
from trainops import Trainer, optim
from trainops.optim import schedules

if not hasattr(optim, "AdamW"):  # pragma: no cover - the adamw branch brings it
    pytest.skip("trainops.optim.AdamW is not in this tree", allow_module_level=True)

K, UPDATES, WARMUP, LR, WD, CLIP = 3, 6, 2, 0.05, 0.05, 1.5


def torch_lr(step: int) -> float:
    """SequentialLR(LinearLR(1/3, total_iters=WARMUP), CosineAnnealingLR(UPDATES - WARMUP))."""
    if step < WARMUP:
        return LR * (1 / 3 + (2 / 3) * step / WARMUP)
    return LR * (1 + math.cos(math.pi * (step - WARMUP) / (UPDATES - WARMUP))) / 2


def torch_adamw(p, g, m, v, lr, t, b1=0.9, b2=0.999, eps=1e-8, wd=WD):
    """torch.optim.AdamW's single-tensor step (float64)."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / math.sqrt(1 - b2 ** t) + eps
    return p - (lr / (1 - b1 ** t)) * m / denom, m, v


def reference_loop(p, batches):
    """The PyTorch loop in numpy float64: losses of every micro-batch, parameters after
    each update, total norms."""
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    acc = {k: np.zeros_like(x) for k, x in p.items()}
    losses, params, norms = [], [], []
    for i, f in enumerate(batches):
        loss, g = numpy_loss_and_grads(p, f)
        losses.append(loss)
        for k in p:
            acc[k] += g[k] / K  # (loss / K).backward()
        if (i + 1) % K == 0:
            total = math.sqrt(sum(float(np.sum(a * a)) for a in acc.values()))
            coef = min(CLIP / (total + 1e-6), 1.0)
            step = (i + 1) // K
            lr = torch_lr(step - 1)
            for k in p:
                p[k], m[k], v[k] = torch_adamw(p[k], acc[k] * coef, m[k], v[k], lr, step)
                acc[k] = np.zeros_like(acc[k])
            params.append({k: x.copy() for k, x in p.items()})
            norms.append(total)
    return losses, params, norms


def test_pytorch_loop_rewritten_with_the_trainer(library_path):
    batches = [data(seed=10 + i, n=8) for i in range(K * UPDATES)]
    want_losses, want_params, want_norms = reference_loop(
        {k: v.astype(np.float64) for k, v in initial_params(mlp_model()).items()}, batches)
    assert max(want_norms) > CLIP > min(want_norms)  # clipping on some updates, not all

    trainer = Trainer(mlp_model(), "loss", optim.AdamW(lr=LR, weight_decay=WD), threads=1,
                      clip_grad_norm=CLIP, accumulate=K,
                      schedule=schedules.Cosine(UPDATES, WARMUP))
    losses, params, norms = [], [], []
    for i, f in enumerate(batches):
        losses.append(trainer.step(f))
        if (i + 1) % K == 0:
            params.append(trainer.parameters())
            norms.append(trainer.last_grad_norm)
    assert trainer.T == UPDATES + 1
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=2e-5)
    for u, (got, want) in enumerate(zip(params, want_params)):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=2e-6,
                                       err_msg=f"update {u + 1}, {k}")
    # the loop trained: the last parameters are far from the first
    first = initial_params(mlp_model())
    assert all(np.abs(params[-1][k] - first[k]).max() > 10 * 2e-6 for k in first)
