"""com.trainops::DynamicLossScale: each rule of the contract (README.md, "Op reference"), a long
random replay against a plain-Python model of PyTorch's GradScaler update, attributes and
errors."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.references import GradScalerModel, dynamic_loss_scale
from trainops import run
from trainops.models import dynamic_loss_scale_model

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)


def step(sess, scale, good_steps, finite, shape=()):
    """One run: returns (new_scale: np.float32, new_good_steps: int) and checks types."""
    s, g = run(sess, {"scale": np.full(shape, scale, F32),
                      "good_steps": np.full(shape, good_steps, np.int64),
                      "finite": np.full(shape, finite, np.bool_)})
    assert s.dtype == np.float32 and g.dtype == np.int64
    assert s.size == 1 and g.size == 1
    return np.float32(s.reshape(-1)[0]), int(g.reshape(-1)[0])


def same_f32(a, b) -> bool:
    return np.float32(a).tobytes() == np.float32(b).tobytes()


@pytest.fixture(scope="module")
def default_sess(request):
    make_session = request.getfixturevalue("make_session")
    return make_session(dynamic_loss_scale_model())


# --- each rule, default attributes (growth_interval 2000, x2, x0.5, min 0) --------------

@pytest.mark.parametrize("scale,good,finite,expected", [
    # finite, below the interval: count up, scale unchanged
    (65536.0, 0, True, (65536.0, 1)),
    (65536.0, 1997, True, (65536.0, 1998)),
    (3.0, 41, True, (3.0, 42)),
    # finite, the growth_interval-th step in a row: grow, restart the count
    (65536.0, 1999, True, (131072.0, 0)),
    (0.75, 1999, True, (1.5, 0)),
    # ... unless growing overflows float32: keep the scale, still restart the count
    (F32_MAX, 1999, True, (F32_MAX, 0)),
    (2.0 ** 127, 1999, True, (2.0 ** 127, 0)),
    (float(np.nextafter(F32(2.0 ** 127), F32(0))), 1999, True,
     (F32_MAX, 0)),  # the largest scale that still grows
    # past the interval (only equality grows): counts on, as PyTorch's tracker does
    (8.0, 2000, True, (8.0, 2001)),
    (8.0, 5000, True, (8.0, 5001)),
    # not finite: back off, count 0
    (65536.0, 0, False, (32768.0, 0)),
    (65536.0, 1999, False, (32768.0, 0)),
    (65536.0, 1234, False, (32768.0, 0)),
    (1.0, 7, False, (0.5, 0)),
    (2.0 ** -149, 3, False, (0.0, 0)),  # the smallest subnormal halves to 0 (min_scale 0)
    (3.0 * 2.0 ** -149, 3, False, (2.0 * 2.0 ** -149, 0)),  # round half to even
])
def test_rule(default_sess, scale, good, finite, expected):
    s, g = step(default_sess, scale, good, finite)
    ref = dynamic_loss_scale(scale, good, finite)
    assert same_f32(ref[0], expected[0]) and ref[1] == expected[1]  # the reference agrees
    assert same_f32(s, expected[0]), f"scale {s!r}, expected {expected[0]!r}"
    assert g == expected[1], f"good_steps {g}, expected {expected[1]}"


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=str)
def test_one_element_any_rank(make_session, shape):
    sess = make_session(dynamic_loss_scale_model(shape=shape))
    s, g = run(sess, {"scale": np.full(shape, 1024.0, F32),
                      "good_steps": np.full(shape, 4, np.int64),
                      "finite": np.full(shape, False)})
    assert float(s.reshape(-1)[0]) == 512.0 and int(g.reshape(-1)[0]) == 0
    # outputs keep the inputs' shape (so that they can be bound in place over them)
    assert s.shape == shape and g.shape == shape


@pytest.mark.parametrize("attrs", [
    {"growth_interval": 1},
    {"growth_interval": 5, "growth_factor": 3.0},
    {"growth_interval": 3, "backoff_factor": 0.25, "min_scale": 1.0},
    {"growth_interval": 2, "growth_factor": 1.5, "backoff_factor": 0.1, "min_scale": 0.3},
    {"backoff_factor": 0.5, "min_scale": 65536.0},
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_attributes(make_session, attrs):
    sess = make_session(dynamic_loss_scale_model(**attrs))
    cases = [(s, g, f) for s in (1.0, 1.3, 65536.0, 2.0 ** 126, F32_MAX, 0.3)
             for g in (0, 1, 2, 3, 4, 1999) for f in (True, False)]
    for scale, good, finite in cases:
        got = step(sess, scale, good, finite)
        ref = dynamic_loss_scale(scale, good, finite, **attrs)
        assert same_f32(got[0], ref[0]) and got[1] == ref[1], (
            f"{attrs} scale={scale} good_steps={good} finite={finite}: got {got}, "
            f"expected {ref}")


def test_min_scale_clamps_backoff_only(make_session):
    sess = make_session(dynamic_loss_scale_model(min_scale=4.0, growth_interval=2))
    assert step(sess, 16.0, 0, False) == (8.0, 0)
    assert step(sess, 8.0, 0, False) == (4.0, 0)
    assert step(sess, 4.0, 0, False) == (4.0, 0)  # floor
    assert step(sess, 5.0, 0, False) == (4.0, 0)  # 2.5 clamped up
    # a scale already below the floor is lifted by a backoff, not by a finite step
    assert step(sess, 1.0, 0, True) == (1.0, 1)
    assert step(sess, 1.0, 1, True) == (2.0, 0)
    assert step(sess, 1.0, 0, False) == (4.0, 0)


@pytest.mark.parametrize("growth_interval,p_bad,init,min_scale,factors", [
    (5, 0.1, 2.0 ** 16, 0.0, (2.0, 0.5)),
    (5, 0.25, 2.0 ** 15, 1.0, (2.0, 0.5)),
    (3, 0.05, 2.0 ** 120, 0.0, (2.0, 0.5)),     # runs into the float32 ceiling
    (7, 0.5, 1.0, 2.0 ** -20, (2.0, 0.5)),      # sinks to the floor
    (4, 0.15, 1000.0, 0.0, (1.7, 0.3)),         # inexact factors: float32 rounding
    (1, 0.3, 1.0, 0.0, (2.0, 0.5)),             # grows on every finite step
])
def test_replay_against_grad_scaler(make_session, growth_interval, p_bad, init, min_scale,
                                    factors):
    """5000 random finite/non-finite verdicts through the op, each output fed back as the
    next input, against PyTorch's GradScaler update (with a floor) step by step."""
    growth_factor, backoff_factor = factors
    attrs = dict(growth_interval=growth_interval, growth_factor=growth_factor,
                 backoff_factor=backoff_factor, min_scale=min_scale)
    sess = make_session(dynamic_loss_scale_model(**attrs))
    rng = np.random.default_rng(growth_interval * 1000 + int(p_bad * 100))
    torch_like = GradScalerModel(init_scale=init, growth_interval=growth_interval,
                                 growth_factor=growth_factor, backoff_factor=backoff_factor,
                                 min_scale=min_scale)
    scale, good = F32(init), 0
    grew = shrank = 0
    for k, bad in enumerate(rng.random(5000) < p_bad):
        new_scale, good = step(sess, scale, good, not bad)
        torch_like.update(found_inf=bool(bad))
        grew += new_scale > scale
        shrank += new_scale < scale
        scale = new_scale
        assert same_f32(scale, torch_like.scale) and good == torch_like.growth_tracker, (
            f"step {k}: op ({scale!r}, {good}) vs GradScaler "
            f"({torch_like.scale!r}, {torch_like.growth_tracker})")
    assert grew and shrank  # the sequence exercised both directions


