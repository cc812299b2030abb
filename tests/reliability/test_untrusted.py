"""Untrusted models: absurd sizes, lying initializers, external-data paths, PythonOp classes and
pointer constants are refused with a clear error, quickly, and without reading or importing anything.

The size checks run in a child process whose address space and CPU time are capped: an
out-of-memory kill or a runaway computation shows up there as a failed test, not as a dead session.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.compat import OrtGradientForwardBackward
from onnxgrad.errors import InputError, ModelError, OnnxGradError, PythonOpError
from onnxgrad.model.validate import (
    Limits,
    check_model_safety,
    check_python_ops,
    default_limits,
    load_untrusted,
    python_op_classes,
    safe_to_propagate_data,
)
from onnxgrad.runtime.values import check_input
from tests.models import make_model, mlp
from tests.reliability._util import conv_model, run_isolated, shapes_model

BIG = 1 << 40  # a dimension of 2**40: 4 TiB of float32
CHILD_MEMORY = 3 << 30


def _with_initializer(tensor: TensorProto) -> onnx.ModelProto:
    """y = x * W for an initializer W given as a raw TensorProto."""
    model = make_model(
        [helper.make_node("Mul", ["x", tensor.name], ["y"])],
        [("x", np.float32, [2])],
        [("y", np.float32, ["?"])],
    )
    model.graph.initializer.append(tensor)
    return model


def _tensor(
    dims: list[int], *, raw: bytes | None = b"\0" * 16, floats: list[float] | None = None
) -> TensorProto:
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=dims)
    if floats is not None:
        t.float_data.extend(floats)
    elif raw is not None:
        t.raw_data = raw
    return t


def _constant_of_shape(shape_nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    """c = ConstantOfShape(s) with s computed by ``shape_nodes``; y = x * c."""
    nodes = [
        *shape_nodes,
        helper.make_node(
            "ConstantOfShape", ["s"], ["c"], value=numpy_helper.from_array(np.ones(1, np.float32))
        ),
        helper.make_node("Mul", ["x", "c"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, [1])], [("y", np.float32, ["?"])], inits)


def _declared_input(shape: list[Any]) -> onnx.ModelProto:
    return make_model(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        [("x", np.float32, shape)],
        [("y", np.float32, ["?"] * len(shape))],
        {"W": np.ones(1, np.float32)},
    )


def _if_with_initializer(tensor: TensorProto) -> onnx.ModelProto:
    branch = helper.make_graph([helper.make_node("Identity", [tensor.name], ["o"])], "then", [], [
        helper.make_tensor_value_info("o", TensorProto.FLOAT, None)], initializer=[tensor])  # fmt: skip
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["o2"])], "else", [], [
        helper.make_tensor_value_info("o2", TensorProto.FLOAT, None)])  # fmt: skip
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other)
    return make_model([node], [("cond", np.bool_, []), ("x", np.float32, [2])], [("y", np.float32, None)])


def _sparse(dims: list[int]) -> onnx.ModelProto:
    values = numpy_helper.from_array(np.ones(1, np.float32), "S")
    indices = numpy_helper.from_array(np.array([5], np.int64), "S_indices")
    model = _declared_input([1])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, dims))
    return model


def _one_node(op: str, inputs: list[str], consts: dict[str, np.ndarray], **attrs: Any) -> onnx.ModelProto:
    """y = op(inputs) with constant initializers ``consts`` and a float input x of shape (2, 2)."""
    node = helper.make_node(op, inputs, ["y"], **attrs)
    graph_inputs = [("x", np.float32, [2, 2])] if "x" in inputs else []
    return make_model([node], graph_inputs, [("y", np.float32 if op != "Range" else np.int64, None)], consts)


def _computed_shape() -> onnx.ModelProto:
    """s = Identity([2**20]) * [2**20]: only data propagation knows the ConstantOfShape's shape."""
    nodes = [
        helper.make_node("Constant", [], ["a"], value_ints=[1 << 20]),
        helper.make_node("Identity", ["a"], ["b"]),
        helper.make_node("Mul", ["b", "k"], ["s"]),
    ]
    return _constant_of_shape(nodes, {"k": np.array([1 << 20], np.int64)})


