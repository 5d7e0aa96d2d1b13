"""Models built the way torch's exporters write them (tests/test_real_models.py), each with
a numpy float64 forward that is its independent reference:

- :func:`rnn_classifier`: batch-first GRU/LSTM (a Transpose in, the zero initial state
  by a Shape -> Gather -> Unsqueeze -> Concat -> Expand chain, as ``nn.GRU`` exports), the
  last step through a Gemm head (reference: ``rnn_reference.gru_bptt``/``lstm_bptt``);
- :func:`bn_cnn`: Conv -> BatchNormalization(training_mode=1, three outputs, as
  ``TrainingMode.TRAINING`` writes it) -> Relu -> GlobalAveragePool -> Flatten -> Gemm;
- :func:`encoder_block`: a post-norm transformer encoder layer as the CLASSIC exporter
  writes ``nn.MultiheadAttention``: the packed in-projection unflattened by a Reshape whose
  shape is ``Concat(Slice(Shape), ..)`` with the slice bound computed by ``Mod(Add(3, -1),
  3)``, then ``Unsqueeze -> Transpose -> Squeeze -> Gather`` for q, k, v, head reshapes from
  ``Shape -> Gather -> Mul`` chains.

:func:`adam_reference` runs ONNX Adam (``helpers.references.adam_step``) on a float64
loss-and-gradient function; :func:`fd_grads` gives central differences of a numpy forward.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from helpers.references import adam_step
from trainops.onnx_defs import IR_VERSION

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
c = helper.make_node


def _model(nodes, inputs, outputs, inits, opset=17):
    g = helper.make_graph(nodes, "exported", inputs, outputs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = IR_VERSION
    return m


def _ints(**kw):
    return {k: np.array(v, np.int64) for k, v in kw.items()}


def adam_reference(params, loss_and_grads, steps, lr, **attrs):
    """(losses before each step, final params) of ``steps`` ONNX Adam steps in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    v = {k: np.zeros_like(a) for k, a in p.items()}
    h = {k: np.zeros_like(a) for k, a in p.items()}
    losses = []
    for t in range(1, steps + 1):
        loss, g = loss_and_grads(p)
        losses.append(loss)
        for k in p:
            p[k], v[k], h[k] = adam_step(lr, t, p[k], g[k], v[k], h[k], **attrs)
    return losses, p


def fd_grads(f, params, eps=1e-6):
    """Central differences of the float64 scalar ``f(params)`` for every element."""
    out = {}
    for k, a in params.items():
        g = np.zeros_like(a)
        flat, gf = a.reshape(-1), g.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + eps
            up = f(params)
            flat[i] = old - eps
            down = f(params)
            flat[i] = old
            gf[i] = (up - down) / (2 * eps)
        out[k] = g
    return out


def cross_entropy(logits, labels):
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(labels)), labels].mean()


# -- GRU / LSTM --------------------------------------------------------------------------

def rnn_classifier(op, batch=4, seq=5, inp=3, hid=6, classes=3, seed=3):
    """(model, params float64, x [batch, seq, inp], labels); the logits tensor is 'logits'."""
    rng = np.random.default_rng(seed)
    gates = {"GRU": 3, "LSTM": 4}[op]
    p = {"W": rng.standard_normal((1, gates * hid, inp)) * 0.5,
         "R": rng.standard_normal((1, gates * hid, hid)) * 0.5,
         "B": rng.standard_normal((1, 2 * gates * hid)) * 0.2,
         "Wh": rng.standard_normal((classes, hid)) * 0.7, "bh": rng.standard_normal(classes) * 0.1}
    p = {k: v.astype(np.float32).astype(np.float64) for k, v in p.items()}
    x = rng.standard_normal((batch, seq, inp)).astype(np.float32)
    labels = rng.integers(0, classes, batch)
    nodes = [
        c("Transpose", ["x"], ["xt"], perm=[1, 0, 2], name="/rnn/Transpose"),
        c("Shape", ["x"], ["/rnn/Shape_output_0"], name="/rnn/Shape"),
        c("Gather", ["/rnn/Shape_output_0", "zero_i"], ["/rnn/Gather_output_0"], axis=0,
          name="/rnn/Gather"),
        c("Unsqueeze", ["/rnn/Gather_output_0", "ax0"], ["/rnn/Unsqueeze_output_0"],
          name="/rnn/Unsqueeze"),
        c("Concat", ["one1", "/rnn/Unsqueeze_output_0", "hid1"], ["/rnn/Concat_output_0"],
          axis=0, name="/rnn/Concat"),
        c("Expand", ["zero_f", "/rnn/Concat_output_0"], ["h0"], name="/rnn/Expand"),
    ]
    attrs = {"hidden_size": hid}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    state = ["h0", "h0"] if op == "LSTM" else ["h0"]
    nodes += [c(op, ["xt", "W", "R", "B", ""] + state, ["Y", "Y_h"], name=f"/rnn/{op}", **attrs),
              c("Squeeze", ["Y", "ax1"], ["Ys"], name="/rnn/Squeeze"),
              c("Gather", ["Ys", "last"], ["h_last"], axis=0, name="/Gather_last"),
              c("Gemm", ["h_last", "Wh", "bh"], ["logits"], transB=1, name="/fc/Gemm")]
    inits = {**_ints(zero_i=0, ax0=[0], one1=[1], hid1=[hid], ax1=[1], last=-1),
             "zero_f": np.zeros([1], np.float32),
             **{k: v.astype(np.float32) for k, v in p.items()}}
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, [batch, seq, inp])],
                   [helper.make_tensor_value_info("logits", F32, [batch, classes])], inits)
    return model, p, x, labels


