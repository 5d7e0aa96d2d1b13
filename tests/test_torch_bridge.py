"""The torch bridge (:mod:`trainops.torch`): ``export`` a torch module, train it with the
Trainer, put the result back with ``module.load_state_dict(trainer.state_dict(),
strict=False)``. Needs torch, torchvision and transformers (``scripts/test-torch``); skipped
without them (the README's test command). Models are built from constructors and tiny
configs with random weights (no model hub).

Training against torch: trainops' AdamW and ``torch.optim.AdamW`` with the same
hyperparameters, 4 steps on the same batches, compared after every step (losses, moments,
parameters, running statistics) within bounds derived from float32 rounding
(:func:`assert_adamw_agree`: the argument of :mod:`helpers.adam_pair`, for torch's AdamW).
The gradients' difference ``D`` comes from :mod:`helpers.rounding` where it has a rule for
every op of the model (each run's whole step, forward errors carried, within a bound of
the float64 step: a theorem); for the transformers, whose ops it lacks, from a model
stated at :func:`torch_model_grads`.
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")

import onnxruntime as ort  # noqa: E402

import trainops.torch as tt  # noqa: E402
from helpers.adam_pair import within, within_loss  # noqa: E402
from helpers.rounding import U, batch_stats, forward, gamma, pair_bounds  # noqa: E402
from trainops import Trainer, losses, optim  # noqa: E402
from trainops.train import torch_meta  # noqa: E402
from trainops.train.importer import import_model  # noqa: E402

pytestmark = pytest.mark.torch

F32 = np.float32
STEPS, LR, WD = 4, 1e-3, 1e-2
nn = torch.nn


# -- models ----------------------------------------------------------------------------------

class BnCnn(nn.Module):
    """Conv (no bias, as before a BatchNorm) -> BatchNorm -> Relu -> spatial mean -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


class FrozenMlp(nn.Module):
    """Linear -> Relu -> Linear, the first layer frozen (requires_grad=False)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 8)
        self.head = nn.Linear(8, 3)
        self.body.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class Lm(nn.Module):
    """GPT-2 (its lm_head tied to the token embedding) with the logits' class axis second,
    as cross-entropy takes them: (batch, vocabulary, positions)."""

    def __init__(self):
        super().__init__()
        self.gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, input_ids):
        return self.gpt(input_ids).logits.transpose(1, 2)


def bert():
    """A tiny BertForSequenceClassification (3 labels); dropout 0, so that both sides
    compute the same function (their dropout masks would differ)."""
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _batches(kind, seed=0):
    """STEPS batches ``(inputs, labels)`` of torch tensors for the model ``kind``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        if kind in ("bert", "gpt2"):
            x = torch.randint(0, 40, (2, 8), generator=g)
            y = torch.randint(0, 3, (2,), generator=g) if kind == "bert" else \
                torch.randint(0, 40, (2, 8), generator=g)
        else:
            shape, classes = {"bn_cnn": ((4, 3, 6, 6), 4), "mlp": ((8, 5), 3),
                              "resnet18": ((4, 3, 32, 32), 4)}[kind]
            x, y = torch.randn(shape, generator=g), torch.randint(0, classes, shape[:1], generator=g)
        out.append((x, y))
    return out


def make(kind):
    """``(module, output name, input name)``, the module in training mode with seeded
    weights."""
    torch.manual_seed(1)
    if kind == "bn_cnn":
        return BnCnn().train(), "output", "x"
    if kind == "mlp":
        return FrozenMlp().train(), "output", "x"
    if kind == "resnet18":
        return torchvision.models.resnet18(num_classes=4).train(), "output", "x"
    if kind == "bert":
        return bert().train(), "logits", "input_ids"
    return Lm().train(), "output", "input_ids"


KINDS = ["bn_cnn", "mlp", "resnet18", "bert", "gpt2"]
RULED = {"bn_cnn", "mlp", "resnet18"}  # every op has a rule in helpers.rounding


def _meta(model):
    return json.loads(next(p.value for p in model.metadata_props if p.key == torch_meta.KEY))


def _onnx_value(model, name):
    from onnx import numpy_helper

    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


