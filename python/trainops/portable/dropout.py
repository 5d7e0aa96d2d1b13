"""``com.trainops::PhiloxDropout`` as ONNX ``Dropout`` with a ``seed`` attribute.

Not bit-exact with PhiloxDropout, by necessity: Philox4x32-10 in standard ops needs XOR,
which the default domain has only from opset 18 (``BitwiseXor``; the package writes opset
17), and 32x32->64-bit products, which onnxruntime 1.17's CPU EP cannot form (no uint32 or
uint64 ``Mul``; int64 would need 16-bit limbs, dozens of full-size nodes per round), and
which GPU EPs without 64-bit integers (WebGPU, most of DirectML, CoreML) could not run.

So the keep decisions come from the runtime's own ``Dropout``: ``seed`` is fixed per node
(``crc32`` of the node's name or first output, mixed with the rewrite's ``dropout_seed``).
On onnxruntime's CPU EP, run k of any session of the model draws the same mask (1.17 and
1.32 alike), but a new session starts its sequence again, so a resumed training run does
not continue the masks it would have drawn, and other EPs draw their own. What stays as
PhiloxDropout has it: ``output`` is ``data * scale`` where kept and ``0``/``-0`` where
dropped (bfloat16 data go through float32, which onnxruntime's Dropout needs); ``mask``;
and ``state_out`` is the state advanced exactly as PhiloxDropout advances it (counter +
ceil(numel / 4) in training mode, unchanged otherwise), so the model's random state stays
where the fused graph would have it.
"""

from __future__ import annotations

import zlib
from typing import Mapping

from onnx import helper

from .emit import BFLOAT16, BOOL, FLOAT, FLOAT_TYPES, INT64, Emitter, Expansion, ExpansionError

__all__ = ["philox_dropout", "advanced_state"]

UINT32 = 12


def advanced_state(e: Emitter, state: str, words: str, out: str) -> None:
    """Emits ``out``: the Philox ``state`` (uint32, 6 elements, any shape) with its
    128-bit counter (words 0..3, least significant first) advanced by ``words`` (an int64
    scalar, >= 0) modulo 2^128 and the key kept; in int64 arithmetic with explicit carries
    (no unsigned Add needed)."""
    flat = e.op("Cast", e.op("Reshape", state, e.ints([6])), to=INT64)
    base = e.const(2 ** 32, INT64)
    carry, parts = words, []
    for k in range(4):
        total = e.op("Add", e.op("Gather", flat, e.const(k, INT64)), carry)
        parts.append(e.op("Unsqueeze", e.op("Mod", total, base), e.ints([0])))
        carry = e.op("Div", total, base)
    parts.append(e.op("Slice", flat, e.ints([4]), e.ints([6])))
    # The last node is the Cast, not a Reshape: when the new state reached the step's
    # closing Reshape into the state's bound buffer (train/barrier.py) through a Reshape of
    # its own, onnxruntime 1.32 wrote it into that buffer before the rest of the step had
    # run, so a step failing later left the state advanced.
    new = e.op("Reshape", e.op("Concat", *parts, axis=0), e.op("Shape", state))
    e.nodes.append(helper.make_node("Cast", [new], [out], to=UINT32, name=e.fresh("Cast")))


def philox_dropout(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``PhiloxDropout(data, ratio?, training_mode?, state) -> (output, mask?, state_out?)``
    as ``Dropout(data, ratio, training_mode)`` with a fixed ``seed`` (see the module
    docstring for what that does and does not reproduce)."""
    e = Emitter(node, types, taken, **options)
    ins = list(node.input) + [""] * (4 - len(node.input))
    outs = list(node.output) + [""] * (3 - len(node.output))
    if len(node.input) != 4 or not ins[3]:
        raise ExpansionError(e.where("expected 4 inputs (data, ratio, training_mode, state; "
                                     "the middle two may be empty names)"))
    data, ratio, training, state = ins[:4]
    elem = e.elem(data, "data", FLOAT_TYPES)
    if ratio:
        e.elem(ratio, "ratio", (FLOAT,))
    if training:
        e.elem(training, "training_mode", (BOOL,))
    e.elem(state, "state", (UINT32,))
    key = zlib.crc32((node.name or node.output[0]).encode())
    seed = (key ^ (e.dropout_seed * 0x9E3779B9)) & 0x7FFFFFFF
    wide = e.cast(data, elem, FLOAT) if elem == BFLOAT16 else data
    result = e.fresh("dropped") if elem == BFLOAT16 else outs[0]
    dropout_outs = [result] + ([outs[1]] if outs[1] else [])
    e.nodes.append(helper.make_node("Dropout", [wide, ratio, training], dropout_outs,
                                    name=e.fresh("Dropout"), seed=seed))
    if elem == BFLOAT16:
        e.nodes.append(helper.make_node("Cast", [result], [outs[0]], to=BFLOAT16,
                                        name=e.fresh("Cast")))
    if outs[2]:
        if training:
            numel = e.op("Size", wide)  # onnxruntime has no Size for bfloat16
            words = e.op("Div", e.op("Add", numel, e.const(3, INT64)), e.const(4, INT64))
            zero = e.const(0, INT64)
            words = e.op("Where", e.scalar(training), words, zero)
            advanced_state(e, state, words, outs[2])
        else:  # never training: no words consumed
            e.nodes.append(helper.make_node("Identity", [state], [outs[2]], name=e.fresh("Identity")))
    return e.finish()
