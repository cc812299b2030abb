"""LoRA adapters (onnxgrad.lora) on a 2-layer MLP, against a torch reference LoRA: always runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad import lora
from onnxgrad.errors import InputError
from onnxgrad.testing import assert_allclose_scaled

torch = pytest.importorskip("torch")


def _mlp(layout: str = "matmul") -> onnx.ModelProto:
    """x[4,6] -> layer1 (6->8) -> Relu -> layer2 (8->3). layout: "matmul" (MatMul(x, W[in,out])),
    "gemm" (Gemm transB, W[out,in]) or "left" (MatMul(W[out,in], x^T))."""
    rng = np.random.default_rng(3)
    w1, b1 = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    w2, b2 = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])
    if layout == "matmul":
        inits = [("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)]
        nodes = [
            helper.make_node("MatMul", ["x", "w1"], ["m1"], name="fc1"),
            helper.make_node("Add", ["m1", "b1"], ["a1"]),
            helper.make_node("Relu", ["a1"], ["h"]),
            helper.make_node("MatMul", ["h", "w2"], ["m2"], name="fc2"),
            helper.make_node("Add", ["m2", "b2"], ["y"]),
        ]
    elif layout == "gemm":
        inits = [("w1", w1.T.copy()), ("b1", b1), ("w2", w2.T.copy()), ("b2", b2)]
        nodes = [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["a1"], name="fc1", transB=1),
            helper.make_node("Relu", ["a1"], ["h"]),
            helper.make_node("Gemm", ["h", "w2", "b2"], ["y"], name="fc2", transB=1),
        ]
    else:  # weight on the left: h^T = W1 x^T
        inits = [("w1", w1.T.copy()), ("b1", b1[:, None].copy()), ("w2", w2.T.copy()), ("b2", b2)]
        nodes = [
            helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
            helper.make_node("MatMul", ["w1", "xt"], ["m1"], name="fc1"),
            helper.make_node("Add", ["m1", "b1"], ["a1"]),
            helper.make_node("Relu", ["a1"], ["ht"]),
            helper.make_node("MatMul", ["w2", "ht"], ["m2"], name="fc2"),
            helper.make_node("Transpose", ["m2"], ["m2t"], perm=[1, 0]),
            helper.make_node("Add", ["m2t", "b2"], ["y"]),
        ]
    graph = helper.make_graph(nodes, "mlp", [x], [y], [numpy_helper.from_array(v, n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _randomize_b(adapted: onnx.ModelProto, seed: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = {t.name: t for t in adapted.graph.initializer}
    values = {
        n: rng.normal(size=tuple(inits[n].dims)).astype(np.float32)
        for n in lora.adapter_names(adapted)
        if n.endswith("lora_B")
    }
    return lora.with_values(adapted, values)


@pytest.mark.parametrize("layout", ["matmul", "gemm", "left"])
def test_adapters_start_equal_and_merge(layout: str) -> None:
    base = _mlp(layout)
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    adapted = lora.add_adapters(base, ["w1", "w2"], rank=2, alpha=4)
    assert_allclose_scaled(_run(adapted, x), _run(base, x), rtol=1e-6)
    changed = _randomize_b(adapted)
    assert not np.allclose(_run(changed, x), _run(base, x))
    merged = lora.merge(changed)
    onnx.checker.check_model(merged)
    assert {t.name for t in merged.graph.initializer} == {t.name for t in base.graph.initializer}
    assert not any(p.key.startswith("onnxgrad.") for p in merged.metadata_props)
    assert_allclose_scaled(_run(merged, x), _run(changed, x), rtol=1e-5)


@pytest.mark.parametrize("layout", ["matmul", "gemm", "left"])
def test_gradients_match_torch_lora(layout: str) -> None:
    """The adapters' gradients equal those of a torch LoRA (frozen base + scale * x A B)."""
    base = _mlp(layout)
    rank, alpha = 2, 6.0
    adapted = _randomize_b(lora.add_adapters(base, "w*", rank=rank, alpha=alpha))
    fb = onnxgrad.ForwardBackward(adapted)
    assert sorted(fb.parameters) == sorted(lora.adapter_names(adapted))  # the base is frozen
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    res = fb.forward({"x": x})
    dy = np.random.default_rng(5).normal(size=res.outputs[0].shape).astype(np.float32)
    grads = res.backward([dy])

    inits = {t.name: numpy_helper.to_array(t) for t in adapted.graph.initializer}
    t = {
        k: torch.tensor(v, dtype=torch.float64, requires_grad=k.endswith(("lora_A", "lora_B")))
        for k, v in inits.items()
    }
    s = alpha / rank
    xt = torch.tensor(x, dtype=torch.float64)
    if layout == "matmul":
        h = torch.relu(xt @ t["w1"] + s * (xt @ t["w1.lora_A"]) @ t["w1.lora_B"] + t["b1"])
        y = h @ t["w2"] + s * (h @ t["w2.lora_A"]) @ t["w2.lora_B"] + t["b2"]
    elif layout == "gemm":
        h = torch.relu(xt @ t["w1"].T + s * (xt @ t["w1.lora_A"]) @ t["w1.lora_B"] + t["b1"])
        y = h @ t["w2"].T + s * (h @ t["w2.lora_A"]) @ t["w2.lora_B"] + t["b2"]
    else:
        ht = torch.relu(t["w1"] @ xt.T + s * t["w1.lora_B"] @ (t["w1.lora_A"] @ xt.T) + t["b1"])
        y = (t["w2"] @ ht + s * t["w2.lora_B"] @ (t["w2.lora_A"] @ ht)).T + t["b2"]
    assert_allclose_scaled(res.outputs[0], y, rtol=1e-5)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    for name in lora.adapter_names(adapted):
        assert_allclose_scaled(grads[name], t[name].grad, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm_alpha_beta_and_transposes(trans_a: int, trans_b: int) -> None:
    """Gemm(x, W, C) = alpha op(x) op(W) + beta C: the adapter adds alpha op(x) (s A B), s = the LoRA
    alpha / rank, the update of op(W) (an adapter ignoring Gemm's alpha, or transA, is off by the
    adapter's whole output); merging gives the same model; A and B get torch's gradients."""
    rng = np.random.default_rng(4)
    alpha, beta, rank, lora_alpha = 2.5, 0.5, 2, 6.0
    x = rng.normal(size=(6, 4) if trans_a else (4, 6)).astype(np.float32)
    w = rng.normal(size=(3, 6) if trans_b else (6, 3)).astype(np.float32)
    c = rng.normal(size=3).astype(np.float32)
    node = helper.make_node(
        "Gemm", ["x", "w", "c"], ["y"], alpha=alpha, beta=beta, transA=trans_a, transB=trans_b
    )
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")],
    )
    base = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    adapted = _randomize_b(lora.add_adapters(base, ["w"], rank=rank, alpha=lora_alpha))
    inits = {t.name: numpy_helper.to_array(t) for t in adapted.graph.initializer}
    t = {
        k: torch.tensor(v, dtype=torch.float64, requires_grad=k.startswith("w.lora"))
        for k, v in inits.items()
    }
    xt = torch.tensor(x.T if trans_a else x, dtype=torch.float64)
    wt = t["w"].T if trans_b else t["w"]
    y = alpha * xt @ (wt + lora_alpha / rank * t["w.lora_A"] @ t["w.lora_B"]) + beta * t["c"]
    base_y = (alpha * xt @ wt + beta * t["c"]).detach().numpy()
    assert np.abs(y.detach().numpy() - base_y).min() > 1e-2  # the adapter moves every output

    res = onnxgrad.ForwardBackward(adapted).forward({"x": x})
    dy = rng.normal(size=(4, 3)).astype(np.float32)
    grads = res.backward([dy])
    assert_allclose_scaled(res.outputs[0], y, rtol=1e-5)
    assert_allclose_scaled(_run(adapted, x), y, rtol=1e-5)
    assert_allclose_scaled(_run(lora.merge(adapted), x), y, rtol=1e-5)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    for name in ("w.lora_A", "w.lora_B"):
        assert_allclose_scaled(grads[name], t[name].grad, rtol=1e-5, err_msg=name)


