"""The model families of ``python -m trainops bench train``: each an ONNX model (standard
ops, a ``SoftmaxCrossEntropyLoss`` output ``loss`` over labels ``t``), its data and its
weights as numpy arrays, which :mod:`trainops.bench.train_torch` loads into the PyTorch
peer, so both peers start from the same weights.

=============  ============================================================================
``mlp``        x[N,256] -> 2 x (Linear 512, LayerNorm, Gelu) -> Linear 10 (opset 20: Gelu)
``cnn``        the demo CNN (:func:`trainops.demos.train.cnn_model`) on 8x8 digits
``bncnn``      the demo CNN with BatchNormalization after each convolution
``transformer``  x[N,32,16] -> Linear 64 -> 2 post-norm encoder layers (4 heads, FF 128,
               ReLU) -> mean over the sequence -> Linear 10
``gru``        x[16,N,32] -> GRU 64 (linear_before_reset, as torch) -> last state -> Linear 10
``resnet``     x[N,3,32,32] -> Conv3x3 16 BN ReLU -> basic block 16 -> basic block 32
               (stride 2, 1x1 projection) -> GlobalAveragePool -> Linear 10
=============  ============================================================================

BatchNormalization runs in training mode in both peers: the Trainer normalises with the
batch's statistics and updates the running ones (its BatchNorm import, as for an exported
model in ``train()`` mode), the torch peer keeps its modules in ``train()``. The running
mean and variance are state, not parameters (:attr:`Family.params` leaves them out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..onnx_defs import IR_VERSION, ONNX_OPSET

__all__ = ["Family", "FAMILIES", "family", "DEFAULT_BATCH"]

DEFAULT_BATCH = {"mlp": 64, "cnn": 64, "bncnn": 256, "transformer": 32, "gru": 64, "resnet": 8}


@dataclass
class Family:
    """One model: ``model`` (onnx ModelProto), ``feeds`` (x, t), ``weights`` (name ->
    array, the initializers), ``params`` (the trained ones), ``kind`` and ``config``
    (what the torch mirror needs)."""

    name: str
    model: object
    feeds: dict
    weights: dict
    params: list
    kind: str
    config: dict = field(default_factory=dict)


class _G:
    """A tiny graph writer: nodes, initializers, fresh names."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.w, self.k = [], {}, 0

    def init(self, name, arr):
        self.w[name] = np.ascontiguousarray(arr, dtype=arr.dtype)
        return name

    def randn(self, name, shape, fan_in):
        return self.init(name, (self.rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32))

    def ints(self, vals):
        self.k += 1
        return self.init(f"const{self.k}", np.asarray(vals, np.int64))

    def op(self, op_type, inputs, n_out=1, **attrs):
        from onnx import helper

        self.k += 1
        outs = [f"{op_type.lower()}{self.k}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}{self.k}", **attrs))
        return outs[0] if n_out == 1 else outs

    def linear(self, x, name, fan_in, fan_out, bias=True):
        """x @ W^T + b with torch's [out, in] weight stored transposed as ``name.wT``."""
        wt = self.randn(f"{name}.wT", (fan_in, fan_out), fan_in)
        y = self.op("MatMul", [x, wt])
        if bias:
            y = self.op("Add", [y, self.init(f"{name}.b", np.zeros(fan_out, np.float32))])
        return y

    def layer_norm(self, x, name, d):
        s = self.init(f"{name}.g", np.ones(d, np.float32))
        b = self.init(f"{name}.b", np.zeros(d, np.float32))
        return self.op("LayerNormalization", [x, s, b], axis=-1, epsilon=1e-5)

    def conv_bn(self, x, name, cin, cout, k, stride=1, relu=True):
        w = self.randn(f"{name}.w", (cout, cin, k, k), cin * k * k / 2)
        p = k // 2
        y = self.op("Conv", [x, w], pads=[p] * 4, strides=[stride] * 2)
        bn = [self.init(f"{name}.bn.{s}", v.astype(np.float32)) for s, v in
              (("g", np.ones(cout)), ("b", np.zeros(cout)),
               ("mean", self.rng.normal(0, 0.1, cout)), ("var", self.rng.uniform(0.5, 1.5, cout)))]
        y = self.op("BatchNormalization", [y] + bn, epsilon=1e-5)
        return self.op("Relu", [y]) if relu else y

    def model(self, name, x_shape, x_type, logits, batch_dims, opset=ONNX_OPSET):
        from onnx import TensorProto, helper, numpy_helper

        self.nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [logits, "t"], ["loss"],
                                           name="loss"))
        g = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info("x", x_type, x_shape),
             helper.make_tensor_value_info("t", TensorProto.INT64, [batch_dims])],
            [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
            [numpy_helper.from_array(v, k) for k, v in self.w.items()])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="trainops.bench.train_models")
        m.ir_version = max(IR_VERSION, 9 if opset >= 20 else IR_VERSION)
        return m


