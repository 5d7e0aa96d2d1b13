"""The step session's execution providers (trainops.train.assignment, .placement): no
silent fallback to the CPU, ``trainer.assignment``, EP options, ``session_config`` and
``free_dimensions``, all on this CPU-only onnxruntime.

- an EP asked for that does not run the step raises, naming it and why (not installed; a
  plugin EP given by name; the plugin EP's own fake device claiming none of a portable
  step's nodes), whether or not the CPU is listed after it, except a zero claim with the
  CPU listed after it (allowed, said in a warning);
- ``assignment``: onnxruntime's graph-assignment record (1.24+) against an independent
  count, the profile of one run of the same session's model (distinct node indices per
  provider); on an onnxruntime without the record, the profile of the first step;
- options reach onnxruntime as its own providers list takes them (one
  ``add_provider_for_devices`` per EP); ``free_dimensions`` makes the batch dimension a
  fixed size in the session (another batch is refused); ``session_config`` entries are in
  the session's options; bad values are errors naming the argument.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

os.environ["TRAINOPS_FAKE_DEVICE"] = "1"  # read when the EP library is first registered

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import pytest  # noqa: E402

from helpers.tiny import mlp  # noqa: E402
from trainops import Trainer, optim  # noqa: E402
from trainops import device as td  # noqa: E402
from trainops.train import assignment as asg  # noqa: E402
from trainops.train import placement as pl  # noqa: E402

CPU = "CPUExecutionProvider"
plugin_eps = pytest.mark.skipif(not td.plugin_ep_supported(),
                                reason=f"onnxruntime {ort.__version__} has no plugin EPs (1.24+)")
record = pytest.mark.skipif(not asg.has_record(), reason=f"onnxruntime {ort.__version__} "
                            "records no graph assignment (1.24+)")


def batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    return {"x": x, "t": (x[:, 0] > 0).astype(np.int64)}


def trainer(**kw):
    return Trainer(mlp(), "loss", optimizer=optim.Adam(lr=0.05), seed=3, **kw)


def profiled_ops(tr, tmp_path, library):
    """The op types run per provider, by the profiler: a new CPU session of the trainer's
    step model (profiling on), run once on states of ones and ``batch()``."""
    import json

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    if any(n.domain not in ("", "ai.onnx") for n in tr.training_model().graph.node):
        so.register_custom_ops_library(library)
    sess = ort.InferenceSession(tr.training_model().SerializeToString(), so, providers=[CPU])
    feeds = dict(batch())
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(uint32)": np.uint32}
    for i in sess.get_inputs():
        if i.name not in feeds:
            shape = [d if isinstance(d, int) else 1 for d in i.shape]
            feeds[i.name] = np.ones(shape, types[i.type])
    sess.run(None, feeds)
    path = sess.end_profiling()
    with open(path, encoding="utf-8") as f:
        events = json.load(f)
    ops: dict = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            ops.setdefault(e["args"]["provider"], Counter())[e["args"]["op_name"]] += 1
    assert asg.profile_counts(path) == {k: sum(v.values()) for k, v in ops.items()}
    return ops


# -- assignment -------------------------------------------------------------------------

@pytest.mark.parametrize("portable", [False, True])
def test_assignment_on_the_cpu(portable, tmp_path, library_path):
    tr = trainer(portable=portable)
    if asg.has_record():  # known once the session is made
        assert tr.assignment is not None
    else:
        assert tr.assignment is None  # the first step's profile gives it
    tr.step(batch())
    got = tr.assignment
    assert set(got) == {CPU} and got[CPU] > 0
    # the nodes after onnxruntime's optimisations: no more than the step graph has
    assert got[CPU] <= len(tr.training_model().graph.node)
    ran = profiled_ops(tr, tmp_path, library_path)  # independent: what one run executes
    assert set(ran) == {CPU}
    if asg.has_record():
        # the record is made when the graph is partitioned: every node run is in it (a
        # few it lists may be folded away later, e.g. a Transpose of a constant)
        recorded = Counter(n.op_type for sub in tr.session.get_provider_graph_assignment_info()
                           for n in sub.get_nodes())
        assert not ran[CPU] - recorded, ran[CPU] - recorded
        assert sum(recorded.values()) == got[CPU]
    else:
        assert got[CPU] == sum(ran[CPU].values())
    tr.step(batch(seed=1))
    assert tr.assignment == got  # unchanged by later steps


def profile_files():
    import glob
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), f"trainops_assignment_{os.getpid()}_*"))


def test_no_profile_file_is_left():
    """Without the record the first step is profiled: its file is read and removed; a
    trainer that never steps, or whose EP is refused, leaves none either."""
    import gc

    before = set(profile_files())
    trainer().step(batch())
    trainer()
    with pytest.raises(RuntimeError), pytest.warns(UserWarning):
        trainer(providers=["MadeUpExecutionProvider"])
    gc.collect()
    assert set(profile_files()) == before


@record
def test_assignment_of_the_plugin_ep(library_path, standard_grads):
    """The plugin EP's fake device claims the optimizer nodes, the CPU the rest."""
    dev = td.devices(library_path)[:1]
    tr = trainer(providers=dev)
    got = tr.assignment
    assert got.get(td.EP_NAME, 0) >= 1 and got.get(CPU, 0) > got[td.EP_NAME], got
    adam = sum(n.op_type == "Adam" for n in tr.training_model().graph.node)
    assert got[td.EP_NAME] == adam, got