# -- the export ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_export_lists_exactly_the_trainable_parameters(library_path, kind):
    """The metadata names every trainable parameter (both names of tied ones, one
    initializer), no frozen one; each initializer holds the module's value (transposed
    where it says so); the buffers are the running statistics; the Trainer trains exactly
    those initializers; the module is unchanged by the export."""
    module, out, x_name = make(kind)
    module.bn.eval() if kind == "bn_cnn" else None  # a submodule's own flag must survive
    before = {k: v.clone() for k, v in module.state_dict().items()}
    flags = [m.training for m in module.modules()]
    x, _ = _batches(kind)[0]
    model = tt.export(module, (x,))

    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert [m.training for m in module.modules()] == flags
    meta = _meta(model)
    trainable = [n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
    assert list(meta["params"]) == trainable
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, entry in meta["params"].items():
        want = params[name].detach().numpy()
        got = _onnx_value(model, entry["initializer"])
        np.testing.assert_array_equal(got.T if entry["transposed"] else got, want, err_msg=name)
    stats = {n for n, _ in module.named_buffers() if "running" in n}
    assert set(meta["buffers"]) - stats <= {n for n, _ in module.named_buffers()
                                            if n.endswith("num_batches_tracked")}
    assert stats <= set(meta["buffers"])
    for name, entry in meta["buffers"].items():
        np.testing.assert_array_equal(_onnx_value(model, entry["initializer"]),
                                      dict(module.named_buffers())[name].numpy())
    if kind == "gpt2":  # tied: two names, one initializer
        assert meta["params"]["gpt.lm_head.weight"]["initializer"] == \
            meta["params"]["gpt.transformer.wte.weight"]["initializer"]
    if kind == "mlp":  # frozen: a constant of the graph, not a parameter
        assert not any(n.startswith("body.") for n in meta["params"])
    assert [i.name for i in model.graph.input] == [x_name]
    assert model.graph.output[0].name == out

    tr = Trainer(model, losses.cross_entropy(out), optim.AdamW(lr=LR), seed=0, threads=1)
    assert tr.param_names == list(dict.fromkeys(e["initializer"] for e in meta["params"].values()))
    assert not set(tr.param_names) & set(tr.running_stats())


def test_inputs_outputs_and_kwargs_are_named(library_path):
    """Inputs after forward's parameters (args in order, then kwargs by key); a
    ModelOutput's tensors under its keys with ``logits`` first; a tuple's as output_<i>."""
    module, _, _ = make("bert")
    ids = torch.randint(0, 40, (2, 8))
    model = tt.export(module, (ids,), kwargs={"attention_mask": torch.ones(2, 8, dtype=torch.int64),
                                               "output_hidden_states": True})
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    outs = [o.name for o in model.graph.output]
    assert outs[0] == "logits" and outs[1:] == [f"hidden_states_{i}" for i in range(3)]

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, a, b):
            return self.lin(a), self.lin(b).sum()

    model = tt.export(Pair(), (torch.randn(4, 3), torch.randn(1, 3)))
    assert [i.name for i in model.graph.input] == ["a", "b"]
    assert [o.name for o in model.graph.output] == ["output_0", "output_1"]


def test_export_saves_and_refuses_what_it_cannot_map(tmp_path, monkeypatch):
    import onnx

    module, _, _ = make("mlp")
    x = torch.randn(8, 5)
    model = tt.export(module, (x,), tmp_path / "mlp.onnx")
    assert onnx.load(tmp_path / "mlp.onnx") == model
    with pytest.raises(TypeError, match="forward takes 1 positional"):
        tt.export(module, (x, x))
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        tt.export(lambda x: x, (x,))

    # An exporter that folds a weight into something else (as torch's dynamo exporter
    # folds BatchNorm into the Conv before it): here the head's weight scaled by 2.
    exporter = sys.modules["trainops.torch.exporter"]
    real = exporter._onnx_export

    def folding(*a):
        from onnx import numpy_helper

        m = real(*a)
        for i in m.graph.initializer:
            if i.name.endswith("head.weight"):
                i.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(i) * 2, i.name))
        return m

    monkeypatch.setattr(exporter, "_onnx_export", folding)
    with pytest.raises(ValueError, match=r"folded or copied the parameters \['head.weight'\]"):
        tt.export(module, (x,))
    monkeypatch.undo()

    class Unused(nn.Module):  # an unused parameter is left out, not an error
        def __init__(self):
            super().__init__()
            self.lin, self.spare = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x)

    assert list(_meta(tt.export(Unused(), (torch.randn(2, 3),)))["params"]) == \
        ["lin.weight", "lin.bias"]


def test_state_dict_needs_the_metadata(library_path):
    module, _, _ = make("mlp")
    model = tt.export(module, (torch.randn(8, 5),))
    del model.metadata_props[:]
    tr = Trainer(model, losses.cross_entropy("output"), optim.AdamW(lr=LR), seed=0, threads=1)
    with pytest.raises(ValueError, match="not exported by trainops.torch.export"):
        tr.state_dict()
