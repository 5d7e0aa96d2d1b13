"""The LoRA graph rewrite (:func:`inject`) and its record in the model (:func:`read`,
:func:`strip`).

For a targeted node ``y = MatMul(x, W)`` / ``Gemm(x, W, b)`` (``W`` a float initializer,
directly or through ``Transpose(perm=[1, 0])``, as the classic torch exporter writes
``MatMul(x, Transpose(W))`` in training mode) the node's output is renamed
``trainops/lora/<y>/base`` and these nodes are inserted after it::

    x' = Dropout(x, ratio)                      # only with dropout > 0
    d  = MatMul(MatMul(x', Transpose(A)), Transpose(B))
    y  = Add(base, Mul(d, alpha / rank))

with ``A = <W>.lora_A`` ``[rank, in_features]`` and ``B = <W>.lora_B``
``[out_features, rank]`` (PEFT's orientation, whatever ``W``'s), A drawn as PEFT's
Kaiming-uniform (``a = sqrt(5)``: ``uniform(-1/sqrt(in), 1/sqrt(in))``) from the seed and
``W``'s name, B zeros: at initialisation the model computes what it did. A weight shared
by several targeted nodes has one adapter. The record (metadata key :data:`KEY`, JSON)::

    {"rank": r, "alpha": a, "targets": [...], "dropout": p,
     "adapters": {W: {"in": n, "out": m, "transposed": bool, "outputs": [y, ...]}}}

``transposed``: ``W`` is stored ``[out, in]`` as torch holds it.
"""

from __future__ import annotations

import json
import zlib

import numpy as np

import onnx
from onnx import helper, numpy_helper

from .spec import LoRA

__all__ = ["KEY", "PREFIX", "adapter_names", "inject", "read", "strip"]

KEY = "trainops.lora"
PREFIX = "trainops/lora/"
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
           onnx.TensorProto.BFLOAT16)


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _sites(graph: onnx.GraphProto, lora: LoRA):
    """``[(node index, W, in, out, transposed)]`` of every node a target matches; ValueError
    naming the targets that match none."""
    inits = {i.name: i for i in graph.initializer}
    transposes = {n.output[0]: n for n in graph.node if n.op_type == "Transpose"
                  and n.domain in ("", "ai.onnx") and list(_attr(n, "perm", [1, 0])) == [1, 0]
                  and len(n.input) == 1 and n.input[0] in inits}
    sites, used = [], set()
    for k, n in enumerate(graph.node):
        if n.op_type not in ("MatMul", "Gemm") or n.domain not in ("", "ai.onnx") or \
                len(n.input) < 2:
            continue
        w, flip = n.input[1], False
        if w in transposes:
            w, flip = transposes[w].input[0], True
        init = inits.get(w)
        if init is None or init.data_type not in _FLOATS or len(init.dims) != 2:
            continue
        hit = [t for t in lora.targets if t in n.name or t in w]
        if not hit:
            continue
        used.update(hit)
        if n.op_type == "Gemm" and _attr(n, "transB", 0):
            flip = not flip
        rows, cols = int(init.dims[0]), int(init.dims[1])
        # ONNX computes x @ W' with W' = W (flip False) or W^T (flip True): W' is [in, out].
        fan_in, fan_out = (cols, rows) if flip else (rows, cols)
        sites.append((k, w, fan_in, fan_out, flip))
    missing = [t for t in lora.targets if t not in used]
    if missing:
        raise ValueError(f"LoRA: targets {missing} match no MatMul/Gemm node (by its name or "
                         "its weight initializer's) whose weight is a 2-D float initializer")
    return sites


def initial_a(seed: int, weight: str, rank: int, fan_in: int, dtype) -> np.ndarray:
    """A's initial value for ``weight``: PEFT's Kaiming-uniform (``a = sqrt(5)``), drawn
    from ``numpy.random.default_rng([seed, crc32(weight)])``: the same seed, the same A."""
    rng = np.random.default_rng([int(seed) & (2**64 - 1), zlib.crc32(weight.encode())])
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, (rank, fan_in)).astype(dtype)


