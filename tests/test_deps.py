"""The compatibility layer (onnxgrad.deps): both DLPack forms, version and capability errors.

Only one form of ``OrtValue.from_dlpack`` is installed at a time; the other is driven through a
stand-in built on the installed one, so neither form can rot.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tomllib
import torch
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad import deps
from onnxgrad.errors import DependencyError, OnnxGradError

ROOT = Path(__file__).resolve().parents[1]
REAL = deps.C.OrtValue.from_dlpack


def capsule_only(capsule):
    """onnxruntime >= 1.32: one capsule; bool travels as DLPack bool."""
    if deps.DLPACK_FORM == "capsule":
        return REAL(capsule)
    t = torch.from_dlpack(capsule)  # emulate it on an onnxruntime of the older form
    if t.dtype is torch.bool:
        return REAL(torch.utils.dlpack.to_dlpack(t.view(torch.uint8)), True)
    return REAL(torch.utils.dlpack.to_dlpack(t), False)


def capsule_and_flag(capsule, is_bool):
    """onnxruntime 1.21-1.31: a capsule and a flag; bool travels as uint8 with the flag set."""
    if deps.DLPACK_FORM == "capsule+flag":
        return REAL(capsule, is_bool)
    t = torch.from_dlpack(capsule)  # emulate it on an onnxruntime of the newer form
    if is_bool:
        assert t.dtype is torch.uint8, "the old form hands bool over as uint8"
        t = t.view(torch.bool)
    return REAL(torch.utils.dlpack.to_dlpack(t))


def test_the_installed_form_is_known():
    assert deps.DLPACK_FORM in ("capsule", "capsule+flag")
    assert deps.probe_from_dlpack(REAL)[0] == deps.DLPACK_FORM
    assert deps.probe_from_dlpack(None) == ("none", None)


@pytest.mark.parametrize(("standin", "form"), [(capsule_only, "capsule"), (capsule_and_flag, "capsule+flag")])
def test_both_dlpack_forms_run_a_graph(standin, form):
    found, adapter = deps.probe_from_dlpack(standin)
    assert found == form
    interop = deps.TorchInterop(torch, adapter, found)
    assert interop.bool_as_uint8 == (form == "capsule+flag")
    # a graph over float, int64 and bool: Y = X * 2, J = I + 1, C = Not(B)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "two"], ["Y"]),
            helper.make_node("Add", ["I", "one"], ["J"]),
            helper.make_node("Not", ["B"], ["C"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 2]),
            helper.make_tensor_value_info("I", TensorProto.INT64, [4]),
            helper.make_tensor_value_info("B", TensorProto.BOOL, [3]),
        ],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2]),
            helper.make_tensor_value_info("J", TensorProto.INT64, [4]),
            helper.make_tensor_value_info("C", TensorProto.BOOL, [3]),
        ],
        [
            helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # a strided view: copied to contiguous
    i = torch.arange(4)
    b = torch.tensor([True, False, True])
    feeds = {"X": interop.to_ortvalue(x), "I": interop.to_ortvalue(i), "B": interop.to_ortvalue(b)}
    assert feeds["B"].data_type() == "tensor(bool)"
    y, j, c = (interop.to_tensor(v) for v in deps.run_with_ort_values(sess, feeds, ["Y", "J", "C"]))
    torch.testing.assert_close(y, x * 2)
    assert j.tolist() == [1, 2, 3, 4] and j.dtype is torch.int64
    assert c.dtype is torch.bool and c.tolist() == [False, True, False]


def test_a_tensor_requiring_grad_crosses_without_copy():
    interop = deps.torch_interop()
    w = torch.ones(4, requires_grad=True)
    value = interop.to_ortvalue(w)
    assert value.data_ptr() == w.data_ptr()
    back = interop.to_tensor(value)
    assert back.data_ptr() == w.data_ptr() and not back.requires_grad


def test_an_old_onnxruntime_is_named_at_first_use(monkeypatch):
    monkeypatch.setattr(deps, "ORT_VERSION", "1.19.2")
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Mul", ["x", "w"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
            [helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    onnxgrad.build_gradient(model)  # building graphs needs no onnxruntime
    message = (
        "onnxgrad needs onnxruntime>=1.31; onnxruntime 1.19.2 is installed (supported: onnxruntime>=1.31)"
    )
    with pytest.raises(DependencyError, match=re.escape(message)) as info:
        onnxgrad.ForwardBackward(model)
    assert isinstance(info.value, OnnxGradError) and isinstance(info.value, ImportError)


def test_an_old_torch_is_named(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    message = "onnxgrad needs torch>=2.13; torch 2.4.1 is installed (supported: torch>=2.13)"
    with pytest.raises(DependencyError, match=re.escape(message)):
        deps.require_torch()


def test_a_missing_capability_is_named(monkeypatch):
    monkeypatch.setattr(deps, "_from_dlpack_adapter", None)
    monkeypatch.setattr(deps, "ORT_VERSION", "1.31.0")
    with pytest.raises(
        DependencyError,
        match=re.escape(
            "onnxruntime 1.31.0 does not offer OrtValue.from_dlpack, which onnxgrad needs; "
            "supported: onnxruntime>=1.31"
        ),
    ):
        deps.ortvalue_from_capsule(np.zeros((), np.int64).__dlpack__())


def test_a_dlpack_exchange_that_disagrees_fails_clearly():
    def drops_bool(capsule, is_bool):  # a pair whose DLPack loses bool: it comes back as uint8
        t = torch.from_dlpack(capsule)
        if t.dtype is torch.bool:
            t = t.to(torch.uint8)
        return capsule_only(torch.utils.dlpack.to_dlpack(t))

    interop = deps.TorchInterop(torch, drops_bool, "capsule")
    with pytest.raises(
        DependencyError, match=r"does not offer a DLPack exchange of torch.bool with torch 2\."
    ):
        deps._probe_torch(interop)


def test_declared_lower_bounds_are_the_supported_ones():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for req in project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", req)
        if m:
            declared.setdefault(m.group(1), m.group(2))
    for package, minimum in deps.SUPPORTED.items():
        assert declared[package] == minimum, package


def test_import_onnxgrad_does_not_import_torch_for_the_probe():
    import subprocess

    code = "import sys, onnxgrad.deps as d; print(d.DLPACK_FORM, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [deps.DLPACK_FORM, "False"]


def test_onnx_is_within_range():
    assert deps.version_tuple(onnx.__version__) >= deps.version_tuple(deps.SUPPORTED["onnx"])
    assert deps.version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert deps.version_tuple("1.32.0rc1") == (1, 32, 0)


def test_the_process_exits_after_importing_onnxgrad():
    # onnx 1.19 hung at exit when a schema's Python shape inference outlived the interpreter
    import subprocess

    code = "import onnxgrad; print('imported')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr


@pytest.mark.parametrize("form", ["classmethod", "classmethod_descriptor"])
def test_function_apply_observed_in_both_forms(monkeypatch, form):
    """torch 2.13 defines Function.apply as a Python classmethod, torch 2.14 as a C descriptor."""
    if form == "classmethod_descriptor":
        descriptor = torch._C._FunctionBase.__dict__["apply"]
        assert type(descriptor).__name__ == "classmethod_descriptor"
        monkeypatch.setattr(torch.autograd.Function, "apply", descriptor)
    before = torch.autograd.Function.__dict__["apply"]

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    seen = []
    x = torch.ones(3, requires_grad=True)
    with deps.function_apply_observed(lambda cls, out: seen.append((cls, out.detach().clone()))):
        y = Double.apply(x)
    y.sum().backward()
    assert seen and seen[0][0] is Double and seen[0][1].tolist() == [2.0, 2.0, 2.0]
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    assert torch.autograd.Function.__dict__["apply"] is before  # put back
    Double.apply(x)
    assert len(seen) == 1  # no longer observed


@pytest.mark.parametrize("form", ["classmethod", "classmethod_descriptor"])
def test_function_apply_direct_in_both_forms(monkeypatch, form):
    """torch 2.13's Python ``Function.apply`` is skipped (the C method, bound to the class); where
    ``Function.apply`` is the C method itself (torch 2.14) the class's own ``apply`` is kept."""
    descriptor = torch._C._FunctionBase.__dict__["apply"]
    if form == "classmethod_descriptor":
        monkeypatch.setattr(torch.autograd.Function, "apply", descriptor)
    elif not isinstance(torch.autograd.Function.__dict__.get("apply"), classmethod):

        def layer(cls, *args, **kwargs):  # torch <= 2.13's form on a newer torch: a Python layer
            return descriptor.__get__(None, cls)(*args, **kwargs)

        monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(layer))

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    apply, active = deps.function_apply_direct(Square)
    if form == "classmethod":
        assert apply.__self__ is Square and apply != Square.apply  # the C method, not the Python layer
    else:
        assert apply == Square.apply
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = apply(x)
    y.sum().backward()
    assert y.tolist() == [1.0, 4.0, 9.0] and x.grad.tolist() == [2.0, -4.0, 6.0]
    assert active() is False
    if form == "classmethod":  # a functorch transform is seen as one
        seen = []
        torch.func.vmap(lambda t: seen.append(active()) or t)(torch.ones(2, 3))
        assert seen == [True]
