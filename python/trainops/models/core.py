"""The generic model helpers (:func:`node_model`, :func:`session_options`, :func:`session`)
and the builders of ONNX's optimizers (Adam, Adagrad, Momentum) and of ``Philox``: see
:mod:`trainops.models`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from ..onnx_defs import (IR_VERSION, ONNX_OPSET, TRAINING_DOMAIN, TRAINOPS_DOMAIN, opset_imports,
                        tensor_type)

__all__ = [
    "TRAINING_DOMAIN",
    "IR_VERSION",
    "ONNX_OPSET",
    "adam_names",
    "adam_model",
    "adam_feeds",
    "node_model",
    "tensor_type",
    "session_options",
    "session",
    "philox_model",
    "adagrad_model",
    "adagrad_feeds",
    "momentum_model",
    "momentum_feeds",
    "adamw_groups",
    "adamw_model",
    "adamw_feeds",
]


Shape = Optional[Sequence[Union[int, str, None]]]  # typing forms: Python 3.9 evaluates this at import


def tensor_shapes(n_or_shapes: int | Sequence[Shape]) -> tuple[int, list[Shape]]:
    """``(n, shapes)`` of a model builder's ``n_or_shapes``: a count (every shape unknown)
    or one shape (None: unknown) per tensor."""
    if isinstance(n_or_shapes, (int, np.integer)):
        return int(n_or_shapes), [None] * int(n_or_shapes)
    shapes: list[Shape] = [None if s is None else tuple(s) for s in n_or_shapes]
    return len(shapes), shapes


def adam_names(n: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of an Adam node over ``n`` tensors."""
    idx = range(1, n + 1)
    inputs = ["R", "T"] + [f"{p}_{i}" for p in "XGVH" for i in idx]
    outputs = [f"{p}_{i}_new" for p in "XVH" for i in idx]
    return inputs, outputs


def node_model(
    op_type: str,
    inputs: Sequence[tuple[str, Any, Shape]],
    outputs: Sequence[tuple[str, Any, Shape]],
    domain: str = TRAINING_DOMAIN,
    node_name: str | None = None,
    **attrs: Any,
):
    """A one-node model: ``inputs``/``outputs`` are ``(name, dtype, shape)``; a shape of
    ``None`` leaves the rank unknown, ``None``/str entries are symbolic dims."""
    from onnx import helper

    def vi(name, dtype, shape):
        return helper.make_tensor_value_info(name, tensor_type(dtype), shape)

    node = helper.make_node(
        op_type,
        [name for name, _, _ in inputs],
        [name for name, _, _ in outputs],
        domain=domain,
        name=node_name or op_type.lower(),
        **attrs,
    )
    graph = helper.make_graph(
        [node],
        f"{op_type.lower()}_graph",
        [vi(*i) for i in inputs],
        [vi(*o) for o in outputs],
    )
    opsets = opset_imports(["", domain] if domain else [""])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="trainops")
    model.ir_version = IR_VERSION
    return model


