"""Moved to :mod:`trainops.autodiff.fold` (``expand_gradients`` folds shape chains too);
re-exported here for code that imported it from the Trainer's package."""

from ..autodiff.fold import MAX_ELEMENTS, fold_shape_constants

__all__ = ["MAX_ELEMENTS", "fold_shape_constants"]
