"""The CUDA kernels' arithmetic, checked without a GPU: a numpy transcription of each
optimizer kernel of crates/trainops-cuda/cuda/trainops.cu (the same float32 operations in the
same order, each rounded on its own as --fmad=false compiles them, with the coefficients the
device kernel is given: ONNX float attributes and R rounded to float32, combined in double,
rounded once) must equal the library's CPU kernels bitwise. A GPU then only has to show that
the PTX computes what the CUDA C says (scripts/gpu_check).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper

f32 = np.float32
TRAINING = "ai.onnx.preview.training"


def a32(v: float) -> float:
    return float(np.float32(v))


def model(op, n, streams, **attrs):
    ins = ["X", "G", *streams]
    node = helper.make_node(op, ["R", "T", *ins], [f"{s}_new" for s in ["X", *streams]], domain=TRAINING, **attrs)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [node],
        "g",
        [vi("R", TensorProto.FLOAT, []), vi("T", TensorProto.INT64, [])] + [vi(s, TensorProto.FLOAT, [n]) for s in ins],
        [vi(f"{s}_new", TensorProto.FLOAT, [n]) for s in ["X", *streams]],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    m.ir_version = 8
    return m


@pytest.fixture(params=[1, 16, 257, 10_007])
def data(request):
    n = request.param
    rng = np.random.default_rng(n)
    x, g, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    return n, x, g, v, rng.random(n).astype(np.float32)


R, T = a32(0.01), 7


def run(make_session, m, **feeds):
    return make_session(m).run(None, {"R": np.array(R, np.float32), "T": np.array(T, np.int64), **feeds})


def test_adam_kernel_arithmetic(make_session, data):
    n, x, g, v, h = data
    alpha, beta, eps, norm, post = a32(0.9), a32(0.999), a32(1e-6), a32(0.01), a32(0.001)
    rate = R * math.sqrt(1 - beta**T) / (1 - alpha**T)
    gr = f32(norm) * x + g
    v_new = f32(alpha) * v + f32(1 - alpha) * gr
    h_new = f32(beta) * h + f32(1 - beta) * (gr * gr)
    x_new = f32(1 - post) * (x - f32(rate) * (v_new / (np.sqrt(h_new) + f32(eps))))
    m = model("Adam", n, ["V", "H"], alpha=alpha, beta=beta, epsilon=eps, norm_coefficient=norm, norm_coefficient_post=post)
    for got, want in zip(run(make_session, m, X=x, G=g, V=v, H=h), (x_new, v_new, h_new)):
        np.testing.assert_array_equal(got, want)


def test_adagrad_kernel_arithmetic(make_session, data):
    n, x, g, _, h = data
    decay, eps, norm = a32(0.1), a32(1e-6), a32(0.01)
    gr = f32(norm) * x + g
    h_new = h + gr * gr
    x_new = x - (f32(R / (1 + T * decay)) * gr) / (np.sqrt(h_new) + f32(eps))
    m = model("Adagrad", n, ["H"], decay_factor=decay, epsilon=eps, norm_coefficient=norm)
    for got, want in zip(run(make_session, m, X=x, G=g, H=h), (x_new, h_new)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", ["standard", "nesterov"])
def test_momentum_kernel_arithmetic(make_session, data, mode):
    n, x, g, v, _ = data
    alpha, beta, norm = a32(0.9), a32(0.5), a32(0.01)
    gr = f32(norm) * x + g
    v_new = f32(alpha) * v + f32(beta) * gr
    x_new = x - f32(R) * (v_new if mode == "standard" else gr + f32(alpha) * v_new)
    m = model("Momentum", n, ["V"], alpha=alpha, beta=beta, norm_coefficient=norm, mode=mode)
    for got, want in zip(run(make_session, m, X=x, G=g, V=v), (x_new, v_new)):
        np.testing.assert_array_equal(got, want)