def test_replay_in_place(make_session):
    """The outputs bound over the inputs' buffers (IOBinding), 1000 steps."""
    from trainops import to_ortvalue

    sess = make_session(dynamic_loss_scale_model())
    rng = np.random.default_rng(5)
    scale = np.array(2.0 ** 16, F32)
    good = np.array(0, np.int64)
    finite = np.array(True)
    vs, vg, vf = to_ortvalue(scale), to_ortvalue(good), to_ortvalue(finite)
    b = sess.io_binding()
    b.bind_ortvalue_input("scale", vs)
    b.bind_ortvalue_input("good_steps", vg)
    b.bind_ortvalue_input("finite", vf)
    b.bind_ortvalue_output("new_scale", vs)
    b.bind_ortvalue_output("new_good_steps", vg)
    torch_like = GradScalerModel(init_scale=2.0 ** 16)
    for bad in rng.random(6000) < 0.0004:
        finite[...] = not bad
        sess.run_with_iobinding(b)
        torch_like.update(bool(bad))
        assert same_f32(scale, torch_like.scale) and int(good) == torch_like.growth_tracker


# --- errors --------------------------------------------------------------------------------

def _clear(message, needles):
    low = message.lower()
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(o.lower() in low for o in options), (
            f"error message lacks {' or '.join(map(repr, options))}: {message}")


