"""LoRA fine-tuning (low-rank adapters, as PEFT's ``LoraConfig``) for
:class:`trainops.Trainer`: ``Trainer(model, loss, lora=LoRA(rank=8, alpha=16,
targets=["q_proj", "v_proj"]))`` trains only the adapter tensors ``<W>.lora_A`` and
``<W>.lora_B`` of every targeted MatMul/Gemm weight ``W``, the base model frozen.

- :mod:`.spec`: :class:`LoRA`, the configuration and its checks;
- :mod:`.inject`: the graph rewrite (``y = x W + (alpha / rank) x A^T B^T``) and the
  record it leaves in the model's metadata (key ``trainops.lora``);
- :mod:`.adapter`: ``Trainer.save_adapter`` / ``load_adapter`` (safetensors, PEFT's file
  pair, ``onnxruntime`` adapter files);
- :mod:`.merge`: ``Trainer.export(merge=...)``.

Importing this package imports :mod:`.spec` only (no onnx, no numpy).
"""

from __future__ import annotations

from .spec import LoRA

__all__ = ["LoRA"]
