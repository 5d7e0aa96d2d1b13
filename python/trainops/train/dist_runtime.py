"""The data-parallel runtime (:class:`DistributedRuntime`): a gradient session and an
optimizer session around the MPI collectives (:class:`trainops.distributed.Collectives`),
over flat buffers that ONNX Runtime and MPI share."""

from __future__ import annotations

import time
import zlib
from typing import Any, Mapping

import numpy as np

from ..autodiff import GradientError
from .dist_graph import DistributedGraphs
from .runtime import session_options
from .spec import PREFIX as _P

__all__ = ["DistributedRuntime"]


class DistributedRuntime:
    """Sessions and buffers of one rank. ``arrays``: name -> buffer (views of the flat
    buffers): the parameters, this rank's Philox states, the optimizer state (per
    parameter, or ``trainops/<S>/shard`` under ``shard_optimizer``). ``state_names``:
    optimizer state name -> the names of its buffers. ``timings``: seconds spent in
    gradients, communication and optimizer, and the step count."""

    def __init__(self, graphs: DistributedGraphs, dist, threads: int, seed: int,
                 shard_optimizer: bool, library: str | None = None):
        import onnxruntime as ort

        self.graphs, self.dist, self.shard_optimizer = graphs, dist, shard_optimizer
        d, lay, ps, initial = dist, graphs.layout, graphs.options.params, graphs.initial
        so = session_options(threads, library, spin=False)  # ranks may outnumber cores
        providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(graphs.gradient_model.SerializeToString(), so,
                                            providers=providers)
        self.optimizer_session = ort.InferenceSession(
            graphs.optimizer_model.SerializeToString(), so, providers=providers)
        dtype = graphs.dtype
        # Flat buffers MPI reduces and gathers in place; ONNX Runtime reads the parameters
        # from, and writes the gradients into, views of them (OrtValues over their memory).
        self.flat_params = np.zeros(lay.padded, dtype)
        self.flat_grads = np.zeros(lay.padded, dtype)
        for p in ps:
            o = lay.offsets[p]
            self.flat_params[o:o + initial[p].size] = initial[p].reshape(-1)
        # Every rank starts from rank 0's parameters, and all must have the same layout.
        # The seed counts only where there are random nodes (0 stands for none).
        seed = int(np.array(seed & (2**64 - 1), np.uint64).view(np.int64)) if graphs.rng else 0
        sig = [lay.total, lay.padded, zlib.crc32(graphs.gradient_model.SerializeToString()),
               seed]
        sigs = d.allgather_values(sig, "the model check (Allgather)")
        bad = [r for r in range(d.size) if list(sigs[r][:3]) != list(sigs[0][:3])]
        if bad:
            raise ValueError(f"rank {d.rank}: ranks {bad} built a different training model "
                             "than rank 0 (model, params, optimizer or policy differ)")
        bad = [r for r in range(d.size) if sigs[r][3] != sigs[0][3]]
        if bad:
            raise ValueError(f"rank {d.rank}: ranks {bad} were given another seed than rank "
                             "0; give every rank the same seed= (the Trainer partitions the "
                             "random streams by rank itself)")
        d.bcast_(self.flat_params, "the initial Bcast of the parameters")
        d.seconds = 0.0
        self.arrays: dict[str, np.ndarray] = {}
        for p in ps:
            o, shape = lay.offsets[p], initial[p].shape
            self.arrays[p] = self.flat_params[o:o + initial[p].size].reshape(shape)
        self.timings = {"gradients": 0.0, "communication": 0.0, "optimizer": 0.0, "steps": 0}
        self._bind_gradients()
        self._bind_optimizer()
        self._scale = dtype(1.0 / d.size)

    def _bind_gradients(self) -> None:
        """The gradient session: parameters in, gradients out, all views of flat buffers."""
        import onnxruntime as ort

        g, lay, initial = self.graphs, self.graphs.layout, self.graphs.initial
        val = ort.OrtValue.ortvalue_from_numpy
        keep = self._keep = []
        gb = self.binding = self.session.io_binding()
        for p, name in zip(g.options.params, g.grad_outputs):
            o, n_, shape = lay.offsets[p], initial[p].size, initial[p].shape
            pv, gv = val(self.arrays[p]), val(self.flat_grads[o:o + n_].reshape(shape))
            keep += [pv, gv]
            gb.bind_ortvalue_input(p, pv)
            gb.bind_ortvalue_output(name, gv)
        out = self.session.get_outputs()[0]
        if out.shape is None or not all(isinstance(x, int) for x in out.shape) \
                or int(np.prod(out.shape)) != 1:
            raise GradientError(f"loss {g.options.loss!r} must be a scalar with a static "
                                f"shape, got {out.shape}")
        self.loss_buf = np.zeros(out.shape, {"tensor(float)": np.float32,
                                             "tensor(double)": np.float64}[out.type])
        lv = val(self.loss_buf)
        keep.append(lv)
        gb.bind_ortvalue_output(g.options.loss, lv)
        for e in g.rng + g.bn:  # this rank's Philox states and BN statistics, in place
            self.arrays[e.input] = e.initial.copy()
            sv = val(self.arrays[e.input])
            keep.append(sv)
            gb.bind_ortvalue_input(e.input, sv)
            gb.bind_ortvalue_output(e.output, sv)

    def _bind_optimizer(self) -> None:
        """The optimizer session: this rank's slice (or all) of params, grads and state."""
        import onnxruntime as ort

        g, d, lay, initial = self.graphs, self.dist, self.graphs.layout, self.graphs.initial
        ps, opt, shard, dtype = g.options.params, g.options.optimizer, lay.shard, g.dtype
        val = ort.OrtValue.ortvalue_from_numpy
        lo = d.rank * shard if self.shard_optimizer else 0
        self.param_slice = self.flat_params[lo:lo + shard]
        self.grad_shard = np.zeros(shard, dtype) if self.shard_optimizer else self.flat_grads
        self.flat_state = {s: np.zeros(shard, dtype) for s in opt.state}
        if not self.shard_optimizer:  # per-parameter views, as a one-process Trainer has
            self.state_names = {s: [f"{_P}/{s}/{p}" for p in ps] for s in opt.state}
            for s in opt.state:
                for p, name in zip(ps, self.state_names[s]):
                    o = lay.offsets[p]
                    self.arrays[name] = self.flat_state[s][o:o + initial[p].size] \
                        .reshape(initial[p].shape)
        else:
            self.state_names = {s: [f"{_P}/{s}/shard"] for s in opt.state}
            for s in opt.state:
                self.arrays[f"{_P}/{s}/shard"] = self.flat_state[s]
        ob = self.opt_binding = self.optimizer_session.io_binding()
        xv, gv = val(self.param_slice), val(self.grad_shard)
        self._keep += [xv, gv]
        ob.bind_ortvalue_input(f"{_P}/flat/params", xv)
        ob.bind_ortvalue_output(f"{_P}/flat/params/new", xv)
        ob.bind_ortvalue_input(f"{_P}/flat/grads", gv)
        for s, arr in self.flat_state.items():
            sv = val(arr)
            self._keep.append(sv)
            ob.bind_ortvalue_input(f"{_P}/flat/{s}", sv)
            ob.bind_ortvalue_output(f"{_P}/flat/{s}/new", sv)

    def run(self, feeds: Mapping[str, Any], lr: float, t: int) -> float:
        """One data-parallel step (update count ``t``): this rank's gradients, their sum
        over the ranks, the mean taken, the optimizer on this rank's slice, the Allgather
        under ``shard_optimizer``. Returns the mean of the ranks' losses."""
        d = self.dist
        d.step = t
        t0 = time.perf_counter()
        bind = self.binding
        for name in self.graphs.data_inputs:
            bind.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        self.session.run_with_iobinding(bind)
        t1 = time.perf_counter()
        # The loss (for the caller) and the gradients, summed over the ranks at once.
        reqs = [d.start_allreduce(self.loss_buf.reshape(-1))]
        if self.shard_optimizer:
            reqs.append(d.start_reduce_scatter(self.flat_grads, self.grad_shard))
            what = "the gradients' ReduceScatter"
        else:
            reqs.append(d.start_allreduce(self.flat_grads))
            what = "the gradients' Allreduce"
        d.wait(reqs, what)
        self.grad_shard *= self._scale  # sum -> mean over the ranks
        t2 = time.perf_counter()
        ob = self.opt_binding
        ob.bind_cpu_input(f"{_P}/lr", np.array([lr], self.graphs.dtype))
        ob.bind_cpu_input(f"{_P}/T", np.array([t], np.int64))
        self.optimizer_session.run_with_iobinding(ob)
        t3 = time.perf_counter()
        if self.shard_optimizer:
            d.allgather_(self.flat_params, "the parameters' Allgather")
        t4 = time.perf_counter()
        tm = self.timings
        tm["gradients"] += t1 - t0
        tm["optimizer"] += t3 - t2
        tm["communication"] += (t2 - t1) + (t4 - t3)
        tm["steps"] += 1
        return float(self.loss_buf.reshape(-1)[0]) / d.size

    def memory(self) -> dict[str, int]:
        """Bytes: ``parameters`` (the flat buffer), ``gradients`` (plus this rank's reduced
        slice under ``shard_optimizer``), ``optimizer_state`` (this rank's)."""
        grads = self.flat_grads.nbytes + (self.grad_shard.nbytes if self.shard_optimizer
                                          else 0)
        return {"parameters": self.flat_params.nbytes, "gradients": grads,
                "optimizer_state": sum(a.nbytes for a in self.flat_state.values())}
