"""The architecture: layers that only look down (tools/check_layers.py, also run by ``make lint``), and a
model validated once per front-end call (docs/architecture.md)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import numpy_helper

import onnxgrad
from onnxgrad.model import validate
from tests.models import mlp

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_layers", module)
    spec.loader.exec_module(module)
    return module


def _copy_source(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "src" / "onnxgrad", tmp_path / "onnxgrad", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


def test_the_package_keeps_its_layers():
    assert _checker().check(ROOT / "src") == []


@pytest.mark.parametrize(
    ("where", "planted", "expected"),
    [
        # a lazy upward import counts as much as one at the top
        ("model/graph.py", "\n\ndef _f():\n    from ..runtime import session\n", "a higher layer"),
        ("autodiff/registry.py", "\nfrom ..pythonop import gradient\n", "a higher layer"),
        ("runtime/runner.py", "\nimport onnxgrad.pythonop.executor\n", "a higher layer"),
        ("model/validate.py", "\nfrom ..autodiff import registry\n", "a higher layer"),
        # a loop inside one layer
        ("model/graph.py", "\n\ndef _f():\n    from . import infer\n", "import cycle"),
        # a module no layer names
        ("newcomer.py", "", "belongs to no layer"),
    ],
)
def test_a_planted_violation_is_reported(tmp_path, where, planted, expected):
    src = _copy_source(tmp_path)
    path = src / "onnxgrad" / where
    path.write_text((path.read_text() if path.exists() else '"""new"""\n') + planted)
    problems = _checker().check(src)
    assert any(expected in p for p in problems), problems


def test_the_checker_fails_the_lint_step(tmp_path):
    src = _copy_source(tmp_path)
    path = src / "onnxgrad" / "model" / "load.py"
    path.write_text(path.read_text() + "\nfrom ..torch import module\n")
    assert _checker().main(["check_layers", str(src)]) == 1
    assert _checker().main(["check_layers", str(ROOT / "src")]) == 0


# ---- one validation per front-end call --------------------------------------------------------------
def _batchnorm_model() -> onnx.ModelProto:
    """x -> MatMul -> BatchNormalization -> Dropout: follows the training flag (switched copies)."""
    rng = np.random.default_rng(0)
    model = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 15]>
        g (float[N, 4] x) => (float[N, 3] y) {
            h = MatMul (x, W)
            b = BatchNormalization (h, scale, bias, mean, var)
            y = Dropout (b)
        }"""
    )
    inits = {
        "W": rng.standard_normal((4, 3)).astype(np.float32),
        "scale": np.ones(3, np.float32),
        "bias": np.zeros(3, np.float32),
        "mean": np.zeros(3, np.float32),
        "var": np.ones(3, np.float32),
    }
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
    return model


@pytest.fixture
def validations(monkeypatch):
    calls = []
    original = validate.validate_model

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(validate, "validate_model", counted)
    return calls


def _front_ends():
    x = np.ones((2, 4))

    def torch_module(model):
        pytest.importorskip("torch")
        from onnxgrad.torch import OnnxModule

        return OnnxModule(model)

    def compat(model):
        pytest.importorskip("torch")
        from onnxgrad.compat import OrtGradientForwardBackward

        return OrtGradientForwardBackward(model)

    def grads(model):
        feeds = {
            "x": x.astype(np.float32 if model.graph.input[0].type.tensor_type.elem_type == 1 else x.dtype)
        }
        return onnxgrad.gradients(model, feeds)

    def trainer(model):
        from onnxgrad.train import Trainer

        return Trainer(model, loss="mse", progress=False)

    def artifacts(model):
        from onnxgrad.artifacts import generate

        return generate(model, loss="mse")

    def sklearn(model):
        pytest.importorskip("sklearn")
        from onnxgrad.sklearn import OnnxRegressor

        dtype = np.float32 if model.graph.input[0].type.tensor_type.elem_type == 1 else x.dtype
        X = np.random.default_rng(0).standard_normal((8, 4)).astype(dtype)
        y = np.random.default_rng(1).standard_normal((8, 3)).astype(dtype)
        return OnnxRegressor(model, epochs=1, batch_size=4).fit(X, y)

    return {
        "ForwardBackward": onnxgrad.ForwardBackward,
        "sklearn.fit": sklearn,
        "Trainer": trainer,
        "artifacts.generate": artifacts,
        "OnnxModule": torch_module,
        "build_gradient": onnxgrad.build_gradient,
        "gradients": grads,
        "compat": compat,
    }


@pytest.mark.parametrize("make", [mlp, _batchnorm_model], ids=["mlp", "batchnorm"])
@pytest.mark.parametrize("front_end", list(_front_ends()))
def test_a_model_is_validated_once_per_front_end_call(validations, front_end, make):
    model = make()
    _front_ends()[front_end](model)
    assert len(validations) == 1


def test_a_model_from_a_file_is_validated_once(validations, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_batchnorm_model(), path)
    fb = onnxgrad.ForwardBackward(str(path))
    fb.forward({"x": np.ones((2, 4), np.float32)}).backward()
    fb.forward({"x": np.ones((2, 4), np.float32)}, training=False)  # the inference graphs, made on use
    assert len(validations) == 1


def test_a_checked_model_is_not_checked_again_but_a_plain_one_is(validations):
    from onnxgrad.model import CheckedModel, load_checked, load_model

    checked = load_checked(mlp())
    assert isinstance(checked, CheckedModel)
    assert load_checked(checked) is checked
    assert load_model(checked) is checked.proto
    assert len(validations) == 1
    load_model(checked.proto)  # a ModelProto carries no proof: checked again
    assert len(validations) == 2


@pytest.mark.parametrize("command", ["grad", "info", "check", "bench", "train"])
def test_each_command_validates_its_model_once(validations, tmp_path, capsys, command):
    from onnxgrad.cli import main
    from onnxgrad.demo import build_mlp

    path = tmp_path / "m.onnx"
    onnx.save(build_mlp((8, 4, 1), np.random.default_rng(0)), path)
    argv = {
        "grad": ["-o", str(tmp_path / "graphs")],
        "info": [],
        "check": ["--no-nodes"],  # the node checks validate one-node models of their own
        "bench": ["--steps", "1"],
        "train": ["--data", str(tmp_path / "d.npz"), "--target", "y", "--loss", "mse", "--epochs", "1"],
    }[command]
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "d.npz", pixels=rng.standard_normal((16, 8)), y=rng.standard_normal((16, 1)))
    argv += ["-o", str(tmp_path / "out.onnx"), "--no-progress"] if command == "train" else []
    assert main([command, str(path), *argv]) == 0
    assert len(validations) == 1
