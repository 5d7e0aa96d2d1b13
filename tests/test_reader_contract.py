"""The reader contract of docs/artifacts.md: the same corrupt manifests and checkpoints, one
per row of its table (and per malformed value), fed to both readers, the Python package
(``Trainer.from_artifacts``, and ``Trainer.load`` for checkpoints) and the Rust trainer (its
example ``train``, crates/trainops-trainer): both refuse every one, each naming the file and
the key. Where both give a list of manifest problems (the schema and the checks it cannot
express), the two lists are the same. Also: the two readers' schema validation (the
``jsonschema`` package and the ``jsonschema`` crate, each worded by its reader) finds the same
problems in valid manifests and in thousands of mutations of them; the copies of the schema
are the documented one; the optimizer and schedule names the readers accept are the ones the
package has; every row of the documented table is exercised here.

Corrupt files are written with safetensors' own writer and ``json``, never trainops'."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from helpers import rust_trainer
from helpers.artifact_cases import CASES, make_trainer
from trainops import Trainer
from trainops.train import schema as schema_mod
from trainops.train.artifacts import ManifestError
from trainops.train.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
CASE = "mixed-float16-skips"  # a loss scale state, a skip output, two data inputs
N_BATCHES = 2


@pytest.fixture(scope="module")
def train_rs():
    """The Rust example, or the reason it cannot run here (then each test checks the
    Python reader and skips the Rust half saying why)."""
    try:
        return rust_trainer.build()
    except pytest.skip.Exception as e:
        return str(e)


def _rust(train_rs, library_path, *args):
    if isinstance(train_rs, str):
        pytest.skip(f"the Python reader refused it; the Rust trainer cannot run: {train_rs}")
    return rust_trainer.run(train_rs, library_path, *args, ok=False, timeout=120)


@pytest.fixture(scope="module")
def base(tmp_path_factory, library_path):
    """(the artifacts folder, its manifest, the checkpoint's tensors and metadata as
    safetensors reads them, a batches file)."""
    root = tmp_path_factory.mktemp("contract")
    art = root / "art"
    make_trainer(CASE).save_artifacts(art)
    man = json.loads((art / "manifest.json").read_text())
    with safe_open(str(art / "checkpoint.safetensors"), "np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    batches = root / "batches.safetensors"
    save_file({f"{n}/{i}": v for i, b in enumerate(CASES[CASE][3](N_BATCHES))
               for n, v in b.items()}, str(batches))
    return art, man, tensors, meta, batches


# --- the corrupt files: (row of the table, what is wrong, how, the key named) -------------

def _state(man, kind, k=0):
    return [s for s in man["states"] if s["kind"] == kind][k]


def _set(path, value):
    """A manifest mutation setting the key ``path`` (``a.b[0].c``) to ``value``."""
    def mutate(man):
        parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
        node = man
        for p in parts[:-1]:
            node = node[int(p[1:-1])] if p.startswith("[") else node[p]
        last = parts[-1]
        if last.startswith("["):
            node[int(last[1:-1])] = value
        else:
            node[last] = value
    return mutate


def _delete(key):
    def mutate(man):
        del man[key]
    return mutate


# row, label, mutation of the manifest (or raw text), key the errors must name
MANIFESTS = [
    ("M1", "not JSON", '{"format": "trainops-artifacts",', None),
    ("M1", "not UTF-8", b'{"format": "\xff"}', None),
    ("M2", "states not an array", _set("states", "W"), "states"),
    ("M2", "options missing", _delete("options"), "options"),
    ("M2", "format_version 2", _set("format_version", 2), "format_version"),
    ("M2", "a dtype unknown", _set("states[0].dtype", "float33"), r"states\[0\]\.dtype"),
    ("M2", "a shape not integers", _set("states[0].shape", [8, "16"]), r"states\[0\]\.shape"),
    ("M2", "checkpoint ../x", _set("checkpoint", "../outside.safetensors"), "checkpoint"),
    ("M2", "checkpoint absolute", "ABSOLUTE_CHECKPOINT", "checkpoint"),
    ("M2", "training ../run/", _set("models.training", "../run/training.onnx"),
     r"models\.training"),
    ("M2", "training ..", _set("models.training", ".."), r"models\.training"),
    # the Rust trainer looks for the library in the folder: a path would load any library
    ("M2", "library ../x.so", _set("custom_op_library", "../evil/libtrainops.so"),
     "custom_op_library"),
    ("M3", "a state input twice",
     lambda m: m["states"][1].update(input=m["states"][0]["input"]), r"states\[1\]\.input"),
    ("M3", "a data input that is a state",
     lambda m: m["data_inputs"][0].update(name=m["states"][0]["input"]), r"states\[0\]\.input"),
    ("M4", "an output bound to two states",
     lambda m: m["states"][1].update(output=m["states"][0]["output"]), r"states\[1\]\.output"),
    ("M5", "the loss on a state's output",
     lambda m: m["loss"].update(training_output=m["states"][0]["output"]),
     r"loss\.training_output"),
    ("M6", "skip output not an extra output", _set("step.skip_output", "nothing"),
     r"step\.skip_output"),
    ("M6", "skip output not bool", _set("extra_outputs[0].dtype", "float32"),
     r"step\.skip_output"),
    ("M7", "a parameter that is no param state",
     lambda m: m["parameters"].__setitem__(0, _state(m, "optimizer")["input"]),
     r"parameters\[0\]"),
    ("M8", "an unknown data input",
     lambda m: m["data_inputs"].append({"name": "z", "dtype": "float32", "shape": ["N"]}),
     r"data_inputs\[2\]\.name"),
    ("M9", "a model input not bound", lambda m: m["data_inputs"].pop(1), "data_inputs"),
    ("M10", "an output the model lacks",
     lambda m: m["states"][0].update(output="trainops/new/nothing"), r"states\[0\]\.output"),
    ("M11", "options differ from the config", _set("options.optimizer.lr", 0.5), "optimizer"),
    ("M11", "key_seed differs from the seed", _set("options.key_seed", 78), "seed"),
]


def _meta(key, value):
    def mutate(tensors, meta):
        meta[key] = value
    return mutate


def _config(**changes):
    def mutate(tensors, meta):
        config = json.loads(meta["config"])
        for k, v in changes.items():
            if k == "lr":
                config["optimizer"]["lr"] = v
            else:
                config[k] = v
        meta["config"] = json.dumps(config)
    return mutate


def _drop_meta(key):
    def mutate(tensors, meta):
        del meta[key]
    return mutate


def _model(make):
    """The source model replaced by ``make(bytes)``; ``rehash``: model_sha256 follows."""
    def mutate(tensors, meta, rehash=True):
        import hashlib

        new = make(tensors["trainops/model"].tobytes())
        tensors["trainops/model"] = np.frombuffer(new, np.uint8).copy()
        if rehash:
            meta["model_sha256"] = hashlib.sha256(new).hexdigest()
    return mutate


def _replaced_model(tensors, meta):
    """Another model's bytes, model_sha256 left as it was (a replaced model)."""
    from helpers.artifact_cases import dropout_mlp

    tensors["trainops/model"] = np.frombuffer(dropout_mlp().SerializeToString(), np.uint8).copy()


