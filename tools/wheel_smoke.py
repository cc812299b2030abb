"""Smoke test of an installed onnxgrad wheel, run by ``make test-wheel`` in a clean venv.

It runs from outside the repository, so it sees only what the wheel installed: ``import onnxgrad``
without torch, the ``py.typed`` marker (PEP 561: type checkers read onnxgrad's annotations),
ForwardBackward against a numpy formula, OnnxModule against torch, a PythonOp round trip through a
custom backward, ``onnxgrad --version`` and ``onnxgrad demo``. Exits non-zero on the
first failure and prints ``N passed, 0 failed`` at the end.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

CHECKS: list[Callable[[], None]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(fn)
    return fn


@check
def installed_from_the_wheel() -> None:
    import onnxgrad

    origin = Path(onnxgrad.__file__).resolve()
    assert "site-packages" in origin.parts, f"onnxgrad imported from {origin}, not from the wheel"


@check
def import_does_not_load_torch() -> None:
    code = "import sys, onnxgrad; onnxgrad.supported_ops(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@check
def ships_py_typed() -> None:
    from importlib.metadata import files

    import onnxgrad

    marker = Path(onnxgrad.__file__).with_name("py.typed")
    assert marker.is_file(), f"{marker} is missing: mypy and IDEs would see onnxgrad as untyped"
    recorded = {str(f) for f in files("onnxgrad") or []}
    assert "onnxgrad/py.typed" in recorded, "py.typed is not in the wheel's RECORD"


@check
def forward_backward_matches_numpy() -> None:
    import numpy as np
    from onnx import TensorProto, helper

    import onnxgrad

    w = np.array([[1.0, -2.0], [0.5, 3.0], [2.0, 1.0]], np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])],
        "smoke",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    fb = onnxgrad.ForwardBackward(model)
    res = fb.forward({"x": x})
    grads = res.backward()
    expected = x.T @ (1 - np.tanh(x @ w) ** 2)
    np.testing.assert_allclose(res.outputs[0], np.tanh(x @ w), rtol=1e-5)
    np.testing.assert_allclose(grads["w"], expected, rtol=1e-4, atol=1e-6)


@check
def onnx_module_matches_torch() -> None:
    import onnx
    import torch

    from onnxgrad.torch import OnnxModule

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    buf = io.BytesIO()
    torch.onnx.export(
        net, (torch.randn(2, 4),), buf, input_names=["x"], dynamic_axes={"x": {0: "b"}}, dynamo=False
    )
    layer = OnnxModule(onnx.load_from_string(buf.getvalue()))
    x = torch.randn(5, 4)
    layer(x).square().sum().backward()
    net(x).square().sum().backward()
    ours = dict(layer.named_parameters())
    assert len(ours) == 4, sorted(ours)
    for name, p in net.named_parameters():
        mine = next(q for n, q in ours.items() if n.replace("_", ".").endswith(name))
        torch.testing.assert_close(mine.grad, p.grad, rtol=1e-4, atol=1e-6)


@check
def python_op_round_trip() -> None:
    import torch

    import onnxgrad
    from onnxgrad.torch import OnnxModule

    class Scale3(torch.autograd.Function):  # forward x*2, backward deliberately 3*grad
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return Scale3.apply(self.fc(x))

    onnxgrad.register_function(Scale3)
    model = onnxgrad.export(Net(), (torch.randn(4, 3),))
    assert any(n.op_type == "PythonOp" and n.domain == "com.microsoft" for n in model.graph.node)
    layer = OnnxModule(model)
    x = torch.randn(4, 3)
    out = layer(x)
    out.sum().backward()
    bias = next(p for n, p in layer.named_parameters() if "bias" in n)
    torch.testing.assert_close(bias.grad, torch.full((2,), 12.0))  # 4 rows x the custom backward's 3


def _cli(*args: str) -> str:
    script = Path(sys.executable).with_name("onnxgrad")  # the console script the wheel installed
    out = subprocess.run([str(script), *args], capture_output=True, text=True)
    assert out.returncode == 0, f"onnxgrad {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@check
def cli_version() -> None:
    import onnxgrad

    assert _cli("--version").strip() == f"onnxgrad {onnxgrad.__version__}"


@check
def cli_demo() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        out = _cli("demo")
    assert "test accuracy" in out and "reloaded" in out, out


def main() -> int:
    passed = 0
    for fn in CHECKS:
        try:
            fn()
        except Exception as exc:
            print(f"FAILED {fn.__name__}: {type(exc).__name__}: {exc}")
            print(f"{passed} passed, 1 failed")
            return 1
        print(f"ok {fn.__name__}")
        passed += 1
    print(f"{passed} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
