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

The work is done by: :mod:`.graph` (the step graph), :mod:`.runtime` (its session and
in-place bindings), :mod:`.assignment` (its EPs), :mod:`.dist_graph` / :mod:`.dist_runtime`
(data-parallel), :mod:`.checkpoint` (save/load).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Any, Mapping, Sequence

import numpy as np

from .. import losses as _losses
from .. import optim as _optim
from .. import offload as _offload
from ..autodiff.importing import load as _load_model
from ..lora import attach as _lora
from ..random import _seed_bits
from . import update_options as _schedules
from .accumulate_runtime import AccumulatingRuntime
from .assignment import StepSession
from .backward import data_inputs
from .buffers import Buffers, host_buffers
from .checkpoint import INT64_MAX
from .graph import build_step_graph
from .params import check_param_names
from .placement import NO_CUSTOM_OPS, TrainingModel, check_portable, portable_graph
from .placement import resolve as resolve_placement
from .prepare import choose_params, prepare
from .results import TrainerResults, thin
from .runtime import StepRuntime
from .spec import (BATCHNORM_MODES, StepGraph, StepOptions, check_policy, check_update_options,
                   fused_grads_enabled)

__all__ = ["Trainer"]


def _share_param_buffers(graph: StepGraph, runtime: StepRuntime) -> None:
    """Point the step graph's parameter entries at the runtime's host buffers (copies of
    their initial values): one copy of the weights in the process, not two, ``graph``'s
    the current ones from then on. States in device memory keep their entries."""
    if runtime.memory is None:
        for e in graph.of_kind("param"):
            e.initial = runtime.arrays[e.input]


