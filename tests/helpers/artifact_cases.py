"""The models, optimizers and batches the training-artifacts tests run (tests/test_artifacts.py,
tests/test_artifacts_c.py): CASES name -> (model builder, optimizer, policy, batches)."""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from trainops import Trainer, optim
from trainops.demos.train import cnn_model, mlp_model

SIZES = (8, 16, 16, 3)


def cnn_batches(steps, n=8, seed=3):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((n, 1, 8, 8)).astype(np.float32),
             "t": rng.integers(0, 10, n).astype(np.int64)} for _ in range(steps)]


def mlp_batches(steps, n=16, seed=4):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((n, SIZES[0])).astype(np.float32),
             "t": rng.integers(0, SIZES[-1], n).astype(np.int64)} for _ in range(steps)]


def dropout_mlp(ratio=0.3):
    """The demos' MLP with a Dropout after its first Relu."""
    m = mlp_model(sizes=SIZES)
    g = m.graph
    i = next(k for k, n in enumerate(g.node) if n.op_type == "Relu")
    out = g.node[i].output[0]
    for n in g.node:
        n.input[:] = ["dropped" if x == out else x for x in n.input]
    g.node.insert(i + 1, helper.make_node("Dropout", [out, "ratio"], ["dropped"]))
    g.initializer.append(numpy_helper.from_array(np.array(ratio, np.float32), "ratio"))
    return m


def overflowing_mlp():
    """The MLP with its logits times 1e4: float16 gradients overflow at the initial loss
    scale 2**15, so mixed_float16 skips the first steps (and halves the scale)."""
    m = mlp_model(sizes=SIZES)
    g = m.graph
    last = g.node[-1]
    g.node.insert(len(g.node) - 1, helper.make_node("Mul", [last.input[0], "k"], ["big"]))
    last.input[0] = "big"
    g.initializer.append(numpy_helper.from_array(np.array(1e4, np.float32), "k"))
    return m


CASES = {
    "cnn-adam": (cnn_model, lambda: optim.Adam(lr=1e-2), "float32", cnn_batches),
    "cnn-adagrad": (cnn_model, lambda: optim.Adagrad(lr=0.05), "float32", cnn_batches),
    "mlp-momentum-nesterov": (lambda: mlp_model(sizes=SIZES),
                              lambda: optim.Momentum(lr=0.05, mode="nesterov"), "float32",
                              mlp_batches),
    "dropout-momentum": (dropout_mlp, lambda: optim.Momentum(lr=0.05), "float32", mlp_batches),
    "mixed-float16-skips": (overflowing_mlp, lambda: optim.Adam(lr=1e-2), "mixed_float16",
                            mlp_batches),
}


def make_trainer(case, seed=77):
    model, opt, policy, _ = CASES[case]
    params = [i.name for i in model().graph.initializer if i.name not in ("ratio", "k")]
    return Trainer(model(), "loss", opt(), params=params, policy=policy, threads=1, seed=seed)
