"""The frozen base of a LoRA model held block-quantised (``Trainer(base_dtype="int8" |
"int4")``): :func:`quantize` rewrites the model before the Trainer builds its step, so the
session holds only the quantised weights; :func:`dequantize` gives the float32 model back
(``export``); :func:`frozen_bytes` counts what ``Trainer.memory()`` reports.

What is quantised: every 2-D float32 initializer that is only the weight (input B) of
MatMul / Gemm nodes, directly or through ``Transpose(perm=[1, 0])``, and is no adapter.
Embedding tables (Gather data, a tied lm_head included), biases, norms and any other
frozen tensor stay float32.

Format: ``W`` seen as ``[out, in]``; each row cut along ``in`` into ``nb = ceil(in / 128)``
blocks of equal size ``bs = ceil(in / nb)`` (at most 128; the last block padded with
zeros, fewer than ``nb`` pad elements per row); per block a float32 scale
``absmax / qmax`` (``qmax`` 127 for int8, 7 for int4: symmetric, no zero point) and
``q = clamp(round_half_even(w / scale), -qmax, qmax)`` (in float64; a block of zeros has
scale 0 and q 0). Stored ``[out * nb, bs]`` rows (out-major): int8 as an INT8 initializer,
int4 as nibbles ``q + 8`` packed two per UINT8 (element ``2k`` low, ``2k + 1`` high; a row
of odd ``bs`` padded by one), i.e. half a byte per element. Scales: ``[out * nb, 1]``
float32.

The dequantisation is standard ops (opset >= 13), ``DequantizeLinear`` first: int8
``DequantizeLinear(q, 1.0)``; int4 ``DequantizeLinear(packed, 1/16, 136)`` and the
nibbles split with ``Round`` / ``Sub`` / ``Mul`` and interleaved (:func:`_dequant_nodes`);
then ``* scale`` per row, Reshape to ``[out, nb * bs]``, a Slice to ``in`` where the last
block is padded, and a Transpose where ``W`` is stored ``[in, out]``. Each value is
``float32(q) * scale``, one rounding: numpy's ``q.astype(float32) * scale`` bit for bit.
onnxruntime's constant folding leaves ``DequantizeLinear`` alone (it keeps QDQ graphs), so
nothing after it is folded back into a float32 initializer.
"""

from __future__ import annotations

import json

import numpy as np

import onnx
from onnx import helper, numpy_helper

from .. import offload as _offload

__all__ = ["BLOCK", "KEY", "PREFIX", "blocks", "dequantize", "dequantized", "frozen_bytes",
           "quantize", "quantize_array", "read"]

KEY = "trainops.lora.base"
PREFIX = "trainops/base/"
BLOCK = 128
QMAX = {"int8": 127, "int4": 7}


