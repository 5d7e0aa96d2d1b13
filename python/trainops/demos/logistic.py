"""The earliest demo (:func:`train`): a logistic regression trained with every Adam step
run in ONNX Runtime.

numpy computes the loss and the gradients; one ``ai.onnx.preview.training::Adam`` node
updates both parameter tensors (weights ``w`` of shape (D,) and bias ``b`` of shape (1,))
in place through IOBinding, so the weights and the optimizer state never leave ONNX
Runtime's buffers between steps.
"""

from __future__ import annotations

import numpy as np


def _data(rng: np.random.Generator, n: int, d: int):
    w_true = rng.normal(size=d).astype(np.float32)
    x = rng.normal(size=(n, d)).astype(np.float32)
    logits = x @ w_true + 0.5
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return x, y


def _loss_and_grads(x, y, w, b):
    p = 1.0 / (1.0 + np.exp(-(x @ w + b[0])))
    eps = 1e-7
    loss = -np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))
    err = (p - y) / len(y)
    return float(loss), (x.T @ err).astype(np.float32), np.array([err.sum()], np.float32), p


def train(steps: int = 300, lr: float = 0.05, every: int = 25, seed: int = 0, out=print) -> list[float]:
    """Trains and returns the loss after every step."""
    import onnxruntime as ort

    from ..models import adam_model, session

    rng = np.random.default_rng(seed)
    d = 16
    x, y = _data(rng, 4000, d)
    sess = session(adam_model([(d,), (1,)], alpha=0.9, beta=0.999, epsilon=1e-8))

    def value(a):
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, np.float32))

    params = [value(np.zeros(d)), value(np.zeros(1))]  # X_1 = w, X_2 = b
    moments = [value(np.zeros(d)), value(np.zeros(1)), value(np.zeros(d)), value(np.zeros(1))]
    binding = sess.io_binding()
    binding.bind_ortvalue_input("R", value(np.array(lr)))
    for i, p in enumerate(params, 1):
        binding.bind_ortvalue_input(f"X_{i}", p)
        binding.bind_ortvalue_output(f"X_{i}_new", p)  # in place
    for k, (name, i) in enumerate([("V", 1), ("V", 2), ("H", 1), ("H", 2)]):
        binding.bind_ortvalue_input(f"{name}_{i}", moments[k])
        binding.bind_ortvalue_output(f"{name}_{i}_new", moments[k])

    out(f"logistic regression, {len(y)} samples x {d} features; Adam(lr={lr}) in ONNX Runtime {ort.__version__}")
    out(f"{'step':>6} {'loss':>9} {'accuracy':>9}")
    losses = []
    for t in range(1, steps + 1):
        w, b = params[0].numpy(), params[1].numpy()
        loss, gw, gb, p = _loss_and_grads(x, y, w, b)
        binding.bind_cpu_input("T", np.array(t, np.int64))
        binding.bind_cpu_input("G_1", gw)
        binding.bind_cpu_input("G_2", gb)
        sess.run_with_iobinding(binding)
        losses.append(loss)
        if t == 1 or t % every == 0 or t == steps:
            acc = float(np.mean((p > 0.5) == (y > 0.5)))
            out(f"{t:>6} {loss:>9.4f} {acc:>9.3f}")
    return losses