def _shape_of_input() -> onnx.ModelProto:
    """ConstantOfShape(Concat(Shape(x), [2**30])) for x of shape (4096,)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Concat", ["sx", "k"], ["s"], axis=0),
        helper.make_node("ConstantOfShape", ["s"], ["y"]),
    ]
    consts = {"k": np.array([1 << 30], np.int64)}
    return make_model(nodes, [("x", np.float32, [1 << 12])], [("y", np.float32, None)], consts)


TWO_20 = np.array([1 << 20, 1 << 20], np.int64)
ABSURD: dict[str, tuple[Callable[[], onnx.ModelProto], str]] = {
    # case: (model, what the message says)
    "initializer of 2**40 holding 16 bytes": (
        lambda: _with_initializer(_tensor([BIG])),
        r"initializer 'W' declares shape \[1099511627776\] of float32: 4\.0 TiB, over the limit",
    ),
    "initializer of 2**40 holding 3 floats": (
        lambda: _with_initializer(_tensor([BIG], floats=[1, 2, 3])),
        r"initializer 'W' declares shape \[1099511627776\] of float32: 4\.0 TiB",
    ),
    "input declared with a dimension of 2**40": (
        lambda: _declared_input([BIG]),
        r"value 'x' is declared with shape \[1099511627776\] of float32: 4\.0 TiB",
    ),
    "symbolic batch and a dimension of 2**40": (
        lambda: _declared_input(["N", BIG]),
        r"value 'x' is declared with shape \[1099511627776\]",
    ),
    "ConstantOfShape of a constant 2**40": (
        lambda: _constant_of_shape([], {"s": np.array([BIG], np.int64)}),
        r"(value '[cy]' would have|ConstantOfShape node would create a tensor of) shape \[1099511627776\]",
    ),
    "ConstantOfShape of 2**20 * 2**20 computed": (
        _computed_shape,
        r"a ConstantOfShape node would create a tensor of shape \[1099511627776\] of float32",
    ),
    "ConstantOfShape of Shape(x) concatenated with 2**30": (
        _shape_of_input,
        r"ConstantOfShape node would create a tensor of shape \[4096, 1073741824\] of float32: 16\.0 TiB",
    ),
    "Expand to 2**40": (
        lambda: _one_node("Expand", ["x", "s"], {"s": TWO_20}),
        r"shape \[1048576, 1048576\] of float32: 4\.0 TiB",
    ),
    "Tile by 2**20 twice": (
        lambda: _one_node("Tile", ["x", "r"], {"r": TWO_20}),
        r"shape \[2097152, 2097152\] of float32: 16\.0 TiB",
    ),
    "Range from 0 to 2**40": (
        lambda: _one_node("Range", ["a", "b", "d"], {"a": np.array(0), "b": np.array(BIG), "d": np.array(1)}),
        r"shape \[1099511627776\] of int64: 8\.0 TiB",
    ),
    "RandomNormal of 2**20 x 2**20": (
        lambda: _one_node("RandomNormal", [], {}, shape=[1 << 20, 1 << 20]),
        r"RandomNormal node would create a tensor of shape \[1048576, 1048576\] of float32: 4\.0 TiB",
    ),
    "sparse initializer densifying to 4 TiB": (
        lambda: _sparse([1 << 20, 1 << 20]),
        r"sparse initializer 'S' declares shape \[1048576, 1048576\] of float32: 4\.0 TiB",
    ),
    "initializer of 2**40 inside an If branch": (
        lambda: _if_with_initializer(_tensor([BIG])),
        r"initializer 'W' in the 'then_branch' graph of node '' \(If\) declares shape \[1099511627776\]",
    ),
    "Constant attribute of 2**40 holding 16 bytes": (
        lambda: _one_node("Constant", [], {}, value=_tensor([BIG])),
        r"attribute 'value' of a Constant node declares shape \[1099511627776\]",
    ),
}

LYING: dict[str, tuple[Callable[[], onnx.ModelProto], str]] = {
    "raw data too short": (
        lambda: _with_initializer(_tensor([5])),
        r"\(20 bytes\) but the file holds 16 bytes",
    ),
    "raw data too long": (
        lambda: _with_initializer(_tensor([3])),
        r"\(12 bytes\) but the file holds 16 bytes",
    ),
    "float_data too short": (
        lambda: _with_initializer(_tensor([4], floats=[1, 2, 3])),
        r"\(4 float_data values\) but the file holds 3 float_data values",
    ),
    "no data at all": (lambda: _with_initializer(_tensor([4], raw=None)), r"holds 0 float_data values"),
    "negative dimension": (
        lambda: _with_initializer(_tensor([-4])),
        r"declares a negative dimension in shape \[-4\]",
    ),
    "unknown element type": (
        lambda: _with_initializer(TensorProto(name="W", data_type=99, dims=[1], raw_data=b"\0")),
        r"initializer 'W' has an unknown element type \(99\)",
    ),
}


# ---- the validator ---------------------------------------------------------------------------------
ORDINARY = {"mlp64": mlp(), "mlp32": mlp(np.float32), "shapes": shapes_model(), "conv": conv_model()}


@pytest.mark.parametrize("model", list(ORDINARY.values()), ids=list(ORDINARY))
def test_validator_accepts_ordinary_models(model):
    check_model_safety(model)
    assert safe_to_propagate_data(model)


@pytest.mark.parametrize("case", list(ABSURD))
def test_validator_refuses_absurd_sizes(case):
    build, message = ABSURD[case]
    with pytest.raises(ModelError, match=message) as info:
        check_model_safety(build())
    assert "corrupt or hostile" in str(info.value) and "ONNXGRAD_MAX_TENSOR_BYTES" in str(info.value)


@pytest.mark.parametrize("case", list(LYING))
def test_validator_refuses_data_that_does_not_match_its_shape(case):
    build, message = LYING[case]
    with pytest.raises(ModelError, match=message):
        check_model_safety(build())


def test_limits_are_configurable(monkeypatch):
    model = mlp()  # 43 float64 values: 344 bytes
    check_model_safety(model, limits=Limits(max_tensor_bytes=160, max_total_bytes=344))
    with pytest.raises(
        ModelError, match=r"the model stores 344 bytes of tensors, over the limit of 300 bytes"
    ):
        check_model_safety(model, limits=Limits(max_total_bytes=300))
    with pytest.raises(ModelError, match=r"initializer 'W1' declares shape \[4, 5\] of float64: 160 bytes"):
        check_model_safety(model, limits=Limits(max_tensor_bytes=100))
    monkeypatch.setenv("ONNXGRAD_MAX_TENSOR_BYTES", "1e9")
    monkeypatch.setenv("ONNXGRAD_MAX_TOTAL_BYTES", "2000000000")
    assert default_limits() == Limits(max_tensor_bytes=10**9, max_total_bytes=2 * 10**9)
    monkeypatch.setenv("ONNXGRAD_MAX_TOTAL_BYTES", "lots")
    with pytest.raises(InputError, match=r"ONNXGRAD_MAX_TOTAL_BYTES='lots' is not a number of bytes"):
        default_limits()
    monkeypatch.delenv("ONNXGRAD_MAX_TENSOR_BYTES")
    monkeypatch.delenv("ONNXGRAD_MAX_TOTAL_BYTES")
    assert default_limits().max_tensor_bytes <= 16 << 30


def test_validator_refuses_text_that_is_not_utf8():
    data = bytearray(mlp().SerializeToString())
    data[data.find(b"\x12\x04test") + 2] = 0xFF  # the first byte of the graph's name
    with pytest.raises(ModelError, match=r"model\.graph\.name is not valid UTF-8 text"):
        check_model_safety(onnx.load_from_string(bytes(data)))


def test_onnx_data_propagation_cost_is_detected():
    assert not safe_to_propagate_data(_declared_input([1 << 21]))
    assert safe_to_propagate_data(_declared_input([4096]))
    assert safe_to_propagate_data(_declared_input(["N", 1 << 21]))  # only 1-D values cost
    bias = make_model(
        [helper.make_node("Add", ["x", "b"], ["y"])],
        [("x", np.float32, ["N", 1 << 21])],
        [("y", np.float32, ["N", 1 << 21])],
        {"b": np.zeros(1 << 21, np.float32)},
    )
    assert safe_to_propagate_data(bias)  # onnx reads no values from float initializers
    indices = make_model(
        [helper.make_node("Gather", ["x", "i"], ["y"])],
        [("x", np.float32, [4])],
        [("y", np.float32, ["M"])],
        {"i": np.zeros(1 << 21, np.int64)},
    )
    assert not safe_to_propagate_data(indices)  # 2**21 integer values: onnx propagates them


def test_deprecated_validate_module_warns_and_gives_the_same_checks():
    import importlib
    import sys

    sys.modules.pop("onnxgrad.validate", None)
    with pytest.warns(DeprecationWarning, match=r"^onnxgrad\.validate is deprecated: import Limits"):
        old = importlib.import_module("onnxgrad.validate")
    assert old.load_untrusted is onnxgrad.model.load_untrusted
    assert old.Limits is onnxgrad.model.Limits


def test_check_input_messages():
    info = onnxgrad.ForwardBackward(mlp())._runner.inputs["x"]
    check_input("x", "float64", (7, 4), info)
    check_input("x", "float32", (7, 4), info)  # cast at the door (the input contract)
    with pytest.raises(InputError, match=r"input 'x' has dtype complex64, the model expects float64"):
        check_input("x", "complex64", (7, 4), info)
    with pytest.raises(
        InputError, match=r"input 'x' has shape \(7, 5\), the model expects \(N, 4\) \(dimension 1"
    ):
        check_input("x", "float64", (7, 5), info)
    with pytest.raises(InputError, match=r"input 'x' has rank 1 \(shape \(4,\)\), the model expects rank 2"):
        check_input("x", "float64", (4,), info)


# ---- the size checks at the entry points, in a child with little memory and CPU time ----------------------
_CHILD = """
import resource, numpy as np, onnx
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu} + 1))  # a runaway computation is killed
import onnxgrad
from onnxgrad.compat import OrtGradientForwardBackward
from onnxgrad.errors import ModelError
model = onnx.load_from_string({data!r})
for name, build in [
    ("build_gradient", lambda: onnxgrad.build_gradient(model)),
    ("ForwardBackward", lambda: onnxgrad.ForwardBackward(model)),
    ("gradients", lambda: onnxgrad.gradients(model, {{}})),
    ("OrtGradientForwardBackward", lambda: OrtGradientForwardBackward(model)),
]:
    try:
        build()
        print(name, "accepted the model")
    except ModelError as exc:
        print(name, "ModelError", str(exc).replace(chr(10), " "))