LOAD_ERRORS = [
    ("scale-double", dict(scale_dtype=np.float64), ["DynamicLossScale", ("input 0", "scale")]),
    ("good_steps-int32", dict(steps_dtype=np.int32),
     ["DynamicLossScale", ("input 1", "good_steps")]),
    ("finite-float", dict(finite_dtype=np.float32), ["DynamicLossScale", ("input 2", "finite")]),
    ("2-inputs", dict(n_inputs=2), ["DynamicLossScale", "input"]),
    ("4-inputs", dict(n_inputs=4), ["DynamicLossScale", "input"]),
    ("1-output", dict(n_outputs=1), ["DynamicLossScale", "output"]),
    ("3-outputs", dict(n_outputs=3), ["DynamicLossScale", "output"]),
    ("growth_interval-float", dict(growth_interval=5.0),
     ["DynamicLossScale", "growth_interval", "int"]),
    ("growth_factor-int", dict(growth_factor=2), ["DynamicLossScale", "growth_factor", "float"]),
    ("min_scale-string", dict(min_scale="1"), ["DynamicLossScale", "min_scale", "float"]),
]


@pytest.mark.parametrize("case", LOAD_ERRORS, ids=[c[0] for c in LOAD_ERRORS])
def test_error_node(make_session, case):
    """A bad node: a clear error when the session is created or first run; a correct
    session created afterwards works."""
    _, kwargs, needles = case
    model = dynamic_loss_scale_model(**kwargs)
    try:
        sess = make_session(model)
    except Exception as exc:  # noqa: BLE001
        _clear(str(exc), needles)
    else:
        import onnx

        feeds = {}
        for vi in model.graph.input:
            dt = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            feeds[vi.name] = np.ones((), dt)
        with pytest.raises(Exception) as info:
            run(sess, feeds)
        _clear(str(info.value), needles)
    good = make_session(dynamic_loss_scale_model())
    assert step(good, 8.0, 0, False) == (4.0, 0)


RUN_ERRORS = [
    ("scale-two-elements", {"scale": np.array([1.0, 2.0], F32)},
     ["DynamicLossScale", ("input 0", "scale"), "element"]),
    ("good_steps-empty", {"good_steps": np.zeros((0,), np.int64)},
     ["DynamicLossScale", ("input 1", "good_steps"), "element"]),
    ("finite-three-elements", {"finite": np.array([True, False, True])},
     ["DynamicLossScale", ("input 2", "finite"), "element"]),
]


@pytest.mark.parametrize("case", RUN_ERRORS, ids=[c[0] for c in RUN_ERRORS])
def test_error_input_session_survives(make_session, case):
    _, override, needles = case
    sess = make_session(dynamic_loss_scale_model(dynamic=True))
    feeds = {"scale": np.array(8.0, F32), "good_steps": np.array(0, np.int64),
             "finite": np.array(False)}
    feeds.update(override)
    for _ in range(2):
        with pytest.raises(Exception) as info:
            run(sess, feeds)
        _clear(str(info.value), needles)
        assert step(sess, 8.0, 0, False) == (4.0, 0)