def test_default_trainable_everywhere(tmp_path) -> None:
    adapted = lora.add_adapters(_mlp(), ["w1", "w2"], rank=2)
    names = sorted(lora.adapter_names(adapted))
    assert sorted(onnxgrad.build_gradient(adapted).trainable) == names
    from onnxgrad.torch import OnnxModule

    m = OnnxModule(adapted)
    assert sorted(m.onnx_names[n] for n, _ in m.named_parameters()) == names
    # the B matrices are all zeros of one shape: never tied together
    assert not onnxgrad.build_gradient(_same_shape_model()).ties
    # explicit names still win
    assert onnxgrad.build_gradient(adapted, trainable=["w1"]).trainable == ["w1"]


def _same_shape_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    inits = [numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), n) for n in ("wa", "wb")]
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["h"]), helper.make_node("MatMul", ["h", "wb"], ["y"])]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], inits),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    return lora.add_adapters(model, rank=2)


def test_trainer_and_artifacts_train_only_adapters(tmp_path) -> None:
    from onnxgrad import artifacts

    adapted = lora.add_adapters(_mlp(), ["w1", "w2"], rank=2)
    artifacts.generate(adapted, loss="mse", out_dir=tmp_path / "art")
    names = sorted(lora.adapter_names(adapted))
    runner = artifacts.Runner(tmp_path / "art")
    assert sorted(runner.parameters) == names
    from onnxgrad.train import Trainer

    fb = onnxgrad.ForwardBackward(adapted)
    assert sorted(fb.parameters) == names
    assert Trainer is not None


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_save_load_adapters(tmp_path, suffix: str) -> None:
    base = _mlp("gemm")
    adapted = _randomize_b(lora.add_adapters(base, ["w1", "w2"], rank=3, alpha=5))
    path = tmp_path / f"adapters{suffix}"
    lora.save_adapters(adapted, path)
    again = lora.load_adapters(base, path)
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    np.testing.assert_array_equal(_run(again, x), _run(adapted, x))
    if suffix == ".safetensors":
        st = pytest.importorskip("safetensors.numpy")
        loaded = st.load_file(str(path))
        assert sorted(loaded) == sorted(lora.adapter_names(adapted))


