"""The standard-op gradient of MaxPool (the rule's form for the portable, CUDA and plugin
placements, and the CPU one with TRAINOPS_FUSED_GRADS=0): no Indices output asked of any
MaxPool (execution providers such as WebGPU claim MaxPool and fail on it), the argmax
found again from X and Y.

References, independent of the rule: a loop in numpy over every window (the first of
equal maxima in window order, padding skipped), checked first against onnxruntime's own
Indices (ties included); the scatter-add of dY at those Indices in output order
(``np.add.at`` in float32, what ScatterElements and com.trainops::MaxPoolGrad compute):
the rule's result has the same bits; central differences of the forward MaxPool."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers.gradcheck import make_model, session
from trainops.autodiff.graph import Builder
from trainops.autodiff.rules import Ctx, max_pool

F32 = np.float32

CASES = [  # (X shape, MaxPool attributes): overlapping windows, pads, dilations, ceil, 1-3D
    ((2, 3, 8, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),
    ((2, 3, 9, 7), dict(kernel_shape=[3, 3], strides=[1, 1])),
    ((1, 4, 10, 10), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((3, 2, 11, 9), dict(kernel_shape=[2, 3], strides=[2, 1], dilations=[2, 1], ceil_mode=1)),
    ((1, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1)),
    ((2, 5, 17), dict(kernel_shape=[4], strides=[3])),
    ((2, 3, 12), dict(kernel_shape=[3], strides=[1], dilations=[2], pads=[2, 1])),
    ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 3], strides=[1, 2, 2])),
    ((1, 2, 5, 5, 4), dict(kernel_shape=[3, 3, 2], strides=[2, 1, 1], pads=[1, 1, 0, 1, 1, 1])),
    ((2, 2, 6, 6), dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])),
    ((2, 2, 7, 6), dict(kernel_shape=[2, 3], auto_pad="SAME_LOWER")),
    ((1, 1, 1, 1), dict(kernel_shape=[1, 1])),
    ((0, 3, 4, 4), dict(kernel_shape=[2, 2])),
]


def pool_model(shape, attrs, dtype=TensorProto.FLOAT):
    node = helper.make_node("MaxPool", ["X"], ["Y", "I"], **attrs)
    return make_model([node], [helper.make_tensor_value_info("X", dtype, shape)],
                      [helper.make_tensor_value_info("Y", dtype, None),
                       helper.make_tensor_value_info("I", TensorProto.INT64, None)])


def rule_model(shape, attrs, dtype=TensorProto.FLOAT):
    """MaxPool(X) -> Y and the rule's standard ops dX(X, dY), N and C symbolic."""
    node = helper.make_node("MaxPool", ["X"], ["Y"], **attrs)
    x = helper.make_tensor_value_info("X", dtype, ["N", "C"] + list(shape[2:]))
    fwd = make_model([node], [x], [helper.make_tensor_value_info("Y", dtype, None)])
    b = Builder(onnx.shape_inference.infer_shapes(fwd).graph, 17)
    b.types["dY"] = dtype
    (dx,) = max_pool(Ctx(b, node, ["dY"], [True]))
    ops = {n.op_type for n in b.nodes}
    assert "MaxPool" not in ops and "ScatterElements" not in ops, ops
    return make_model([node] + b.nodes,
                      [x, helper.make_tensor_value_info("dY", dtype, None)],
                      [helper.make_tensor_value_info(dx, dtype, None)])


