"""Gradient rules for the ops exporters and the ONNX zoo use (the rules_*.py modules of trainops.autodiff) against
central finite differences of the forward graph run in plain onnxruntime (float64 where
onnxruntime has the kernels, else float32), and against analytic float64 numpy where the
derivative is a convention (ties, kinks). Each op runs at opset 13 and at the newest opset
both onnx and onnxruntime know (plus older opsets where the op changed); a case whose opset
the installed runtime lacks skips and says why. Every expanded model passes onnx.checker
(inside ``check``)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi import _pybind_state as ort_c

from helpers.gradcheck import check, make_model, ort_version, session
from trainops.autodiff import RULES, GradientError, expand_gradients
from trainops.onnx_defs import TRAINING_DOMAIN

rng = np.random.default_rng(23)


def _cpu_kernels() -> dict[str, list[tuple[int, int, bool]]]:
    """op -> [(first opset, last opset, has a double kernel)] of onnxruntime's CPU kernels."""
    out: dict[str, list[tuple[int, int, bool]]] = {}
    for k in ort_c.get_all_opkernel_def():
        if k.domain in ("", "ai.onnx") and k.provider == "CPUExecutionProvider":
            double = any("double" in t for ts in k.type_constraints.values() for t in ts)
            out.setdefault(k.op_name, []).append((*k.version_range, double))
    return out


KERNELS = _cpu_kernels()
RUNTIME_OPSET = max(lo for ranges in KERNELS.values() for lo, _, _ in ranges)
NEWEST = min(onnx.defs.onnx_opset_version(), RUNTIME_OPSET)
OPSETS = sorted({13, NEWEST})


def at(op: str, opset: int) -> int:
    """``opset``, or skip when onnx or onnxruntime cannot run ``op`` there."""
    if opset > onnx.defs.onnx_opset_version():
        pytest.skip(f"onnx {onnx.__version__} knows opsets up to {onnx.defs.onnx_opset_version()}")
    if opset > RUNTIME_OPSET:
        pytest.skip(f"onnxruntime {ort.__version__} runs opsets up to {RUNTIME_OPSET}")
    try:
        schema = onnx.defs.get_schema(op, opset)
    except onnx.defs.SchemaError:
        pytest.skip(f"{op} does not exist at opset {opset}")
    since = schema.since_version
    if schema.deprecated:
        pytest.skip(f"onnx {onnx.__version__} deprecates {op}-{since} (its checker rejects it)")
    if any(lo <= since <= hi for lo, hi, _ in KERNELS.get(op, [])):
        return opset
    if schema.has_function or schema.has_context_dependent_function:
        return opset  # onnxruntime inlines the function body
    pytest.skip(f"onnxruntime {ort.__version__} has no CPU kernel for {op}-{since}")


def fd_dtypes(op: str, opset: int) -> tuple:
    """float64 only where onnxruntime registers a double kernel for ``op`` at ``opset`` (a
    double input to a float-only kernel may be computed in float: onnxruntime 1.17's
    ReduceL2-18), else float32 with its wider step and tolerance."""
    since = onnx.defs.get_schema(op, opset).since_version
    if any(lo <= since <= hi and d for lo, hi, d in KERNELS.get(op, [])):
        return (np.float64, np.float32)
    return (np.float32,)


def r(*shape, lo=None):
    a = rng.standard_normal(shape)
    return np.abs(a) + lo if lo is not None else a


def avoiding(a, points, margin=0.05):
    """``a`` with values within ``margin`` of a kink in ``points`` moved off it."""
    a = np.array(a, dtype=np.float64)
    for p in points:
        near = np.abs(a - p) < margin
        a[near] = p + np.where(a[near] >= p, 2, -2) * margin
    return a


def distinct(*shape, scale=0.37):
    """No two elements equal (no ties for Max/Min/TopK), spread around zero."""
    n = int(np.prod(shape))
    return (rng.permutation(n) - n / 2).reshape(shape) * scale + 0.01


def node(op, ins, outs=("y",), **kw):
    return helper.make_node(op, list(ins), list(outs), **kw)


def backward_grads(nodes, feeds: dict, wrt: list[str], R, opset: int, out: str = "y",
                   dtype=np.float64):
    """The expanded gradient of ``sum(out * R)`` (float feeds cast to ``dtype``), run in
    onnxruntime."""
    feeds = {k: v.astype(dtype) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    ttype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                         list(v.shape)) for k, v in feeds.items()]
    tail = [node("Mul", [out, "R"], ["yR"]), node("ReduceSum", ["yR"], ["loss"], keepdims=0),
            helper.make_node("Gradient", wrt, [f"d_{x}" for x in wrt], domain=TRAINING_DOMAIN,
                             xs=wrt, y="loss")]
    outs = [helper.make_tensor_value_info(f"d_{x}", ttype, list(feeds[x].shape))
            for x in wrt]
    init = [onnx.numpy_helper.from_array(np.asarray(R, dtype), "R")]
    m = expand_gradients(make_model(list(nodes) + tail, vis, outs, init, opset))
    onnx.checker.check_model(m)
    return session(m).run([f"d_{x}" for x in wrt], feeds)


