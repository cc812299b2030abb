"""Every error onnxgrad raises comes from onnxgrad.errors, and each still is the builtin type that
code written without onnxgrad in mind catches."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from onnxgrad import errors
from onnxgrad.errors import InputError, InputTypeError, NotFoundError, OnnxGradError, PathNotFoundError

SRC = Path(__file__).resolve().parent.parent / "src" / "onnxgrad"
BUILTIN = {"ValueError", "RuntimeError", "TypeError", "KeyError", "FileNotFoundError", "OSError"}


def _raised_builtins() -> list[str]:
    """``file:line name`` of every ``raise <builtin error>`` in the package (``NotImplementedError``
    in abstract methods and the ``AssertionError`` of the testing helpers are what they should be)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {exc.id}")
    return found


def test_no_builtin_error_is_raised_directly():
    assert _raised_builtins() == []


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [(InputTypeError, TypeError), (NotFoundError, KeyError), (PathNotFoundError, FileNotFoundError)],
)
def test_each_error_is_also_its_builtin(cls, builtin):
    assert issubclass(cls, OnnxGradError) and issubclass(cls, InputError) and issubclass(cls, builtin)
    assert cls.__name__ in errors.__all__


def test_the_errors_that_were_builtins():
    from onnxgrad import build_gradient, demo
    from onnxgrad.autodiff.compose import compose
    from onnxgrad.train import History
    from tests.train.test_trainer import linear

    with pytest.raises(InputError, match="side must be divisible by 4, got 6"):
        demo.build_cnn(np.random.default_rng(0), side=6)
    with pytest.raises(NotFoundError, match="no 'val_loss' in the history"):
        History([{"epoch": 1, "loss": 0.5}])["val_loss"]
    with pytest.raises(KeyError):  # what the builtin-minded caller catches
        History([{"epoch": 1, "loss": 0.5}])["val_loss"]
    graphs = build_gradient(linear())
    graphs.backward.graph.output[0].name = "xw"  # edited into a forward value's name
    with pytest.raises(InputError, match=r"backward outputs \['xw'\] are also forward values"):
        compose(graphs)
