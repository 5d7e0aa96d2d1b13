"""The mixed-precision demo: a small MLP trained under Keras' ``mixed_float16`` policy with
every optimizer step in ONNX Runtime.

numpy runs the forward and backward passes in float16 (the policy's compute dtype; the loss
itself in float32, as Keras keeps softmax/losses in float32), on the scaled loss
``loss * loss_scale``. One ONNX model from ``trainops.optimizer_model(..., policy=
"mixed_float16")`` then does the rest in ONNX Runtime, with every tensor bound in place
through an IOBinding: ``MixedPrecisionAdam`` unscales the float16 gradients, checks them
(one verdict for all), updates the float32 master weights and moments and writes the
float16 copies the next forward pass uses, or skips the step when some gradient is not
finite; ``DynamicLossScale`` then halves the scale after a skip, or doubles it after
``growth_interval`` finite steps in a row.

The targets have an offset, so the first gradients are large: at Keras' initial scale of
2**15 they overflow float16 and the first steps are skipped while the scale backs off; later
the scale grows again every ``growth_interval`` steps until it overflows once more.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

F16 = np.float16
F32 = np.float32


@dataclass
class MixedTrainResult:
    """What :func:`train_mixed` saw, one entry per step (1-based step ``k`` at index
    ``k - 1``): the loss of the forward pass, the loss scale that step's gradients carried
    and whether the step was applied. ``skipped``/``grown``: step numbers where the scale
    backed off (non-finite gradients) / grew. ``final_scale``: the scale after the last
    step."""

    losses: list = field(default_factory=list)
    scales: list = field(default_factory=list)
    applied: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    grown: list = field(default_factory=list)
    final_scale: float = 0.0


def _data(rng: np.random.Generator, n: int, d: int):
    x = rng.standard_normal((n, d)).astype(F32)
    w = rng.standard_normal((d, 1)).astype(F32) / np.sqrt(d)
    y = 3.0 + 2.0 * np.sin(2.0 * (x @ w)) + 0.5 * x[:, :1] * x[:, 1:2]
    return x, y.astype(F32)


def _forward_backward(x16, y, w, scale):
    """Forward in float16, loss in float32, backward in float16 on ``loss * scale``.
    ``w``: the float16 weights (``w1``, ``b1``, ``w2``, ``b2``). Returns (loss, grads)."""
    w1, b1, w2, b2 = w["w1"], w["b1"], w["w2"], w["b2"]
    with np.errstate(over="ignore", invalid="ignore"):
        z1 = x16 @ w1 + b1
        a1 = np.tanh(z1)
        pred = a1 @ w2 + b2                              # float16
        err = pred.astype(F32) - y                       # the loss in float32
        loss = float(np.mean(err * err))
        # d(loss * scale)/d(pred), cast to the compute dtype: may overflow to inf
        dpred = (err * (2.0 * scale / len(y))).astype(F16)
        g_w2 = a1.T @ dpred
        g_b2 = dpred.sum(axis=0, dtype=F16)
        dz1 = (dpred @ w2.T) * (F16(1) - a1 * a1)
        g_w1 = x16.T @ dz1
        g_b1 = dz1.sum(axis=0, dtype=F16)
    return loss, {"w1": g_w1, "b1": g_b1, "w2": g_w2, "b2": g_b2}


def train_mixed(steps: int = 300, lr: float = 0.01, growth_interval: int = 20,
                batch: int = 256, hidden: int = 32, every: int = 25, seed: int = 0,
                out=print, library: str | None = None) -> MixedTrainResult:
    """Trains the MLP for ``steps`` steps; prints progress through ``out`` and returns a
    :class:`MixedTrainResult`."""
    import onnxruntime as ort

    from ..mixed_precision import InPlaceOptimizer, Policy

    policy = Policy("mixed_float16")
    rng = np.random.default_rng(seed)
    d = 8
    x, y = _data(rng, 4096, d)
    weights = {
        "w1": rng.standard_normal((d, hidden)) / np.sqrt(d),
        "b1": np.zeros(hidden),
        "w2": rng.standard_normal((hidden, 1)) / np.sqrt(hidden),
        "b2": np.zeros(1),
    }
    opt = InPlaceOptimizer(weights, policy, lr=lr, library=library,
                           growth_interval=growth_interval, epsilon=1e-7)
    result = MixedTrainResult()
    n_params = sum(int(np.prod(w.shape)) for w in weights.values())
    out(f"MLP {d}-{hidden}-1, {n_params} parameters, policy {policy.name} (compute "
        f"{policy.compute_dtype}, variables {policy.variable_dtype}); Adam(lr={lr}) "
        f"in ONNX Runtime {ort.__version__}")
    out(f"dynamic loss scale: initial {policy.loss_scale:.0f}, x2 after {growth_interval} "
        f"finite steps, x0.5 on overflow")
    out(f"{'step':>6} {'loss':>9} {'loss scale':>11}")
    order = rng.permutation(len(y))
    pos = 0
    for k in range(1, steps + 1):
        if pos + batch > len(y):
            order = rng.permutation(len(y))
            pos = 0
        idx = order[pos:pos + batch]
        pos += batch
        scale = opt.loss_scale
        loss, grads = _forward_backward(x[idx].astype(F16), y[idx], opt.compute_weights, scale)
        applied = opt.step(grads)
        new_scale = opt.loss_scale
        result.losses.append(loss)
        result.scales.append(scale)
        result.applied.append(applied)
        if not applied:
            result.skipped.append(k)
            out(f"step {k} skipped: non-finite gradients, loss scale {scale:.0f} -> "
                f"{new_scale:.0f}")
        elif new_scale > scale:
            result.grown.append(k)
            out(f"step {k}: {growth_interval} finite steps in a row, loss scale "
                f"{scale:.0f} -> {new_scale:.0f}")
        if k == 1 or k % every == 0 or k == steps:
            out(f"{k:>6} {loss:>9.4f} {new_scale:>11.0f}")
    result.final_scale = opt.loss_scale
    out(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; {len(result.skipped)} "
        f"steps skipped, the scale grew {len(result.grown)} times; "
        f"{opt.iterations} updates applied")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainops demo --mixed",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--growth-interval", type=int, default=20)
    args = ap.parse_args(argv)
    r = train_mixed(args.steps, args.lr, args.growth_interval)
    return 0 if r.losses[-1] < r.losses[0] else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
