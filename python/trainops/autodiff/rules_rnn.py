"""Gradient rules for the recurrent ops ``RNN``, ``GRU`` and ``LSTM`` (registered into
:data:`~trainops.autodiff.rules.RULES` when :mod:`trainops.autodiff` is imported).

Backpropagation through time without unrolling: everything that does not depend on the
recurrence is computed for all time steps at once, and one reverse ``Scan`` carries the
hidden-state (and cell-state) gradient back through time.

1. The previous hidden states ``H_{t-1}`` are the op's own output ``Y`` shifted by one step
   (``initial_h``, or zeros, first); ``Y`` is recomputed by a copy of the node where the
   node leaves it out. The gate pre-activations of every step then come from two batched
   MatMuls, ``X W^T`` and ``H_{t-1} R^T``. LSTM's cell states, which no output holds, are
   recomputed by a small forward ``Scan`` (``c = f * c + i * g``).
2. A ``Scan`` in the opposite time direction carries ``dH`` (and ``dC``) with one
   ``[batch, gates*hidden] x [gates*hidden, hidden]`` MatMul per step and scans out the
   gradients of the gate pre-activations ``dA_t``.
3. ``dX = dA W``, ``dW = sum_t dA_t^T X_t``, ``dR = sum_t dA_t^T H_{t-1}`` and the bias and
   peephole gradients are again batched over all steps; ``d initial_h`` / ``d initial_c``
   are the Scan's final states.

Where the builder fuses (the Trainer's CPU placement, float32), GRU's backward is instead
one ``com.trainops::GRUGrad`` node (the same algorithm in one kernel, ``grad::rnn``); in
layout 0 it reads the gates of a ``com.trainops::GRUTrain`` node, GRU's forward keeping
them, which :func:`~.simplify.merge_gru_train` makes the forward node itself. LSTM
(without peepholes) likewise becomes ``com.trainops::LSTMTrain`` + ``LSTMGrad``
(``grad::rnn::lstm``): the forward keeps the gates and cell states the backward reads.

A Scan rather than an unrolled graph keeps the backward graph's size independent of the
sequence length, and works when that length is known only at run time.

Covered: all three directions, ``layout`` 0 and 1, the optional ``B``, ``initial_h``,
``initial_c`` and peepholes ``P``, any of the outputs used, GRU's ``linear_before_reset`` 0
and 1, the default activations (also written out). A ``GradientError`` naming the node for
``sequence_lens``, other activations, ``activation_alpha``/``beta``, ``clip``,
``input_forget`` and opsets before 10.
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import helper, numpy_helper

from ..onnx_defs import TRAINOPS_DOMAIN
from .graph import Builder
from .rules import Ctx, rule

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTS = {"RNN": ["tanh"], "GRU": ["sigmoid", "tanh"],
                 "LSTM": ["sigmoid", "tanh", "tanh"]}
_INT64_MAX = np.iinfo(np.int64).max


# -- small emitters --------------------------------------------------------------------

def _slice(b: Builder, x: str, start: int, end: int, axis: int) -> str:
    return b.op("Slice", [x, b.ints([start]), b.ints([end]), b.ints([axis])])


def _gate(b: Builder, x: str, k: int, hidden: int, axis: int, n: int = 1) -> str:
    """Gates ``k .. k+n-1`` (each ``hidden`` wide) along ``axis``."""
    return _slice(b, x, k * hidden, (k + n) * hidden, axis)


def _pick(b: Builder, x: str, index: int, axis: int) -> str:
    """``x`` at ``index`` along ``axis``, that axis removed (Gather with a scalar index)."""
    return b.op("Gather", [x, b.const(np.int64(index), hint="index")], axis=axis)


def _sum_steps(b: Builder, x: str) -> str:
    """Sum over the time and batch axes of a ``[seq, batch, k]`` tensor: ``[k]``."""
    return b.reduce("ReduceSum", x, [0, 1], keepdims=0)


def _outer_sum(b: Builder, da: str, v: str) -> str:
    """``sum_t da_t^T v_t`` for ``[seq, batch, m]`` and ``[seq, batch, n]``: ``[m, n]``."""
    da2, v2 = b.op("Flatten", [da], axis=2), b.op("Flatten", [v], axis=2)
    if b.opset < 11:  # Gemm's C is optional from opset 11
        return b.op("MatMul", [b.op("Transpose", [da2], perm=[1, 0]), v2])
    return b.op("Gemm", [da2, v2], transA=1)


def _stack(b: Builder, parts: list[str]) -> str:
    """Per-direction results stacked on a new leading axis."""
    parts = [b.unsqueeze(p, [0]) for p in parts]
    return parts[0] if len(parts) == 1 else b.op("Concat", parts, axis=0)


def _scan(b: Builder, elem: int, states: list[str], xs: list[str], reverse: bool, body_fn,
          n_out: int) -> list[str]:
    """One ``Scan`` over axis 0 of ``xs`` (backwards in time when ``reverse``; scan outputs
    are then stacked backwards too, so index ``t`` stays step ``t``). ``body_fn(state_names,
    slice_names)`` emits the body with ``b`` and returns ``(new_states, scan_outputs)``;
    those nodes are moved into the body graph. Returns final states + scan outputs."""
    s_in = [b.fresh("state") for _ in states]
    x_in = [b.fresh("step") for _ in xs]
    start = len(b.nodes)
    new_states, outs = body_fn(s_in, x_in)
    assert len(outs) == n_out
    made = {o for n in b.nodes[start:] for o in n.output}
    body_out = []
    for name in list(new_states) + list(outs):
        if name not in made or name in body_out:  # a body output must be made in the body
            name = b.op("Identity", [name])
        body_out.append(name)
    nodes = b.nodes[start:]
    del b.nodes[start:]
    # Every state and step here is [batch, k]: rank 2, sizes left to the runtime.
    vi = [helper.make_tensor_value_info(n, elem, [None, None]) for n in s_in + x_in]
    vo = [helper.make_tensor_value_info(n, elem, [None, None]) for n in body_out]
    body = helper.make_graph(nodes, b.fresh("scan_body").replace("/", "_"), vi, vo)
    direction = [1 if reverse else 0]
    return b.op("Scan", list(states) + list(xs), len(states) + n_out, body=body,
                num_scan_inputs=len(xs), scan_input_directions=direction * len(xs),
                scan_output_directions=direction * n_out)


# -- the rule ------------------------------------------------------------------------------

class _Rnn:
    """What the three ops share: the checks, the layout, each direction's inputs and the
    gradients of X and W; :meth:`rnn`, :meth:`gru` and :meth:`lstm` build one direction's
    recurrence backward (returning dA, the gate pre-activations' gradient, and the rest)."""

    def __init__(self, c: Ctx):
        self.c = c
        self.b = b = c.b
        self.kind = kind = c.node.op_type
        self.n_gates = _GATES[kind]
        if b.opset < 10:
            raise c.fail("its gradient needs opset >= 10 (Scan with directions, Slice with "
                         "inputs)")
        if c.x(4) is not None:
            raise c.fail("input 'sequence_lens' is given: the gradient supports only sequences "
                         "of one length (leave sequence_lens out)")
        if c.attr("clip") is not None:
            raise c.fail("attribute 'clip' is not supported by its gradient")
        if kind == "LSTM" and c.attr("input_forget", 0):
            raise c.fail("attribute 'input_forget' = 1 is not supported by its gradient")
        self.direction = c.attr("direction", "forward")
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise c.fail(f"unknown direction '{self.direction}'")
        self.n_dir = 2 if self.direction == "bidirectional" else 1
        acts = c.attr("activations")
        want = _DEFAULT_ACTS[kind] * self.n_dir
        if acts is not None:
            got = [a.decode() if isinstance(a, bytes) else a for a in acts]
            if [a.lower() for a in got] != want:
                raise c.fail(f"activations {got} are not supported by its gradient (only the "
                             f"defaults {[a.capitalize() for a in want]})")
        for a in ("activation_alpha", "activation_beta"):
            if c.attr(a):
                raise c.fail(f"attribute '{a}' is not supported by its gradient")
        self.layout = c.attr("layout", 0)
        self.x_name = c.x(0)
        self.elem = b.dtype(self.x_name) or b.dtype(c.x(1))
        if self.elem is None:
            raise c.fail(f"the element type of input '{self.x_name}' is unknown")
        if b.dtype(self.x_name) is None:
            b.set_info(self.x_name, self.elem, b.shape(self.x_name))
        hidden = c.attr("hidden_size")
        if hidden is None:
            rs = b.shape(c.x(2))
            if rs is None or not isinstance(rs[-1], int):
                raise c.fail("attribute 'hidden_size' is missing and R's shape is unknown")
            hidden = rs[-1]
        self.hidden = int(hidden)

    def relayout(self, x: str | None, perm: list[int]) -> str | None:
        """Layout 1 (``[batch, seq, ...]``) to layout 0 (``[seq, (dir,) batch, ...]``) or,
        with the inverse ``perm``, back; the identity in layout 0."""
        if x is None or self.layout == 0:
            return x
        return self.b.op("Transpose", [x], perm=perm)

    def one(self) -> str:
        return self.b.scalar(1.0, self.x_name)

    def zeros_bh(self, x0: str) -> str:
        """Zeros ``[batch, hidden]`` (batch from ``x0``, ``[seq, batch, input]``)."""
        b = self.b
        xs = b.shape(self.x_name)
        batch = None
        if xs is not None and len(xs) == 3:
            batch = xs[1 if self.layout == 0 else 0]
        if isinstance(batch, int):
            shape = b.ints([batch, self.hidden])
        else:
            shape = b.op("Concat", [_slice(b, b.op("Shape", [x0]), 1, 2, 0),
                                    b.ints([self.hidden])], axis=0)
        value = numpy_helper.from_array(np.zeros([1], b.np_dtype(self.x_name)), "zero")
        return b.op("ConstantOfShape", [shape], value=value)

    def output_y(self) -> str:
        """The node's output Y, or Y of a copy of the node where it leaves Y out."""
        node = self.c.node
        if node.output and node.output[0]:
            return node.output[0]
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        y = self.b.fresh("Y")
        del copy.output[:]
        copy.output.append(y)
        copy.name = self.b.fresh(node.op_type + "_recompute")
        self.b.nodes.append(copy)
        return y

    def run(self) -> list[str | None]:
        c, b = self.c, self.b
        x0 = self.relayout(self.x_name, [1, 0, 2])
        y0 = self.relayout(self.output_y(), [1, 2, 0, 3])
        gys = list(c.gys) + [None] * (3 - len(c.gys))
        gy0 = self.relayout(gys[0], [1, 2, 0, 3])
        g_h, g_c = (self.relayout(gys[k], [1, 0, 2]) for k in (1, 2))
        h0 = self.relayout(c.x(5), [1, 0, 2])
        c0 = self.relayout(c.x(6), [1, 0, 2]) if self.kind == "LSTM" else None
        peep = c.x(7) if self.kind == "LSTM" else None

        def pick(x, d, axis=0):
            return _pick(b, x, d, axis) if x is not None else None
        res: dict[str, list[str]] = {k: [] for k in ("x", "w", "r", "b", "h0", "c0", "p")}
        for d in range(self.n_dir):
            w, yd = pick(c.x(1), d), pick(y0, d, 1)
            h0d = pick(h0, d) if h0 is not None else self.zeros_bh(x0)
            forward = d == 0 and self.direction != "reverse"
            k = dict(x0=x0, w=w, r=pick(c.x(2), d), bd=pick(c.x(3), d), yd=yd,
                     hprev=self.shift(yd, h0d, forward), forward=forward,
                     c0d=pick(c0, d), peep=pick(peep, d), gy=pick(gy0, d, 1),
                     gyh=pick(g_h, d), gyc=pick(g_c, d))
            out = getattr(self, self.kind.lower())(k)
            if c.need(0):
                res["x"].append(b.op("MatMul", [out["da"], w]))
            if c.need(1):
                res["w"].append(_outer_sum(b, out["da"], x0))
            for key in ("r", "b", "h0", "c0", "p"):
                if key in out:
                    res[key].append(out[key])
        grads: list[str | None] = [None] * len(c.node.input)
        if c.need(0):
            dx = res["x"][0] if len(res["x"]) == 1 else b.op("Sum", res["x"])
            grads[0] = self.relayout(dx, [1, 0, 2])
        for i, key in ((1, "w"), (2, "r"), (3, "b"), (7, "p")):
            if c.need(i):
                grads[i] = _stack(b, res[key])
        for i, key in ((5, "h0"), (6, "c0")):
            if c.need(i):
                grads[i] = self.relayout(_stack(b, res[key]), [1, 0, 2])
        return grads

    def gx(self, k: dict) -> str:
        """``X_t W^T + Wb`` for every step: ``[seq, batch, gates*hidden]``."""
        b = self.b
        gx = b.op("MatMul", [k["x0"], b.op("Transpose", [k["w"]], perm=[1, 0])])
        if k["bd"] is not None:
            gx = b.op("Add", [gx, _gate(b, k["bd"], 0, self.hidden, 0, self.n_gates)])
        return gx

    def shift(self, seq: str, first: str, forward: bool) -> str:
        """The previous step's value at every step: ``first`` then ``seq`` without its last
        step (forward in time), or ``seq`` without its first step then ``first``."""
        b = self.b
        head = b.unsqueeze(first, [0])
        if forward:
            return b.op("Concat", [head, _slice(b, seq, 0, -1, 0)], axis=0)
        return b.op("Concat", [_slice(b, seq, 1, _INT64_MAX, 0), head], axis=0)

    def initial(self, grad: str | None, x0: str) -> str:
        return grad if grad is not None else self.zeros_bh(x0)

    # -- per op: the backward of one direction ---------------------------------------------
    def rnn(self, k: dict) -> dict:
        """H_t = tanh(A_t): dA_t = dH_t (1 - H_t^2); dH_{t-1} = dA_t R."""
        b = self.b
        kt = b.op("Sub", [self.one(), b.op("Mul", [k["yd"], k["yd"]])])
        has_gy = k["gy"] is not None

        def body(s, xs):
            dh = b.op("Add", [xs[0], s[0]]) if has_gy else s[0]
            da = b.op("Mul", [dh, xs[-1]])
            return [b.op("MatMul", [da, k["r"]])], [da]

        seqs = ([k["gy"]] if has_gy else []) + [kt]
        dh0, da = _scan(b, self.elem, [self.initial(k["gyh"], k["x0"])], seqs,
                        k["forward"], body, 1)
        out = {"da": da, "h0": dh0}
        self.common_r_b(k, da, da, out)
        return out

    def common_r_b(self, k: dict, da: str, da_r: str, out: dict, dr: str | None = None) -> None:
        """dR (``sum dA_r^T H_{t-1}`` unless given) and dB (``[sum dA, sum dA_r]``)."""
        c, b = self.c, self.b
        if c.need(2):
            out["r"] = dr if dr is not None else _outer_sum(b, da_r, k["hprev"])
        if c.need(3):
            out["b"] = b.op("Concat", [_sum_steps(b, da), _sum_steps(b, da_r)], axis=0)

    def gru(self, k: dict) -> dict:
        b, hid = self.b, self.hidden
        lbr = bool(self.c.attr("linear_before_reset", 0))
        one = self.one()
        hp, r = k["hprev"], k["r"]
        bd = k["bd"]
        gx = self.gx(k)
        r_zr = _gate(b, r, 0, hid, 0, 2)  # [2H, H]
        # H_{t-1} R^T + Rb for the gates z, r (lbr = 0) or z, r, h (lbr = 1).
        gh = b.op("MatMul", [hp, b.op("Transpose", [r if lbr else r_zr], perm=[1, 0])])
        if bd is not None:
            gh = b.op("Add", [gh, _gate(b, bd, 3, hid, 0, 3 if lbr else 2)])
        a_zr = b.op("Add", [_gate(b, gx, 0, hid, 2, 2), _gate(b, gh, 0, hid, 2, 2)])
        zr = b.op("Sigmoid", [a_zr])
        z, rg = _gate(b, zr, 0, hid, 2), _gate(b, zr, 1, hid, 2)
        r_h = _gate(b, r, 2, hid, 0)  # Rh [H, H]
        if lbr:
            hr = _gate(b, gh, 2, hid, 2)  # H_{t-1} Rh^T + Rbh
            a_h = b.op("Add", [_gate(b, gx, 2, hid, 2), b.op("Mul", [rg, hr])])
        else:
            rh = b.op("Mul", [rg, hp])
            a_h = b.op("Add", [_gate(b, gx, 2, hid, 2),
                               b.op("MatMul", [rh, b.op("Transpose", [r_h], perm=[1, 0])])])
            if bd is not None:
                a_h = b.op("Add", [a_h, _gate(b, bd, 5, hid, 0)])  # Rbh
        hh = b.op("Tanh", [a_h])
        # Per-step coefficients: dA_h = dH K_h, dA_z = dH K_z, dA_r = (dA_h Rh or dA_h) K_r.
        k_h = b.op("Mul", [b.op("Sub", [one, z]), b.op("Sub", [one, b.op("Mul", [hh, hh])])])
        k_z = b.op("Mul", [b.op("Sub", [hp, hh]), b.op("Mul", [z, b.op("Sub", [one, z])])])
        dsig_r = b.op("Mul", [rg, b.op("Sub", [one, rg])])
        k_r = b.op("Mul", [hr if lbr else hp, dsig_r])
        has_gy = k["gy"] is not None

        def body(s, xs):
            off = 1 if has_gy else 0
            kh, kz, kr, zt, rt = xs[off:]
            dh = b.op("Add", [xs[0], s[0]]) if has_gy else s[0]
            da_h = b.op("Mul", [dh, kh])
            da_z = b.op("Mul", [dh, kz])
            if lbr:
                da_r = b.op("Mul", [da_h, kr])
                da_hr = b.op("Mul", [da_h, rt])
                dhp = b.op("Add", [b.op("Mul", [dh, zt]), b.op("MatMul", [
                    b.op("Concat", [da_z, da_r, da_hr], axis=1), r])])
            else:
                drh = b.op("MatMul", [da_h, r_h])
                da_r = b.op("Mul", [drh, kr])
                dhp = b.op("Sum", [b.op("Mul", [dh, zt]), b.op("Mul", [drh, rt]), b.op(
                    "MatMul", [b.op("Concat", [da_z, da_r], axis=1), r_zr])])
            return [dhp], [b.op("Concat", [da_z, da_r, da_h], axis=1)]

        seqs = ([k["gy"]] if has_gy else []) + [k_h, k_z, k_r, z, rg]
        dh0, da = _scan(b, self.elem, [self.initial(k["gyh"], k["x0"])], seqs,
                        k["forward"], body, 1)
        out = {"da": da, "h0": dh0}
        da_zr, da_h = _gate(b, da, 0, hid, 2, 2), _gate(b, da, 2, hid, 2)
        if lbr:  # R's and Rb's h gate see dA_h * r
            da_r = b.op("Concat", [da_zr, b.op("Mul", [da_h, rg])], axis=2)
            self.common_r_b(k, da, da_r, out)
        else:
            dr = None
            if self.c.need(2):
                dr = b.op("Concat", [_outer_sum(b, da_zr, hp), _outer_sum(b, da_h, rh)], axis=0)
            self.common_r_b(k, da, da, out, dr)
        return out

    def lstm(self, k: dict) -> dict:
        b, hid = self.b, self.hidden
        one = self.one()
        hp, r = k["hprev"], k["r"]
        a = b.op("Add", [self.gx(k), b.op("MatMul", [hp, b.op("Transpose", [r], perm=[1, 0])])])
        if k["bd"] is not None:
            a = b.op("Add", [a, _gate(b, k["bd"], 4, hid, 0, 4)])  # Rb
        a_i, a_o, a_f = (_gate(b, a, j, hid, 2) for j in range(3))
        gg = b.op("Tanh", [_gate(b, a, 3, hid, 2)])
        peep = k["peep"]
        p_i = p_o = p_f = None
        if peep is not None:
            p_i, p_o, p_f = (_gate(b, peep, j, hid, 0) for j in range(3))
        c0d = k["c0d"] if k["c0d"] is not None else self.zeros_bh(k["x0"])

        # Cell states: c_t = f_t c_{t-1} + i_t g_t (i, f see c_{t-1} through peepholes).
        if peep is None:
            i_g = b.op("Sigmoid", [a_i])
            f_g = b.op("Sigmoid", [a_f])

            def fwd_body(s, xs):  # the new state is also the step's scan output
                cn = b.op("Add", [b.op("Mul", [xs[0], s[0]]), xs[1]])
                return [cn], [cn]
            seqs = [f_g, b.op("Mul", [i_g, gg])]
        else:
            def fwd_body(s, xs):
                ai, af, gt = xs
                it = b.op("Sigmoid", [b.op("Add", [ai, b.op("Mul", [p_i, s[0]])])])
                ft = b.op("Sigmoid", [b.op("Add", [af, b.op("Mul", [p_f, s[0]])])])
                cn = b.op("Add", [b.op("Mul", [ft, s[0]]), b.op("Mul", [it, gt])])
                return [cn], [cn]
            seqs = [a_i, a_f, gg]

        _, cs = _scan(b, self.elem, [c0d], seqs, not k["forward"], fwd_body, 1)
        cprev = self.shift(cs, c0d, k["forward"])
        if peep is not None:
            i_g = b.op("Sigmoid", [b.op("Add", [a_i, b.op("Mul", [p_i, cprev])])])
            f_g = b.op("Sigmoid", [b.op("Add", [a_f, b.op("Mul", [p_f, cprev])])])
            o_g = b.op("Sigmoid", [b.op("Add", [a_o, b.op("Mul", [p_o, cs])])])
        else:
            o_g = b.op("Sigmoid", [a_o])
        tc = b.op("Tanh", [cs])

        def dsig(s):
            return b.op("Mul", [s, b.op("Sub", [one, s])])
        k_o = b.op("Mul", [tc, dsig(o_g)])  # dA_o = dH K_o
        k_c = b.op("Mul", [o_g, b.op("Sub", [one, b.op("Mul", [tc, tc])])])  # dC += dH K_c
        if peep is not None:  # o sees c_t: dC += dA_o P_o
            k_c = b.op("Add", [k_c, b.op("Mul", [k_o, p_o])])
        k_i = b.op("Mul", [gg, dsig(i_g)])  # dA_i = dC K_i
        k_f = b.op("Mul", [cprev, dsig(f_g)])  # dA_f = dC K_f
        k_g = b.op("Mul", [i_g, b.op("Sub", [one, b.op("Mul", [gg, gg])])])  # dA_g = dC K_g
        has_gy = k["gy"] is not None

        def body(s, xs):
            off = 1 if has_gy else 0
            kc, ki, ko, kf, kg, ft = xs[off:]
            dh = b.op("Add", [xs[0], s[0]]) if has_gy else s[0]
            dc = b.op("Add", [s[1], b.op("Mul", [dh, kc])])
            da_i, da_f = b.op("Mul", [dc, ki]), b.op("Mul", [dc, kf])
            da = b.op("Concat", [da_i, b.op("Mul", [dh, ko]), da_f, b.op("Mul", [dc, kg])],
                      axis=1)
            dcp = b.op("Mul", [dc, ft])
            if peep is not None:
                dcp = b.op("Sum", [dcp, b.op("Mul", [da_i, p_i]), b.op("Mul", [da_f, p_f])])
            return [b.op("MatMul", [da, r]), dcp], [da]

        seqs = ([k["gy"]] if has_gy else []) + [k_c, k_i, k_o, k_f, k_g, f_g]
        inits = [self.initial(k["gyh"], k["x0"]), self.initial(k["gyc"], k["x0"])]
        dh0, dc0, da = _scan(b, self.elem, inits, seqs, k["forward"], body, 1)
        out = {"da": da, "h0": dh0, "c0": dc0}
        self.common_r_b(k, da, da, out)
        if self.c.need(7):
            out["p"] = b.op("Concat", [
                _sum_steps(b, b.op("Mul", [_gate(b, da, 0, hid, 2), cprev])),
                _sum_steps(b, b.op("Mul", [_gate(b, da, 1, hid, 2), cs])),
                _sum_steps(b, b.op("Mul", [_gate(b, da, 2, hid, 2), cprev]))], axis=0)
        return out


def _trimmed(names: list[str]) -> list[str]:
    """``names`` without trailing "" (absent optional inputs or outputs)."""
    while names and not names[-1]:
        names.pop()
    return names


def _gru_fused(r: _Rnn) -> list[str | None] | None:
    """GRU's backward as one ``com.trainops::GRUGrad`` node (float32, where the builder
    fuses; layout 1 is transposed to layout 0 around it), or ``None`` for the Scan form.
    The checks of :class:`_Rnn` (activations, clip, sequence_lens) have passed. In layout 0
    the node's forward is also emitted as ``com.trainops::GRUTrain``, whose gates GRUGrad
    reads instead of recomputing them; :func:`~.simplify.merge_gru_train` then replaces
    the forward GRU node by it."""
    c, b = r.c, r.b
    gys = (list(c.gys) + [None, None])[:2]
    # GRU has one element type T: the gradients (whose types the builder may not know)
    # have the inputs' type.
    if not b.fuses(*[n for n in (r.x_name, c.x(1), c.x(2), c.x(3), c.x(5)) if n]):
        return None
    wanted = [0, 1, 2, 3, 5]  # dX, dW, dR, dB, d_initial_h
    outs = [b.fresh("GRUGrad_d" + str(i)) if c.need(i) else "" for i in wanted]
    while outs and outs[-1] == "":
        outs.pop()
    if not outs:
        return [None] * len(c.node.input)
    attrs = dict(hidden_size=r.hidden, linear_before_reset=int(c.attr("linear_before_reset", 0)),
                 direction=r.direction)
    gates = ""
    if r.layout == 0:
        # The forward again as GRUTrain, which keeps the gates: merge_gru_train (after the
        # step's simplification) makes it the forward node itself, so they are computed once.
        y, gates = b.op("GRUTrain", _trimmed(list(c.node.input)), [b.fresh("Y"), "",
                        b.fresh("GRU_gates")], domain=TRAINOPS_DOMAIN, **attrs)[0::2]
    else:
        y = r.relayout(r.output_y(), [1, 2, 0, 3])
    ins = _trimmed([r.relayout(r.x_name, [1, 0, 2]), c.x(1), c.x(2), y, c.x(3) or "",
                    r.relayout(c.x(5), [1, 0, 2]) or "", r.relayout(gys[0], [1, 2, 0, 3]) or "",
                    r.relayout(gys[1], [1, 0, 2]) or "", gates])
    names = b.op("GRUGrad", ins, outs, domain=TRAINOPS_DOMAIN, **attrs)
    grads: list[str | None] = [None] * len(c.node.input)
    for i, name in zip(wanted, names):
        if name:
            grads[i] = r.relayout(name, [1, 0, 2]) if i in (0, 5) else name
    return grads


def _lstm_fused(r: _Rnn) -> list[str | None] | None:
    """LSTM's backward as one ``com.trainops::LSTMGrad`` node reading the gates and cell
    states of ``com.trainops::LSTMTrain``, LSTM's forward keeping them (float32, where the
    builder fuses), or ``None`` for the Scan form (peepholes ``P``). In layout 0 the
    forward node itself becomes that LSTMTrain (:func:`~.simplify.merge_gru_train`); in
    layout 1 LSTMTrain runs on transposed inputs beside it (the recurrence then runs twice)
    and the gradients are transposed back. The checks of :class:`_Rnn` have passed."""
    c, b = r.c, r.b
    if c.x(7) is not None:
        return None
    if not b.fuses(*[n for n in (r.x_name, c.x(1), c.x(2), c.x(3), c.x(5), c.x(6)) if n]):
        return None
    wanted = [0, 1, 2, 3, 5, 6]  # dX, dW, dR, dB, d_initial_h, d_initial_c
    outs = _trimmed([b.fresh("LSTMGrad_d" + str(i)) if c.need(i) else "" for i in wanted])
    if not outs:
        return [None] * len(c.node.input)
    gys = (list(c.gys) + [None] * 3)[:3]
    attrs = dict(hidden_size=r.hidden, direction=r.direction)
    x0 = r.relayout(r.x_name, [1, 0, 2])
    h0, c0 = (r.relayout(c.x(k), [1, 0, 2]) for k in (5, 6))
    if r.layout == 0:
        fwd = _trimmed(list(c.node.input))
    else:
        fwd = _trimmed([x0, c.x(1), c.x(2), c.x(3) or "", "", h0 or "", c0 or ""])
    y, gates = b.op("LSTMTrain", fwd, [b.fresh("Y"), "", "", b.fresh("LSTM_gates")],
                    domain=TRAINOPS_DOMAIN, **attrs)[0::3]
    ins = _trimmed([x0, c.x(1), c.x(2), y, gates, h0 or "", c0 or "",
                    r.relayout(gys[0], [1, 2, 0, 3]) or "", r.relayout(gys[1], [1, 0, 2]) or "",
                    r.relayout(gys[2], [1, 0, 2]) or ""])
    names = b.op("LSTMGrad", ins, outs, domain=TRAINOPS_DOMAIN, **attrs)
    grads: list[str | None] = [None] * len(c.node.input)
    for i, name in zip(wanted, names):
        if name:
            grads[i] = r.relayout(name, [1, 0, 2]) if i in (0, 5, 6) else name
    return grads


@rule("RNN", "GRU", "LSTM")
def recurrent(c: Ctx):
    """RNN, GRU and LSTM: backpropagation through time with a reverse Scan (see the
    module's docstring); GRU as one ``GRUGrad`` node and LSTM (without peepholes) as one
    ``LSTMGrad`` node where the builder fuses."""
    r = _Rnn(c)
    if r.kind in ("GRU", "LSTM"):
        grads = (_gru_fused if r.kind == "GRU" else _lstm_fused)(r)
        if grads is not None:
            return grads
    return r.run()
