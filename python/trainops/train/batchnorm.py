"""BatchNormalization in a training graph, as PyTorch's ``model.train()`` does it.

- :func:`training_batchnorm` rewrites every BatchNormalization of a model's main graph
  (``batchnorm="train"``) to ``training_mode=1``: it normalises with the batch statistics
  and outputs the updated running mean and variance, which become ``bn_stat`` states (their
  input the model's running-statistic initializer, updated in place each step). ONNX's
  running variance is ``momentum * var + (1 - momentum) * biased_batch_var``; PyTorch uses
  the UNBIASED batch variance (``n / (n - 1)`` times it, ``n`` the elements per channel):
  the update here is PyTorch's. One value per channel (``n = 1``: a batch of one) is
  refused at run time as PyTorch refuses it (its unbiased variance is NaN): a check in the
  graph fails the step, which then changes nothing. With ``batchnorm="frozen"`` every
  BatchNormalization is the inference form (running statistics, fixed: fine-tuning).
- :func:`unshare_running_stats`: exporters deduplicate identical initializers, so fresh
  BatchNorm layers of one width share one running mean, or read it through an Identity of
  a zero bias (classic exporter, eval mode) or a Constant; each node gets its own
  initializer, holding the stored value.
- :func:`inference_batchnorm`: back to the inference form (:meth:`Trainer.export`).
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import helper, numpy_helper

from ..autodiff import GradientError
from ..autodiff.graph import attr, describe
from ..losses import guard
from .spec import PREFIX as _P
from .spec import StateEntry

__all__ = ["batchnorm_nodes", "inference_batchnorm", "running_stats", "training_batchnorm",
           "unshare_running_stats"]


def batchnorm_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The default-domain BatchNormalization nodes of ``graph`` (main graph only)."""
    return [n for n in graph.node
            if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]


def running_stats(graph: onnx.GraphProto) -> set[str]:
    """The names of the BatchNormalization nodes' running mean and variance inputs."""
    return {n.input[k] for n in batchnorm_nodes(graph) for k in (3, 4) if len(n.input) > k}