def inject(model: onnx.ModelProto, lora: LoRA, seed: int) -> onnx.ModelProto:
    """A copy of ``model`` with the adapters of ``lora`` (see the module) and its record."""
    if read(model) is not None:
        raise ValueError("LoRA: the model already carries LoRA adapters (metadata "
                         f"{KEY!r}); train it without lora= to continue them")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    sites = _sites(g, lora)
    inits = {i.name: i for i in g.initializer}
    taken = set(inits) | {o for n in g.node for o in n.output} | {i.name for i in g.input}
    adapters: dict[str, dict] = {}
    extra: dict[int, list] = {}
    opset = max([o.version for o in m.opset_import if o.domain in ("", "ai.onnx")] or [13])
    for k, w, fan_in, fan_out, flip in sites:
        n = g.node[k]
        wt = inits[w].data_type
        npt = helper.tensor_dtype_to_np_dtype(wt)
        a_name, b_name = f"{w}.lora_A", f"{w}.lora_B"
        if w not in adapters:
            clash = [x for x in (a_name, b_name) if x in taken]
            if clash:
                raise ValueError(f"LoRA: the adapter names {clash} are taken in the model")
            adapters[w] = {"in": fan_in, "out": fan_out, "transposed": flip, "outputs": []}
            g.initializer.extend([
                numpy_helper.from_array(initial_a(seed, w, lora.rank, fan_in, npt), a_name),
                numpy_helper.from_array(np.zeros((fan_out, lora.rank), npt), b_name)])
            scale = f"{PREFIX}scale/{np.dtype(npt).name}"
            if scale not in taken:
                g.initializer.append(numpy_helper.from_array(np.array(lora.scale, npt), scale))
                taken.add(scale)
        y = n.output[0]
        adapters[w]["outputs"].append(y)
        p = f"{PREFIX}{y}/"
        n.output[0] = f"{p}base"
        x, nodes = n.input[0], []
        if n.op_type == "Gemm" and _attr(n, "transA", 0):
            nodes.append(helper.make_node("Transpose", [x], [f"{p}x"], name=f"{p}x", perm=[1, 0]))
            x = f"{p}x"
        if lora.dropout > 0:
            ratio = f"{PREFIX}dropout_ratio"
            if ratio not in taken:
                g.initializer.append(numpy_helper.from_array(np.array(lora.dropout, np.float32),
                                                             ratio))
                taken.add(ratio)
            ins = [x, ratio] if opset >= 12 else [x]
            kw = {} if opset >= 12 else {"ratio": lora.dropout}
            nodes.append(helper.make_node("Dropout", ins, [f"{p}dropout"], name=f"{p}dropout",
                                          **kw))
            x = f"{p}dropout"
        nodes += [
            helper.make_node("Transpose", [a_name], [f"{p}A_T"], name=f"{p}A_T", perm=[1, 0]),
            helper.make_node("MatMul", [x, f"{p}A_T"], [f"{p}xA"], name=f"{p}xA"),
            helper.make_node("Transpose", [b_name], [f"{p}B_T"], name=f"{p}B_T", perm=[1, 0]),
            helper.make_node("MatMul", [f"{p}xA", f"{p}B_T"], [f"{p}xAB"], name=f"{p}xAB"),
            helper.make_node("Mul", [f"{p}xAB", f"{PREFIX}scale/{np.dtype(npt).name}"],
                             [f"{p}delta"], name=f"{p}delta"),
            helper.make_node("Add", [f"{p}base", f"{p}delta"], [y], name=f"{p}add")]
        extra[k] = nodes
    order = []
    for k, n in enumerate(g.node):
        order.append(n)
        order.extend(extra.get(k, []))
    new = [onnx.NodeProto() for _ in order]
    for dst, src in zip(new, order):
        dst.CopyFrom(src)
    del g.node[:]
    g.node.extend(new)
    record = {**lora.to_dict(), "adapters": adapters}
    m.metadata_props.append(onnx.StringStringEntryProto(key=KEY, value=json.dumps(record)))
    return m


def read(model: onnx.ModelProto) -> dict | None:
    """The LoRA record of ``model`` (see the module), or None when it has none."""
    found = [p.value for p in model.metadata_props if p.key == KEY]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"model metadata {KEY!r}: {len(found)} entries, expected one")
    try:
        rec = json.loads(found[0])
        LoRA.from_dict(rec)
        if not isinstance(rec["adapters"], dict):
            raise TypeError("'adapters' is not an object")
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"model metadata {KEY!r} is malformed: {exc}") from None
    return rec


def adapter_names(record: dict) -> list[str]:
    """The adapter tensors of ``record``, ``<W>.lora_A``, ``<W>.lora_B`` per weight."""
    return [f"{w}.lora_{k}" for w in record["adapters"] for k in "AB"]


def adapter_shapes(record: dict) -> dict[str, tuple[int, int]]:
    """Each adapter tensor's shape: A ``[rank, in]``, B ``[out, rank]``."""
    r = record["rank"]
    out = {}
    for w, a in record["adapters"].items():
        out[f"{w}.lora_A"] = (r, a["in"])
        out[f"{w}.lora_B"] = (a["out"], r)
    return out


def strip(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without its adapters: the inserted nodes removed, each targeted
    node writing its output again, the adapter and LoRA initializers and record dropped."""
    record = read(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    keep = [n for n in g.node if not n.name.startswith(PREFIX)]
    for n in keep:
        for i, o in enumerate(n.output):
            if o.startswith(PREFIX) and o.endswith("/base"):
                n.output[i] = o[len(PREFIX):-len("/base")]
    del g.node[:]
    g.node.extend(keep)
    drop = set(adapter_names(record)) if record else set()
    inits = [i for i in g.initializer if i.name not in drop and not i.name.startswith(PREFIX)]
    del g.initializer[:]
    g.initializer.extend(inits)
    vis = [v for v in g.value_info if not v.name.startswith(PREFIX)]
    del g.value_info[:]
    g.value_info.extend(vis)
    props = [p for p in m.metadata_props if p.key != KEY]
    del m.metadata_props[:]
    m.metadata_props.extend(props)
    return m
