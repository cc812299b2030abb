"""Convolutions fed their weight run on onnxruntime's blocked (NCHWc) kernels, with the same results."""

from __future__ import annotations

import copy
import io
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.runtime.blocked_conv import NCHWC, _agrees, block_size, blocked_convs, native_block_size
from onnxgrad.runtime.runner import default_options, make_session

CPU = ["CPUExecutionProvider"]
EPS32 = float(np.finfo(np.float32).eps)
needs_blocks = pytest.mark.skipif(
    native_block_size() == 0, reason="this CPU has no onnxruntime NCHWc kernels"
)


def _conv_model(
    nodes: list, inputs: dict[str, tuple[int, ...]], inits: list | None = None
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "convs",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(s)) for k, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits or [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _nchwc_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.domain == NCHWC]


@needs_blocks
def test_session_runs_the_blocked_conv_kernel(tmp_path) -> None:
    """The session made for a Conv whose weight is an input holds onnxruntime's NCHWc Conv (without
    the rewrite its optimizer keeps the generic Conv: it blocks only constant weights)."""
    model = _conv_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        {"x": (2, 16, 8, 8), "w": (16, 16, 3, 3)},
    )
    options = default_options()
    options.optimized_model_filepath = os.path.join(tmp_path, "optimized.onnx")
    make_session(model, CPU, options)
    ops = [(n.domain, n.op_type) for n in onnx.load(options.optimized_model_filepath).graph.node]
    assert (NCHWC, "Conv") in ops
    assert ("", "Conv") not in ops and ("com.microsoft", "FusedConv") not in ops


@needs_blocks
@pytest.mark.parametrize("pads", [[1, 1, 1, 1], [0, 2, 2, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("channels", ["blocks", "nchw input", "padded outputs"])
def test_conv_and_conv_transpose_agree_with_the_generic_kernels(pads: list[int], channels: str) -> None:
    """Conv(x, w, b) and a stride-1 ConvTranspose(dy, w, b) (the input gradient's form), the weight
    fed at run time, inputs in whole blocks or fewer channels than a block (read as NCHW), outputs
    padded to whole blocks: the blocked form's results are the generic kernels' up to float32
    rounding of sums of C k^2 products."""
    rng = np.random.default_rng(0)
    block = block_size()
    c_in, c_out = {"blocks": (2 * block, block), "nchw input": (3, block), "padded outputs": (block, 6)}[
        channels
    ]
    x = rng.standard_normal((2, c_in, 7, 9), dtype=np.float32)
    w = rng.standard_normal((c_out, c_in, 3, 3), dtype=np.float32)
    b = rng.standard_normal(c_out, dtype=np.float32)
    wt = rng.standard_normal((c_in, c_out, 3, 3), dtype=np.float32)  # ConvTranspose: (C of dy, C out)
    for node, feeds in (
        (helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=pads), {"x": x, "w": w, "b": b}),
        (helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], pads=pads), {"x": x, "w": wt, "b": b}),
    ):
        model = _conv_model([node], {k: v.shape for k, v in feeds.items()})
        before = copy.deepcopy(model)
        blocked = blocked_convs(model, CPU)
        assert model == before  # never modified in place
        ops = _nchwc_ops(blocked)
        assert ops[-2:] == ["Conv", "ReorderOutput"] and ("ReorderInput" in ops) == (c_in % block == 0)
        generic = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)[0]
        got = make_session(model, CPU).run(None, feeds)[0]
        assert got.shape == generic.shape
        terms = c_in * 9  # each result a sum of these many products, each at most |x|max |w|max
        bound = terms * EPS32 * np.abs(x).max() * np.abs(feeds["w"]).max()
        np.testing.assert_allclose(got, generic, rtol=0, atol=bound)


@needs_blocks
def test_a_layout_for_another_block_is_refused() -> None:
    """The once-per-process check of the blocked form on random data passes for this CPU's block
    and fails for another: a weight layout that does not match the kernels is never used."""
    assert _agrees(block_size())
    assert not _agrees(8 if block_size() == 16 else 16)


def test_convs_the_blocked_kernels_do_not_take_are_left_alone() -> None:
    """Grouped, dilated, strided-transposed, constant-weight Convs, channel counts off the block,
    other providers: the same model object comes back."""
    block = max(block_size(), 8)
    c = 2 * block
    w = (c, c, 3, 3)
    cases = [
        (helper.make_node("Conv", ["x", "w"], ["y"], group=2), {"x": (1, c, 8, 8), "w": (c, block, 3, 3)}),
        (helper.make_node("Conv", ["x", "w"], ["y"], dilations=[2, 2]), {"x": (1, c, 8, 8), "w": w}),
        (helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER"), {"x": (1, c, 8, 8), "w": w}),
        (helper.make_node("Conv", ["x", "w"], ["y"]), {"x": (1, c + 1, 8, 8), "w": (c, c + 1, 3, 3)}),
        (helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2]), {"x": (1, c, 8, 8), "w": w}),
        (helper.make_node("Conv", ["x", "w"], ["y"]), {"x": (1, c, 8, 8), "w": ("o", c, 3, 3)}),
    ]
    for node, inputs in cases:
        model = _conv_model([node], inputs)
        assert blocked_convs(model, CPU) is model, node
    weight = numpy_helper.from_array(np.zeros(w, np.float32), "w")
    constant = _conv_model([helper.make_node("Conv", ["x", "w"], ["y"])], {"x": (1, c, 8, 8)}, [weight])
    assert blocked_convs(constant, CPU) is constant  # onnxruntime blocks constant weights itself
    fed = _conv_model([helper.make_node("Conv", ["x", "w"], ["y"])], {"x": (1, c, 8, 8), "w": w})
    assert blocked_convs(fed, ["CUDAExecutionProvider", "CPUExecutionProvider"]) is fed


class _Convs(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(c, c, 3, padding=1)
        self.b = torch.nn.Conv2d(c, 2 * c, 3, padding=1)
        self.c = torch.nn.Conv2d(2 * c, c, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@needs_blocks
def test_gradients_match_torch_float64() -> None:
    """Forward and backward sessions of a stack of 3x3 Convs (blocked Convs in the forward, blocked
    input gradients in the backward) give torch's float64 gradients up to float32 rounding."""
    torch.manual_seed(0)
    c = block_size()
    module = _Convs(c)
    x = torch.randn(2, c, 8, 8)
    buf = io.BytesIO()
    torch.onnx.export(
        module, (x,), buf, opset_version=17, dynamo=False, input_names=["input"], output_names=["output"]
    )
    model = onnx.load_from_string(buf.getvalue())
    model.ir_version = min(model.ir_version, 10)
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["input"])
    assert len(_nchwc_ops(blocked_convs(fb.graphs.backward, CPU, shapes_from=fb.graphs.forward))) == 2 * 3
    md, xd = copy.deepcopy(module).double(), x.double().requires_grad_(True)
    out = md(xd)
    dy = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out.backward(dy)
    grads = fb.forward({"input": x.numpy()}).backward({"output": dy.float().numpy()})
    ref = {"input": xd.grad, **{k: p.grad for k, p in md.named_parameters()}}
    terms = 2 * c * 9 * 2 * 8 * 8  # the longest sums: a weight gradient over batch and positions
    for name, r in ref.items():
        r = r.numpy()
        assert np.abs(grads[name] - r).max() <= terms * EPS32 * np.abs(r).max(), name
