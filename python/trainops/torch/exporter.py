"""``trainops.torch.export``: a torch module as an ONNX model that trains as
``module.train()`` does (see :mod:`trainops.torch`).

How parameters are found in the exported graph, whatever names the exporter gives them:
before exporting, every floating parameter and every tracking BatchNorm's running
statistics (:func:`_fillable`: tensors the training-mode forward only multiplies in or
does not read) are given distinct values (seeded random values, the first element of
each tensor unique), so that each initializer of the export can be told apart by its
bytes. Each torch tensor's initializer is the one holding its bytes (or, for a 2-D
parameter, its transpose's: ``transposed``); the module's real values are then written
into those initializers and the module's own state is put back. A used parameter found
nowhere was folded into something else (a constant, another weight): an error naming it,
as training that export could not be faithful; one found twice was copied: the same. Tied
parameters are one tensor, so one initializer under both names. Other buffers keep their
real values (the forward may compute with them) and are named where their value picks
out one initializer. Last, :mod:`.check` runs the export in onnxruntime against the
module's own outputs.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch

import onnx
from onnx import numpy_helper

from ..train import torch_meta
from .check import reference, verify
from .wrap import Preserved, Wrapped, input_names, padding_rows

__all__ = ["OPSET", "export"]

# The one place the exporter is chosen. The TorchScript ("classic") exporter in training
# mode with constant folding off keeps BatchNormalization in its training form with the
# running statistics as initializers (updated by the node's outputs), Dropout in training
# mode, and every parameter an initializer of its own. torch 2.15's default (dynamo)
# exporter with optimize=True folds BatchNorm into the convolution and class tokens into
# batch-sized constants; with optimize=False it writes forms (CastLike, sequence ops) the
# gradient rules do not all cover yet.
OPSET = 17


def _onnx_export(wrapped, tensors, names, outputs, dynamic_axes) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        # Known and harmless here: the classic exporter's deprecation notices (the docs say
        # it once), its dropping of num_batches_tracked's increment (a count the Trainer
        # does not keep), and BatchNorm's batch-size check in torch.nn.functional (a
        # Python bool of the input's shape). Any other TracerWarning (a trace that may
        # not generalise) still reaches the user.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", r"ONNX Preprocess - Removing mutation .*"
                                r"num_batches_tracked")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning,
                                module="torch.nn.functional")
        torch.onnx.export(wrapped, tuple(tensors), buf, dynamo=False, opset_version=OPSET,
                          input_names=names, output_names=outputs, dynamic_axes=dynamic_axes,
                          training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, export_params=True,
                          keep_initializers_as_inputs=False)
    return onnx.load_from_string(buf.getvalue())


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _fill(tensors: list, counters: set, seed: int = 0x7261696E) -> None:
    """Gives each floating tensor of ``tensors`` (those safe to fill, :func:`_fillable`)
    distinct values: seeded uniform values in [1, 2), the first element ``1 + k * 2**-20``
    unique to the k-th tensor (so no two tensors share their bytes), and each BatchNorm's
    ``num_batches_tracked`` (``counters``: their ids; the forward does not read them when
    momentum is set) a distinct count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, t in enumerate(tensors):
            if t.is_floating_point():
                v = 1 + torch.rand(t.shape, generator=gen, dtype=torch.float64)
                # 16-bit types cannot tell 1 + k 2**-20 apart: the integer k + 1 instead
                # (exact up to 2048 in float16, 256 in bfloat16)
                wide = torch.finfo(t.dtype).bits > 16
                v.reshape(-1)[:1] = 1 + (k + 1) * 2.0 ** -20 if wide else k + 1
                t.copy_(v.to(t.dtype))
            elif id(t) in counters:
                t.fill_(1_000_003 + 7919 * k)


def _fillable(module, counters: set) -> set:
    """The ids of the tensors whose values the training-mode forward only multiplies into
    the graph or does not read, so that filling them cannot change what the trace records:
    the floating parameters, and each tracking BatchNorm's running statistics and
    ``num_batches_tracked`` (``counters``; in training mode BatchNorm normalises by the
    batch's statistics and only updates these). Every other buffer keeps its real value
    while tracing: a forward may compute with it (rotary embeddings' ``inv_freq``, position
    ids, masks), and the tracer would bake what it computed from a filled value into a
    constant."""
    out = {id(p) for p in module.parameters() if p.is_floating_point()} | set(counters)
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            out |= {id(t) for t in (m.running_mean, m.running_var) if t is not None}
    return out


