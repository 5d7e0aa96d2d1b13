"""Gradient clipping inside the step graph: :func:`clip_grad_norm`, PyTorch's
``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (2-norm) as standard ONNX ops.

PyTorch's arithmetic, in its order (float32 for float32/float16 gradients, float64 for
float64 ones)::

    norms = [vector_norm(g) for g in grads]          # ReduceL2 per gradient
    total = vector_norm(stack(norms))                 # Concat, ReduceL2
    coef  = (total + 1e-6).reciprocal() * max_norm    # torch's `max_norm / tensor`
    coef  = clamp(coef, max=1.0)                      # Min
    g    *= coef                                      # Mul, always (coef 1 when small)

Under ``mixed_float16`` the gradients arrive multiplied by the loss scale (float16): they
are cast to float32, the total norm of the scaled gradients is divided by the scale (a
power of two, so this is exactly the norm of the unscaled gradients, as after torch's
``GradScaler.unscale_``), and the clipped gradients stay float32 and scaled (the
optimizer node divides by the scale: ``(g * coef) / s == (g / s) * coef`` exactly for a
power-of-two ``s``). Non-finite gradients give a non-finite total, ``coef`` 0 or NaN and
non-finite clipped gradients, so the step is still skipped. (On the CPU execution
provider ONNX Runtime computes most float16 ops in float32 between Casts it inserts, and
drops a float32 -> float16 -> float32 round trip: the clipping's Cast then reads the
float32 value, so a gradient that would overflow float16 only there is not seen as
non-finite, while the unclipped path, which hands the float16 tensors to the optimizer,
skips that step.)

The optimizer consumes only the clipped gradients, and each of them depends on every
gradient through ``total``: no update can run before the whole backward pass is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx import TensorProto, helper, numpy_helper

from .spec import PREFIX as _P

__all__ = ["CLIP_EPSILON", "Clipped", "clip_grad_norm"]

CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_'s, added to the total norm


@dataclass
class Clipped:
    """What :func:`clip_grad_norm` adds: ``nodes``, ``grads`` (the clipped gradients, in
    the order given), ``norm`` (the total norm, shape ``[1]``, of type ``norm_type``)."""

    nodes: list
    grads: list[str]
    norm: str
    norm_type: int


def _const(name: str, value: np.ndarray):
    return helper.make_node("Constant", [], [name], name=name,
                            value=numpy_helper.from_array(value, name))


def clip_grad_norm(grads: list[str], types: list[int], max_norm: float,
                   loss_scale: str | None = None, prefix: str = f"{_P}/clip") -> Clipped:
    """The nodes clipping ``grads`` (element types ``types``) to total 2-norm
    ``max_norm``, PyTorch's rule (module docstring). ``loss_scale``: the float32 ``[1]``
    loss scale the gradients are multiplied by (``mixed_float16``): the norm is the
    unscaled one and the clipped gradients are float32, still scaled. The total norm is
    the output ``trainops/grad_norm``."""
    double = any(t == TensorProto.DOUBLE for t in types)
    nt = TensorProto.DOUBLE if double else TensorProto.FLOAT
    npt = np.float64 if double else np.float32
    nodes = [_const(f"{prefix}/shape1", np.array([1], np.int64)),
             _const(f"{prefix}/epsilon", np.array([CLIP_EPSILON], npt)),
             _const(f"{prefix}/max_norm", np.array([max_norm], npt)),
             _const(f"{prefix}/one", np.array([1.0], npt))]
    wide, norms = [], []
    for i, (g, t) in enumerate(zip(grads, types)):
        if t != nt:  # float16, or float32 among float64 gradients: the norm's type
            nodes.append(helper.make_node("Cast", [g], [f"{prefix}/wide/{i}"], to=nt,
                                          name=f"{prefix}/wide/{i}"))
            g = f"{prefix}/wide/{i}"
        wide.append(g)
        n = f"{prefix}/norm/{i}"
        nodes.append(helper.make_node("ReduceL2", [g], [n + "/keep"], keepdims=1,
                                      name=n + "/reduce"))
        nodes.append(helper.make_node("Reshape", [n + "/keep", f"{prefix}/shape1"], [n],
                                      name=n))
        norms.append(n)
    norm = f"{_P}/grad_norm"
    nodes.append(helper.make_node("Concat", norms, [f"{prefix}/norms"], axis=0,
                                  name=f"{prefix}/norms"))
    total = f"{prefix}/total" if loss_scale is not None else norm
    nodes.append(helper.make_node("ReduceL2", [f"{prefix}/norms"], [total], keepdims=1,
                                  name=f"{prefix}/total"))
    if loss_scale is not None:  # the norm of the unscaled gradients (the scale: 2**k)
        scale = loss_scale
        if nt != TensorProto.FLOAT:
            nodes.append(helper.make_node("Cast", [loss_scale], [f"{prefix}/scale"], to=nt,
                                          name=f"{prefix}/scale"))
            scale = f"{prefix}/scale"
        nodes.append(helper.make_node("Div", [total, scale], [norm], name=f"{prefix}/unscale"))
    c = f"{prefix}/coef"
    nodes += [helper.make_node("Add", [norm, f"{prefix}/epsilon"], [c + "/den"], name=c + "/den"),
              helper.make_node("Reciprocal", [c + "/den"], [c + "/rec"], name=c + "/rec"),
              helper.make_node("Mul", [c + "/rec", f"{prefix}/max_norm"], [c + "/raw"],
                               name=c + "/raw"),
              helper.make_node("Min", [c + "/raw", f"{prefix}/one"], [c], name=c)]
    out = []
    for i, (g, w, t) in enumerate(zip(grads, wide, types)):
        o = f"{prefix}/grad/{i}"
        if loss_scale is not None:  # mixed: float32, still scaled
            nodes.append(helper.make_node("Mul", [w, c], [o], name=o))
        elif t == nt:
            nodes.append(helper.make_node("Mul", [g, c], [o], name=o))
        else:  # torch: g.mul_(coef.to(g.dtype))
            nodes.append(helper.make_node("Cast", [c], [f"{c}/as/{i}"], to=t, name=f"{c}/as/{i}"))
            nodes.append(helper.make_node("Mul", [g, f"{c}/as/{i}"], [o], name=o))
        out.append(o)
    return Clipped(nodes, out, norm, nt)