"""


def _entry_points_in_a_child(model: onnx.ModelProto, cpu: int = 8) -> str:
    """What each entry point does with ``model`` in a child capped at 3 GiB and ``cpu`` seconds."""
    result = run_isolated(
        _CHILD.format(data=model.SerializeToString(), cpu=cpu), timeout=300, max_bytes=CHILD_MEMORY
    )
    assert not result.timed_out and not result.crashed, (
        f"the child was killed ({result.returncode}): out of memory or CPU time\n{result.stderr[-2000:]}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_entry_points_refuse_a_huge_initializer_in_a_small_file_quickly():
    out = _entry_points_in_a_child(_with_initializer(_tensor([BIG])))
    assert out.count("ModelError") == 4, out
    assert out.count("4398046511104 bytes") == 4 or out.count("4.0 TiB") == 4, out


def test_entry_points_refuse_absurd_declared_shapes_quickly():
    out = _entry_points_in_a_child(_declared_input([BIG]))
    assert out.count("ModelError value 'x' is declared with shape [1099511627776]") == 4, out
    out = _entry_points_in_a_child(_constant_of_shape([], {"s": np.array([BIG], np.int64)}))
    assert out.count("shape [1099511627776]") == 4, out


def test_build_gradient_memory_does_not_grow_with_declared_1d_sizes():
    model = make_model(
        [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [("x", np.float32, [1 << 21])],  # 8 MiB: an ordinary size
        [("y", np.float32, ["?"])],
        {"w": np.ones(1, np.float32)},
    )
    code = f"""
