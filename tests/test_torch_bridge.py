"""The torch bridge (:mod:`trainops.torch`): ``export`` a torch module, train it with the
Trainer, put the result back with ``module.load_state_dict(trainer.state_dict(),
strict=False)``. Needs torch, torchvision and transformers (``scripts/test-torch``); skipped
without them (the README's test command). Models are built from constructors and tiny
configs with random weights (no model hub).

Training against torch: trainops' AdamW and ``torch.optim.AdamW`` with the same
hyperparameters, 4 steps on the same batches, compared after every step (losses, moments,
parameters, running statistics) within bounds derived from float32 rounding
(:func:`assert_adamw_agree`: the argument of :mod:`helpers.adam_pair`, for torch's AdamW).
The gradients' difference ``D`` comes from :mod:`helpers.rounding` for the shallow models
whose every op it has a rule for (each run's whole step, forward errors carried, within a
bound of the float64 step: a theorem); for ResNet-18 (where that worst case compounds out
of use) and the transformers (whose ops it lacks), from a model stated at
:func:`torch_model_grads`. ResNet-18's comparison is an expected failure: a ReLU input
within float32 rounding of 0 makes either float32 gradient 23% off the float64 one (see
``RESNET_KINK``), which that model does not allow for.
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


class Llama(nn.Module):
    """A tiny Llama (rotary position embeddings: its ``inv_freq`` is a non-persistent buffer
    the forward computes the angles from), logits' class axis second as in :class:`Lm`."""

    def __init__(self):
        super().__init__()
        self.llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            attention_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2))

    def forward(self, input_ids):  # the mask given: without it transformers looks for packed
        # sequences with aten::diff, which the exporter does not have
        mask = torch.ones_like(input_ids)
        return self.llama(input_ids, attention_mask=mask).logits.transpose(1, 2)


