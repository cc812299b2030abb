"""The parameter file of a training folder (``state.safetensors``): the safetensors format of
:mod:`onnxgrad.model.safetensors`, the one reader and writer of onnxgrad, under the names this
module always had."""

from __future__ import annotations

from ..model.safetensors import DTYPES, load, loads, save, saves

__all__ = ["DTYPES", "load", "loads", "save", "saves"]