import onnx, onnxgrad
def kib(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
model = onnx.load_from_string({model.SerializeToString()!r})
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from the current size
before = kib("VmRSS")
onnxgrad.build_gradient(model)
print((kib("VmHWM") - before) // 1024)
"""
    result = run_isolated(code, timeout=300, max_bytes=CHILD_MEMORY)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) < 64, f"building the gradient took {result.stdout.strip()} MB more memory"


def test_entry_points_apply_the_configured_limits(monkeypatch):
    monkeypatch.setenv("ONNXGRAD_MAX_TOTAL_BYTES", "300")
    with pytest.raises(ModelError, match=r"over the limit of 300 bytes"):
        onnxgrad.build_gradient(mlp())


# ---- external data ------------------------------------------------------------------------------------
@pytest.fixture
def folders(tmp_path):
    """A model folder with its weights file, and a secret file next to the folder."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (tmp_path / "secret.bin").write_bytes(np.full(4, 42, np.float32).tobytes())
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    (folder / "inner.bin").symlink_to(folder / "weights.bin")
    return folder


def _external_model(folder: Any, location: str, **keys: int) -> str:
    """Save y = x * W with W in external data at ``location``; return the model path."""
    tensor = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in {"location": location, **{k: str(v) for k, v in keys.items()}}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    model = make_model(
        [helper.make_node("Mul", ["x", "W"], ["y"])], [("x", np.float32, [4])], [("y", np.float32, [4])]
    )
    model.graph.initializer.append(tensor)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return str(path)


TRAVERSALS = {
    "parent": ("../secret.bin", r"points outside the"),
    "nested parent": ("sub/../../secret.bin", r"points outside the"),
    "absolute": ("{tmp}/secret.bin", r"absolute path"),
    "symlink out": ("link.bin", r"symbolic link"),
    "symlink in": ("inner.bin", r"symbolic link"),
}


def test_external_data_is_read_from_the_model_folder(folders):
    model = load_untrusted(_external_model(folders, "weights.bin"))
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), np.arange(4))
    fb = onnxgrad.ForwardBackward(_external_model(folders, "weights.bin"))
    np.testing.assert_array_equal(fb.parameters["W"], np.arange(4))


