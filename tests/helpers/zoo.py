"""The light ONNX zoo models shipped in the onnx wheel (``onnx/backend/test/data/light``),
with their placeholder weights filled.

Their weights are stored as ``ConstantOfShape(<name>__SHAPE)`` nodes (or as zero
initializers) and listed among the graph inputs, at opsets 7-9 and IR version 3: as the zoo
ships them. :func:`light_model` keeps all of that but the values: each weight becomes an
initializer (still listed as an input, as IR 3 requires) drawn at random for its role: He
initialisation for Conv/Gemm weights (the last layer scaled down so the softmax does not
saturate), small biases, BatchNorm and Caffe2-style scale layers near identity.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

LIGHT = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
         "shufflenet", "squeezenet", "vgg19", "zfnet512")


def light_path(name: str) -> str:
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"light_{name}.onnx")


def _consumers(g):
    out = {}
    for n in g.node:
        for k, i in enumerate(n.input):
            out.setdefault(i, []).append((n, k))
    return out


def logits_of(model: onnx.ModelProto) -> str:
    """The input of the model's final Softmax (the logits), else its output."""
    soft = [n for n in model.graph.node if n.op_type == "Softmax"]
    return soft[-1].input[0] if soft else model.graph.output[0].name


def _last_layer(g, logits: str) -> set[str]:
    """The weights of the Conv/Gemm nearest before the logits."""
    producer = {o: n for n in g.node for o in n.output}
    t = logits
    while t in producer:
        n = producer[t]
        if n.op_type in ("Conv", "Gemm"):
            out = set()
            for w in n.input[1:]:  # through views of the weight (inception_v1: a Reshape)
                while w in producer and producer[w].op_type in ("Reshape", "Transpose"):
                    w = producer[w].input[0]
                out.add(w)
            return out
        t = n.input[0]
    return set()


def light_model(name: str, seed: int = 0, last_scale: float = 0.1):
    """(model as shipped with random weights, logits tensor name, data input name, data
    input shape)."""
    m = onnx.load(light_path(name))
    g = m.graph
    rng = np.random.default_rng(seed)
    consumers = _consumers(g)
    inits = {i.name: i for i in g.initializer}
    # Weight name -> shape: the ConstantOfShape placeholders and the float initializers.
    shapes, drop_nodes = {}, []
    for n in g.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in inits:
            shapes[n.output[0]] = [int(d) for d in numpy_helper.to_array(inits[n.input[0]])]
            drop_nodes.append(n)
    for i in g.initializer:
        if i.data_type == TensorProto.FLOAT:
            shapes[i.name] = list(i.dims)
    logits = logits_of(m)
    last = _last_layer(g, logits)
    values = {}
    for w, shape in shapes.items():
        uses = [(n.op_type, k, n) for n, k in consumers.get(w, [])]
        op, k, node = uses[0] if uses else ("", 0, None)
        if op == "Unsqueeze":  # Caffe2 scale layers: Unsqueeze -> Mul (scale) / Add (bias)
            nxt = consumers.get(node.output[0], [(None, 0)])[0][0]
            op, k = ("Scale", 0) if nxt is not None and nxt.op_type == "Mul" else ("Bias", 0)
        if op in ("Conv", "Gemm") and k == 1:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            fan_in = int(np.prod(shape[1:])) if op == "Conv" or trans_b else shape[0]
            v = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
        elif op == "BatchNormalization" and k in (1, 4):  # scale, running variance
            v = 1.0 + 0.1 * rng.random(shape)
        elif op == "Scale":
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        else:  # biases, BatchNorm bias and running mean
            v = 0.05 * rng.standard_normal(shape)
        if w in last:
            v = v * last_scale
        values[w] = v.astype(np.float32)
    for n in drop_nodes:
        g.node.remove(n)
    used = {i for n in g.node for i in n.input}
    keep_inits = [i for i in g.initializer if i.name in used and i.name not in values]
    del g.initializer[:]
    g.initializer.extend(keep_inits)
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in values.items())
    inputs = [i for i in g.input if i.name in used or i.name in values]
    listed = {i.name for i in inputs}
    inputs += [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
               for k, v in values.items() if k not in listed]
    del g.input[:]
    g.input.extend(inputs)
    data = [i for i in g.input if i.name not in values and i.name not in
            {x.name for x in g.initializer}]
    assert len(data) == 1, [i.name for i in data]
    shape = [d.dim_value for d in data[0].type.tensor_type.shape.dim]
    return m, logits, data[0].name, shape
