"""The module as the exporter sees it (:class:`Wrapped`): its tensor arguments as named
inputs (named after ``forward``'s parameters), its result flattened to named tensors (a
tuple, a dict or a transformers ``ModelOutput``: ``logits`` first), and the module's
state around an export saved and put back (:class:`Preserved`); embeddings with a
``padding_idx`` written so that their padding row gets no gradient (:func:`padding_rows`)."""

from __future__ import annotations

import contextlib
import inspect

import torch

__all__ = ["Preserved", "Wrapped", "input_names", "padding_rows"]


def input_names(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[list, list]:
    """``(names, tensors)``: the tensors among ``args`` (named after ``forward``'s
    parameters, in order) and ``kwargs`` (by their keys), which become the model's data
    inputs. TypeError when ``args`` are more than ``forward`` takes."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        sig = None
    params = [] if sig is None else [
        p for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = sig is not None and any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    if sig is not None and len(args) > len(params) and not varargs:
        raise TypeError(f"trainops.torch.export: {type(module).__name__}.forward takes "
                        f"{len(params)} positional arguments, args has {len(args)}")
    names, tensors = [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            names.append(params[i].name if i < len(params) else f"input_{i}")
            tensors.append(a)
    for k, a in kwargs.items():
        if isinstance(a, torch.Tensor):
            names.append(k)
            tensors.append(a)
    return names, tensors


def _flatten(out, key: str, into: list) -> None:
    """Appends ``(name, tensor)`` for each tensor of ``out``: a tensor under ``key``, a
    tuple or list under ``key_0``, ``key_1``, ..., a dict under its keys; anything else
    (None, a cache object, a number) is left out."""
    if isinstance(out, torch.Tensor):
        into.append((key, out))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            _flatten(v, f"{key}_{i}", into)
    elif isinstance(out, dict):
        for k, v in out.items():
            _flatten(v, str(k), into)


def flatten_output(out) -> list:
    """The named tensors of a module's result (see the module): a tensor is ``output``, a
    tuple ``output_0``, ``output_1``, ..., a dict or ``ModelOutput`` its keys (and
    ``<key>_<i>`` inside tuples), ``logits`` moved first."""
    named: list = []
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict
        for k, v in out.items():
            _flatten(v, str(k), named)
    else:
        _flatten(out, "output", named)
    named.sort(key=lambda kv: kv[0] != "logits")  # stable: the rest keep their order
    return named


class Wrapped(torch.nn.Module):
    """``module`` called with the tensor inputs at their places among ``args`` /
    ``kwargs`` (the other arguments as given), returning the flat tuple of its result's
    tensors (:func:`flatten_output`). ``output_names`` is filled by the first call."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.module = module
        self.args, self.kwargs = args, kwargs
        self.output_names: list[str] = []

    def forward(self, *tensors):
        it = iter(tensors)
        args = [next(it) if isinstance(a, torch.Tensor) else a for a in self.args]
        kwargs = {k: next(it) if isinstance(a, torch.Tensor) else a
                  for k, a in self.kwargs.items()}
        named = flatten_output(self.module(*args, **kwargs))
        if not named:
            raise TypeError(f"trainops.torch.export: {type(self.module).__name__} returned "
                            "no tensor")
        self.output_names = [k for k, _ in named]
        return tuple(v for _, v in named)


class Preserved:
    """A context that saves ``module``'s state (every parameter's and buffer's values,
    running statistics and ``num_batches_tracked`` included, and each submodule's
    train/eval flag) and puts it back on exit, whatever happened inside."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __enter__(self):
        with torch.no_grad():
            self.values = [(t, t.detach().clone()) for t in _tensors(self.module)]
        self.modes = [(m, m.training) for m in self.module.modules()]
        return self

    def real(self) -> dict:
        """id(tensor) -> its saved value."""
        return {id(t): v for t, v in self.values}

    def __exit__(self, *exc):
        with torch.no_grad():
            for t, v in self.values:
                t.copy_(v)
        for m, mode in self.modes:
            m.training = mode
        return False


def _tensors(module: torch.nn.Module) -> list:
    """Every distinct parameter and buffer tensor of ``module`` (a tied one once)."""
    seen, out = set(), []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


@contextlib.contextmanager
def padding_rows(module: torch.nn.Module, real: dict):
    """While exporting, each ``nn.Embedding`` of ``module`` with a ``padding_idx`` looks up
    ``where(ids == padding_idx, row, weight[ids])``, ``row`` a constant copy of the
    padding row's value at the call (``real``: id(tensor) -> value): torch's embedding
    gives that row no gradient, which a plain Gather of the weight would. (torch's weight
    decay still shrinks a non-zero padding row; the constant keeps its value.)"""
    patched = []

    def lookup(emb, row):
        def forward(ids):
            out = torch.nn.functional.embedding(ids, emb.weight, None, emb.max_norm,
                                                emb.norm_type, emb.scale_grad_by_freq,
                                                emb.sparse)
            return torch.where((ids == emb.padding_idx).unsqueeze(-1), row, out)
        return forward

    try:
        for m in module.modules():
            if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
                row = real[id(m.weight)][m.padding_idx].detach().clone()
                m.forward = lookup(m, row)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