@pytest.mark.parametrize("case", list(TRAVERSALS))
def test_validator_refuses_external_data_outside_the_folder(folders, case):
    location, message = TRAVERSALS[case]
    path = _external_model(folders, location.format(tmp=folders.parent))
    with pytest.raises(ModelError, match=message):
        load_untrusted(path)


@pytest.mark.parametrize("case", list(TRAVERSALS))
@pytest.mark.parametrize(
    "entry", ["build_gradient", "ForwardBackward", "OnnxModule", "OrtGradientForwardBackward"]
)
def test_entry_points_refuse_external_data_outside_the_folder(folders, case, entry):
    location, message = TRAVERSALS[case]
    path = _external_model(folders, location.format(tmp=folders.parent))
    with pytest.raises(ModelError, match=message):
        _load(entry, path)


def test_validator_refuses_bad_external_data_records(folders):
    for keys, message in [
        ({"offset": 8}, r"needs 16 bytes at offset 8 of 'weights.bin', which has 16 bytes"),
        ({"length": 8}, r"declares 16 bytes but its external data says offset 0, length 8"),
    ]:
        with pytest.raises(ModelError, match=message):
            load_untrusted(_external_model(folders, "weights.bin", **keys))
    with pytest.raises(ModelError, match=r"'absent.bin', which does not exist"):
        load_untrusted(_external_model(folders, "absent.bin"))
    with open(_external_model(folders, "weights.bin"), "rb") as f:
        data = f.read()
    with pytest.raises(ModelError, match=r"the model was not given as a path"):
        load_untrusted(data)  # bytes have no folder: external data cannot be located safely


