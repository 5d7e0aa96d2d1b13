"""The fused CPU step's SoftmaxCrossEntropyLoss as ``com.trainops::SoftmaxCrossEntropy``.

onnxruntime runs ONNX's SoftmaxCrossEntropyLoss through its function body: a LogSoftmax
over the whole ``[N, C]`` scores, kept as a tensor, then the loss gathered from it. For a
language model's vocabulary that tensor is as large as the logits (201 MB for 49152 words
over 1024 tokens, in the step's peak memory) and its LogSoftmax took 89 ms of the
architecture bench's Llama step on one thread (x1.37 on two; 2026-11-28).
``SoftmaxCrossEntropy`` is the same loss (the same ``reduction`` and ``ignore_index``) on a
kernel that computes each row's log-sum-exp in place and spreads the rows over the
session's threads; the gradient already reads the scores, not the log-probabilities
(``SoftmaxCrossEntropyLossGrad``). :func:`cross_entropy_forward` swaps every node of the
common form over a vocabulary-sized class axis: two inputs (no class weights), float32
2-D scores of at least :data:`FROM_CLASSES` classes (known statically), int64 labels, and
no ``log_prob`` output read; others stay onnxruntime's. A classifier's few classes keep
onnxruntime's op, so that the training artifacts' ``eval.onnx`` (standard ops only) gives
the step's loss bit for bit there; with a vocabulary the two agree within both ops'
rounding bounds.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ..onnx_defs import TRAINOPS_DOMAIN


# Classes from which the loss runs on trainops' kernel: a language model's vocabulary
# (BERT's 30522, Llama's 32000-128256), where the log-probabilities cost memory and time.
FROM_CLASSES = 4096


def _takes(node, builder) -> bool:
    """True when ``node`` is a SoftmaxCrossEntropyLoss the kernel runs."""
    if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.input) != 2 or not all(node.input) or any(node.output[1:]):
        return False
    scores, labels = node.input
    return (builder.dtype(scores) == TensorProto.FLOAT and builder.dtype(labels) == TensorProto.INT64
            and builder.dtype(node.output[0]) in (TensorProto.FLOAT, None)
            and len(builder.shape(scores) or []) == 2
            and isinstance(builder.shape(scores)[1], int)
            and builder.shape(scores)[1] >= FROM_CLASSES)


def cross_entropy_forward(nodes: list, builder) -> list:
    """``nodes`` with every SoftmaxCrossEntropyLoss of the common form (see the module
    text) replaced by a ``com.trainops::SoftmaxCrossEntropy`` node of the same name,
    inputs, output, ``reduction`` and ``ignore_index``; types from ``builder``."""
    out = []
    for n in nodes:
        if not _takes(n, builder):
            out.append(n)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        kw = {"reduction": attrs.get("reduction", b"mean").decode()}
        if "ignore_index" in attrs:
            kw["ignore_index"] = int(attrs["ignore_index"])
        out.append(helper.make_node("SoftmaxCrossEntropy", list(n.input), [n.output[0]],
                                    name=n.name, domain=TRAINOPS_DOMAIN, **kw))
    return out
