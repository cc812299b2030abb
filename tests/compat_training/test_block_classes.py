"""The elementwise blocks of ``onnxblock.blocks`` made from one pattern (binary and unary ops):
real classes of that module, each appending its own ONNX op and computing it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgrad.compat.training import onnxblock
from onnxgrad.compat.training.onnxblock import blocks
from onnxgrad.errors import InputError

BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}
UNARY = {"Sigmoid": lambda x: 1 / (1 + np.exp(-x)), "Neg": np.negative, "Exp": np.exp, "Tanh": np.tanh}


class _Forward(onnxblock.ForwardBlock):
    def __init__(self, block: blocks.Block) -> None:
        super().__init__()
        self._block = block

    def build(self, *names: str) -> str:
        return self._block(*names)


def _run(block: blocks.Block, *arrays: np.ndarray) -> tuple[onnx.ModelProto, np.ndarray]:
    names = [f"x{i}" for i in range(len(arrays))]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in names]
    base = helper.make_model(
        helper.make_graph([], "empty", inputs, []), opset_imports=[helper.make_opsetid("", 17)], ir_version=8
    )
    fwd = _Forward(block)
    with onnxblock.base(base):
        out = fwd(*names)
    model = fwd.to_model_proto()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return model, session.run([out], dict(zip(names, arrays)))[0]


@pytest.mark.parametrize("name", [*BINARY, *UNARY, "Relu", "Sqrt", "Log", "Abs", "Softmax"])
def test_classes_belong_to_the_blocks_module(name):
    cls = getattr(blocks, name)
    assert isinstance(cls, type) and issubclass(cls, blocks.Block)
    assert (cls.__module__, cls.__qualname__) == (blocks.__name__, name)
    assert cls.__doc__ and name in blocks.__all__


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_blocks(name):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 2, 3)).astype(np.float32)
    model, y = _run(getattr(blocks, name)(), a, b)
    assert [n.op_type for n in model.graph.node] == [name]
    np.testing.assert_allclose(y, BINARY[name](a, b), rtol=1e-6)


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_blocks(name):
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    model, y = _run(getattr(blocks, name)(), x)
    assert [n.op_type for n in model.graph.node] == [name]
    np.testing.assert_allclose(y, UNARY[name](x), rtol=1e-6, atol=1e-7)


def test_a_block_that_breaks_the_model_is_refused():
    class Broken(blocks.Block):
        def build(self, name: str) -> str:
            self.base.graph.node.append(helper.make_node("Add", [name], ["y"]))  # Add needs two inputs
            return "y"

    base = helper.make_model(
        helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], []),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    with onnxblock.base(base), pytest.raises(InputError, match="block Broken made an invalid model"):
        Broken()("x")