# -- BatchNorm CNN -----------------------------------------------------------------------

def conv2d(x, w):
    """3x3 convolution, stride 1, pad 1, no bias (float64)."""
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # N C H W 3 3
    return np.einsum("nchwij,ocij->nohw", win, w)


def bn_cnn_forward(p, x, labels, eps=1e-5, running=None):
    """(loss, batch mean, biased batch variance) in training mode; with ``running`` =
    (mean, var): the logits of the inference form."""
    z = conv2d(x, p["W"])
    if running is None:
        mu, var = z.mean(axis=(0, 2, 3)), z.var(axis=(0, 2, 3))
    else:
        mu, var = running
    y = (z - mu[None, :, None, None]) / np.sqrt(var[None, :, None, None] + eps)
    y = np.maximum(p["s"][None, :, None, None] * y + p["beta"][None, :, None, None], 0)
    logits = y.mean(axis=(2, 3)) @ p["Wh"].T + p["bh"]
    if running is not None:
        return logits
    return cross_entropy(logits, labels), mu, var


def bn_cnn(batch=4, cin=2, cout=3, hw=5, classes=3, seed=5):
    """(model, params float64, running (mean, var) float64, x, labels)."""
    rng = np.random.default_rng(seed)
    # No conv bias (as torch writes Conv before BatchNorm): its gradient would be exactly 0
    # under batch statistics, and Adam would turn float32 rounding noise into steps.
    p = {"W": rng.standard_normal((cout, cin, 3, 3)) * 0.4,
         "s": 1 + 0.2 * rng.standard_normal(cout), "beta": 0.1 * rng.standard_normal(cout),
         "Wh": rng.standard_normal((classes, cout)) * 0.7, "bh": rng.standard_normal(classes) * 0.1}
    p = {k: v.astype(np.float32).astype(np.float64) for k, v in p.items()}
    running = (np.float32(0.1) * rng.standard_normal(cout).astype(np.float32),
               (1 + 0.3 * rng.random(cout)).astype(np.float32))
    x = rng.standard_normal((batch, cin, hw, hw)).astype(np.float32)
    labels = rng.integers(0, classes, batch)
    nodes = [c("Conv", ["x", "W"], ["z"], pads=[1, 1, 1, 1], kernel_shape=[3, 3],
               name="/conv/Conv"),
             c("BatchNormalization", ["z", "s", "beta", "rm", "rv"], ["y", "rm_out", "rv_out"],
               epsilon=1e-5, momentum=0.9, training_mode=1, name="/bn/BatchNormalization"),
             c("Relu", ["y"], ["r"], name="/Relu"),
             c("GlobalAveragePool", ["r"], ["gap"], name="/GlobalAveragePool"),
             c("Flatten", ["gap"], ["f"], axis=1, name="/Flatten"),
             c("Gemm", ["f", "Wh", "bh"], ["logits"], transB=1, name="/fc/Gemm")]
    inits = {**{k: v.astype(np.float32) for k, v in p.items()}, "rm": running[0],
             "rv": running[1]}
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, list(x.shape))],
                   [helper.make_tensor_value_info("logits", F32, [batch, classes])], inits)
    return model, p, tuple(np.float64(r) for r in running), x, labels


# -- transformer encoder block -----------------------------------------------------------

def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def encoder_forward(p, x, labels, heads=2):
    """The loss of :func:`encoder_block`'s model in float64."""
    B, T, D = x.shape
    hd = D // heads
    proj = x @ p["in_w"].T + p["in_b"]                          # [B, T, 3D]
    q, k, v = (proj[..., i * D:(i + 1) * D].reshape(B, T, heads, hd).transpose(0, 2, 1, 3)
               for i in range(3))                              # [B, H, T, hd]
    s = (q / np.sqrt(hd)) @ k.transpose(0, 1, 3, 2)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, D) @ p["out_w"].T + p["out_b"]
    h1 = layer_norm(x + o, p["ln1_g"], p["ln1_b"])
    ff = np.maximum(h1 @ p["w1"].T + p["b1"], 0) @ p["w2"].T + p["b2"]
    h2 = layer_norm(h1 + ff, p["ln2_g"], p["ln2_b"])
    return cross_entropy(h2.mean(axis=1) @ p["Wh"].T + p["bh"], labels)


