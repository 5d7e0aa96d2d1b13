"""What the Python side refuses when it is given it, before anything is built or changed:
optimizer hyperparameters (one check for every Adam/AdamW state_dtype, torch's ranges),
schedule arguments and rates out of the float range, params= as a bare string, models in
which a tensor has two definitions, and what `python -m trainops coverage` says (and
exits with) for input it cannot use."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.tiny import mlp
from trainops import Trainer, optim
from trainops.__main__ import main as cli
from trainops.autodiff import GradientError, expand_gradients
from trainops.onnx_defs import IR_VERSION
from trainops.optim import schedules as S
from trainops.train.importer import import_model
from trainops.train.params import check_param_names

F32 = TensorProto.FLOAT
ROOT = Path(__file__).resolve().parent.parent
STATE_DTYPES = ("float32", "int8", "bfloat16")


# --- optimizers: one validation whatever the state_dtype ---

# (keyword arguments, error type, exact message): torch.optim.AdamW's ranges.
ADAMW_BAD = [
    (dict(betas=(1.0, 0.999)), ValueError, "AdamW: betas[0] 1.0: expected a number in [0, 1)"),
    (dict(betas=(1.5, 0.999)), ValueError, "AdamW: betas[0] 1.5: expected a number in [0, 1)"),
    (dict(betas=(-0.1, 0.999)), ValueError,
     "AdamW: betas[0] -0.1: expected a number in [0, 1)"),
    (dict(betas=(0.9, 1.0)), ValueError, "AdamW: betas[1] 1.0: expected a number in [0, 1)"),
    (dict(betas=(0.9, math.nan)), ValueError, "AdamW: betas[1] nan: expected a finite number"),
    (dict(betas="ab"), TypeError,
     "AdamW: betas 'ab': expected a pair of numbers (beta1, beta2), got str"),
    (dict(betas=0.9), TypeError,
     "AdamW: betas 0.9: expected a pair of numbers (beta1, beta2), got float"),
    (dict(betas=(0.9,)), ValueError,
     "AdamW: betas (0.9,): expected a pair of numbers (beta1, beta2), got 1"),
    (dict(betas=(0.9, "a")), TypeError, "AdamW: betas[1] 'a': expected a real number, got str"),
    (dict(eps=-1e-8), ValueError, "AdamW: eps -1e-08: expected a number >= 0"),
    (dict(eps=math.inf), ValueError, "AdamW: eps inf: expected a finite number"),
    (dict(weight_decay=-0.01), ValueError, "AdamW: weight_decay -0.01: expected a number >= 0"),
    (dict(weight_decay="0.01"), TypeError,
     "AdamW: weight_decay '0.01': expected a real number, got str"),
    (dict(maximize=2), ValueError, "AdamW: maximize 2: expected True or False"),
    (dict(maximize="yes"), TypeError, "AdamW: maximize 'yes': expected True or False, got str"),
    (dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0 (AdamW: expected a finite number "
                                ">= 0)"),
]

ADAM_BAD = [
    (dict(alpha=1.0), ValueError, "Adam: alpha 1.0: expected a number in [0, 1)"),
    (dict(alpha=-0.1), ValueError, "Adam: alpha -0.1: expected a number in [0, 1)"),
    (dict(beta=1.5), ValueError, "Adam: beta 1.5: expected a number in [0, 1)"),
    (dict(epsilon=-1e-6), ValueError, "Adam: epsilon -1e-06: expected a number >= 0"),
    (dict(epsilon="1e-6"), TypeError, "Adam: epsilon '1e-6': expected a real number, got str"),
    (dict(norm_coefficient=-0.1), ValueError,
     "Adam: norm_coefficient -0.1: expected a number >= 0"),
    (dict(norm_coefficient_post=math.nan), ValueError,
     "Adam: norm_coefficient_post nan: expected a finite number"),
    (dict(alpha=True), TypeError, "Adam: alpha True: expected a real number, got bool"),
    (dict(beta=np.bool_(False)), TypeError,
     f"Adam: beta {np.bool_(False)!r}: expected a real number, got "
     f"{type(np.bool_(False)).__name__}"),
]


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("kwargs, error, message", ADAMW_BAD)
def test_adamw_refuses_the_same_values_whatever_its_state(state_dtype, kwargs, error, message):
    """AdamW(betas=(1.0, 0.999), state_dtype='int8') trained to all-NaN weights while the
    float32 and bfloat16 ops refused beta1 = 1 at run time: now each state_dtype refuses
    each value at construction, with the same error."""
    with pytest.raises(error) as info:
        optim.AdamW(state_dtype=state_dtype, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("kwargs, error, message", ADAM_BAD)
def test_adam_refuses_the_same_values_whatever_its_state(state_dtype, kwargs, error, message):
    with pytest.raises(error) as info:
        optim.Adam(state_dtype=state_dtype, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("state_dtype, op", [("int8", "8-bit"), ("bfloat16", "bfloat16-state")])
@pytest.mark.parametrize("amsgrad", [True, 1])
def test_amsgrad_is_refused_where_the_state_has_no_op_for_it(state_dtype, op, amsgrad):
    with pytest.raises(ValueError) as info:
        optim.AdamW(amsgrad=amsgrad, state_dtype=state_dtype)
    assert str(info.value) == f"AdamW: amsgrad has no {op} op: use state_dtype='float32'"


def test_valid_edges_and_numpy_values_are_kept_as_plain_numbers():
    """The ranges' closed ends pass; numpy scalars and 0/1 flags become floats and bools,
    so to_dict() stays JSON and from_dict() gives the optimizer back."""
    for sd in STATE_DTYPES:
        opt = optim.AdamW(lr=np.float32(0.5), betas=np.array([0.0, 0.0]), eps=0,
                          weight_decay=np.float64(0.0), maximize=1, state_dtype=sd)
        assert (opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.maximize) == \
            (0.5, (0.0, 0.0), 0.0, 0.0, True)
        assert [type(v) for v in (opt.eps, opt.betas[0], opt.maximize)] == [float, float, bool]
        assert optim.from_dict(json.loads(json.dumps(opt.to_dict()))) == opt
    assert optim.AdamW(amsgrad=1).amsgrad is True
    assert optim.AdamW(maximize=np.bool_(True)).maximize is True
    adam = optim.Adam(alpha=0.0, beta=0.0, epsilon=0.0, norm_coefficient=np.float32(0.25))
    assert adam.attributes() == {"alpha": 0.0, "beta": 0.0, "epsilon": 0.0,
                                 "norm_coefficient": 0.25, "norm_coefficient_post": 0.0}


def test_other_optimizer_arguments_are_checked():
    for make, error, message in [
        (lambda: optim.Adagrad(epsilon="1e-6"), TypeError,
         "Adagrad: epsilon '1e-6': expected a real number, got str"),
        (lambda: optim.Adagrad(decay_factor=math.nan), ValueError,
         "Adagrad: decay_factor nan: expected a finite number"),
        (lambda: optim.Momentum(alpha=None), TypeError,
         "Momentum: alpha None: expected a real number, got NoneType"),
        (lambda: optim.Momentum(mode="heavy"), ValueError,
         "Momentum: mode 'heavy': expected 'standard' or 'nesterov'"),
        (lambda: optim.AdamW(state_dtype=8), TypeError,
         "AdamW: state_dtype 8: expected 'float32', 'int8' or 'bfloat16', got int"),
        (lambda: optim.Adam(state_dtype="int4"), ValueError,
         "Adam: state_dtype 'int4': expected 'float32', 'int8' or 'bfloat16'"),
        (lambda: optim.from_dict({"type": "SGD", "lr": 0.1}), ValueError,
         "optim.from_dict: unknown optimizer type 'SGD'; expected one of "
         "['Adagrad', 'Adam', 'AdamW', 'Momentum']"),
    ]:
        with pytest.raises(error) as info:
            make()
        assert str(info.value) == message


# --- schedules ---

BASE_LR_SCHEDULES = [S.Constant, lambda **k: S.LinearWarmup(3, **k), lambda **k: S.Cosine(10, **k),
                     S.Step, S.Exponential, S.Lambda]


@pytest.mark.parametrize("make", BASE_LR_SCHEDULES)
@pytest.mark.parametrize("lr, error, expected", [
    (math.nan, ValueError, "lr nan: expected a finite number >= 0"),
    (-1, ValueError, "lr -1: expected a finite number >= 0"),
    (math.inf, ValueError, "lr inf: expected a finite number >= 0"),
    ("0.1", TypeError, "lr '0.1': expected a real number, got str"),
    (True, TypeError, "lr True: expected a real number, got bool"),
])
def test_schedules_refuse_a_bad_base_rate(make, lr, error, expected):
    name = type(make(lr=0.1)).__name__
    with pytest.raises(error) as info:
        make(lr=lr)
    assert str(info.value) == f"{name}: {expected}"


def test_schedule_arguments_are_checked_by_type_then_range():
    for make, error, message in [
        (lambda: S.Exponential(gamma="0.9"), TypeError,
         "Exponential: gamma '0.9': expected a real number, got str"),
        (lambda: S.Exponential(gamma=-0.5), ValueError,
         "Exponential: gamma -0.5: expected a finite number >= 0"),
        (lambda: S.Step(gamma=math.inf), ValueError,
         "Step: gamma inf: expected a finite number >= 0"),
        (lambda: S.Step(2.5), TypeError, "Step: step_size 2.5: expected an integer >= 1, got float"),
        (lambda: S.Cosine(10, floor="0"), TypeError,
         "Cosine: floor '0': expected a real number, got str"),
        (lambda: S.OneCycle(max_lr=math.nan), ValueError,
         "OneCycle: max_lr nan: expected a finite number > 0"),
        (lambda: S.OneCycle(three_phase="no"), TypeError,
         "OneCycle: three_phase 'no': expected True or False, got str"),
        (lambda: S.Lambda(0.5), TypeError,
         "Lambda: fn 0.5: expected a callable step -> factor, got float"),
    ]:
        with pytest.raises(error) as info:
            make()
        assert str(info.value) == message
    # numpy values become plain numbers (to_dict stays JSON)
    s = S.Exponential(np.float32(0.5), lr=np.int64(2))
    assert (s.gamma, s.lr, type(s.gamma), type(s.lr)) == (0.5, 2.0, float, float)
    assert S.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_growing_schedules_as_torch_then_a_clear_error_past_the_float_range():
    """gamma > 1 is allowed (torch.optim.lr_scheduler allows it: the rate grows); where
    the rate leaves the float range, a ValueError names the schedule, the step and the
    value, instead of Python's bare OverflowError (34, 'Numerical result out of range')."""
    e = S.Exponential(2.0, lr=0.1)
    assert [e(k) for k in (0, 1, 10)] == [0.1, 0.2, 0.1 * 2.0 ** 10]
    assert e(1000) == 0.1 * 2.0 ** 1000
    with pytest.raises(ValueError) as info:
        e(2000)
    assert str(info.value) == ("Exponential: the learning rate at step 2000 is inf: expected a "
                               "finite number (lr 0.1 * gamma 2.0 ** step)")
    st = S.Step(gamma=10, lr=0.1)
    assert st(3) == 0.1 * 10.0 ** 3
    with pytest.raises(ValueError) as info:
        st(400)
    assert str(info.value) == ("Step: the learning rate at step 400 is inf: expected a finite "
                               "number (lr 0.1 * gamma 10.0 ** (step // 1))")
    # A product that overflows without an exception is caught the same way.
    with pytest.raises(ValueError, match=r"^Exponential: the learning rate at step 1 is inf"):
        S.Exponential(1e300, lr=1e10)(1)
    # From a base rate of 0 the rate stays 0, as PyTorch's multiplications keep it.
    assert S.Exponential(2.0, lr=0.0)(5000) == 0.0
    with pytest.raises(ValueError) as info:
        S.Lambda(lambda step: math.inf, lr=1.0)(3)
    assert str(info.value) == ("Lambda: the learning rate at step 3 is inf: expected a finite "
                               "number (lr 1.0 * fn(step))")
    with pytest.raises(ValueError) as info:  # float(10 ** 400) raises OverflowError
        S.Lambda(lambda step: 10 ** 400, lr=1.0)(0)
    assert str(info.value) == ("Lambda: the learning rate at step 0 is inf: expected a finite "
                               "number (lr 1.0 * fn(step))")
    with pytest.raises(TypeError) as info:
        S.Lambda(lambda step: "x", lr=1.0)(3)
    assert str(info.value) == "Lambda: fn(3) returned 'x': expected a number"


