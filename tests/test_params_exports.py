"""The Trainer's default parameters on graphs shaped as torch's exporters write them
(handmade with onnx.helper, no torch): buffers, exporter constants, masks, sine/cosine
tables and positions left out; GatherND's table taken; warnings where the export merged or
folded torch's parameters; BatchNormalization running statistics read through Identity and
Constant chains trained as state, against a numpy float64 reference."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION
from trainops.train.importer import import_model
from trainops.train.params import default_params

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64
rng = np.random.default_rng(0)


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _choose(model):
    """``(default params, warning messages)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = default_params(model)
    return chosen, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _sinusoids(n, d):
    """Whisper's encoder positions: sin | cos of position times log-spaced frequencies."""
    f = np.exp(-np.log(10000) * np.arange(d // 2) / (d // 2 - 1))
    t = np.arange(n)[:, None] * f[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def decoder(kinds: bool):
    """A decoder step as the exporters write it: token embedding (Gather) tied to the LM
    head (MatMul of its Transpose), learned positions read by GatherND through a
    Transpose (dynamo, optimize=False), frozen sinusoids added, rotary frequencies times
    Cast(Range(Shape)) positions, a folded causal mask, a dynamo ``val_N`` scale and a
    classic ``onnx::Mul_N`` constant, a zero ``[1, V]`` logits bias, a weight folded as
    ``val_7`` (read by MatMul: taken) and a tensor read only as a Where condition source.
    ``kinds``: with the dynamo exporter's PARAMETER/BUFFER records."""
    S, D, V = 4, 6, 5
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["tok"]),
        helper.make_node("Transpose", ["pos_table"], ["pos_t"], perm=[1, 0]),
        helper.make_node("GatherND", ["pos_t", "pos_idx"], ["pos_rows"]),
        helper.make_node("Transpose", ["pos_rows"], ["pos"], perm=[1, 0]),
        helper.make_node("Add", ["tok", "pos"], ["h0"]),
        helper.make_node("Add", ["h0", "sinus"], ["h1"]),
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "seq", "one"], ["steps"]),
        helper.make_node("Cast", ["steps"], ["steps_f"], to=F32),
        helper.make_node("Unsqueeze", ["steps_f", "axis0"], ["steps_row"]),
        helper.make_node("MatMul", ["inv_freq", "steps_row"], ["freqs"]),  # [D, 1]x[1, S]
        helper.make_node("Transpose", ["freqs"], ["freqs_t"], perm=[1, 0]),
        helper.make_node("Cos", ["freqs_t"], ["cos"]),
        helper.make_node("Mul", ["h1", "cos"], ["h2"]),
        helper.make_node("MatMul", ["h2", "val_7"], ["h3"]),
        helper.make_node("Mul", ["h3", "val_12"], ["h4"]),
        helper.make_node("Mul", ["h4", "onnx::Mul_9"], ["h5"]),
        helper.make_node("MatMul", ["h5", "h5t"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["scores_m"]),
        helper.make_node("Softmax", ["scores_m"], ["attn"], axis=-1),
        helper.make_node("MatMul", ["attn", "h5"], ["ctx"]),
        helper.make_node("Greater", ["gate", "ctx"], ["keep"]),
        helper.make_node("Where", ["keep", "ctx", "zero_f"], ["ctx2"]),
        helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["ctx2", "emb_t"], ["lm"]),
        helper.make_node("Add", ["lm", "final_logits_bias"], ["logits"]),
    ]
    nodes.insert(18, helper.make_node("Transpose", ["h5"], ["h5t"], perm=[1, 0]))
    inits = [
        _init("emb", rng.standard_normal((V, D)).astype(np.float32)),
        _init("pos_table", rng.standard_normal((8, D)).astype(np.float32)),
        _init("pos_idx", np.arange(S, dtype=np.int64)[:, None]),
        _init("sinus", _sinusoids(S, D)),
        _init("one", np.int64(1)), _init("zero", np.int64(0)),
        _init("axis0", np.array([0], np.int64)),
        _init("inv_freq", rng.random((D, 1)).astype(np.float32)),
        _init("val_7", rng.standard_normal((D, D)).astype(np.float32)),
        _init("val_12", np.full((S, D), 0.5, np.float32)),
        _init("onnx::Mul_9", rng.random((S, D)).astype(np.float32) + 1),
        _init("mask", np.triu(np.full((S, S), np.finfo(np.float32).min, np.float32), 1)),
        _init("gate", rng.standard_normal((S, D)).astype(np.float32)),
        _init("zero_f", np.float32(0)),
        _init("final_logits_bias", np.zeros((1, V), np.float32)),
    ]
    g = helper.make_graph(nodes, "decoder", [helper.make_tensor_value_info("ids", I64, [S])],
                          [helper.make_tensor_value_info("logits", F32, [S, V])], inits)
    if kinds:
        for name, kind in [("emb", "PARAMETER"), ("pos_table", "PARAMETER"),
                           ("sinus", "PARAMETER"), ("inv_freq", "BUFFER"),
                           ("gate", "PARAMETER"), ("final_logits_bias", "BUFFER")]:
            vi = helper.make_tensor_value_info(name, F32, None)
            p = vi.metadata_props.add()
            p.key, p.value = "pkg.torch.export.graph_signature.InputSpec.kind", kind
            g.value_info.append(vi)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=IR_VERSION)


