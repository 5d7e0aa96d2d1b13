"""com.trainops::GatherGrad: the gradient of Gather on axis 0 (a token embedding's, a tied
table's, torch's ``unbind`` of a stacked q/k/v), the fused CPU step's form of the scatter.

Against numpy's ``np.add.at`` in float32 (unbuffered: each update added in index order, the
sequential scatter) and onnxruntime's own ScatterND with reduction ``add``, bit for bit;
threads bit for bit; bad inputs; and a step with an embedding against numpy in float64."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from test_grad_batchnorm import _error
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN


def model(with_base: bool = False):
    ins = ["shape", "indices", "dY"] + (["base"] if with_base else [])
    node = helper.make_node("GatherGrad", ins, ["dX"], domain=TRAINOPS_DOMAIN)
    vis = [helper.make_tensor_value_info("shape", TensorProto.INT64, None),
           helper.make_tensor_value_info("indices", TensorProto.INT64, None),
           helper.make_tensor_value_info("dY", TensorProto.FLOAT, None)]
    if with_base:
        vis.append(helper.make_tensor_value_info("base", TensorProto.FLOAT, None))
    g = helper.make_graph([node], "gg", vis, [helper.make_tensor_value_info("dX", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def scatter_nd_model():
    node = helper.make_node("ScatterND", ["base", "idx", "dY"], ["dX"], reduction="add")
    g = helper.make_graph([node], "snd", [helper.make_tensor_value_info("base", TensorProto.FLOAT, None),
                                          helper.make_tensor_value_info("idx", TensorProto.INT64, None),
                                          helper.make_tensor_value_info("dY", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("dX", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    return m


def numpy_scatter(shape, indices, dy, base=None):
    """The sequential scatter in float32: np.add.at adds each update in order."""
    out = np.zeros(shape, np.float32) if base is None else base.copy()
    idx = np.where(indices < 0, indices + shape[0], indices).reshape(-1)
    np.add.at(out, idx, dy.reshape((idx.size,) + tuple(shape[1:])))
    return out


CASES = [
    # (data shape, indices shape): a vocabulary table over a batch of tokens (more rows than
    # one task's 1 MiB block), a scalar index (unbind), one row, rows of one element
    ((3000, 96), (8, 40)),
    ((3, 5, 2, 7), ()),
    ((1, 4), (6,)),
    ((50, 1), (3, 4, 5)),
    ((7, 0), (4,)),
    ((9, 3), (0,)),
]


@pytest.mark.parametrize("shape,ishape", CASES)
@pytest.mark.parametrize("with_base", [False, True])
def test_matches_the_sequential_scatter_and_onnxruntime(make_session, rng, shape, ishape, with_base):
    n = shape[0]
    indices = rng.integers(-n, n, ishape).astype(np.int64)
    if indices.size > 2:
        indices.reshape(-1)[:3] = indices.reshape(-1)[0]  # a row added into three times
    dy = (8 * rng.standard_normal(ishape + shape[1:])).astype(np.float32)
    base = (4 * rng.standard_normal(shape)).astype(np.float32)
    feeds = {"shape": np.array(shape, np.int64), "indices": indices, "dY": dy}
    if with_base:
        feeds["base"] = base
    want = numpy_scatter(shape, indices, dy, base if with_base else None)
    outs = [make_session(model(with_base), threads=t).run(None, feeds)[0] for t in (1, 2)]
    for got in outs:
        assert got.shape == shape and got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # onnxruntime's ScatterND 'add' (non-negative indices, one coordinate each)
    snd = make_session(scatter_nd_model()).run(None, {
        "base": base if with_base else np.zeros(shape, np.float32),
        "idx": np.where(indices < 0, indices + n, indices)[..., None], "dY": dy})[0]
    assert np.array_equal(outs[0].view(np.uint32), snd.view(np.uint32))


def test_the_check_can_fail(make_session, rng):
    """Dropping a repeated index's second update is not the scatter."""
    shape, indices = (6, 3), np.array([2, 2, 5], np.int64)
    dy = rng.standard_normal((3, 3)).astype(np.float32)
    got = make_session(model()).run(None, {"shape": np.array(shape, np.int64), "indices": indices, "dY": dy})[0]
    assert not np.array_equal(got, numpy_scatter(shape, indices[[0, 2]], dy[[0, 2]]))
    assert np.array_equal(got, numpy_scatter(shape, indices, dy))


def test_bad_inputs_are_clear_errors(make_session):
    shape = np.array([4, 3], np.int64)
    ok = {"shape": shape, "indices": np.array([0, 3], np.int64), "dY": np.ones((2, 3), np.float32)}
    msg = _error(make_session, model(), {**ok, "indices": np.array([1, 4], np.int64)})
    assert "GatherGrad: input 1 (indices)" in msg and "element 1 is 4, outside [-4, 4)" in msg, msg
    msg = _error(make_session, model(), {**ok, "indices": np.array([-5, 0], np.int64)})
    assert "element 0 is -5" in msg, msg
    msg = _error(make_session, model(), {**ok, "dY": np.ones((2, 4), np.float32)})
    assert "GatherGrad: input 2 (dY): expected shape [2, 3]" in msg, msg
    msg = _error(make_session, model(), {**ok, "shape": np.array([[4, 3]], np.int64)})
    assert "GatherGrad: input 0 (shape)" in msg, msg
    msg = _error(make_session, model(), {**ok, "shape": np.array([4, -3], np.int64)})
    assert "GatherGrad: input 0 (shape)" in msg and "non-negative" in msg, msg
    msg = _error(make_session, model(True), {**ok, "base": np.ones((4, 2), np.float32)})
    assert "GatherGrad: input 3 (base): expected shape [4, 3]" in msg, msg
    with pytest.raises(Exception, match="indices|GatherGrad|type"):
        make_session(model()).run(None, {**ok, "indices": np.array([0, 3], np.int32)})
