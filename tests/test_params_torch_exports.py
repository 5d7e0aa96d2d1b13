"""The default parameters on torch's own exports (tests/data/torch_models, made by
scripts/make_torch_fixtures.py; skipped where absent): on the faithful exports (classic,
dynamo without optimisation) they are torch's trainable parameters, one for one, with no
warning; on the optimised dynamo exports, which fold BatchNorms into Convs, merge
identical initializers or expand tables to the batch, a warning says so."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from trainops.train.importer import import_model
from trainops.train.params import default_params
from helpers.torch_exports import read_export

DATA = Path(__file__).parent / "data" / "torch_models"
EXPORTS = sorted(DATA.glob("*.onnx.gz")) if DATA.is_dir() else []


def _load(path: Path) -> onnx.ModelProto:
    return import_model(read_export(path))


def _torch_params(arch: str) -> tuple[list[str], dict[str, str]]:
    """torch's trainable parameters (``param:<name>``) as the fixture script stored them,
    and its tied parameters' other names (``aliases``: ``other=name``)."""
    with np.load(DATA / f"{arch}.npz") as z:
        names = [k[len("param:"):] for k in z.files if k.startswith("param:")]
        aliases = dict(a.split("=", 1) for a in z["aliases"]) if "aliases" in z.files else {}
    return names, aliases


def _choose(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = default_params(model)
    return chosen, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("path", [p for p in EXPORTS if ".dynamo." not in p.name],
                         ids=lambda p: p.name.removesuffix(".onnx.gz"))
def test_faithful_exports_train_torchs_parameters(path):
    arch = path.name.split(".")[0]
    names, aliases = _torch_params(arch)
    chosen, warned = _choose(_load(path))
    assert warned == []
    # A tied weight (an embedding and the LM head) is one torch parameter the graph may
    # name after its other use.
    assert sorted(aliases.get(n, n) for n in chosen) == sorted(names)


@pytest.mark.parametrize("path", [p for p in EXPORTS if ".dynamo." in p.name],
                         ids=lambda p: p.name.removesuffix(".onnx.gz"))
def test_optimised_dynamo_exports_warn(path):
    model = _load(path)
    chosen, warned = _choose(model)
    assert chosen and warned
    assert all("trainops.torch.export" in w for w in warned)
    kinds = " ".join(warned)
    if any(n.op_type == "Conv" for n in model.graph.node):
        assert "BatchNorm" in kinds or "merged" in kinds
