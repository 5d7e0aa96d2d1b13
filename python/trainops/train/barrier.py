"""All or nothing: the step graph's in-place state updates run after everything else
(:func:`order_updates`).

ONNX Runtime orders nodes by data dependencies only. A node that writes a state in place
(the optimizer node, ``DynamicLossScale``, a Philox op's state) may run before a node it
does not depend on; if that node then fails, the step is half-applied (weights and moments
updated, ``T`` not). So:

1. nodes that neither the loss nor an update needs are pruned (they would only fail);
2. the update count the writers read is ``T + 0``, the 0 computed from one element of the
   last output of every node the writers do not already depend on (a data dependency:
   ONNX Runtime's constant folding cannot remove it, unlike a ``Shape`` of a static shape);
   ``T + 0`` is ``T`` exactly, so the update's arithmetic is unchanged;
3. each Philox op writes its new state to a fresh tensor (``<state output>/pending``); the
   aliased state output is a ``Reshape`` of it that depends on the optimizer's output, so
   the state buffer changes only once every other node has run (BatchNormalization's
   running statistics likewise: :func:`defer_writes`);
4. a writer that reads no ``T`` (the accumulation ``Add`` of a micro-batch,
   :mod:`.accumulate`) reads its ``held`` inputs through a ``Reshape`` to their own static
   shape whose shape is ``shape + 0``, the same barrier 0: it too waits for every node.
"""

from __future__ import annotations

from typing import Sequence

import onnx
from onnx import TensorProto, helper

from ..autodiff.graph import node_inputs as _all_inputs
from ..graph_deps import zero_of as _zero_of
from .spec import PREFIX as _P

__all__ = ["defer_writes", "order_updates", "pending_name"]


def pending_name(state_output: str) -> str:
    """The fresh tensor a Philox op writes its new state to (not aliased)."""
    return f"{state_output}/pending"


def defer_writes(graph: onnx.GraphProto, nodes: Sequence[onnx.NodeProto],
                 written) -> list[tuple[str, str, Sequence[int]]]:
    """Make the forward pass's own state writes (``written``: the Philox states' and the
    BatchNormalization running statistics' :class:`~.spec.StateEntry`) go to fresh tensors
    (:func:`pending_name`), in ``nodes`` and ``graph``'s value infos, in place: the
    ``rng`` argument of :func:`order_updates` (pending, state output, shape), which writes
    each state once every other node has run."""
    pending = {e.output: pending_name(e.output) for e in written}
    for n in nodes:
        for i, o in enumerate(n.output):
            if o in pending:
                n.output[i] = pending[o]
    for v in graph.value_info:
        if v.name in pending:
            v.name = pending[v.name]
    return [(pending[e.output], e.output, e.initial.shape) for e in written]


def _ancestors(nodes: Sequence[onnx.NodeProto], names) -> set[int]:
    """Indices of the nodes that ``names`` (tensor names) depend on."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    seen: set[int] = set()
    stack = [producer[x] for x in names if x in producer]
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        stack.extend(producer[x] for x in _all_inputs(nodes[k]) if x in producer)
    return seen


def order_updates(nodes: list[onnx.NodeProto], writers: list[onnx.NodeProto],
                  required: Sequence[str], t_name: str,
                  rng: Sequence[tuple[str, str, Sequence[int]]],
                  opset: int, held: Sequence[tuple[str, Sequence[int]]] = ()
                  ) -> list[onnx.NodeProto]:
    """``nodes`` (the forward, backward and Philox nodes, each Philox op writing
    :func:`pending_name` of its state output) and the state ``writers`` (the optimizer
    node(s) first, each reading ``t_name``) as one node list where every write comes last:

    - nodes that none of ``required`` (the loss output), no pending state of ``rng`` and no
      writer input depends on are dropped;
    - the writers read ``T`` through a ``T + 0`` that depends on every kept node not all of
      the ``T``-reading writers already depend on;
    - ``rng``: (pending, state output, shape) of each state the forward pass writes
      (Philox's, BatchNorm's running statistics: :func:`defer_writes`): the state output is
      written from the pending tensor once the first writer has run;
    - ``held``: (tensor, static shape) of writer inputs read through the barrier too (for
      writers that read no ``T``): a ``Reshape`` to the same shape, so no value changes."""
    writer_inputs = [x for w in writers for x in _all_inputs(w) if x != t_name]
    kept = _ancestors(nodes, list(required) + [r[0] for r in rng] + writer_inputs)
    nodes = [n for k, n in enumerate(nodes) if k in kept]
    # The nodes every T-reading writer depends on already: with two optimizer nodes (int8
    # state and small tensors) a node only one of them needs may read a weight the other
    # overwrites in place, so it must run before both.
    t_writers = [w for w in writers if t_name in w.input] or writers
    direct = set.intersection(*[_ancestors(nodes, [x for x in _all_inputs(w) if x != t_name])
                                for w in t_writers])
    rest = [n for k, n in enumerate(nodes) if k not in direct]
    consumed = {x for n in rest for x in _all_inputs(n)}
    sinks = [next(o for o in n.output if o) for n in rest
             if not any(o in consumed for o in n.output if o)]
    out = list(nodes)
    if sinks:
        zero, t_after = f"{_P}/barrier/zero", f"{_P}/barrier/T"
        out += _zero_of(sinks, zero, opset)
        out.append(helper.make_node("Add", [t_name, zero], [t_after], name=f"{_P}/barrier"))
        late = {t_name: t_after}
        for x, shape in held:
            out += _after(zero, x, f"{x}/held", shape, f"{x}/held")
            late[x] = f"{x}/held"
        for w in writers:
            for i, x in enumerate(w.input):
                if x in late:
                    w.input[i] = late[x]
    out += writers
    if rng:
        after = f"{_P}/after_update/zero"
        out += _zero_of([next(o for o in writers[0].output if o)], after, opset)
        for pending, state, shape in rng:
            out += _after(after, pending, state, shape, f"{state}/after_update")
    return out


def _after(zero: str, x: str, out: str, shape: Sequence[int], name: str
           ) -> list[onnx.NodeProto]:
    """``x`` as ``out``, unchanged, once ``zero`` (an int64 0 computed from what must run
    first) exists: a ``Reshape`` named ``name`` to ``x``'s own static ``shape``, read as
    ``shape + zero`` (``<out>/shape``)."""
    s = f"{out}/shape"
    return [helper.make_node("Constant", [], [s + "/static"], value=helper.make_tensor(
                s + "/static", TensorProto.INT64, [len(shape)], list(shape))),
            helper.make_node("Add", [s + "/static", zero], [s]),
            helper.make_node("Reshape", [x, s], [out], name=name)]