def _feeds(seed):
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal((5, 4)).astype(np.float32),
            "t": r.integers(0, 3, 5).astype(np.int64)}


def test_trainer_step_past_the_float_range_changes_nothing(library_path):
    """Exponential(1e300) from 1e-300: rates 1e-300 and 1.0, then 1e300 ** 2 overflows at
    the third update: a ValueError naming the schedule and step from Trainer.step, with
    the weights, T and the learning rate as they were."""
    tr = Trainer(mlp(), "loss", optim.Momentum(lr=0.1), threads=1, seed=0,
                 schedule=S.Exponential(1e300, lr=1e-300))
    tr.step(_feeds(0))
    tr.step(_feeds(1))
    before = {k: v.copy() for k, v in tr.parameters().items()}
    assert (tr.T, tr.learning_rate) == (3, 1.0)
    with pytest.raises(ValueError) as info:
        tr.step(_feeds(2))
    assert str(info.value).startswith("Exponential: the learning rate at step 2 is inf: ")
    assert (tr.T, tr.learning_rate) == (3, 1.0)
    after = tr.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)


# --- params= ---

def test_params_must_be_a_list_of_names_not_a_string():
    for bad, error, message in [
        ("W", TypeError, "Trainer: params 'W': expected a list of initializer names "
                         "(e.g. params=['W']), got a str"),
        (b"W", TypeError, "Trainer: params b'W': expected a list of initializer names "
                          "(e.g. params=[b'W']), got a bytes"),
        (3, TypeError, "Trainer: params 3: expected a list of initializer names, got int"),
        (["w1", 2], TypeError, "Trainer: params: 2 is no initializer name: expected strings, "
                               "got int"),
        (["w1", "w2", "w1"], ValueError, "Trainer: params names ['w1'] more than once"),
    ]:
        with pytest.raises(error) as info:
            check_param_names(bad)
        assert str(info.value) == message
    assert check_param_names(None) is None
    assert check_param_names(("w1", "w2")) == ["w1", "w2"]
    assert check_param_names(n for n in ["w2"]) == ["w2"]