class Rotary(nn.Module):
    """Buffers the forward computes with: ``freq`` non-persistent (the exporter records
    what is computed from it as a constant), ``scale`` persistent (an initializer); and a
    BatchNorm with running statistics away from their initial values."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.tensor([1.0, 0.1, 0.01, 0.001]), persistent=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.lin = nn.Linear(8, 3)
        self.bn = nn.BatchNorm1d(8)
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.linspace(-1, 1, 8))
            self.bn.running_var.copy_(torch.linspace(0.5, 2, 8))

    def forward(self, x):  # x: (batch, positions, 8)
        pos = torch.arange(x.shape[1], dtype=x.dtype)
        angles = pos[:, None] * self.freq[None, :]
        x = x * torch.cat([angles.cos(), angles.sin()], -1) * self.scale
        return self.lin(self.bn(x.transpose(1, 2)).transpose(1, 2)).transpose(1, 2)


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
        if kind in ("bert", "gpt2", "llama"):
            x = torch.randint(0, 40, (2, 8), generator=g)
            y = torch.randint(0, 3, (2,), generator=g) if kind == "bert" else \
                torch.randint(0, 40, (2, 8), generator=g)
        else:
            shape, classes = {"bn_cnn": ((4, 3, 6, 6), 4), "mlp": ((8, 5), 3),
                              "resnet18": ((4, 3, 64, 64), 4)}[kind]
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
    if kind == "llama":
        return Llama().train(), "output", "input_ids"
    return Lm().train(), "output", "input_ids"


KINDS = ["bn_cnn", "mlp", "resnet18", "bert", "gpt2", "llama"]
RULED = {"bn_cnn", "mlp", "resnet18"}  # every op has a rule in helpers.rounding
SHALLOW = {"bn_cnn", "mlp"}  # whose forward's worst-case bound is of use


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

    gpt = Lm().gpt  # a ModelOutput with a cache object: only its tensors, logits first
    model = tt.export(gpt, (ids,))
    assert [o.name for o in model.graph.output] == ["logits"]

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, a, b):
            return self.lin(a), self.lin(b).sum()

    model = tt.export(Pair(), (torch.randn(4, 3), torch.randn(1, 3)),
                      dynamic_axes={"a": {0: "batch"}, "output_0": {0: "batch"}})
    assert [i.name for i in model.graph.input] == ["a", "b"]
    assert [o.name for o in model.graph.output] == ["output_0", "output_1"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    tr = Trainer(model, losses.mse("output_0"), optim.AdamW(lr=LR), seed=0, threads=1)
    tr.step({"a": np.ones((7, 3), F32), "b": np.ones((1, 3), F32),
             "target": np.zeros((7, 2), F32)})  # another batch size than the example's


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

    cumulative = BnCnn()
    cumulative.bn.momentum = None  # 1/num_batches_tracked: no fixed ONNX momentum
    with pytest.raises(ValueError, match="bn has momentum=None"):
        tt.export(cumulative, (torch.randn(2, 3, 4, 4),))

    class Unused(nn.Module):  # an unused parameter is left out, not an error
        def __init__(self):
            super().__init__()
            self.lin, self.spare = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x)

    assert list(_meta(tt.export(Unused(), (torch.randn(2, 3),)))["params"]) == \
        ["lin.weight", "lin.bias"]


def _torch_bound(module, x, want):
    """How far another float32 evaluation of ``module`` (train mode) at ``x`` may be from
    torch's ``want``: the model of :func:`torch_model_grads`, four times torch's own float32
    error against a float64 copy plus u of the largest output."""
    with torch.no_grad():
        want64 = _logits(copy.deepcopy(module).double(),
                         x.double() if x.is_floating_point() else x).numpy()
    return 4 * (np.abs(want - want64).max() + U * np.abs(want64).max())


@pytest.mark.parametrize("kind", ["llama", "rotary"])
def test_export_computes_what_the_module_computes(kind):
    """onnxruntime's outputs of the export (a plain InferenceSession) are the module's own
    training-mode outputs within float32 rounding (:func:`_torch_bound`), for buffers the
    forward computes with: Llama's rotary ``inv_freq`` (non-persistent: what is computed
    from it becomes a constant of the graph, which must hold the real angles, not ones
    from the values the export fills parameters with); a persistent buffer used as a
    factor (an initializer holding its value, named in the metadata); BatchNorm's running
    statistics (an initializer each, their values put back in the module too)."""
    if kind == "llama":
        module, out, _ = make("llama")
        x = _batches("llama")[0][0]
    else:
        torch.manual_seed(1)
        module, out, x = Rotary().train(), "output", torch.randn(4, 5, 8)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    bufs = {n: b.clone() for n, b in module.named_buffers()}
    model = tt.export(module, (x,))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(torch.equal(bufs[n], b) for n, b in module.named_buffers())
    meta = _meta(model)
    if kind == "llama":
        assert not meta["buffers"]  # inv_freq: not an initializer (computed into a constant)
    else:
        assert set(meta["buffers"]) == {"scale", "bn.running_mean", "bn.running_var"}
        for name, e in meta["buffers"].items():
            np.testing.assert_array_equal(_onnx_value(model, e["initializer"]),
                                          bufs[name].numpy())
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if kind == "rotary":  # onnxruntime's optimizations rewrite training-mode BatchNorm
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    got = session.run([out], {model.graph.input[0].name: x.numpy()})[0].astype(np.float64)
    with torch.no_grad():
        want = _logits(module, x).double().numpy()
    module.load_state_dict(before)  # the forward moved the running statistics
    bound = _torch_bound(module, x, want)
    diff = np.abs(got - want)
    assert diff.max() <= bound, f"{kind}: outputs differ by {diff.max():.3g}, bound {bound:.3g}"


def test_export_refuses_a_graph_that_computes_something_else(monkeypatch):
    """The export's own check: with every buffer filled while tracing (as the bridge once
    did), the constant computed from the non-persistent ``freq`` holds the fill values'
    angles, and the export refuses, naming the output; active dropout modules are quiet
    for the check (and stay in training mode); a forward random without them (functional
    dropout) cannot be checked: a warning."""
    exporter = sys.modules["trainops.torch.exporter"]
    real = exporter._fillable
    monkeypatch.setattr(exporter, "_fillable", lambda module, counters: real(
        module, counters) | {id(b) for b in module.buffers() if b.is_floating_point()})
    with pytest.raises(ValueError, match="onnxruntime's outputs of the export are not the "
                       r"module's training-mode outputs: output differs by"):
        tt.export(Rotary().train(), (torch.randn(4, 5, 8),))
    monkeypatch.undo()

    drop = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).train()
    model = tt.export(drop, (torch.randn(4, 3),))
    assert drop[1].training and any(n.op_type == "Dropout" for n in model.graph.node)

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return nn.functional.dropout(self.lin(x), 0.5, training=True)

    with pytest.warns(UserWarning, match="could not be checked"):
        tt.export(Functional(), (torch.randn(64, 3),))


def test_state_dict_needs_the_metadata(library_path):
    module, _, _ = make("mlp")
    model = tt.export(module, (torch.randn(8, 5),))
    del model.metadata_props[:]
    tr = Trainer(model, losses.cross_entropy("output"), optim.AdamW(lr=LR), seed=0, threads=1)
    with pytest.raises(ValueError, match="not exported by trainops.torch.export"):
        tr.state_dict()


# -- training against torch ------------------------------------------------------------------

def _logits(module, x):
    out = module(x)
    return out.logits if hasattr(out, "logits") else out


def _by_initializer(meta, values: dict, kind="params") -> dict:
    """``{initializer: float32 array in the ONNX orientation}`` from torch tensors by torch
    name (tied names give one entry)."""
    out = {}
    for name, e in meta[kind].items():
        if name in values and e["initializer"] not in out:
            v = values[name].detach().numpy()
            out[e["initializer"]] = np.array(v.T if e.get("transposed") else v, F32)
    return out


def torch_run(module, meta, batches):
    """torch.optim.AdamW (LR, WD, torch's other defaults) on the trainable parameters:
    ``(losses, states)`` with ``states[t]`` the parameters ``x``, moments ``M``, ``V``
    and running statistics after step t (``states[0]``: before the first)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    named = dict(module.named_parameters(remove_duplicate=False))

    def snap():
        out = {"x": _by_initializer(meta, named),
               "stats": _by_initializer(meta, dict(module.named_buffers()), "buffers")}
        for key, slot in (("M", "exp_avg"), ("V", "exp_avg_sq")):
            out[key] = _by_initializer(meta, {n: opt.state[p][slot] if p in opt.state else
                                              torch.zeros_like(p) for n, p in named.items()})
        out["stats"] = {k: v for k, v in out["stats"].items() if v.dtype.kind == "f"}
        return out

    states, out = [snap()], []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(_logits(module, x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
        states.append(snap())
    return out, states


def trainops_run(tr, batches, x_name):
    def snap():
        st = tr.optimizer_state()
        x = tr.parameters()
        return {"x": x, "stats": tr.running_stats(),
                **{s: {k: st[f"trainops/{s}/{k}"] for k in x} for s in ("M", "V")}}

    states, out = [snap()], []
    for x, y in batches:
        out.append(tr.step({x_name: x.numpy(), "labels": y.numpy()}))
        states.append(snap())
    return out, states


def assert_adamw_agree(grads, run_a, run_b, what=""):
    """:func:`helpers.adam_pair.assert_runs_agree`'s argument for torch's AdamW, after every
    step, from ``grads(t, xa, xb) -> (loss bound, D)`` (D: per parameter, how far the two
    runs' gradients at step t may be apart):

    - ``M = beta1 M + (1 - beta1) g`` moves apart by beta1 times the previous bound plus
      (1 - beta1) D, plus each run's roundings of the lerp (its difference and product:
      2u (|M| + |M_prev|), and the sum: u |M|);
    - ``sqrt(V)``, the 2-norm of (sqrt(beta2) sqrt(V_prev), sqrt(1 - beta2) g), moves by
      sqrt(beta2) times the previous bound plus sqrt(1 - beta2) D (Minkowski), plus
      gamma_3 of each run's value (V's two roundings and the square root's);
    - the update ``r M / (sqrt(V) + eps')``, with ``r = lr sqrt(1 - beta2^t) / (1 -
      beta1^t)`` and ``eps' = eps sqrt(1 - beta2^t)`` (torch's ``step_size`` and
      ``denom``), differs by at most ``r (dM / (S_a + eps') + |M_b| dS / ((S_a + eps')(S_b
      + eps')))`` and never by more than both updates' sizes together, plus gamma_8 of
      each (the square root, the division by sqrt(1 - beta2^t), + eps, the quotient, the
      step size and the constants' own roundings to float32);
    - the parameters: the decay ``x (1 - lr wd)`` scales the previous bound and rounds
      (the factor and the product: gamma_3 of each run's previous value with the update's
      subtraction from it), the update's subtraction rounds once (u |x|)."""
    (la, sa), (lb, sb) = run_a, run_b
    b1, b2, eps = 0.9, 0.999, 1e-8
    names = list(sa[0]["x"])
    assert sorted(names) == sorted(sb[0]["x"]), (names, list(sb[0]["x"]))
    bx, bm, bs = ({k: np.zeros(sa[0]["x"][k].shape) for k in names} for _ in range(3))
    worst = {k: {"x": 0.0, "M": 0.0, "sqrt(V)": 0.0} for k in names}
    worst["loss"] = 0.0
    for t in range(1, len(la) + 1):
        lbound, Ds = grads(t, sa[t - 1]["x"], sb[t - 1]["x"])
        within_loss(worst, what, t, la[t - 1], lb[t - 1], lbound)
        rate = LR * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        epsh = eps * np.sqrt(1 - b2 ** t)
        for k in names:
            D = Ds[k]
            Ma, Mb, Mpa, Mpb = (s[i]["M"][k].astype(np.float64)
                                for i in (t, t - 1) for s in (sa, sb))
            Sa, Sb = (np.sqrt(s[t]["V"][k].astype(np.float64)) for s in (sa, sb))
            bm[k] = b1 * bm[k] + (1 - b1) * D \
                + U * (1 + gamma(2)) * (3 * (np.abs(Ma) + np.abs(Mb)) + 2 * (np.abs(Mpa) + np.abs(Mpb)))
            bs[k] = np.sqrt(b2) * bs[k] + np.sqrt(1 - b2) * D + gamma(3) * (Sa + Sb)
            ua, ub = rate * np.abs(Ma) / (Sa + epsh), rate * np.abs(Mb) / (Sb + epsh)
            du = np.minimum(rate * (bm[k] / (Sa + epsh)
                                    + np.abs(Mb) * bs[k] / ((Sa + epsh) * (Sb + epsh))), ua + ub)
            xpa, xpb, xa, xb = (s[i]["x"][k].astype(np.float64)
                                for i in (t - 1, t) for s in (sa, sb))
            bx[k] = bx[k] * (1 - LR * WD) + du + gamma(8) * (ua + ub) \
                + gamma(3) * (np.abs(xpa) + np.abs(xpb)) + U * (np.abs(xa) + np.abs(xb))
            within(worst[k], f"{what}step {t}, {k}", (("M", np.abs(Ma - Mb), bm[k]),
                                                      ("sqrt(V)", np.abs(Sa - Sb), bs[k]),
                                                      ("x", np.abs(xa - xb), bx[k])))
    return worst


def with_loss(model, out):
    """``model`` with ``loss = SoftmaxCrossEntropyLoss(out, labels)`` (mean: torch's
    ``cross_entropy``), the form :mod:`helpers.rounding` bounds."""
    from onnx import TensorProto, helper

    m = copy.deepcopy(model)
    m.graph.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, None))
    m.graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [out, "labels"], ["loss"]))
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return m


