"""Every public entry point refuses each bad input with the right onnxgrad error and a useful message.

Entry points: ``build_gradient``, ``gradients``, ``ForwardBackward``, ``OnnxModule``,
``OrtGradientForwardBackward`` and the command line. Bad inputs: a truncated file, a file that is not
ONNX, a graph with a cycle, a value nothing defines, a trainable name that is not an initializer,
inputs with wrong names, shapes or dtypes, an output gradient of the wrong shape, a backward without
its forward or run twice.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad.cli import main as cli_main
from onnxgrad.compat import OrtGradientForwardBackward
from onnxgrad.errors import (
    GradientNotImplementedError,
    InputError,
    ModelError,
    OnnxGradError,
    OnnxGradRuntimeError,
    PythonOpError,
)
from tests.models import mlp
from tests.reliability._util import cyclic_model, missing_value_model

torch = pytest.importorskip("torch")
from onnxgrad.torch import OnnxModule  # noqa: E402

X = np.random.default_rng(0).standard_normal((2, 4))  # a valid input of mlp(): x is (N, 4) float64
DY = np.ones((2, 3))  # a valid gradient of its output y, (N, 3)


class CliFailed(Exception):
    """The command line exited with a non-zero code (the message is what it printed on stderr)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _run_cli(args: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(args)
    if code:
        raise CliFailed(code, err.getvalue())


# ---- the entry points, as "load this model" -------------------------------------------------------
# Each takes the model (proto, path or bytes; the command line writes a proto to a file first),
# the trainable names (None: the default) and pytest's tmp_path.
def _build_gradient(src: Any, trainable: list[str] | None, tmp: Any) -> Any:
    return onnxgrad.build_gradient(src, trainable=trainable)


def _gradients(src: Any, trainable: list[str] | None, tmp: Any) -> Any:
    # mlp() takes x of shape (N, 4); the broken models take x of shape (2,)
    rank = len(src.graph.input[0].type.tensor_type.shape.dim) if isinstance(src, onnx.ModelProto) else 2
    return onnxgrad.gradients(src, {"x": X if rank == 2 else np.ones(2)}, wrt=trainable)


def _forward_backward(src: Any, trainable: list[str] | None, tmp: Any) -> Any:
    return onnxgrad.ForwardBackward(src, trainable=trainable)


def _onnx_module(src: Any, trainable: list[str] | None, tmp: Any) -> Any:
    return OnnxModule(src, trainable=trainable)


def _compat(src: Any, trainable: list[str] | None, tmp: Any) -> Any:
    return OrtGradientForwardBackward(src, weights_to_train=trainable)


def _cli(src: Any, trainable: list[str] | None, tmp: Any) -> Any:
    if isinstance(src, onnx.ModelProto):
        path = tmp / "model.onnx"
        onnx.save(src, path)
        src = path
    elif isinstance(src, bytes):
        path = tmp / "model.onnx"
        path.write_bytes(src)
        src = path
    _run_cli(["grad", str(src), "-o", str(tmp / "out"), *(["--trainable", *trainable] if trainable else [])])


LOADERS: dict[str, Callable[[Any, list[str] | None, Any], Any]] = {
    "build_gradient": _build_gradient,
    "gradients": _gradients,
    "ForwardBackward": _forward_backward,
    "OnnxModule": _onnx_module,
    "OrtGradientForwardBackward": _compat,
    "cli": _cli,
}


def _expect(name: str, loader: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    """``loader()`` raises ``error`` matching ``pattern``; for the command line: exit code 2 and one
    line ``onnxgrad: error: ...`` matching it."""
    if name == "cli":
        with pytest.raises(CliFailed) as info:
            loader()
        assert info.value.code == 2
        text = str(info.value)
        assert text.startswith("onnxgrad: error: ") and text.count("\n") == 1, text
        assert re.search(pattern, text), text
        return
    with pytest.raises(error, match=pattern):
        loader()


def _cases(kind: str) -> list[Any]:
    """One pytest.param per entry point."""
    return [pytest.param(name, id=name) for name in LOADERS]


# ---- files that are not models --------------------------------------------------------------------------
@pytest.fixture
def truncated(tmp_path):
    data = mlp().SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.fixture
def not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("these are my notes, not a model\n" * 20)
    return path


@pytest.mark.parametrize("entry", _cases("file"))
@pytest.mark.parametrize("form", ["path", "bytes"])
def test_truncated_file(entry, form, truncated, tmp_path):
    src = truncated if form == "path" else truncated.read_bytes()
    _expect(entry, lambda: LOADERS[entry](src, None, tmp_path), ModelError, r"not a valid ONNX file")


@pytest.mark.parametrize("entry", _cases("file"))
@pytest.mark.parametrize("form", ["path", "bytes"])
def test_not_an_onnx_file(entry, form, not_onnx, tmp_path):
    src = not_onnx if form == "path" else not_onnx.read_bytes()
    _expect(entry, lambda: LOADERS[entry](src, None, tmp_path), ModelError, r"not a valid ONNX file")


@pytest.mark.parametrize("entry", _cases("file"))
def test_missing_file(entry, tmp_path):
    src = tmp_path / "absent.onnx"
    _expect(entry, lambda: LOADERS[entry](src, None, tmp_path), ModelError, r"absent\.onnx'? does not exist")


@pytest.mark.parametrize("entry", _cases("file"))
def test_empty_file(entry, tmp_path):
    src = tmp_path / "empty.onnx"
    src.write_bytes(b"")
    _expect(entry, lambda: LOADERS[entry](src, None, tmp_path), ModelError, r"empty graph")


@pytest.mark.parametrize("entry", [e for e in LOADERS if e != "cli"])
def test_not_a_model_object(entry, tmp_path):
    with pytest.raises(ModelError, match=r"expected an onnx.ModelProto, a path or bytes, got int"):
        LOADERS[entry](12, None, tmp_path)


# ---- graphs that cannot run ----------------------------------------------------------------------------
@pytest.mark.parametrize("entry", _cases("graph"))
def test_graph_with_a_cycle(entry, tmp_path):
    _expect(
        entry,
        lambda: LOADERS[entry](cyclic_model(), None, tmp_path),
        ModelError,
        r"cycle through value '[ab]'",
    )


@pytest.mark.parametrize("entry", _cases("graph"))
def test_value_nothing_defines(entry, tmp_path):
    _expect(
        entry,
        lambda: LOADERS[entry](missing_value_model(), None, tmp_path),
        ModelError,
        r"node 'add' \(Add\) reads 'nowhere', which no node, input or initializer defines",
    )


TRAINABLE_CASES = [
    # wrt of gradients() accepts inputs too: only an unknown name is wrong there
    pytest.param(entry, name, id=f"{entry}-{name}")
    for entry in LOADERS
    for name in ("nope", "x")  # unknown, and an input rather than an initializer
    if not (entry == "gradients" and name == "x")
]


@pytest.mark.parametrize(("entry", "name"), TRAINABLE_CASES)
def test_trainable_name_that_is_not_an_initializer(entry, name, tmp_path):
    if entry == "gradients":
        pattern = r"\['nope'\] are neither initializers nor inputs of the model"
    else:
        pattern = rf"trainable name '{name}' is not an initializer of the model"
    _expect(entry, lambda: LOADERS[entry](mlp(), [name], tmp_path), InputError, pattern)


def test_cli_info_reports_bad_files_in_one_line(truncated, tmp_path):
    with pytest.raises(CliFailed) as info:
        _run_cli(["info", str(truncated)])
    assert info.value.code == 2 and "not a valid ONNX file" in str(info.value)
    with pytest.raises(CliFailed, match="does not exist"):
        _run_cli(["info", str(tmp_path / "absent.onnx")])


# ---- inputs at run time -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fb():
    return onnxgrad.ForwardBackward(mlp())


@pytest.fixture(scope="module")
def module():
    return OnnxModule(mlp())


@pytest.fixture(scope="module")
def compat():
    factory = OrtGradientForwardBackward(mlp())
    weights = [factory.get_initializer(n) for n in factory.weights_to_train]
    return factory, weights


WRONG_INPUTS = {
    # label: (x, message of ForwardBackward / gradients / OnnxModule, message of the compat class)
    "shape": (
        np.zeros((2, 5)),
        r"has shape \(2, 5\), the model expects \(N, 4\) \(dimension 1 must be 4\)",
        r"input 0 \('x'\) has shape \(2, 5\), expected \('\?', 4\)",
    ),
    "rank": (
        np.zeros(4),
        r"has rank 1 \(shape \(4,\)\), the model expects rank 2",
        r"input 0 \('x'\) has shape \(4,\), expected",
    ),
    # floats of another width are cast (the input contract) but complex numbers are not; the compat
    # class takes OrtValues of the model's type only, as onnxcustom's did
    "dtype": (
        np.zeros((2, 4), np.complex64),
        r"has dtype complex64, the model expects float64",
        r"input 0 \('x'\) has type tensor\(float\), expected tensor\(double\)",
        np.zeros((2, 4), np.float32),
    ),
}


@pytest.mark.parametrize("what", list(WRONG_INPUTS))
def test_forward_backward_wrong_input(fb, what):
    x, message, *_ = WRONG_INPUTS[what]
    with pytest.raises(InputError, match=rf"input 'x' {message}"):
        fb.forward({"x": x})


@pytest.mark.parametrize("what", list(WRONG_INPUTS))
def test_gradients_wrong_input(what):
    x, message, *_ = WRONG_INPUTS[what]
    with pytest.raises(InputError, match=rf"input 'x' {message}"):
        onnxgrad.gradients(mlp(), {"x": x})


@pytest.mark.parametrize("what", list(WRONG_INPUTS))
def test_onnx_module_wrong_input(module, what):
    x, message, *_ = WRONG_INPUTS[what]
    with pytest.raises(InputError, match=rf"input 'x' {message}"):
        module(torch.from_numpy(x).requires_grad_())


@pytest.mark.parametrize("what", list(WRONG_INPUTS))
def test_compat_wrong_input(compat, what):
    factory, weights = compat
    x, _, message, *compat_x = WRONG_INPUTS[what]
    x = compat_x[0] if compat_x else x
    with pytest.raises(InputError, match=message):
        factory.new_instance().forward([x, *weights], training=True)


def test_wrong_input_names_and_counts(fb, module, compat):
    with pytest.raises(InputError, match=r"unknown input name\(s\) \['X'\]; the model's inputs are \['x'\]"):
        fb.forward({"X": X})
    with pytest.raises(InputError, match=r"missing input\(s\) \['x'\]"):
        fb.forward({})
    with pytest.raises(InputError, match=r"unknown input name\(s\) \['X'\]"):
        onnxgrad.gradients(mlp(), {"X": X})
    with pytest.raises(InputError, match=r"feeds must be a mapping input name -> array, got list"):
        fb.forward([X])  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"expected 1 input tensor\(s\) \['x'\], got 2"):
        module(torch.from_numpy(X), torch.from_numpy(X))
    with pytest.raises(InputError, match=r"input 'x' must be a torch.Tensor, got ndarray"):
        module(X)
    factory, _ = compat
    with pytest.raises(InputError, match=r"forward expects 5 values \(inputs then weights"):
        factory.new_instance().forward([X])
    with pytest.raises(InputError, match=r"input_names: \['X'\] not in the model"):
        OrtGradientForwardBackward(mlp(), input_names=["X"])
    with pytest.raises(InputError, match=r"'z' is not an output of the model"):
        onnxgrad.ForwardBackward(mlp(), outputs=["z"])
    with pytest.raises(InputError, match=r"'z' is not an input of the model"):
        onnxgrad.build_gradient(mlp(), inputs_requiring_grad=["z"])


def test_feeds_that_are_not_arrays(fb):
    with pytest.raises(InputError, match=r"input 'x' cannot be converted to float64"):
        fb.forward({"x": "abc"})
    with pytest.raises(InputError, match=r"input 'x' cannot be converted to float64"):
        fb.forward({"x": [[1.0, 2.0], [3.0]]})


# ---- output gradients -------------------------------------------------------------------------------------
def test_output_gradient_with_wrong_shape_or_dtype(fb, compat):
    res = fb.forward({"x": X})
    with pytest.raises(
        InputError, match=r"gradient of output 'y' has shape \(3, 3\), the output has \(2, 3\)"
    ):
        res.backward({"y": np.zeros((3, 3))})
    with pytest.raises(InputError, match=r"gradient of output 'y' has dtype float32, expected float64"):
        res.backward({"y": np.zeros((2, 3), np.float32)})
    with pytest.raises(InputError, match=r"expected 1 output gradients \(one per output\), got 2"):
        res.backward([DY, DY])
    with pytest.raises(InputError, match=r"no gradient can be given for \['z'\]"):
        res.backward({"z": DY})
    # a refused gradient consumes nothing: the backward still runs once, with the right one
    assert res.backward({"y": DY})["W1"].shape == (4, 5)

    with pytest.raises(
        InputError, match=r"gradient of output 'y' has shape \(3, 3\), the output has \(2, 3\)"
    ):
        onnxgrad.gradients(mlp(), {"x": X}, {"y": np.zeros((3, 3))})

    factory, weights = compat
    fn = factory.new_instance()
    fn.forward([X, *weights], training=True)
    with pytest.raises(InputError, match=r"gradient 0 \('y'\) has shape \(3, 3\), expected \(2, 3\)"):
        fn.backward([np.zeros((3, 3))])
    with pytest.raises(
        InputError, match=r"gradient 0 \('y'\) has type tensor\(float\), expected tensor\(double\)"
    ):
        fn.backward([np.zeros((2, 3), np.float32)])
    with pytest.raises(InputError, match=r"backward expects 1 gradients"):
        fn.backward([DY, DY])
    assert len(fn.backward([DY])) == 5  # the pending forward was kept


def test_onnx_module_output_gradient_with_wrong_shape(module):
    # torch checks the gradient against the output before calling the module's backward
    y = module(torch.from_numpy(X).requires_grad_())
    with pytest.raises(
        RuntimeError, match=r"Mismatch in shape: grad_output\[0\] has a shape of torch.Size\(\[3, 3\]\)"
    ):
        y.backward(torch.ones(3, 3, dtype=torch.float64))


# ---- the forward/backward protocol ------------------------------------------------------------------------
def test_backward_without_forward_or_twice_forward_backward(fb):
    res = fb.forward({"x": X})
    res.backward()
    with pytest.raises(OnnxGradRuntimeError, match=r"backward already ran for this forward result"):
        res.backward()
    inference = fb.forward({"x": X}, training=False)
    with pytest.raises(OnnxGradRuntimeError, match=r"this forward ran with training=False"):
        inference.backward()


def test_backward_without_forward_or_twice_compat(compat):
    factory, weights = compat
    fn = factory.new_instance()
    with pytest.raises(
        OnnxGradRuntimeError, match=r"backward needs a pending forward\(\.\.\., training=True\)"
    ):
        fn.backward([DY])
    fn.forward([X, *weights], training=False)
    with pytest.raises(OnnxGradRuntimeError, match=r"backward needs a pending forward"):
        fn.backward([DY])
    fn.forward([X, *weights], training=True)
    fn.backward([DY])
    with pytest.raises(OnnxGradRuntimeError, match=r"backward needs a pending forward"):
        fn.backward([DY])
    with pytest.raises(OnnxGradRuntimeError, match=r"no tensor was saved"):
        fn.saved_tensors  # noqa: B018


def test_backward_without_forward_or_twice_onnx_module(module):
    with torch.no_grad():
        y = module(torch.from_numpy(X))
    with pytest.raises(RuntimeError, match=r"does not require grad"):
        y.sum().backward()
    loss = module(torch.from_numpy(X).requires_grad_()).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match=r"backward through the graph a second time"):
        loss.backward()


# ---- the hierarchy --------------------------------------------------------------------------------------
def test_errors_are_onnxgrad_errors_and_builtin_ones():
    for cls, builtin in [
        (ModelError, ValueError),
        (InputError, ValueError),
        (GradientNotImplementedError, NotImplementedError),
        (PythonOpError, RuntimeError),
        (OnnxGradRuntimeError, RuntimeError),
    ]:
        assert issubclass(cls, OnnxGradError) and issubclass(cls, builtin)