# --- variadic elementwise ------------------------------------------------------------

VARIADIC_SHAPES = [[(2, 3, 4)], [(2, 3, 4), (3, 1), (4,)], [(3, 1), (1, 4)], [(2, 3), (2, 3)]]


@pytest.mark.parametrize("shapes", VARIADIC_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
@pytest.mark.parametrize("opset", OPSETS + [9])  # broadcasting since 8; the seed needs 9
def test_variadic(op, shapes, opset):
    at(op, opset)
    names = [f"x{i}" for i in range(len(shapes))]
    ins = {n: distinct(*s) + 0.05 * i for i, (n, s) in enumerate(zip(names, shapes))}
    check([node(op, names)], ins, names, opset=opset)


def test_variadic_symbolic_dims():
    check([node("Max", ["a", "b"])], {"a": distinct(3, 4), "b": distinct(1, 4) + 0.01},
          ["a", "b"], symbolic={"a": ["N", 4], "b": [None, 4]})


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_ties_split_evenly(op):
    """Where k inputs tie for the extremum each gets dy/k (torch.maximum's convention for
    two inputs, extended to k); the others get 0."""
    a = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]])
    b = np.array([1.0, 5.0, -3.0])           # ties a[0, 0] (both the max and the min there)
    c = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]])  # ties a everywhere
    R = r(2, 3)
    got = backward_grads([node(op, ["a", "b", "c"])], {"a": a, "b": b, "c": c}, ["a", "b", "c"],
                         R, 17)
    stack = np.broadcast_arrays(a, b, c)
    y = np.max(stack, 0) if op == "Max" else np.min(stack, 0)
    masks = [(s == y).astype(np.float64) for s in stack]
    count = sum(masks)
    want = [m * R / count for m in masks]
    np.testing.assert_allclose(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1].sum(0))
    np.testing.assert_allclose(got[2], want[2])


# --- Clip ----------------------------------------------------------------------------------

CLIP_CASES = [("lo", "hi"), ("lo", ""), ("", "hi"), ("", "")]


@pytest.mark.parametrize("bounds", CLIP_CASES, ids=str)
@pytest.mark.parametrize("opset", OPSETS + [11, 12])
def test_clip_inputs(bounds, opset):
    at("Clip", opset)
    x = avoiding(r(3, 4) * 1.5, [-0.5, 0.7])
    ins = {"x": x}
    wrt = ["x"]
    for name, v in zip(bounds, [-0.5, 0.7]):
        if name:
            ins[name] = np.array(v)
            wrt.append(name)
    names = ["x", bounds[0], bounds[1]]
    while names and not names[-1]:
        names.pop()
    check([node("Clip", names)], ins, wrt, opset=opset)


def test_clip_min_above_max_gives_everything_to_max():
    x = r(2, 3)
    check([node("Clip", ["x", "lo", "hi"])], {"x": x, "lo": np.array(0.5), "hi": np.array(-0.5)},
          ["x", "lo", "hi"])


@pytest.mark.parametrize("attrs", [dict(min=-0.5, max=0.7), dict(min=-0.5), dict(max=0.7), {}],
                         ids=str)
def test_clip_attributes_before_opset11(attrs):
    at("Clip", 10)  # Clip-6 (attributes); the backward's ConstantOfShape needs opset >= 9
    check([node("Clip", ["x"], **attrs)], {"x": avoiding(r(3, 4) * 1.5, [-0.5, 0.7])}, ["x"],
          opset=10)


def test_clip_boundaries_are_inside():
    """x == min or x == max: x gets dy (PyTorch's clamp), the bound gets none."""
    x = np.array([-0.5, -0.2, 0.7, 0.9, -1.0])
    R = r(5)
    gx, glo, ghi = backward_grads([node("Clip", ["x", "lo", "hi"])],
                                  {"x": x, "lo": np.array(-0.5), "hi": np.array(0.7)},
                                  ["x", "lo", "hi"], R, 13)
    np.testing.assert_allclose(gx, R * np.array([1, 1, 1, 0, 0]))
    np.testing.assert_allclose(glo, R[4])
    np.testing.assert_allclose(ghi, R[3])


# --- activations ----------------------------------------------------------------------------

ACTIVATIONS = [
    ("HardSigmoid", {}, [-2.5, 2.5]),
    ("HardSigmoid", dict(alpha=0.3, beta=0.4), [-0.4 / 0.3, 0.6 / 0.3]),
    ("HardSwish", {}, [-3.0, 3.0]),
    ("Softplus", {}, []),
    ("Elu", {}, [0.0]),
    ("Elu", dict(alpha=0.7), [0.0]),
    ("Selu", {}, [0.0]),
    ("Selu", dict(alpha=1.2, gamma=0.9), [0.0]),
    ("Celu", {}, [0.0]),
    ("Celu", dict(alpha=1.5), [0.0]),
    ("Mish", {}, []),
    ("Sin", {}, []),
    ("Cos", {}, []),
]