def rounding_grads(model, loss, feeds_at, carried=True):
    """``grads`` for :func:`assert_adamw_agree` from :mod:`helpers.rounding`.

    ``carried`` (shallow models): each run's whole step (forward errors carried: torch's
    kernels and onnxruntime's differ in the forward too) within a bound of the float64
    step at its own parameters, so ``D = E_a + E_b + |g64(x_a) - g64(x_b)|`` and the
    losses within ``e_a + e_b`` plus the exact change: a theorem, given the allowances for
    the elementary functions. In a deep model (ResNet-18) that worst case, every rounding
    of every layer aligned, compounds out of use (BatchNorm's variance is no longer
    resolved); there, as :func:`helpers.adam_pair.grad_difference` models it, the two
    forwards' differences (other kernels, other summation orders) are roundings of the
    magnitudes of the backward's own, counted as one more ``E_a + E_b``: ``D = 2 (E_a +
    E_b) + |g64(x_a) - g64(x_b)|``, E each backward's bound at the forward's values (a
    model, not a theorem)."""
    def grads(t, xa, xb):
        (La, eLa, ga, Ea), (Lb, eLb, gb, Eb) = pair_bounds(model, xa, xb, feeds_at(t), loss,
                                                           forward_errors=carried)
        k = 1 if carried else 2
        return abs(La - Lb) + k * (eLa + eLb), \
            {p: k * (Ea[p] + Eb[p]) + np.abs(ga[p] - gb[p]) for p in ga}
    return grads


