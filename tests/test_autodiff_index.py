"""GatherND and ScatterND gradients (trainops.autodiff.rules_index) against central finite
differences of the forward graph in onnxruntime (helpers.gradcheck), and against numpy
float64 where positions repeat (GatherND's gradient adds them up). GatherND's rule needs
opset 16 (ScatterND 'add'): an older model is upgraded by expand_gradients."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from helpers.gradcheck import check
from test_autodiff_rules2 import at, backward_grads, node
from trainops.autodiff import GradientError
from trainops.autodiff.coverage import opset_needs

rng = np.random.default_rng(11)

# (data shape, indices, batch_dims)
GATHER_CASES = [
    ((4, 3), [[0, 1], [3, 2], [1, 0]], 0),                  # whole elements
    ((4, 3, 2), [[1], [3], [0]], 0),                        # rows (a position table)
    ((4, 3, 2), [[[2, 1]], [[-1, 0]]], 0),                  # negative index
    ((2, 3, 4), [[[1], [2]], [[0], [0]]], 1),               # batch_dims=1, a repeat
    ((2, 3, 4, 2), [[[1, 3]], [[2, -4]]], 1),
    ((2, 3, 4), [[[2], [1], [0]], [[3], [3], [1]]], 2),     # batch_dims=2
]


@pytest.mark.parametrize("shape,indices,batch_dims", GATHER_CASES, ids=str)
@pytest.mark.parametrize("opset", [16, 18])
def test_gather_nd(shape, indices, batch_dims, opset):
    at("GatherND", opset)
    idx = np.array(indices, np.int64)
    check([node("GatherND", ["x", "i"], batch_dims=batch_dims)],
          {"x": rng.standard_normal(shape), "i": idx}, ["x"], opset=opset)


def test_gather_nd_adds_repeated_positions():
    """Whisper's decoder reads each position of its table once per batch row: the rows
    read twice get the sum of both gradients (numpy's np.add.at)."""
    w = rng.standard_normal((5, 3))
    idx = np.array([[[1], [3]], [[1], [1]]], np.int64)
    R = rng.standard_normal((2, 2, 3))
    (g,) = backward_grads([node("GatherND", ["w", "i"])], {"w": w, "i": idx}, ["w"], R, 18)
    want = np.zeros_like(w)
    np.add.at(want, idx[..., 0], R)
    np.testing.assert_allclose(g, want, rtol=1e-15)


def test_gather_nd_before_opset16_is_upgraded():
    """The rule refuses opset 13 (no ScatterND 'add'); expand_gradients upgrades the model
    to what coverage.OPSET_NEEDS says and differentiates it there."""
    assert opset_needs([helper.make_node("GatherND", ["x", "i"], ["y"])])[
        "GatherND's gradient (ScatterND with reduction 'add')"] == 16
    check([node("GatherND", ["x", "i"])], {"x": rng.standard_normal((4, 3)),
                                           "i": np.array([[2], [0], [2]], np.int64)},
          ["x"], opset=13)


SCATTER_CASES = [
    ((4, 3), [[0, 1], [3, 2]], (2,)),
    ((4, 3, 2), [[1], [3]], (2, 3, 2)),
    ((4, 3), [[-1]], (1, 3)),
]


@pytest.mark.parametrize("shape,indices,upd", SCATTER_CASES, ids=str)
@pytest.mark.parametrize("reduction", ["none", "add"])
@pytest.mark.parametrize("opset", [13, 18])
def test_scatter_nd(shape, indices, upd, reduction, opset):
    at("ScatterND", opset)
    kw = {} if reduction == "none" else {"reduction": reduction}
    if kw and opset < 16:
        pytest.skip("ScatterND's reduction attribute is opset 16")
    check([node("ScatterND", ["x", "i", "u"], **kw)],
          {"x": rng.standard_normal(shape), "i": np.array(indices, np.int64),
           "u": rng.standard_normal(upd)}, ["x", "u"], opset=opset)


def test_scatter_nd_mul_is_refused():
    with pytest.raises(GradientError, match=r"ScatterND node .*reduction='mul'"):
        check([helper.make_node("ScatterND", ["x", "i", "u"], ["y"], name="sc",
                                reduction="mul")],
              {"x": rng.standard_normal((3,)), "i": np.array([[1]], np.int64),
               "u": rng.standard_normal((1,))}, ["x", "u"], opset=18)


def test_gather_nd_needs_the_index_tuple_length():
    """Indices whose last dimension is unknown: refused, naming the node and the tensor."""
    with pytest.raises(GradientError, match=r"GatherND node 'gnd'.*last dimension"):
        check([helper.make_node("GatherND", ["x", "i"], ["y"], name="gnd")],
              {"x": rng.standard_normal((3, 2)), "i": np.array([[1, 0]], np.int64)}, ["x"],
              opset=18, symbolic={"i": [1, "K"]})



@pytest.mark.parametrize("reduction", ["none", "add"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_elements(reduction, axis):
    opset = at("ScatterElements", 18)
    idx = np.array([[1, 0, 2], [2, -3, 1]], np.int64)  # distinct along each axis, a negative
    if axis == 0:
        idx = np.array([[1, 0, 2], [2, 1, 0]], np.int64)
    kw = {} if reduction == "none" else {"reduction": reduction}
    check([node("ScatterElements", ["x", "i", "u"], axis=axis, **kw)],
          {"x": rng.standard_normal((3, 3)), "i": idx, "u": rng.standard_normal((2, 3))},
          ["x", "u"], opset=opset)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2])
def test_trilu(upper, k):
    opset = at("Trilu", 14)
    ins = {"x": rng.standard_normal((2, 3, 4))}
    if k is not None:
        ins["k"] = np.array(k, np.int64)
    check([node("Trilu", list(ins), upper=upper)], ins, ["x"], opset=opset)
