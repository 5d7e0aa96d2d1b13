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

import hashlib
import os
import secrets
from typing import Any, Mapping, Sequence

import numpy as np

import onnx
from onnx import numpy_helper

from .. import optim as _optim
from ..random import _seed_bits
from . import artifacts as _artifacts
from . import checkpoint as _checkpoint
from . import update_options as _schedules
from .accumulate_runtime import AccumulatingRuntime
from .backward import data_inputs
from .graph import build_step_graph
from .placement import TrainingModel, portable_graph
from .placement import resolve as resolve_placement
from .runtime import StepRuntime
from .spec import StepGraph, StepOptions, check_policy, check_update_options

__all__ = ["Trainer"]


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
      ``trainops.distributed.rank_seed(seed, r)`` instead of ``seed`` (rank 0: ``seed``);
    - ``clip_grad_norm``: ``max_norm`` of PyTorch's ``clip_grad_norm_`` (total 2-norm over
      every parameter's gradient, coefficient ``min(max_norm / (norm + 1e-6), 1)``),
      applied inside the step graph before the update (:mod:`trainops.train.clip`); the
      total norm before clipping is ``last_grad_norm``. Under ``mixed_float16`` it is the
      norm of the unscaled gradients, and the clipped ones go to the optimizer as float32;
    - ``accumulate``: ``k`` >= 1: :meth:`step` adds each micro-batch's gradients into
      accumulation buffers (``grad_accum`` state) and updates on every k-th call, with
      their mean (:mod:`trainops.train.accumulate`): k micro-batches of B train as one
      batch of kB with a mean loss. ``T`` counts updates;
    - ``schedule``: a learning-rate schedule (:mod:`trainops.optim.schedules`, or any
      callable ``step -> lr``): each update uses ``schedule(T - 1)`` (``T - 1`` updates
      made so far); a schedule without ``lr`` takes the optimizer's;
    - ``device``: ``"cpu"`` (the default), ``"cuda"`` (onnxruntime-gpu's
      ``CUDAExecutionProvider`` then the CPU, with trainops' CUDA kernels: ``TRAINOPS_CUDA=1``)
      or ``"auto"`` (the CPU for now: CUDA becomes its choice once trainops' CUDA kernels are
      verified on a GPU); exclusive with ``providers``;
    - ``providers``: as ``onnxruntime.InferenceSession``'s (names or ``(name, options)``
      pairs), or a list of ``OrtEpDevice`` (``onnxruntime.get_ep_devices()``), given to
      ``SessionOptions.add_provider_for_devices``;
    - ``portable``: rewrite the step's trainops nodes as standard ONNX ops
      (:func:`trainops.portable.rewrite`) for EPs that take no custom-op library; ``None``:
      True for the EPs in :data:`trainops.train.placement.NO_CUSTOM_OPS` (DirectML, WebGPU,
      CoreML, OpenVINO, QNN, ...), else False. Not with ``comm``.

    Every other graph input is data, fed to :meth:`step`. ``training_model`` is the model the
    session runs: read its attributes directly (``trainer.training_model.graph``) or call it
    for the ``onnx.ModelProto`` itself (``trainer.training_model()``).
    """

    def __init__(self, model, loss: str, optimizer: _optim.Optimizer | None = None,
                 params: Sequence[str] | None = None, policy: str = "float32",
                 threads: int | None = None, seed: int | None = None, comm=None,
                 shard_optimizer: bool = False, collective_timeout: float | None = None,
                 *, clip_grad_norm: float | None = None, accumulate: int = 1,
                 schedule=None, providers=None, portable: bool | None = None,
                 device: str | None = None, _step_graph: StepGraph | None = None):
        if isinstance(model, (str, os.PathLike)):
            model = onnx.load(os.fspath(model))
        self._model = onnx.ModelProto()
        if isinstance(model, bytes):
            self._model.ParseFromString(model)
        else:
            self._model.CopyFrom(model)
        # The bytes a checkpoint stores, and their hash that identifies the model.
        self._model_bytes = model if isinstance(model, bytes) else \
            self._model.SerializeToString()
        self.model_sha256 = hashlib.sha256(self._model_bytes).hexdigest()
        self.loss_name = loss
        self.optimizer = _optim.check_optimizer(optimizer)
        self.policy = check_policy(policy, self.optimizer)
        self.clip_grad_norm, self.accumulate = check_update_options(clip_grad_norm, accumulate)
        self.schedule = _schedules.bind(schedule, self.optimizer)
        if seed is not None:
            _seed_bits(seed)  # TypeError / ValueError for a seed that is not a 64-bit int
        self.shard_optimizer = bool(shard_optimizer)
        self.placement = resolve_placement(providers, portable, device)
        self._dist = None
        if comm is not None and not self.placement.is_cpu:
            raise NotImplementedError("comm= trains on the CPU only for now: leave providers, "
                                      "portable and device unset")
        if comm is not None:
            from ..distributed import Collectives

            if self.policy == "mixed_float16":
                raise NotImplementedError("comm= with policy 'mixed_float16' is not "
                                          "supported yet (the finite check and the loss "
                                          "scale would need to agree across ranks)")
            if self.clip_grad_norm is not None or self.accumulate > 1:
                raise NotImplementedError("comm= with clip_grad_norm or accumulate is not "
                                          "supported yet")
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
        options = StepOptions(loss, self.optimizer, params, self.policy, key_seed,
                              self.clip_grad_norm, self.accumulate)
        self.input_names = data_inputs(self._model)
        self.step_graph: StepGraph | None = None
        if self._dist is None:
            # _step_graph: a step graph read back (from_artifacts), not built again.
            self.step_graph = _step_graph or build_step_graph(self._model, options)
            if self.placement.portable and _step_graph is None:
                self.step_graph = portable_graph(self.step_graph, key_seed)
            self.param_names = self.step_graph.param_names
            self.training_model = TrainingModel(self.step_graph.model)
            if self.step_graph.apply_model is None:
                self.runtime = StepRuntime(self.step_graph, threads, placement=self.placement)
            elif self.placement.is_cpu:
                self.runtime = AccumulatingRuntime(self.step_graph, threads)
            else:
                raise NotImplementedError("accumulate > 1 trains on the CPU only for now: "
                                          "leave providers, portable and device unset")
            self._rng = [(e.input, e.output, e.initial) for e in self.step_graph.of_kind("rng")]
            opt_states = self.step_graph.of_kind("optimizer")
            self.state_names = {s: [e.input for e in opt_states if e.slot == s]
                                for s in self.optimizer.state}
        else:
            from .dist_graph import build_distributed
            from .dist_runtime import DistributedRuntime

            graphs = build_distributed(self._model, options, self._dist.size,
                                       self.shard_optimizer)
            self.param_names = list(graphs.options.params)
            self.gradient_model = graphs.gradient_model
            self.optimizer_model = graphs.optimizer_model
            self.training_model = TrainingModel(graphs.gradient_model)  # the forward pass
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
        if self.schedule is not None:
            self.lr = _schedules.lr_at(self.schedule, self.T)

    def _states(self) -> dict[str, np.ndarray]:
        """Every state buffer (what a checkpoint holds), by its input name."""
        if self.step_graph is not None:
            return {e.input: self._arrays[e.input] for e in self.step_graph.states}
        return dict(self._arrays)  # the distributed runtime's arrays are all states

    # -- training ----------------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The learning rate of the next steps (the optimizer node's ``R`` input)."""
        return self.lr

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        if self.schedule is not None:
            raise ValueError("learning_rate: this trainer's schedule sets it before every "
                             "update (Trainer(schedule=None) to set it by hand)")
        self.lr = _optim.check_lr(value, "Trainer.learning_rate")

    @property
    def last_grad_norm(self) -> float | None:
        """With ``clip_grad_norm``: the total 2-norm of the last update's gradients before
        clipping (unscaled under ``mixed_float16``; inf or NaN for non-finite gradients,
        as torch's ``clip_grad_norm_`` returns); None before the first update or without
        ``clip_grad_norm``."""
        name = self.step_graph.norm_output if self.step_graph is not None else None
        if name is None or not getattr(self, "_updated", False):
            return None
        return float(self._arrays[name][0])

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale under ``mixed_float16``, else None."""
        v = self._arrays.get("trainops/loss_scale")
        return None if v is None else float(v[0])

    def step(self, feeds: Mapping[str, Any]) -> float:
        """One training step on ``feeds`` (every data input of the model): forward, loss,
        backward and the optimizer update, in one ``run_with_iobinding``. Returns the loss
        before the update. Under ``mixed_float16`` a step whose gradients are not finite
        is skipped (the weights and moments stay, ``T`` does not advance, the loss scale
        halves) and ``skipped`` counts it. With ``accumulate=k`` only every k-th call
        updates (the others add the micro-batch's gradients); each call returns its
        micro-batch's loss. With ``schedule`` the update's learning rate is
        ``schedule(T - 1)``.

        All or nothing (without ``comm`` and ``accumulate``): if the step fails (an error
        from any node), no state has changed (weights, optimizer state, ``T``, loss scale,
        Philox states).

        With ``comm``: ``feeds`` is this rank's shard of the batch; every rank must call
        ``step`` the same number of times; the gradients are averaged over the ranks
        before the update and the loss returned is the mean of the ranks' losses."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"step: feeds lack model inputs {missing}")
        if self.schedule is not None:
            self.lr = _schedules.lr_at(self.schedule, self.T)
        loss = self.runtime.run(feeds, self.lr, self.T)
        if not getattr(self.runtime, "updated", True):
            return loss  # a micro-batch added to the accumulation buffers: no update
        self._updated = True  # an update ran (or was skipped): last_grad_norm is its
        if self._dist is None and not self.runtime.finite:
            self.skipped += 1  # not an update: T stays (as PyTorch's GradScaler and Keras)
        else:
            self.T += 1
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
        out = {"parameters": params, "gradients": params, "optimizer_state": state}
        if self.accumulate > 1:
            out["accumulation"] = sum(self._arrays[e.input].nbytes
                                      for e in self.step_graph.of_kind("grad_accum"))
        return out

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
        m = _artifacts.inference_mode(self._model)
        params = self.parameters()
        for init in m.graph.initializer:
            if init.name in params:
                init.CopyFrom(numpy_helper.from_array(params[init.name], init.name))
        return m

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, path) -> None:
        """A checkpoint (safetensors, ``docs/artifacts.md``): every state (the weights, the
        optimizer state, the loss scale, the Philox states of the random nodes) by its
        input name, the model's bytes, and as metadata the update count, the learning
        rate, the seed, the skipped count and the configuration. :meth:`load` resumes from
        it, bit for bit. Atomic: a failed save leaves the previous file at ``path`` intact.

        With ``comm`` (not sharded) every rank holds the whole state: rank 0 writing the
        file is enough, and a one-process Trainer can resume from it (the Philox states
        saved are the writing rank's own: a one-process run resumed from rank 0's file
        continues rank 0's streams, as rank 0 and one process share them). Checkpoints of a
        ``shard_optimizer`` trainer are not implemented yet."""
        _checkpoint.save(self, path)

    @classmethod
    def load(cls, path, threads: int | None = None, schedule=None) -> "Trainer":
        """The trainer saved at ``path`` (:meth:`save`; an old ``.npz`` checkpoint too),
        ready to continue. :class:`~trainops.train.checkpoint.CheckpointError` listing
        every problem when the file is no valid checkpoint or its states do not fit the
        trainer its model and configuration build (missing, extra, other dtype or shape).
        ``schedule``: needed when the saved trainer's schedule was a Python function
        (which a checkpoint cannot hold), else it replaces the saved one."""
        return _checkpoint.load_trainer(cls, path, threads, schedule)

    def load_state(self, path) -> None:
        """Continue from the checkpoint at ``path`` in this trainer (the same model,
        configuration and, with random nodes, seed). Every entry is validated first; any
        mismatch raises ONE :class:`~trainops.train.checkpoint.CheckpointError` listing
        them all, and the trainer is left exactly as it was."""
        tensors, metadata = _checkpoint.read(path)
        _checkpoint.restore(self, tensors, metadata, path)

    # -- training artifacts ----------------------------------------------------------------
    def save_artifacts(self, directory) -> dict:
        """Write the training artifacts into ``directory`` (``docs/artifacts.md``):
        ``training.onnx`` (one step), ``eval.onnx`` (forward and loss, no update),
        ``inference.onnx`` (:meth:`export`), ``checkpoint.safetensors`` (every state) and
        ``manifest.json``. Stock ONNX Runtime with the trainops library loaded trains from
        them in any language; :meth:`from_artifacts` resumes here. Returns the manifest.
        Not with ``accumulate`` > 1 (two models) yet; a ``schedule`` is not part of them
        (the loop feeds ``lr``)."""
        if self.accumulate > 1:
            raise NotImplementedError("save_artifacts with accumulate > 1 (a micro-batch "
                                      "model and an update model) is not supported yet")
        return _artifacts.save(self, directory)

    @classmethod
    def from_artifacts(cls, directory, threads: int | None = None) -> "Trainer":
        """The trainer whose artifacts (:meth:`save_artifacts`, or a checkpoint another
        language wrote into the folder) are in ``directory``, ready to continue bit for bit:
        the step graph from ``manifest.json`` and ``training.onnx``, the states from
        ``checkpoint.safetensors`` (validated as :meth:`load` does)."""
        return _artifacts.load(cls, directory, threads)