@pytest.mark.parametrize("op,kw,kinks", ACTIVATIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("opset", OPSETS)
def test_activation(op, kw, kinks, opset):
    opset = max(opset, onnx.defs.get_schema(op).since_version if op in ("HardSwish", "Mish") else 0)
    at(op, opset)
    x = avoiding(r(3, 5) * 2.5, kinks, margin=0.1)
    check([node(op, ["x"], **kw)], {"x": x}, ["x"], opset=opset)


@pytest.mark.parametrize("slope_shape", [(4,), (3, 1), (1,), (2, 3, 4), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("opset", OPSETS + [9])
def test_prelu(slope_shape, opset):
    at("PRelu", opset)
    check([node("PRelu", ["x", "s"])], {"x": avoiding(r(2, 3, 4), [0.0]),
                                        "s": r(*slope_shape) * 0.5},
          ["x", "s"], opset=opset)


def test_activation_kinks_take_pytorchs_branch():
    """At the kinks: HardSwish is x/3 + 1/2 on [-3, 3] (so 1.5 at 3, -0.5 at -3), 0 below,
    1 above; HardSigmoid 0 at the ends; Elu/Celu/PRelu use the negative branch at 0."""
    x = np.array([-3.0, 3.0, -3.5, 3.5, 0.0])
    R = np.ones(5)
    f32 = dict(dtype=np.float32)  # onnxruntime has float kernels only for these
    (g,) = backward_grads([node("HardSwish", ["x"])], {"x": x}, ["x"], R, at("HardSwish", 14),
                          **f32)
    np.testing.assert_allclose(g, [-0.5, 1.5, 0.0, 1.0, 0.5], rtol=1e-6)
    (g,) = backward_grads([node("HardSigmoid", ["x"])], {"x": np.array([-2.5, 2.5, 0.0])},
                          ["x"], np.ones(3), 13, **f32)
    np.testing.assert_allclose(g, [0.0, 0.0, 0.2], rtol=1e-6)
    (g,) = backward_grads([node("Elu", ["x"], alpha=0.7)], {"x": np.array([0.0])}, ["x"],
                          np.ones(1), 13, **f32)
    np.testing.assert_allclose(g, [0.7], rtol=1e-6)
    (g,) = backward_grads([node("Celu", ["x"], alpha=0.7)], {"x": np.array([0.0])}, ["x"],
                          np.ones(1), 13, **f32)
    np.testing.assert_allclose(g, [1.0], rtol=1e-6)
    g, gs = backward_grads([node("PRelu", ["x", "s"])], {"x": np.array([0.0, 1.0]),
                                                          "s": np.array([0.25])},
                           ["x", "s"], np.ones(2), 13, **f32)
    np.testing.assert_allclose(g, [0.25, 1.0])
    np.testing.assert_allclose(gs, [0.0])


@pytest.mark.parametrize("op", ["Floor", "Ceil", "Round", "Sign"])
@pytest.mark.parametrize("opset", OPSETS)
def test_piecewise_constant_ops_pass_no_gradient(op, opset):
    at(op, opset)
    x = avoiding(r(3, 4) * 3, list(np.arange(-10, 11) * 0.5), margin=0.05)
    # y = x * op(x): d/dx = op(x) (the op's own derivative is 0 off its steps)
    check([node(op, ["x"], ["t"]), node("Mul", ["x", "t"])], {"x": x}, ["x"], opset=opset)
    check([node(op, ["x"])], {"x": x}, ["x"], opset=opset)



# --- reductions, CumSum, TopK -----------------------------------------------------------------

def _reduce_node(op, opset, axes, keepdims, consts):
    if axes is None:
        return node(op, ["x"], keepdims=keepdims)
    if opset >= 18:
        consts["ax"] = np.array(axes, np.int64)
        return node(op, ["x", "ax"], keepdims=keepdims)
    return node(op, ["x"], keepdims=keepdims, axes=axes)


@pytest.mark.parametrize("axes", [[0, -1], [1], None], ids=str)
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceL2", "ReduceLogSumExp"])
@pytest.mark.parametrize("opset", OPSETS + [11, 18])
def test_reduce(op, keepdims, axes, opset):
    at(op, opset)
    consts = {}
    n = _reduce_node(op, opset, axes, keepdims, consts)
    check([n], {"x": distinct(2, 3, 4)}, ["x"], consts=consts, opset=opset,
          dtypes=fd_dtypes(op, opset))


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceL2", "ReduceLogSumExp"])
def test_reduce_symbolic_dims(op):
    check([node(op, ["x"], keepdims=0, axes=[1])], {"x": distinct(3, 4)}, ["x"],
          symbolic={"x": ["N", None]}, opset=13)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceL2", "ReduceLogSumExp"])
def test_reduce_noop_with_empty_axes(op):
    """A reduction over no axes (ReduceL2 is then |x|, ReduceLogSumExp x)."""
    at(op, 18)
    n = node(op, ["x"], keepdims=0, noop_with_empty_axes=1)
    vi = helper.make_tensor_value_info
    probe = make_model([n], [vi("x", TensorProto.FLOAT, [3, 4])],
                       [vi("y", TensorProto.FLOAT, None)], opset=18)
    try:
        session(probe).run(["y"], {"x": np.ones((3, 4), np.float32)})
    except Exception as exc:  # noqa: BLE001 - onnxruntime 1.17 reduces all axes and fails
        pytest.skip(f"onnxruntime {ort.__version__} does not run noop_with_empty_axes: {exc}")
    check([n], {"x": distinct(3, 4)}, ["x"], opset=18, dtypes=fd_dtypes(op, 18))


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_max_min_ties_split_evenly(op):
    """Elements tying for the extremum share dy evenly (torch.amax/amin's convention)."""
    x = np.array([[1.0, 3.0, 3.0, -2.0], [-2.0, 0.5, -2.0, -2.0], [4.0, 4.0, 4.0, 4.0]])
    R = r(3)
    (g,) = backward_grads([node(op, ["x"], axes=[1], keepdims=0)], {"x": x}, ["x"], R, 13)
    y = (x.max if op == "ReduceMax" else x.min)(axis=1, keepdims=True)
    mask = (x == y).astype(np.float64)
    np.testing.assert_allclose(g, mask * R[:, None] / mask.sum(1, keepdims=True))


def test_reduce_l2_of_zeros_has_zero_gradient():
    x = np.array([[0.0, 0.0], [3.0, 4.0]])
    (g,) = backward_grads([node("ReduceL2", ["x"], axes=[1], keepdims=0)], {"x": x}, ["x"],
                          np.array([2.0, 5.0]), 13, dtype=np.float32)
    np.testing.assert_allclose(g, [[0.0, 0.0], [5.0 * 0.6, 5.0 * 0.8]], rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("opset", OPSETS + [11])
def test_cumsum(axis, exclusive, reverse, opset):
    at("CumSum", opset)
    check([node("CumSum", ["x", "ax"], exclusive=exclusive, reverse=reverse)], {"x": r(3, 4)},
          ["x"], consts={"ax": np.array(axis, np.int64)}, opset=opset)


def test_cumsum_axis_at_run_time():
    check([node("CumSum", ["x", "ax"], reverse=1)], {"x": r(3, 4), "ax": np.array(1, np.int32)},
          ["x"])


@pytest.mark.parametrize("axis,k,largest", [(-1, 2, 1), (0, 1, 1), (1, 3, 0), (1, 4, 1)])
@pytest.mark.parametrize("opset", OPSETS + [10, 11])
def test_topk(axis, k, largest, opset):
    at("TopK", opset)
    kw = dict(axis=axis)
    if opset >= 11:
        kw["largest"] = largest
    elif not largest:
        pytest.skip("largest=0 needs TopK-11")
    check([node("TopK", ["x", "k"], ["y", "i"], **kw)], {"x": distinct(3, 4)}, ["x"],
          consts={"k": np.array([k], np.int64)}, opset=opset)


def test_topk_values_feed_a_graph_that_also_uses_indices():
    nodes = [node("TopK", ["x", "k"], ["v", "i"], axis=1), node("Cast", ["i"], ["f"], to=11),
             node("Mul", ["v", "f"])]
    check(nodes, {"x": distinct(3, 5)}, ["x"], consts={"k": np.array([2], np.int64)},
          dtypes=(np.float64,))


# --- Tile, GatherElements, DepthToSpace, SpaceToDepth -----------------------------------------

@pytest.mark.parametrize("shape,reps", [((2, 3), (2, 1)), ((2, 1, 3), (1, 3, 2)), ((4,), (3,)),
                                        ((2, 3), (1, 1))], ids=str)
@pytest.mark.parametrize("opset", OPSETS + [9])
def test_tile(shape, reps, opset):
    at("Tile", opset)
    check([node("Tile", ["x", "reps"])], {"x": r(*shape)}, ["x"],
          consts={"reps": np.array(reps, np.int64)}, opset=opset)


def test_tile_repeats_and_shape_at_run_time():
    check([node("Tile", ["x", "reps"])], {"x": r(2, 3), "reps": np.array([2, 3], np.int64)},
          ["x"], symbolic={"x": ["N", None]})


GATHER_ELEMENTS = [
    (0, (3, 4), np.array([[2, 0, 1, 2], [0, 0, 2, 1]])),     # duplicates along the axis
    (1, (3, 4), np.array([[3, 3], [0, -1], [1, 2]])),        # negative, fewer along the axis
    (-1, (2, 3, 4), np.array([[[0, 3, 3]], [[1, 2, 0]]])),   # shorter on other axes too
    (1, (2, 3), np.array([[0, 2, 1], [1, 1, 1]])),
]


@pytest.mark.parametrize("axis,shape,idx", GATHER_ELEMENTS, ids=lambda v: str(np.shape(v)))
@pytest.mark.parametrize("opset", OPSETS + [11, 16])
def test_gather_elements(axis, shape, idx, opset):
    at("GatherElements", opset)
    check([node("GatherElements", ["x", "i"], axis=axis)], {"x": r(*shape), "i": idx}, ["x"],
          opset=opset)


@pytest.mark.parametrize("opset", [13, 16])
def test_gather_elements_symbolic(opset):
    check([node("GatherElements", ["x", "i"], axis=1)],
          {"x": r(3, 4), "i": np.array([[0, 3], [1, 1], [2, 0]])}, ["x"],
          symbolic={"x": ["N", None], "i": ["N", None]}, opset=opset)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("bs", [2, 3])
@pytest.mark.parametrize("opset", OPSETS + [11])
def test_depth_to_space(mode, bs, opset):
    at("DepthToSpace", opset)
    check([node("DepthToSpace", ["x"], blocksize=bs, mode=mode)], {"x": r(2, 2 * bs * bs, 2, 3)},
          ["x"], opset=opset)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_symbolic(mode):
    check([node("DepthToSpace", ["x"], blocksize=2, mode=mode)], {"x": r(2, 8, 2, 3)}, ["x"],
          symbolic={"x": ["N", 8, "H", "W"]})


@pytest.mark.parametrize("bs", [2, 3])
@pytest.mark.parametrize("opset", OPSETS + [9])
def test_space_to_depth(bs, opset):
    at("SpaceToDepth", opset)
    sym = {"x": ["N", 2, 2 * bs, 3 * bs]} if opset >= 13 else {}
    check([node("SpaceToDepth", ["x"], blocksize=bs)], {"x": r(2, 2, 2 * bs, 3 * bs)}, ["x"],
          opset=opset, symbolic=sym)


# --- Pad ---------------------------------------------------------------------------------------

PAD_CASES = [
    ("constant", [1, 0, 2, 1, 3, 0]),
    ("constant", [-1, 2, 0, 1, -2, 1]),    # negative pads crop
    ("reflect", [1, 2, 0, 1, 3, 1]),
    ("reflect", [0, 3, 1, 0, 3, 0]),       # as far as one reflection goes: n - 1
    ("edge", [2, 0, 1, 1, 4, 0]),
    ("wrap", [1, 4, 2, 2, 1, 0]),          # up to n
]


def _pad_nodes(mode, pads, opset, consts, value=None):
    if opset < 11:
        kw = dict(mode=mode, pads=pads)
        if value is not None:
            kw["value"] = value
        return [node("Pad", ["x"], **kw)]
    consts["pads"] = np.array(pads, np.int64)
    ins = ["x", "pads"]
    if value is not None:
        ins.append("v")
    return [node("Pad", ins, mode=mode)]


@pytest.mark.parametrize("mode,pads", PAD_CASES, ids=str)
@pytest.mark.parametrize("opset", OPSETS + [10, 11, 18, 19])
def test_pad(mode, pads, opset):
    at("Pad", opset)
    if mode == "wrap" and opset < 19:
        pytest.skip("mode 'wrap' is Pad-19")
    consts = {}
    check(_pad_nodes(mode, pads, opset, consts), {"x": r(2, 4, 3)}, ["x"], consts=consts,
          opset=opset)


@pytest.mark.parametrize("opset", OPSETS)
def test_pad_constant_value_gets_the_padding(opset):
    at("Pad", opset)
    consts = {"pads": np.array([1, 0, 0, 2], np.int64)}
    check([node("Pad", ["x", "pads", "v"])], {"x": r(2, 3), "v": np.array(0.3)}, ["x", "v"],
          consts=consts, opset=opset)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("opset", [18, NEWEST])
def test_pad_axes_input(mode, opset):
    at("Pad", opset)
    check([node("Pad", ["x", "pads", "", "ax"], mode=mode)], {"x": r(2, 3, 4)}, ["x"],
          consts={"pads": np.array([2, 1, 0, 1], np.int64), "ax": np.array([-1, 0], np.int64)},
          opset=opset)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("opset", [16, NEWEST])
def test_pad_at_run_time(mode, opset):
    """pads a graph input and the sizes symbolic: constant crops by the negated pads, the
    others scatter dy onto a padded index grid."""
    at("Pad", opset)
    check([node("Pad", ["x", "pads"], mode=mode)],
          {"x": r(3, 4), "pads": np.array([1, 2, 2, 0], np.int64)}, ["x"],
          symbolic={"x": ["N", None]}, opset=opset)


def test_pad_reflect_at_run_time_before_opset16_is_a_clear_error():
    m = _gradient_model([node("Pad", ["x", "pads"], name="pad", mode="reflect")],
                        {"x": (3, 4), "pads": (4,)}, ["x"], opset=13,
                        int_inputs=("pads",))
    with pytest.raises(GradientError, match=r"Pad node 'pad': mode='reflect'.*opset >= 16"):
        expand_gradients(m)


# --- Einsum ------------------------------------------------------------------------------------

EINSUM_CASES = [
    ("ij,jk->ik", [(3, 4), (4, 2)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
    ("ij->", [(3, 4)]),
    ("ij->ji", [(3, 4)]),
    ("i,i->", [(5,), (5,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,jk", [(3, 4), (4, 2)]),                   # implicit output
    ("ij,k->i", [(3, 4), (2,)]),                   # k summed from operand 1 alone
    ("kj,ji->ik", [(2, 3), (3, 4)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 5, 4, 2)]),  # broadcast ellipsis
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 2)]),
    ("...i,...i->...", [(2, 3), (2, 3)]),
    ("bi,bij,j->b", [(2, 3), (2, 3, 4), (4,)]),
]


@pytest.mark.parametrize("eq,shapes", EINSUM_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("opset", OPSETS)
def test_einsum(eq, shapes, opset):
    at("Einsum", opset)
    names = [f"x{i}" for i in range(len(shapes))]
    check([node("Einsum", names, equation=eq)],
          {n: r(*s) for n, s in zip(names, shapes)}, names, opset=opset)


def test_einsum_symbolic_batch():
    check([node("Einsum", ["a", "b"], equation="bij,jk->bik")], {"a": r(2, 3, 4), "b": r(4, 2)},
          ["a", "b"], symbolic={"a": ["N", 3, 4]}, opset=13)


def test_einsum_diagonal_is_a_clear_error():
    m = _gradient_model([node("Einsum", ["x"], name="tr", equation="ii->")], {"x": (3, 3)}, ["x"])
    with pytest.raises(GradientError, match=r"Einsum node 'tr': operand 0's subscripts 'ii'"):
        expand_gradients(m)


def _gradient_model(nodes, shapes: dict, xs, y="y", opset=17, int_inputs=()):
    vis = [helper.make_tensor_value_info(
        k, TensorProto.INT64 if k in int_inputs else TensorProto.FLOAT, list(v))
        for k, v in shapes.items()]
    g = helper.make_node("Gradient", xs, [f"d_{x}" for x in xs], name="my_gradient",
                         domain=TRAINING_DOMAIN, xs=xs, y=y)
    outs = [helper.make_tensor_value_info(f"d_{x}", TensorProto.FLOAT, None) for x in xs]
    return make_model(list(nodes) + [g], vis, outs, opset=opset)


# --- ConvTranspose, LRN, InstanceNormalization, GroupNormalization ------------------------------

CONV_T_CASES = [
    dict(x=(2, 3, 3, 4), w=(3, 2, 3, 3), kw={}),
    dict(x=(1, 2, 3, 3), w=(2, 3, 3, 2), kw=dict(strides=[2, 2], pads=[1, 0, 0, 1])),
    dict(x=(1, 2, 3, 4), w=(2, 2, 2, 3), kw=dict(strides=[2, 3], output_padding=[1, 2])),
    dict(x=(1, 2, 4, 3), w=(2, 1, 2, 2),
         kw=dict(dilations=[2, 1], strides=[1, 2], pads=[1, 1, 0, 0])),
    dict(x=(2, 4, 3, 3), w=(4, 3, 3, 3), kw=dict(group=2, strides=[2, 1], pads=[1, 1, 1, 1])),
    dict(x=(1, 3, 3, 2), w=(3, 1, 2, 2), kw=dict(group=3, auto_pad="VALID", strides=[2, 2])),
    dict(x=(2, 2, 5), w=(2, 3, 3), kw=dict(strides=[2], pads=[2, 1], dilations=[2])),
    dict(x=(1, 1, 4), w=(1, 2, 3), kw=dict(strides=[3], dilations=[2], output_padding=[2])),
]


@pytest.mark.parametrize("case", CONV_T_CASES,
                         ids=lambda c: "x{}w{}{}".format(c["x"], c["w"], c["kw"]))
@pytest.mark.parametrize("opset", OPSETS)
def test_conv_transpose(case, opset):
    at("ConvTranspose", opset)
    c_out = case["w"][1] * case["kw"].get("group", 1)
    ins = {"x": r(*case["x"]), "w": r(*case["w"]), "b": r(c_out)}
    check([node("ConvTranspose", ["x", "w", "b"], **case["kw"])], ins, ["x", "w", "b"],
          opset=opset)


def test_conv_transpose_symbolic_batch_no_bias():
    check([node("ConvTranspose", ["x", "w"], strides=[2, 2])], {"x": r(2, 2, 3, 3),
                                                                 "w": r(2, 2, 2, 2)},
          ["x", "w"], symbolic={"x": ["N", 2, "H", "W"]})


@pytest.mark.parametrize("kw,msg", [(dict(output_shape=[6, 6]), "output_shape"),
                                    (dict(auto_pad="SAME_UPPER"), "output_shape"),
                                    (dict(dilations=[3, 3], output_padding=[2, 0]),
                                     r"output_padding \[2, 0\] >= strides")])
def test_conv_transpose_unsupported_is_a_clear_error(kw, msg):
    m = _gradient_model([node("ConvTranspose", ["x", "w"], name="up", strides=[2, 2], **kw)],
                        {"x": (1, 1, 3, 3), "w": (1, 1, 2, 2)}, ["x"])
    with pytest.raises(GradientError, match=r"ConvTranspose node 'up': " + msg):
        expand_gradients(m)


@pytest.mark.parametrize("kw", [dict(size=3), dict(size=3, alpha=0.3, beta=0.6, bias=2.0),
                                dict(size=5, alpha=0.2, beta=1.1), dict(size=1, alpha=0.5),
                                dict(size=7, alpha=0.4)], ids=str)
@pytest.mark.parametrize("shape", [(2, 5, 3, 2), (1, 6, 1, 4)], ids=str)
@pytest.mark.parametrize("opset", OPSETS)
def test_lrn(kw, shape, opset):
    """onnxruntime runs LRN on 4-D inputs with odd sizes only (the rule covers any)."""
    at("LRN", opset)
    check([node("LRN", ["x"], **kw)], {"x": r(*shape)}, ["x"], opset=opset)


def test_lrn_symbolic():
    check([node("LRN", ["x"], size=3, alpha=0.5)], {"x": r(2, 4, 3, 2)}, ["x"],
          symbolic={"x": ["N", "C", None, 2]})


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 6), (1, 2, 3, 2, 2)], ids=str)
@pytest.mark.parametrize("opset", OPSETS)
def test_instance_norm(shape, opset):
    at("InstanceNormalization", opset)
    c = shape[1]
    check([node("InstanceNormalization", ["x", "s", "b"], epsilon=1e-3)],
          {"x": r(*shape), "s": r(c), "b": r(c)}, ["x", "s", "b"], opset=opset)


def test_instance_norm_symbolic():
    check([node("InstanceNormalization", ["x", "s", "b"])],
          {"x": r(2, 3, 5), "s": r(3), "b": r(3)}, ["x", "s", "b"], symbolic={"x": ["N", 3, "L"]})


@pytest.mark.parametrize("shape,groups", [((2, 6, 3, 2), 3), ((2, 4, 5), 2), ((1, 6, 4), 6),
                                          ((2, 4, 3), 1)], ids=str)
@pytest.mark.parametrize("opset", [18, 21] + ([NEWEST] if NEWEST > 21 else []))
def test_group_norm(shape, groups, opset):
    at("GroupNormalization", opset)
    params = shape[1] if opset >= 21 else groups
    kw = dict(stash_type=TensorProto.DOUBLE) if opset >= 21 else {}  # not float32 statistics
    check([node("GroupNormalization", ["x", "s", "b"], num_groups=groups, epsilon=1e-3, **kw)],
          {"x": r(*shape), "s": r(params), "b": r(params)}, ["x", "s", "b"], opset=opset)


def test_group_norm_symbolic():
    at("GroupNormalization", 21)
    check([node("GroupNormalization", ["x", "s", "b"], num_groups=2,
                stash_type=TensorProto.DOUBLE)],
          {"x": r(2, 4, 3), "s": r(4), "b": r(4)}, ["x", "s", "b"], opset=21,
          symbolic={"x": ["N", "C", None]})


# --- Resize ------------------------------------------------------------------------------------

F32 = (np.float32,)  # onnxruntime's Resize has no double kernel
RESIZE_SCALES = [[1, 1, 2, 2], [1, 1, 0.5, 0.6], [1, 1, 1.7, 0.8], [1, 1, 3, 1]]
CTMS = ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"]


def _resize(opset, consts, scales=None, sizes=None, **kw):
    """A Resize node at ``opset`` (roi/scales/sizes inputs as that opset has them)."""
    if opset < 11:
        consts["sc"] = np.array(scales, np.float32)
        return node("Resize", ["x", "sc"], **kw)
    consts["roi"] = np.array([], np.float32)
    if scales is not None:
        consts["sc"] = np.array(scales, np.float32)
        return node("Resize", ["x", "roi", "sc"], **kw)
    consts["sz"] = np.array(sizes, np.int64)
    if opset < 13:
        consts["sc"] = np.array([], np.float32)
        return node("Resize", ["x", "roi", "sc", "sz"], **kw)
    return node("Resize", ["x", "", "", "sz"], **kw)


def _check_resize(n, consts, opset, shape=(1, 2, 5, 6), symbolic=None):
    """float32 constants stay float32 (check casts float initializers to the test dtype)."""
    inits = {k: v for k, v in consts.items() if v.dtype != np.float32}
    f32 = [onnx.numpy_helper.from_array(v, k) for k, v in consts.items() if v.dtype == np.float32]
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in f32] + [n]
    check(nodes, {"x": r(*shape)}, ["x"], consts=inits, opset=opset, dtypes=F32,
          symbolic=symbolic or {})


@pytest.mark.parametrize("nearest_mode",
                         ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("ctm", CTMS + ["tf_half_pixel_for_nn"])
@pytest.mark.parametrize("scales", RESIZE_SCALES, ids=str)
@pytest.mark.parametrize("opset", OPSETS)
def test_resize_nearest(scales, ctm, nearest_mode, opset):
    at("Resize", opset)
    consts = {}
    n = _resize(opset, consts, scales=scales, mode="nearest", coordinate_transformation_mode=ctm,
                nearest_mode=nearest_mode)
    _check_resize(n, consts, opset)


@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("scales", RESIZE_SCALES, ids=str)
@pytest.mark.parametrize("opset", OPSETS)
def test_resize_linear(scales, ctm, opset):
    at("Resize", opset)
    consts = {}
    n = _resize(opset, consts, scales=scales, mode="linear", coordinate_transformation_mode=ctm)
    _check_resize(n, consts, opset)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("sizes", [[1, 2, 9, 3], [1, 2, 1, 7], [1, 2, 4, 1]], ids=str)
@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("opset", [11] + OPSETS)
def test_resize_sizes(mode, sizes, ctm, opset):
    at("Resize", opset)
    consts = {}
    n = _resize(opset, consts, sizes=sizes, mode=mode, coordinate_transformation_mode=ctm)
    _check_resize(n, consts, opset)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 3, 1.5]], ids=str)
