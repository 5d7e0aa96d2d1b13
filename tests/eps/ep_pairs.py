"""What the EP lanes (tests/eps/test_webgpu.py, tests/eps/test_openvino.py) share: the
models, their batches, and one training run on an EP beside the CPU portable Trainer from
the same seed.

The reference is ``Trainer(..., portable=True)`` on the CPU: the same step graph of
standard ONNX ops, run by onnxruntime's CPU kernels. The EP runs the same graph with its
own kernels, which sum in other orders (tiled matrix products, tree reductions) and have
their own Exp / Erf / Sqrt. A float32 sum of n terms in any order is within
``gamma(n) = n u / (1 - n u)`` (u = 2^-24) times the sum of the terms' magnitudes of its
exact value (tests/helpers/rounding.py); the longest sums here are a convolution weight
gradient's, 16 x 8 x 8 = 1024 terms (the CNN) and a transformer's 4 x 32 = 128 token sums
of 64-wide products: gamma(1024) = 6.1e-5 relative where the terms do not cancel. The
lanes' comparison is the issue's: ``rtol 1e-4, atol 1e-5`` on each step's loss and on the
final parameters, after :data:`STEPS` steps. AdamW runs with ``eps = 1e-3``: its update
``lr m / (sqrt(v) + eps)`` then moves by at most ``lr / eps`` times a gradient's absolute
difference, where the default ``1e-8`` would turn a near-zero gradient's rounding into a
sign flip of a whole ``lr`` step; the float32 optimizer math is still the code under test.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from trainops import Trainer, optim
from trainops.demos.train import cnn_model, digits, mlp_model

STEPS = 6
RTOL, ATOL = 1e-4, 1e-5
BATCH = 16


def required(lane: str) -> bool:
    """Whether the lane script asked for ``lane`` (``EPS_REQUIRE=webgpu,openvino``): then a
    missing EP fails instead of skipping."""
    return lane in os.environ.get("EPS_REQUIRE", "").split(",")


def unavailable(lane: str, why: str):
    """Skip (the default pytest run: no EP there) or, in the lane, fail with ``why``."""
    if required(lane):
        pytest.fail(f"{lane} lane: {why}")
    pytest.skip(why)


def cnn_batches():
    x, t = digits(STEPS * BATCH, seed=5)
    return [{"x": x[k * BATCH:(k + 1) * BATCH], "t": t[k * BATCH:(k + 1) * BATCH]}
            for k in range(STEPS)]


def mlp_batches(width: int = 12):
    rng = np.random.default_rng(11)
    out = []
    for _ in range(STEPS):
        x = rng.standard_normal((BATCH, width)).astype(np.float32)
        out.append({"x": x, "t": np.abs(x[:, :5]).argmax(1).astype(np.int64)})
    return out


def transformer():
    """The bench's transformer encoder (2 post-norm layers, d64, 4 heads, LayerNorm, Softmax,
    ReLU; trainops.bench.train_models), built with onnx.helper: batch 4, a new batch drawn
    per step from the family's seed."""
    from trainops.bench.train_models import family

    fams = [family("transformer", batch=4, seed=s) for s in range(STEPS)]
    return fams[0].model, [f.feeds for f in fams], fams[0].params


def static_batch(model, size: int = BATCH):
    """``model`` with its batch dimension ``N`` fixed to ``size`` (a copy)."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for v in list(m.graph.input) + list(m.graph.output):
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param == "N":
                d.dim_value = size
    return m


MODELS = {
    "mlp": lambda: (mlp_model(seed=2, sizes=(12, 32, 32, 5)), mlp_batches(), None),
    "cnn": lambda: (cnn_model(seed=1), cnn_batches(), None),
    "transformer": transformer,
}


def optimizer():
    return optim.AdamW(lr=0.01, eps=1e-3)


# The other optimizers' portable forms (ONNX Adam's exact square root, Adagrad's, Momentum's
# plain products), each with an epsilon that bounds its update's sensitivity as AdamW's does.
OPTIMIZERS = {
    "Adam": lambda: optim.Adam(lr=0.01, epsilon=1e-3, norm_coefficient=0.01),
    "Adagrad": lambda: optim.Adagrad(lr=0.05, epsilon=1e-3),
    "Momentum-nesterov": lambda: optim.Momentum(lr=0.05, mode="nesterov"),
}


class Run:
    """The CPU portable Trainer and the EP Trainer, trained on the same batches; ``error``
    is the exception the EP run raised (its construction or a step), else None."""

    def __init__(self, model, batches, params, make_optimizer=optimizer, **where):
        self.model = model
        self.cpu = Trainer(model, "loss", optimizer=make_optimizer(), params=params, seed=5,
                           portable=True)
        self.cpu_losses = [self.cpu.step(b) for b in batches]
        self.dev, self.losses, self.error = None, [], None
        try:
            self.dev = Trainer(model, "loss", optimizer=make_optimizer(), params=params,
                               seed=5, **where)
            for b in batches:
                self.losses.append(self.dev.step(b))
        except Exception as exc:  # noqa: BLE001 - kept for the tests to report
            self.error = exc

    def trained(self):
        """Raises the EP run's error, if any, so that a test fails with it."""
        if self.error is not None:
            raise self.error
        return self.dev

    def check_matches_cpu(self) -> None:
        dev = self.trained()
        np.testing.assert_allclose(self.losses, self.cpu_losses, rtol=RTOL, atol=ATOL,
                                   err_msg="losses, step by step")
        want, got = self.cpu.parameters(), dev.parameters()
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"parameter {name} after {STEPS} steps")
        # the run trained: the weights moved by far more than the tolerance
        moved = max(float(np.max(np.abs(want[n] - self.initial(n)))) for n in want)
        assert moved > 100 * ATOL, moved

    def initial(self, name: str):
        from onnx import numpy_helper

        for init in self.model.graph.initializer:
            if init.name == name:
                return numpy_helper.to_array(init)
        raise KeyError(name)