def test_the_record_key_is_trainops_own():
    with pytest.raises(ValueError, match=r"session_config\['session.record_ep_graph_"):
        trainer(session_config={asg.RECORD_KEY: "0"})


# -- no silent fallback -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["CUDAExecutionProvider", "MadeUpExecutionProvider"])
@pytest.mark.parametrize("cpu_after", [False, True])
def test_an_absent_ep_raises(name, cpu_after):
    if name in ort.get_available_providers():
        pytest.skip(f"{name} is installed here")
    providers = [name, CPU] if cpu_after else [name]
    with pytest.warns(UserWarning), pytest.raises(
            RuntimeError, match=rf"Trainer: {name} was asked for but does not run the step "
                                r"\(the session's providers: \['CPUExecutionProvider'\]\): "
                                r"not installed: onnxruntime .* offers"):
        trainer(providers=providers)


@plugin_eps
def test_a_plugin_ep_by_name(library_path):
    """A registered plugin EP given by name: onnxruntime 1.32 makes the trainops EP from its
    name (and fails on its kernels: the library's domains come with its devices), other
    plugins are left out (the WebGPU one); either way no step runs on the CPU instead, and
    the reason the Trainer gives for an absent one names the OrtEpDevice form."""
    td.devices(library_path)  # registered: its devices are listed
    with pytest.raises(Exception, match=td.EP_NAME):
        trainer(providers=[td.EP_NAME, CPU])
    assert pl._why_absent(td.EP_NAME, by_device=False).startswith(
        "it is a plugin EP: register it (onnxruntime.register_execution_provider_library) and "
        "pass its OrtEpDevice (onnxruntime.get_ep_devices()), not its name")


@plugin_eps
def test_an_ep_claiming_nothing_raises_unless_the_cpu_follows(library_path, caplog):
    """The portable step has no node of trainops' domains: the plugin EP takes none. On an
    onnxruntime without the record the first step finds it (not here: 1.24+ has both)."""
    dev = td.devices(library_path)[:1]
    with pytest.raises(RuntimeError, match=rf"Trainer: {td.EP_NAME} claims none of the "
                                           r"step's \d+ nodes \(CPUExecutionProvider: \d+\): "
                                           r"the step would run on the CPU. List "
                                           r"'CPUExecutionProvider' after it"):
        trainer(providers=dev, portable=True)
    cpu_dev = [d for d in ort.get_ep_devices() if d.ep_name == CPU]
    with caplog.at_level(logging.WARNING, logger="trainops"):
        tr = trainer(providers=dev + cpu_dev, portable=True)
    assert tr.placement.cpu_after
    assert f"{td.EP_NAME} claims none of the step's" in caplog.text
    assert set(tr.assignment) == {CPU}
    ref = trainer(portable=True)
    assert tr.step(batch()) == ref.step(batch())


def test_cpu_after_is_the_callers_own_list():
    assert pl.resolve(providers=["X", CPU]).cpu_after
    assert not pl.resolve(providers=[CPU, "X"]).cpu_after
    assert not pl.resolve(providers=["X"]).cpu_after
    assert not pl.resolve(device="cpu").cpu_after


# -- options ----------------------------------------------------------------------------

def test_provider_options_as_onnxruntime_takes_them():
    p = pl.resolve(providers=[("XExecutionProvider", {"a": 1, "b": True, "c": 0.5,
                                                     "load_config": {"CPU": {"P": "f32"}}}), CPU])
    assert p.providers[0] == ("XExecutionProvider", {"a": "1", "b": "True", "c": "0.5",
                                                     "load_config": '{"CPU": {"P": "f32"}}'})
    with pytest.raises(TypeError, match=r"providers: entry 0 \(X\): option names must be str"):
        pl.resolve(providers=[("X", {1: "a"})])
    with pytest.raises(TypeError, match=r"providers: entry 1 \(Y\): option 'k' must be a str, "
                                        r"number, bool or dict, got list"):
        pl.resolve(providers=[CPU, ("Y", {"k": [1]})])
    with pytest.raises(TypeError, match="providers must be a list"):
        pl.resolve(providers=CPU)


def test_cpu_options_make_the_session_with_them():
    """CPU options are not dropped: the session is made from the providers list (the
    default CPU path would ignore it), training as the default CPU Trainer does."""
    opts = [(CPU, {"arena_extend_strategy": "kSameAsRequested"})]
    tr = trainer(providers=opts)
    assert not tr.placement.is_cpu and tr.placement.fuses_grads
    ref = trainer()
    for s in range(3):
        assert tr.step(batch(seed=s)) == ref.step(batch(seed=s))