def test_resize_opset10(mode, scales):
    at("Resize", 10)
    consts = {}
    _check_resize(_resize(10, consts, scales=scales, mode=mode), consts, 10)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("opset", [18] + ([NEWEST] if NEWEST > 18 else []))
def test_resize_axes_and_aspect_ratio(mode, policy, opset):
    at("Resize", opset)
    consts = {}
    n = _resize(opset, consts, sizes=[8, 9], mode=mode, axes=[2, 3],
                keep_aspect_ratio_policy=policy)
    _check_resize(n, consts, opset, shape=(1, 2, 3, 5))
    consts = {}
    n = _resize(opset, consts, scales=[1.5, 0.7], mode=mode, axes=[3, 2])
    _check_resize(n, consts, opset, shape=(1, 2, 3, 5))


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_negative_axes(mode):
    if ort_version() < (1, 18):
        pytest.skip("onnxruntime 1.17 indexes out of bounds (aborts) on negative Resize axes")
    consts = {}
    n = _resize(18, consts, scales=[1.5, 0.7], mode=mode, axes=[-1, 2])
    _check_resize(n, consts, 18, shape=(1, 2, 3, 5))


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 0.5, 0.7]], ids=str)
def test_resize_half_pixel_symmetric(mode, scales):
    opset = at("Resize", max(19, NEWEST))
    consts = {}
    n = _resize(opset, consts, scales=scales, mode=mode,
                coordinate_transformation_mode="half_pixel_symmetric")
    _check_resize(n, consts, opset)