def _counters(module) -> set:
    """The ids of the BatchNorms' ``num_batches_tracked``; ValueError for a BatchNorm that
    tracks running statistics with ``momentum=None`` (a cumulative average, its factor
    1/num_batches_tracked changing every step): ONNX's BatchNormalization has one fixed
    momentum, so no export trains it as torch does."""
    out = set()
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            if m.momentum is None:
                raise ValueError(f"trainops.torch.export: {name or type(m).__name__} has "
                                 "momentum=None (a cumulative average of the batch "
                                 "statistics): ONNX's BatchNormalization has one fixed "
                                 "momentum; give it a number (torch's default is 0.1)")
            if m.num_batches_tracked is not None:
                out.add(id(m.num_batches_tracked))
    return out


def _used(wrapped, tensors, missing: list) -> list:
    """Those of ``missing`` (parameters the export does not hold) that the module's
    outputs depend on (a gradient reaches them): they were folded, not dropped unused."""
    flags = [p.requires_grad for p in missing]
    try:
        for p in missing:
            p.requires_grad_(True)
        outs = [o for o in wrapped(*tensors) if o.is_floating_point() and o.requires_grad]
        if not outs:
            return []
        total = sum(o.float().sum() for o in outs)
        grads = torch.autograd.grad(total, missing, allow_unused=True)
        return [p for p, g in zip(missing, grads) if g is not None]
    finally:
        for p, f in zip(missing, flags):
            p.requires_grad_(f)


def _names(module) -> dict:
    """id(tensor) -> (kind, its torch names): parameters under every name (tied ones
    several), buffers likewise."""
    out: dict = {}
    for kind, items in (("params", module.named_parameters(remove_duplicate=False)),
                        ("buffers", module.named_buffers(remove_duplicate=False))):
        for name, t in items:
            out.setdefault(id(t), (kind, t, []))[2].append(name)
    return out


def _match(model, names: dict, filled: set, real: dict, after: dict):
    """``{id: (initializer, transposed)}`` for each torch tensor found in ``model`` by its
    bytes, and the ids of filled tensors found in more than one initializer. A filled
    tensor (``filled``: ids) is found by its filled values or ``after[id]`` (a buffer's
    value once the export's trace updated it), a 2-D parameter also as its transpose; any
    other buffer by its real value (``real[id]``) or ``after[id]``, only where that is
    unambiguous: one initializer holds it and no other tensor is found there (two equal
    buffers, or a real value that happens to equal another's, are left out)."""
    index: dict = {}
    for init in model.graph.initializer:
        index.setdefault(numpy_helper.to_array(init).tobytes(), []).append(init)
    found, copied, claims = {}, [], {}
    for key, (kind, t, _) in names.items():
        mine = _bytes(t) if key in filled else _bytes(real[key])
        hits = []
        for b in dict.fromkeys([mine, after.get(key, b"")]):
            hits += [(i, False) for i in index.get(b, []) if list(i.dims) == list(t.shape)]
        if kind == "params" and t.dim() == 2 and t.shape[0] != 1 and t.shape[1] != 1:
            hits += [(i, True) for i in index.get(_bytes(t.T), [])
                     if list(i.dims) == [t.shape[1], t.shape[0]]]
        for i, _ in hits:
            claims.setdefault(i.name, set()).add(key)
        if len({i.name for i, _ in hits}) > 1:
            if key in filled:
                copied.append(key)
        elif hits:
            found[key] = hits[0]
    for key in [k for k in found if k not in filled]:
        if len(claims[found[key][0].name]) > 1:
            del found[key]
    return found, copied


def _rename(model, wanted: dict, meta: dict) -> None:
    """Renames each initializer of ``wanted`` (name -> the torch name of its tensor) to that
    name where no other tensor of the graph has it (the exporter's names carry the
    wrapper's ``module.`` prefix), in the nodes that read it (subgraphs too) and in
    ``meta``."""
    taken = {i.name for i in model.graph.input} | {o for n in model.graph.node for o in n.output}
    taken |= {i.name for i in model.graph.initializer}
    rename = {}
    for old, new in wanted.items():
        if old != new and new not in taken:
            rename[old] = new
            taken.add(new)
    if not rename:
        return

    def visit(graph):
        for n in graph.node:
            n.input[:] = [rename.get(i, i) for i in n.input]
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    visit(g)

    visit(model.graph)
    for i in model.graph.initializer:
        i.name = rename.get(i.name, i.name)
    for entries in meta.values():
        for e in entries.values():
            e["initializer"] = rename.get(e["initializer"], e["initializer"])