def _step64(module, meta, x, batch, dtype):
    """The loss and gradients (by initializer, ONNX orientation, float64) of a copy of
    ``module`` in ``dtype`` at the parameters ``x`` (by initializer) on ``batch``."""
    m = copy.deepcopy(module).to(dtype)
    named = dict(m.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, e in meta["params"].items():
            v = torch.from_numpy(np.asarray(x[e["initializer"]]))
            named[name].copy_(v.T if e["transposed"] else v)
    m.zero_grad()
    loss = torch.nn.functional.cross_entropy(_logits(m, batch[0].to(dtype) if
                                                     batch[0].is_floating_point() else batch[0]),
                                             batch[1])
    loss.backward()
    return float(loss.detach()), {k: np.asarray(v, np.float64) for k, v in
                         ((e["initializer"], (named[n].grad.T if e["transposed"] else
                                              named[n].grad).double().numpy())
                          for n, e in meta["params"].items())}


def torch_model_grads(module, meta, batches):
    """``grads`` for :func:`assert_adamw_agree` where :mod:`helpers.rounding` has no rule
    for some op (the transformers' Erf, Gather, Where, ...): a MODEL, not a theorem. The
    exact change between the two runs' parameters comes from torch in float64 (``|g64(x_a)
    - g64(x_b)|``, ``|L64(x_a) - L64(x_b)|``); each run's own rounding is taken as at most
    twice the largest error torch's float32 step makes on that tensor at ``x_b`` against
    float64 (``E``: the same ops, summed in other orders), plus u of the tensor's largest
    gradient (where torch happens to be exact); two runs: ``D = |g64(x_a) - g64(x_b)| +
    4 (E + u max|g64|)``, and likewise for the loss."""
    def grads(t, xa, xb):
        La, ga = _step64(module, meta, xa, batches[t - 1], torch.float64)
        Lb, gb = _step64(module, meta, xb, batches[t - 1], torch.float64)
        L32, g32 = _step64(module, meta, xb, batches[t - 1], torch.float32)
        D = {k: np.abs(ga[k] - gb[k]) + 4 * (np.abs(g32[k] - gb[k]).max() + U * np.abs(gb[k]).max())
             for k in ga}
        return abs(La - Lb) + 4 * (abs(L32 - Lb) + U * abs(Lb)), D
    return grads


def assert_stats_agree(model, feeds_at, sa, sb, what="", carried=True):
    """The BatchNorm running statistics of the two runs after every step: ``new = m old +
    (1 - m) batch_stat`` (the variance times n / (n - 1)) move apart by m times the previous
    bound plus (1 - m) times how far the two batch statistics may be apart (the exact
    change between the runs' parameters, from the float64 forward, plus each run's
    distance to it: its forward errors carried, :func:`helpers.rounding.batch_stats`),
    plus gamma_3 of each run's three roundings. Without ``carried`` (a deep model, see
    :func:`rounding_grads`) each run's distance is modelled as twice the local roundings
    of the forward (:func:`helpers.rounding.forward`'s widths)."""
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert bns
    bound = {}
    for t in range(1, len(sa)):
        va, wa = forward(model, sa[t - 1]["x"], feeds_at(t), forward_errors=carried)
        vb, wb = forward(model, sb[t - 1]["x"], feeds_at(t), forward_errors=carried)
        for n in bns:
            mom = float(F32(next((a.f for a in n.attribute if a.name == "momentum"), 0.9)))
            ma, vra, wma, wva, cnt = batch_stats(va[n.input[0]], wa[n.input[0]])
            mb, vrb, wmb, wvb, _ = batch_stats(vb[n.input[0]], wb[n.input[0]])
            for name, da, db, w, scale in ((n.input[3], ma, mb, wma + wmb, 1.0),
                                           (n.input[4], vra, vrb, wva + wvb, cnt / (cnt - 1))):
                olda, oldb = (s[t - 1]["stats"][name].astype(np.float64) for s in (sa, sb))
                newa, newb = (s[t]["stats"][name].astype(np.float64) for s in (sa, sb))
                rounding = gamma(3) * (mom * (np.abs(olda) + np.abs(oldb))
                                       + (1 - mom) * scale * (np.abs(da) + np.abs(db)))
                bound[name] = mom * bound.get(name, 0.0) \
                    + (1 - mom) * scale * (np.abs(da - db) + w) * (1 + gamma(3)) + rounding
                got = np.abs(newa - newb)
                assert (got <= bound[name]).all(), (
                    f"{what}step {t}, {name}: running statistics differ by {got.max():.3g}, "
                    f"bound {bound[name][np.argmax(got - bound[name])]:.3g}")


def _batch_stats(module, meta, x, batch, dtype) -> dict:
    """Each BatchNorm's batch mean and unbiased variance (by the running statistics'
    initializers, float64) in a copy of ``module`` in ``dtype`` at the parameters ``x``:
    its running statistics after one forward with momentum 1."""
    m = copy.deepcopy(module).to(dtype)
    named = dict(m.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, e in meta["params"].items():
            named[name].copy_(torch.from_numpy(np.asarray(x[e["initializer"]])))
        for bn in m.modules():
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.momentum = 1.0
        m(batch[0].to(dtype))
    bufs = dict(m.named_buffers())
    return {e["initializer"]: bufs[n].double().numpy() for n, e in meta["buffers"].items()
            if "running" in n}


def assert_stats_agree_model(module, meta, batches, sa, sb, what=""):
    """The running statistics where :func:`assert_stats_agree`'s forward bound is out of use
    (a deep model): ``new = (1 - m) old + m batch_stat`` (torch's momentum m), the batch
    statistics' difference modelled as :func:`torch_model_grads` models the gradients'
    (the exact change from torch in float64, plus four times torch's own float32 error on
    that tensor, plus u of its largest value), plus gamma_3 of each run's roundings."""
    mom = {n: bn.momentum for n, bn in module.named_modules()
           if isinstance(bn, nn.modules.batchnorm._BatchNorm)}
    bound = {}
    for t in range(1, len(sa)):
        a64 = _batch_stats(module, meta, sa[t - 1]["x"], batches[t - 1], torch.float64)
        b64 = _batch_stats(module, meta, sb[t - 1]["x"], batches[t - 1], torch.float64)
        b32 = _batch_stats(module, meta, sb[t - 1]["x"], batches[t - 1], torch.float32)
        for name, e in meta["buffers"].items():
            k = e["initializer"]
            if k not in a64:
                continue
            m = mom[name.rsplit(".", 1)[0]]
            olda, oldb, newa, newb = (s[i]["stats"][k].astype(np.float64)
                                      for i in (t - 1, t) for s in (sa, sb))
            width = np.abs(a64[k] - b64[k]) + 4 * (np.abs(b32[k] - b64[k]).max()
                                                  + U * np.abs(b64[k]).max())
            bound[k] = (1 - m) * bound.get(k, 0.0) + m * width * (1 + gamma(3)) + gamma(3) * (
                (1 - m) * (np.abs(olda) + np.abs(oldb)) + m * (np.abs(a64[k]) + np.abs(b64[k])))
            got = np.abs(newa - newb)
            assert (got <= bound[k]).all(), (
                f"{what}step {t}, {name}: running statistics differ by {got.max():.3g}, "
                f"bound {bound[k][np.argmax(got - bound[k])]:.3g}")


# ResNet-18 at 64x64, first step: one input of layer2.0's last ReLU (sample 2, channel 117,
# row 5, column 3) is -3.8e-6 in float64, the sum of two BatchNorm outputs of 0.845 that
# cancel; onnxruntime's float32 forward has +1.8e-7 there (within its rounding: every
# BatchNorm output of trainops is as close to float64 as torch's float32 ones), so its ReLU
# passes the gradient that float64's blocks, and layer2.0.conv2.weight's gradient is 23%
# (of its largest element) off float64's; the layers before it, 2-25%. Not a trainops bug:
# torch float32 in channels_last memory format rounds that sum to +2.4e-6 and is off by the
# same 23%, and float64 with that one input moved by +1e-5 matches trainops' gradients to
# 3e-6. Whether the sum's sign flips depends on the kernels (graph optimizations, which
# parameters train, the CPU), so not strict. The comparison's model has no allowance for a
# ReLU input inside the forward's error of 0.
RESNET_KINK = pytest.mark.xfail(strict=False, reason="a ReLU input within float32 rounding of "
                                "0 (-3.8e-6 in float64) takes the other branch: the gradients "
                                "before layer2.1 differ from float64's by up to 23%, as torch "
                                "float32's do in channels_last")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=RESNET_KINK) if k == "resnet18" else k
                                  for k in KINDS])
