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
        loss."""
        g, bind = self.graph, self.binding
        for name in g.data_inputs:
            bind.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        self.session.run_with_iobinding(bind)
        loss = float(self.arrays[g.loss_output].reshape(-1)[0])
        self.updated = self.pending >= g.options.accumulate
        if self.updated:
            ab = self.apply_binding
            ab.bind_cpu_input(g.lr_input, np.array([lr], g.lr_dtype))
            ab.bind_cpu_input(g.step_input, np.array([t], np.int64))
            self.apply_session.run_with_iobinding(ab)
            for a in self._accum:  # the buffers and the count start again from zero
                a.fill(0)
        return loss

    @property
    def finite(self) -> bool:
        """Whether the last update's gradients were finite (True without a finite flag or
        when the last call did not update)."""
        f = self.graph.finite_output
        return True if f is None or not self.updated else bool(self.arrays[f])
