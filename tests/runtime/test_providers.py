"""Provider resolution, one function for every front end (onnxgrad.runtime.providers): each
spelling of a device becomes the onnxruntime providers it names, a bad spelling an InputError that
lists the good ones, and an unavailable provider an InputError naming those available."""

from __future__ import annotations

import re
from types import SimpleNamespace

import onnxruntime as ort
import pytest

import onnxgrad
from onnxgrad.errors import InputError
from onnxgrad.runtime.providers import device_providers, parse_device, resolve_providers
from tests.models import mlp

CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
CPU = ["CPUExecutionProvider"]


def _torch_device(kind: str, index: int | None = None) -> object:
    """A torch.device as the runtime sees it (by its attributes): torch's own when installed."""
    try:
        import torch
    except ImportError:
        return SimpleNamespace(type=kind, index=index)
    return torch.device(kind) if index is None else torch.device(kind, index)


@pytest.mark.parametrize(
    ("device", "want"),
    [
        (None, ("cpu", 0)),
        ("cpu", ("cpu", 0)),
        (" CPU ", ("cpu", 0)),
        ("cuda", ("cuda", 0)),
        ("Cuda:2", ("cuda", 2)),
        ("gpu", ("cuda", 0)),
        ("GPU:1", ("cuda", 1)),
        ("torch:cpu", ("cpu", 0)),
        ("torch:cuda", ("cuda", 0)),
        ("torch:cuda:3", ("cuda", 3)),
        ("duck:cuda:1", ("cuda", 1)),  # anything with torch.device's attributes
    ],
)
def test_each_spelling_names_its_device(device: object, want: tuple[str, int]) -> None:
    if isinstance(device, str) and device.startswith("torch:"):
        parts = device.split(":")[1:]
        device = _torch_device(parts[0], int(parts[1]) if len(parts) > 1 else None)
    elif isinstance(device, str) and device.startswith("duck:"):
        device = SimpleNamespace(type="cuda", index=1)
    assert parse_device(device) == want
    providers = device_providers(want)
    if want[0] == "cpu":
        assert providers == CPU
    else:
        assert providers == [("CUDAExecutionProvider", {"device_id": want[1]}), *CPU]


@pytest.mark.parametrize("providers", [None, "cpu", "CPU", ["cpu"], CPU, [("CPUExecutionProvider", {})]])
def test_the_cpu_resolves_everywhere(providers: object) -> None:
    got = resolve_providers(providers)
    assert [p[0] if isinstance(p, tuple) else p for p in got] == CPU
    assert resolve_providers(_torch_device("cpu")) == CPU


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
@pytest.mark.parametrize(
    "providers", ["cuda", "cuda:1", "gpu", "GPU:0", "torch:cuda", ["CUDAExecutionProvider"]]
)
def test_cuda_where_onnxruntime_has_none_is_refused(providers: object) -> None:
    if providers == "torch:cuda":
        providers = _torch_device("cuda", 0)
    message = r"^execution provider 'CUDAExecutionProvider' is not available \(available: \["
    with pytest.raises(InputError, match=message):
        resolve_providers(providers)


@pytest.mark.skipif(not CUDA, reason="no CUDA in this onnxruntime")
@pytest.mark.parametrize("providers", ["cuda", "cuda:0", "gpu", "torch:cuda"])
def test_cuda_resolves_where_onnxruntime_has_it(providers: object) -> None:
    if providers == "torch:cuda":
        providers = _torch_device("cuda", 0)
    assert resolve_providers(providers) == [("CUDAExecutionProvider", {"device_id": 0}), *CPU]


@pytest.mark.parametrize(
    ("providers", "message"),
    [
        ("tpu", "unknown device 'tpu'"),
        ("cuda:x", "unknown device 'cuda:x'"),
        ("gpu:-1", "unknown device 'gpu:-1'"),
        (42, "unknown device 42"),
        (["cpu", "npu"], "unknown device 'npu'"),
        ("torch:meta", "unsupported torch device .*: only cpu and cuda work"),
    ],
)
def test_a_bad_spelling_says_what_is_expected(providers: object, message: str) -> None:
    if providers == "torch:meta":
        providers = _torch_device("meta")
    expected = re.escape("expected 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device")
    with pytest.raises(
        InputError, match=rf"^{message}(: {expected})? \(or one of onnxruntime's provider names"
    ):
        resolve_providers(providers)


def test_front_ends_take_every_spelling() -> None:
    """ForwardBackward resolves through the same function (OnnxModule, Trainer, the artifacts
    Runner and compat call it too): a torch.device works there, a bad spelling is refused."""
    fb = onnxgrad.ForwardBackward(mlp(), providers=_torch_device("cpu"))
    assert fb.providers == CPU
    with pytest.raises(InputError, match="unknown device 'tpu'"):
        onnxgrad.ForwardBackward(mlp(), providers="tpu")


def test_newest_opset_is_one_onnx_defines_and_onnxruntime_loads() -> None:
    """empty_base() and other models written from nothing stamp it: onnx 1.23 defines opset 28, which
    onnxruntime 1.31 (the oldest supported) refuses, so onnx's current opset is not enough."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from onnxgrad.model.graph import ir_version_for
    from onnxgrad.runtime.runner import make_session, newest_opset

    opset = newest_opset()
    assert 17 < opset <= onnx.defs.onnx_opset_version()
    imports = [helper.make_opsetid("", opset)]
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=imports, ir_version=ir_version_for(imports))
    session = make_session(model, ["CPUExecutionProvider"], None)
    out = session.run(None, {"x": np.array([-1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(out[0], [0.0, 2.0])
