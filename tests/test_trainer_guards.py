"""What a failed or refused :class:`trainops.Trainer` step leaves, and refusals that every
placement makes alike.

- accumulation: a micro-batch that fails (an error ONNX Runtime raises mid-run, or in the
  update after the k-th) changes no state: the accumulation buffers, the count, the
  weights, the optimizer, Philox and BatchNorm states keep their bits, and training goes
  on as if it had never been tried (the reference: a trainer that never tried it);
- BatchNormalization in training mode refuses one value per channel, as PyTorch does
  ("Expected more than 1 value per channel when training");
- labels of ``cross_entropy`` / ``nll`` (and of a model's own loss node) outside
  ``[0, C)``, other than the ignore_index, or not shaped as the logits without their class
  axis: one ValueError naming the labels, the value and the range, on the fused CPU step
  and on the portable graph alike; the graph refuses them by itself too;
- ``portable=True`` (asked for, or picked for an EP) with int8 or bfloat16 optimizer state
  is refused before anything is built;
- ``providers=[the CPU EP's OrtEpDevice]`` builds the default Trainer's step, fused
  gradient kernels included: the same bits.
"""

from __future__ import annotations

import re
import types

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.checks import TOLERANCES, same_bits
from helpers.checks import assert_trainer_unchanged as assert_unchanged
from helpers.checks import trainer_snapshot as snapshot
from trainops import Trainer, losses, optim
from trainops.demos.train import cnn_model, digits
from trainops.onnx_defs import IR_VERSION
from trainops.train import placement as pl
from trainops.train.graph import build_step_graph
from trainops.train.spec import StepOptions

F32 = TensorProto.FLOAT
RTOL, ATOL = TOLERANCES[np.dtype(np.float32)]  # float32 arithmetic vs a float64 reference


