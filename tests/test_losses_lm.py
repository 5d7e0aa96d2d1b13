"""``losses.cross_entropy`` / ``losses.nll`` as PyTorch's ``F.cross_entropy`` /
``F.nll_loss``: ``[N, C]``, ``[N, C, d]`` and a language model's ``[B, T, V]`` logits
(``class_axis=-1``), ``ignore_index`` (-100 by default, another, every label ignored),
``label_smoothing`` with and without ignored labels, ``reduction`` mean and sum.

References: a numpy float64 transcription of PyTorch's definitions (:func:`reference`),
itself checked against values torch 2.15 computed (``TORCH``: ``F.cross_entropy`` /
``F.nll_loss`` in float64 on the same logits, the class axis moved to 1 for
``class_axis=-1``, ``loss.backward()`` for the gradient; printed by the script in this
module's ``TORCH`` comment). Torch's answers for every label ignored: NaN under ``"mean"``
with a zero gradient, 0 under ``"sum"``.

The gradient is read from a Trainer's update: the logits are ``z + bias`` with ``bias`` a
zero parameter of their shape, so one Momentum step with lr 1 leaves ``bias = -dL/dz``;
and a linear language model ``x @ W`` takes the SGD step numpy computes in float64. Both on
the fused CPU step and on the portable graph.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.checks import assert_trainer_unchanged, trainer_snapshot
from helpers.rounding import ELEMENTARY, gamma
from trainops import Trainer, losses, optim
from trainops.onnx_defs import IR_VERSION

F32 = TensorProto.FLOAT

# Computed by torch 2.15 (float64, CPU) on logits(shape) with
#   zz = z.movedim(class_axis, 1); loss = F.cross_entropy(zz, y, **kw) (F.nll_loss for
#   "nll"); loss.backward(); (loss.item(), z.grad)
# printed to 12 decimals. kw: the case's reduction / ignore_index / label_smoothing.
CASES = {  # name: (kind, shape, class_axis, labels, keyword arguments)
    "nc": ("cross_entropy", (4, 3), 1, [0, 2, -100, 1], {}),
    "nc_smooth": ("cross_entropy", (4, 3), 1, [0, 2, -100, 1], {"label_smoothing": 0.2}),
    "ncd_sum_smooth": ("cross_entropy", (2, 3, 2), 1, [[0, -100], [2, 1]],
                       {"reduction": "sum", "label_smoothing": 0.1}),
    "btv": ("cross_entropy", (2, 2, 3), -1, [[1, -100], [0, 2]], {}),
    "btv_smooth": ("cross_entropy", (2, 2, 3), -1, [[1, -100], [0, 2]],
                   {"label_smoothing": 0.1}),
    "btv_ignore_1": ("cross_entropy", (2, 2, 3), -1, [[1, 0], [1, 2]], {"ignore_index": 1}),
    "btv_none": ("cross_entropy", (2, 2, 3), -1, [[1, 0], [1, 2]], {"ignore_index": None}),
    "btv_all_ignored": ("cross_entropy", (2, 2, 3), -1, [[-100, -100], [-100, -100]],
                        {"label_smoothing": 0.1}),
    "btv_all_ignored_sum": ("cross_entropy", (2, 2, 3), -1, [[-100, -100], [-100, -100]],
                            {"reduction": "sum"}),
    "nll_btv": ("nll", (2, 2, 3), -1, [[1, -100], [0, 2]], {}),
    "nll_ncd": ("nll", (2, 3, 2), 1, [[0, -100], [2, 1]], {}),
}
TORCH = {  # name: (loss, dL/dz)
    "nc": (1.801588766404, [[-0.260944877919, 0.247052585805, 0.013892292114],
                            [0.009191498552, 0.185257374056, -0.194448872608],
                            [0, 0, 0], [0.151718932642, -0.316773609518, 0.165054676876]]),
    "nc_smooth": (1.764612287245, [[-0.216500433475, 0.224830363583, -0.008329930108],
                                   [-0.013030723670, 0.163035151834, -0.150004428164],
                                   [0, 0, 0],
                                   [0.129496710420, -0.272329165074, 0.142832454654]]),
    "ncd_sum_smooth": (6.083468734540, [
        [[-0.653333474112, 0], [0.020402304677, 0], [0.632931169435, 0]],
        [[-0.009732747793, 0.125341188167], [0.924504124250, -0.530379931387],
         [-0.914771376457, 0.405038743220]]]),
    "btv": (1.598720674744, [
        [[0.072388455414, -0.086280747528, 0.013892292114], [0, 0, 0]],
        [[-0.325829688046, 0.021291797996, 0.304537890050],
         [0.151718932642, 0.016559723815, -0.168278656457]]]),
    "btv_smooth": (1.618087700371, [
        [[0.061277344303, -0.064058525306, 0.002781181003], [0, 0, 0]],
        [[-0.303607465824, 0.010180686885, 0.293426778939],
         [0.140607821531, 0.005448612704, -0.146056434235]]]),
    "btv_ignore_1": (2.146865100116, [
        [[0, 0, 0], [-0.486212752172, 0.277886061085, 0.208326691088]],
        [[0, 0, 0], [0.227578398963, 0.024839585723, -0.252417984685]]]),
    "btv_none": (1.836023260238, [
        [[0.054291341561, -0.064710560646, 0.010419219086],
         [-0.243106376086, 0.138943030542, 0.104163345544]],
        [[0.005627733965, -0.234031151503, 0.228403417538],
         [0.113789199481, 0.012419792861, -0.126208992343]]]),
    "btv_all_ignored": (float("nan"), np.zeros((2, 2, 3)).tolist()),
    "btv_all_ignored_sum": (0.0, np.zeros((2, 2, 3)).tolist()),
    "nll_btv": (-0.119652559360, [[[0, -1 / 3, 0], [0, 0, 0]], [[-1 / 3, 0, 0], [0, 0, -1 / 3]]]),
    "nll_ncd": (0.397667060296, [[[-1 / 3, 0], [0, 0], [0, 0]],
                                 [[0, 0], [0, -1 / 3], [-1 / 3, 0]]]),
}


def logits(shape) -> np.ndarray:
    """The logits of the cases: float32 values of a fixed formula."""
    n = int(np.prod(shape))
    return (2.0 * np.sin(1.7 * np.arange(n) + 0.3)).astype(np.float32).reshape(shape)


def reference(kind, z, labels, class_axis=1, reduction="mean", ignore_index=-100,
              label_smoothing=0.0):
    """PyTorch's loss and its gradient with respect to ``z``, in float64: the classes
    moved to the last axis; per target ``(1 - eps) * -logp[label] + eps / C * -sum(logp)``
    (``logp = z`` for nll), 0 where the label is the ignore_index; the sum, or the sum over
    the count of targets not ignored (0 / 0: NaN, with a zero gradient, as torch's)."""
    z = np.moveaxis(np.asarray(z, np.float64), class_axis, -1)
    y = np.asarray(labels)
    c = z.shape[-1]
    kept = np.ones(y.shape, bool) if ignore_index is None else y != ignore_index
    safe = np.where(kept, y, 0)
    onehot = np.eye(c)[safe]
    if kind == "nll":
        logp, grad_of_logp = z, True
    else:
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        grad_of_logp = False
    target = (1 - label_smoothing) * onehot + label_smoothing / c
    per = -(target * logp).sum(-1) * kept
    weight = kept.astype(np.float64)
    count = kept.sum()
    if reduction == "mean":
        loss = per.sum() / count if count else np.nan
        weight = weight / max(count, 1)
    else:
        loss = per.sum()
    dz = -target if grad_of_logp else np.exp(logp) - target
    return loss, np.moveaxis(dz * weight[..., None], -1, class_axis)


def make_loss(kind, class_axis, kw, output="logits"):
    fn = losses.cross_entropy if kind == "cross_entropy" else losses.nll
    return fn(output, class_axis=class_axis, **kw)


def model(nodes, inputs, inits, opset=17):
    g = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info("logits", F32, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = IR_VERSION
    return m


def biased(shape, opset=17):
    """logits = z + bias, bias a zero parameter of the logits' shape."""
    return model([helper.make_node("Add", ["z", "bias"], ["logits"])],
                 [helper.make_tensor_value_info("z", F32, list(shape))],
                 {"bias": np.zeros(shape, np.float32)}, opset)


# A float32 loss or gradient entry here is a chain of at most R roundings: an Exp and a Log
# (ELEMENTARY ulps each), sums of at most C + N <= 8 terms, a dozen elementwise ops; so it
# is within gamma(R) of the magnitudes it is made of (Higham's bound; helpers.rounding).
R = 2 * ELEMENTARY + 8 + 12


def test_the_numpy_reference_is_torchs():
    for name, (kind, shape, axis, labels, kw) in CASES.items():
        loss, dz = reference(kind, logits(shape), labels, axis, **kw)
        want_loss, want_dz = TORCH[name]
        np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-11, err_msg=name)
        np.testing.assert_allclose(dz, want_dz, rtol=0, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradient_as_torch(library_path, name, portable):
    kind, shape, axis, labels, kw = CASES[name]
    z = logits(shape)
    tr = Trainer(biased(shape), make_loss(kind, axis, kw), optim.Momentum(lr=1.0),
                 params=["bias"], threads=1, seed=0, portable=portable)
    got = tr.step({"z": z, "labels": np.array(labels, np.int64)})
    want, dz = reference(kind, z, labels, axis, **kw)
    scale = 2 * np.abs(z).max() + 1  # what the log-softmax of one target is made of
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert abs(got - want) <= gamma(R) * scale * (len(np.ravel(labels)) + 1), (got, want)
    # Momentum's first step with lr 1: bias = 0 - dL/dz; each entry a probability or a
    # one-hot less a probability, times a weight <= 1
    np.testing.assert_allclose(-tr.parameters()["bias"], dz, rtol=0, atol=gamma(R))
    assert np.all(tr.parameters()["bias"][dz == 0] == 0)  # ignored targets: exactly 0


def lm(d=3, v=5, static=None, opset=17):
    """A linear language model: x [B, T, d] @ W [d, v] -> logits [B, T, v] (B, T named,
    or ``static`` (B, T))."""
    w = np.random.default_rng(11).standard_normal((d, v)).astype(np.float32)
    dims = list(static) if static else ["B", "T"]
    return model([helper.make_node("MatMul", ["x", "W"], ["logits"])],
                 [helper.make_tensor_value_info("x", F32, dims + [d])], {"W": w}, opset)


def sgd_step(x, w, labels, lr, **kw):
    """W after one SGD step on the loss of x @ W (float64), and the loss; with the bound
    on the float32 step's distance from it."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    z = x64 @ w64
    loss, dz = reference("cross_entropy", z, labels, -1, **kw)
    xs, gs = x64.reshape(-1, x.shape[-1]), dz.reshape(-1, w.shape[-1])
    new = w64 - lr * xs.T @ gs
    # dz: R roundings of each entry, plus the float32 forward's error in z (d terms)
    # through the softmax (at most that error); dW: a sum of B*T terms of x * dz
    ez = gamma(R) + gamma(x.shape[-1]) * (np.abs(xs) @ np.abs(w64)).max()
    bound = lr * (np.abs(xs).T @ (ez + gamma(xs.shape[0]) * np.abs(gs))) \
        + gamma(1) * np.abs(new)
    return new, loss, bound


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1}, {"reduction": "sum"}],
                         ids=["mean", "smoothing", "sum"])
def test_language_model_sgd_step(library_path, kw, portable):
    """[B, T, V] logits with class_axis=-1, labels [B, T] with ignored positions, the
    batch and sequence lengths named (two steps of other shapes): each step is the numpy
    float64 SGD step."""
    tr = Trainer(lm(), losses.cross_entropy("logits", class_axis=-1, **kw),
                 optim.Momentum(lr=0.5, alpha=0.0), threads=1, seed=0, portable=portable)
    rng = np.random.default_rng(2)
    for b, t in [(2, 4), (3, 1)]:
        x = rng.standard_normal((b, t, 3)).astype(np.float32)
        y = rng.integers(0, 5, (b, t))
        y[0, 0] = -100
        w = tr.parameters()["W"].copy()
        want, loss, bound = sgd_step(x, w, y, 0.5, **kw)
        got = tr.step({"x": x, "labels": y})
        assert abs(got - loss) <= gamma(R + 3) * 10 * y.size, (got, loss)
        assert np.all(np.abs(tr.parameters()["W"] - want) <= bound), \
            np.abs(tr.parameters()["W"] - want).max()


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
def test_shapes_known_only_at_run_time(library_path, portable):
    """Opset 13 infers no rank for a Reshape to a computed shape: the logits' shape (and
    the number of classes) is unknown when the loss is attached. The loss flattens by the
    run's shape, the gradient still flows (label smoothing included), and the graph's own
    check refuses labels of the wrong shape or class, naming them."""
    m = lm(opset=13)
    m.graph.node[0].output[0] = "h"
    m.graph.node.extend([helper.make_node("Shape", ["h"], ["h_shape"]),
                         helper.make_node("Reshape", ["h", "h_shape"], ["logits"])])
    tr = Trainer(m, losses.cross_entropy("logits", class_axis=-1, label_smoothing=0.1),
                 optim.Momentum(lr=0.5, alpha=0.0), threads=1, seed=0, portable=portable)
    x = np.random.default_rng(7).standard_normal((2, 4, 3)).astype(np.float32)
    y = np.array([[0, 1, -100, 4], [3, -100, 2, 2]])
    w = tr.parameters()["W"].copy()
    want, loss, bound = sgd_step(x, w, y, 0.5, label_smoothing=0.1)
    got = tr.step({"x": x, "labels": y})
    assert abs(got - loss) <= gamma(R + 3) * 10 * y.size, (got, loss)
    assert np.all(np.abs(tr.parameters()["W"] - want) <= bound)
    before = trainer_snapshot(tr)
    for bad in (y.T.copy(), np.where(y == 4, 5, y)):
        with pytest.raises(ValueError, match=r"cross_entropy: labels 'labels': expected a class "
                                             r"index in \[0, C\) or the ignore_index -100 \(C: "
                                             r"the size of axis -1 of 'logits'\)"):
            tr.step({"x": x, "labels": bad})
        assert_trainer_unchanged(tr, before)


def test_mixed_float16(library_path):
    """Under mixed_float16 the loss computes in float16: each per-target share is divided
    before the sum (a float16 sum of many per-token losses would overflow) and the count
    stays int64. Within float16's rounding (u = 2^-11) of the float64 loss, over the same
    R roundings as the float32 bounds."""
    tr = Trainer(lm(), losses.cross_entropy("logits", class_axis=-1, label_smoothing=0.1),
                 optim.Adam(lr=0.01), threads=1, seed=0, policy="mixed_float16")
    x = np.random.default_rng(8).standard_normal((2, 4, 3)).astype(np.float32)
    y = np.array([[0, 1, -100, 4], [3, -100, 2, 2]])
    w = tr.parameters()["W"].copy()
    want = sgd_step(x, w, y, 0.0, label_smoothing=0.1)[1]
    u16 = 2.0 ** -11
    scale = 2 * (np.abs(x) @ np.abs(w)).max() + 1  # what the log-softmax of one target is made of
    got = tr.step({"x": x, "labels": y})
    assert abs(got - want) <= R * u16 / (1 - R * u16) * scale, (got, want)


def test_labels_declared_as_the_logits_without_their_class_axis():
    """The labels input a loss adds: int64, the logits' shape without the class axis
    (was [B, V] for [B, T, V] logits, the class axis taken as 1)."""
    def labels_of(m, loss):
        vi = next(i for i in loss.attach(m).graph.input if i.name == "labels")
        dims = [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
        return vi.type.tensor_type.elem_type, dims

    ce = losses.cross_entropy("logits", class_axis=-1)
    assert labels_of(lm(v=1000, static=(8, 7)), ce) == (TensorProto.INT64, [8, 7])
    assert labels_of(lm(), ce) == (TensorProto.INT64, ["B", "T"])
    assert labels_of(biased((4, 3)), losses.cross_entropy("logits")) == (TensorProto.INT64, [4])
    assert labels_of(biased((4, 3)), ce) == (TensorProto.INT64, [4])  # -1 of [N, C] is 1
    assert labels_of(biased((2, 3, 5)), losses.nll("logits")) == (TensorProto.INT64, [2, 5])


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
def test_every_label_ignored(library_path, portable):
    """Mean over no target: NaN, as torch's, and a zero gradient (ONNX's own mean would
    divide it by zero: NaN weights); sum: 0. The weights do not move either way."""
    x = np.random.default_rng(3).standard_normal((2, 4, 3)).astype(np.float32)
    y = np.full((2, 4), -100)
    for kw in ({}, {"label_smoothing": 0.3}, {"reduction": "sum"}):
        tr = Trainer(lm(), losses.cross_entropy("logits", class_axis=-1, **kw),
                     optim.Momentum(lr=0.5), threads=1, seed=0, portable=portable)
        w = tr.parameters()["W"].copy()
        got = tr.step({"x": x, "labels": y})
        assert np.isnan(got) if kw.get("reduction") != "sum" else got == 0.0
        assert np.array_equal(tr.parameters()["W"], w)


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
@pytest.mark.parametrize("op_type", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_every_label_ignored_by_the_models_own_loss(library_path, portable, op_type):
    """A model that computes its own loss (ONNX's op, mean, ignore_index): every target
    ignored is 0/0, NaN, and PyTorch's gradient is 0. The backward divided dY by the zero
    count (inf * 0 per row: NaN weights after one step, fused kernel and standard form
    alike); the weights now stay as they were."""
    w0 = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["logits"]),
             helper.make_node(op_type, ["logits", "t"], ["loss"], ignore_index=-100)]
    g = helper.make_graph(nodes, "own_loss", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
        helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(w0, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    tr = Trainer(model, "loss", optim.AdamW(lr=0.1, weight_decay=0.0), threads=1,
                 portable=portable)
    x = np.random.default_rng(6).standard_normal((5, 3)).astype(np.float32)
    assert np.isnan(tr.step({"x": x, "t": np.full(5, -100, np.int64)}))
    assert np.array_equal(tr.parameters()["W"], w0)
    # one kept target: the gradient is the whole of it, as an ordinary step
    assert np.isfinite(tr.step({"x": x, "t": np.array([-100, -100, 2, -100, -100])}))
    assert np.all(np.isfinite(tr.parameters()["W"])) and not np.array_equal(tr.parameters()["W"], w0)


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
def test_bad_labels_are_refused_naming_the_input(library_path, portable):
    """[B, T, V] labels: a class index in [0, V) or the ignore_index, shaped [B, T] (a
    [T, B] tensor of the same size is refused, not reshaped): the Trainer's check before
    the run names the labels, the position and the value; the graph's own check (for what
    only the run can tell) names them too; nothing changes."""
    tr = Trainer(lm(), losses.cross_entropy("logits", class_axis=-1), optim.Momentum(lr=0.5),
                 threads=1, seed=0, portable=portable)
    x = np.random.default_rng(4).standard_normal((2, 3, 3)).astype(np.float32)
    good = np.array([[0, 1, -100], [4, 3, 2]])
    tr.step({"x": x, "labels": good})
    before = trainer_snapshot(tr)
    bad = {"V": (np.where(good == 3, 5, good),
                 "labels 'labels'[1, 1] = 5: expected a class index in [0, 5) or the "
                 "ignore_index -100 ('logits' has 5 classes, its axis -1)"),
           "-1": (np.where(good == 1, -1, good), "labels 'labels'[0, 1] = -1: expected"),
           "[T, B]": (good.T.copy(), "labels 'labels' has shape [3, 2]: expected [2, 3], the "
                                     "shape of 'logits' ['B', 'T', 5] without its class "
                                     "axis (axis -1)")}
    for labels, said in bad.values():
        with pytest.raises(ValueError) as e:
            tr.step({"x": x, "labels": labels})
        assert str(e.value).startswith(f"cross_entropy: {said}"), str(e.value)
        assert_trainer_unchanged(tr, before)
    tr._check_labels = None  # the graph's check alone
    want = ("Trainer.step: cross_entropy: labels 'labels': expected a class index in [0, C) "
            "or the ignore_index -100 (C: the size of axis -1 of 'logits') and the shape of "
            "'logits' without that axis")
    for labels, _ in bad.values():
        with pytest.raises(ValueError) as e:
            tr.step({"x": x, "labels": labels})
        assert str(e.value).startswith(want), str(e.value)
        assert_trainer_unchanged(tr, before)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match=r"cross_entropy: label_smoothing 1.5: expected a "
                                         r"number in \[0, 1\]"):
        losses.cross_entropy(label_smoothing=1.5)
    with pytest.raises(ValueError, match="label_smoothing nan"):
        losses.cross_entropy(label_smoothing=float("nan"))
    with pytest.raises(ValueError, match="nll: label_smoothing is cross_entropy's"):
        losses.Loss("nll", None, "labels", label_smoothing=0.1)
    with pytest.raises(TypeError):
        losses.nll(label_smoothing=0.1)
    with pytest.raises(ValueError, match="class_axis True: expected an int"):
        losses.cross_entropy(class_axis=True)
    with pytest.raises(ValueError, match="mse: class_axis is for class labels"):
        losses.Loss("mse", None, "target", class_axis=-1)
    with pytest.raises(TypeError):  # reduction and what follows: by keyword
        losses.cross_entropy("logits", "labels", "sum")
    four = biased((2, 3, 4, 5))
    for axis in (0, 2, -2, 4):
        with pytest.raises(ValueError, match=rf"cross_entropy: class_axis {axis} of 'logits' "
                                             r"\(shape \[2, 3, 4, 5\]\): expected 1 .* or -1"):
            losses.cross_entropy("logits", class_axis=axis).attach(four)
    losses.cross_entropy("logits", class_axis=3).attach(four)  # the last axis by number


def test_to_dict_carries_the_new_fields():
    ce = losses.cross_entropy("logits", "y", reduction="sum", ignore_index=7, class_axis=-1,
                              label_smoothing=0.25)
    d = ce.to_dict()
    assert d == {"kind": "cross_entropy", "output": "logits", "target": "y",
                 "reduction": "sum", "ignore_index": 7, "class_axis": -1,
                 "label_smoothing": 0.25}
    assert losses.from_dict(json.loads(json.dumps(d))) == ce
    # defaults are left out: a config reads as it did before the fields existed
    assert losses.nll("lp").to_dict() == {"kind": "nll", "output": "lp", "target": "labels",
                                          "reduction": "mean", "ignore_index": -100}
    with pytest.raises(ValueError, match=r"unknown keys \['weight'\]"):
        losses.from_dict({**d, "weight": [1, 2]})


def test_checkpoint_and_artifacts_keep_the_loss(library_path, tmp_path):
    """Trainer.load (the checkpoint's config) and Trainer.from_artifacts rebuild the
    language-model loss with its fields and resume bit for bit."""
    loss = losses.cross_entropy("logits", class_axis=-1, ignore_index=4, label_smoothing=0.1)
    a = Trainer(lm(), loss, optim.AdamW(lr=0.01), threads=1, seed=0)
    rng = np.random.default_rng(6)
    batches = [{"x": rng.standard_normal((2, 3, 3)).astype(np.float32),
                "labels": rng.integers(0, 5, (2, 3))} for _ in range(3)]
    a.step(batches[0])
    a.save(tmp_path / "ckpt.safetensors")
    a.save_artifacts(tmp_path / "art")
    b = Trainer.load(tmp_path / "ckpt.safetensors", threads=1)
    c = Trainer.from_artifacts(tmp_path / "art", threads=1)
    assert b.loss == loss and c.loss == loss
    for feeds in batches[1:]:
        want = np.float64(a.step(feeds)).tobytes()
        assert np.float64(b.step(feeds)).tobytes() == want
        assert np.float64(c.step(feeds)).tobytes() == want
