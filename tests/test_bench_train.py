"""trainops.bench.train: the model families are the models they say (their loss in ONNX
Runtime against onnx.reference, and against the torch mirror where torch is installed),
and the target runs end to end on tiny settings. No assertion on timings."""

from __future__ import annotations

import json
import os

import pytest

from trainops.bench import train_models
from trainops.bench.train import run

onnxruntime = pytest.importorskip("onnxruntime")


def _ort_loss(fam):
    s = onnxruntime.InferenceSession(fam.model.SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    return float(s.run(["loss"], fam.feeds)[0])


@pytest.mark.parametrize("name", train_models.FAMILIES)
def test_family_loss_matches_onnx_reference(name):
    from onnx.reference import ReferenceEvaluator

    fam = train_models.family(name, batch=3)
    ref = float(ReferenceEvaluator(fam.model).run(["loss"], fam.feeds)[0])
    assert _ort_loss(fam) == pytest.approx(ref, rel=1e-4)
    # trained: every float initializer but BatchNorm's running statistics and constants
    assert not any(p.endswith((".bn.mean", ".bn.var", ".scale")) for p in fam.params)


@pytest.mark.parametrize("name", train_models.FAMILIES)
def test_torch_mirror_is_the_same_model(name):
    torch = pytest.importorskip("torch")
    from trainops.bench.train_torch import torch_model

    fam = train_models.family(name, batch=3)
    net = torch_model(fam)
    logits = net(torch.from_numpy(fam.feeds["x"]))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(fam.feeds["t"]))
    assert float(loss) == pytest.approx(_ort_loss(fam), rel=1e-4)
    n = sum(p.numel() for p in net.parameters())
    assert n == sum(fam.weights[p].size for p in fam.params)


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        train_models.family("vgg")


def test_train_target_end_to_end(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert run(["--models", "cnn,gru", "--threads", "1", "--batch", "4", "--repeat", "1",
                "--steps", "1", "--no-torch", "--profile", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["rows"]] == ["cnn", "gru"]
    cnn, gru = data["rows"]
    assert cnn["ms"]["trainops"] > 0
    # ORT fuses a Conv with its Relu (FusedConv) when only the Relu's output is read later
    assert {"MaxPool", "Adam"} <= set(cnn["profile_us"])
    assert {"Conv", "FusedConv"} & set(cnn["profile_us"])
    # The GRU's backward: trainops' kernel (fused, the CPU default), or the Scan form.
    fused = os.environ.get("TRAINOPS_FUSED_GRADS", "1") != "0"
    assert ("GRUGrad" if fused else "Scan") in gru["profile_us"]
    prof = cnn["profile_us"]
    ops = sum(v for k, v in prof.items() if not k.startswith("("))
    assert ops == pytest.approx(prof["(total kernels)"])
    text = capsys.readouterr().out
    assert "trainops cnn, 1 thread(s): kernels" in text
