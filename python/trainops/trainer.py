"""Training an ONNX model entirely inside ONNX Runtime.

:class:`Trainer` builds ONE ONNX model that runs the forward pass, the loss, the backward
pass (:mod:`trainops.autodiff`: ordinary ONNX ops) and the optimizer node (ONNX's
``Adam`` / ``Adagrad`` / ``Momentum``, or ``com.trainops::MixedPrecisionAdam`` +
``DynamicLossScale`` under ``policy="mixed_float16"``), and one session in which the
parameters and the optimizer state live in ONNX Runtime's buffers, updated in place
through an IOBinding::

    trainer = Trainer(model, loss="loss", optimizer=optim.Adam(lr=1e-3))
    for x, t in batches:
        loss = trainer.step({"x": x, "t": t})     # the loss before this update
    onnx.save(trainer.export(), "trained.onnx")    # plain onnxruntime runs it

With ``comm=`` (an mpi4py communicator) it trains data-parallel over MPI
(:mod:`trainops.distributed`): the step splits into a gradient session and an optimizer
session around the collectives, over flat buffers that ONNX Runtime and MPI share.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Mapping, Sequence

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

from . import optim as _optim
from .autodiff import GradientError, build_backward, infer
from .autodiff.backward import default_opset, toposort
from .autodiff.graph import Builder
from .onnx_defs import TRAINING_DOMAIN, TRAINOPS_DOMAIN
from .random import RANDOM_OPS, _seed_bits, make_reproducible

__all__ = ["Trainer"]

_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)
_P = "trainops"  # prefix of the names the trainer adds


def _float_initializers(graph) -> list[str]:
    return [i.name for i in graph.initializer if i.data_type in _FLOATS]


def _to_fp16_graph(graph: onnx.GraphProto, params: list[str], data_inputs: list[str]) -> dict:
    """Turn a float32 forward graph into float16 compute in place: float32 data inputs
    and parameters are cast (parameters arrive as float16 copies), other float32
    initializers and Constants become float16, Casts to float become Casts to float16.
    Returns {param: name of its float16 copy}."""
    copies = {p: f"{_P}/{p}/float16" for p in params}
    renames = dict(copies)
    pre = []
    for name in data_inputs:
        vi = next(i for i in graph.input if i.name == name)
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            new = f"{_P}/{name}/float16"
            pre.append(helper.make_node("Cast", [name], [new], to=TensorProto.FLOAT16,
                                        name=f"{_P}/cast_{name}"))
            renames[name] = new
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT and init.name not in params:
            init.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(init).astype(np.float16), init.name))
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.FLOAT16
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(a.t).astype(np.float16), a.t.name))
    # The casts go last so the model's nodes keep their positions (Philox node keys depend
    # on them); the caller sorts the graph before inferring it.
    graph.node.extend(pre)
    return copies


class Trainer:
    """Trains ``model`` (an ``onnx.ModelProto`` or path) whose scalar float output
    ``loss`` is minimised, in ONNX Runtime.

    - ``params``: the initializers to train (default: every float initializer but those
      that only serve as a Dropout's ratio);
    - ``optimizer``: :class:`trainops.optim.Adam` (default ``Adam()``), ``Adagrad`` or
      ``Momentum``;
    - ``policy``: ``"float32"`` (or ``"float64"`` for a float64 model), or
      ``"mixed_float16"``: the forward and backward passes in float16 on float16 copies of
      float32 master weights, ``MixedPrecisionAdam`` (Adam only) with dynamic loss scaling
      (``DynamicLossScale``: Keras' initial scale 2**15, growth every 2000 finite steps);
    - ``threads``: ONNX Runtime's intra-op threads (default: its own choice; with
      ``comm``, the machine's cores shared out among the ranks on it);
    - ``comm``: an mpi4py communicator (:mod:`trainops.distributed`): data-parallel
      training, each rank stepping on its own shard of the batch; the gradients are
      averaged over the ranks (in-place Allreduce of the flat buffer ONNX Runtime writes
      them to) before the optimizer step, so N ranks with batch B each train as one
      process on the N*B batch would (for a mean-reduced loss);
    - ``shard_optimizer``: with ``comm``, ZeRO stage 1: each rank keeps the optimizer
      state of its 1/N slice of the (flattened) parameters only, the gradients are
      reduce-scattered, each rank updates its slice and an Allgather brings everyone the
      new parameters;
    - ``collective_timeout``: seconds a collective may take before
      :class:`trainops.distributed.CollectiveTimeout` (default 300, or
      ``$TRAINOPS_COLLECTIVE_TIMEOUT``);
    - ``seed``: the 64-bit seed of the random nodes. In the training graph every
      ``Dropout`` runs in training mode (as PyTorch's ``model.train()``) as
      ``com.trainops::PhiloxDropout``, and ``RandomUniform``/``RandomNormal`` become
      ``PhiloxUniform``/``PhiloxNormal`` (:func:`trainops.random.make_reproducible`): the
      node at position ``i`` of the model's ``graph.node`` draws from the key
      ``trainops.random.node_key(seed, i)`` from counter 0, its state threaded through the
      steps in place. The same seed gives bit-identical runs for any thread count. Without
      ``seed`` a fresh one is drawn from the OS (as PyTorch does), kept as ``seed``; with
      ``comm``, rank 0's. With ``comm``, rank ``r`` keys its nodes with
      ``trainops.distributed.rank_seed(seed, r)`` instead of ``seed`` (rank 0: ``seed``).

    Every other graph input is data, fed to :meth:`step`.
    """

    def __init__(self, model, loss: str, optimizer: _optim.Optimizer | None = None,
                 params: Sequence[str] | None = None, policy: str = "float32",
                 threads: int | None = None, seed: int | None = None, comm=None,
                 shard_optimizer: bool = False, collective_timeout: float | None = None,
                 *, _state=None):
        if isinstance(model, bytes):
            model = onnx.load_from_string(model)
        elif isinstance(model, (str, os.PathLike)):
            model = onnx.load(os.fspath(model))
        self._model = onnx.ModelProto()
        self._model.CopyFrom(model)
        self.loss_name = loss
        self.optimizer = optimizer if optimizer is not None else _optim.Adam()
        self.policy = str(getattr(policy, "name", policy))
        if self.policy not in ("float32", "float64", "mixed_float16"):
            raise ValueError(f"policy {self.policy!r}: expected 'float32', 'float64' or "
                             "'mixed_float16'")
        if self.policy == "mixed_float16" and self.optimizer.op_type != "Adam":
            raise ValueError("policy 'mixed_float16' uses MixedPrecisionAdam: the optimizer "
                             f"must be Adam, got {self.optimizer.op_type}")
        if seed is not None:
            _seed_bits(seed)  # TypeError / ValueError for a seed that is not a 64-bit int
        self.shard_optimizer = bool(shard_optimizer)
        self._dist = None
        if comm is not None:
            from .distributed import Collectives

            if self.policy == "mixed_float16":
                raise NotImplementedError("comm= with policy 'mixed_float16' is not "
                                          "supported yet (the finite check and the loss "
                                          "scale would need to agree across ranks)")
            self._dist = Collectives(comm, collective_timeout)
            if threads is None:
                threads = max(1, (os.cpu_count() or 1) // self._dist.local_size())
        elif shard_optimizer:
            raise ValueError("shard_optimizer=True needs comm= (an mpi4py communicator)")
        self.threads = threads
        if seed is None:  # as PyTorch: a fresh seed per run, kept so the run can be repeated
            seed = secrets.randbits(64)
            if self._dist is not None:  # every rank needs the same one: rank 0's
                buf = np.array([seed], np.uint64)
                self._dist.bcast_(buf, "the Bcast of the default seed")
                seed = int(buf[0])
        self.seed = int(seed)
        g = self._model.graph
        if loss not in {o for n in g.node for o in n.output} | {i.name for i in g.input}:
            raise ValueError(f"loss {loss!r} is not a tensor of the model")
        float_inits = _float_initializers(g)
        if params is None:  # a Dropout's ratio is a setting, not a weight (as in PyTorch)
            ratios = {n.input[1] for n in g.node if n.op_type == "Dropout" and len(n.input) > 1}
            other = {i for n in g.node for k, i in enumerate(n.input)
                     if not (n.op_type == "Dropout" and k == 1)}
            params = [p for p in float_inits if p not in ratios or p in other]
        self.param_names = list(params)
        missing = [p for p in self.param_names if p not in float_inits]
        if missing:
            raise ValueError(f"params {missing} are not float initializers of the model")
        if not self.param_names:
            raise ValueError("the model has no float initializers to train")
        inits = {i.name for i in g.initializer}
        self.input_names = [i.name for i in g.input if i.name not in inits]
        if self._dist is None:
            self._build()
            self._make_session()
        else:
            self._build_distributed()
            self._make_distributed_sessions()
        if _state is not None:
            self._restore(_state)

    # -- the training model --------------------------------------------------------------
    def _backward(self):
        """The forward graph with the backward pass appended: (graph, nodes, gradient
        names in param order, inferred graph, param types, initial values, float16
        copies, loss type). Random nodes become Philox ops (:meth:`_philox`)."""
        src = self._training_source()
        opset = default_opset(src)
        inferred = infer(src).graph
        ptypes = {}
        values = {}
        for init in src.graph.initializer:
            if init.name in self.param_names:
                values[init.name] = numpy_helper.to_array(init)
                ptypes[init.name] = init.data_type
        self._initial = values
        mixed = self.policy == "mixed_float16"

        g = onnx.GraphProto()
        g.CopyFrom(src.graph)
        g.name = (src.graph.name or "model") + "_training"
        keep = [i for i in g.initializer if i.name not in values]
        del g.initializer[:]
        g.initializer.extend(keep)
        del g.output[:]
        copies = {}
        if mixed:
            for p in values:
                if ptypes[p] != TensorProto.FLOAT:
                    raise ValueError(f"mixed_float16 needs float32 parameters; {p!r} is not")
            copies = _to_fp16_graph(g, self.param_names, self.input_names)
            inferred_src = onnx.ModelProto()
            inferred_src.CopyFrom(src)
            inferred_src.graph.CopyFrom(g)
            del inferred_src.graph.node[:]
            inferred_src.graph.node.extend(toposort(list(g.node), {i.name for i in g.input}))
            for p, c in copies.items():
                inferred_src.graph.input.append(helper.make_tensor_value_info(
                    c, TensorProto.FLOAT16, list(values[p].shape)))
            inferred = infer(inferred_src).graph
        wrt = [copies.get(p, p) for p in self.param_names]

        b = Builder(inferred, opset, prefix=f"{_P}/grad")
        loss = self.loss_name
        loss_t = b.dtype(loss)
        if loss_t not in _FLOATS:
            raise GradientError(f"loss {loss!r} must be a float tensor (its type is {loss_t})")
        seed = None
        if mixed:
            seed = b.op("Cast", [f"{_P}/loss_scale"], to=TensorProto.FLOAT16)
            if b.shape(loss) not in (None, []):
                seed = b.op("Expand", [seed, b.op("Shape", [loss])])
        b, grads = build_backward(inferred, opset, loss, wrt, seed=seed, builder=b)
        nodes = self._philox(src, g, inferred) + list(b.nodes)
        return g, nodes, grads, inferred, ptypes, values, copies, loss_t

    def _training_source(self) -> onnx.ModelProto:
        """The model with every Dropout of its main graph in training mode (as PyTorch's
        ``model.train()``: ``training_mode`` a constant true) and with a mask output, which
        its gradient uses. Node positions are kept (they give the Philox node keys)."""
        m = onnx.ModelProto()
        m.CopyFrom(self._model)
        drops = [n for n in m.graph.node
                 if n.op_type == "Dropout" and n.domain in ("", "ai.onnx")]
        if not drops:
            return m
        if default_opset(m) < 12:
            raise GradientError(f"Dropout before opset 12 (this model imports opset "
                                f"{default_opset(m)}) has no training mode: export the model "
                                "with opset 12 or later to train it")
        on = f"{_P}/training_mode"
        m.graph.initializer.append(numpy_helper.from_array(np.array(True), on))
        for k, n in enumerate(drops):
            ins = list(n.input) + [""] * (3 - len(n.input))
            ins[2] = on
            outs = list(n.output) + [""] * (2 - len(n.output))
            if not outs[1]:
                outs[1] = f"{_P}/dropout_mask/{k}"
            del n.input[:], n.output[:]
            n.input.extend(ins)
            n.output.extend(outs)
        return m

    def _philox(self, src: onnx.ModelProto, g: onnx.GraphProto, inferred) -> list:
        """The forward nodes of ``g`` with its random nodes (Dropout, RandomUniform,
        RandomNormal) rewritten by :func:`trainops.random.make_reproducible` into the Philox
        ops, keyed by ``seed`` (with ``comm``: by :func:`trainops.distributed.rank_seed`
        of it and the rank). Each state becomes a graph input of ``g`` (fed from a buffer
        the session updates in place); ``self._rng`` lists (state input, state output,
        initial state)."""
        self._rng = []
        if not any(n.op_type in RANDOM_OPS and n.domain in ("", "ai.onnx") for n in g.node):
            return list(g.node)
        m = onnx.ModelProto()
        m.CopyFrom(src)
        m.graph.CopyFrom(g)
        # Types for make_reproducible: the inferred ones, and those of inputs g lacks yet
        # (parameters, float16 copies).
        declared = {v.name for v in list(m.graph.value_info) + list(m.graph.input)}
        m.graph.value_info.extend(v for v in list(inferred.input) + list(inferred.value_info)
                                  if v.name not in declared)
        key_seed = self.seed
        if self._dist is not None:
            from .distributed import rank_seed

            key_seed = rank_seed(self.seed, self._dist.rank)
        r = make_reproducible(m, key_seed)
        had_in = {i.name for i in m.graph.input}
        new_in = [i for i in r.graph.input if i.name not in had_in]
        new_out = [o.name for o in r.graph.output if o.name not in {o.name for o in m.graph.output}]
        inits = {i.name: i for i in r.graph.initializer}
        for vi, out in zip(new_in, new_out):
            self._rng.append((vi.name, out, numpy_helper.to_array(inits[vi.name])))
        states = {vi.name for vi in new_in}
        have = {i.name for i in g.initializer}
        g.initializer.extend(i for i in r.graph.initializer
                             if i.name not in have and i.name not in states)
        g.input.extend(new_in)
        # The Philox ops' outputs keep the types make_reproducible declares for them.
        rewritten = {o for n in r.graph.node if n.domain == TRAINOPS_DOMAIN for o in n.output}
        keep = [v for v in g.value_info if v.name not in rewritten]
        del g.value_info[:]
        g.value_info.extend(keep + [v for v in r.graph.value_info if v.name in rewritten])
        return list(r.graph.node)

    def _build(self) -> None:
        src = self._model
        mixed = self.policy == "mixed_float16"
        g, nodes, grads, inferred, ptypes, values, copies, loss_t = self._backward()
        loss = self.loss_name

        ps = self.param_names
        r_name, t_name = f"{_P}/lr", f"{_P}/T"
        self.state_names = {s: [f"{_P}/{s}/{p}" for p in ps] for s in self.optimizer.state}
        new = {p: f"{_P}/new/{p}" for p in ps}
        new_state = {s: [f"{_P}/new/{s}/{p}" for p in ps] for s in self.optimizer.state}
        opt = self.optimizer
        state_in = [n for s in opt.state for n in self.state_names[s]]
        state_out = [n for s in opt.state for n in new_state[s]]
        extra_in: list = []
        loss_out = loss
        self._aliases = []  # (input name, output name) pairs bound to one buffer
        if mixed:
            loss_out = f"{_P}/loss_float32"
            nodes.append(helper.make_node("Cast", [loss], [loss_out], to=TensorProto.FLOAT))
            copy_out = [f"{_P}/new/{copies[p]}" for p in ps]
            nodes.append(helper.make_node(
                "MixedPrecisionAdam", [r_name, t_name, f"{_P}/loss_scale"] + ps + grads + state_in,
                [f"{_P}/finite"] + [new[p] for p in ps] + state_out + copy_out,
                domain=TRAINOPS_DOMAIN, name=f"{_P}/mixed_precision_adam",
                copy_dtype=TensorProto.FLOAT16, **opt.attributes()))
            nodes.append(helper.make_node(
                "DynamicLossScale", [f"{_P}/loss_scale", f"{_P}/good_steps", f"{_P}/finite"],
                [f"{_P}/new/loss_scale", f"{_P}/new/good_steps"], domain=TRAINOPS_DOMAIN,
                name=f"{_P}/dynamic_loss_scale"))
            extra_in = [helper.make_tensor_value_info(f"{_P}/loss_scale", TensorProto.FLOAT, [1]),
                        helper.make_tensor_value_info(f"{_P}/good_steps", TensorProto.INT64, [1])]
            for p in ps:
                c = copies[p]
                extra_in.append(helper.make_tensor_value_info(c, TensorProto.FLOAT16,
                                                              list(values[p].shape)))
                self._aliases.append((c, f"{_P}/new/{c}"))
            self._aliases += [(f"{_P}/loss_scale", f"{_P}/new/loss_scale"),
                              (f"{_P}/good_steps", f"{_P}/new/good_steps")]
            outs = [f"{_P}/finite"]
        else:
            nodes.append(helper.make_node(
                opt.op_type, [r_name, t_name] + ps + grads + state_in,
                [new[p] for p in ps] + state_out, domain=TRAINING_DOMAIN,
                name=f"{_P}/{opt.op_type.lower()}", **opt.attributes()))
            outs = []
        self._aliases += [(p, new[p]) for p in ps] + list(zip(state_in, state_out))
        self._aliases += [(i, o) for i, o, _ in self._rng]

        r_type = TensorProto.DOUBLE if any(ptypes[p] == TensorProto.DOUBLE for p in ps) \
            and not mixed else TensorProto.FLOAT
        self._r_dtype = np.float64 if r_type == TensorProto.DOUBLE else np.float32
        g.input.extend([helper.make_tensor_value_info(r_name, r_type, [1]),
                        helper.make_tensor_value_info(t_name, TensorProto.INT64, [1])])
        for p in ps:
            g.input.append(helper.make_tensor_value_info(p, ptypes[p], list(values[p].shape)))
        for s in opt.state:
            for p, n in zip(ps, self.state_names[s]):
                g.input.append(helper.make_tensor_value_info(n, ptypes[p], list(values[p].shape)))
        g.input.extend(extra_in)
        available = {i.name for i in g.input} | {i.name for i in g.initializer}
        del g.node[:]
        g.node.extend(toposort(nodes, available))
        vi = {v.name: v for v in inferred.value_info}
        for name in [loss_out] + [o for _, o in self._aliases] + outs:
            g.output.append(vi[name] if name in vi else helper.make_empty_tensor_value_info(name))
        # Graph outputs need types for onnxruntime's checks: give the aliases their input's.
        types = {i.name: i.type for i in g.input}
        for o in g.output:
            for i_name, o_name in self._aliases:
                if o.name == o_name:
                    o.type.CopyFrom(types[i_name])
            if o.name == loss_out and not o.type.HasField("tensor_type"):
                o.type.CopyFrom(helper.make_tensor_type_proto(
                    TensorProto.FLOAT if mixed else loss_t, None))
            if o.name == f"{_P}/finite":
                o.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.BOOL, []))
        self._loss_out = loss_out
        domains = {o.domain: o.version for o in src.opset_import}
        domains[TRAINING_DOMAIN] = 1
        if mixed or self._rng:
            domains[TRAINOPS_DOMAIN] = 1
        m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in domains.items()],
                              producer_name="trainops.Trainer")
        m.ir_version = src.ir_version
        self.training_model = m

    def _build_distributed(self) -> None:
        """Two models for data-parallel training: the gradient model (forward, loss,
        backward; parameters in, loss and gradients out) and the optimizer model (one
        optimizer node on one flat tensor: all the parameters, or this rank's slice of
        them under ``shard_optimizer``). Element-wise optimizers make the flat update
        the same as the per-tensor one."""
        src = self._model
        d = self._dist
        g, nodes, grads, inferred, ptypes, values, _, loss_t = self._backward()
        ps = self.param_names
        dtypes = {ptypes[p] for p in ps}
        if len(dtypes) != 1:
            raise ValueError("comm= needs parameters of one float type (they share one flat "
                             f"buffer), got {sorted(dtypes)}")
        ptype = dtypes.pop()
        self._r_dtype = np.float64 if ptype == TensorProto.DOUBLE else np.float32
        # Layout of the flat buffers: each parameter (and its gradient) at its offset.
        offsets, total = {}, 0
        for p in ps:
            offsets[p] = total
            total += int(values[p].size)
        n = d.size
        padded = -(-total // n) * n if self.shard_optimizer else total
        self._layout = (offsets, total, padded, padded // n if self.shard_optimizer else total)

        taken = {i.name for i in g.input} | {i.name for i in g.initializer}
        for p in ps:
            g.input.append(helper.make_tensor_value_info(p, ptype, list(values[p].shape)))
        del g.output[:]
        vi = {v.name: v for v in inferred.value_info}
        loss = self.loss_name
        g.output.append(vi[loss] if loss in vi else helper.make_tensor_value_info(
            loss, loss_t, None))
        self._grad_outputs = []
        seen = {loss}
        for p, name in zip(ps, grads):
            if name in taken or name in seen or name in ps:
                # a gradient that is an input, a constant or another output: copy it
                new = f"{_P}/grad/{p}"
                nodes.append(helper.make_node("Identity", [name], [new],
                                              name=f"{_P}/grad_copy/{p}"))
                name = new
            seen.add(name)
            self._grad_outputs.append(name)
            g.output.append(helper.make_tensor_value_info(name, ptype, list(values[p].shape)))
        for _, out, _ in self._rng:
            g.output.append(helper.make_tensor_value_info(out, TensorProto.UINT32, [6]))
        available = {i.name for i in g.input} | {i.name for i in g.initializer}
        del g.node[:]
        g.node.extend(toposort(nodes, available))
        imports = list(src.opset_import)
        if self._rng and not any(o.domain == TRAINOPS_DOMAIN for o in imports):
            imports.append(helper.make_opsetid(TRAINOPS_DOMAIN, 1))
        m = helper.make_model(g, opset_imports=imports, producer_name="trainops.Trainer")
        m.ir_version = src.ir_version
        self.gradient_model = m

        shard = self._layout[3]
        opt = self.optimizer
        r_type = TensorProto.DOUBLE if ptype == TensorProto.DOUBLE else TensorProto.FLOAT
        x, gr = f"{_P}/flat/params", f"{_P}/flat/grads"
        st = [f"{_P}/flat/{s}" for s in opt.state]
        og = helper.make_graph(
            [helper.make_node(opt.op_type, [f"{_P}/lr", f"{_P}/T", x, gr] + st,
                              [x + "/new"] + [s + "/new" for s in st], domain=TRAINING_DOMAIN,
                              name=f"{_P}/{opt.op_type.lower()}", **opt.attributes())],
            "trainops_optimizer",
            [helper.make_tensor_value_info(f"{_P}/lr", r_type, [1]),
             helper.make_tensor_value_info(f"{_P}/T", TensorProto.INT64, [1])]
            + [helper.make_tensor_value_info(v, ptype, [shard]) for v in [x, gr] + st],
            [helper.make_tensor_value_info(v + "/new", ptype, [shard]) for v in [x] + st])
        om = helper.make_model(og, opset_imports=[helper.make_opsetid("", default_opset(src)),
                                                  helper.make_opsetid(TRAINING_DOMAIN, 1)],
                               producer_name="trainops.Trainer")
        om.ir_version = src.ir_version
        self.optimizer_model = om
        self.training_model = m  # the model that carries the forward pass

    def _make_distributed_sessions(self) -> None:
        import onnxruntime as ort

        from . import get_library_path

        d = self._dist
        offsets, total, padded, shard = self._layout
        ps = self.param_names
        so = ort.SessionOptions()
        so.register_custom_ops_library(get_library_path())
        so.intra_op_num_threads = int(self.threads)
        so.inter_op_num_threads = 1
        # Ranks may outnumber cores: idle intra-op workers must not spin.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(self.gradient_model.SerializeToString(), so,
                                            providers=providers)
        self.optimizer_session = ort.InferenceSession(
            self.optimizer_model.SerializeToString(), so, providers=providers)
        dtype = self._r_dtype
        # Flat buffers MPI reduces and gathers in place; ONNX Runtime reads the parameters
        # from, and writes the gradients into, views of them (OrtValues over their memory).
        self._flat_params = np.zeros(padded, dtype)
        self._flat_grads = np.zeros(padded, dtype)
        for p in ps:
            o = offsets[p]
            self._flat_params[o:o + self._initial[p].size] = self._initial[p].reshape(-1)
        # Every rank starts from rank 0's parameters, and all must have the same layout.
        import zlib

        # The seed counts only where there are random nodes (0 stands for none).
        seed = int(np.array(self.seed & (2**64 - 1), np.uint64).view(np.int64)) \
            if self._rng else 0
        sig = [total, padded, zlib.crc32(self.gradient_model.SerializeToString()), seed]
        sigs = d.allgather_values(sig, "the model check (Allgather)")
        bad = [r for r in range(d.size) if list(sigs[r][:3]) != list(sigs[0][:3])]
        if bad:
            raise ValueError(f"rank {d.rank}: ranks {bad} built a different training model "
                             "than rank 0 (model, params, optimizer or policy differ)")
        bad = [r for r in range(d.size) if sigs[r][3] != sigs[0][3]]
        if bad:
            raise ValueError(f"rank {d.rank}: ranks {bad} were given another seed than rank "
                             "0; give every rank the same seed= (the Trainer partitions the "
                             "random streams by rank itself)")
        d.bcast_(self._flat_params, "the initial Bcast of the parameters")
        d.seconds = 0.0
        self._arrays: dict[str, np.ndarray] = {}
        self._values: dict[str, Any] = {}
        for p in ps:
            o, shape = offsets[p], self._initial[p].shape
            self._arrays[p] = self._flat_params[o:o + self._initial[p].size].reshape(shape)
        self.T = 1
        self.lr = float(self.optimizer.lr)
        self.skipped = 0
        self.timings = {"gradients": 0.0, "communication": 0.0, "optimizer": 0.0, "steps": 0}

        # The gradient session: parameters in, gradients out, all views of flat buffers.
        val = ort.OrtValue.ortvalue_from_numpy
        keep = []
        gb = self._binding = self.session.io_binding()
        for p, name in zip(ps, self._grad_outputs):
            o, n_, shape = offsets[p], self._initial[p].size, self._initial[p].shape
            pv, gv = val(self._arrays[p]), val(self._flat_grads[o:o + n_].reshape(shape))
            keep += [pv, gv]
            gb.bind_ortvalue_input(p, pv)
            gb.bind_ortvalue_output(name, gv)
        out = self.session.get_outputs()[0]
        if out.shape is None or not all(isinstance(x, int) for x in out.shape) \
                or int(np.prod(out.shape)) != 1:
            raise GradientError(f"loss {self.loss_name!r} must be a scalar with a static "
                                f"shape, got {out.shape}")
        self._loss_buf = np.zeros(out.shape, {"tensor(float)": np.float32,
                                              "tensor(double)": np.float64}[out.type])
        lv = val(self._loss_buf)
        keep.append(lv)
        gb.bind_ortvalue_output(self.loss_name, lv)
        for name, out, initial in self._rng:  # this rank's Philox states, updated in place
            self._arrays[name] = initial.copy()
            sv = val(self._arrays[name])
            keep.append(sv)
            gb.bind_ortvalue_input(name, sv)
            gb.bind_ortvalue_output(out, sv)

        # The optimizer session: this rank's slice (or all) of params, grads and state.
        lo = d.rank * shard if self.shard_optimizer else 0
        self._param_slice = self._flat_params[lo:lo + shard]
        self._grad_shard = np.zeros(shard, dtype) if self.shard_optimizer \
            else self._flat_grads
        self._flat_state = {s: np.zeros(shard, dtype) for s in self.optimizer.state}
        if not self.shard_optimizer:  # per-parameter views, as a one-process Trainer has
            self.state_names = {s: [f"{_P}/{s}/{p}" for p in ps] for s in self.optimizer.state}
            for s in self.optimizer.state:
                for p, name in zip(ps, self.state_names[s]):
                    o = offsets[p]
                    self._arrays[name] = self._flat_state[s][o:o + self._initial[p].size] \
                        .reshape(self._initial[p].shape)
        else:
            self.state_names = {s: [f"{_P}/{s}/shard"] for s in self.optimizer.state}
            for s in self.optimizer.state:
                self._arrays[f"{_P}/{s}/shard"] = self._flat_state[s]
        ob = self._opt_binding = self.optimizer_session.io_binding()
        xv, gv = val(self._param_slice), val(self._grad_shard)
        keep += [xv, gv]
        ob.bind_ortvalue_input(f"{_P}/flat/params", xv)
        ob.bind_ortvalue_output(f"{_P}/flat/params/new", xv)
        ob.bind_ortvalue_input(f"{_P}/flat/grads", gv)
        for s, arr in self._flat_state.items():
            sv = val(arr)
            keep.append(sv)
            ob.bind_ortvalue_input(f"{_P}/flat/{s}", sv)
            ob.bind_ortvalue_output(f"{_P}/flat/{s}/new", sv)
        self._keep = keep
        self._scale = dtype(1.0 / d.size)

    def _step_distributed(self, feeds: Mapping[str, Any]) -> float:
        d = self._dist
        d.step = self.T
        t0 = time.perf_counter()
        bind = self._binding
        for name in self.input_names:
            bind.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        self.session.run_with_iobinding(bind)
        t1 = time.perf_counter()
        # The loss (for the caller) and the gradients, summed over the ranks at once.
        reqs = [d.start_allreduce(self._loss_buf.reshape(-1))]
        if self.shard_optimizer:
            reqs.append(d.start_reduce_scatter(self._flat_grads, self._grad_shard))
            what = "the gradients' ReduceScatter"
        else:
            reqs.append(d.start_allreduce(self._flat_grads))
            what = "the gradients' Allreduce"
        d.wait(reqs, what)
        self._grad_shard *= self._scale  # sum -> mean over the ranks
        t2 = time.perf_counter()
        ob = self._opt_binding
        ob.bind_cpu_input(f"{_P}/lr", np.array([self.lr], self._r_dtype))
        ob.bind_cpu_input(f"{_P}/T", np.array([self.T], np.int64))
        self.optimizer_session.run_with_iobinding(ob)
        t3 = time.perf_counter()
        if self.shard_optimizer:
            d.allgather_(self._flat_params, "the parameters' Allgather")
        t4 = time.perf_counter()
        self.T += 1
        tm = self.timings
        tm["gradients"] += t1 - t0
        tm["optimizer"] += t3 - t2
        tm["communication"] += (t2 - t1) + (t4 - t3)
        tm["steps"] += 1
        return float(self._loss_buf.reshape(-1)[0]) / d.size

    def memory(self) -> dict[str, int]:
        """Bytes this process holds for training: ``parameters``, ``gradients`` (the
        buffers ONNX Runtime writes them to; with ``comm``, plus this rank's reduced
        slice under ``shard_optimizer``) and ``optimizer_state`` (1/N of the whole under
        ``shard_optimizer``)."""
        if self._dist is None:
            params = sum(self._arrays[p].nbytes for p in self.param_names)
            state = sum(self._arrays[n].nbytes for s in self.optimizer.state
                        for n in self.state_names[s])
            return {"parameters": params, "gradients": params, "optimizer_state": state}
        grads = self._flat_grads.nbytes + (self._grad_shard.nbytes if self.shard_optimizer
                                           else 0)
        return {"parameters": self._flat_params.nbytes, "gradients": grads,
                "optimizer_state": sum(a.nbytes for a in self._flat_state.values())}

    def _make_session(self) -> None:
        import onnxruntime as ort

        from . import get_library_path

        so = ort.SessionOptions()
        so.register_custom_ops_library(get_library_path())
        if self.threads is not None:
            so.intra_op_num_threads = int(self.threads)
            so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.session = ort.InferenceSession(self.training_model.SerializeToString(), so,
                                            providers=["CPUExecutionProvider"])
        self._arrays: dict[str, np.ndarray] = {}
        self._values: dict[str, Any] = {}
        ps = self.param_names

        def put(name, arr):
            # The OrtValue wraps this array's memory (and keeps it alive): the session
            # updates it in place, and numpy reads it without a copy.
            arr = np.array(arr, order="C", copy=True)
            self._arrays[name] = arr
            self._values[name] = ort.OrtValue.ortvalue_from_numpy(arr)

        for p in ps:
            put(p, self._initial[p])
        for s in self.optimizer.state:
            for p, n in zip(ps, self.state_names[s]):
                put(n, np.zeros_like(self._initial[p]))
        mixed = self.policy == "mixed_float16"
        if mixed:
            from .mixed_precision import KERAS_INITIAL_LOSS_SCALE

            put(f"{_P}/loss_scale", np.array([KERAS_INITIAL_LOSS_SCALE], np.float32))
            put(f"{_P}/good_steps", np.array([0], np.int64))
            for p in ps:
                put(f"{_P}/{p}/float16", self._initial[p].astype(np.float16))
        for name, _, initial in self._rng:
            put(name, initial)
        self.T = 1
        self.lr = float(self.optimizer.lr)
        self.skipped = 0
        self._binding = bind = self.session.io_binding()
        for i_name, o_name in self._aliases:
            v = self._values[i_name]
            bind.bind_ortvalue_input(i_name, v)
            bind.bind_ortvalue_output(o_name, v)
        out = self.session.get_outputs()[0]
        shape = out.shape
        dtype = {"tensor(float)": np.float32, "tensor(double)": np.float64,
                 "tensor(float16)": np.float16}[out.type]
        if shape is not None and all(isinstance(d, int) for d in shape):
            put(self._loss_out, np.zeros(shape, dtype))
            bind.bind_ortvalue_output(self._loss_out, self._values[self._loss_out])
        else:
            raise GradientError(f"loss {self.loss_name!r} must have a static shape "
                                f"(one element), got {shape}")
        if int(np.prod(shape)) != 1:
            raise GradientError(f"loss {self.loss_name!r} must be a scalar, has shape {shape}")
        if mixed:
            put(f"{_P}/finite", np.zeros((), np.bool_))
            bind.bind_ortvalue_output(f"{_P}/finite", self._values[f"{_P}/finite"])

    # -- training ----------------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        return self.lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.lr = float(value)

    @property
    def loss_scale(self) -> float | None:
        v = self._arrays.get(f"{_P}/loss_scale")
        return None if v is None else float(v[0])

    def step(self, feeds: Mapping[str, Any]) -> float:
        """One training step on ``feeds`` (every data input of the model): forward, loss,
        backward and the optimizer update, in one ``run_with_iobinding``. Returns the loss
        before the update. Under ``mixed_float16`` a step whose gradients are not finite
        is skipped (the weights stay) and ``skipped`` counts it.

        With ``comm``: ``feeds`` is this rank's shard of the batch; every rank must call
        ``step`` the same number of times; the gradients are averaged over the ranks
        before the update and the loss returned is the mean of the ranks' losses."""
        bind = self._binding
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"step: feeds lack model inputs {missing}")
        if self._dist is not None:
            return self._step_distributed(feeds)
        for name in self.input_names:
            bind.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        bind.bind_cpu_input(f"{_P}/lr", np.array([self.lr], self._r_dtype))
        bind.bind_cpu_input(f"{_P}/T", np.array([self.T], np.int64))
        self.session.run_with_iobinding(bind)
        self.T += 1
        if self.policy == "mixed_float16" and not bool(self._arrays[f"{_P}/finite"]):
            self.skipped += 1
        return float(self._arrays[self._loss_out].reshape(-1)[0])

    # -- results -------------------------------------------------------------------------
    def parameters(self) -> dict[str, np.ndarray]:
        """The current weights (copies), by initializer name."""
        return {p: self._arrays[p].copy() for p in self.param_names}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer state (copies) by name; under ``shard_optimizer``, this rank's
        flat slice of each state tensor (``trainops/<V|H>/shard``)."""
        return {n: self._arrays[n].copy() for s in self.optimizer.state
                for n in self.state_names[s]}

    def export(self) -> onnx.ModelProto:
        """The original model (inference graph, loss included) with the trained weights:
        no trainops op, so plain onnxruntime runs it. Its Dropout nodes are plain ONNX
        ``Dropout`` in inference mode (as PyTorch's ``model.eval()``): any
        ``training_mode`` input is removed, so they pass their input through."""
        m = onnx.ModelProto()
        m.CopyFrom(self._model)
        for n in m.graph.node:
            if n.op_type == "Dropout" and n.domain in ("", "ai.onnx") and len(n.input) > 2:
                ins = list(n.input[:2])
                del n.input[:]
                n.input.extend(ins)
        params = self.parameters()
        for init in m.graph.initializer:
            if init.name in params:
                init.CopyFrom(numpy_helper.from_array(params[init.name], init.name))
        return m

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, path) -> None:
        """A checkpoint (``.npz``): the model, the weights, the optimizer state, the update
        count, the learning rate, the loss scale, the seed and the Philox states of the
        random nodes. :meth:`load` resumes from it, bit for bit.

        With ``comm`` (not sharded) every rank holds the whole state: rank 0 writing the
        file is enough, and a one-process Trainer can resume from it (the Philox states
        saved are the writing rank's own: a one-process run resumed from rank 0's file
        continues rank 0's streams, as rank 0 and one process share them). Checkpoints of a
        ``shard_optimizer`` trainer are not implemented yet."""
        if self.shard_optimizer:
            raise NotImplementedError("save() of a shard_optimizer trainer: each rank holds "
                                      "1/N of the optimizer state; not implemented yet")
        config = {"loss": self.loss_name, "optimizer": self.optimizer.to_dict(),
                  "params": self.param_names, "policy": self.policy, "T": self.T,
                  "lr": self.lr, "skipped": self.skipped, "seed": self.seed}
        arrays = {f"value:{k}": v for k, v in self._arrays.items()}
        arrays["model"] = np.frombuffer(self._model.SerializeToString(), np.uint8)
        arrays["config"] = np.frombuffer(json.dumps(config).encode(), np.uint8)
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path, threads: int | None = None) -> "Trainer":
        with np.load(path) as z:
            config = json.loads(bytes(z["config"]).decode())
            model = onnx.load_from_string(bytes(z["model"]))
            values = {k[len("value:"):]: z[k] for k in z.files if k.startswith("value:")}
        state = {"values": values, "T": config["T"], "lr": config["lr"],
                 "skipped": config["skipped"]}
        return cls(model, config["loss"], _optim.from_dict(config["optimizer"]),
                   params=config["params"], policy=config["policy"], threads=threads,
                   seed=config.get("seed"), _state=state)

    def _restore(self, state) -> None:
        for name, arr in state["values"].items():
            if name not in self._arrays:
                raise ValueError(f"checkpoint value {name!r} is not part of this trainer")
            np.copyto(self._arrays[name], arr)
        self.T = int(state["T"])
        self.lr = float(state["lr"])
        self.skipped = int(state["skipped"])
