"""A device-resident state that host nodes also read, bound under a second input name.

ONNX Runtime's IOBinding copies an input, when it is bound, to the device of the first node
that reads it, and every node reading it then gets that copy. A step on the plugin EP
``TrainopsExecutionProvider`` runs its optimizer (and random ops) on the GPU and the forward
and backward passes on the CPU, so a weight is read by both: measured on an NVIDIA H200 with
onnxruntime 1.30, the EP's Adam was handed the weight's host copy (and refused it: "input 2
(X): expected a buffer in the CUDA device's memory, got host memory").

:func:`split_host_reads` gives such a state's host readers an input of their own,
``<state>/host``, which the runtime binds to the same device value: bound, it is copied to
the host for them (the values before the step's update, as they read them), and the EP's
nodes read the device buffer itself.
"""

from __future__ import annotations

from typing import Sequence

import onnx

__all__ = ["DEVICE_OPS", "HOST_SUFFIX", "split_host_reads"]

HOST_SUFFIX = "/host"

# The nodes the plugin EP runs on its device, and the inputs it takes in host memory (as
# the library's catalogue declares them: crates/trainops-ort/src/ops/mod.rs, device_support).
DEVICE_OPS: dict[tuple[str, str], frozenset[int]] = {
    ("ai.onnx.preview.training", "Adam"): frozenset({0, 1}),
    ("ai.onnx.preview.training", "Adagrad"): frozenset({0, 1}),
    ("ai.onnx.preview.training", "Momentum"): frozenset({0, 1}),
    ("com.trainops", "AdamW"): frozenset({0, 1}),
    ("com.trainops", "MixedPrecisionAdam"): frozenset({0, 1}),
    ("com.trainops", "Philox"): frozenset({0, 1}),
    ("com.trainops", "PhiloxDropout"): frozenset({1, 2, 3}),
    ("com.trainops", "PhiloxUniform"): frozenset({0, 1}),
    ("com.trainops", "PhiloxNormal"): frozenset({0, 1}),
    ("com.trainops", "AllFinite"): frozenset(),
    ("com.trainops", "DynamicLossScale"): frozenset(),
}


def _reads_on_device(node: onnx.NodeProto, index: int) -> bool:
    host = DEVICE_OPS.get((node.domain or "", node.op_type))
    return host is not None and index not in host


def split_host_reads(model: onnx.ModelProto,
                     states: Sequence[str]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``model`` (a copy where anything changes) in which every state of ``states`` that is
    read both on the device (an input of a :data:`DEVICE_OPS` node the EP takes in device
    memory) and elsewhere is read elsewhere as ``<state>/host``, a new graph input of the
    state's type; and ``{alias: state}`` for the runtime to bind. A state read only on one
    side is left alone."""
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    wanted = set(states)
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in wanted:
                readers.setdefault(name, []).append((node, k))
    split = [s for s in states
             if any(_reads_on_device(n, k) for n, k in readers.get(s, ()))
             and not all(_reads_on_device(n, k) for n, k in readers.get(s, ()))]
    if not split:
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inputs = {vi.name: vi for vi in out.graph.input}
    taken = {vi.name for vi in out.graph.input} | {o for n in out.graph.node for o in n.output}
    aliases: dict[str, str] = {}
    for s in split:
        alias = s + HOST_SUFFIX
        if alias in taken or s not in inputs:
            continue  # (a name already used, or a state that is no graph input: left as is)
        aliases[alias] = s
        vi = out.graph.input.add()
        vi.CopyFrom(inputs[s])
        vi.name = alias
    for node in out.graph.node:
        for k, name in enumerate(node.input):
            if aliases.get(name + HOST_SUFFIX) == name and not _reads_on_device(node, k):
                node.input[k] = name + HOST_SUFFIX
    return out, aliases