def test_resize_2d_and_symbolic_batch():
    consts = {}
    _check_resize(_resize(13, consts, scales=[1.5, 2.5], mode="linear"), consts, 13, shape=(3, 4))
    consts = {}
    _check_resize(_resize(13, consts, scales=[1, 1, 2, 1.5], mode="nearest"), consts, 13,
                  symbolic={"x": ["N", "C", 5, 6]})


@pytest.mark.parametrize("kw,msg", [
    (dict(mode="cubic"), "mode='cubic'"),
    (dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize"),
     "coordinate_transformation_mode='tf_crop_and_resize'"),
    (dict(mode="linear", antialias=1), "antialias=1"),
])
def test_resize_uncovered_is_a_clear_error(kw, msg):
    m = _gradient_model([node("Resize", ["x", "", "sc"], name="up", **kw)], {"x": (1, 1, 3, 3)},
                        ["x"], opset=18)
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32),
                                                            "sc"))
    with pytest.raises(GradientError, match=r"Resize node 'up': " + msg):
        expand_gradients(m)


def test_resize_dynamic_resized_axis_is_a_clear_error():
    m = _gradient_model([node("Resize", ["x", "", "sc"], name="up")], {"x": (1, 1, 3, 3)}, ["x"],
                        opset=18)
    m.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32),
                                                            "sc"))
    with pytest.raises(GradientError, match=r"Resize node 'up': .* the input's axis 2"):
        expand_gradients(m)

# --- the table --------------------------------------------------------------------------

MODULES = {"rules_elementwise", "rules_nn", "rules_reduce", "rules_resize", "rules_tensor"}
TESTED_HERE = {"Sum", "Mean", "Max", "Min", "Clip", "HardSigmoid", "HardSwish", "Softplus", "Elu",
               "Selu", "Celu", "PRelu", "Mish", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign",
               "ReduceMax", "ReduceMin", "ReduceL2", "ReduceLogSumExp", "CumSum", "TopK",
               "Pad", "Tile", "GatherElements", "DepthToSpace", "SpaceToDepth", "Einsum",
               "ConvTranspose", "LRN", "InstanceNormalization", "GroupNormalization", "Resize"}


def test_every_rule_of_these_modules_is_tested_here():
    mine = {op for op, fn in RULES.items() if fn.__module__.rsplit(".", 1)[-1] in MODULES}
    assert mine == TESTED_HERE
