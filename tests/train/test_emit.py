"""The shared graph emitter (onnxgrad.model.emit): fresh names, constants, axes by opset; the old
private name in train.losses still imports."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxgrad.model.emit import Emitter


def _graph() -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Identity", ["x"], ["loss/sub"], name="loss/Sub")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [],
    )


def test_names_are_fresh_and_axes_follow_the_opset():
    for opset, as_input in ((12, False), (13, True)):
        g = _graph()
        e = Emitter(g, opset, TensorProto.FLOAT, "loss")
        d = e.op("Sub", "x", e.const(1.0))
        assert d != "loss/sub" and e.fresh("sub") not in {"loss/sub", d}  # taken names are skipped
        s = e.axes_op("ReduceSum", d, [1], keepdims=0)
        node = g.node[-1]
        assert node.op_type == "ReduceSum" and (len(node.input) == 2) == as_input
        assert [a.name for a in node.attribute if a.name == "axes"] == ([] if as_input else ["axes"])
        g.output.append(helper.make_tensor_value_info(s, TensorProto.FLOAT, [2]))
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
        onnx.checker.check_model(model, full_check=True)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], (x - 1).sum(axis=1))


def test_the_old_private_name_still_imports():
    from onnxgrad.train.losses import _Emitter

    assert _Emitter is Emitter