class Trainer(TrainerResults):
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
      :meth:`export`'s model. Class labels (of that loss or of the model's own
      SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss) are checked on every placement:
      :mod:`trainops.losses`;
    - ``params``: the initializers to train (default: a :func:`trainops.torch.export`
      model's trainable parameters, else the float initializers that are weights of an
      op, :mod:`trainops.train.params`; the choice is ``param_names``, logged once);
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
      ``trainops.distributed.rank_seed(seed, r)`` instead of ``seed`` (rank 0: ``seed``);
    - ``clip_grad_norm``: ``max_norm`` of PyTorch's ``clip_grad_norm_`` (total 2-norm over
      every parameter's gradient, coefficient ``min(max_norm / (norm + 1e-6), 1)``),
      applied inside the step graph before the update (:mod:`trainops.train.clip`); the
      total norm before clipping is ``last_grad_norm``. Under ``mixed_float16`` it is the
      norm of the unscaled gradients, and the clipped ones go to the optimizer as float32;
    - ``accumulate``: ``k`` >= 1: :meth:`step` adds each micro-batch's gradients into
      accumulation buffers (``grad_accum`` state) and updates on every k-th call, with
      their mean (:mod:`trainops.train.accumulate`): k micro-batches of B train as one
      batch of kB with a mean loss. ``T`` counts updates. A micro-batch that fails is not
      counted (every state keeps its bits, the buffers and the count too);
    - ``schedule``: a learning-rate schedule (:mod:`trainops.optim.schedules`, or any
      callable ``step -> lr``): each update uses ``schedule(T - 1)`` (``T - 1`` updates
      made so far); a schedule without ``lr`` takes the optimizer's;
    - ``device``: ``"cpu"`` (the default), ``"cuda"`` (onnxruntime-gpu's
      ``CUDAExecutionProvider`` then the CPU, with trainops' CUDA kernels: ``TRAINOPS_CUDA=1``)
      or ``"auto"`` (the CPU for now: CUDA becomes its choice once trainops' CUDA kernels are
      verified on a GPU); exclusive with ``providers``. On the CUDA EP and on a
      ``TrainopsExecutionProvider`` device every state lives in device memory between steps
      (a step moves only the data, ``lr`` and ``T`` in and the loss out: ``transfers``
      counts it); reading the weights or saving copies them to the host (docs/gpu.md);
    - ``providers``: as ``onnxruntime.InferenceSession``'s (names or ``(name, options)``),
      or ``OrtEpDevice`` / ``(OrtEpDevice, options)`` (``onnxruntime.get_ep_devices()``). An EP
      not running the step, or claiming none of its nodes (unless the CPU is listed after
      it), raises; ``session_config`` / ``free_dimensions``: the step session's config
      entries and symbolic dimension sizes (:mod:`.assignment`, docs/training.md);
    - ``portable``: rewrite the step's trainops nodes as standard ONNX ops
      (:func:`trainops.portable.rewrite`) for EPs that take no custom-op library; ``None``:
      True for the EPs in :data:`trainops.train.placement.NO_CUSTOM_OPS` (DirectML, WebGPU,
      CoreML, OpenVINO, QNN, ...), else False. Not with ``comm``, nor with an optimizer's
      ``state_dtype="int8"`` or ``"bfloat16"`` (no standard-op form: ValueError). The CPU
      gradient kernels are used wherever every EP is the CPU's (by name or as its
      ``OrtEpDevice``) and the graph is not portable.
    - ``lora``: a :class:`trainops.LoRA`: only its adapters train, the model frozen
      (:mod:`trainops.lora`); ``base_dtype``: ``"float32"``, or ``"int8"`` / ``"int4"``
      with ``lora``: the frozen MatMul / Gemm weights held block-quantised, dequantised
      on the fly (:mod:`trainops.lora.quantize`).
    - ``recompute``: True: gradient checkpointing, each repeated block's (transformer
      layer's) activations computed again in the backward instead of kept, the same bits
      (:mod:`trainops.train.recompute`); ValueError for a model without repeated blocks.

    Every other graph input is data, fed to :meth:`step`. ``training_model`` is the model the
    session runs: read its attributes directly (``trainer.training_model.graph``) or call it
    for the ``onnx.ModelProto`` itself (``trainer.training_model()``).
    """

    def __init__(self, model, loss: str | _losses.Loss, optimizer: _optim.Optimizer | None = None,
                 params: Sequence[str] | None = None, policy: str = "float32",
                 threads: int | None = None, seed: int | None = None, comm=None,
                 shard_optimizer: bool = False, collective_timeout: float | None = None,
                 *, clip_grad_norm: float | None = None, accumulate: int = 1,
                 schedule=None, providers=None, portable: bool | None = None,
                 device: str | None = None, batchnorm: str = "train", lora=None,
                 base_dtype: str = "float32", recompute: bool = False, session_config=None,
                 free_dimensions=None, _step_graph: StepGraph | None = None):
        if batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"batchnorm {batchnorm!r}: expected 'train' or 'frozen'")
        self.batchnorm = batchnorm
        _lora.check_options(lora, base_dtype, recompute)
        self.base_dtype, self.recompute = base_dtype, recompute
        # A LoRA trainer on the CPU holds its frozen weights outside the model (memory maps of
        # a model file's external data, else one copy): no graph pass copies them (.offload).
        self._frozen = None
        if _offload.wanted(model, lora) and policy == "float32" and accumulate == 1 \
                and comm is None and providers is None and not portable and device is None:
            model, self._frozen = _offload.take(model)
        elif isinstance(model, (str, os.PathLike)):
            self._source_model = os.fspath(model)  # a file: kept by its path, read again
            model = _load_model(model)  # a file that is no ONNX model: ValueError naming it
        params = check_param_names(params)
        # The bytes a checkpoint stores and their hash. The model is kept as given (a reference:
        # a copy of the weights less), serialized when a checkpoint needs it; offloaded: hashed
        # when a checkpoint first asks (model_sha256).
        model_bytes = model if isinstance(model, bytes) or self._frozen is not None \
            else model.SerializeToString()
        self.model_sha256 = None if self._frozen is not None else \
            hashlib.sha256(model_bytes).hexdigest()
        self.__dict__.setdefault("_source_model", model)
        # As exported -> trainable (.importer); the loss attached (.prepare).
        self.loss = loss
        self._model, self._train_model, self.loss_name = prepare(model_bytes, loss, batchnorm)
        del model_bytes
        self.optimizer = _optim.check_optimizer(optimizer)
        self.policy = check_policy(policy, self.optimizer)
        self.clip_grad_norm, self.accumulate = check_update_options(clip_grad_norm, accumulate)
        self.schedule = _schedules.bind(schedule, self.optimizer)
        if seed is not None:
            _seed_bits(seed)  # TypeError / ValueError for a seed that is not a 64-bit int
        self.shard_optimizer = bool(shard_optimizer)
        self.placement = resolve_placement(providers, portable, device)
        self._eps = StepSession(self.placement, session_config, free_dimensions,
                                single=comm is None and accumulate == 1)
        if self.placement.portable:  # before any graph is built: the reason, said plainly
            check_portable(self.optimizer, [] if portable else
                           [n for n in self.placement.names if n in NO_CUSTOM_OPS])
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
            if getattr(self.optimizer, "state_dtype", "float32") != "float32":
                raise NotImplementedError("comm= with state_dtype "
                                          f"{self.optimizer.state_dtype!r} is not supported "
                                          "yet: use state_dtype='float32'")
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
        self.lora, params = _lora.attach(self, lora, params, loss)  # adapters only: lora/
        chosen, self.coverage = choose_params(self._train_model, self.loss_name, params,
                                              batchnorm)
        options = StepOptions(self.loss_name, self.optimizer, chosen, self.policy, key_seed,
                              self.clip_grad_norm, self.accumulate, batchnorm,
                              fused=self.placement.fuses_grads and fused_grads_enabled(),
                              recompute=bool(recompute))
        self.input_names = data_inputs(self._train_model)
        # The labels of a cross_entropy / nll loss, checked before each run (the graph
        # checks them too, on every placement: losses.label_check).
        self._check_labels = _losses.label_check(self._train_model)
        self.step_graph: StepGraph | None = None
        if self._dist is None:
            # _step_graph: a step graph read back (from_artifacts), not built again.
            self.step_graph = _step_graph or build_step_graph(self._train_model, options)
            if _step_graph is None:  # LoRA on a quantised base: the backward's dequantisation
                _lora.finish_step(self)
            if self.placement.portable and _step_graph is None:
                self.step_graph = portable_graph(self.step_graph, key_seed,
                                                 self.placement.names)
            self.param_names = self.step_graph.param_names
            self.training_model = TrainingModel(self.step_graph.model)
            if self.step_graph.apply_model is None:
                self.runtime = StepRuntime(self.step_graph, threads, placement=self.placement,
                                           frozen=self._frozen,
                                           configure=self._eps.configure(self.step_graph.model))
                self._eps.check(self.runtime.session)  # every EP asked for runs the step
                _share_param_buffers(self.step_graph, self.runtime)
            elif self.placement.is_cpu:
                self.runtime = AccumulatingRuntime(self.step_graph, threads)
            else:
                raise NotImplementedError("accumulate > 1 trains on the CPU only for now: "
                                          "leave providers, portable and device unset")
            self._rng = [(e.input, e.output, e.initial) for e in self.step_graph.of_kind("rng")]
            opt_states = self.step_graph.of_kind("optimizer")
            # By slot, in the step graph's order (with int8 state the small tensors' float
            # slots follow the 8-bit ones).
            self.state_names = {s: [e.input for e in opt_states if e.slot == s]
                                for s in dict.fromkeys(e.slot for e in opt_states)}
            self._bn = [e.input for e in self.step_graph.of_kind("bn_stat")]
        else:
            from .dist_graph import build_distributed
            from .dist_runtime import DistributedRuntime

            graphs = build_distributed(self._train_model, options, self._dist.size,
                                       self.shard_optimizer)
            self._bn = [e.input for e in graphs.bn]
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
        arrays = self.runtime.arrays
        # Every host-side read and write of a state goes through this one accessor: on a
        # device placement a read copies device->host, a write host->device.
        self._arrays: Buffers = arrays if isinstance(arrays, Buffers) else host_buffers(arrays)
        self.T = 1
        self.lr = float(self.optimizer.lr)
        self.skipped = 0
        if self.schedule is not None:
            self.lr = _schedules.lr_at(self.schedule, self.T)
        self._thinned = thin(self) if self.lora is None and self._frozen is None else None

    assignment = property(lambda self: self._eps.assignment,
                          doc="``{EP name: node count}`` of the step session (:mod:`.assignment`).")

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
        clipping (unscaled under ``mixed_float16``; inf or NaN for non-finite gradients, as
        torch's ``clip_grad_norm_``); None before the first update or without it."""
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
        micro-batch's loss. With ``schedule`` the update's learning rate is ``schedule(T - 1)``.

        All or nothing (without ``comm``): if the step fails (an error from any node), no
        state has changed (weights, optimizer state, ``T``, loss scale, Philox states,
        BatchNorm's running statistics; with ``accumulate``, the accumulation buffers and
        the micro-batch count too: the failed micro-batch was never added).

        Refused with a ValueError, nothing changed: labels of a ``cross_entropy`` / ``nll``
        loss outside ``[0, C)`` (other than its ``ignore_index``) or not shaped as the
        logits without their class axis; a BatchNormalization in training mode given one
        value per channel (PyTorch refuses it too: its unbiased variance would be NaN).

        With ``comm``: ``feeds`` is this rank's shard of the batch; every rank must call
        ``step`` the same number of times; the gradients are averaged over the ranks
        before the update and the loss returned is the mean of the ranks' losses."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"step: feeds lack model inputs {missing}")
        if self.T >= INT64_MAX:  # T is an int64 input: one more step could not be counted
            raise ValueError(f"Trainer.step: T = {self.T} cannot advance past int64; the step "
                             "changed nothing")
        if self._check_labels is not None:
            self._check_labels(feeds)
        if self.schedule is not None:
            self.lr = _schedules.lr_at(self.schedule, self.T)
        try:
            loss = self.runtime.run(feeds, self.lr, self.T)
        except Exception as e:
            refused = _losses.step_refusal(e, feeds, self.input_names)  # a check of the graph
            if refused is None:
                raise
            raise refused from e
        self._eps.after_step()  # without onnxruntime's record: the first step's profile
        if not getattr(self.runtime, "updated", True):
            return loss  # a micro-batch added to the accumulation buffers: no update
        self._updated = True  # an update ran (or was skipped): last_grad_norm is its
        if self._dist is None and not self.runtime.finite:
            self.skipped += 1  # not an update: T stays (as PyTorch's GradScaler and Keras)
        else:
            self.T += 1
        return loss