def adam_model(
    n_or_shapes: int | Sequence[Shape],
    dtype: Any = np.float32,
    r_dtype: Any = None,
    g_shapes: Sequence[Shape] | None = None,
    *,
    g_dtype: Any = None,
    t_dtype: Any = np.int64,
    r_shape: Shape = (),
    t_shape: Shape = (),
    dynamic: bool = False,
    **attrs: Any,
):
    """An ``ai.onnx.preview.training::Adam`` model.

    ``n_or_shapes``: the number of tensors (shapes left unknown) or a list of ``X_i``
    shapes (``V_i``/``H_i`` get the same). ``dtype``: ``X/V/H`` element type (``G`` too
    unless ``g_dtype``; every output has ``dtype``). ``r_dtype``: ``R``'s type (default:
    ``dtype``). ``g_shapes``: ``G_i`` shapes when they differ (broadcast). ``dynamic``:
    declare every tensor with unknown shape (one session then takes any shapes).
    Attributes (``alpha``, ``beta``, ``epsilon``, ``norm_coefficient``,
    ``norm_coefficient_post``) are passed to ``onnx.helper.make_node`` as given, so
    ``alpha=1`` makes an INT attribute.
    """
    n, shapes = tensor_shapes(n_or_shapes)
    if n < 1:
        raise ValueError("Adam needs at least one tensor")
    if g_shapes is None:
        g_shapes = shapes
    elif len(g_shapes) != n:
        raise ValueError(f"g_shapes has {len(g_shapes)} entries, expected {n}")
    if dynamic:
        shapes = [None] * n
        g_shapes = [None] * n
        r_shape = t_shape = None
    r_dtype = dtype if r_dtype is None else r_dtype
    g_dtype = dtype if g_dtype is None else g_dtype
    in_names, out_names = adam_names(n)
    inputs = [("R", r_dtype, r_shape), ("T", t_dtype, t_shape)]
    for p, dt, shp in (("X", dtype, shapes), ("G", g_dtype, g_shapes),
                       ("V", dtype, shapes), ("H", dtype, shapes)):
        inputs += [(f"{p}_{i + 1}", dt, shp[i]) for i in range(n)]
    outputs = []
    for p in "XVH":
        outputs += [(f"{p}_{i + 1}_new", dtype, shapes[i]) for i in range(n)]
    assert [i[0] for i in inputs] == in_names and [o[0] for o in outputs] == out_names
    return node_model("Adam", inputs, outputs, **attrs)


def adam_feeds(
    r: Any,
    t: Any,
    xs: Sequence[np.ndarray],
    gs: Sequence[np.ndarray],
    vs: Sequence[np.ndarray],
    hs: Sequence[np.ndarray],
    r_dtype: Any = None,
) -> dict[str, np.ndarray]:
    """The ``InferenceSession.run`` feed dict for :func:`adam_model`'s names.

    ``r``/``t`` may be Python numbers (then ``R`` gets ``r_dtype`` or ``xs[0]``'s dtype,
    ``T`` int64, both rank 0) or numpy arrays/scalars (passed with their own dtype)."""
    n = len(xs)
    if not (len(gs) == len(vs) == len(hs) == n):
        raise ValueError("xs, gs, vs, hs must have the same length")
    if isinstance(r, np.generic):
        r = np.asarray(r)
    elif not isinstance(r, np.ndarray):
        r = np.array(r, dtype=r_dtype or np.asarray(xs[0]).dtype)
    if isinstance(t, np.generic):
        t = np.asarray(t)
    elif not isinstance(t, np.ndarray):
        t = np.array(t, dtype=np.int64)
    feeds = {"R": r, "T": t}
    for p, arrs in (("X", xs), ("G", gs), ("V", vs), ("H", hs)):
        for i, a in enumerate(arrs):
            feeds[f"{p}_{i + 1}"] = a
    return feeds


def session_options(threads: int | None = None, library: str | None = None,
                    log_severity_level: int | None = None):
    """``SessionOptions`` with the trainops library registered."""
    import onnxruntime as ort

    from .. import get_library_path

    so = ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads = int(threads)
    if log_severity_level is not None:
        so.log_severity_level = int(log_severity_level)
    so.register_custom_ops_library(library or get_library_path())
    return so


def session(model: Any, threads: int | None = None, library: str | None = None,
            log_severity_level: int | None = None, **options: Any):
    """A CPU ``InferenceSession`` for ``model`` (ModelProto, bytes or path) with trainops
    registered. ``threads`` sets ``intra_op_num_threads``; other keyword arguments are set
    on the ``SessionOptions`` as attributes."""
    import onnxruntime as ort

    so = session_options(threads, library, log_severity_level)
    for key, value in options.items():
        setattr(so, key, value)
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif not isinstance(model, (bytes, bytearray)):
        model = str(model)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])