def test_trainer_refuses_params_as_a_bare_string():
    with pytest.raises(TypeError, match=r"^Trainer: params 'w1': expected a list"):
        Trainer(mlp(), "loss", threads=1, seed=0, params="w1")


# --- a tensor with two definitions ---

def _model(nodes, inputs=("x",), inits=None, outputs=("y",)):
    inits = inits if inits is not None else [
        numpy_helper.from_array(np.ones((3, 4), np.float32), "W")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(i, F32, [2, 3])
                                       for i in inputs],
                          [helper.make_tensor_value_info(o, F32, None) for o in outputs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    return m


def _two_writers():
    """MatMul and ReduceSum both write 'y0'; the loss reads 'y0'."""
    return _model([helper.make_node("MatMul", ["x", "W"], ["y0"], name="mm"),
                   helper.make_node("ReduceSum", ["x"], ["y0"], name="rs", keepdims=0),
                   helper.make_node("ReduceSum", ["y0"], ["y"], name="loss", keepdims=0)])


TWO_WRITERS = ("tensor 'y0' is written by two nodes, MatMul node 'mm' and ReduceSum node 'rs': "
               "ONNX allows one definition per tensor (onnxruntime refuses the model)")


def _if_model(then_nodes, then_out):
    cond = numpy_helper.from_array(np.array(True), "c")
    then = helper.make_graph(then_nodes, "then", [],
                             [helper.make_tensor_value_info(then_out, F32, [2, 3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="neg")], "else", [],
                              [helper.make_tensor_value_info("e", F32, [2, 3])])
    return _model([helper.make_node("If", ["c"], ["z"], name="if", then_branch=then,
                                    else_branch=other),
                   helper.make_node("ReduceSum", ["z"], ["y"], name="loss", keepdims=0)],
                  inits=[cond])


@pytest.mark.parametrize("make, message", [
    (_two_writers, TWO_WRITERS),
    (lambda: _model([helper.make_node("Relu", ["x"], ["x"], name="r"),
                     helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0, name="s")]),
     "tensor 'x' is a graph input and is also written by Relu node 'r': ONNX allows one "
     "definition per tensor (onnxruntime refuses the model)"),
    (lambda: _model([helper.make_node("Relu", ["W"], ["W"], name="r"),
                     helper.make_node("ReduceSum", ["W"], ["y"], keepdims=0, name="s")]),
     "tensor 'W' is an initializer and is also written by Relu node 'r': ONNX allows one "
     "definition per tensor (onnxruntime refuses the model)"),
    (lambda: _if_model([helper.make_node("Relu", ["x"], ["t1"], name="a"),
                        helper.make_node("Neg", ["x"], ["t1"], name="b")], "t1"),
     "tensor 't1' is written by two nodes, Relu node 'a' and Neg node 'b' (in the then_branch "
     "of If node 'if'): ONNX allows one definition per tensor (onnxruntime refuses the model)"),
    (lambda: _if_model([helper.make_node("Relu", ["x"], ["x"], name="a")], "x"),
     "tensor 'x' is a graph input of an enclosing graph and is also written by Relu node 'a' "
     "(in the then_branch of If node 'if'): ONNX allows one definition per tensor "
     "(onnxruntime refuses the model)"),
])
def test_a_tensor_with_two_definitions_is_refused_on_import(make, message):
    m = make()
    with pytest.raises(Exception):  # the independent judge: onnxruntime refuses each of them
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(GradientError) as info:
        import_model(m)
    assert str(info.value) == message
    with pytest.raises(GradientError) as info:
        expand_gradients(m)  # no Gradient node: only the check runs
    assert str(info.value) == message


def test_an_if_branch_may_write_its_if_node_output_name():
    """Not a second definition: onnxruntime runs it (a branch's names live in its scope)."""
    m = _if_model([helper.make_node("Relu", ["x"], ["z"], name="a")], "z")
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [n.name for n in import_model(m).graph.node] == ["if", "loss"]


def test_trainer_and_gradient_nodes_refuse_two_writers():
    """The Trainer trained on the second writer (W never moved) and exported a model
    onnxruntime refused; a Gradient node writing a forward tensor is the same fault."""
    with pytest.raises(GradientError) as info:
        Trainer(_two_writers(), "y", optim.Adam(), threads=1, seed=0)
    assert str(info.value) == TWO_WRITERS
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y0"], name="mm"),
                helper.make_node("ReduceSum", ["y0"], ["y"], name="loss", keepdims=0),
                helper.make_node("Gradient", ["W"], ["y0"], name="grad", xs=["W"], y="y",
                                 domain="ai.onnx.preview.training")])
    m.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    with pytest.raises(GradientError) as info:
        expand_gradients(m)
    assert str(info.value) == ("tensor 'y0' is written by two nodes, MatMul node 'mm' and "
                               "ai.onnx.preview.training::Gradient node 'grad': ONNX allows one "
                               "definition per tensor (onnxruntime refuses the model)")