@pytest.mark.parametrize("kinds", [False, True], ids=["classic", "dynamo"])
def test_default_params_are_what_torch_trains(kinds):
    if kinds and not hasattr(onnx.ValueInfoProto(), "metadata_props"):
        pytest.skip("this onnx has no value metadata (onnx >= 1.16 writes it)")
    chosen, warned = _choose(decoder(kinds))
    # emb: a real tie (Gather and MatMul); pos_table through Transpose -> GatherND;
    # val_7 a folded weight read by MatMul. Left out: the sinusoids, the rotary
    # frequencies (times positions), exporter constants read elementwise, the mask, the
    # Where condition source, the zero logits bias.
    assert chosen == ["emb", "pos_table", "val_7"]
    assert warned == []


def _norms(merged: bool, batch_table: bool, folded_conv: bool):
    nodes, inits = [], [_init("w_in", rng.standard_normal((3, 4)).astype(np.float32))]
    nodes.append(helper.make_node("MatMul", ["x", "w_in"], ["h"]))
    for k in range(2):  # two LayerNorms; merged: one ones scale and one zero bias
        s, b = ("ln.weight", "ln.bias") if merged else (f"ln{k}.weight", f"ln{k}.bias")
        nodes.append(helper.make_node("LayerNormalization", ["h" if k == 0 else "n0", s, b],
                                      [f"n{k}"], axis=-1))
        if merged and k == 1:
            continue
        inits += [_init(s, np.ones(4, np.float32)), _init(b, np.zeros(4, np.float32))]
    out = "n1"
    if batch_table:  # a position table expanded to the batch size 2
        inits.append(_init("expand", rng.standard_normal((2, 5, 4)).astype(np.float32)))
        nodes.append(helper.make_node("Add", ["n1", "expand"], ["n2"]))
        out = "n2"
    if folded_conv:
        conv = helper.make_node("Conv", ["img", "c.weight", "c.weight_bias"], ["y"],
                                name="node_Conv_56")
        p = conv.metadata_props.add()
        p.key = "pkg.torch.onnx.class_hierarchy"
        p.value = "['M', 'torch.nn.modules.batchnorm.BatchNorm2d']"
        nodes.append(conv)
        inits += [_init("c.weight", rng.standard_normal((2, 1, 1, 1)).astype(np.float32)),
                  _init("c.weight_bias", rng.standard_normal(2).astype(np.float32))]
    g = helper.make_graph(
        nodes, "norms", [helper.make_tensor_value_info("x", F32, [2, 5, 3]),
                         helper.make_tensor_value_info("img", F32, [2, 1, 3, 3])],
        [helper.make_tensor_value_info(out, F32, None)]
        + ([helper.make_tensor_value_info("y", F32, None)] if folded_conv else []), inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=IR_VERSION)


def test_warnings_name_merged_batch_sized_and_folded_tensors():
    chosen, warned = _choose(_norms(False, False, False))
    assert chosen == ["w_in", "ln0.weight", "ln0.bias", "ln1.weight", "ln1.bias"]
    assert warned == []  # separate zeros and ones: no merge
    chosen, warned = _choose(_norms(True, False, False))
    assert chosen == ["w_in", "ln.weight", "ln.bias"]
    assert len(warned) == 1 and "ln.weight" in warned[0] and "ln.bias" in warned[0]
    assert "trainops.torch.export" in warned[0]
    chosen, warned = _choose(_norms(False, True, False))
    assert "expand" in chosen
    assert len(warned) == 1 and "expand" in warned[0] and "batch" in warned[0]
    if not hasattr(onnx.NodeProto(), "metadata_props"):
        pytest.skip("this onnx has no node metadata (onnx >= 1.16 writes it)")
    chosen, warned = _choose(_norms(False, False, True))
    assert len(warned) == 1 and "node_Conv_56" in warned[0] and "BatchNorm" in warned[0]
    assert "trainops.torch.export" in warned[0]


