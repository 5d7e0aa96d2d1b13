"""Make the torch exports and torch reference runs that tests/test_torch_models.py reads.

Run with a Python that has torch, torchvision, transformers and onnxscript (never the
project's own venv; neither the package nor the tests import this file):

    /work/torchvenv/bin/python scripts/make_torch_fixtures.py [--out /work/exports]
        [--data tests/data/torch_models] [--only resnet18,gpt2] [--commit] [--refs-only]

For each architecture (tiny configs, random weights, seeded; dropout 0 since a dropout
mask cannot match torch's) in train mode:

- three exports into OUT/<arch>.<exporter>.onnx: ``dynamo`` (torch.onnx.export's default:
  dynamo=True, optimize=True), ``dynamo_noopt`` (dynamo=True, optimize=False) and
  ``classic`` (dynamo=False, opset 17, TrainingMode.TRAINING, no constant folding, inputs
  named after forward's arguments, the output ``logits``); the output is the logits only
  (transformers models are wrapped);
- OUT/<arch>.pt: the initial state_dict (what every export starts from);
- DATA/<arch>.npz: the torch reference: fixed inputs and labels, then 10 steps of
  torch.optim.AdamW(lr=1e-3, weight_decay=0.01) on F.cross_entropy of the logits
  (flattened to [B*T, V] for token logits), storing each step's loss (float64 of torch's
  float32 loss, taken before that step's update; token labels hold -100, torch's default
  ignore_index, where they do not count), the final parameters by the exported
  module's names, and the final buffers (BatchNorm running statistics);
- with --commit, the exports the tests use are copied into DATA too, gzipped
  (DATA/<arch>.<exporter>.onnx.gz).

Keys of the npz: ``input:<name>`` (by forward's argument names), ``labels``, ``losses``,
``losses64`` (the same run in float64), ``param:<name>`` (those that require grad),
``frozen`` (the parameter names that do not), ``buffer:<name>``, ``dev64:<name>`` /
``rms64:<name>`` (the largest / root-mean-square difference between a final float32
parameter or buffer and the float64 run's), ``aliases`` (``"other=name"``: a tied
parameter's other names), ``steps``, ``lr``, ``weight_decay``.

Exports that fail (T5 with the dynamo exporter, in torch 2.15) are logged and left out; the
run's log is OUT/README.txt (a partial run's: README.txt.<archs>). 5-15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

STEPS = 10
LR = 1e-3
WEIGHT_DECAY = 0.01
BATCH = 2
SEQ = 8
VOCAB = 96
CLASSES = 10
IGNORE = -100  # F.cross_entropy's default ignore_index
EXPORTERS = ("dynamo", "dynamo_noopt", "classic")
# What the tests read (tests/data/torch_models): classic and dynamo_noopt everywhere, the
# optimised dynamo export for the vision models and the two decoder-only LMs (BatchNorm
# folded, initializers merged: the tests of the Trainer's warning).
VISION = ("resnet18", "mobilenet_v3_small", "efficientnet_b0", "vit", "convnext")
COMMITTED = {a: (EXPORTERS if a in VISION + ("gpt2", "llama") else ("dynamo_noopt", "classic"))
             for a in VISION + ("bert", "distilbert", "modernbert", "gpt2", "llama", "t5",
                                "bart", "whisper")}


# --- vision models (torchvision), images [2, 3, 32, 32] (ResNet: 64x64) -> logits [2, 10] ---

def resnet18():
    """torchvision's ResNet with resnet18's BasicBlock [2, 2, 2, 2] topology, its widths cut
    from 64..512 to 4..32 (torchvision hard-codes 64..512; this repeats its __init__ with
    the widths as the only change, so the blocks and forward are torchvision's own)."""
    from torchvision.models import resnet as R

    class TinyResNet(R.ResNet):
        def __init__(self, widths=(4, 8, 16, 32), layers=(2, 2, 2, 2), num_classes=CLASSES):
            nn.Module.__init__(self)
            self._norm_layer = nn.BatchNorm2d
            self.inplanes, self.dilation, self.groups, self.base_width = widths[0], 1, 1, 64
            self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(widths[0])
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            self.layer1 = self._make_layer(R.BasicBlock, widths[0], layers[0])
            self.layer2 = self._make_layer(R.BasicBlock, widths[1], layers[1], stride=2)
            self.layer3 = self._make_layer(R.BasicBlock, widths[2], layers[2], stride=2)
            self.layer4 = self._make_layer(R.BasicBlock, widths[3], layers[3], stride=2)
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(widths[3], num_classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    return TinyResNet()


def mobilenet_v3_small():
    """torchvision's MobileNetV3 with mobilenet_v3_small's first four inverted-residual
    settings (squeeze-excitation, hardswish, both kinds) at width 0.25."""
    from torchvision.models import mobilenetv3 as M
    setting, _last = M._mobilenet_v3_conf("mobilenet_v3_small", width_mult=0.25)
    return M.MobileNetV3(setting[:4], last_channel=32, num_classes=CLASSES, dropout=0.0)


def efficientnet_b0():
    """torchvision's EfficientNet with efficientnet_b0's first three MBConv stages at width
    0.25, stochastic depth off (0) and dropout 0."""
    from torchvision.models import efficientnet as E
    setting, _last = E._efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=1.0)
    return E.EfficientNet(setting[:3], dropout=0.0, stochastic_depth_prob=0.0,
                          num_classes=CLASSES, last_channel=32)


def vit():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                             hidden_dim=32, mlp_dim=64, dropout=0.0, attention_dropout=0.0,
                             num_classes=CLASSES)


def convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                    stochastic_depth_prob=0.0, layer_scale=0.1, num_classes=CLASSES)


# --- transformers models: token ids [2, 8] -> logits [2, 8, V] ---

class Logits(nn.Module):
    """A transformers model whose one output is its logits, its inputs the named ids."""

    def __init__(self, model, names, mask: str | None = None):
        super().__init__()
        self.m = model
        self.names = names
        # An all-ones attention mask made inside forward: without one, transformers' causal
        # mask looks for packed sequences in the positions (torch.diff, which the classic
        # exporter cannot write); it changes nothing in what is computed.
        self.mask = mask

    def forward(self, *args):
        kw = dict(zip(self.names, args))
        if self.mask:  # the mask of the (decoder's) token ids, the last argument
            kw[self.mask] = torch.ones_like(args[-1])
        return self.m(**kw).logits


def _small(cfg_cls, **kw):
    """A config without the KV cache (training computes no cache)."""
    kw.setdefault("use_cache", False)
    return cfg_cls(**kw)


def bert():
    from transformers import BertConfig, BertForMaskedLM
    cfg = _small(BertConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(BertForMaskedLM(cfg), ("input_ids",))


def distilbert():
    from transformers import DistilBertConfig, DistilBertForMaskedLM
    cfg = _small(DistilBertConfig, vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2,
                 hidden_dim=64, max_position_embeddings=32, dropout=0.0,
                 attention_dropout=0.0, qa_dropout=0.0, seq_classif_dropout=0.0)
    return Logits(DistilBertForMaskedLM(cfg), ("input_ids",))


def modernbert():
    from transformers import ModernBertConfig, ModernBertForMaskedLM
    cfg = _small(ModernBertConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                 global_attn_every_n_layers=2, local_attention=4, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                 attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0,
                 classifier_dropout=0.0)
    return Logits(ModernBertForMaskedLM(cfg), ("input_ids",))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = _small(GPT2Config, vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                 n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 bos_token_id=1, eos_token_id=2)
    return Logits(GPT2LMHeadModel(cfg), ("input_ids",), mask="attention_mask")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = _small(LlamaConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=32, attention_dropout=0.0, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    return Logits(LlamaForCausalLM(cfg), ("input_ids",), mask="attention_mask")


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = _small(T5Config, vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                 num_decoder_layers=1, num_heads=4, relative_attention_num_buckets=8,
                 relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
                 eos_token_id=1, decoder_start_token_id=0)
    return Logits(T5ForConditionalGeneration(cfg), ("input_ids", "decoder_input_ids"))


def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = _small(BartConfig, vocab_size=VOCAB, d_model=32, encoder_layers=1,
                 decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                 classifier_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                 decoder_start_token_id=2, forced_eos_token_id=None)
    return Logits(BartForConditionalGeneration(cfg), ("input_ids", "decoder_input_ids"))


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = _small(WhisperConfig, vocab_size=VOCAB, num_mel_bins=8, d_model=32,
                 encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 max_source_positions=8, max_target_positions=16, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                 suppress_tokens=None, begin_suppress_tokens=None)
    return Logits(WhisperForConditionalGeneration(cfg), ("input_features", "decoder_input_ids"),
                  mask="decoder_attention_mask")


ARCHS = {"resnet18": resnet18, "mobilenet_v3_small": mobilenet_v3_small,
         "efficientnet_b0": efficientnet_b0, "vit": vit, "convnext": convnext,
         "bert": bert, "distilbert": distilbert, "modernbert": modernbert, "gpt2": gpt2,
         "llama": llama, "t5": t5, "bart": bart, "whisper": whisper}


def inputs_for(arch: str, model) -> tuple[dict, np.ndarray]:
    """Fixed inputs (by forward's argument names) and labels, from a seed of their own."""
    g = torch.Generator().manual_seed(1)
    if arch in VISION:
        # ResNet's last stage is at stride 32: at 32x32 its BatchNorms would normalise 2
        # values per channel (+-1 whatever the input), whose gradients are rounding noise
        # that AdamW turns into full steps (float32 and float64 runs part after 2 steps).
        size = 64 if arch == "resnet18" else 32
        x = torch.randn(BATCH, 3, size, size, generator=g)
        return {"x": x}, torch.randint(0, CLASSES, (BATCH,), generator=g)
    feeds = {}
    for name in model.names:
        if name == "input_features":
            feeds[name] = torch.randn(BATCH, model.m.config.num_mel_bins,
                                      2 * model.m.config.max_source_positions, generator=g)
        else:  # ids past the special tokens 0..2
            feeds[name] = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # As transformers' losses are fed: positions that do not count (a masked LM's unmasked
    # tokens, padding) hold -100, F.cross_entropy's default ignore_index; the mean is over
    # the others.
    labels[torch.rand(BATCH, SEQ, generator=g) < 0.25] = IGNORE
    labels[:, 0] = IGNORE
    return feeds, labels


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def export(model, args, names, path, exporter):
    from torch.onnx import TrainingMode
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "classic":
            torch.onnx.export(model, args, path, dynamo=False, opset_version=17,
                              training=TrainingMode.TRAINING, do_constant_folding=False,
                              input_names=list(names), output_names=["logits"])
        else:
            prog = torch.onnx.export(model, args, dynamo=True,
                                     optimize=(exporter == "dynamo"), verbose=False)
            prog.save(path, external_data=False)


def train(model, feeds: dict, labels) -> list[float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model(*feeds.values()), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def reference(model, feeds: dict, labels) -> dict:
    """The float32 run (what the tests compare with) and the same run in float64 from the
    same start (``losses64``): how far torch's own float32 run strays from the exact one
    measures this model's float32 rounding along this trajectory."""
    wide = copy.deepcopy(model).double()
    losses64 = train(wide, {k: (v.double() if v.is_floating_point() else v)
                            for k, v in feeds.items()}, labels)
    losses = train(model, feeds, labels)
    out = {f"input:{k}": v.numpy() for k, v in feeds.items()}
    out["labels"] = labels.numpy().astype(np.int64)
    out["losses"] = np.asarray(losses, np.float64)
    out["losses64"] = np.asarray(losses64, np.float64)
    out["steps"] = np.int64(STEPS)
    out["lr"] = np.float64(LR)
    out["weight_decay"] = np.float64(WEIGHT_DECAY)
    for k, v in model.named_parameters():
        if v.requires_grad:  # what torch trains (Whisper's encoder positions are frozen)
            out[f"param:{k}"] = v.detach().numpy().copy()
    out["frozen"] = np.asarray([k for k, v in model.named_parameters() if not v.requires_grad],
                               dtype=np.str_)
    # Tied parameters (an LM head sharing the embedding) appear once above, under their
    # first name; an export may name the shared initializer after another user of it.
    first, aliases = {}, []
    for k, v in model.named_parameters(remove_duplicate=False):
        if id(v) in first:
            aliases.append(f"{k}={first[id(v)]}")
        else:
            first[id(v)] = k
    out["aliases"] = np.asarray(aliases, dtype=np.str_)
    for k, v in model.named_buffers():
        if is_statistic(k):
            out[f"buffer:{k}"] = v.detach().numpy().copy()
    # How far each final float32 tensor is from the float64 run's, at most (one number a
    # tensor, to keep the file small): the float32 rounding of this run, per tensor.
    exact = dict(wide.named_parameters())
    exact.update(wide.named_buffers())
    for key in [k for k in out if k.startswith(("param:", "buffer:"))]:
        name = key.split(":", 1)[1]
        d = np.abs(out[key].astype(np.float64) - exact[name].detach().numpy())
        out[f"dev64:{name}"] = np.float64(np.max(d, initial=0.0))
        out[f"rms64:{name}"] = np.float64(np.sqrt(np.mean(d * d)) if d.size else 0.0)
    return out


def is_statistic(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")


def check_initializers(path: str, state: dict) -> tuple[list[str], list[str]]:
    """Names whose initializer differs from the initial state: running statistics (the
    classic exporter's trace runs forward in train mode, which moves them) are set back to
    the initial state in the file, so every export starts where the torch reference does;
    anything else (a BatchNorm folded into a convolution's weights) is left and listed."""
    import onnx
    from onnx import numpy_helper
    m = onnx.load(path)
    reset, other = [], []
    for init in m.graph.initializer:
        if init.name in state:
            want = state[init.name].detach().numpy()
            got = numpy_helper.to_array(init)
            if got.shape == want.shape and not np.array_equal(got, want):
                if is_statistic(init.name):
                    init.CopyFrom(numpy_helper.from_array(want.astype(got.dtype), init.name))
                    reset.append(init.name)
                else:
                    other.append(init.name)
    if reset:
        onnx.save(m, path)
    return reset, other


def make(arch: str, out: str, data: str, commit: bool, log, refs_only: bool = False) -> None:
    torch.manual_seed(0)
    model = ARCHS[arch]()
    model.train()
    feeds, labels = inputs_for(arch, model)
    state = copy.deepcopy(model.state_dict())
    torch.save(state, os.path.join(out, f"{arch}.pt"))
    names = tuple(feeds)
    if refs_only:
        exporters = ()
    else:
        exporters = EXPORTERS
    nparams = sum(p.numel() for p in model.parameters())
    log(f"{arch}: {type(model.m if isinstance(model, Logits) else model).__name__}, "
        f"{nparams} parameters, inputs "
        + ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in feeds.items()))
    for exporter in exporters:
        path = os.path.join(out, f"{arch}.{exporter}.onnx")
        try:
            export(model, tuple(feeds.values()), names, path, exporter)
            reset, moved = check_initializers(path, state)
            log(f"  {arch}.{exporter}.onnx: {os.path.getsize(path) // 1024} kB"
                + (f"; {len(reset)} running statistics the trace moved set back to the "
                   f"initial state" if reset else "")
                + (f"; {len(moved)} initializers differ from the initial state (folded), "
                   f"e.g. {moved[0]}" if moved else ""))
        except Exception as e:  # record the exporter's failure and go on
            root = e
            while root.__cause__ is not None:  # the exporter wraps what went wrong
                root = root.__cause__
            log(f"  {arch}.{exporter}.onnx: EXPORT FAILED: {type(e).__name__}, from "
                f"{type(root).__name__}: {str(root).splitlines()[0][:300] if str(root) else ''}")
            if os.path.exists(path):
                os.remove(path)
        model.load_state_dict(state)  # a trace in train mode moves BatchNorm's statistics
    torch.manual_seed(0)
    ref = reference(model, feeds, labels)
    os.makedirs(data, exist_ok=True)
    np.savez_compressed(os.path.join(data, f"{arch}.npz"), **ref)
    log(f"  torch losses: {np.array2string(ref['losses'], precision=5)}; float32 - float64: "
        f"{np.array2string(ref['losses'] - ref['losses64'], precision=2)}")
    if commit and not refs_only:
        for exporter in COMMITTED[arch]:
            src = os.path.join(out, f"{arch}.{exporter}.onnx")
            if os.path.exists(src):
                commit_copy(src, os.path.join(data, f"{arch}.{exporter}.onnx"))


def commit_copy(src: str, dst: str) -> None:
    """The export byte for byte, gzipped (``dst`` + ``.gz``): the dynamo exporter's per-node
    metadata (stack traces, module paths, the rewrite rules that folded a BatchNorm, which
    trainops reads) is most of a tiny model's file and compresses ten times."""
    import gzip
    with open(src, "rb") as f, open(dst + ".gz", "wb") as raw, \
            gzip.GzipFile("", "wb", 9, raw, mtime=0) as g:  # the same bytes on every run
        g.write(f.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/work/exports")
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                   "data", "torch_models"))
    ap.add_argument("--only", default="")
    ap.add_argument("--refs-only", action="store_true",
                    help="the torch references only (the exports already in --out)")
    ap.add_argument("--commit", action="store_true",
                    help="copy the exports the tests use into --data")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    archs = [s for s in a.only.split(",") if s] or list(ARCHS)
    readme = os.path.join(a.out, "README.txt")
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
        with open(readme + ".part", "w") as f:
            f.write("\n".join(lines) + "\n")

    log(f"torch {torch.__version__}; made by scripts/make_torch_fixtures.py "
        f"({', '.join(archs)}); exporters {', '.join(EXPORTERS)}; <arch>.pt = initial "
        f"state_dict; references in {os.path.abspath(a.data)}")
    for arch in archs:
        try:
            make(arch, a.out, a.data, a.commit, log, a.refs_only)
        except Exception as e:
            log(f"{arch}: FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stderr)
    done = readme if not (a.only or a.refs_only) else \
        f"{readme}.{'refs.' if a.refs_only else ''}{a.only.replace(',', '_') or 'all'}"
    os.replace(readme + ".part", done)


if __name__ == "__main__":
    main()