def encoder_block(batch=2, seq=3, d=4, heads=2, ff=8, classes=3, seed=7, batch_dim=None):
    """(model, params float64, x, labels); ``batch_dim``: the input's declared batch
    dimension (default the number; a name makes it symbolic)."""
    rng = np.random.default_rng(seed)
    hd = d // heads
    shapes = {"in_w": (3 * d, d), "in_b": (3 * d,), "out_w": (d, d), "out_b": (d,),
              "ln1_g": (d,), "ln1_b": (d,), "w1": (ff, d), "b1": (ff,), "w2": (d, ff),
              "b2": (d,), "ln2_g": (d,), "ln2_b": (d,), "Wh": (classes, d), "bh": (classes,)}
    p = {k: rng.standard_normal(s) * (0.5 if len(s) == 2 else 0.1) for k, s in shapes.items()}
    p["ln1_g"] += 1
    p["ln2_g"] += 1
    p = {k: v.astype(np.float32).astype(np.float64) for k, v in p.items()}
    x = rng.standard_normal((batch, seq, d)).astype(np.float32)
    labels = rng.integers(0, classes, batch)
    a = "/self_attn/"
    nodes = [
        c("Transpose", ["x"], ["xt"], perm=[1, 0, 2], name=a + "Transpose"),
        c("Transpose", ["in_w"], ["in_wT"], perm=[1, 0], name=a + "Transpose_1"),
        c("MatMul", ["xt", "in_wT"], ["mm"], name=a + "MatMul"),
        c("Add", ["in_b", "mm"], ["proj"], name=a + "Add"),       # [T, B, 3D]
        # unflatten(-1, (3, D)): the slice bound from index arithmetic on constants
        c("Constant", [], ["c3"], value=numpy_helper.from_array(np.array([3], np.int64))),
        c("Constant", [], ["cm1"], value=numpy_helper.from_array(np.array(-1, np.int64))),
        c("Add", ["c3", "cm1"], ["dim_plus"], name=a + "Add_1"),
        c("Mod", ["dim_plus", "c3"], ["dim"], name=a + "Mod"),
        c("Reshape", ["dim", "one1"], ["dim1"], name=a + "Reshape"),
        c("Add", ["dim", "one1"], ["dim_next"], name=a + "Add_2"),
        c("Reshape", ["dim_next", "one1"], ["dim_next1"], name=a + "Reshape_1"),
        c("Shape", ["proj"], ["proj_shape"], name=a + "Shape"),
        c("Slice", ["proj_shape", "zero1", "dim1"], ["head"], name=a + "Slice"),
        c("Slice", ["proj_shape", "dim_next1", "big1"], ["tail"], name=a + "Slice_1"),
        c("Concat", ["head", "three_d", "tail"], ["unflat"], axis=0, name=a + "Concat_1"),
        c("Reshape", ["proj", "unflat"], ["r5"], name=a + "Reshape_2"),        # [T, B, 3, D]
        c("Unsqueeze", ["r5", "zero1"], ["u5"], name=a + "Unsqueeze_2"),     # [1, T, B, 3, D]
        c("Transpose", ["u5"], ["t5"], perm=[3, 1, 2, 0, 4], name=a + "Transpose_2"),
        c("Squeeze", ["t5", "m2"], ["qkv"], name=a + "Squeeze"),             # [3, T, B, D]
        c("Gather", ["qkv", "i0"], ["q"], axis=0, name=a + "Gather"),
        c("Gather", ["qkv", "i1"], ["k"], axis=0, name=a + "Gather_1"),
        c("Gather", ["qkv", "i2"], ["v"], axis=0, name=a + "Gather_2"),
        # q.view(T, B * heads, hd): sizes from Shape -> Gather -> Mul chains
        c("Shape", ["xt"], ["xt_shape"], name=a + "Shape_1"),
        c("Gather", ["xt_shape", "i0"], ["T_"], axis=0, name=a + "Gather_3"),
        c("Gather", ["xt_shape", "i1"], ["B_"], axis=0, name=a + "Gather_4"),
        c("Mul", ["B_", "heads"], ["BH"], name=a + "Mul"),
        c("Mul", ["T_", "B_"], ["TB"], name=a + "Mul_1"),
        c("Unsqueeze", ["T_", "zero1"], ["T1"], name=a + "Unsqueeze_3"),
        c("Unsqueeze", ["B_", "zero1"], ["B1"], name=a + "Unsqueeze_4"),
        c("Unsqueeze", ["BH", "zero1"], ["BH1"], name=a + "Unsqueeze_5"),
        c("Unsqueeze", ["TB", "zero1"], ["TB1"], name=a + "Unsqueeze_6"),
        c("Concat", ["T1", "BH1", "hd1"], ["hshape"], axis=0, name=a + "Concat_2"),
    ]
    for t in "qkv":
        nodes += [c("Reshape", [t, "hshape"], [t + "r"], name=a + f"Reshape_{t}"),
                  c("Transpose", [t + "r"], [t + "h"], perm=[1, 0, 2], name=a + f"Transpose_{t}")]
    nodes += [
        c("Mul", ["qh", "scale"], ["qs"], name=a + "Mul_2"),
        c("Transpose", ["kh"], ["khT"], perm=[0, 2, 1], name=a + "Transpose_3"),
        c("MatMul", ["qs", "khT"], ["scores"], name=a + "MatMul_1"),
        c("Softmax", ["scores"], ["attn"], axis=-1, name=a + "Softmax"),
        c("MatMul", ["attn", "vh"], ["ctx"], name=a + "MatMul_2"),              # [BH, T, hd]
        c("Transpose", ["ctx"], ["ctxt"], perm=[1, 0, 2], name=a + "Transpose_4"),
        c("Concat", ["TB1", "d1"], ["flat_shape"], axis=0, name=a + "Concat_3"),
        c("Reshape", ["ctxt", "flat_shape"], ["ctxf"], name=a + "Reshape_3"),
        c("Gemm", ["ctxf", "out_w", "out_b"], ["o"], transB=1, name=a + "Gemm"),
        c("Concat", ["T1", "B1", "d1"], ["tbd"], axis=0, name=a + "Concat_4"),
        c("Reshape", ["o", "tbd"], ["o3"], name=a + "Reshape_4"),
        c("Transpose", ["o3"], ["attn_out"], perm=[1, 0, 2], name=a + "Transpose_5"),
        c("Add", ["x", "attn_out"], ["res1"], name="/Add"),
        c("LayerNormalization", ["res1", "ln1_g", "ln1_b"], ["h1"], axis=-1, epsilon=1e-5,
          name="/norm1/LayerNormalization"),
        c("Transpose", ["w1"], ["w1T"], perm=[1, 0], name="/linear1/Transpose"),
        c("MatMul", ["h1", "w1T"], ["f1m"], name="/linear1/MatMul"),
        c("Add", ["b1", "f1m"], ["f1"], name="/linear1/Add"),
        c("Relu", ["f1"], ["f1r"], name="/Relu"),
        c("Transpose", ["w2"], ["w2T"], perm=[1, 0], name="/linear2/Transpose"),
        c("MatMul", ["f1r", "w2T"], ["f2m"], name="/linear2/MatMul"),
        c("Add", ["b2", "f2m"], ["f2"], name="/linear2/Add"),
        c("Add", ["h1", "f2"], ["res2"], name="/Add_1"),
        c("LayerNormalization", ["res2", "ln2_g", "ln2_b"], ["h2"], axis=-1, epsilon=1e-5,
          name="/norm2/LayerNormalization"),
        c("ReduceMean", ["h2"], ["pooled"], axes=[1], keepdims=0, name="/ReduceMean"),
        c("Gemm", ["pooled", "Wh", "bh"], ["logits"], transB=1, name="/head/Gemm")]
    inits = {**_ints(one1=[1], zero1=[0], big1=[2 ** 63 - 1], three_d=[3, d], m2=[-2], i0=0,
                     i1=1, i2=2, heads=heads, hd1=[hd], d1=[d]),
             "scale": np.array(1 / np.sqrt(hd), np.float32),
             **{k: v.astype(np.float32) for k, v in p.items()}}
    dims = [batch_dim or batch, seq, d]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, dims)],
                   [helper.make_tensor_value_info("logits", F32, [dims[0], classes])], inits)
    return model, p, x, labels


def expanded_op_types(model, xs, y="loss"):
    """The op types of ``expand_gradients`` run on ``model`` (changed in place) given a
    Gradient node of ``y`` with respect to ``xs``, whose outputs ``d<x>`` become graph
    outputs."""
    from trainops.autodiff import expand_gradients
    from trainops.onnx_defs import TRAINING_DOMAIN

    g = model.graph
    g.node.append(helper.make_node("Gradient", list(xs), [f"d{x}" for x in xs],
                                   domain=TRAINING_DOMAIN, xs=list(xs), y=y))
    g.output.extend(helper.make_tensor_value_info(f"d{x}", TensorProto.FLOAT, None) for x in xs)
    model.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    return [n.op_type for n in expand_gradients(model).graph.node]