def _labels(rng, n):
    return rng.integers(0, 10, n).astype(np.int64)


def _mlp(batch, seed):
    from onnx import TensorProto

    g = _G(seed)
    h, d = "x", 256
    for i in range(2):
        h = g.linear(h, f"fc{i}", d, 512)
        h = g.op("Gelu", [g.layer_norm(h, f"ln{i}", 512)])
        d = 512
    logits = g.linear(h, "fc2", 512, 10)
    rng = np.random.default_rng(seed + 1)
    feeds = {"x": rng.standard_normal((batch, 256)).astype(np.float32), "t": _labels(rng, batch)}
    return g.model("mlp", ["N", 256], TensorProto.FLOAT, logits, "N", opset=20), feeds, g.w


def _bncnn(batch, seed):
    from onnx import TensorProto

    from ..demos.train import digits

    g = _G(seed)
    h = g.conv_bn("x", "conv1", 1, 8, 3)
    h = g.op("MaxPool", [h], kernel_shape=[2, 2], strides=[2, 2])
    h = g.conv_bn(h, "conv2", 8, 16, 3)
    h = g.op("MaxPool", [h], kernel_shape=[2, 2], strides=[2, 2])
    logits = g.linear(g.op("Flatten", [h]), "fc", 64, 10)
    x, t = digits(batch, seed)
    return (g.model("bncnn", ["N", 1, 8, 8], TensorProto.FLOAT, logits, "N"),
            {"x": x, "t": t}, g.w)


def _transformer(batch, seed, seq=32, d=64, heads=4, ff=128, layers=2):
    from onnx import TensorProto

    g = _G(seed)
    h = g.linear("x", "embed", 16, d)
    dh = d // heads
    for i in range(layers):
        p = f"layer{i}"
        qkv = g.linear(h, f"{p}.in_proj", d, 3 * d)
        q, k, v = g.op("Split", [qkv, g.ints([d, d, d])], 3, axis=-1)
        heads4 = g.ints([0, 0, heads, dh])
        q, k, v = (g.op("Transpose", [g.op("Reshape", [t, heads4])], perm=[0, 2, 1, 3])
                   for t in (q, k, v))
        s = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])
        s = g.op("Mul", [s, g.init(f"{p}.scale", np.asarray(1 / np.sqrt(dh), np.float32))])
        a = g.op("MatMul", [g.op("Softmax", [s], axis=-1), v])
        a = g.op("Reshape", [g.op("Transpose", [a], perm=[0, 2, 1, 3]), g.ints([0, 0, d])])
        h = g.layer_norm(g.op("Add", [h, g.linear(a, f"{p}.out_proj", d, d)]), f"{p}.norm1", d)
        f = g.linear(g.op("Relu", [g.linear(h, f"{p}.linear1", d, ff)]), f"{p}.linear2", ff, d)
        h = g.layer_norm(g.op("Add", [h, f]), f"{p}.norm2", d)
    pooled = g.op("ReduceMean", [h, g.ints([1])], keepdims=0)
    logits = g.linear(pooled, "head", d, 10)
    rng = np.random.default_rng(seed + 1)
    feeds = {"x": rng.standard_normal((batch, seq, 16)).astype(np.float32), "t": _labels(rng, batch)}
    return (g.model("transformer", ["N", seq, 16], TensorProto.FLOAT, logits, "N", opset=18),
            feeds, g.w)