def philox_model(shape: Sequence[int] | None = None, *, state_shape: Shape = (6,),
                 state_out: bool = True, dynamic: bool = False):
    """A ``com.trainops::Philox`` model: input ``state`` (uint32, 6 elements); the output
    shape comes from the ``shape`` attribute when ``shape`` is given, else from a second
    input ``shape`` (int64, 1-D). Outputs ``output`` and, if ``state_out``, ``state_out``.
    ``dynamic`` declares every input with unknown rank, so that the op itself (not ONNX
    Runtime's input checks) sees whatever is fed."""
    if dynamic:
        state_shape = None
    inputs = [("state", np.uint32, state_shape)]
    attrs = {}
    if shape is None:
        inputs.append(("shape", np.int64, None if dynamic else [None]))
    else:
        attrs["shape"] = [int(d) for d in shape]
    outputs = [("output", np.uint32, None)]
    if state_out:
        outputs.append(("state_out", np.uint32, state_shape))
    return node_model("Philox", inputs, outputs, domain=TRAINOPS_DOMAIN, **attrs)


def _optimizer_model(op: str, groups: Sequence[str], n_or_shapes: int | Sequence[Shape], dtype: Any,
                     r_dtype: Any, g_shapes: Sequence[Shape] | None, *, g_dtype: Any = None,
                     t_dtype: Any = np.int64, r_shape: Shape = (), t_shape: Shape = (),
                     dynamic: bool = False, **attrs: Any):
    """A one-node model of an ONNX optimizer whose inputs are ``R, T`` then the tensor
    groups named by ``groups`` (``"XGH"``: ``X_1..X_n, G_1..G_n, H_1..H_n``, or a list of
    names; the second is the gradient), and whose outputs rewrite every group but the
    gradient. A ``domain`` keyword goes to :func:`node_model`."""
    n, shapes = tensor_shapes(n_or_shapes)
    if n < 1:
        raise ValueError(f"{op} needs at least one tensor")
    g_shapes = list(shapes if g_shapes is None else g_shapes)
    if len(g_shapes) != n:
        raise ValueError(f"g_shapes has {len(g_shapes)} entries, expected {n}")
    if dynamic:
        shapes, g_shapes, r_shape, t_shape = [None] * n, [None] * n, None, None
    inputs = [("R", dtype if r_dtype is None else r_dtype, r_shape), ("T", t_dtype, t_shape)]
    for k, p in enumerate(groups):
        dt, shp = (dtype if g_dtype is None else g_dtype, g_shapes) if k == 1 else (dtype, shapes)
        inputs += [(f"{p}_{i + 1}", dt, shp[i]) for i in range(n)]
    outputs = [(f"{p}_{i + 1}_new", dtype, shapes[i])
               for p in list(groups[:1]) + list(groups[2:]) for i in range(n)]
    return node_model(op, inputs, outputs, **attrs)


def _optimizer_feeds(r: Any, t: Any, groups: Sequence[str], lists: Sequence[Sequence[np.ndarray]],
                     r_dtype: Any = None) -> dict[str, np.ndarray]:
    """Feeds ``R, T`` (as :func:`adam_feeds` makes them) and ``<group>_<i>`` for each list."""
    if len({len(a) for a in lists}) != 1:
        raise ValueError(f"the {', '.join(groups)} lists must have the same length")
    xs = lists[0]
    feeds = adam_feeds(r, t, xs, xs, xs, xs, r_dtype=r_dtype)  # only its R and T are kept
    feeds = {"R": feeds["R"], "T": feeds["T"]}
    for p, arrs in zip(groups, lists):
        feeds.update({f"{p}_{i + 1}": a for i, a in enumerate(arrs)})
    return feeds


def adagrad_model(n_or_shapes: int | Sequence[Shape], dtype: Any = np.float32,
                  r_dtype: Any = None, g_shapes: Sequence[Shape] | None = None, **kwargs: Any):
    """An ``ai.onnx.preview.training::Adagrad`` model: inputs ``R, T, X_1..X_n, G_1..G_n,
    H_1..H_n``, outputs ``X_1_new..X_n_new, H_1_new..H_n_new``. Arguments as
    :func:`adam_model`'s; attributes ``decay_factor``, ``epsilon``, ``norm_coefficient``."""
    return _optimizer_model("Adagrad", "XGH", n_or_shapes, dtype, r_dtype, g_shapes, **kwargs)


