"""The plugin EP offering several devices (TRAINOPS_FAKE_DEVICES=2, fake mode): each device
carries its CUDA ordinal and PCI bus id (matched by bus, never by list position; the fake
bus ids descend with the ordinal so that a positional match would show), each device runs a
session of its own with results equal to the CPU door, and a Trainer refuses two devices of
the EP in one session. Runs in a subprocess: the EP reads the variables when first
registered in a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ort = pytest.importorskip("onnxruntime")
from trainops import device as td  # noqa: E402

pytestmark = pytest.mark.skipif(not td.plugin_ep_supported(),
                                reason=f"onnxruntime {ort.__version__} has no plugin EPs (1.24+)")
TESTS = Path(__file__).resolve().parent

CODE = r"""
import json, sys
import numpy as np, onnxruntime as ort
sys.path.insert(0, TESTS)
from trainops import device as td
from trainops.train import placement
from test_plugin_ep import model, adam_model, feeds
devs = td.devices(LIB)
out = {"devices": [dict(d.ep_metadata) | {"hw": dict(d.device.metadata)} for d in devs]}
m = model(adam_model(33))
rng = np.random.default_rng(4)
f = {"R": np.array(0.01, np.float32), "T": np.array(2, np.int64), **feeds(33, rng)}
so = ort.SessionOptions(); so.register_custom_ops_library(LIB)
want = ort.InferenceSession(m, so).run(None, f)
out["runs"] = []
for d in devs:
    so = ort.SessionOptions(); so.log_severity_level = 3
    so.add_provider_for_devices([d], {})
    sess = ort.InferenceSession(m, so)
    before = td.counters(LIB)["device_runs"]
    got = sess.run(None, f)
    out["runs"].append([sess.get_providers()[0], td.counters(LIB)["device_runs"] - before,
                        all(np.array_equal(a, b) for a, b in zip(got, want))])
try:
    placement.resolve(providers=devs)
    out["two"] = "accepted"
except ValueError as e:
    out["two"] = str(e)
print(json.dumps(out))
"""


def test_two_fake_devices_by_bus_id(library_path):
    env = dict(os.environ, TRAINOPS_FAKE_DEVICE="1", TRAINOPS_FAKE_DEVICES="2")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "python"), env.get("PYTHONPATH", "")])
    code = f"LIB = {library_path!r}; TESTS = {str(TESTS)!r}\n" + CODE
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    devs = out["devices"]
    assert [d["device_id"] for d in devs] == ["0", "1"]
    # The bus ids are distinct, written as sysfs writes them, equal to the hardware device's
    # own metadata, and descend with the ordinal (bus::fake): matched by bus, not position.
    buses = [d["pci_bus_id"] for d in devs]
    assert buses == [d["hw"]["pci_bus_id"] for d in devs]
    assert all(len(b) == 12 and b[4] == ":" and b[7] == ":" and b[10] == "." for b in buses), buses
    assert int(buses[0].split(":")[1], 16) > int(buses[1].split(":")[1], 16)
    for provider, runs, same in out["runs"]:
        assert provider == "TrainopsExecutionProvider" and runs == 1 and same
    assert "a session takes one" in out["two"], out["two"]
