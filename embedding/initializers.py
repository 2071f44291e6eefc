"""Picklable table initializers (`init(key, shape, dtype) -> array`)."""

from embedding._initializers import Constant, Normal, TruncatedNormal, Uniform

__all__ = ["Constant", "Normal", "TruncatedNormal", "Uniform"]