def test_trains_as_torch_adamw(library_path, kind):
    """trainops' AdamW on the export against torch.optim.AdamW on the module, STEPS steps
    on the same batches: losses, moments, parameters and running statistics within the
    rounding-derived bounds after every step; the frozen parameters stay as they were."""
    module, out, x_name = make(kind)
    batches = _batches(kind)
    model = tt.export(module, (batches[0][0],))
    meta = _meta(model)
    reference = copy.deepcopy(module)  # the module as exported, for the float64 steps
    tr = Trainer(model, losses.cross_entropy(out), optim.AdamW(lr=LR, weight_decay=WD),
                 seed=0, threads=1)
    ours = trainops_run(tr, batches, x_name)
    theirs = torch_run(module, meta, batches)

    def feeds_at(t):
        x, y = batches[t - 1]
        return {x_name: x.numpy(), "labels": y.numpy()}

    if kind in SHALLOW:
        graph = with_loss(import_model(model), out)
        grads = rounding_grads(graph, "loss", feeds_at)
    else:
        grads = torch_model_grads(reference, meta, batches)
    assert_adamw_agree(grads, ours, theirs, f"{kind}: ")
    if kind == "bn_cnn":
        assert_stats_agree(graph, feeds_at, ours[1], theirs[1], f"{kind}: ")
    if kind == "resnet18":
        assert_stats_agree_model(reference, meta, batches, ours[1], theirs[1], f"{kind}: ")
    # it trained: every parameter moved, the frozen ones did not
    for k, x0 in ours[1][0]["x"].items():
        assert not np.array_equal(ours[1][-1]["x"][k], x0), k
    exported = tr.export()
    for name, p in reference.named_parameters():
        if not p.requires_grad:
            np.testing.assert_array_equal(_onnx_value(exported, name), p.detach().numpy())
            np.testing.assert_array_equal(dict(module.named_parameters())[name].detach(), p.detach())