def _gru(batch, seed, seq=16, inp=32, hidden=64):
    from onnx import TensorProto

    g = _G(seed)
    H = hidden
    g.randn("gru.W", (1, 3 * H, inp), H)   # ONNX gate order z, r, h
    g.randn("gru.R", (1, 3 * H, H), H)
    g.init("gru.B", (g.rng.standard_normal((1, 6 * H)) / np.sqrt(H)).astype(np.float32))
    _, yh = g.op("GRU", ["x", "gru.W", "gru.R", "gru.B"], 2, hidden_size=H, linear_before_reset=1)
    last = g.op("Reshape", [yh, g.ints([-1, H])])
    logits = g.linear(last, "fc", H, 10)
    rng = np.random.default_rng(seed + 1)
    feeds = {"x": rng.standard_normal((seq, batch, inp)).astype(np.float32), "t": _labels(rng, batch)}
    return g.model("gru", [seq, "N", inp], TensorProto.FLOAT, logits, "N"), feeds, g.w


def _resnet(batch, seed, size=32):
    from onnx import TensorProto

    g = _G(seed)
    h = g.conv_bn("x", "stem", 3, 16, 3)

    def block(x, name, cin, cout, stride):
        y = g.conv_bn(x, f"{name}.c1", cin, cout, 3, stride)
        y = g.conv_bn(y, f"{name}.c2", cout, cout, 3, relu=False)
        sc = x if (cin == cout and stride == 1) else g.conv_bn(x, f"{name}.proj", cin, cout, 1,
                                                               stride, relu=False)
        return g.op("Relu", [g.op("Add", [y, sc])])

    h = block(h, "block1", 16, 16, 1)
    h = block(h, "block2", 16, 32, 2)
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    logits = g.linear(pooled, "fc", 32, 10)
    rng = np.random.default_rng(seed + 1)
    feeds = {"x": rng.standard_normal((batch, 3, size, size)).astype(np.float32),
             "t": _labels(rng, batch)}
    return (g.model("resnet", ["N", 3, size, size], TensorProto.FLOAT, logits, "N"),
            feeds, g.w)


def _cnn(batch, seed):
    from onnx import numpy_helper

    from ..demos.train import cnn_model, digits

    m = cnn_model(seed)
    x, t = digits(batch, seed)
    return m, {"x": x, "t": t}, {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


_BUILDERS = {"mlp": _mlp, "cnn": _cnn, "bncnn": _bncnn, "transformer": _transformer,
             "gru": _gru, "resnet": _resnet}
FAMILIES = tuple(_BUILDERS)


def family(name: str, batch: int | None = None, seed: int = 0) -> Family:
    """The model family ``name`` (one of :data:`FAMILIES`) at ``batch`` (its default
    batch: :data:`DEFAULT_BATCH`)."""
    if name not in _BUILDERS:
        raise ValueError(f"bench train: unknown model {name!r}; choose from {', '.join(FAMILIES)}")
    batch = batch or DEFAULT_BATCH[name]
    model, feeds, w = _BUILDERS[name](batch, seed)
    frozen = [k for k in w if k.endswith((".bn.mean", ".bn.var"))]
    params = [k for k, v in w.items() if v.dtype == np.float32 and k not in frozen
              and not k.endswith(".scale")]
    return Family(name, model, feeds, w, params, name)
