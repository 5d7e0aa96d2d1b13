"""The exact GELU written as five nodes (torch's exporters below opset 20, transformers'
``gelu``): the fused CPU step differentiates the chain with one GeluGrad
(``trainops.autodiff.gelu_chain``). Which chains qualify (every grouping of the products,
Div or Mul by 1/sqrt(2), either operand order; an intermediate the graph also gives out,
which no gradient flows into) and which do not (an intermediate read elsewhere, other
constants); the step's gradient against numpy in
float64 within a bound carried through each rounding."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION

F32 = np.float32
U = 2.0 ** -24
N, K, M = 16, 12, 24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _c(name, v):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v, F32), name))


def chain(form: str, scale=1 / math.sqrt(2), half=0.5):
    """The GELU of ``h`` as ``form`` writes it, output ``g``."""
    c = _c
    sqrt2 = 1 / scale
    if form.startswith("div"):
        head = [c("k", sqrt2), helper.make_node("Div", ["h", "k"], ["s"])]
    else:
        head = [c("k", scale), helper.make_node("Mul", ["k", "h"] if form.endswith("swap") else ["h", "k"], ["s"])]
    head += [helper.make_node("Erf", ["s"], ["e"]), c("one", 1.0),
             helper.make_node("Add", ["one", "e"] if form.endswith("swap") else ["e", "one"], ["a"]), c("half", half)]
    group = form.split("_")[1]
    if group == "xa":  # (x * a) * 0.5: torch's classic exporter
        tail = [helper.make_node("Mul", ["a", "h"] if form.endswith("swap") else ["h", "a"], ["p"]),
                helper.make_node("Mul", ["p", "half"], ["g"])]
    elif group == "xh":  # (x * 0.5) * a: transformers' gelu
        tail = [helper.make_node("Mul", ["half", "h"] if form.endswith("swap") else ["h", "half"], ["p"]),
                helper.make_node("Mul", ["p", "a"], ["g"])]
    else:  # x * (a * 0.5)
        tail = [helper.make_node("Mul", ["a", "half"], ["p"]),
                helper.make_node("Mul", ["p", "h"] if form.endswith("swap") else ["h", "p"], ["g"])]
    return head + tail


def mlp(nodes, extra_out=None, seed=0):
    """x[N, K] @ W[K, M] -> h -> the chain -> g; loss = sum(g * c)."""
    rng = np.random.default_rng(seed)
    npd, dtype = F32, TensorProto.FLOAT
    w = (rng.standard_normal((K, M)) * 0.6).astype(npd)
    c = rng.standard_normal((N, M)).astype(npd)
    body = [helper.make_node("MatMul", ["x", "W"], ["h"])] + nodes + [
        helper.make_node("Mul", ["g", "c"], ["gc"]),
        helper.make_node("ReduceSum", ["gc"], ["loss"], keepdims=0)]
    outs = [helper.make_tensor_value_info("loss", dtype, [])]
    if extra_out:
        outs.append(helper.make_tensor_value_info(extra_out, dtype, None))
    g = helper.make_graph(body, "gelu_mlp", [helper.make_tensor_value_info("x", dtype, [N, K])], outs,
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(c, "c")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    x = (rng.standard_normal((N, K)) * 1.5).astype(npd)
    return m, w, c, {"x": x}


def _trainer(m, monkeypatch, fused=True):
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    # Momentum with alpha 0 and lr 1: the first step subtracts the gradient itself
    return Trainer(m, "loss", optim.Momentum(lr=1.0, alpha=0.0, beta=1.0), params=["W"],
                   threads=1, seed=0)


def _ops(tr):
    return Counter(n.op_type for n in tr.training_model().graph.node)


FORMS = [f"{h}_{g}{s}" for h in ("div", "mul") for g in ("xa", "xh", "ah") for s in ("", "_swap")]


@pytest.mark.parametrize("form", FORMS + ["div_xa_out"])
def test_every_written_form_is_one_gelu_grad(library_path, monkeypatch, form):
    out = form.endswith("_out")  # the Erf's output given out too: still one GeluGrad
    m, *_ = mlp(chain(form.removesuffix("_out")), extra_out="e" if out else None)
    ops = _ops(_trainer(m, monkeypatch))
    assert ops["GeluGrad"] == 1 and ops["Exp"] == 0 and ops["Neg"] == 0, ops


@pytest.mark.parametrize("why", ["read_elsewhere", "scale", "half", "unfused"])
def test_chains_that_keep_their_node_by_node_gradient(library_path, monkeypatch, why):
    nodes = chain("div_xa")
    if why == "read_elsewhere":  # the Erf's output read by another node too
        nodes = nodes[:-1] + [helper.make_node("Add", ["p", "e"], ["p2"]),
                              helper.make_node("Mul", ["p2", "half"], ["g"])]
    elif why == "scale":
        nodes = chain("div_xa", scale=0.7)
    elif why == "half":
        nodes = chain("div_xa", half=0.6)
    m, *_ = mlp(nodes)
    ops = _ops(_trainer(m, monkeypatch, fused=why != "unfused"))
    assert ops["GeluGrad"] == 0 and ops["Exp"] == 1, ops  # the Erf rule's exp(-s^2)


_erf = np.vectorize(math.erf)


def _gelu_prime(h):
    erf = _erf
    return 0.5 * (1 + erf(h / math.sqrt(2))) + h * np.exp(-h * h / 2) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("form", ["div_xa", "mul_xh_swap", "mul_ah"])
def test_step_gradient_within_the_float64_bound(library_path, monkeypatch, form):
    m, w, c, feeds = mlp(chain(form))
    tr = _trainer(m, monkeypatch)
    assert _ops(tr)["GeluGrad"] == 1
    tr.step(feeds)
    w1 = tr.parameters()["W"].astype(np.float64)
    got = w.astype(np.float64) - w1  # x - fl(x - g): within u |x1| of g
    x, W, C = feeds["x"].astype(np.float64), w.astype(np.float64), c.astype(np.float64)
    h = x @ W
    d = _gelu_prime(h)
    want = x.T @ (C * d)
    # h off by gamma(K) |x| |W|; |Gelu''| = phi(h) |2 - h^2| <= 2 phi(0) < 0.8 moves the
    # derivative by at most 0.8 of that; GeluGrad is within 1 ulp of the derivative at its
    # input and rounds dY times it once; the reduction over N rows adds gamma(N)
    dh = gamma(K) * (np.abs(x) @ np.abs(W))
    eG = np.abs(C) * (0.8 * dh + 2 * U * (np.abs(d) + 0.8 * dh))
    G = np.abs(C) * (np.abs(d) + 0.8 * dh)
    bound = np.abs(x).T @ eG + gamma(N) * (np.abs(x).T @ G) + U * np.abs(w1)
    err = np.abs(got - want)
    assert np.all(err <= bound), (err / bound).max()
    # able to fail: Gelu's derivative with Phi alone (the x phi(x) term dropped)
    wrong = x.T @ (C * 0.5 * (1 + _erf(h / math.sqrt(2))))
    assert np.any(np.abs(wrong - want) > bound)