def blocks(n: int) -> tuple[int, int]:
    """``(nb, bs)``: ``n`` input features in ``nb`` blocks of ``bs <= BLOCK`` elements."""
    nb = -(-n // BLOCK)
    return nb, -(-n // nb)


def quantize_array(w: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(q [out * nb, bs] int8, scale [out * nb] float32)`` of ``w`` ``[out, in]``
    (unpacked; see the module)."""
    out, n = w.shape
    nb, bs = blocks(n)
    x = np.zeros((out, nb * bs), np.float64)
    x[:, :n] = w
    x = x.reshape(out * nb, bs)
    scale = (np.abs(x).max(axis=1) / QMAX[dtype]).astype(np.float32)
    s = scale.astype(np.float64)[:, None]
    q = np.rint(np.divide(x, s, out=np.zeros_like(x), where=s > 0))
    return np.clip(q, -QMAX[dtype], QMAX[dtype]).astype(np.int8), scale


def pack_int4(q: np.ndarray) -> np.ndarray:
    """``q`` ``[rows, bs]`` in [-7, 7] as nibbles ``q + 8``, two per byte (``[rows,
    ceil(bs / 2)]`` uint8)."""
    nib = (q.astype(np.int16) + 8).astype(np.uint8)
    if nib.shape[1] % 2:
        nib = np.concatenate([nib, np.full((nib.shape[0], 1), 8, np.uint8)], axis=1)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(p: np.ndarray, bs: int) -> np.ndarray:
    """:func:`pack_int4`'s inverse: ``[rows, bs]`` int8."""
    nib = np.stack([p & 15, p >> 4], axis=-1).reshape(p.shape[0], -1)[:, :bs]
    return (nib.astype(np.int16) - 8).astype(np.int8)


def _consumers(g: onnx.GraphProto) -> dict[str, list]:
    uses: dict[str, list] = {}
    for n in g.node:
        for i, x in enumerate(n.input):
            uses.setdefault(x, []).append((n, i))
    return uses


def _targets(g: onnx.GraphProto, skip: set) -> dict[str, bool]:
    """``{W: transposed}`` of the weights to quantise (see the module); ``transposed``: W
    is stored ``[out, in]``."""
    uses = _consumers(g)
    outside = {v.name for v in list(g.input) + list(g.output)}
    found: dict[str, bool] = {}
    for init in g.initializer:
        w = init.name
        if init.data_type != onnx.TensorProto.FLOAT or len(init.dims) != 2 or w in skip \
                or w in outside or not uses.get(w):
            continue
        kinds = set()
        for n, i in uses[w]:
            flip = False
            if n.op_type == "Transpose" and n.domain in ("", "ai.onnx") and i == 0 and \
                    [int(p) for p in _attr(n, "perm", [1, 0])] == [1, 0] and \
                    n.output[0] not in outside and uses.get(n.output[0]):
                flip, sites = True, uses[n.output[0]]
            else:
                sites = [(n, i)]
            for m, j in sites:
                if m.op_type not in ("MatMul", "Gemm") or m.domain not in ("", "ai.onnx") \
                        or j != 1:
                    kinds.add(None)
                else:
                    kinds.add(flip != bool(m.op_type == "Gemm" and _attr(m, "transB", 0)))
        if len(kinds) == 1 and None not in kinds:
            found[w] = kinds.pop()
    return found


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _dequant_nodes(w, dtype, scale, width, out, n, nb, bs, transposed):
    """``(initializers, nodes)`` computing ``w`` from ``<PREFIX><w>/q`` (``width``
    columns) and its scales. int4: ``u = DequantizeLinear(packed, 1/16, 136)`` is
    ``hi + lo / 16`` with ``lo``, ``hi`` the two values in [-7, 7] (``((lo + 8) + 16 (hi
    + 8) - 136) / 16``, exact), so ``hi = Round(u)`` (``|lo / 16| < 1/2``: no tie) and
    ``lo = (u - hi) * 16``, exact; interleaved, then ``* scale``, one rounding."""
    p = f"{PREFIX}{w}/"
    rows = out * nb
    c = lambda v, name: numpy_helper.from_array(np.array(v, np.int64), f"{p}{name}")  # noqa: E731
    inits = [numpy_helper.from_array(scale.reshape(-1, 1), f"{p}scale_col")]
    if dtype == "int8":  # not DequantizeLinear(q, scale, axis=0) straight into Reshape:
        # onnxruntime 1.17's QDQ propagation moves such a pair past Reshape / Transpose and
        # fails on int8 per-axis ("expected tensor(uint8)"); a Mul stops it
        nodes = [helper.make_node("DequantizeLinear", [f"{p}q", f"{PREFIX}one"], [f"{p}int"],
                                  name=f"{p}dq"),
                 helper.make_node("Mul", [f"{p}int", f"{p}scale_col"], [f"{p}rows"],
                                  name=f"{p}rows")]
    else:
        inits += [c([rows, width, 1], "pair_shape"), c([rows, 2 * width], "row_shape")]
        nodes = [
            helper.make_node("DequantizeLinear", [f"{p}q", f"{PREFIX}1/16", f"{PREFIX}136"],
                             [f"{p}u"], name=f"{p}dq"),
            helper.make_node("Round", [f"{p}u"], [f"{p}hi"], name=f"{p}hi"),
            helper.make_node("Sub", [f"{p}u", f"{p}hi"], [f"{p}lo16"], name=f"{p}lo16"),
            helper.make_node("Mul", [f"{p}lo16", f"{PREFIX}16"], [f"{p}lo"], name=f"{p}lo"),
            helper.make_node("Reshape", [f"{p}lo", f"{p}pair_shape"], [f"{p}lo3"],
                             name=f"{p}lo3"),
            helper.make_node("Reshape", [f"{p}hi", f"{p}pair_shape"], [f"{p}hi3"],
                             name=f"{p}hi3"),
            helper.make_node("Concat", [f"{p}lo3", f"{p}hi3"], [f"{p}pairs"],
                             name=f"{p}pairs", axis=2),
            helper.make_node("Reshape", [f"{p}pairs", f"{p}row_shape"], [f"{p}nib"],
                             name=f"{p}interleave")]
        q = f"{p}nib"
        if 2 * width != bs:  # an odd block: its pad nibble dropped
            inits.append(c([bs], "bs"))
            nodes.append(helper.make_node("Slice", [q, f"{PREFIX}0", f"{p}bs", f"{PREFIX}1"],
                                          [f"{p}nib_bs"], name=f"{p}nib_bs"))
            q = f"{p}nib_bs"
        nodes.append(helper.make_node("Mul", [q, f"{p}scale_col"], [f"{p}rows"],
                                      name=f"{p}rows"))
    oi = w if transposed else f"{p}oi"
    full = f"{p}padded" if nb * bs != n else oi
    inits.append(c([out, nb * bs], "shape"))
    nodes.append(helper.make_node("Reshape", [f"{p}rows", f"{p}shape"], [full],
                                  name=f"{p}reshape"))
    if full != oi:  # the last block's zero padding dropped
        inits.append(c([n], "in"))
        nodes.append(helper.make_node("Slice", [full, f"{PREFIX}0", f"{p}in", f"{PREFIX}1"],
                                      [oi], name=f"{p}slice"))
    if not transposed:
        nodes.append(helper.make_node("Transpose", [oi], [w], name=f"{p}T", perm=[1, 0]))
    return inits, nodes


def quantize(model: onnx.ModelProto, dtype: str, skip, store=None) -> onnx.ModelProto:
    """A copy of ``model`` with its frozen MatMul / Gemm weights (not those in ``skip``,
    the adapters) held as ``dtype`` (see the module), the record under metadata
    :data:`KEY`. ``store``: the :class:`trainops.offload.FrozenStore` of a model whose
    weights are held outside it: each quantised weight's data goes there too (a stub in
    the model) and the float32 weight leaves it."""
    opset = max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [0])
    if opset < 13:
        raise ValueError(f"Trainer: base_dtype {dtype!r}: the model's opset {opset} has no "
                         "per-axis DequantizeLinear; expected opset >= 13")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    targets = _targets(g, set(skip))
    inits = {i.name: i for i in g.initializer}
    record = {"dtype": dtype, "block": BLOCK, "weights": {}}
    nodes, new = [], []
    for w, transposed in targets.items():
        a = _offload.value(inits[w], store)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"Trainer: base_dtype {dtype!r}: the weight {w!r} has "
                             "non-finite values, which a block scale cannot hold")
        wt = a if transposed else a.T
        out, n = wt.shape
        nb, bs = blocks(n)
        q, scale = quantize_array(wt, dtype)
        p = f"{PREFIX}{w}/"
        data = q if dtype == "int8" else pack_int4(q)
        if store is not None and _offload.is_offloaded(inits[w]):
            store.session_copies = False  # a quantised base: memory first
            new.append(store.put(f"{p}q", data))
            del store[w], a  # the float32 weight is no longer held
        else:
            new.append(numpy_helper.from_array(data, f"{p}q"))
        more, chain = _dequant_nodes(w, dtype, scale, data.shape[1], out, n, nb, bs,
                                     transposed)
        new += more
        nodes += chain
        record["weights"][w] = {"shape": [int(d) for d in inits[w].dims],
                                "transposed": transposed, "blocks": nb, "block": bs}
    shared = (("0", [0], np.int64), ("1", [1], np.int64))
    shared += ((("1/16", 0.0625, np.float32), ("136", 136, np.uint8), ("16", 16.0, np.float32))
               if dtype == "int4" else (("one", 1.0, np.float32),))
    if targets:
        new += [numpy_helper.from_array(np.array(v, t), f"{PREFIX}{k}") for k, v, t in shared]
    keep = [i for i in g.initializer if i.name not in targets]
    del g.initializer[:]
    g.initializer.extend(keep + new)
    order = nodes + list(g.node)
    del g.node[:]
    g.node.extend(order)
    m.metadata_props.append(onnx.StringStringEntryProto(key=KEY, value=json.dumps(record)))
    return m


def read(model: onnx.ModelProto) -> dict | None:
    """The quantised base's record of ``model`` (see :func:`quantize`), or None."""
    found = [p.value for p in model.metadata_props if p.key == KEY]
    if len(found) > 1:
        raise ValueError(f"model metadata {KEY!r}: {len(found)} entries, expected one")
    return json.loads(found[0]) if found else None


def dequantized(record: dict, w: str, inits: dict, store=None) -> np.ndarray:
    """The float32 value ``W`` of the quantised weight ``w`` (``inits``: name ->
    TensorProto; ``store``: where a held-outside tensor's values are), as the graph
    computes it."""
    e = record["weights"][w]
    p = f"{PREFIX}{w}/"
    data = _offload.value(inits[f"{p}q"], store)
    q = data if record["dtype"] == "int8" else unpack_int4(data, e["block"])
    scale = numpy_helper.to_array(inits[f"{p}scale_col"]).reshape(-1)
    rows = q.astype(np.float32) * scale[:, None]
    out, n = (e["shape"] if e["transposed"] else e["shape"][::-1])
    wt = rows.reshape(out, -1)[:, :n]
    return np.ascontiguousarray(wt if e["transposed"] else wt.T)


def dequantize(model: onnx.ModelProto, store=None) -> onnx.ModelProto:
    """A copy of ``model`` with its quantised weights float32 initializers again (their
    dequantised values), the dequantisation nodes and the record removed (``store``: a
    :class:`trainops.offload.FrozenStore` holding the quantised data of its stubs)."""
    record = read(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if record is None:
        return m
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    weights = [numpy_helper.from_array(dequantized(record, w, inits, store), w)
               for w in record["weights"]]
    keep = [n for n in g.node if not n.name.startswith(PREFIX)]
    del g.node[:]
    g.node.extend(keep)
    rest = [i for i in g.initializer if not i.name.startswith(PREFIX)]
    del g.initializer[:]
    g.initializer.extend(weights + rest)
    props = [p for p in m.metadata_props if p.key != KEY]
    del m.metadata_props[:]
    m.metadata_props.extend(props)
    return m


def frozen_bytes(model: onnx.ModelProto, params) -> dict[str, int]:
    """``Trainer.memory()``'s frozen entries: ``frozen`` (the MatMul / Gemm weights
    ``base_dtype`` applies to, as held: float32, or quantised data and scales),
    ``embeddings`` (Gather tables) and ``frozen_other`` (every other initializer that is
    not a parameter: biases, norms, constants)."""
    g = model.graph
    params = set(params)
    record = read(model)
    if record is None:
        frozen = set(_targets(g, params))
    else:
        frozen = {i.name for i in g.initializer for w in record["weights"]
                  if i.name in (f"{PREFIX}{w}/q", f"{PREFIX}{w}/scale_col")}
    tables = {n.input[0] for n in g.node if n.op_type == "Gather" and n.input}
    out = {"frozen": 0, "embeddings": 0, "frozen_other": 0}
    for i in g.initializer:
        if i.name in params:
            continue
        key = "frozen" if i.name in frozen else "embeddings" if i.name in tables \
            else "frozen_other"
        out[key] += int(np.prod(i.dims, dtype=np.int64)) * \
            helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
    return out