def residual_bn():
    """Two BatchNormalization blocks and a skip, written as torch's classic exporter writes
    an eval-mode model: both blocks' scale ``s`` and shift ``b`` are one merged tensor,
    the first node's running mean is an Identity of ``b`` and its variance an Identity
    chain of ``s``; the second's mean is a Constant and its variance the initializer
    ``rv``, which another node reads too (an Identity to an output)."""
    C = 3
    nodes = [
        helper.make_node("Identity", ["b"], ["bn1.running_mean"]),
        helper.make_node("Identity", ["s"], ["s_view"]),
        helper.make_node("Identity", ["s_view"], ["bn1.running_var"]),
        helper.make_node("Constant", [], ["bn2.running_mean"],
                         value=_init("c", np.full(C, 0.25, np.float32))),
        helper.make_node("BatchNormalization", ["x", "s", "b", "bn1.running_mean",
                                                "bn1.running_var"], ["y1"],
                         name="/blocks/blocks.0/b1/BatchNormalization", momentum=0.9),
        helper.make_node("Relu", ["y1"], ["r1"]),
        helper.make_node("Mul", ["r1", "w"], ["m1"]),
        helper.make_node("BatchNormalization", ["m1", "s", "b", "bn2.running_mean", "rv"],
                         ["y2"], name="/blocks/blocks.1/b1/BatchNormalization",
                         momentum=0.8),
        helper.make_node("Add", ["y2", "x"], ["z"]),
        helper.make_node("Relu", ["z"], ["out"]),
        helper.make_node("Mul", ["out", "out"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
        helper.make_node("Identity", ["rv"], ["rv_out"]),
    ]
    inits = [_init("s", np.ones(C, np.float32)), _init("b", np.zeros(C, np.float32)),
             _init("w", (rng.random((1, C, 1, 1)) + 0.5).astype(np.float32)),
             _init("rv", np.full(C, 2.0, np.float32))]
    g = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", F32, [4, C, 2, 2])],
                          [helper.make_tensor_value_info("loss", F32, []),
                           helper.make_tensor_value_info("rv_out", F32, [C])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=IR_VERSION)


def _bn_reference(x, mean, var, momentum):
    """torch's BatchNorm training step in float64: batch statistics over N, H, W; the
    running variance takes the unbiased batch variance."""
    n = x.shape[0] * x.shape[2] * x.shape[3]
    mu = x.mean(axis=(0, 2, 3))
    v = x.var(axis=(0, 2, 3))
    y = (x - mu[None, :, None, None]) / np.sqrt(v[None, :, None, None] + 1e-5)
    return (y, momentum * mean + (1 - momentum) * mu,
            momentum * var + (1 - momentum) * v * n / (n - 1))


def test_running_stats_through_identity_and_constant_chains(library_path):
    model = residual_bn()
    m = import_model(model)
    assert not [n for n in m.graph.node if n.op_type in ("Identity", "Constant")
                and n.output[0].startswith("bn")]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")  # s and b merged: warned (tested above)
        tr = Trainer(model, "loss", optim.Momentum(lr=0.0), seed=0)
    assert sorted(tr.running_stats()) == ["bn1.running_mean", "bn1.running_var",
                                          "bn2.running_mean", "rv/1"]
    w = numpy_helper.to_array(model.graph.initializer[2]).astype(np.float64)
    stats = {"m1": np.zeros(3), "v1": np.ones(3), "m2": np.full(3, 0.25), "v2": np.full(3, 2.0)}
    bound = 0.0
    for _ in range(2):  # lr 0: the weights stay; only the running statistics move
        x = rng.standard_normal((4, 3, 2, 2)).astype(np.float32)
        tr.step({"x": x})
        y1, stats["m1"], stats["v1"] = _bn_reference(x.astype(np.float64), stats["m1"],
                                                     stats["v1"], 0.9)
        h = np.maximum(y1, 0) * w
        _, stats["m2"], stats["v2"] = _bn_reference(h, stats["m2"], stats["v2"], 0.8)
        # float32 sums of n = 16 values of magnitude <= M per statistic, a few roundings
        # each (Bessel factor, momentum products): 4 * n roundings of 2**-24 relative to
        # the largest value involved, squared values for the variance.
        M = max(np.abs(x).max(), np.abs(h).max())
        bound += (4 * 16 * 2.0 ** -24 * max(M, 1.0) ** 2 * 4)
    got = tr.running_stats()
    for name, key in [("bn1.running_mean", "m1"), ("bn1.running_var", "v1"),
                      ("bn2.running_mean", "m2"), ("rv/1", "v2")]:
        np.testing.assert_allclose(got[name], stats[key], rtol=0, atol=bound, err_msg=name)
