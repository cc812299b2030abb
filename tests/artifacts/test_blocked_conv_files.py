"""Sessions made from a file (the artifacts folder's one-graph step) run Convs fed their weight on
onnxruntime's blocked (NCHWc) kernels too, with the losses of the generic kernels."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad.runtime.runner as runner_module
from onnxgrad.artifacts import Runner, generate
from onnxgrad.demo import build_cnn
from onnxgrad.runtime.blocked_conv import NCHWC, block_size
from onnxgrad.runtime.runner import default_options, make_session
from onnxgrad.storage import save_model

CPU = ["CPUExecutionProvider"]
EPS32 = float(np.finfo(np.float32).eps)
needs_blocks = pytest.mark.skipif(block_size() == 0, reason="this CPU has no onnxruntime NCHWc kernels")
STEPS, BATCH, SIDE = 4, 8, 8


def _ops(path: str) -> set[tuple[str, str]]:
    """(domain, op type) of the nodes of the graph onnxruntime optimized and saved at ``path``."""
    return {(n.domain, n.op_type) for n in onnx.load(path).graph.node}


def _sgd_losses(folder: str, batch: dict[str, np.ndarray], optimized: str | None = None) -> list[float]:
    options = default_options()
    if optimized is not None:
        options.optimized_model_filepath = optimized
    runner = Runner(folder, lr=0.1, session_options=options)
    return [float(runner.step(batch)) for _ in range(STEPS)]


@needs_blocks
def test_the_one_graph_step_of_an_artifacts_folder_runs_the_blocked_convs(tmp_path, monkeypatch) -> None:
    """The artifacts Runner hands make_session the step file's path: the session holds onnxruntime's
    NCHWc Conv (without the path branch, only the generic Conv), and a few SGD steps give the
    losses of the generic kernels up to float32 rounding.

    Tolerance: each Conv result is a sum of C k^2 products (forward 1*9 and 4*9, the input
    gradient of the second 8*9: 117 terms in all), each rounding to at most terms * eps relative
    in either order; the loss of step s carries the differences of s forwards and backwards
    (the updates lr * grad change it by no more than they do), so 4 * STEPS * 117 * eps relative
    (about 2e-4), orders of magnitude below what a wrong layout gives."""
    rng = np.random.default_rng(0)
    generate(build_cnn(rng, side=SIDE, classes=4), loss="cross_entropy", optimizer="sgd", out_dir=tmp_path)
    batch = {
        "pixels": rng.random((BATCH, 1, SIDE, SIDE), dtype=np.float32),
        "target": rng.integers(0, 4, BATCH),
    }
    blocked = _sgd_losses(str(tmp_path), batch, os.path.join(tmp_path, "optimized.onnx"))
    ops = _ops(os.path.join(tmp_path, "optimized.onnx"))
    assert (NCHWC, "Conv") in ops and (NCHWC, "ReorderOutput") in ops
    assert blocked[-1] < blocked[0]  # it trains

    monkeypatch.setattr(runner_module, "blocked_convs", lambda model, providers, shapes_from=None: model)
    generic = _sgd_losses(str(tmp_path), batch, os.path.join(tmp_path, "generic.onnx"))
    assert (NCHWC, "Conv") not in _ops(os.path.join(tmp_path, "generic.onnx"))
    terms = 9 + 4 * 9 + 8 * 9
    np.testing.assert_allclose(blocked, generic, rtol=4 * STEPS * terms * EPS32, atol=0)


def _external_conv(tmp_path) -> tuple[onnx.ModelProto, str, dict[str, np.ndarray]]:
    """A Conv (one block of channels, weight fed) whose bias is external data: the model, the path
    of its file, feeds."""
    c = block_size()
    bias = numpy_helper.from_array(np.linspace(-1, 1, c, dtype=np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
        "conv",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 6, 6]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [c, c, 3, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = save_model(model, os.path.join(tmp_path, "conv.onnx"), external_data=True, size_threshold=0)
    assert os.path.exists(path + ".data")
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, c, 6, 6), dtype=np.float32)}
    feeds["w"] = rng.standard_normal((c, c, 3, 3), dtype=np.float32)
    return model, path, feeds


@needs_blocks
def test_a_file_with_external_data_is_read_whole_only_when_a_conv_is_rewritten(tmp_path, monkeypatch) -> None:
    """A Conv model whose bias is external data: the session from its path runs the blocked Conv
    with the proto's results (the data read from the file's folder); a model without a Conv that
    can be rewritten is handed to onnxruntime as its path, its external data never read here."""
    model, path, feeds = _external_conv(tmp_path)
    options = default_options()
    options.optimized_model_filepath = os.path.join(tmp_path, "optimized.onnx")
    got = make_session(path, CPU, options).run(None, feeds)[0]
    assert (NCHWC, "Conv") in _ops(options.optimized_model_filepath)
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)[0]
    terms = feeds["x"].shape[1] * 9  # as in tests/runtime/test_blocked_conv.py: sums of C k^2 products
    bound = terms * EPS32 * np.abs(feeds["x"]).max() * np.abs(feeds["w"]).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)

    reads: list[object] = []  # (a raise would be taken for an unreadable file: recorded instead)
    monkeypatch.setattr(runner_module, "load_external_data_for_model", lambda *args: reads.append(args))
    dilated = onnx.load(path, load_external_data=False)
    dilated.graph.node[0].attribute.append(helper.make_attribute("dilations", [2, 2]))
    dilated_path = os.path.join(tmp_path, "dilated.onnx")
    onnx.save(dilated, dilated_path)  # its bias still points at conv.onnx.data
    make_session(dilated_path, CPU).run(None, feeds)
    assert reads == []


@needs_blocks
def test_a_file_over_one_protobuf_runs_as_it_is(tmp_path, monkeypatch) -> None:
    """Where the file's tensors would not fit in one protobuf (the limit lowered here to 0 bytes),
    the file goes to onnxruntime by its path, unrewritten: the generic Conv, the same results."""
    model, path, feeds = _external_conv(tmp_path)
    monkeypatch.setattr(runner_module, "PROTOBUF_LIMIT", 0)
    options = default_options()
    options.optimized_model_filepath = os.path.join(tmp_path, "optimized.onnx")
    got = make_session(path, CPU, options).run(None, feeds)[0]
    assert (NCHWC, "Conv") not in _ops(options.optimized_model_filepath)
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)  # the same kernel on the same data