# ---- PythonOp -----------------------------------------------------------------------------------------
def _python_op_model(cls: str, *, spelling: str = "func_name", **attrs: Any) -> onnx.ModelProto:
    types = {"input_tensor_types": [TensorProto.FLOAT], "output_tensor_types": [TensorProto.FLOAT]}
    ranks = {"input_tensor_ranks": [1], "output_tensor_ranks": [1]}
    attrs = {"training_mode": 1, "input_requires_grads": [1], "output_tensor_requires_grads": [1], **attrs}
    node = helper.make_node(
        "PythonOp", ["x"], ["ctx", "y"], name="custom", domain="com.microsoft", input_convention="d",
        **types, **ranks, **attrs,
    )  # fmt: skip
    node.attribute.append(helper.make_attribute(spelling, cls))  # `name` would clash with make_node's
    model = make_model(
        [node, helper.make_node("Mul", ["y", "W"], ["z"])],
        [("x", np.float32, [2])],
        [("z", np.float32, [2])],
        {"W": np.ones(2, np.float32)},
    )
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_validator_lists_and_checks_python_op_classes():
    model = _python_op_model("pkg.mod.Fn")
    old = _python_op_model("OldFn", spelling="name")
    assert python_op_classes(model) == ["pkg.mod.Fn"] and python_op_classes(old) == ["OldFn"]
    check_python_ops(model, {"pkg.mod.Fn"})
    check_python_ops(model, lambda name: name.startswith("pkg."))
    with pytest.raises(
        PythonOpError, match=r"names the Function class 'pkg.mod.Fn', which is not registered"
    ):
        check_python_ops(model, set())
    with pytest.raises(PythonOpError, match=r"onnxgrad.register_function\(cls\)"):
        check_model_safety(old, allowed_functions={"pkg.mod.Fn"})


def test_validator_refuses_pointer_constants():
    model = _python_op_model(
        "pkg.Fn", input_pointer_scalars=[0x7F3A5C001230], input_pointer_scalar_positions=[1]
    )
    with pytest.raises(
        ModelError, match=r"PythonOp node 'custom' \(class 'pkg.Fn'\) has input_pointer_scalars"
    ):
        check_model_safety(model)


@pytest.fixture
def payload(tmp_path, monkeypatch):
    """An importable module that leaves a marker file when imported, and the class name it defines."""
    name = f"onnxgrad_payload_{os.getpid()}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass Payload:\n    pass\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}.Payload", marker
    sys.modules.pop(name, None)


ENTRY_POINTS = ["build_gradient", "ForwardBackward", "gradients", "OnnxModule", "OrtGradientForwardBackward"]


def _load(entry: str, model: Any) -> Any:
    """Load ``model`` with ``entry`` and, where that alone builds nothing, run one training step."""
    if entry == "build_gradient":
        return onnxgrad.build_gradient(model)
    if entry == "ForwardBackward":
        return onnxgrad.ForwardBackward(model).forward({"x": np.ones(2, np.float32)}).backward()
    if entry == "gradients":
        return onnxgrad.gradients(model, {"x": np.ones(2, np.float32)})
    if entry == "OrtGradientForwardBackward":
        return OrtGradientForwardBackward(model)
    torch = pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    module = OnnxModule(model)
    return module(torch.ones(2, requires_grad=True))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_model_naming_a_class_imports_nothing(payload, entry):
    cls, marker = payload
    with contextlib.suppress(OnnxGradError):  # failing is right; importing the module is not
        _load(entry, _python_op_model(cls))
    assert not marker.exists() and cls.split(".")[0] not in sys.modules


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e != "build_gradient"])  # it runs nothing
def test_an_unregistered_python_op_class_fails_before_running_naming_it(payload, entry):
    cls, marker = payload
    with pytest.raises(PythonOpError, match=rf"'{re.escape(cls)}'.*registered"):
        _load(entry, _python_op_model(cls))
    assert not marker.exists()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_points_refuse_pointer_constants(entry):
    model = _python_op_model(
        "pkg.Fn", input_pointer_scalars=[0x7F3A5C001230], input_pointer_scalar_positions=[1]
    )
    with pytest.raises(ModelError, match=r"input_pointer_scalars"):
        _load(entry, model)