def _drop_tensor(pick):
    def mutate(tensors, meta):
        del tensors[pick(tensors)]
    return mutate


def _first_param(tensors):
    return "fc0.w"


CHECKPOINTS = [
    ("C1", "not safetensors", b"junk", None),
    ("C2", "seed missing", _drop_meta("seed"), "seed"),
    ("C2", "config missing", _drop_meta("config"), "config"),
    ("C3", "format", _meta("format", "other"), "format"),
    ("C3", "format_version", _meta("format_version", "2"), "format_version"),
    *[("C4", f"step {v!r}", _meta("step", v), "step")
      for v in ["3_0", " 3", "3 ", "+3", "\u0663", "\uff13", "0", "-1", "", "3.0",
                str(2**63), str(2**64 - 1)]],
    *[("C5", f"skipped {v!r}", _meta("skipped", v), "skipped") for v in ["-1", "1.0", "1_0"]],
    *[("C6", f"seed {v!r}", _meta("seed", v), "seed") for v in ["-5x", str(2**64), " 7"]],
    *[("C7", f"learning_rate {v!r}", _meta("learning_rate", v), "learning_rate")
      for v in ["nan", "inf", "-1", "1_0", " 0.1", "0x1p-3", "1e999"]],
    *[("C8", f"loss_scale {v!r}", _meta("loss_scale", v), "loss_scale")
      for v in ["big", "Infinity", "1_0"]],
    *[("C9", f"config {v!r}", _meta("config", v), "config")
      for v in ["{{{", "[1]", '{"loss": NaN}']],
    ("C10", "accumulate 0", _config(accumulate=0), "accumulate"),
    ("C10", "policy bf16", _config(policy="bf16"), "policy"),
    ("C10", "lr -1", _config(lr=-1), "lr"),
    ("C10", "an unknown schedule", _config(schedule={"type": "Sine"}), "schedule"),
    ("C10", "an unknown optimizer", _config(optimizer={"type": "Adamax", "lr": 0.1}), "type"),
    ("C11", "model_sha256 upper case",
     lambda t, m: m.update(model_sha256=m["model_sha256"].upper()), "model_sha256"),
    ("C11", "model_sha256 short", _meta("model_sha256", "abc"), "model_sha256"),
    ("C12", "no source model", _drop_tensor(lambda t: "trainops/model"), "trainops/model"),
    ("C13", "a replaced model", _replaced_model, "trainops/model"),
    ("C13", "a wrong model_sha256", _meta("model_sha256", "0" * 64), "trainops/model"),
    ("C14", "a truncated model, its hash updated", _model(lambda b: b[:len(b) // 2]),
     "trainops/model"),
    ("C14", "no graph, its hash updated", _model(lambda b: b[:2]), "trainops/model"),
    ("C15", "a state missing", _drop_tensor(_first_param), "fc0.w"),
    ("C15", "a state of another shape",
     lambda t, m: t.update({"fc0.w": t["fc0.w"][:4]}), "fc0.w"),
    ("C15", "a state of another dtype",
     lambda t, m: t.update({"fc0.w": t["fc0.w"].astype(np.float64)}), "fc0.w"),
    ("C16", "a tensor that is no state",
     lambda t, m: t.update({"stray": np.zeros(2, np.float32)}), "stray"),
    ("C17", "loss_scale disagrees with its tensor", _meta("loss_scale", "1.0"), "loss_scale"),
]


def _ids(rows):
    return [f"{r[0]}-{r[1]}" for r in rows]


def _copy_art(base, dest: Path) -> Path:
    art = base[0]
    shutil.copytree(art, dest)
    return dest


def _key_named(text: str, key: str | None) -> bool:
    """``key`` named in ``text``: bare (a key path) or quoted either way (a metadata key)."""
    return key is None or re.search(rf"(^|[\s'\"(]){key}($|[\s'\":,)\[\]])", text) is not None


def _problems(python_msg: str) -> list[str]:
    return [line[4:] for line in python_msg.split("\n") if line.startswith("  - ")]


@pytest.mark.parametrize("row, label, change, key", MANIFESTS, ids=_ids(MANIFESTS))
def test_both_readers_refuse_the_manifest(base, train_rs, library_path, tmp_path, row, label,
                                          change, key):
    art = _copy_art(base, tmp_path / "art")
    # What a manifest naming files outside the folder would reach: a valid copy.
    (tmp_path / "run").mkdir()
    shutil.copy(art / "training.onnx", tmp_path / "run" / "training.onnx")
    shutil.copy(art / "checkpoint.safetensors", tmp_path / "outside.safetensors")
    mpath = art / "manifest.json"
    if isinstance(change, (str, bytes)) and change != "ABSOLUTE_CHECKPOINT":
        mpath.write_bytes(change.encode() if isinstance(change, str) else change)
    else:
        man = copy.deepcopy(base[1])
        if change == "ABSOLUTE_CHECKPOINT":
            man["checkpoint"] = str(tmp_path / "outside.safetensors")
        else:
            change(man)
        mpath.write_text(json.dumps(man))
    expected = CheckpointError if row == "M11" else ManifestError
    with pytest.raises(expected) as e:
        Trainer.from_artifacts(art, threads=1)
    py = str(e.value)
    file = str(art / "checkpoint.safetensors") if row == "M11" else str(mpath)
    assert file in py and _key_named(py, key), (key, py)
    r = _rust(train_rs, library_path, art, base[4], 1)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    what = "checkpoint" if row == "M11" else "manifest"
    assert r.stderr.startswith(f"train: {what} {file}: "), r.stderr
    assert _key_named(r.stderr, key), (key, r.stderr)
    if row not in ("M1", "M11"):  # the same list of problems, in the same words
        rust = r.stderr.strip()[len(f"train: manifest {mpath}: "):].split("; ")
        assert sorted(rust) == sorted(_problems(py)), (rust, py)


@pytest.mark.parametrize("row, label, change, key", CHECKPOINTS, ids=_ids(CHECKPOINTS))
def test_both_readers_refuse_the_checkpoint(base, train_rs, library_path, tmp_path, row, label,
                                            change, key):
    art = _copy_art(base, tmp_path / "art")
    path = art / "checkpoint.safetensors"
    if isinstance(change, bytes):
        path.write_bytes(change)
    else:
        tensors = {k: v.copy() for k, v in base[2].items()}
        meta = dict(base[3])
        change(tensors, meta)
        save_file(tensors, str(path), metadata=meta)
    for load in (lambda: Trainer.from_artifacts(art, threads=1),
                 lambda: Trainer.load(path, threads=1)):
        with pytest.raises(CheckpointError) as e:
            load()
        assert str(path) in str(e.value) and _key_named(str(e.value), key), (key, str(e.value))
    r = _rust(train_rs, library_path, art, base[4], 1)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.startswith(f"train: checkpoint {path}: "), r.stderr
    assert _key_named(r.stderr, key), (key, r.stderr)


def test_both_readers_accept_the_files_unchanged(base, train_rs, library_path, tmp_path):
    """The control: the same folder, rewritten by the same writers, trains in both."""
    art = _copy_art(base, tmp_path / "art")
    (art / "manifest.json").write_text(json.dumps(base[1]))
    save_file(dict(base[2]), str(art / "checkpoint.safetensors"), metadata=dict(base[3]))
    tr = Trainer.from_artifacts(art, threads=1)
    batches = CASES[CASE][3](N_BATCHES)
    want = ["%.9g" % tr.step(b) for b in batches]
    r = _rust(train_rs, library_path, art, base[4], 2)
    assert r.returncode == 0 and r.stdout.split() == want, r.stderr


def test_every_row_of_the_documented_table_is_exercised():
    text = (ROOT / "docs" / "artifacts.md").read_text()
    documented = re.findall(r"^\| (M\d+|C\d+) \|", text, re.M)
    assert len(documented) == len(set(documented)) > 20
    tested = {r[0] for r in MANIFESTS + CHECKPOINTS}
    assert set(documented) == tested, (set(documented) ^ tested)


# --- the schema: one file, one meaning -----------------------------------------------------

def test_the_schema_copies_are_the_documented_schema():
    docs = (ROOT / "docs" / "manifest.schema.json").read_bytes()
    assert (ROOT / "python" / "trainops" / "train" / "manifest.schema.json").read_bytes() == docs
    assert (ROOT / "crates" / "trainops-trainer" / "src" / "manifest.schema.json").read_bytes() \
        == docs


def test_the_package_ships_its_schema():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "manifest.schema.json" in config["tool"]["setuptools"]["package-data"]["trainops.train"]
    assert Path(schema_mod.SCHEMA_PATH).read_bytes() == \
        (ROOT / "docs" / "manifest.schema.json").read_bytes()


def test_the_validator_is_draft_2020_12():
    with pytest.raises(ValueError, match="2020-12"):
        schema_mod.Validator({"type": "object"})
    with pytest.raises(ValueError, match="2020-12"):
        schema_mod.Validator({"$schema": "http://json-schema.org/draft-07/schema#"})
    with pytest.raises(Exception, match="is not valid under any of the given schemas"):
        schema_mod.Validator({"$schema": schema_mod.DRAFT_2020_12, "type": 5})


def test_messages_name_the_key_and_what_was_expected():
    file = "a bare file name inside the artifacts folder (no '/', '\\' or NUL, and not '.' or '..')"
    p = schema_mod.manifest_validator().problems(
        {"format": "x", "checkpoint": "../x", "models": {"training": "..", "z": 1},
         "parameters": ["a", "a"], "options": {"key_seed": 2**64}, "min_onnxruntime": "1.17.0\n",
         "step": {"skip_output": 3}, "data_inputs": [{"shape": [1, 2.5]}]})
    for want in [
            'format: expected "trainops-artifacts", got "x"',
            f'checkpoint: expected {file}, got "../x"',
            f'models.training: expected {file}, got ".."',
            f"models.eval: required key is missing (expected {file})",
            "parameters: expected a non-empty array, each item a graph input or output name "
            '(non-empty), without repeats, got ["a","a"]',
            "options.key_seed: expected an integer >= 0 and <= 18446744073709551615, "
            "got 18446744073709551616",
            # ECMA-262's $ (the Rust reader's): not before a final newline
            "min_onnxruntime: expected a string matching ^[0-9]+\\.[0-9]+\\.[0-9]+$, "
            'got "1.17.0\\n"',
            "states: required key is missing (expected a non-empty array, each item an object)",
            "step.skip_output: expected a graph input or output name (non-empty) or null, got 3",
            "data_inputs[0].shape: expected an array, each item a size, a symbolic dimension's "
            "name, or null when unknown or null, got [1,2.5]"]:
        assert want in p, (want, p)
    assert schema_mod.manifest_validator().problems([]) == \
        ["(the manifest): expected an object, got []"]


def _mutations(value, path=()):
    """(path, replacement or DELETE) for every key and item of ``value``, each replaced by
    values of every JSON type (and, for strings and numbers, edge values)."""
    kinds = [None, True, 0, -1, 1.5, 2.0, "", "x", "x\n", "1.0.0\n", "../x", "..", "a\\b",
             "\u0000", [], {}, ["N"], [1, 1], 2**64, 2**64 - 1, -0.0]
    if isinstance(value, dict):
        for k, v in value.items():
            yield path + (k,), "DELETE"
            yield from _mutations(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            yield from _mutations(v, path + (i,))
    for k in kinds:
        if path:
            yield path, k


def _apply(man, path, new):
    man = copy.deepcopy(man)
    node = man
    for p in path[:-1]:
        node = node[p]
    if new == "DELETE":
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return man


def _check_manifest():
    """The Rust example ``check_manifest`` (the trainer's schema validation, no ONNX Runtime),
    built in debug; skips without cargo."""
    return rust_trainer.build_example("check_manifest", "the Rust validator")


def test_both_validators_find_the_same_problems(library_path, tmp_path):
    """The package (``jsonschema``) and the Rust trainer (the ``jsonschema`` crate) find the
    same problems, in the same words, in every valid manifest the package writes and in each
    of their mutations (every key deleted, every value replaced by values of every type,
    strings ending in a newline among them), and agree that the valid ones are valid."""
    exe = _check_manifest()
    ours = schema_mod.manifest_validator()
    manifests = [make_trainer(case).save_artifacts(tmp_path / case) for case in
                 ("cnn-adam", "dropout-momentum", CASE)]
    cases = [(None, man) for man in manifests]
    for man in manifests:
        cases += [(new, _apply(man, path, new)) for path, new in _mutations(man)]
    r = subprocess.run([str(exe)], input="".join(json.dumps(m) + "\n" for _, m in cases),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rust = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rust) == len(cases) and rust[:len(manifests)] == [[]] * len(manifests)
    refused = 0
    for (new, man), theirs in zip(cases, rust):
        got = ours.problems(man)
        if new == 2**64 and not isinstance(new, float):
            # serde_json reads 2^64 as a float, which it shows as 1.8446744073709552e+19:
            # the same problems, the value shown otherwise
            got, theirs = ([p.rsplit(", got ", 1)[0] for p in x] for x in (got, theirs))
        assert sorted(got) == sorted(theirs), (got, theirs)
        refused += bool(got)
    assert len(cases) > 6000 and refused > 4500, (len(cases), refused)  # 6415 and 4794 today


def test_what_the_readers_accept_is_what_the_package_has():
    from trainops import optim, schedules
    from trainops.train import checkpoint_file as checkpoint

    assert set(checkpoint.OPTIMIZER_TYPES) == {"Adam", "AdamW", "Adagrad", "Momentum"}
    for name in checkpoint.OPTIMIZER_TYPES:  # optim.from_dict builds each
        assert type(optim.from_dict({"type": name, "lr": 0.1})).__name__ == name
    assert set(checkpoint.SCHEDULE_TYPES) == set(schedules._TYPES) | {"callable"}
    rust = (ROOT / "crates" / "trainops-trainer" / "src" / "checkpoint.rs").read_text()
    for const, names in (("OPTIMIZER_TYPES", checkpoint.OPTIMIZER_TYPES),
                         ("SCHEDULE_TYPES", checkpoint.SCHEDULE_TYPES),
                         ("POLICIES", checkpoint.POLICIES), ("BATCHNORM", checkpoint.BATCHNORM)):
        m = re.search(rf"pub const {const}: \[&str; \d+\] =\s*\[([^\]]*)\]", rust)
        assert m, const
        assert re.findall(r'"([^"]+)"', m.group(1)) == list(names), const
    schema = json.loads((ROOT / "docs" / "manifest.schema.json").read_text())
    opt = schema["properties"]["options"]["properties"]["optimizer"]["properties"]["type"]
    assert opt["enum"] == list(checkpoint.OPTIMIZER_TYPES)