def export(module: torch.nn.Module, args, f=None, *, kwargs: dict | None = None,
           dynamic_axes: dict | None = None) -> onnx.ModelProto:
    """``module`` as an ONNX model faithful to ``module.train()`` (see
    :mod:`trainops.torch`), with the torch names of its parameters and buffers recorded
    in ``model.metadata_props`` (:mod:`trainops.train.torch_meta`), so that
    :class:`trainops.Trainer` trains exactly the trainable parameters and
    :meth:`~trainops.train.Trainer.state_dict` gives them back under their torch names.

    ``args``: the example inputs (a tensor or a tuple), named after ``forward``'s
    parameters; ``kwargs``: keyword inputs, named by their keys (arguments that are not
    tensors are kept as given); ``dynamic_axes``: as ``torch.onnx.export``'s; ``f``: a
    path to save the model to as well (atomically). The module is left as it was: its
    values (running statistics and ``num_batches_tracked`` too) and every submodule's
    train/eval flag. ValueError naming the parameters the exporter folded or copied, or
    the output onnxruntime computes differently from the module (:mod:`.check`)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"trainops.torch.export: expected a torch.nn.Module, got "
                        f"{type(module).__name__}")
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    kwargs = dict(kwargs or {})
    names_in, tensors = input_names(module, args, kwargs)
    names = _names(module)
    counters = _counters(module)
    saved = Preserved(module)
    wrapped = Wrapped(module, args, kwargs)
    with saved:  # the module's own outputs from its real state (and the output names)
        module.train()
        want = reference(wrapped, tensors)
    with saved, padding_rows(module, saved.real()):
        module.train()
        fillable = _fillable(module, counters)
        targets = [t for key, (_, t, _) in names.items() if key in fillable]
        _fill(targets, counters)
        filled = {key: _bytes(t) for key, (_, t, _) in names.items() if key in fillable}
        if len(set(filled.values())) < len(filled):
            same = [names[k][2][0] for k, b in filled.items()
                    if list(filled.values()).count(b) > 1]
            raise ValueError(f"trainops.torch.export: cannot tell the tensors {same} apart "
                             "by their values (one-element 16-bit parameters?)")
        model = _onnx_export(wrapped, tensors, names_in, wrapped.output_names, dynamic_axes)
        real = saved.real()
        after = {key: _bytes(t) for key, (kind, t, _) in names.items() if kind == "buffers"
                 and _bytes(t) != filled.get(key, _bytes(real[key]))}
        _fill(targets, counters)  # again, to find them
        found, copied = _match(model, names, set(filled), real, after)
        missing = [t for key, (kind, t, _) in names.items() if kind == "params"
                   and key not in found and key not in copied and t.is_floating_point()]
        folded = _used(wrapped, tensors, missing) if missing else []
    bad = [n for key in copied for n in names[key][2]]
    bad += [n for t in folded for n in names[id(t)][2]]
    if bad:
        raise ValueError(f"trainops.torch.export: the exporter folded or copied the "
                         f"parameters {bad} (no initializer of their own holds them), so "
                         "the export would not train as the module does")
    meta = {"params": {}, "buffers": {}}
    inits = {i.name: i for i in model.graph.initializer}
    for key, (init, transposed) in found.items():
        kind, t, tnames = names[key]
        value = real[key].cpu()
        value = value.T if transposed else value
        arr = numpy_helper.to_array(init)
        new = np.ascontiguousarray(value.numpy() if value.dtype != torch.bfloat16 else
                                   value.view(torch.int16).numpy().view(arr.dtype))
        inits[init.name].CopyFrom(numpy_helper.from_array(new.astype(arr.dtype), init.name))
        for n in tnames:
            if kind == "params" and t.requires_grad:
                meta["params"][n] = {"initializer": init.name, "transposed": transposed}
            elif kind == "buffers":
                meta["buffers"][n] = {"initializer": init.name}
    _rename(model, {init.name: names[key][2][0] for key, (init, _) in found.items()}, meta)
    order = {n: i for i, (n, _) in enumerate(module.named_parameters(remove_duplicate=False))}
    meta["params"] = dict(sorted(meta["params"].items(), key=lambda kv: order[kv[0]]))
    torch_meta.write(model, meta)
    verify(model, names_in, tensors, want)
    if f is not None:
        from ..train.atomic import write_files

        write_files([(f, [model.SerializeToString()])], "trainops.torch.export")
    return model
