"""The Trainer's results and persistence (a mixin of :class:`trainops.train.Trainer`):
the weights, optimizer state and running statistics it holds, :meth:`export`, checkpoints
(:mod:`.checkpoint`) and training artifacts (:mod:`.artifacts`)."""

from __future__ import annotations

import hashlib

import numpy as np

import onnx
from onnx import numpy_helper

from .. import losses as _losses
from .. import offload as _offload
from ..autodiff.importing import load as _load_model
from . import artifacts as _artifacts
from . import checkpoint as _checkpoint
from . import torch_meta as _torch_meta
from . import prepare as _prepare

__all__ = ["TrainerResults", "thin"]


def thin(trainer) -> list[str]:
    """Holds ``trainer``'s training model without the initializer data its imported
    model holds too (:func:`.prepare.thin`); the names cleared."""
    return _prepare.thin(trainer.__dict__["_train_model_held"], trainer._model)


class TrainerResults:
    """What a :class:`~trainops.train.Trainer` gives back and saves (its state is read and
    written through ``self._arrays``, :class:`~trainops.train.buffers.Buffers`: host buffers
    bound in place on the CPU, device memory copied on demand on a device)."""

    @property
    def _train_model(self) -> onnx.ModelProto:
        """The imported model with the loss attached (what the step graph was built
        from), its initializers' data whole: held without the data the imported model
        (``_model``) holds too (:func:`.prepare.thin`), which is put back in a copy here."""
        held = self.__dict__["_train_model_held"]
        names = self.__dict__.get("_thinned")
        return _prepare.thickened(held, self._model, names) if names else held

    @_train_model.setter
    def _train_model(self, model: onnx.ModelProto) -> None:
        self.__dict__["_train_model_held"] = model
        self.__dict__["_thinned"] = None

    def _state_names(self) -> list[str]:
        """Every state's input name (what a checkpoint holds)."""
        if self.step_graph is not None:
            return [e.input for e in self.step_graph.states]
        return list(self._arrays)  # the distributed runtime's arrays are all states

    @property
    def model_sha256(self) -> str:
        """The sha256 (hex) of the model's bytes that a checkpoint stores: the model as
        given, or (a LoRA trainer) as imported with its adapters. A trainer whose frozen
        weights are held outside the model hashes it when first asked."""
        if getattr(self, "_model_sha256", None) is None:
            self._model_sha256 = hashlib.sha256(self._model_bytes).hexdigest()
        return self._model_sha256

    @model_sha256.setter
    def model_sha256(self, value: str | None) -> None:
        self._model_sha256 = value

    @property
    def _model_bytes(self) -> bytes:
        """The serialized model the Trainer was built from (what a checkpoint stores); a
        ModelProto changed since then is refused (its bytes no longer hash to
        ``model_sha256``), as a checkpoint must name the model that was trained. With
        frozen weights held outside (:mod:`trainops.offload`), the model with them put back
        (NotImplementedError over protobuf's 2 GB)."""
        src = self._source_model
        if getattr(self, "_frozen", None) is not None:  # the trainer's own stub model
            return _offload.serialize(src, self._frozen, "Trainer checkpoint")
        if isinstance(src, str):  # the model file it was built from, read again
            data = _load_model(src).SerializeToString()
            if hashlib.sha256(data).hexdigest() != self.model_sha256:
                raise RuntimeError(f"Trainer: the model file {src!r} it was built from has "
                                   "changed since, so the checkpoint cannot store the model "
                                   "that was trained; keep the file as it was, or pass "
                                   "Trainer the model's bytes")
            return data
        data = src if isinstance(src, bytes) else src.SerializeToString()
        if hashlib.sha256(data).hexdigest() != self.model_sha256:
            raise RuntimeError("Trainer: the ModelProto it was built from has been changed "
                               "since, so the checkpoint cannot store the model that was "
                               "trained; pass Trainer a copy (or the model's bytes) if the "
                               "proto is to be edited while training")
        return data

    def _states(self) -> dict[str, np.ndarray]:
        """Every state's value (what a checkpoint holds), by its input name: the buffers
        themselves on the host, copies from a device."""
        return {n: self._arrays[n] for n in self._state_names()}

    def _state_specs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Every state's ``(dtype, shape)`` by its input name, with no copy."""
        return {n: self._arrays.spec(n) for n in self._state_names()}

    def state_dict(self) -> dict:
        """The trained weights and running statistics as torch tensors by the torch module's
        names, for a :func:`trainops.torch.export` model (:func:`.torch_meta.state_dict`)."""
        model = self._model
        if getattr(self, "_frozen", None) is not None:  # the frozen weights put back
            model = _offload.materialise(model, self._frozen)
        if getattr(self, "base_dtype", "float32") != "float32":  # LoRA on a quantised base:
            from ..lora import quantize as _quantize  # its weights dequantised, as export's

            model = _quantize.dequantize(model)
        return _torch_meta.state_dict(model, {**self.parameters(), **self.running_stats()})

    # -- results -------------------------------------------------------------------------
    def _copy(self, name: str) -> np.ndarray:
        """A host copy of the state ``name``: a read from the device is one already."""
        value = self._arrays[name]
        return value if self._arrays.on_device(name) else value.copy()

    @property
    def transfers(self):
        """The host<->device copies the step's runtime causes
        (:class:`~trainops.train.buffers.Transfers`: ``last_step`` and ``total`` counts and
        bytes; all zero on the CPU). None for the data-parallel and accumulating runtimes."""
        return getattr(self.runtime, "transfers", None)

    def memory(self) -> dict[str, int]:
        """Bytes this process holds for training: ``parameters``, ``gradients`` (the
        buffers ONNX Runtime writes them to; with ``comm``, plus this rank's reduced
        slice under ``shard_optimizer``) and ``optimizer_state`` (1/N of the whole under
        ``shard_optimizer``). With ``lora``, the frozen model too: ``frozen`` (the MatMul /
        Gemm weights, as ``base_dtype`` holds them: quantised data and scales),
        ``embeddings`` (Gather tables) and ``frozen_other``
        (:func:`trainops.lora.quantize.frozen_bytes`)."""
        if self._dist is not None:
            return self.runtime.memory()
        params = sum(self._arrays.nbytes(p) for p in self.param_names)
        state = sum(self._arrays.nbytes(n) for names in self.state_names.values()
                    for n in names)
        out = {"parameters": params, "gradients": params, "optimizer_state": state}
        if self.accumulate > 1:
            out["accumulation"] = sum(self._arrays.nbytes(e.input)
                                      for e in self.step_graph.of_kind("grad_accum"))
        if getattr(self, "lora", None) is not None:
            from ..lora import quantize as _quantize

            out.update(_quantize.frozen_bytes(self._model, self.param_names))
        return out

    def parameters(self) -> dict[str, np.ndarray]:
        """The current weights (copies), by initializer name."""
        return {p: self._copy(p) for p in self.param_names}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer state (copies) by name; under ``shard_optimizer``, this rank's
        flat slice of each state tensor (``trainops/<V|H>/shard``)."""
        return {n: self._copy(n) for names in self.state_names.values() for n in names}

    def running_stats(self) -> dict[str, np.ndarray]:
        """The BatchNormalization running means and variances (copies) by initializer
        name: updated each step under ``batchnorm="train"``, else empty."""
        return {n: self._copy(n) for n in self._bn}

    @property
    def loss_config(self):
        """The loss as a checkpoint stores it: a tensor name or a loss' ``to_dict()``."""
        return self.loss.to_dict() if isinstance(self.loss, _losses.Loss) else self.loss

    def export(self, merge: bool = True) -> onnx.ModelProto:
        """The model as imported (inference graph, a :mod:`trainops.losses` loss left out)
        with the trained weights and running statistics: no trainops op, so plain
        onnxruntime runs it. Dropout nodes are in inference mode (as PyTorch's
        ``model.eval()``: their ``training_mode`` input removed), BatchNormalization nodes
        in the inference form with the running statistics.

        With ``lora``: ``merge=True`` folds each adapter into its weight
        (``W + (alpha / rank) B A``, in float64, rounded once); ``merge=False`` keeps the
        adapters, their tensors graph inputs with the trained values as defaults
        (:mod:`trainops.lora.merge`)."""
        m = _artifacts.inference_mode(self._model)
        frozen = getattr(self, "_frozen", None)  # weights held outside: put back last
        params = self.parameters()
        params.update(self.running_stats())
        for init in m.graph.initializer:
            if init.name in params:
                init.CopyFrom(numpy_helper.from_array(params[init.name], init.name))
        if getattr(self, "lora", None) is not None:
            from ..lora import merge as _merge

            return _merge.finish(m, merge, frozen)  # every value in it
        if not merge:
            raise ValueError("export(merge=False): this trainer has no LoRA adapters")
        return m

    # -- LoRA adapters ---------------------------------------------------------------------
    def save_adapter(self, path, format: str | None = None) -> None:
        """The LoRA adapters to ``path``: ``.safetensors``, ``.onnx_adapter``
        (``onnxruntime.AdapterFormat``) or, with ``format="peft"``, PEFT's file pair in
        the folder ``path`` (:mod:`trainops.lora.adapter`). Atomic."""
        from ..lora import adapter as _adapter

        _adapter.save(self._lora_trainer("save_adapter"), path, format)

    def load_adapter(self, path) -> None:
        """Set the LoRA adapters from a ``.safetensors`` or ``.onnx_adapter`` file: names
        and shapes checked first, ONE ValueError listing every mismatch, nothing changed
        then. The optimizer state is kept."""
        from ..lora import adapter as _adapter

        _adapter.load(self._lora_trainer("load_adapter"), path)

    def _lora_trainer(self, what: str):
        if getattr(self, "lora", None) is None:
            raise ValueError(f"{what}: this trainer has no LoRA adapters (Trainer(lora=...))")
        return self

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, path) -> None:
        """A checkpoint (safetensors, ``docs/artifacts.md``): every state (the weights, the
        optimizer state, the loss scale, the Philox states of the random nodes) by its
        input name, the model's bytes, and as metadata the update count, the learning
        rate, the seed, the skipped count and the configuration. :meth:`load` resumes from
        it, bit for bit. Atomic: a failed save (a full disk, a file-size limit) raises
        :class:`OSError` with its errno naming ``path`` and leaves the previous file intact.
        A symlink is written through; a ``path`` that is not a regular file (a directory, a
        FIFO, a device) is refused with :class:`OSError`.

        With ``comm`` (not sharded) every rank holds the whole state: rank 0 writing the
        file is enough, and a one-process Trainer can resume from it (the Philox states
        saved are the writing rank's own: a one-process run resumed from rank 0's file
        continues rank 0's streams, as rank 0 and one process share them). Checkpoints of a
        ``shard_optimizer`` trainer are not implemented yet."""
        _checkpoint.save(self, path)

    @classmethod
    def load(cls, path, threads: int | None = None, schedule=None) -> "Trainer":
        """The trainer saved at ``path`` (:meth:`save`; an old ``.npz`` checkpoint too),
        ready to continue. :class:`~trainops.train.checkpoint.CheckpointError` naming the
        file and listing every problem with its key when the file is no valid checkpoint
        (the reader contract of ``docs/artifacts.md``: malformed metadata, a config that
        cannot build a trainer, a corrupt source model) or its states do not fit the
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
    def save_artifacts(self, directory, portable: bool = False) -> dict:
        """Write the training artifacts into ``directory`` (``docs/artifacts.md``):
        ``training.onnx`` (one step), ``eval.onnx`` (forward and loss, no update),
        ``inference.onnx`` (:meth:`export`), ``checkpoint.safetensors`` (every state) and
        ``manifest.json``. Stock ONNX Runtime with the trainops library loaded trains from
        them in any language; :meth:`from_artifacts` resumes here. Returns the manifest.
        All or nothing: every file is written and fsync'ed before any replaces its previous
        version; a failure is an :class:`OSError` naming the file, and a special file among
        the targets is refused (as :meth:`save`). Not with ``accumulate`` > 1 (two models)
        yet; a ``schedule`` is not part of them (the loop feeds ``lr``).

        ``portable=True``: ``training.onnx`` and ``eval.onnx`` of default-domain ONNX ops
        only, for runtimes without the library (onnxruntime-web, onnxruntime-node), from
        any trainer (:mod:`trainops.train.artifacts_portable`; manifest ``"portable":
        true``); a step that cannot be written so raises
        :class:`~trainops.train.artifacts_portable.NotPortableError` naming its ops."""
        if self.accumulate > 1:
            raise NotImplementedError("save_artifacts with accumulate > 1 (a micro-batch "
                                      "model and an update model) is not supported yet")
        if portable:
            from . import artifacts_portable

            return artifacts_portable.save(self, directory)
        return _artifacts.save(self, directory)

    @classmethod
    def from_artifacts(cls, directory, threads: int | None = None) -> "Trainer":
        """The trainer whose artifacts (:meth:`save_artifacts`, or a checkpoint another
        language wrote into the folder) are in ``directory``, ready to continue bit for bit:
        the step graph from ``manifest.json`` and ``training.onnx``, the states from
        ``checkpoint.safetensors`` (validated as :meth:`load` does). The manifest is checked
        against ``docs/manifest.schema.json`` and the training model:
        :class:`~trainops.train.artifacts.ManifestError` names the file and lists every
        problem with its key (``states[0].output``)."""
        return _artifacts.load(cls, directory, threads)
