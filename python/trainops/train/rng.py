"""The random nodes of a training graph rewired to seeded Philox ops whose states are
in-place step states (:func:`philox_states`)."""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from ..onnx_defs import TRAINOPS_DOMAIN
from ..random import RANDOM_OPS, make_reproducible
from .spec import StateEntry

__all__ = ["has_random_nodes", "philox_states"]


def has_random_nodes(graph: onnx.GraphProto) -> bool:
    """Whether ``graph`` has a Dropout, RandomUniform or RandomNormal of the ONNX domain."""
    return any(n.op_type in RANDOM_OPS and n.domain in ("", "ai.onnx") for n in graph.node)


def philox_states(src: onnx.ModelProto, g: onnx.GraphProto, inferred: onnx.GraphProto,
                  key_seed: int) -> tuple[list[onnx.NodeProto], list[StateEntry]]:
    """The forward nodes of ``g`` with its random nodes (Dropout, RandomUniform,
    RandomNormal) rewritten by :func:`trainops.random.make_reproducible` into the Philox
    ops keyed by ``key_seed``, and their states (kind ``"rng"``: state input, state
    output, initial state). Each state becomes a graph input of ``g`` (fed from a buffer
    the session updates in place); ``g``'s initializers and value_info are completed.
    ``src`` is the model ``g`` came from (opsets, IR version)."""
    if not has_random_nodes(g):
        return list(g.node), []
    m = onnx.ModelProto()
    m.CopyFrom(src)
    m.graph.CopyFrom(g)
    # Types for make_reproducible: the inferred ones, and those of inputs g lacks yet
    # (parameters, float16 copies).
    declared = {v.name for v in list(m.graph.value_info) + list(m.graph.input)}
    m.graph.value_info.extend(v for v in list(inferred.input) + list(inferred.value_info)
                              if v.name not in declared)
    r = make_reproducible(m, key_seed)
    had_in = {i.name for i in m.graph.input}
    new_in = [i for i in r.graph.input if i.name not in had_in]
    new_out = [o.name for o in r.graph.output if o.name not in {o.name for o in m.graph.output}]
    inits = {i.name: i for i in r.graph.initializer}
    states = [StateEntry(vi.name, out, "rng", numpy_helper.to_array(inits[vi.name]))
              for vi, out in zip(new_in, new_out)]
    names = {vi.name for vi in new_in}
    have = {i.name for i in g.initializer}
    g.initializer.extend(i for i in r.graph.initializer
                         if i.name not in have and i.name not in names)
    g.input.extend(new_in)
    # The Philox ops' outputs keep the types make_reproducible declares for them.
    rewritten = {o for n in r.graph.node if n.domain == TRAINOPS_DOMAIN for o in n.output}
    keep = [v for v in g.value_info if v.name not in rewritten]
    del g.value_info[:]
    g.value_info.extend(keep + [v for v in r.graph.value_info if v.name in rewritten])
    return list(r.graph.node), states
