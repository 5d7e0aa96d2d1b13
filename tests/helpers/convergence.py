"""A least-squares problem and a run of an optimizer op on it beside the same optimizer with
float32 moments in numpy, for the low-memory-state optimizers' convergence tests."""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32


def least_squares(rng, m=512, n=600):
    """``loss_grad(x)``: the mean squared residual / 2 of a random ``m x n`` system (float64)
    and its gradient (float32)."""
    a = (rng.standard_normal((m, n)) / math.sqrt(n)).astype(F32)
    b = (a @ rng.standard_normal(n).astype(F32) + 0.01 * rng.standard_normal(m)).astype(F32)

    def loss_grad(x):
        res = a @ x - b
        return float(0.5 * np.mean(res.astype(np.float64) ** 2)), (a.T @ res / m).astype(F32)
    return loss_grad


def against_float32(loss_grad, step, update, n, steps, lr, **attrs):
    """From zeros, ``steps`` updates (``t`` from 1) of the op under test, ``step(t, x, g) ->
    x_new`` (its state its own), and of ``update`` (numpy, float32 moments, ``attrs``):
    ``(loss of the op's x, loss of update's x, starting loss)``."""
    x = np.zeros(n, F32)
    x32, m32, v32 = np.zeros(n, F32), np.zeros(n, F32), np.zeros(n, F32)
    start, _ = loss_grad(x32)
    for t in range(1, steps + 1):
        _, g = loss_grad(x)
        x = step(t, x, g)
        _, g = loss_grad(x32)
        x32, m32, v32 = update(float(F32(lr)), t, x32, g, m32, v32, **attrs)
    return loss_grad(x)[0], loss_grad(x32)[0], start