# --- python -m trainops coverage: exit codes and one-line errors ---

def _external(tmp_path, name):
    """A model in tmp_path/name/m.onnx whose weight W is stored in tmp_path/name/w.bin."""
    folder = tmp_path / name
    folder.mkdir()
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y0"], name="mm"),
                helper.make_node("ReduceSum", ["y0"], ["y"], name="loss", keepdims=0)])
    onnx.save(m, str(folder / "m.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    return folder / "m.onnx"


def _coverage(capsys, path, *extra):
    code = cli(["coverage", str(path), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_coverage_exit_codes(tmp_path, capsys):
    """0: every op type has a rule; 1: some have none; 2: the model cannot be used, with a
    one-line error naming the file or the tensor (no traceback: the CLI returns)."""
    good = _external(tmp_path, "good")
    code, out, err = _coverage(capsys, good, "--loss", "y")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == "2 of 2 op types have a gradient rule"

    acos = tmp_path / "acos.onnx"
    onnx.save(_model([helper.make_node("MatMul", ["x", "W"], ["y0"], name="mm"),
                      helper.make_node("Acos", ["y0"], ["y1"], name="ac"),
                      helper.make_node("ReduceSum", ["y1"], ["y"], keepdims=0)]), str(acos))
    code, out, err = _coverage(capsys, acos, "--loss", "y")
    assert (code, err) == (1, "")
    assert "Acos" in out and "NO RULE: no gradient rule" in out

    text = tmp_path / "notes.txt"
    text.write_text("hello world, this is not a model\n")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, np.uint8).tobytes())
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    missing = _external(tmp_path, "missing")
    (missing.parent / "w.bin").unlink()
    escapes = _external(tmp_path, "escapes")
    inner = escapes.parent / "sub"
    inner.mkdir()
    m = onnx.load(str(escapes), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../w.bin"  # the data is there, but outside the model's folder
    onnx.save(m, str(inner / "m.onnx"))
    escapes = inner / "m.onnx"
    dup = tmp_path / "dup.onnx"
    onnx.save(_two_writers(), str(dup))

    parse = "protobuf cannot parse it as an onnx.ModelProto"
    for path, start in [
        (text, f"error: '{text}' is not an ONNX model: {parse}"),
        (garbage, f"error: '{garbage}' is not an ONNX model: {parse}"),
        (empty, f"error: '{empty}' is not an ONNX model: it parses as an onnx.ModelProto "
                "that holds no graph"),
        (missing, f"error: '{missing}': its external data cannot be loaded: "),
        (escapes, f"error: '{escapes}': its external data cannot be loaded: "),
        (dup, f"error: {TWO_WRITERS}"),
        (tmp_path / "absent.onnx", "error: [Errno 2] No such file or directory: "),
        (tmp_path, "error: [Errno 21] Is a directory: "),
    ]:
        code, out, err = _coverage(capsys, path, "--loss", "y")
        assert (code, out) == (2, ""), path
        assert err.startswith(start) and err.count("\n") == 1, err
    assert "w.bin" in _coverage(capsys, missing)[2]
    assert "../w.bin" in _coverage(capsys, escapes)[2]
    code, out, err = _coverage(capsys, good, "--loss", "nope")
    assert (code, out, err) == (2, "", "error: 'nope' is not a node output of the model\n")


def test_coverage_command_line_exit_status(tmp_path):
    """The real process: status 2 and one line on stderr for a text file, not Python's
    traceback and status 1 (the status of 'an op has no rule')."""
    text = tmp_path / "notes.txt"
    text.write_text("hello world, this is not a model\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    run = subprocess.run([sys.executable, "-m", "trainops", "coverage", str(text)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr.startswith(f"error: '{text}' is not an ONNX model: ")
    assert "Traceback" not in run.stderr and run.stderr.count("\n") == 1