def test_targets_errors_and_predicate() -> None:
    base = _mlp()
    with pytest.raises(InputError, match="not 2-D"):
        lora.add_adapters(base, ["b1"])
    with pytest.raises(InputError, match=r"targets \['nope\*'\] match no weight"):
        lora.add_adapters(base, "nope*")
    adapted = lora.add_adapters(base, lambda n: n == "w2", rank=1)
    assert lora.adapter_names(adapted) == ["w2.lora_A", "w2.lora_B"]
    with pytest.raises(InputError, match="already has LoRA"):
        lora.add_adapters(adapted)


def test_dropout_on_the_adapter_input() -> None:
    """dropout > 0: a Dropout on the adapter's input, active in training mode only."""
    base = _mlp()
    adapted = _randomize_b(lora.add_adapters(base, ["w1", "w2"], rank=2, dropout=0.5))
    assert sum(n.op_type == "Dropout" for n in adapted.graph.node) == 2
    fb = onnxgrad.ForwardBackward(adapted)
    assert sorted(fb.parameters) == sorted(lora.adapter_names(adapted))
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    infer = fb.forward({"x": x}, training=False).outputs[0]
    train = fb.forward({"x": x}).outputs[0]
    assert not np.allclose(train, infer)  # dropped in training
    assert_allclose_scaled(infer, _run(lora.merge(adapted), x), rtol=1e-5)
    assert_allclose_scaled(_run(fb.to_onnx(), x), infer, rtol=1e-6)


def test_dynamo_renamed_linear_weights() -> None:
    """torch.onnx.export(dynamo=True) folds Linear's transposed weight into val_N: targets still
    name the torch weight."""
    pytest.importorskip("onnxscript")

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.o = torch.nn.Linear(8, 4), torch.nn.Linear(4, 8, bias=False)

        def forward(self, x):
            return self.o(torch.relu(self.q(x)))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    model = torch.onnx.export(Two().eval(), (x,), dynamo=True, verbose=False).model_proto
    adapted = lora.add_adapters(model, ["q.weight", "o.*"], rank=2)
    assert sorted(lora.adapter_names(adapted)) == [
        "o.weight.lora_A",
        "o.weight.lora_B",
        "q.weight.lora_A",
        "q.weight.lora_B",
    ]
    changed = _randomize_b(adapted)
    import onnxruntime as ort

    def run(m):
        s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]

    assert_allclose_scaled(run(lora.merge(changed)), run(changed), rtol=1e-5)


def test_trainer_trains_only_the_adapters() -> None:
    from onnxgrad.train import Trainer

    base = _mlp()
    adapted = lora.add_adapters(base, ["w1", "w2"], rank=2, alpha=4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = (x[:, :3] * 2).astype(np.float32)
    trainer = Trainer(adapted, loss="mse", lr=1e-2, progress=False, recompute="all", batch_size=4)
    assert sorted(trainer.parameters) == sorted(lora.adapter_names(adapted))
    trainer.fit({"x": x, "target": y}, epochs=5)
    merged = lora.merge(trainer.to_onnx())
    inits = {t.name: numpy_helper.to_array(t) for t in merged.graph.initializer}
    base_inits = {t.name: numpy_helper.to_array(t) for t in base.graph.initializer}
    assert not np.array_equal(inits["w1"], base_inits["w1"])  # the trained adapters, folded in
    np.testing.assert_array_equal(inits["b1"], base_inits["b1"])  # the base's bias untouched


def test_corrupt_adapter_files_are_refused(tmp_path) -> None:
    import json
    import struct

    adapted = lora.add_adapters(_mlp(), ["w1"], rank=2)
    path = tmp_path / "a.safetensors"
    lora.save_adapters(adapted, path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["w1.lora_A"]["shape"] = [1000, 1000]
    raw = json.dumps(header).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(InputError, match="bytes for shape"):
        lora.read_adapters(bad)
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(InputError, match="not a safetensors"):
        lora.read_adapters(tmp_path / "short.safetensors")