def _model(nodes, inputs, output, inits, opset=17):
    g = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info(output, F32, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = IR_VERSION
    return m


def regression(dropout=False, batchnorm=False, four_d=False):
    """x [N, 4] -> MatMul W [4, 3] -> [BatchNormalization 'bn1' over the 3 channels, of
    h [N, 3] or, ``four_d``, h4 [N, 3, 1, 1]] -> Add b -> [Dropout] -> mean squared error
    against y [N, 3] ('loss'). The batch is dynamic: a y of another batch size fails the
    run at the Sub, after the forward pass has run."""
    rng = np.random.default_rng(3)
    inits = {"W": rng.standard_normal((4, 3)).astype(np.float32),
             "b": np.array([0.25, -0.5, 0.125], np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"])]
    h = "h"
    if batchnorm:
        inits.update(s=np.array([1.0, 0.5, 2.0], np.float32), beta=np.zeros(3, np.float32),
                     rm=np.zeros(3, np.float32), rv=np.ones(3, np.float32))
        if four_d:
            inits.update(to4=np.array([0, 3, 1, 1], np.int64), to2=np.array([0, 3], np.int64))
            nodes += [helper.make_node("Reshape", ["h", "to4"], ["h4"]),
                      helper.make_node("BatchNormalization", ["h4", "s", "beta", "rm", "rv"],
                                       ["n4"], name="bn1"),
                      helper.make_node("Reshape", ["n4", "to2"], ["n"])]
        else:
            nodes.append(helper.make_node("BatchNormalization", ["h", "s", "beta", "rm", "rv"],
                                          ["n"], name="bn1"))
        h = "n"
    nodes.append(helper.make_node("Add", [h, "b"], ["p0" if dropout else "p"]))
    if dropout:
        inits["ratio"] = np.array(0.25, np.float32)
        nodes.append(helper.make_node("Dropout", ["p0", "ratio"], ["p"], name="drop"))
    nodes += [helper.make_node("Sub", ["p", "y"], ["d"]),
              helper.make_node("Mul", ["d", "d"], ["d2"]),
              helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    return _model(nodes, [helper.make_tensor_value_info("x", F32, ["N", 4]),
                          helper.make_tensor_value_info("y", F32, ["N", 3])], "loss", inits)


def batch(seed, n=8, scale=1.0):
    rng = np.random.default_rng(seed)
    return {"x": (rng.standard_normal((n, 4)) * scale).astype(np.float32),
            "y": (rng.standard_normal((n, 3)) * scale).astype(np.float32)}


def assert_same_trainers(a, b) -> None:
    sa, sb = a._states(), b._states()
    assert sorted(sa) == sorted(sb)
    for k, v in sa.items():
        assert same_bits(v, sb[k]), k
    assert (a.T, a.skipped) == (b.T, b.skipped)


# --- accumulation: a failed micro-batch changes nothing ----------------------------------

VARIANTS = {
    "plain": (dict(), dict(), 1.0),
    "dropout": (dict(dropout=True), dict(), 1.0),  # Philox states
    "batchnorm": (dict(batchnorm=True), dict(), 1.0),  # running statistics, every micro-batch
    # 0.1: gradients times the loss scale 2^15 stay finite in float16 (updates, not skips)
    "mixed_float16": (dict(), dict(policy="mixed_float16"), 0.1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("at", [0, 1, 2], ids=["first", "middle", "kth"])
def test_a_failed_micro_batch_changes_nothing_and_is_never_counted(library_path, variant, at):
    """accumulate=3; the micro-batch at position ``at`` of the first cycle fails in ONNX
    Runtime mid-run (y of 5 rows against x of 8: the Sub after the forward pass); the
    trainer keeps every bit, and 6 more good micro-batches give exactly what a trainer that
    never saw the failed one gives (2 updates, each the mean of exactly 3 gradients)."""
    model_kw, kw, scale = VARIANTS[variant]
    def make():
        return Trainer(regression(**model_kw), "loss", optim.Adam(lr=0.05), threads=1, seed=11,
                       accumulate=3, **kw)

    a, b = make(), make()
    good = [batch(s, scale=scale) for s in range(6)]
    for f in good[:at]:
        assert a.step(f) == b.step(f)
    before = snapshot(a)
    bad = batch(99, scale=scale)
    bad["y"] = bad["y"][:5]
    with pytest.raises(RuntimeError, match="Sub node"):
        a.step(bad)
    assert_unchanged(a, before)
    assert a.runtime.pending == at and int(a._states()["trainops/accum/count"][0]) == at
    for f in good[at:]:
        la, lb = a.step(f), b.step(f)
        assert np.float32(la).tobytes() == np.float32(lb).tobytes()
    assert a.T == 3 and a.runtime.pending == 0  # two updates: 6 micro-batches after the failure
    assert_same_trainers(a, b)
    start = {i.name: numpy_helper.to_array(i) for i in regression(**model_kw).graph.initializer}
    assert not np.array_equal(a.parameters()["W"], start["W"])  # it trained


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
def test_a_failed_step_keeps_the_batchnorm_statistics(library_path, portable):
    """Without accumulation too: onnxruntime's BatchNormalization writes its running mean
    output over its input's buffer, the state's own; a step failing after it (y of 5 rows
    against x of 8) must leave the running mean as it was, and the next steps be those of
    a trainer that never tried it. (With Dropout on the fused step only: the portable
    graph's ONNX Dropout draws from onnxruntime's own per-session generator, which every
    run advances, a failed one too: trainops.portable.dropout.)"""
    def make():
        return Trainer(regression(batchnorm=True, dropout=not portable), "loss",
                       optim.Adam(lr=0.05), threads=1, seed=11, portable=portable)

    a, b = make(), make()
    a.step(batch(0)), b.step(batch(0))
    before = snapshot(a)
    bad = batch(99)
    bad["y"] = bad["y"][:5]
    with pytest.raises(RuntimeError, match="Sub node"):
        a.step(bad)
    assert_unchanged(a, before)
    for s in (1, 2):
        a.step(batch(s)), b.step(batch(s))
    assert_same_trainers(a, b)


def test_a_failed_update_after_the_kth_micro_batch_undoes_its_addition(library_path,
                                                                         monkeypatch):
    """The k-th micro-batch's model runs, then the update fails (its session refuses the
    learning rate: a float64 ``lr`` bound for the float32 ``Adam``): the buffers, the
    count, the Philox and BatchNorm states are put back; the weights were never touched."""
    def make():
        return Trainer(regression(dropout=True, batchnorm=True), "loss", optim.Adam(lr=0.05),
                       threads=1, seed=11, accumulate=3)

    a, b = make(), make()
    good = [batch(s) for s in range(6)]
    for f in good[:2]:
        a.step(f), b.step(f)
    before = snapshot(a)
    with monkeypatch.context() as m:
        m.setattr(a.runtime.graph, "lr_dtype", np.float64)
        with pytest.raises(RuntimeError, match="data type"):
            a.step(batch(99))
    assert_unchanged(a, before)
    assert a.runtime.pending == 2 and not a.runtime.updated
    for f in good[2:]:
        a.step(f), b.step(f)
    assert a.T == b.T == 3
    assert_same_trainers(a, b)


def test_accumulate_updates_batchnorm_statistics_every_micro_batch(library_path):
    """As PyTorch's forward in train mode: each micro-batch's statistics enter the running
    mean and variance (unbiased variance, momentum 0.9 of ONNX = PyTorch's 0.1), with the
    weights unchanged between micro-batches (float64 reference)."""
    tr = Trainer(regression(batchnorm=True), "loss", optim.Adam(lr=0.05), threads=1, seed=1,
                 accumulate=2)
    w = numpy_helper.to_array(next(i for i in regression().graph.initializer if i.name == "W"))
    rm, rv = np.zeros(3), np.ones(3)
    for s in range(2):
        f = batch(s)
        tr.step(f)
        h = f["x"].astype(np.float64) @ w
        rm = 0.9 * rm + 0.1 * h.mean(0)
        rv = 0.9 * rv + 0.1 * h.var(0, ddof=1)
    assert tr.T == 2 and not np.array_equal(tr.parameters()["W"], w)  # updated after 2
    stats = tr.running_stats()
    np.testing.assert_allclose(stats["rm"], rm, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(stats["rv"], rv, rtol=RTOL, atol=ATOL)


# --- BatchNormalization: one value per channel --------------------------------------------

@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
@pytest.mark.parametrize("four_d", [False, True], ids=["[1,C]", "[1,C,1,1]"])
def test_batchnorm_train_refuses_one_value_per_channel(library_path, portable, four_d):
    tr = Trainer(regression(batchnorm=True, four_d=four_d), "loss", optim.Adam(lr=0.05),
                 threads=1, seed=1, portable=portable)
    tr.step(batch(0, n=4))
    before = snapshot(tr)
    with pytest.raises(ValueError) as e:
        tr.step(batch(1, n=1))
    msg = str(e.value)
    assert f"BatchNormalization node 'bn1' (input '{'h4' if four_d else 'h'}')" in msg, msg
    assert "expected more than 1 value per channel when training" in msg, msg
    assert "batchnorm='frozen'" in msg and "the step changed nothing" in msg, msg
    assert_unchanged(tr, before)
    exported = {i.name: numpy_helper.to_array(i) for i in tr.export().graph.initializer}
    assert np.isfinite(exported["rv"]).all() and same_bits(exported["rv"],
                                                           before["states"]["rv"])
    # Two values per channel train, with PyTorch's unbiased update (float64 reference).
    f = batch(2, n=2)
    h = f["x"].astype(np.float64) @ tr.parameters()["W"].astype(np.float64)
    tr.step(f)
    np.testing.assert_allclose(tr.running_stats()["rv"],
                               0.9 * before["states"]["rv"] + 0.1 * h.var(0, ddof=1),
                               rtol=RTOL, atol=ATOL)


# --- labels -------------------------------------------------------------------------------

C = 4


def classifier(kind):
    """x [N, 3] -> MatMul W [3, 4] -> 'logits' [N, 4]; ``kind``: the loss
    (``"cross_entropy"``, ``"nll"`` on a LogSoftmax, or ``"own"``: the model's own
    SoftmaxCrossEntropyLoss node 'ce' on labels 't', loss 'loss'). Returns (model, loss,
    labels input)."""
    w = {"W": np.random.default_rng(5).standard_normal((3, C)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["logits"])]
    inputs = [helper.make_tensor_value_info("x", F32, ["N", 3])]
    if kind == "cross_entropy":
        return _model(nodes, inputs, "logits", w), losses.cross_entropy("logits"), "labels"
    if kind == "nll":
        nodes.append(helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1))
        return _model(nodes, inputs, "logp", w), losses.nll("logp"), "labels"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"],
                                  name="ce"))
    inputs.append(helper.make_tensor_value_info("t", TensorProto.INT64, ["N"]))
    return _model(nodes, inputs, "loss", w), "loss", "t"


X6 = np.random.default_rng(8).standard_normal((6, 3)).astype(np.float32)
WHO = {"cross_entropy": "cross_entropy", "nll": "nll", "own": "SoftmaxCrossEntropyLoss node 'ce'"}
BAD_LABELS = {  # labels fed with X6: (labels, what the error says after "labels 'name'")
    "minus_one": ([0, 1, -1, 2, 3, 0], "[2] = -1: expected a class index in [0, 4)"),
    "C": ([0, 1, 2, 3, 4, 0], "[4] = 4: expected a class index in [0, 4)"),
    "minus_100": ([0, 1, 2, 3, 0, -100], "[5] = -100: expected a class index in [0, 4)"),
    "minus_101": ([0, 1, 2, 3, 0, -101], "[5] = -101: expected a class index in [0, 4)"),
    "2^40": ([2**40, 1, 2, 3, 0, 0], "[0] = 1099511627776: expected a class index in [0, 4)"),
    "one_for_six": ([2], " has shape [1]: expected [6], the shape of"),
}


def trainer(kind, portable, **kw):
    model, loss, _ = classifier(kind)
    return Trainer(model, loss, optim.Adam(lr=0.01), threads=1, seed=0, portable=portable, **kw)


# -100 is bad where no ignore_index is set (the model's own node 'ce'); the attached
# losses ignore it by default, as PyTorch's (test_ignore_index_is_skipped_as_pytorch_does)
LABEL_CASES = [(kind, case) for kind in sorted(WHO) for case in sorted(BAD_LABELS)
               if case != "minus_100" or kind == "own"]


@pytest.mark.parametrize("kind,case", LABEL_CASES)
def test_bad_labels_are_one_error_on_every_placement(library_path, kind, case):
    """ONNX's own ops read -1 as the last class and broadcast one label over a batch (the
    portable graph trained on both) or fail in an inner GatherElements naming nothing (C,
    -100 without an ignore_index, 2^40); the fused kernel refused some: now both refuse
    all, alike, before the run, naming the labels, the position, the value and [0, C) (and
    the ignore_index, when the loss has one), and change nothing."""
    labels, said = BAD_LABELS[case]
    name = classifier(kind)[2]
    messages = []
    for portable in (False, True):
        tr = trainer(kind, portable)
        tr.step({"x": X6, name: np.array([0, 1, 2, 3, 0, 1])})
        before = snapshot(tr)
        with pytest.raises(ValueError) as e:
            tr.step({"x": X6, name: np.array(labels, np.int64)})
        assert_unchanged(tr, before)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"{WHO[kind]}: labels {name!r}{said}"), messages[0]
    if case == "one_for_six":
        assert "('N' = 6 from input 'x')" in messages[0] and "never broadcast" in messages[0]
    else:
        assert "has 4 classes, its axis 1" in messages[0], messages[0]


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
@pytest.mark.parametrize("kind", sorted(WHO))
def test_the_graph_refuses_bad_labels_by_itself(library_path, kind, portable):
    """What the Trainer's check before the run cannot tell (C or a dim known only then),
    and every runtime without Python (training artifacts run from C or Rust), meets the
    check in the graph: ONNX Runtime's error names the labels and what was expected; the
    Trainer turns it into a ValueError; nothing changed."""
    tr = trainer(kind, portable)
    name = classifier(kind)[2]
    tr._check_labels = None  # the graph's check alone
    before = snapshot(tr)
    scores = "logp" if kind == "nll" else "logits"
    ignored = "" if kind == "own" else " or the ignore_index -100"  # the attached default
    want = (f"{WHO[kind]}: labels {name!r}: expected a class index in [0, C){ignored} (C: the "
            f"size of axis 1 of {scores!r}) and the shape of {scores!r} without that axis")
    minus_100 = [-100] * 6 if kind == "own" else [-100] * 5 + [-101]
    for labels in ([0, 1, -1, 2, 3, 0], [0, 1, 2, 3, 4, 0], minus_100, [2]):
        with pytest.raises(ValueError) as e:
            tr.step({"x": X6, name: np.array(labels, np.int64)})
        y = np.array(labels)
        assert str(e.value) == (f"Trainer.step: {want} ({name!r} fed: shape {list(y.shape)}, "
                                f"values from {y.min()} to {y.max()}); the step changed "
                                "nothing"), str(e.value)
        assert_unchanged(tr, before)
    with pytest.raises(Exception, match=re.escape(f"Name:'trainops/check: {want}'")):
        tr.runtime.run({"x": X6, name: np.array([0, 1, 2, 3, 0, 7], np.int64)}, 0.01, tr.T)
    tr.step({"x": X6, name: np.array([0, 1, 2, 3, 0, 1])})  # good labels still train
    assert tr.T == 2


def _numpy_cross_entropy(x, w, labels, ignore_index):
    z = x.astype(np.float64) @ w.astype(np.float64)
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    keep = labels != ignore_index
    return -logp[keep, labels[keep]].mean()


@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
@pytest.mark.parametrize("kind", ["cross_entropy", "nll"])
def test_ignore_index_is_skipped_as_pytorch_does(library_path, kind, portable):
    """``ignore_index=-100`` (PyTorch's default, and trainops'): those labels count for
    nothing, in the loss and in the mean's count; any other label outside [0, C) is still
    refused, the message naming the ignore_index. ``ignore_index=None`` has none: -100 is
    refused then. A config written before the default (no ``ignore_index`` key) reads
    back as the loss it described, with none."""
    model = classifier(kind)[0]
    scores = "logits" if kind == "cross_entropy" else "logp"
    loss = getattr(losses, kind)(scores)
    assert loss.ignore_index == -100 and loss == getattr(losses, kind)(scores, ignore_index=-100)
    assert losses.from_dict(loss.to_dict()) == loss
    old = {"kind": kind, "output": scores, "target": "labels", "reduction": "mean"}
    assert losses.from_dict(old).ignore_index is None  # configs as before
    assert losses.from_dict(old).to_dict() == old
    assert getattr(losses, kind)(scores, ignore_index=None).to_dict() == old
    # SGD with momentum: its step is proportional to the gradient (Adam's first is not)
    tr = Trainer(model, loss, optim.Momentum(lr=0.1), threads=1, seed=0, portable=portable)
    w = tr.parameters()["W"].copy()
    labels = np.array([0, -100, 3, 1, -100, 2])
    got = tr.step({"x": X6, "labels": labels})
    np.testing.assert_allclose(got, _numpy_cross_entropy(X6, w, labels, -100), rtol=RTOL,
                               atol=ATOL)
    # the gradient is the mean over the 4 kept samples: the step a batch of those 4 takes
    kept = Trainer(classifier(kind)[0], getattr(losses, kind)(scores), optim.Momentum(lr=0.1),
                   threads=1, seed=0, portable=portable)
    keep = labels != -100
    kept.step({"x": X6[keep], "labels": labels[keep]})
    np.testing.assert_allclose(tr.parameters()["W"], kept.parameters()["W"], rtol=RTOL,
                               atol=ATOL)
    before = snapshot(tr)
    with pytest.raises(ValueError, match=r"labels 'labels'\[1\] = -1: expected a class index "
                                         r"in \[0, 4\) or the ignore_index -100"):
        tr.step({"x": X6, "labels": np.array([0, -1, 3, 1, -100, 2])})
    assert_unchanged(tr, before)
    none = Trainer(classifier(kind)[0], getattr(losses, kind)(scores, ignore_index=None),
                   optim.Momentum(lr=0.1), threads=1, seed=0, portable=portable)
    with pytest.raises(ValueError, match=r"labels 'labels'\[1\] = -100: expected a class "
                                         r"index in \[0, 4\) \("):
        none.step({"x": X6, "labels": labels})


def test_ignore_index_is_checked():
    with pytest.raises(ValueError, match="ignore_index 1.5: expected None or an int64"):
        losses.cross_entropy(ignore_index=1.5)
    with pytest.raises(ValueError, match="mse: ignore_index is for class labels"):
        losses.Loss("mse", None, "target", "mean", -100)


# --- portable: no int8 or bfloat16 optimizer state ----------------------------------------

def _fake_device(ep_name):
    """An object the placement takes for an OrtEpDevice (ep_name, device)."""
    return types.SimpleNamespace(ep_name=ep_name, device=None)


STATE_OPTIMIZERS = {("int8", "Adam"): "Adam8bit", ("int8", "AdamW"): "AdamW8bit",
                    ("bfloat16", "Adam"): "AdamBf16State",
                    ("bfloat16", "AdamW"): "AdamWBf16State"}


@pytest.mark.parametrize("dtype,opt", sorted(STATE_OPTIMIZERS))
@pytest.mark.parametrize("how", ["portable=True", "DirectML", "WebGPU device"])
def test_portable_refuses_int8_and_bfloat16_state(library_path, dtype, opt, how):
    """The portable graph is for EPs that take no custom-op library: an optimizer node
    without a standard-op form would be left in it. Refused before any graph or session
    is made (so no DirectML or WebGPU is needed to see it)."""
    kw = {"portable=True": dict(portable=True),
          "DirectML": dict(providers=["DmlExecutionProvider", "CPUExecutionProvider"]),
          "WebGPU device": dict(providers=[_fake_device("WebGpuExecutionProvider")])}[how]
    o = getattr(optim, opt)(lr=0.01, state_dtype=dtype)
    with pytest.raises(ValueError) as e:
        Trainer(regression(), "loss", o, **kw)
    msg = str(e.value)
    picked = "" if how == "portable=True" else " (portable=None picks it for "
    assert msg.startswith(f"portable=True{picked}"), msg
    assert f"with state_dtype={dtype!r}" in msg and STATE_OPTIMIZERS[dtype, opt] in msg, msg
    assert "state_dtype='float32'" in msg and "portable=False" in msg, msg
    if how != "portable=True":
        assert ("DmlExecutionProvider" if how == "DirectML" else "WebGpuExecutionProvider") in msg


@pytest.mark.parametrize("dtype,op", [("int8", "Adam8bit"), ("bfloat16", "AdamBf16State")])
def test_portable_graph_refuses_a_node_it_cannot_rewrite(library_path, dtype, op):
    """The step graph's own door (placement.portable_graph), for any caller: an int8 or
    bfloat16-state Adam step graph is refused, naming the op, instead of keeping it."""
    from trainops.train.importer import import_model

    w = {"W": np.full((64, 64), 0.01, np.float32)}  # 4096 values: int8 state (not float32)
    model = _model([helper.make_node("MatMul", ["x", "W"], ["h"]),
                    helper.make_node("ReduceMean", ["h"], ["loss"], keepdims=0)],
                   [helper.make_tensor_value_info("x", F32, ["N", 64])], "loss", w)
    o = optim.Adam(lr=0.01, state_dtype=dtype)
    graph = build_step_graph(import_model(model), StepOptions("loss", o))
    assert any(n.op_type == op for n in graph.model.graph.node)
    with pytest.raises(ValueError, match=rf"portable=True with state_dtype='{dtype}': the "
                                         rf"{dtype} optimizer state \({op}\)"):
        pl.portable_graph(graph, 0)


# --- providers=[the CPU OrtEpDevice]: the default step ------------------------------------

def test_placement_fuses_gradients_wherever_every_ep_is_the_cpus():
    cpu = pl.resolve(providers=[_fake_device("CPUExecutionProvider")])
    assert cpu.fuses_grads and not cpu.is_cpu  # the devices' session door, the CPU kernels
    assert pl.resolve().fuses_grads
    assert pl.resolve(providers=[("CPUExecutionProvider", {})]).fuses_grads
    assert not pl.resolve(portable=True).fuses_grads
    assert not pl.resolve(providers=[_fake_device("CPUExecutionProvider")],
                          portable=True).fuses_grads
    assert not pl.resolve(providers=[_fake_device("TrainopsExecutionProvider")]).fuses_grads
    assert not pl.resolve(providers=["CUDAExecutionProvider", "CPUExecutionProvider"]).fuses_grads


@pytest.mark.skipif(not hasattr(ort, "get_ep_devices"),
                    reason=f"onnxruntime {ort.__version__} has no get_ep_devices (1.22+)")
def test_cpu_ep_device_trainer_equals_the_default_trainer(library_path, monkeypatch):
    monkeypatch.delenv("TRAINOPS_FUSED_GRADS", raising=False)  # the default: fused kernels
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"]
    if not devs:
        pytest.skip(f"onnxruntime {ort.__version__} lists no CPUExecutionProvider device")
    x, t = digits(4 * 16, seed=4)
    feeds = [{"x": x[k * 16:(k + 1) * 16], "t": t[k * 16:(k + 1) * 16]} for k in range(4)]
    def make(**kw):
        return Trainer(cnn_model(seed=1), "loss", optim.Adam(lr=0.01), threads=1, seed=3, **kw)

    dev, default = make(providers=devs), make()
    assert dev.placement.ep_devices is not None and dev.placement.fuses_grads
    grads = sorted(n.op_type for n in default.training_model.graph.node
                   if n.domain == "com.trainops")
    assert "ConvWeightGrad" in grads  # the fused kernels the comparison is about
    assert sorted(n.op_type for n in dev.training_model.graph.node
                  if n.domain == "com.trainops") == grads
    for f in feeds:
        assert np.float32(dev.step(f)).tobytes() == np.float32(default.step(f)).tobytes()
    assert_same_trainers(dev, default)


# --- a model path that is no model, and the last step an int64 T can count ---

@pytest.mark.parametrize("content", [b"not a model\n", bytes(range(256)) * 4])
def test_a_path_that_is_no_model_is_one_error_naming_it(library_path, tmp_path, content):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^'{re.escape(str(path))}' is not an ONNX model"):
        Trainer(str(path), "loss", threads=1, seed=0)


def test_a_step_at_int64s_last_t_is_refused_and_changes_nothing(library_path):
    """T is fed as an int64: at T = 2^63 - 1 one more step could not be counted (the Rust
    trainer refuses the same step), so the step is refused before anything runs."""
    tr = Trainer(regression(), "loss", threads=1, seed=0)
    tr.step(batch(0))
    tr.T = 2**63 - 1
    before = snapshot(tr)
    with pytest.raises(ValueError, match=r"^Trainer\.step: T = 9223372036854775807 cannot "
                                         r"advance past int64; the step changed nothing$"):
        tr.step(batch(1))
    assert_unchanged(tr, before)
    assert tr.T == 2**63 - 1
    tr.T = 2**63 - 2  # the step before it still runs and counts
    tr.step(batch(1))
    assert tr.T == 2**63 - 1
