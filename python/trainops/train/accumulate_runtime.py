"""The runtime of an accumulating step graph (:class:`AccumulatingRuntime`): the
micro-batch session and the update session of :mod:`.accumulate` over ONE set of buffers:
each state is bound in place in the session(s) whose model has it (input and output to
one OrtValue; an input only, where a model only reads it)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..autodiff import GradientError
from .accumulate import COUNT
from .runtime import NUMPY_TYPES, session_options
from .spec import StepGraph

__all__ = ["AccumulatingRuntime"]


class AccumulatingRuntime:
    """Two CPU sessions (``session``: the micro-batch model, ``apply_session``: the
    update) of a StepGraph with an ``apply_model``. ``arrays``/``values``: name -> numpy
    buffer / OrtValue, as :class:`~.runtime.StepRuntime`'s. ``updated``: whether the last
    :meth:`run` updated the parameters."""

    def __init__(self, graph: StepGraph, threads: int | None = None,
                 library: str | None = None):
        import onnxruntime as ort

        if graph.apply_model is None:
            raise ValueError("AccumulatingRuntime: the step graph has no apply model")
        self.graph = graph
        so = session_options(threads, library)
        self.session = ort.InferenceSession(graph.model.SerializeToString(), so,
                                            providers=["CPUExecutionProvider"])
        self.apply_session = ort.InferenceSession(graph.apply_model.SerializeToString(), so,
                                                  providers=["CPUExecutionProvider"])
        self.arrays: dict[str, np.ndarray] = {}
        self.values: dict[str, Any] = {}
        self.binding = self.session.io_binding()
        self.apply_binding = self.apply_session.io_binding()
        for e in graph.states:
            self._put(e.input, e.initial)
        for sess, bind in ((self.session, self.binding),
                           (self.apply_session, self.apply_binding)):
            ins = {i.name for i in sess.get_inputs()}
            outs = {o.name for o in sess.get_outputs()}
            for e in graph.states:
                if e.input in ins:
                    bind.bind_ortvalue_input(e.input, self.values[e.input])
                if e.output in outs:
                    bind.bind_ortvalue_output(e.output, self.values[e.input])
        self._accum = [self.arrays[e.input] for e in graph.of_kind("grad_accum")]
        # What the micro-batch model writes in place (buffers, count, Philox states,
        # running statistics): the k-th call keeps a copy until its update has run.
        outs = {o.name for o in self.session.get_outputs()}
        self._micro_writes = [e.input for e in graph.states if e.output in outs]
        self.updated = False
        self._bind_outputs(self.session, self.binding, [graph.loss_output])
        self._bind_outputs(self.apply_session, self.apply_binding, graph.extra_outputs)

    def _bind_outputs(self, sess, bind, names) -> None:
        outputs = {o.name: o for o in sess.get_outputs()}
        for out in names:
            o = outputs[out]
            if o.shape is None or not all(isinstance(d, int) for d in o.shape):
                raise GradientError(f"output {out!r} must have a static shape, got {o.shape}")
            if out == self.graph.loss_output and int(np.prod(o.shape)) != 1:
                raise GradientError(f"loss {self.graph.options.loss!r} must be a scalar, has "
                                    f"shape {o.shape}")
            bind.bind_ortvalue_output(out, self._put(out, np.zeros(o.shape, NUMPY_TYPES[o.type])))

    def _put(self, name: str, arr) -> Any:
        from ..bfloat16 import to_ortvalue

        arr = np.array(arr, order="C", copy=True)
        self.arrays[name] = arr
        self.values[name] = to_ortvalue(arr)  # shares arr's memory (bfloat16 state too)
        return self.values[name]

    @property
    def pending(self) -> int:
        """Micro-batches accumulated since the last update."""
        return int(self.arrays[COUNT][0])

    def run(self, feeds: Mapping[str, Any], lr: float, t: int) -> float:
        """One micro-batch: ``feeds`` (every data input); after the ``accumulate``-th since
        the last update, the update with learning rate ``lr`` and update count ``t`` (then
        ``updated`` is True and the buffers are zero again). Returns the micro-batch's
        loss.

        All or nothing: when it raises, every state has its bits from before the call. The
        micro-batch model is ordered so (:mod:`.accumulate`); on the k-th call the states
        it writes are copied first and put back if the update fails."""
        g, bind = self.graph, self.binding
        for name in g.data_inputs:
            bind.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        self.updated = False
        final = self.pending + 1 >= g.options.accumulate
        before = {n: self.arrays[n].copy() for n in self._micro_writes} if final else None
        self.session.run_with_iobinding(bind)
        loss = float(self.arrays[g.loss_output].reshape(-1)[0])
        if final:
            ab = self.apply_binding
            ab.bind_cpu_input(g.lr_input, np.array([lr], g.lr_dtype))
            ab.bind_cpu_input(g.step_input, np.array([t], np.int64))
            try:
                self.apply_session.run_with_iobinding(ab)
            except BaseException:
                for n, v in before.items():  # the k-th micro-batch was never added
                    np.copyto(self.arrays[n], v)
                raise
            for a in self._accum:  # the buffers and the count start again from zero
                a.fill(0)
            self.updated = True
        return loss

    @property
    def finite(self) -> bool:
        """Whether the last update's gradients were finite (True without a finite flag or
        when the last call did not update)."""
        f = self.graph.finite_output
        return True if f is None or not self.updated else bool(self.arrays[f])
