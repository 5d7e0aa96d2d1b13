"""The training loop of docs/artifacts.md with onnxruntime, numpy and safetensors ONLY: no
trainops import (the library's path comes from $TRAINOPS_LIBRARY). What a program in any
language does with the artifacts; tests/test_artifacts.py checks it against Trainer.step."""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
from safetensors import safe_open
from safetensors.numpy import save_file


class ArtifactLoop:
    """A session on ``training.onnx`` with every state's input and output bound to ONE
    OrtValue over one numpy buffer, read from ``checkpoint.safetensors``."""

    def __init__(self, directory, threads: int = 1, library: str | None = None):
        self.dir = str(directory)
        with open(os.path.join(self.dir, "manifest.json")) as f:
            self.manifest = m = json.load(f)
        assert m["format"] == "trainops-artifacts" and m["format_version"] == 1
        so = ort.SessionOptions()
        if m["custom_ops"]:  # portable artifacts need no library: none is loaded
            so.register_custom_ops_library(library or os.environ["TRAINOPS_LIBRARY"])
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.session = ort.InferenceSession(os.path.join(self.dir, m["models"]["training"]),
                                            so, providers=["CPUExecutionProvider"])
        with safe_open(os.path.join(self.dir, m["checkpoint"]), "np") as f:
            self.metadata = dict(f.metadata())
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        self.buffers: dict[str, np.ndarray] = {}
        self.values: dict[str, ort.OrtValue] = {}
        self.binding = bind = self.session.io_binding()
        for s in m["states"]:
            buf = np.array(tensors.pop(s["input"]), order="C", copy=True)
            assert str(buf.dtype) == s["dtype"] and list(buf.shape) == s["shape"], s
            self.buffers[s["input"]] = buf
            self.values[s["input"]] = v = ort.OrtValue.ortvalue_from_numpy(buf)
            bind.bind_ortvalue_input(s["input"], v)
            bind.bind_ortvalue_output(s["output"], v)
        self.other_tensors = tensors  # not states (the source model's bytes): kept as read
        loss = m["loss"]
        self.outputs = {loss["training_output"]: np.zeros(loss["shape"], loss["dtype"])}
        for o in m["extra_outputs"]:
            self.outputs[o["name"]] = np.zeros(o["shape"], o["dtype"])
        for name, buf in self.outputs.items():
            self.values[name] = v = ort.OrtValue.ortvalue_from_numpy(buf)
            bind.bind_ortvalue_output(name, v)
        self.T = int(self.metadata["step"])
        self.lr = float(self.metadata["learning_rate"])
        self.skipped = int(self.metadata["skipped"])

    def step(self, feeds) -> float:
        """One step on ``feeds`` (every data input); the loss before the update. ``T``
        advances unless the manifest's skip output says the step was skipped."""
        m, bind = self.manifest, self.binding
        for d in m["data_inputs"]:
            bind.bind_cpu_input(d["name"], np.ascontiguousarray(feeds[d["name"]], d["dtype"]))
        bind.bind_cpu_input(m["learning_rate"]["input"],
                            np.array([self.lr], m["learning_rate"]["dtype"]))
        bind.bind_cpu_input(m["step"]["input"], np.array([self.T], np.int64))
        self.session.run_with_iobinding(bind)
        skip = m["step"]["skip_output"]
        if skip is None or bool(self.outputs[skip]):
            self.T += 1
        else:
            self.skipped += 1
        return float(self.outputs[m["loss"]["training_output"]].reshape(-1)[0])

    def save(self, path) -> None:
        """The checkpoint: every state buffer by its input name, the other tensors as read,
        the metadata with this loop's step, learning rate, loss scale and skipped count."""
        meta = dict(self.metadata, step=str(self.T), learning_rate=repr(self.lr),
                    skipped=str(self.skipped))
        scale = self.buffers.get("trainops/loss_scale")
        if scale is not None:
            meta["loss_scale"] = repr(float(scale.reshape(-1)[0]))
        save_file({**self.other_tensors, **self.buffers}, str(path), metadata=meta)

    def eval_session(self, threads: int = 1) -> ort.InferenceSession:
        """A session on ``eval.onnx`` (it needs no custom op; the library is loaded anyway
        when the manifest lists custom ops, as a program would for every model of the
        folder)."""
        so = ort.SessionOptions()
        if self.manifest["custom_ops"]:
            so.register_custom_ops_library(os.environ["TRAINOPS_LIBRARY"])
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        return ort.InferenceSession(os.path.join(self.dir, self.manifest["models"]["eval"]),
                                    so, providers=["CPUExecutionProvider"])

    def evaluate(self, sess: ort.InferenceSession, feeds) -> float:
        """eval.onnx's loss on ``feeds`` with the parameters' buffers bound as its inputs."""
        m = self.manifest
        bind = sess.io_binding()
        for d in m["data_inputs"]:
            bind.bind_cpu_input(d["name"], np.ascontiguousarray(feeds[d["name"]], d["dtype"]))
        for p in m["parameters"]:
            bind.bind_ortvalue_input(p, self.values[p])
        bind.bind_output(m["loss"]["eval_output"], "cpu")
        sess.run_with_iobinding(bind)
        return float(bind.copy_outputs_to_cpu()[0].reshape(-1)[0])