def adagrad_feeds(r: Any, t: Any, xs: Sequence[np.ndarray], gs: Sequence[np.ndarray],
                  hs: Sequence[np.ndarray], r_dtype: Any = None) -> dict[str, np.ndarray]:
    """The feed dict for :func:`adagrad_model`'s names (``R``/``T`` as in :func:`adam_feeds`)."""
    return _optimizer_feeds(r, t, "XGH", [xs, gs, hs], r_dtype)


def momentum_model(n_or_shapes: int | Sequence[Shape], dtype: Any = np.float32,
                   r_dtype: Any = None, g_shapes: Sequence[Shape] | None = None, **kwargs: Any):
    """An ``ai.onnx.preview.training::Momentum`` model: inputs ``R, T, X_1..X_n, G_1..G_n,
    V_1..V_n``, outputs ``X_1_new..X_n_new, V_1_new..V_n_new``. Arguments as
    :func:`adam_model`'s. ONNX requires all four attributes (``alpha``, ``beta``, ``mode``
    "standard" or "nesterov", ``norm_coefficient``); none is filled in here."""
    return _optimizer_model("Momentum", "XGV", n_or_shapes, dtype, r_dtype, g_shapes, **kwargs)


def momentum_feeds(r: Any, t: Any, xs: Sequence[np.ndarray], gs: Sequence[np.ndarray],
                   vs: Sequence[np.ndarray], r_dtype: Any = None) -> dict[str, np.ndarray]:
    """The feed dict for :func:`momentum_model`'s names (``R``/``T`` as in :func:`adam_feeds`)."""
    return _optimizer_feeds(r, t, "XGV", [xs, gs, vs], r_dtype)


def adamw_groups(amsgrad: bool = False) -> list[str]:
    """The input groups of a ``com.trainops::AdamW`` node: ``X, G, M, V`` (and ``Vmax``)."""
    return ["X", "G", "M", "V"] + (["Vmax"] if amsgrad else [])


def adamw_model(n_or_shapes: int | Sequence[Shape], dtype: Any = np.float32,
                r_dtype: Any = None, g_shapes: Sequence[Shape] | None = None, *,
                amsgrad: int = 0, **kwargs: Any):
    """A ``com.trainops::AdamW`` model: inputs ``R, T, X_1..X_n, G_1..G_n, M_1..M_n,
    V_1..V_n`` (and ``Vmax_1..Vmax_n`` when ``amsgrad``), outputs ``X_i_new, M_i_new,
    V_i_new`` (and ``Vmax_i_new``). Arguments as :func:`adam_model`'s; attributes
    ``beta1``, ``beta2``, ``epsilon``, ``weight_decay``, ``maximize`` (left out: torch's
    defaults); ``amsgrad`` is written only when non-zero."""
    if amsgrad:
        kwargs["amsgrad"] = amsgrad
    return _optimizer_model("AdamW", adamw_groups(bool(amsgrad)), n_or_shapes, dtype, r_dtype,
                            g_shapes, domain=TRAINOPS_DOMAIN, **kwargs)


def adamw_feeds(r: Any, t: Any, xs: Sequence[np.ndarray], gs: Sequence[np.ndarray],
                ms: Sequence[np.ndarray], vs: Sequence[np.ndarray],
                vmaxs: Sequence[np.ndarray] | None = None, r_dtype: Any = None) -> dict[str, np.ndarray]:
    """The feed dict for :func:`adamw_model`'s names (``R``/``T`` as in :func:`adam_feeds`);
    ``vmaxs`` for an amsgrad model."""
    lists = [xs, gs, ms, vs] + ([] if vmaxs is None else [vmaxs])
    return _optimizer_feeds(r, t, adamw_groups(vmaxs is not None), lists, r_dtype)
