"""Helpers of the Python tests, by role:

- :mod:`helpers.references`: independent float64 (or float32, where the contract says so)
  references of every op, from the contracts in README.md;
- :mod:`helpers.data`: dtypes, generated tensor groups, onnx's conformance cases;
- :mod:`helpers.runners`: running a model through ``session.run`` or in place through an
  IOBinding;
- :mod:`helpers.checks`: ``same_bits``, tolerances against the references, ulp distances,
  error-message wording;
- :mod:`helpers.rounding`: bounds on how far any float32 evaluation of a training step's
  backward (any summation order) is from its float64 value, for tests that compare two
  float32 paths whose rounding differs by kernel or CPU;
- :mod:`helpers.adam_pair`: those bounds carried through ONNX Adam, for two Trainers
  stepped on the same data (fused against standard-op gradients, portable against not,
  float16 against float32, ranks against one process);
- :mod:`helpers.momentum_pair`: the same through ONNX Momentum (accumulated micro-batches
  against one batch, ranks against one process).

``tests/`` is on ``sys.path`` when pytest runs (rootdir-relative imports), so a test
imports ``from helpers.checks import same_bits``.
"""
