"""The second half of :func:`.params.default_params`: from the initializers an op reads as
weights, leave out what torch does not train (:func:`not_torch_params`), and warn where
the export itself no longer holds torch's parameters (:func:`warn_unfaithful`).

Left out (said in one ``logging.getLogger("trainops")`` line):

- what torch's dynamo exporter recorded as a BUFFER or a CONSTANT_TENSOR;
- an additive attention mask (zeros and huge negatives) an exporter folded;
- a frozen sine/cosine table (Whisper's encoder positions, rotary cos/sin folded);
- where no exporter recorded kinds, a zero ``[1, ..., 1, N]`` tensor added to a layer's
  output: a buffer such as BART's ``final_logits_bias`` (torch's Linear bias is ``[N]``).

Warned (UserWarning, one per kind, naming the tensors), each pointing to
``trainops.torch.export``, which exports with what these checks lack:

- a constant tensor (all elements equal: fresh zeros or ones) read at two or more weight
  positions of one kind (two LayerNorm scales, two biases): exporters merge identical
  initializers, so torch's separate parameters train as one. A tensor read by Gather and
  by MatMul is an embedding tied to the LM head, a real tie: no warning;
- a trained tensor of rank >= 3 whose leading dimension is a data input's batch size, read
  elementwise only: a class token or position table the exporter expanded to the batch;
- a Conv whose metadata says it was a BatchNorm (folded by the exporter's optimizer): its
  bias trains in place of the BatchNorm's scale, shift and running statistics.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import numpy as np

import onnx
from onnx import numpy_helper

from ..offload import is_offloaded
from .exported import is_mask, sinusoid_tables, torch_kinds

__all__ = ["not_torch_params", "warn_unfaithful"]

log = logging.getLogger("trainops")

BRIDGE = ("export the module with trainops.torch.export, which keeps torch's parameters "
          "and buffers apart")
# Gather-read tables larger than this are word embeddings, never checked for sinusoids
# (reading them would copy the whole table).
TABLE_LIMIT = 1 << 23


def _value_read(uses) -> bool:
    """Read elementwise or looked up only (a bias, a table, a mask)."""
    return all(k == -1 or op in ("Gather", "GatherND") for op, k, _ in uses)


def not_torch_params(graph: onnx.GraphProto, inits: dict, uses: dict) -> set[str]:
    """The names in ``uses`` (initializer -> its weight reads) that torch would train."""
    kinds = torch_kinds(graph)
    keep = {s for s in uses if kinds.get(s) not in ("BUFFER", "CONSTANT_TENSOR")}
    values = {}
    for s in keep:
        size = int(np.prod(inits[s].dims, dtype=np.int64))
        if not is_offloaded(inits[s]) and _value_read(uses[s]) and (size <= TABLE_LIMIT
                                     or all(k == -1 for _, k, _ in uses[s])):
            values[s] = numpy_helper.to_array(inits[s])
    masks = {s for s, v in values.items() if all(k == -1 for _, k, _ in uses[s])
             and is_mask(v)}
    tables = sinusoid_tables(values)
    buffers = {s for s, v in values.items()
               if s not in kinds and v.ndim >= 2 and all(d == 1 for d in v.shape[:-1])
               and not v.any() and all(op == "Add" and after for op, _, after in uses[s])}
    left = [(what, sorted(names)) for what, names in
            (("BUFFER/CONSTANT_TENSOR per the exporter", set(uses) - keep),
             ("attention masks", masks), ("sine/cosine tables", tables),
             ("zero [1, N] biases added to a layer (buffers)", buffers)) if names]
    if left:
        log.info("default parameters leave out %s", "; ".join(
            f"{what}: {', '.join(names)}" for what, names in left))
    return keep - masks - tables - buffers


def _batch_sizes(graph: onnx.GraphProto) -> set[int]:
    inits = {i.name for i in graph.initializer}
    out = set()
    for i in graph.input:
        dims = i.type.tensor_type.shape.dim
        if i.name not in inits and dims and dims[0].HasField("dim_value") \
                and dims[0].dim_value > 1:
            out.add(dims[0].dim_value)
    return out


def _folded_batchnorm(graph: onnx.GraphProto) -> list[str]:
    """Conv nodes whose exporter metadata names a BatchNorm, with no BatchNormalization
    reading them."""
    bn_in = {n.input[0] for n in graph.node if n.op_type == "BatchNormalization" and n.input}
    out = []
    for n in graph.node:
        if n.op_type not in ("Conv", "ConvTranspose") or any(o in bn_in for o in n.output):
            continue
        text = " ".join(p.value for p in getattr(n, "metadata_props", ()))
        if "BatchNorm" in text or "batch_norm" in text:
            out.append(n.name or n.output[0])
    return out


def warn_unfaithful(model: onnx.ModelProto, chosen: list[str], inits: dict,
                    uses: dict) -> None:
    """Warn (see the module) about ``chosen`` where the export lost torch's parameters."""
    g = model.graph
    merged = []
    for s in chosen:
        counts = Counter((op, k) for op, k, _ in uses.get(s, ()))
        twice = sorted(f"{op}[{k}]" if k >= 0 else op for (op, k), c in counts.items()
                       if c >= 2)
        if not twice or is_offloaded(inits[s]):
            continue
        v = numpy_helper.to_array(inits[s])
        if v.size > 1 and np.all(v == v.reshape(-1)[0]):
            merged.append(f"{s} ({' '.join(twice)}, {sum(counts.values())} reads)")
    if merged:
        warnings.warn(
            "default parameters: the exporter merged identical initializers, so separate "
            f"torch parameters would train as one tensor: {'; '.join(merged)}; {BRIDGE}, "
            "or name the parameters with params=", UserWarning, stacklevel=3)
    batch = _batch_sizes(g)
    folded = [s for s in chosen if len(inits[s].dims) >= 3 and inits[s].dims[0] in batch
              and all(k == -1 for _, k, _ in uses.get(s, ()))]
    if folded:
        warnings.warn(
            f"default parameters: {', '.join(folded)}: a leading dimension equal to the "
            "batch size of a data input: a class token or position table the exporter "
            "expanded to the batch (each sample's copy would train apart, and the model "
            f"only runs at this batch size); {BRIDGE}", UserWarning, stacklevel=3)
    convs = _folded_batchnorm(g)
    if convs:
        warnings.warn(
            f"default parameters: Conv nodes {', '.join(convs)} hold a BatchNorm the "
            "exporter folded into their weights and bias: training them trains no "
            f"BatchNorm scale, shift or running statistics; {BRIDGE}", UserWarning,
            stacklevel=3)
