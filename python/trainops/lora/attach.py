"""The Trainer's LoRA hook (:func:`attach`): the adapters injected into the imported model
(or found there, in a model a LoRA trainer's checkpoint stored) and chosen as the only
parameters."""

from __future__ import annotations

import hashlib

from .. import losses as _losses
from . import inject as _inject
from . import quantize as _quantize
from .spec import LoRA

__all__ = ["BASE_DTYPES", "attach", "finish_step"]

BASE_DTYPES = ("float32", "int8", "int4")


def check_options(lora, base_dtype, recompute) -> None:
    """``base_dtype`` and ``recompute`` as given: only what is implemented is accepted."""
    if lora is not None and not isinstance(lora, LoRA):
        raise TypeError(f"Trainer: lora: expected a trainops.LoRA, got {type(lora).__name__}")
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"Trainer: base_dtype {base_dtype!r}: expected one of {BASE_DTYPES}")
    if base_dtype != "float32" and lora is None:
        # a model a quantised LoRA trainer stored carries its base's format (attach)
        raise ValueError(f"Trainer: base_dtype {base_dtype!r}: a quantised frozen base needs "
                         "lora= (only the adapters can train on it)")
    if not isinstance(recompute, bool):  # recompute=True: trainops.train.recompute
        raise TypeError(f"Trainer: recompute: expected True or False, got {recompute!r}")


def attach(trainer, lora: LoRA | None, params, loss):
    """``(the trainer's LoRA or None, the parameters to train)``. With ``lora``: the
    adapters are injected into ``trainer._model`` (:func:`.inject.inject`, A drawn from
    ``trainer.seed``), the loss attached again, and the injected model becomes the model
    the trainer was built from (what checkpoints store and ``model_sha256`` hashes), so a
    checkpoint rebuilds a LoRA trainer. A model that carries adapters already (metadata
    ``trainops.lora``) trains them, ``lora=None``. The parameters are the adapters,
    exactly: ``params=`` with ``lora=`` is an error."""
    record = _inject.read(trainer._model)
    if lora is None and record is None:
        return None, params
    if lora is not None:
        if params is not None:
            raise ValueError("Trainer: params= with lora=: under LoRA the trained parameters "
                             "are exactly the adapter tensors (<W>.lora_A, <W>.lora_B); "
                             "leave params unset")
        model = _inject.inject(trainer._model, lora, trainer.seed)
        if trainer.base_dtype != "float32" and trainer.policy != "float32":
            # the policy would cast the dequantisation's float32 scales to float16
            raise NotImplementedError(f"Trainer: base_dtype {trainer.base_dtype!r} with "
                                      f"policy {trainer.policy!r} is not supported yet: "
                                      "use policy 'float32'")
        frozen = getattr(trainer, "_frozen", None)  # weights held outside: trainops.offload
        if trainer.base_dtype != "float32":  # the frozen base held quantised: .quantize
            model = _quantize.quantize(model, trainer.base_dtype,
                                       _inject.adapter_names(_inject.read(model)), frozen)
        trainer._model = model
        trainer._train_model = loss.attach(model) if isinstance(loss, _losses.Loss) else model
        if frozen is not None:  # the model is the trainer's own: hashed when needed
            trainer._source_model, trainer.model_sha256 = model, None
        else:
            data = model.SerializeToString()
            trainer._source_model = data
            trainer.model_sha256 = hashlib.sha256(data).hexdigest()
        record = _inject.read(model)
    else:  # a stored LoRA trainer's model: its base as it was (.quantize's record)
        trainer.base_dtype = (_quantize.read(trainer._model) or {}).get("dtype", "float32")
    names = _inject.adapter_names(record)
    if params is not None and sorted(params) != sorted(names):
        raise ValueError(f"Trainer: params {list(params)}: this model carries LoRA adapters, "
                         f"whose tensors {names} are the parameters")
    return LoRA.from_dict(record), names


def finish_step(trainer) -> None:
    """After the step graph is built: on a quantised base, the backward's readers of the
    dequantised weights get their own (gated) dequantisation (:mod:`.quant_backward`)."""
    if trainer.base_dtype != "float32" and trainer.step_graph is not None:
        from .quant_backward import dequantise_in_backward

        dequantise_in_backward(trainer.step_graph.model, trainer.loss_name)