def _stored_stats(model: onnx.ModelProto) -> None:
    """Running statistics an exporter wrote as the output of an Identity chain or a
    Constant (torch's classic exporter, eval mode, deduplicates a fresh running mean with
    a zero bias and a running variance with a ones scale, read through ``Identity``)
    become initializers of their own (in place), holding the stored tensor's value: named
    as the node reads them (torch's buffer name) when this node is the only reader (the
    Identity or Constant then goes), else ``<name>/<k>``."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output if o}
    readers: dict[str, int] = {}
    for name in [i for n in g.node for i in n.input] + [o.name for o in g.output]:
        readers[name] = readers.get(name, 0) + 1
    taken = set(inits) | set(producer) | {i.name for i in g.input}
    drop = []
    for n in batchnorm_nodes(g):
        for k in (3, 4):
            name = n.input[k] if len(n.input) > k else ""
            if not name or name in inits:
                continue
            t, chain = name, []
            while t in producer and producer[t].op_type == "Identity" and t not in inits:
                chain.append(producer[t])
                t = producer[t].input[0]
            value = inits.get(t)
            if value is None and t in producer and producer[t].op_type == "Constant":
                chain.append(producer[t])
                value = next((a.t for a in producer[t].attribute if a.name == "value"), None)
            if value is None:
                continue  # computed: training_batchnorm names it
            copy = onnx.TensorProto()
            copy.CopyFrom(value)
            first = chain[0] if chain else None
            if first is not None and readers[name] == 1 and list(first.output) == [name]:
                drop.append(first)  # only this node read it: the initializer replaces it
                copy.name = name
            else:
                j = 1
                while f"{name}/{j}" in taken:
                    j += 1
                copy.name = f"{name}/{j}"
                readers[name] -= 1
            taken.add(copy.name)
            g.initializer.append(copy)
            inits[copy.name] = copy
            n.input[k] = copy.name
    dropped = {id(n) for n in drop}
    keep = [n for n in g.node if id(n) not in dropped]
    del g.node[:]
    g.node.extend(keep)


def unshare_running_stats(model: onnx.ModelProto) -> None:
    """Give every BatchNormalization its own running-statistic initializers (in place): a
    running statistic read through an Identity chain or a Constant is first stored as an
    initializer (:func:`_stored_stats`); one that another input also reads (another
    BatchNormalization, or a zero bias the exporter merged with a zero running mean) is
    copied for this node, as ``<name>/<k>``; the last reader keeps the original."""
    _stored_stats(model)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers: dict[str, int] = {}
    for name in [i for n in g.node for i in n.input] + [o.name for o in g.output]:
        readers[name] = readers.get(name, 0) + 1
    taken = set(inits) | {o for n in g.node for o in n.output} | {i.name for i in g.input}
    for n in batchnorm_nodes(g):
        for k in (3, 4):
            name = n.input[k] if len(n.input) > k else ""
            if name not in inits or readers[name] <= 1:
                continue
            readers[name] -= 1
            j = 1
            while f"{name}/{j}" in taken:
                j += 1
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[name])
            copy.name = f"{name}/{j}"
            taken.add(copy.name)
            g.initializer.append(copy)
            n.input[k] = copy.name


def _set_training_mode(n: onnx.NodeProto, on: bool) -> None:
    keep = [a for a in n.attribute if a.name != "training_mode"]
    del n.attribute[:]
    n.attribute.extend(keep)
    if on:
        n.attribute.append(helper.make_attribute("training_mode", 1))


def inference_batchnorm(model: onnx.ModelProto) -> None:
    """Every BatchNormalization of ``model`` (in place) in the inference form: no
    ``training_mode``, and only the output ``Y`` unless another node or the graph reads
    the running-statistic outputs."""
    g = model.graph
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for n in batchnorm_nodes(g):
        _set_training_mode(n, False)
        if not any(o in used for o in n.output[1:] if o):
            del n.output[1:]


def training_batchnorm(model: onnx.ModelProto, mode: str, opset: int,
                       params=()) -> list[StateEntry]:
    """Rewrite ``model``'s BatchNormalization nodes (in place) for ``mode`` (``"train"`` or
    ``"frozen"``, see the module). Under ``"train"`` each running statistic leaves the
    initializers for a graph input of the same name (a ``bn_stat`` state, returned, whose
    output ``trainops/new/<name>`` the added nodes compute). GradientError for a running
    statistic that is no initializer, is shared, or is among ``params``."""
    g = model.graph
    nodes = batchnorm_nodes(g)
    if mode == "frozen" or not nodes:
        if mode == "frozen":
            inference_batchnorm(model)
        return []
    if opset < 14:
        raise GradientError(f"BatchNormalization in training mode needs opset >= 14 (the "
                            f"model imports {opset}): import the model with "
                            "trainops.train.importer.import_model (the Trainer does), or "
                            "pass batchnorm='frozen'")
    inits = {i.name: i for i in g.initializer}
    read = {i for n in g.node for i in n.input}
    stats: list[StateEntry] = []
    used: set[str] = set()
    for k, n in enumerate(nodes):
        ins = list(n.input)
        if len(ins) < 5:
            raise GradientError(f"{describe(n)}: expected 5 inputs, got {len(ins)}")
        for slot, name in (("mean", ins[3]), ("var", ins[4])):
            if name not in inits:
                raise GradientError(f"{describe(n)}: its running {slot} {name!r} is not an "
                                    "initializer; it cannot be trained as state (pass "
                                    "batchnorm='frozen')")
            if name in used:
                raise GradientError(f"{describe(n)}: its running {slot} {name!r} is shared "
                                    "with another BatchNormalization (unshare_running_stats)")
            if name in params:
                raise GradientError(f"{describe(n)}: its running {slot} {name!r} is state "
                                    "updated from the batch, not a parameter: leave it out "
                                    "of params")
            used.add(name)
        mean, var = ins[3], ins[4]
        old_outs = list(n.output) + [""] * (3 - len(n.output))
        momentum = float(attr(n, "momentum", 0.9))
        p = f"{_P}/bn/{k}"
        value = numpy_helper.to_array(inits[var])
        dt = value.dtype

        def const(name, v):
            g.node.append(helper.make_node("Constant", [], [name], name=name + "/node",
                                           value=numpy_helper.from_array(np.asarray(v), name)))
            return name

        # The node gets a zero running mean and variance, its outputs then are
        # (1 - momentum) * batch_mean and (1 - momentum) * biased_batch_var, and the
        # updates below read the old statistics themselves. Why: onnxruntime computes the
        # running-statistic outputs in place over inputs 3 and 4's buffers (even over an
        # initializer's, across runs), which are the states' bound buffers: a step failing
        # after the node would leave them changed (the mean, before it went this way too),
        # and onnxruntime may place the update's intermediates there. Each zero is x - x,
        # computed each run (0 whether it reads the old value or an intermediate); its node
        # comes after the BatchNormalization in the list, so that no node moves (the Philox
        # keys are node positions): the builders sort the graph.
        g.node.append(helper.make_node("Sub", [mean, mean], [f"{p}/zero_mean"],
                                       name=f"{p}/zero_mean"))
        g.node.append(helper.make_node("Sub", [var, var], [f"{p}/zero"], name=f"{p}/zero"))
        n.input[3] = f"{p}/zero_mean"
        n.input[4] = f"{p}/zero"
        del n.output[:]
        n.output.extend([old_outs[0], f"{p}/batch_mean", f"{p}/batch_var"])
        _set_training_mode(n, True)
        # new = momentum * var + (1 - momentum) * n / (n - 1) * batch_var: PyTorch's update
        # with the unbiased batch variance (n: elements per channel). One value per channel
        # (n = 1: a batch of one [1, C] or [1, C, 1, 1]) would make it NaN: refused, as
        # PyTorch does, by a check the update waits for (losses.guard), so a refused step
        # changes nothing.
        who = describe(n) if n.name else f"BatchNormalization node #{k} (unnamed)"
        what = (f"{who} (input {ins[0]!r}): expected more than 1 value per channel "
                "when training (N * d1 * ... > 1, as PyTorch: the unbiased variance of one "
                "value is NaN and would become the running variance); batch more samples, "
                "or pass batchnorm='frozen' to normalise with the running statistics")
        checks, ok = guard(f"{p}/one_value", what, f"{p}/check")
        extra = [
            helper.make_node("Size", [ins[0]], [f"{p}/size"]),
            helper.make_node("Div", [f"{p}/size", const(f"{p}/channels",
                                                       np.int64(value.size))], [f"{p}/count"]),
            helper.make_node("Less", [f"{p}/count", const(f"{p}/two", np.int64(2))],
                             [f"{p}/one_value"]),
            *checks,
            helper.make_node("Add", [f"{p}/count", ok], [f"{p}/n"]),
            helper.make_node("Cast", [f"{p}/n"], [f"{p}/n/float"],
                             to=helper.np_dtype_to_tensor_dtype(dt)),
            helper.make_node("Sub", [f"{p}/n/float", const(f"{p}/one", dt.type(1))],
                             [f"{p}/n-1"]),
            helper.make_node("Div", [f"{p}/n/float", f"{p}/n-1"], [f"{p}/bessel"]),
            helper.make_node("Mul", [f"{p}/batch_var", f"{p}/bessel"], [f"{p}/added"]),
            helper.make_node("Mul", [var, const(f"{p}/momentum", dt.type(momentum))],
                             [f"{p}/kept"]),
            helper.make_node("Add", [f"{p}/kept", f"{p}/added"], [f"{_P}/new/{var}"],
                             name=f"{p}/Add/new_var"),
            # new mean = momentum * mean + (1 - momentum) * batch_mean (ONNX's and PyTorch's)
            helper.make_node("Mul", [mean, f"{p}/momentum"], [f"{p}/kept_mean"]),
            helper.make_node("Add", [f"{p}/kept_mean", f"{p}/batch_mean"], [f"{_P}/new/{mean}"],
                             name=f"{p}/Add/new_mean"),
        ]
        for e in extra:  # names unique per node: p and the output's own last part
            if not e.name:
                e.name = f"{p}/{e.op_type}/{e.output[0].rsplit('/', 1)[-1]}"
        g.node.extend(extra)
        for old, new in ((old_outs[1], f"{_P}/new/{mean}"), (old_outs[2], f"{_P}/new/{var}")):
            if old in read:  # another node reads the node's own outputs: keep them
                g.node.append(helper.make_node("Identity", [new], [old], name=f"{p}/{old}"))
        for slot, name in (("mean", mean), ("var", var)):
            value = numpy_helper.to_array(inits[name])
            stats.append(StateEntry(name, f"{_P}/new/{name}", "bn_stat", value, slot=slot))
            g.input.append(helper.make_tensor_value_info(name, inits[name].data_type,
                                                         list(value.shape)))
    keep = [i for i in g.initializer if i.name not in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return stats