# -- the round trip --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mlp", "bn_cnn", "gpt2"])
def test_state_dict_puts_the_trained_model_back(library_path, kind):
    """Train in trainops, ``module.load_state_dict(trainer.state_dict(), strict=False)``:
    the module holds the trainer's values bit for bit (torch's orientation, both names of
    tied parameters, the running statistics), and in eval mode its logits are
    onnxruntime's on ``trainer.export()``: within the forward's rounding bound for the MLP
    (:func:`helpers.rounding.forward`, errors carried: each float32 evaluation within its
    width of the float64 values, a theorem), and for the others (ops without a rule there:
    BatchNorm's inference form, the transformer) within the model of
    :func:`torch_model_grads`: four times torch's own float32 error against float64 plus
    u of the largest logit."""
    module, out, x_name = make(kind)
    batches = _batches(kind)
    model = tt.export(module, (batches[0][0],))
    tr = Trainer(model, losses.cross_entropy(out), optim.AdamW(lr=1e-2, weight_decay=WD),
                 seed=0, threads=1)
    trainops_run(tr, batches[:3], x_name)
    sd = tr.state_dict()
    meta = _meta(model)
    assert set(sd) == set(meta["params"]) | set(meta["buffers"])
    result = module.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys
    params, stats = tr.parameters(), tr.running_stats()
    state = module.state_dict(keep_vars=False)
    for name, e in meta["params"].items():
        want = params[e["initializer"]]
        np.testing.assert_array_equal(state[name].numpy(), want.T if e["transposed"] else want)
    for name, e in meta["buffers"].items():
        if e["initializer"] in stats:
            np.testing.assert_array_equal(state[name].numpy(), stats[e["initializer"]])
    assert kind != "bn_cnn" or stats  # the running statistics were trained and came back
    if kind == "gpt2":
        assert module.gpt.lm_head.weight is module.gpt.transformer.wte.weight  # still tied

    module.eval()
    x = batches[-1][0]
    exported = tr.export()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(exported.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    got = session.run([out], {x_name: x.numpy()})[0].astype(np.float64)
    with torch.no_grad():
        want = _logits(module, x).double().numpy()
        want64 = _logits(copy.deepcopy(module).double(),
                         x.double() if x.is_floating_point() else x).numpy()
    if kind == "mlp":
        vals, width = forward(exported, {}, {x_name: x.numpy()}, forward_errors=True)
        bound = 2 * width[out]
        np.testing.assert_allclose(vals[out], want64, rtol=1e-12, atol=1e-12)
    else:
        bound = 4 * (np.abs(want - want64).max() + U * np.abs(want64).max())
    diff = np.abs(got - want)
    assert (diff <= bound).all(), f"{kind}: logits differ by {diff.max():.3g} (bound " \
                                  f"{np.broadcast_to(bound, diff.shape)[np.argmax(diff - bound)]:.3g})"


def test_state_dict_survives_checkpoints_and_artifacts(library_path, tmp_path):
    """The metadata travels with the model a checkpoint and the training artifacts store:
    a trainer resumed from either gives the same state_dict, bit for bit."""
    module, out, x_name = make("bn_cnn")
    batches = _batches("bn_cnn")
    tr = Trainer(tt.export(module, (batches[0][0],)), losses.cross_entropy(out),
                 optim.AdamW(lr=1e-2), seed=0, threads=1)
    trainops_run(tr, batches[:2], x_name)
    want = tr.state_dict()
    tr.save(tmp_path / "ckpt.safetensors")
    tr.save_artifacts(tmp_path / "artifacts")
    for other in (Trainer.load(tmp_path / "ckpt.safetensors"),
                  Trainer.from_artifacts(tmp_path / "artifacts")):
        got = other.state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
