"""Helpers of the Python tests, by role:

- :mod:`helpers.references`: independent float64 (or float32, where the contract says so)
  references of every op, from the contracts in README.md;
- :mod:`helpers.data`: dtypes, generated tensor groups, onnx's conformance cases;
- :mod:`helpers.runners`: running a model through ``session.run`` or in place through an
  IOBinding;
- :mod:`helpers.checks`: ``same_bits``, tolerances against the references, ulp distances,
  error-message wording.

``tests/`` is on ``sys.path`` when pytest runs (rootdir-relative imports), so a test
imports ``from helpers.checks import same_bits``.
"""