def windows(shape, attrs):
    """For every output position (row-major), the flat input positions of its window in
    window order, the padding left out: by the ONNX definition, one window at a time."""
    sp = list(shape[2:])
    n = len(sp)
    k = attrs["kernel_shape"]
    s = attrs.get("strides", [1] * n)
    d = attrs.get("dilations", [1] * n)
    y = session(pool_model(shape, attrs)).run(["Y"], {"X": np.zeros(shape, F32)})[0]
    out = list(y.shape[2:])  # onnxruntime's sizes (ceil_mode's rounding rules differ)
    auto = attrs.get("auto_pad", "NOTSET")
    if auto.startswith("SAME"):
        begin = []
        for i in range(n):
            total = max(0, (out[i] - 1) * s[i] + (k[i] - 1) * d[i] + 1 - sp[i])
            begin.append(total // 2 if auto == "SAME_UPPER" else total - total // 2)
    else:
        begin = list(attrs.get("pads", [0] * 2 * n))[:n]
    result = []
    for o in itertools.product(*(range(v) for v in out)):
        cells = []
        for kk in itertools.product(*(range(v) for v in k)):
            pos = [o[i] * s[i] - begin[i] + kk[i] * d[i] for i in range(n)]
            if all(0 <= p < sp[i] for i, p in enumerate(pos)):
                cells.append(int(np.ravel_multi_index(pos, sp)))
        result.append(cells)
    return out, result


def first_argmax(x, shape, attrs):
    """The first maximum of every window of every (n, c) plane, as flat input indices
    within the whole tensor (onnxruntime's Indices layout)."""
    out, wins = windows(shape, attrs)
    planes = x.reshape(shape[0] * shape[1], int(np.prod(shape[2:])))
    plane = planes.shape[1]
    idx = np.zeros((planes.shape[0], len(wins)), np.int64)
    for p in range(planes.shape[0]):
        for w, cells in enumerate(wins):
            vals = planes[p, cells]
            idx[p, w] = p * plane + cells[int(np.argmax(vals))]  # argmax: the first maximum
    return idx.reshape(list(shape[:2]) + out)


def data(rng, shape, ties):
    x = rng.standard_normal(shape).astype(F32)
    if ties == "relu":  # many windows of zeros
        x = np.maximum(x, 0)
    elif ties == "coarse":  # few distinct values: ties between nonzero maxima
        x = np.round(x * 2).astype(F32)
    return x


@pytest.mark.parametrize("ties", ["none", "relu", "coarse"])
@pytest.mark.parametrize("shape,attrs", CASES)
def test_same_bits_as_the_indices_scatter(rng, shape, attrs, ties):
    x = data(rng, shape, ties)
    y, idx = session(pool_model(shape, attrs)).run(None, {"X": x})
    # the tie rule, by the ONNX definition: onnxruntime's Indices name each window's first
    # maximum in window order (row-major, padding skipped)
    np.testing.assert_array_equal(idx, first_argmax(x, shape, attrs))
    gy = rng.standard_normal(y.shape).astype(F32)
    if ties == "coarse":
        gy[..., ::3] = -0.0  # a -0 sent alone comes out +0, as ScatterElements from zeros
    want = np.zeros(x.size, F32)
    np.add.at(want, idx.reshape(-1), gy.reshape(-1))  # float32 sums in output order
    got = session(rule_model(shape, attrs)).run(None, {"X": x, "dY": gy})[0]
    assert got.dtype == F32 and got.shape == x.shape
    assert got.tobytes() == want.reshape(shape).tobytes()


@pytest.mark.parametrize("dtype,tensor", [(np.float64, TensorProto.DOUBLE),
                                          (np.float16, TensorProto.FLOAT16)])
def test_other_float_types(rng, dtype, tensor):
    """float64: the same bits as the scatter-add. float16: onnxruntime runs float16 chains
    without float16 kernels in float32 (its inserted Casts), so each input's sum of at most
    prod(ceil(k / s)) = 6 terms is within 6 roundings of float16 of the float64 one."""
    shape, attrs = (2, 3, 9, 7), dict(kernel_shape=[3, 3], strides=[2, 1], pads=[1, 1, 0, 1])
    x = np.maximum(rng.standard_normal(shape), 0).astype(dtype)
    idx = first_argmax(x, shape, attrs)
    gy = rng.standard_normal(idx.shape).astype(dtype)
    want = np.zeros(x.size, np.float64 if dtype == np.float16 else dtype)
    np.add.at(want, idx.reshape(-1), gy.reshape(-1))
    try:
        got = session(rule_model(shape, attrs, tensor)).run(None, {"X": x, "dY": gy})[0]
    except Exception as exc:  # noqa: BLE001 - an onnxruntime without MaxPool for the type
        if "NOT_IMPLEMENTED" in str(exc) or "implementation" in str(exc):
            pytest.skip(f"onnxruntime lacks a kernel: {exc}"[:200])
        raise
    assert got.dtype == dtype and got.shape == shape
    if dtype == np.float64:
        assert got.tobytes() == want.reshape(shape).tobytes()
        return
    size = np.zeros(x.size)
    np.add.at(size, idx.reshape(-1), np.abs(gy.reshape(-1)).astype(np.float64))
    tol = 6 * 2.0 ** -11 * size  # float16's unit roundoff per rounding
    assert np.all(np.abs(got.reshape(-1).astype(np.float64) - want) <= tol)


@pytest.mark.parametrize("shape,attrs", [
    ((1, 2, 6, 6), dict(kernel_shape=[3, 3], strides=[1, 1])),
    ((1, 1, 7, 6), dict(kernel_shape=[3, 2], strides=[2, 1], dilations=[1, 2], pads=[1, 0, 1, 1],
                        ceil_mode=1)),
    ((1, 2, 4, 5, 4), dict(kernel_shape=[2, 3, 2], strides=[1, 1, 2], pads=[0, 1, 0, 0, 1, 1])),
])
def test_finite_differences(rng, shape, attrs):
    """d/dx sum(gy * MaxPool(x)) by central differences of the forward (distinct values
    0.5 apart, steps of 0.125: no maximum changes place), in float64 arithmetic."""
    x = (rng.permutation(int(np.prod(shape))) * 0.5).reshape(shape).astype(F32)
    pool = session(pool_model(shape, attrs))
    y = pool.run(["Y"], {"X": x})[0]
    gy = rng.standard_normal(y.shape).astype(F32)
    fd = np.zeros(x.size)
    for j in range(x.size):
        e = np.zeros(x.size, F32)
        e[j] = 0.125
        up = pool.run(["Y"], {"X": x + e.reshape(shape)})[0].astype(np.float64)
        down = pool.run(["Y"], {"X": x - e.reshape(shape)})[0].astype(np.float64)
        fd[j] = np.sum(gy.astype(np.float64) * (up - down)) / 0.25
    got = session(rule_model(shape, attrs)).run(None, {"X": x, "dY": gy})[0]
    # Each input sums at most prod(ceil(k / s)) float32 values: the float64 sum of the
    # differences is exact, the rule's float32 one within that many roundings.
    terms = int(np.prod([-(-k // s) for k, s in zip(attrs["kernel_shape"], attrs["strides"])]))
    tol = terms * np.finfo(F32).eps / 2 * np.abs(gy).sum()
    np.testing.assert_allclose(got.reshape(-1), fd, rtol=0, atol=tol)


def test_windows_without_a_finite_maximum_pass_nothing(rng):
    """onnxruntime's kernel starts each window from the lowest finite value and takes
    strictly greater elements: a window of -inf, NaN or that lowest value names no element
    (com.trainops::MaxPoolGradFromInput passes no gradient there; nor does the rule), the
    others are unaffected."""
    shape, attrs = (1, 1, 4, 6), dict(kernel_shape=[2, 2], strides=[2, 2])
    x = rng.standard_normal(shape).astype(F32)
    x[0, 0, :2, :2] = -np.inf
    x[0, 0, :2, 2:4] = [[np.nan, -np.inf], [np.nan, np.nan]]
    x[0, 0, :2, 4:] = np.finfo(F32).min
    x[0, 0, 2, 0] = np.nan  # beside finite values: never the maximum
    gy = rng.standard_normal((1, 1, 2, 3)).astype(F32)
    got = session(rule_model(shape, attrs)).run(None, {"X": x, "dY": gy})[0][0, 0]
    assert not got[:2].any()
    want = np.zeros((2, 6), F32)
    for j in range(3):
        w = x[0, 0, 2:, 2 * j:2 * j + 2].reshape(-1)
        first = int(np.nanargmax(w))
        want[first // 2, 2 * j + first % 2] = gy[0, 0, 1, j]
    assert got[2:].tobytes() == want.tobytes()
