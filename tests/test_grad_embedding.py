"""A token embedding's gradient and a language model's vocabulary projection (the Gather
and MatMul rules at the sizes language models have): the Gather gradient adds the tokens'
rows into zeros (ScatterND 'add', opset >= 16; trainops' GatherGrad in the fused CPU
step) instead of a OneHot product over the whole vocabulary; a tied table's two gradients meet by scattering the rows into the projection's
gradient; the fused CPU step computes a projection's weight gradient of more than 8192
rows in blocks of 2048. Checked against numpy in float64 within a bound carried through
each rounding, and the fused step against the standard-op step."""

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


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def tied_lm(vocab: int, d: int, tokens: int, seed: int = 0):
    """ids [2, tokens] -> Gather(W) -> MatMul(., Transpose(W)) -> mean cross-entropy over
    the next tokens: a tied embedding and vocabulary projection, W [vocab, d]."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((vocab, d)) / math.sqrt(d)).astype(F32)
    nodes = [helper.make_node("Gather", ["W", "ids"], ["h"], axis=0),
             helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "Wt"], ["logits"]),
             helper.make_node("Reshape", ["logits", "flat"], ["logits2"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits2", "labels"], ["loss"])]
    g = helper.make_graph(nodes, "tied_lm",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, tokens]),
                           helper.make_tensor_value_info("labels", TensorProto.INT64, [2 * tokens])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w, "W"),
                           numpy_helper.from_array(np.array([-1, vocab], np.int64), "flat")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    ids = rng.integers(0, vocab, (2, tokens)).astype(np.int64)
    ids[1, :3] = ids[0, 0]  # a token read four times: its rows' gradients add
    feeds = {"ids": ids, "labels": rng.integers(0, vocab, 2 * tokens).astype(np.int64)}
    return m, w, feeds


def reference(w: np.ndarray, feeds: dict):
    """dLoss/dW in float64 and a bound on any float32 evaluation of it (forward and
    backward, any summation order, the fused step's order of the tied sum)."""
    W = w.astype(np.float64)
    ids, labels = feeds["ids"].reshape(-1), feeds["labels"]
    n, (vocab, d) = ids.size, W.shape
    h = W[ids]
    z = h @ W.T
    dz = gamma(d) * (np.abs(h) @ np.abs(W).T)  # the logits' rounding (d-term dot products)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    onehot = np.zeros_like(p)
    onehot[np.arange(n), labels] = 1
    G = (p - onehot) / n
    # a logit off by up to D moves each probability by at most p (e^(2D) - 1); then the
    # cross-entropy kernel's own bound (softmax.rs) and the standard form's, whichever is
    # larger: u ((10 + ln C) p + 2.4) |s| with s = 1/n, and 1/n's rounding
    D = dz.max(axis=1, keepdims=True)
    eG = p * np.expm1(2 * D) / n + U * ((10 + math.log(vocab)) * p + 2.4 + np.abs(p - onehot)) / n
    head = G.T @ h
    e_head = eG.T @ np.abs(h) + gamma(n) * (np.abs(G).T @ np.abs(h))
    dh = G @ W
    e_dh = eG @ np.abs(W) + gamma(vocab) * (np.abs(G) @ np.abs(W))
    emb, e_emb, mag, k = (np.zeros_like(W) for _ in range(4))
    np.add.at(emb, ids, dh)
    np.add.at(e_emb, ids, e_dh)
    np.add.at(mag, ids, np.abs(dh) + e_dh)
    np.add.at(k, ids, 1)
    # the rows' updates and the projection's gradient summed in any order: k + 1 terms
    kmax = int(k.max()) + 1
    total = head + emb
    bound = e_head + e_emb + gamma(kmax) * (np.abs(head) + e_head + mag)
    return total, bound


def _trainer(m, monkeypatch, fused: bool) -> Trainer:
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    # Momentum with alpha 0 and lr 1: the first step subtracts the gradient itself
    return Trainer(m, "loss", optim.Momentum(lr=1.0, alpha=0.0, beta=1.0), params=["W"],
                   threads=1, seed=0)


@pytest.mark.parametrize("fused", [True, False])
def test_tied_embedding_gradient_within_the_float64_bound(library_path, monkeypatch, fused):
    vocab, d, tokens = 8200, 8, 6  # a vocabulary over 8192: the input gradient's deep product
    m, w, feeds = tied_lm(vocab, d, tokens)
    tr = _trainer(m, monkeypatch, fused)
    ops = Counter(n.op_type for n in tr.training_model().graph.node)
    # (the standard-op step's one OneHot is the cross-entropy's labels, not the table's;
    # the fused step scatters with trainops' GatherGrad)
    scatter_op = "GatherGrad" if fused else "ScatterND"
    assert ops["OneHot"] == (0 if fused else 1) and ops[scatter_op] == 1, ops
    assert ops["ScatterND"] + ops["GatherGrad"] == 1, ops
    # the tied sum is the scatter into the projection's gradient, not into zeros
    nodes = tr.training_model().graph.node
    made_by = {o: n.op_type for n in nodes for o in n.output}
    (scatter,) = [n for n in nodes if n.op_type == scatter_op]
    base = scatter.input[3] if fused else scatter.input[0]
    assert made_by[base] not in ("ConstantOfShape", None), made_by.get(base)
    if fused:  # the projection's input gradient (8200 terms deep) on BlockedMatMul, its
        # weight's gradient (65600 elements, under BlockedMatMul's 2^19) a Gemm
        assert ops["BlockedMatMul"] == 1 and ops["Gemm"] == 1, ops
    tr.step(feeds)
    w1 = tr.parameters()["W"]
    got = w.astype(np.float64) - w1.astype(np.float64)  # x - fl(x - g): within u |x1| of g
    want, bound = reference(w, feeds)
    bound = bound + U * np.abs(w1)
    err = np.abs(got - want)
    assert np.all(err <= bound), (err - bound).max()


def test_a_wrong_gradient_is_outside_the_bound():
    """The check can fail: the projection's gradient alone (the embedding's rows dropped)
    leaves the bound at the tokens' rows."""
    vocab, d, tokens = 8200, 8, 6
    _, w, feeds = tied_lm(vocab, d, tokens)
    want, bound = reference(w, feeds)
    W = w.astype(np.float64)
    ids = feeds["ids"].reshape(-1)
    emb = np.zeros_like(W)  # the embedding's part alone
    h = W[ids]
    z = h @ W.T
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(ids.size), feeds["labels"]] -= 1
    np.add.at(emb, ids, (p / ids.size) @ W)
    assert np.any(np.abs((want - emb) - want) > bound)
