"""The fused CPU step's forward depthwise convolutions as ``com.trainops::DepthwiseConv``.

A ``Conv`` with one input channel per group (``W`` of shape ``[M, 1, kh, kw]``, ``group``
> 1, 2-d, float32) runs in onnxruntime's grouped path: measured 1.7-4.9x slower than the
trainops kernel on every depthwise shape of mobilenet_v3_small, efficientnet_b0 and
ConvNeXt, 3x3 included (docs/ops/gradients-depthwise.md). The Conv rule already emits ``DepthwiseConvGrad`` for
its gradients in that mode; :func:`depthwise_forward` swaps the forward node too, same
inputs, outputs and name, attributes resolved (explicit pads). A node with ``auto_pad``
``SAME_*``, or whose shapes onnx could not infer, stays a ``Conv``.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ..onnx_defs import TRAINOPS_DOMAIN


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _resolved(node, builder) -> dict | None:
    """``DepthwiseConv``'s attributes for ``node``, or None when it is no depthwise
    convolution the kernel takes."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    x, w = node.input[0], node.input[1]
    xs, ws = builder.shape(x), builder.shape(w)
    if (xs is None or ws is None or len(xs) != 4 or len(ws) != 4
            or not all(isinstance(d, int) for d in list(xs[1:]) + list(ws))):
        return None
    if any(builder.dtype(t) != TensorProto.FLOAT for t in node.input if t):
        return None
    a = _attrs(node)
    group = int(a.get("group", 1))
    if group <= 1 or ws[1] != 1 or xs[1] != group:
        return None
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "VALID"):
        return None
    pads = list(a.get("pads", [0] * 4)) if auto == "NOTSET" else [0] * 4
    return dict(kernel_shape=list(a.get("kernel_shape", ws[2:])), strides=list(a.get("strides", [1, 1])),
                dilations=list(a.get("dilations", [1, 1])), pads=pads, group=group)


def depthwise_forward(nodes: list, builder) -> list:
    """``nodes`` with every depthwise ``Conv`` (see the module text) replaced by a
    ``com.trainops::DepthwiseConv`` node of the same name, inputs and output; shapes and
    types from ``builder`` (the forward graph's, as the rules see them)."""
    out = []
    for n in nodes:
        attrs = _resolved(n, builder)
        if attrs is None:
            out.append(n)
            continue
        out.append(helper.make_node("DepthwiseConv", list(n.input), list(n.output), name=n.name,
                                    domain=TRAINOPS_DOMAIN, **attrs))
    return out
