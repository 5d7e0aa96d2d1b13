"""The fused CPU step's training-mode BatchNormalization as ``com.trainops::BatchNormTrain``.

onnxruntime's CPU kernel for BatchNormalization with ``training_mode=1`` runs on one
thread whatever ``intra_op_num_threads`` says: measured in the architecture bench's
profiles (2026-11-28), its share of resnet18's, efficientnet_b0's and mobilenet_v3_small's
step stayed the same milliseconds at 2 threads (x1.00-1.02) while the step around it
gained 1.3-1.7x. ``BatchNormTrain`` is the same op (same inputs, outputs, ``epsilon`` and
``momentum``, ONNX's biased batch variance in the running statistic) on a kernel that
spreads the channels over the session's threads, and its backward,
``BatchNormTrainGrad``, already is trainops'. :func:`batchnorm_forward` swaps every such
node whose tensors are all float32 (the kernel's type); others stay onnxruntime's.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ..onnx_defs import TRAINOPS_DOMAIN


def _training(node) -> bool:
    for a in node.attribute:
        if a.name == "training_mode":
            return bool(helper.get_attribute_value(a))
    return False


def _takes(node, builder) -> bool:
    """True when ``node`` is a training-mode BatchNormalization the kernel runs."""
    if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.input) != 5 or not all(node.input) or not _training(node):
        return False
    return all(builder.dtype(t) == TensorProto.FLOAT for t in list(node.input) + [node.output[0]])


def batchnorm_forward(nodes: list, builder) -> list:
    """``nodes`` with every training-mode BatchNormalization (see the module text)
    replaced by a ``com.trainops::BatchNormTrain`` node of the same name, inputs, outputs,
    ``epsilon`` and ``momentum``; types from ``builder`` (the forward graph's)."""
    out = []
    for n in nodes:
        if not _takes(n, builder):
            out.append(n)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        out.append(helper.make_node("BatchNormTrain", list(n.input), list(n.output), name=n.name,
                                    domain=TRAINOPS_DOMAIN, epsilon=float(attrs.get("epsilon", 1e-5)),
                                    momentum=float(attrs.get("momentum", 0.9))))
    return out