class Recorder:
    """SessionOptions' add_provider_for_devices, recorded."""

    def __init__(self):
        self.calls = []

    def add_provider_for_devices(self, devices, options):
        self.calls.append(([d.ep_name for d in devices], options))


class FakeDevice:
    def __init__(self, ep_name):
        self.ep_name, self.device = ep_name, object()


def test_device_options_one_call_per_ep():
    a1, a2, b = FakeDevice("A"), FakeDevice("A"), FakeDevice("B")
    p = pl.resolve(providers=[(a1, {"k": 1}), (a2, {"k": 1}), b])
    assert p.ep_options == {"A": {"k": "1"}} and p.names == ("A", "B")
    so = Recorder()
    p.configure(so, None, needs_library=False)
    assert so.calls == [(["A", "A"], {"k": "1"}), (["B"], {})]
    with pytest.raises(ValueError, match=r"entry 1: A devices with different options"):
        pl.resolve(providers=[(a1, {"k": 1}), (a2, {"k": 2})])
    with pytest.raises(TypeError, match="cannot be mixed with provider names"):
        pl.resolve(providers=[(a1, {}), CPU])


@plugin_eps
def test_device_with_options_trains(library_path, standard_grads):
    dev = td.devices(library_path)[0]
    tr = trainer(providers=[(dev, {"unused_option": "1"})])
    assert tr.placement.ep_options == {td.EP_NAME: {"unused_option": "1"}}
    ref = trainer()
    for s in range(2):
        assert tr.step(batch(seed=s)) == ref.step(batch(seed=s))


def test_free_dimensions_fix_the_batch():
    tr = trainer(free_dimensions={"N": 8})
    shapes = {i.name: i.shape for i in tr.session.get_inputs()}
    assert shapes["x"] == [8, 4] and shapes["t"] == [8]
    ref = trainer()
    assert tr.step(batch(8)) == ref.step(batch(8))
    with pytest.raises(Exception, match=r"(?i)x.*(dimension|shape|expected)"):
        tr.step(batch(4))


@pytest.mark.parametrize("dims,error,match", [
    ({"batch": 8}, ValueError, r"free_dimensions \['batch'\]: no input of the step graph has "
                               r"such a dimension \(its symbolic dimensions: \['N'\]\)"),
    ({"N": 0}, ValueError, r"free_dimensions\['N'\] must be an int >= 1, got 0"),
    ({"N": 2.0}, ValueError, r"free_dimensions\['N'\] must be an int >= 1, got 2.0"),
    ({"N": True}, ValueError, r"free_dimensions\['N'\] must be an int >= 1, got True"),
    ({3: 1}, TypeError, r"free_dimensions keys must be dimension names"),
    ([("N", 8)], TypeError, r"free_dimensions must be a dict"),
])
def test_bad_free_dimensions(dims, error, match):
    with pytest.raises(error, match=match):
        trainer(free_dimensions=dims)


def test_session_config_entries_reach_the_session():
    tr = trainer(session_config={"session.intra_op.allow_spinning": "0",
                                 "session.use_device_allocator_for_initializers": 1,
                                 "session.disable_prepacking": False})
    so = tr.session.get_session_options()
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert so.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    assert so.get_session_config_entry("session.disable_prepacking") == "0"
    tr.step(batch())


@pytest.mark.parametrize("config,error,match", [
    ({"k": 1.5}, TypeError, r"session_config\['k'\] must be a str \(or int / bool\), got float"),
    ({"": "1"}, TypeError, r"session_config keys must be non-empty str"),
    ({"k" * 1025: "1"}, ValueError, r"session_config\['kkk.*onnxruntime refused it"),
    ("k=1", TypeError, r"session_config must be a dict"),
])
def test_bad_session_config(config, error, match):
    with pytest.raises(error, match=match):
        trainer(session_config=config)


def test_options_need_the_one_step_session():
    with pytest.raises(NotImplementedError, match="not with accumulate > 1 or comm"):
        trainer(free_dimensions={"N": 8}, accumulate=2)
    assert trainer(accumulate=2).assignment is None  # its two CPU sessions: not recorded


@plugin_eps
def test_without_the_record_the_first_step_profiles(library_path, standard_grads, monkeypatch):
    """The path of onnxruntime before 1.24, here by hiding the record: the counts come from
    the first step's profile (the plugin EP's Adam node, the rest on the CPU), and a zero
    claim is raised by that first step."""
    monkeypatch.setattr(asg, "has_record", lambda: False)
    dev = td.devices(library_path)[:1]
    tr = trainer(providers=dev)
    assert tr.assignment is None
    tr.step(batch())
    adam = sum(n.op_type == "Adam" for n in tr.training_model().graph.node)
    assert tr.assignment[td.EP_NAME] == adam and tr.assignment[CPU] > adam, tr.assignment
    idle = trainer(providers=dev, portable=True)
    with pytest.raises(RuntimeError, match=rf"{td.EP_NAME} claims none of the step's"):
        idle.step(batch())
