"""Training an ONNX model entirely inside ONNX Runtime: :class:`Trainer`, the façade.

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

The work is done by: :mod:`.graph` (the step graph, :class:`~.spec.StepGraph`),
:mod:`.runtime` (its session and in-place bindings), :mod:`.dist_graph` and
:mod:`.dist_runtime` (data-parallel), :mod:`.checkpoint` (save/load).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any, Mapping, Sequence

import numpy as np

import onnx
from onnx import numpy_helper

from .. import losses as _losses
from .. import optim as _optim
from ..autodiff import coverage as _coverage
from ..random import _seed_bits
from . import checkpoint as _checkpoint
from .backward import data_inputs, resolve_params
from .batchnorm import inference_batchnorm
from .graph import build_step_graph
from .importer import import_model
from .runtime import StepRuntime
from .spec import BATCHNORM_MODES, StepGraph, StepOptions, check_policy

__all__ = ["Trainer"]

log = logging.getLogger("trainops")


class Trainer:
    """Trains ``model`` (an ``onnx.ModelProto``, bytes or a path; external data is loaded
    beside a path), minimising ``loss`` in ONNX Runtime.

    The model is taken as exported (:func:`trainops.train.importer.import_model`): any
    opset from 7 on (upgraded where the gradient rules need it, said in one log line),
    initializers listed as inputs, nodes in any order, shape chains of the classic torch
    exporter. Every op type between the parameters and the loss must have a gradient rule:
    a GradientError lists all that do not (``python -m trainops coverage`` shows it).

    - ``loss``: the name of a scalar float tensor of the model, or a
      :mod:`trainops.losses` loss (``losses.cross_entropy("logits")``): its nodes and its
      data input (``labels`` / ``target``) are added to the training graph, not to
      :meth:`export`'s model;
    - ``params``: the initializers to train (default: the float initializers that are
      weights of an op, :mod:`trainops.train.params`; the choice is ``param_names``,
      logged once);
    - ``batchnorm``: ``"train"`` (default, as PyTorch's ``model.train()``): every
      BatchNormalization normalises with the batch statistics and updates its running
      mean and variance in place each step (with its momentum, the unbiased batch
      variance as PyTorch does); they are state (``running_stats()``, checkpoints,
      :meth:`export`), never parameters. ``"frozen"``: the inference form, the running
      statistics fixed (fine-tuning);
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

    def __init__(self, model, loss: str | _losses.Loss, optimizer: _optim.Optimizer | None = None,
                 params: Sequence[str] | None = None, policy: str = "float32",
                 threads: int | None = None, seed: int | None = None, comm=None,
                 shard_optimizer: bool = False, collective_timeout: float | None = None,
                 *, batchnorm: str = "train", _state=None):
        if batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"batchnorm {batchnorm!r}: expected 'train' or 'frozen'")
        self.batchnorm = batchnorm
        self._model = import_model(model, batchnorm)
        self.loss = loss
        if isinstance(loss, _losses.Loss):
            train_model = loss.attach(self._model)
            self.loss_name = loss.name
        elif isinstance(loss, str):
            train_model, self.loss_name = self._model, loss
        else:
            raise TypeError(f"loss: expected a tensor name or a trainops.losses loss, got "
                            f"{type(loss).__name__}")
        self.optimizer = optimizer if optimizer is not None else _optim.Adam()
        self.policy = check_policy(policy, self.optimizer)
        if seed is not None:
            _seed_bits(seed)  # TypeError / ValueError for a seed that is not a 64-bit int
        self.shard_optimizer = bool(shard_optimizer)
        self._dist = None
        if comm is not None:
            from ..distributed import Collectives

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
        key_seed = self.seed
        if self._dist is not None:
            from ..distributed import rank_seed

            key_seed = rank_seed(self.seed, self._dist.rank)
        chosen = resolve_params(train_model, self.loss_name, params)
        if params is None:
            size = sum(int(np.prod(i.dims)) for i in train_model.graph.initializer
                       if i.name in set(chosen))
            log.info("training %d parameters (%d values) chosen by default: %s%s", len(chosen),
                     size, ", ".join(chosen[:8]), ", ..." if len(chosen) > 8 else "")
        # Every op type between the parameters and the loss, each with its rule
        # (GradientError listing all that have none).
        self.coverage = _coverage.check(train_model, self.loss_name, chosen, batchnorm == "train")
        options = StepOptions(self.loss_name, self.optimizer, chosen, self.policy, key_seed,
                              batchnorm)
        self.input_names = data_inputs(train_model)
        self.step_graph: StepGraph | None = None
        if self._dist is None:
            self.step_graph = build_step_graph(train_model, options)
            self.param_names = self.step_graph.param_names
            self.training_model = self.step_graph.model
            self.runtime = StepRuntime(self.step_graph, threads)
            self._rng = [(e.input, e.output, e.initial) for e in self.step_graph.of_kind("rng")]
            opt_states = self.step_graph.of_kind("optimizer")
            self.state_names = {s: [e.input for e in opt_states if e.slot == s]
                                for s in self.optimizer.state}
            self._bn = [e.input for e in self.step_graph.of_kind("bn_stat")]
        else:
            from .dist_graph import build_distributed
            from .dist_runtime import DistributedRuntime

            graphs = build_distributed(train_model, options, self._dist.size,
                                       self.shard_optimizer)
            self._bn = [e.input for e in graphs.bn]
            self.param_names = list(graphs.options.params)
            self.gradient_model = graphs.gradient_model
            self.optimizer_model = graphs.optimizer_model
            self.training_model = graphs.gradient_model  # the model with the forward pass
            self.runtime = DistributedRuntime(graphs, self._dist, threads, self.seed,
                                              self.shard_optimizer)
            self._rng = [(e.input, e.output, e.initial) for e in graphs.rng]
            self.optimizer_session = self.runtime.optimizer_session
            self.state_names = self.runtime.state_names
            self.timings = self.runtime.timings
        self.session = self.runtime.session
        self._arrays: dict[str, np.ndarray] = self.runtime.arrays
        self.T = 1
        self.lr = float(self.optimizer.lr)
        self.skipped = 0
        if _state is not None:
            self.T, self.lr, self.skipped = _checkpoint.restore(self._arrays, _state)

    # -- training ----------------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The learning rate of the next steps (the optimizer node's ``R`` input)."""
        return self.lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.lr = float(value)

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale under ``mixed_float16``, else None."""
        v = self._arrays.get("trainops/loss_scale")
        return None if v is None else float(v[0])

    def step(self, feeds: Mapping[str, Any]) -> float:
        """One training step on ``feeds`` (every data input of the model): forward, loss,
        backward and the optimizer update, in one ``run_with_iobinding``. Returns the loss
        before the update. Under ``mixed_float16`` a step whose gradients are not finite
        is skipped (the weights stay) and ``skipped`` counts it.

        With ``comm``: ``feeds`` is this rank's shard of the batch; every rank must call
        ``step`` the same number of times; the gradients are averaged over the ranks
        before the update and the loss returned is the mean of the ranks' losses."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"step: feeds lack model inputs {missing}")
        loss = self.runtime.run(feeds, self.lr, self.T)
        self.T += 1
        if self._dist is None and not self.runtime.finite:
            self.skipped += 1
        return loss

    def memory(self) -> dict[str, int]:
        """Bytes this process holds for training: ``parameters``, ``gradients`` (the
        buffers ONNX Runtime writes them to; with ``comm``, plus this rank's reduced
        slice under ``shard_optimizer``) and ``optimizer_state`` (1/N of the whole under
        ``shard_optimizer``)."""
        if self._dist is not None:
            return self.runtime.memory()
        params = sum(self._arrays[p].nbytes for p in self.param_names)
        state = sum(self._arrays[n].nbytes for s in self.optimizer.state
                    for n in self.state_names[s])
        return {"parameters": params, "gradients": params, "optimizer_state": state}

    # -- results -------------------------------------------------------------------------
    def parameters(self) -> dict[str, np.ndarray]:
        """The current weights (copies), by initializer name."""
        return {p: self._arrays[p].copy() for p in self.param_names}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer state (copies) by name; under ``shard_optimizer``, this rank's
        flat slice of each state tensor (``trainops/<V|H>/shard``)."""
        return {n: self._arrays[n].copy() for s in self.optimizer.state
                for n in self.state_names[s]}

    def running_stats(self) -> dict[str, np.ndarray]:
        """The BatchNormalization running means and variances (copies) by initializer
        name: updated each step under ``batchnorm="train"``, else empty."""
        return {n: self._arrays[n].copy() for n in self._bn}

    @property
    def loss_config(self):
        """The loss as a checkpoint stores it: a tensor name or a loss' ``to_dict()``."""
        return self.loss.to_dict() if isinstance(self.loss, _losses.Loss) else self.loss

    def export(self) -> onnx.ModelProto:
        """The model as imported (inference graph, a :mod:`trainops.losses` loss left out)
        with the trained weights and running statistics: no trainops op, so plain
        onnxruntime runs it. Its Dropout nodes are plain ONNX ``Dropout`` in inference
        mode (as PyTorch's ``model.eval()``): any ``training_mode`` input is removed, so
        they pass their input through; its BatchNormalization nodes are in the inference
        form, with the running statistics."""
        m = onnx.ModelProto()
        m.CopyFrom(self._model)
        inference_batchnorm(m)
        for n in m.graph.node:
            if n.op_type == "Dropout" and n.domain in ("", "ai.onnx") and len(n.input) > 2:
                ins = list(n.input[:2])
                del n.input[:]
                n.input.extend(ins)
        params = self.parameters()
        params.update(self.running_stats())
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
        _checkpoint.save(self, path)

    @classmethod
    def load(cls, path, threads: int | None = None) -> "Trainer":
        """The trainer saved at ``path`` (:meth:`save`), ready to continue."""
        model, config, state = _checkpoint.read(path)
        loss = config["loss"]
        loss = _losses.from_dict(loss) if isinstance(loss, dict) else loss
        return cls(model, loss, _optim.from_dict(config["optimizer"]),
                   params=config["params"], policy=config["policy"], threads=threads,
                   seed=config.get("seed"), batchnorm=config.get("batchnorm", "train"),
                   _state=state)
