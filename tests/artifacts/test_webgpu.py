"""generate(targets=["onnxruntime-web-webgpu"]): steps in the forms onnxruntime-web's WebGPU provider
runs on the GPU (no 1-D MatMul operand, no MaxPool Indices nor MaxUnpool, no LogSoftmax, float32
optimizer scalars), with the losses of the default step on onnxruntime. The browser run itself is
examples/web/test-web.mjs (make test-web)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.artifacts import Runner, generate
from onnxgrad.artifacts.webgpu import WEBGPU, lower_for_webgpu
from onnxgrad.demo import build_cnn, build_mlp
from onnxgrad.errors import InputError
from onnxgrad.model.infer import infer_value_infos
from onnxgrad.testing import assert_allclose_scaled

WEBGPU_TARGETS = [WEBGPU]


def _batches(kind: str, steps: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    shape = (32, 64) if kind == "mlp" else (32, 1, 8, 8)
    return [
        {"pixels": rng.random(shape, dtype=np.float32), "target": rng.integers(0, 10, 32).astype(np.int64)}
        for _ in range(steps)
    ]


def _model(kind: str) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    return build_mlp((64, 32, 10), rng) if kind == "mlp" else build_cnn(rng)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_webgpu_step_forms(kind):
    art = generate(_model(kind), loss="cross_entropy", optimizer="adamw", targets=WEBGPU_TARGETS)
    default = generate(_model(kind), loss="cross_entropy", optimizer="adamw")
    step = art.train_step
    infos = infer_value_infos(step)
    ops = [n.op_type for n in step.graph.node]
    for n in step.graph.node:
        if n.op_type == "MatMul":
            assert all(len(infos[i].shape) >= 2 for i in n.input), n.name
    assert "LogSoftmax" not in ops and "MaxUnpool" not in ops and "ConstantOfShape" not in ops
    assert all(len([o for o in n.output if o]) == 1 for n in step.graph.node if n.op_type == "MaxPool")
    doubles = sorted({o for n in step.graph.node for o in n.output if infos[o].dtype == TensorProto.DOUBLE})
    assert doubles == []  # only the lr input is double; the Cast that reads it gives float
    # the default step keeps the CPU's fastest forms: ones @ dY, MaxPool Indices, double scalars
    default_ops = [n.op_type for n in default.train_step.graph.node]
    assert "LogSoftmax" in default_ops
    if kind == "cnn":
        assert "MaxUnpool" in default_ops
        # the CPU step finds each window's argmax with a forward ArgMax (its MaxPools have no
        # Indices); WebGPU's form recomputes it from X and Y, the ArgMax is gone
        assert "ArgMax" in default_ops and "ArgMax" not in ops

        def grouped(m: onnx.ModelProto) -> list[str]:
            return [
                n.name
                for n in m.graph.node
                if n.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in n.attribute)
            ]

        # conv2's weight gradient unfolds its 4 channels with a grouped one-hot Conv on the CPU;
        # WebGPU's grouped Conv computes that wrongly: the target folds the groups into the batch
        assert len(grouped(default.train_step)) == 1
        assert grouped(step) == []
        # conv1's (one channel) is a 3-D Conv of depth 1 on the CPU; WebGPU has no 3-D Conv
        default_infos = infer_value_infos(default.train_step)

        def conv_ranks(m: onnx.ModelProto, known: dict) -> list[int]:
            return sorted(len(known[n.input[0]].shape) for n in m.graph.node if n.op_type == "Conv")

        assert 5 in conv_ranks(default.train_step, default_infos)
        assert set(conv_ranks(step, infos)) == {4}
    for m in (art.eval_step, art.inference):
        assert "LogSoftmax" not in [n.op_type for n in m.graph.node]
    assert art.manifest["lr"]["dtype"] == "float64"  # the interface is the same for every target


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_webgpu_step_gives_the_default_losses(kind, tmp_path):
    default = generate(
        _model(kind), loss="cross_entropy", optimizer="adamw", lr=1e-2, out_dir=tmp_path / "cpu"
    )
    generate(_model(kind), loss="cross_entropy", optimizer="adamw", lr=1e-2, out_dir=tmp_path / "gpu",
             targets=WEBGPU_TARGETS)  # fmt: skip
    assert default.manifest["parameters"]
    a, b = Runner(tmp_path / "cpu", threads=1), Runner(tmp_path / "gpu", threads=1)
    batches = _batches(kind, 30)
    ref = np.array([a.step(x) for x in batches])
    got = np.array([b.step(x) for x in batches])
    assert ref[-1] < ref[0]
    assert_allclose_scaled(got, ref, rtol=1e-5)
    trained = b.state_dict()
    for name, value in a.state_dict().items():
        assert_allclose_scaled(trained[name], value, rtol=1e-4, err_msg=name)


def _sgd_grad(model: onnx.ModelProto, targets, batch) -> np.ndarray:
    """The gradient of the parameter ``p`` after one SGD step with lr 1: p - next p."""
    art = generate(model, loss=None, optimizer="sgd", targets=targets, lr=1.0)
    sess = ort.InferenceSession(art.train_step.SerializeToString(), providers=["CPUExecutionProvider"])
    p = art.state["p"]
    feeds = {**batch, "lr": np.array(1.0), "step": np.array(0, np.int64), "p": p}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return p.astype(np.float64) - out["next/p"]


def _pool_model(p: np.ndarray, kernel: list[int], strides: list[int]) -> onnx.ModelProto:
    """loss = sum(MaxPool(p) * w): dL/dp is w at each window's argmax."""
    nodes = [
        helper.make_node("MaxPool", ["p"], ["y"], kernel_shape=kernel, strides=strides),
        helper.make_node("Mul", ["y", "w"], ["yw"]),
        helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "pool", [helper.make_tensor_value_info("w", TensorProto.FLOAT, ["N", "C", "H", "W"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(p, "p")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _first_argmax_grad(p: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """numpy: each k x k window (stride k) sends w to its first maximum in row-major order."""
    grad = np.zeros(p.shape)
    n, c, h, wd = p.shape
    for b in range(n):
        for ch in range(c):
            for i in range(h // k):
                for j in range(wd // k):
                    win = p[b, ch, i * k : i * k + k, j * k : j * k + k]
                    r, s = np.unravel_index(np.argmax(win), win.shape)
                    grad[b, ch, i * k + r, j * k + s] += w[b, ch, i, j]
    return grad


@pytest.mark.parametrize("size", [6, 7])  # 7: the last row and column belong to no window
def test_max_pool_gradient_without_indices(size):
    rng = np.random.default_rng(0)
    p = rng.integers(0, 3, (2, 3, size, size)).astype(np.float32)  # many ties within windows
    w = rng.standard_normal((2, 3, size // 2, size // 2)).astype(np.float32)
    model = _pool_model(p, [2, 2], [2, 2])
    webgpu = _sgd_grad(model, WEBGPU_TARGETS, {"w": w})
    indices = _sgd_grad(model, ["onnxruntime"], {"w": w})
    expected = _first_argmax_grad(p.astype(np.float64), w.astype(np.float64), 2)
    assert_allclose_scaled(indices, expected, rtol=1e-6)  # onnxruntime's Indices: the first maximum
    assert_allclose_scaled(webgpu, expected, rtol=1e-6)
    assert np.count_nonzero(webgpu) == w.size  # one element per window, ties or not


def test_max_pool_gradient_against_finite_differences():
    rng = np.random.default_rng(3)
    p = rng.standard_normal((1, 2, 4, 6)).astype(np.float32)
    w = rng.standard_normal((1, 2, 2, 3)).astype(np.float32)
    grad = _sgd_grad(_pool_model(p, [2, 2], [2, 2]), WEBGPU_TARGETS, {"w": w})

    def loss(x: np.ndarray) -> float:
        y = x.reshape(1, 2, 2, 2, 3, 2).max(axis=(3, 5))
        return float((y * w).sum())

    x0, eps = p.astype(np.float64), 1e-6
    fd = np.zeros_like(x0)
    for idx in np.ndindex(x0.shape):
        hi, lo = x0.copy(), x0.copy()
        hi[idx] += eps
        lo[idx] -= eps
        fd[idx] = (loss(hi) - loss(lo)) / (2 * eps)
    assert_allclose_scaled(grad, fd, rtol=1e-5)


@pytest.mark.parametrize(
    ("kernel", "strides", "why"),
    [([3, 3], [1, 1], "beyond one MaxUnpool"), ([2, 2], [3, 3], "do not tile the input")],
)
def test_max_pool_the_webgpu_form_cannot_express_is_refused(kernel, strides, why, tmp_path):
    p = np.random.default_rng(0).standard_normal((1, 1, 9, 9)).astype(np.float32)
    model = _pool_model(p, kernel, strides)
    out = tmp_path / "art"
    with pytest.raises(
        InputError, match=rf"MaxPool .*onnxruntime-web-webgpu target has no MaxPool Indices.*{why}"
    ):
        generate(model, loss=None, optimizer="sgd", targets=WEBGPU_TARGETS, out_dir=out)
    assert not out.exists()
    generate(model, loss=None, optimizer="sgd")  # the other targets keep the Indices


def test_a_model_that_outputs_max_pool_indices_is_refused():
    model = _pool_model(np.zeros((1, 1, 4, 4), np.float32), [2, 2], [2, 2])
    model.graph.node[0].output.append("idx")
    model.graph.output.append(helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 1, 2, 2]))
    with pytest.raises(InputError, match=r"MaxPool .*the model outputs its Indices"):
        generate(model, loss=None, optimizer="sgd", targets=WEBGPU_TARGETS)


def test_an_op_without_a_webgpu_kernel_is_refused(tmp_path):
    model = build_mlp((64, 32, 10), np.random.default_rng(0))
    for n in model.graph.node:
        if n.op_type == "Relu":
            n.op_type = "Softsign"  # measured: no WebGPU kernel (onnxruntime-web 1.30)
    out = tmp_path / "art"
    with pytest.raises(
        InputError, match=r"onnxruntime-web-webgpu has no kernel for Softsign \(in train_step.onnx\)"
    ):
        generate(model, loss="cross_entropy", targets=WEBGPU_TARGETS, out_dir=out)
    assert not out.exists()
    generate(model, loss="cross_entropy", out_dir=out)  # wasm and the CPU have it


def test_matmul_with_a_vector_operand_is_written_with_matrices():
    rng = np.random.default_rng(0)
    a, b, v = (rng.standard_normal(s).astype(np.float32) for s in [(3, 4, 5), (5,), (4,)])
    nodes = [helper.make_node("MatMul", ["a", "b"], ["ab"]), helper.make_node("MatMul", ["v", "a"], ["va"]),
             helper.make_node("MatMul", ["b", "b"], ["bb"])]  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, x.shape) for n, x in zip("abv", (a, b, v))]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("ab", "va", "bb")]
    model = helper.make_model(helper.make_graph(nodes, "mm", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18)])  # fmt: skip
    model.ir_version = 8
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    lower_for_webgpu(lowered)
    infos = infer_value_infos(lowered)
    assert all(len(infos[i].shape) >= 2 for n in lowered.graph.node if n.op_type == "MatMul" for i in n.input)
    run = lambda m: ort.InferenceSession(m.SerializeToString()).run(None, {"a": a, "b": b, "v": v})
    for got, ref in zip(run(lowered), run(model)):
        assert got.shape == ref.shape
        assert_allclose_scaled(got, ref, rtol=1e-6)


def test_cli_target_webgpu(tmp_path):
    from onnxgrad.cli import main

    path = tmp_path / "mlp.onnx"
    onnx.save(build_mlp((64, 32, 10), np.random.default_rng(0)), path)
    out = tmp_path / "art"
    assert main(["artifacts", str(path), "--loss", "cross_entropy", "--target", WEBGPU, "-o", str(out)]) == 0
    ops = [n.op_type for n in onnx.load(out / "train_step.onnx").graph.node]
    assert "LogSoftmax" not in ops and "ReduceSum" in ops
    with pytest.raises(SystemExit):
        main(["artifacts", str(path), "--loss", "cross_entropy", "--target", "tensorflow.js", "-o", str(out)])


def _grouped_cnn(per_group: int, groups: int = 2) -> onnx.ModelProto:
    """Conv(4 -> groups * per_group, group=groups, 3x3) -> Relu -> GlobalAveragePool -> Gemm(10)."""
    rng = np.random.default_rng(3)
    out = groups * per_group
    inits = [
        numpy_helper.from_array(rng.standard_normal((out, 4 // groups, 3, 3)).astype(np.float32) * 0.3, "w"),
        numpy_helper.from_array(rng.standard_normal(out).astype(np.float32) * 0.1, "b"),
        numpy_helper.from_array(rng.standard_normal((out, 10)).astype(np.float32) * 0.3, "fc"),
    ]
    nodes = [
        helper.make_node("Conv", ["pixels", "w", "b"], ["c"], group=groups, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "grouped", [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["N", 4, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], initializer=inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize(("per_group", "split"), [(6, True), (5, True), (8, False), (3, False)])
def test_grouped_convs_webgpu_miscomputes_run_one_conv_per_group(per_group, split, tmp_path):
    """onnxruntime-web's WebGPU Conv gets groups of more than 4 outputs, not a multiple of 4, wrong
    (measured in chromium); the target writes them as one ungrouped Conv per group, same losses."""
    model = _grouped_cnn(per_group)
    art = generate(model, loss="cross_entropy", optimizer="adamw", lr=1e-2, out_dir=tmp_path / "gpu",
                   targets=WEBGPU_TARGETS)  # fmt: skip
    generate(model, loss="cross_entropy", optimizer="adamw", lr=1e-2, out_dir=tmp_path / "cpu")
    grouped = [
        n
        for n in art.train_step.graph.node
        if n.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in n.attribute)
    ]
    assert (grouped == []) == split
    rng = np.random.default_rng(4)
    batches = [
        {
            "pixels": rng.random((16, 4, 8, 8), dtype=np.float32),
            "target": rng.integers(0, 10, 16).astype(np.int64),
        }
        for _ in range(8)
    ]
    a, b = Runner(tmp_path / "cpu", threads=1), Runner(tmp_path / "gpu", threads=1)
    ref = np.array([a.step(x) for x in batches])
    assert_allclose_scaled(np.array([b.step(x) for x in batches]), ref, rtol=1e-5)
    for name, value in a.state_dict().items():
        assert_allclose_scaled(b.state_dict()[name], value, rtol=1e-4, err_msg=name)
