"""Builders of the mixed-precision ops (``com.trainops``): ``MixedPrecisionAdam``,
``DynamicLossScale``, ``AllFinite``; see :mod:`trainops.models`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..onnx_defs import TRAINOPS_DOMAIN
from .core import Shape, adam_feeds, node_model, tensor_shapes

__all__ = [
    "mixed_precision_adam_names",
    "mixed_precision_adam_model",
    "mixed_precision_adam_feeds",
    "dynamic_loss_scale_model",
    "all_finite_model",
]


def mixed_precision_adam_names(n: int, copy: bool = False) -> tuple[list[str], list[str]]:
    """(input names, output names) of a ``MixedPrecisionAdam`` node over ``n`` tensors:
    ``R, T, loss_scale, X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n`` ->
    ``finite, X_1_new..X_n_new, V_1_new.., H_1_new..`` and, with ``copy``, ``X_1_copy..``."""
    idx = range(1, n + 1)
    inputs = ["R", "T", "loss_scale"] + [f"{p}_{i}" for p in "XGVH" for i in idx]
    outputs = ["finite"] + [f"{p}_{i}_new" for p in "XVH" for i in idx]
    if copy:
        outputs += [f"X_{i}_copy" for i in idx]
    return inputs, outputs


def mixed_precision_adam_model(
    n_or_shapes: int | Sequence[Shape],
    g_dtype: Any = np.float16,
    copy_dtype: int | None = None,
    *,
    dtype: Any = np.float32,
    r_dtype: Any = np.float32,
    t_dtype: Any = np.int64,
    loss_scale_dtype: Any = np.float32,
    loss_scale_shape: Shape = (),
    copy_output_dtype: Any = None,
    copies: bool | None = None,
    dynamic: bool = False,
    **attrs: Any,
):
    """A ``com.trainops::MixedPrecisionAdam`` model (names: :func:`mixed_precision_adam_names`).

    ``g_dtype``: the gradients' type, one for all or a list per tensor. ``copy_dtype``:
    the attribute (``None`` leaves it out: no copies); ``X_i_copy`` outputs are declared
    when it is non-zero (or when ``copies`` says so), with type ``copy_output_dtype``
    (default: ``copy_dtype`` itself). ``dtype``: X/V/H's type. ``dynamic``: every shape
    unknown. Other keyword arguments are node attributes, passed as given."""
    n, shapes = tensor_shapes(n_or_shapes)
    if n < 1:
        raise ValueError("MixedPrecisionAdam needs at least one tensor")
    g_dtypes = list(g_dtype) if isinstance(g_dtype, (list, tuple)) else [g_dtype] * n
    if len(g_dtypes) != n:
        raise ValueError(f"g_dtype has {len(g_dtypes)} entries, expected {n}")
    r_shape: Shape = ()
    t_shape: Shape = ()
    if dynamic:
        shapes = [None] * n
        r_shape = t_shape = loss_scale_shape = None
    if copies is None:
        copies = bool(copy_dtype)
    if copy_dtype is not None:
        attrs["copy_dtype"] = copy_dtype
    if copy_output_dtype is None:
        copy_output_dtype = copy_dtype if copy_dtype else np.float16
    inputs = [("R", r_dtype, r_shape), ("T", t_dtype, t_shape),
              ("loss_scale", loss_scale_dtype, loss_scale_shape)]
    inputs += [(f"X_{i + 1}", dtype, shapes[i]) for i in range(n)]
    inputs += [(f"G_{i + 1}", g_dtypes[i], shapes[i]) for i in range(n)]
    inputs += [(f"{p}_{i + 1}", dtype, shapes[i]) for p in "VH" for i in range(n)]
    outputs = [("finite", np.bool_, ())]
    outputs += [(f"{p}_{i + 1}_new", dtype, shapes[i]) for p in "XVH" for i in range(n)]
    if copies:
        outputs += [(f"X_{i + 1}_copy", copy_output_dtype, shapes[i]) for i in range(n)]
    names = mixed_precision_adam_names(n, copies)
    assert [i[0] for i in inputs] == names[0] and [o[0] for o in outputs] == names[1]
    return node_model("MixedPrecisionAdam", inputs, outputs, domain=TRAINOPS_DOMAIN, **attrs)


def mixed_precision_adam_feeds(r: Any, t: Any, loss_scale: Any, xs, gs, vs, hs
                               ) -> dict[str, np.ndarray]:
    """Feeds for :func:`mixed_precision_adam_model`: ``R`` float32 and ``T`` int64 and
    ``loss_scale`` float32 (rank 0) unless given as numpy arrays."""
    feeds = adam_feeds(r, t, xs, gs, vs, hs, r_dtype=np.float32)
    if not isinstance(loss_scale, np.ndarray):
        loss_scale = np.array(loss_scale, dtype=np.float32)
    feeds["loss_scale"] = loss_scale
    return feeds


def dynamic_loss_scale_model(*, shape: Shape = (), scale_dtype: Any = np.float32,
                             steps_dtype: Any = np.int64, finite_dtype: Any = np.bool_,
                             dynamic: bool = False, n_inputs: int = 3, n_outputs: int = 2,
                             **attrs: Any):
    """A ``com.trainops::DynamicLossScale`` model: inputs ``scale``, ``good_steps``,
    ``finite`` (one element each, ``shape``), outputs ``new_scale``, ``new_good_steps``.
    Attributes (``growth_interval``, ``growth_factor``, ``backoff_factor``, ``min_scale``)
    are passed as given. ``n_inputs``/``n_outputs`` truncate or pad (with extra float
    tensors) the lists, to build wrong arities."""
    if dynamic:
        shape = None
    inputs = [("scale", scale_dtype, shape), ("good_steps", steps_dtype, shape),
              ("finite", finite_dtype, shape)]
    inputs += [(f"extra_{k}", np.float32, shape) for k in range(n_inputs - 3)]
    outputs = [("new_scale", scale_dtype, shape), ("new_good_steps", steps_dtype, shape)]
    outputs += [(f"extra_out_{k}", np.float32, shape) for k in range(n_outputs - 2)]
    return node_model("DynamicLossScale", inputs[:n_inputs], outputs[:n_outputs],
                      domain=TRAINOPS_DOMAIN, **attrs)


def all_finite_model(dtypes: Sequence[Any], shapes: Sequence[Shape] | None = None, *,
                     dynamic: bool = False, **attrs: Any):
    """A ``com.trainops::AllFinite`` model over inputs ``x_1..x_n`` of ``dtypes`` (and
    ``shapes``; default unknown); output ``finite`` (bool scalar)."""
    n = len(dtypes)
    if shapes is None or dynamic:
        shapes = [None] * n
    inputs = [(f"x_{i + 1}", dt, None if s is None else tuple(s))
              for i, (dt, s) in enumerate(zip(dtypes, shapes))]
    return node_model("AllFinite", inputs, [("finite", np.bool_, ())],
                      domain=TRAINOPS_DOMAIN, **attrs)
