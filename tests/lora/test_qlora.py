"""QLoRA: LoRA adapters beside the frozen weights of models quantized by onnxruntime's quantizers
(4-bit DequantizeLinear and MatMulNBits, int8 DequantizeLinear, quantize_dynamic, quantize_static),
checked against the float model holding the dequantized weights and the same adapters."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxgrad
from onnxgrad import lora
from onnxgrad.errors import InputError
from onnxgrad.testing import assert_allclose_scaled

from .quantized_models import EXACT_KINDS, IN, KINDS, OUT, dequantized_weights, float_mlp, quantized

pytest.importorskip("onnxruntime.quantization")

F32 = np.float32
RANK = 4
QUANT_OPS = {"DequantizeLinear", "MatMulNBits", "MatMulInteger"}


def _random_adapters(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Values for every adapter of ``model``, B not zero (the adapters then change the output)."""
    r = np.random.default_rng(seed)
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    return {n: (r.standard_normal(shapes[n]) * 0.2).astype(F32) for n in lora.adapter_names(model)}


def _pair(kind: str, tmp_path: Path, seed: int = 3) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(the quantized model with adapters, the float model with the dequantized weights and the same
    adapters), both adapters holding the same random values."""
    q = lora.add_adapters(quantized(kind, tmp_path), ["W1", "W2"], rank=RANK)
    ref = lora.add_adapters(lora.with_values(float_mlp(), dequantized_weights(q)), ["W1", "W2"], rank=RANK)
    assert lora.adapter_names(q) == lora.adapter_names(ref)
    values = _random_adapters(q, seed)
    return lora.with_values(q, values), lora.with_values(ref, values)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The first output of ``model`` in inference, under lora.session_options()."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        model.SerializeToString(), lora.session_options(), ["CPUExecutionProvider"]
    )
    return session.run(None, feeds)[0]


def _batch(seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal((16, IN)).astype(F32)}


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_found_behind_quantized_weights(kind: str, tmp_path: Path) -> None:
    """Every kind: W1 and W2 are found (by the float weight's name), the quantized product stays as
    it is, only the adapters train, and the adapted model starts equal to the base."""
    base = quantized(kind, tmp_path)
    adapted = lora.add_adapters(base, "W*", rank=RANK)
    assert lora.adapter_names(adapted) == ["W1.lora_A", "W1.lora_B", "W2.lora_A", "W2.lora_B"]
    ops = [n.op_type for n in adapted.graph.node]
    assert QUANT_OPS & set(ops) and sorted(o for o in ops if o in QUANT_OPS) == sorted(
        n.op_type for n in base.graph.node if n.op_type in QUANT_OPS
    )
    fb = onnxgrad.ForwardBackward(adapted, session_options=lora.session_options())
    assert sorted(fb.parameters) == lora.adapter_names(adapted)
    feeds = _batch(1)
    np.testing.assert_array_equal(fb.forward(feeds, training=False).outputs[0], _run(base, feeds))


@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_gradients_match_dequantized_float_model(kind: str, tmp_path: Path) -> None:
    """Weight-only quantization: outputs and adapter gradients equal the float model's with the
    dequantized weights and the same adapters, up to float32 reordering."""
    q, ref = _pair(kind, tmp_path)
    feeds = _batch(2)
    dy = np.random.default_rng(4).standard_normal((16, OUT)).astype(F32)
    want = onnxgrad.ForwardBackward(ref).forward(feeds)
    got = onnxgrad.ForwardBackward(q, session_options=lora.session_options()).forward(feeds)
    assert_allclose_scaled(got.outputs[0], want.outputs[0], rtol=1e-5)
    g_want, g_got = want.backward([dy]), got.backward([dy])
    assert sorted(g_got) == lora.adapter_names(q)
    for name in g_got:
        assert np.abs(g_got[name]).max() > 0
        assert_allclose_scaled(g_got[name], g_want[name], rtol=1e-5, err_msg=name)


def _relative_gradient_error(q: onnx.ModelProto, ref: onnx.ModelProto, options: object) -> float:
    feeds = _batch(2)
    dy = np.random.default_rng(4).standard_normal((16, OUT)).astype(F32)
    g_want = onnxgrad.ForwardBackward(ref).forward(feeds).backward([dy])
    g_got = onnxgrad.ForwardBackward(q, session_options=options).forward(feeds).backward([dy])
    return max(float(np.abs(g_got[n] - g_want[n]).max() / np.abs(g_want[n]).max()) for n in g_got)


def test_dq_matmul_fusion_changes_the_numbers_unless_turned_to_float(tmp_path: Path) -> None:
    """4-bit DequantizeLinear -> MatMul: onnxruntime's default session fuses it into MatMulNBits
    at accuracy level 4 (activations quantized to int8): the gradients are off by about 0.5 %
    (measured 5e-3 to 7e-3); under lora.session_options(), which every session onnxgrad makes
    gets without options given, they are the float graph's."""
    from onnxgrad.runtime.options import default_options

    q, ref = _pair("int4_qdq", tmp_path)
    with pytest.warns(UserWarning, match="quantizes the activations to int8"):
        fused = _relative_gradient_error(q, ref, default_options())  # options without the level
    exact = _relative_gradient_error(q, ref, lora.session_options())
    default = _relative_gradient_error(q, ref, None)
    print(f"4-bit QDQ adapters' gradients vs float: level 4 {fused:.1e}, session_options {exact:.1e}")
    assert fused > 1e-3
    assert exact < 1e-5
    assert default < 1e-5


@pytest.mark.parametrize("kind", [*EXACT_KINDS, "int8_dynamic"])
def test_ten_training_steps_match_float_reference(kind: str, tmp_path: Path) -> None:
    """Ten SGD steps on an MSE loss: the losses of the quantized model with adapters follow those of
    the float model with the dequantized weights (exactly for weight-only quantization; within the
    dynamic quantization of the activations for quantize_dynamic), and go down."""
    q, ref = _pair(kind, tmp_path)
    r = np.random.default_rng(5)
    x = r.standard_normal((32, IN)).astype(F32)
    target = np.tanh(x[:, :OUT] * 2).astype(F32)

    def losses(model: onnx.ModelProto, options: object) -> list[float]:
        fb = onnxgrad.ForwardBackward(model, session_options=options)
        out = []
        for _ in range(10):
            res = fb.forward({"x": x})
            err = res.outputs[0] - target
            out.append(float((err**2).mean()))
            grads = res.backward([(2.0 / err.size) * err])
            fb.set_parameters({n: fb.parameters[n] - 0.05 * g for n, g in grads.items()})
        return out

    got, want = losses(q, lora.session_options()), losses(ref, None)
    print(f"{kind}: losses {got[0]:.4f} -> {got[-1]:.4f} (float reference {want[0]:.4f} -> {want[-1]:.4f})")
    assert got[-1] < 0.8 * got[0]
    rtol = 1e-4 if kind in EXACT_KINDS else 3e-2
    np.testing.assert_allclose(got, want, rtol=rtol)


def test_static_qdq_model_trains(tmp_path: Path) -> None:
    """quantize_static (activations quantized too): the adapters train under the straight-through
    estimator, and the loss goes down."""
    adapted = lora.add_adapters(quantized("int8_static", tmp_path), ["W1", "W2"], rank=RANK)
    assert "QuantizeLinear" in {n.op_type for n in adapted.graph.node}
    r = np.random.default_rng(6)
    x = r.standard_normal((32, IN)).astype(F32)
    target = np.tanh(x[:, :OUT] * 2).astype(F32)
    fb = onnxgrad.ForwardBackward(adapted, session_options=lora.session_options())
    first = None
    for _ in range(30):
        res = fb.forward({"x": x})
        err = res.outputs[0] - target
        first = first if first is not None else float((err**2).mean())
        grads = res.backward([(2.0 / err.size) * err])
        fb.set_parameters({n: fb.parameters[n] - 0.1 * g for n, g in grads.items()})
    last = float(((fb.forward({"x": x}, training=False).outputs[0] - target) ** 2).mean())
    assert last < 0.8 * first, (first, last)


@pytest.mark.parametrize("kind", [*EXACT_KINDS, "int8_dynamic"])
def test_merge_writes_float_weights_and_warns(kind: str, tmp_path: Path) -> None:
    """merge on a quantized base: float MatMuls holding dequantized W + the update, a UserWarning
    that says so, the quantized weights gone; it computes the float reference with the adapters."""
    q, ref = _pair(kind, tmp_path)
    with pytest.warns(UserWarning, match=r"2 quantized weight\(s\) .* are written as float weights"):
        merged = lora.merge(q)
    assert not QUANT_OPS & {n.op_type for n in merged.graph.node}
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in merged.graph.initializer)
    feeds = _batch(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the float reference merges without a warning
        ref_merged = lora.merge(ref)
    want = _run(ref_merged, feeds)
    assert_allclose_scaled(_run(merged, feeds), want, rtol=1e-5)
    if kind in EXACT_KINDS:  # and what the adapted quantized model computes
        assert_allclose_scaled(_run(q, feeds), want, rtol=1e-5)


def test_dequantized_weight_matches_onnxruntime(tmp_path: Path) -> None:
    """lora.dequantized_weight reads the packed 4-bit layout as onnxruntime's MatMulNBits does."""
    model = quantized("int4_nbits", tmp_path)
    want = dequantized_weights(model)
    assert_allclose_scaled(lora.dequantized_weight(model, "W1_Q4").T, want["W1"], rtol=1e-6)
    with pytest.raises(
        InputError, match=r"'W1_scales' is not a quantized weight: not the B input of MatMulNBits"
    ):
        lora.dequantized_weight(model, "W1_scales")


def test_unfit_quantized_names_are_refused(tmp_path: Path) -> None:
    """A name given exactly that cannot be adapted: an InputError that says why."""
    dynamic = quantized("int8_dynamic", tmp_path)
    with pytest.raises(InputError, match=r"cannot put an adapter beside 'W1_zero_point': not 2-D"):
        lora.add_adapters(dynamic, ["W1_zero_point"])
    model = quantized("int8_qdq", tmp_path)
    for node in model.graph.node:  # the dequantized W1 read by a Relu as well
        if node.op_type == "Relu":
            node.input[0] = "W1_dequantized"
    with pytest.raises(InputError, match=r"is read by Relu node 'relu', not only by MatMul/Gemm"):
        lora.add_adapters(model, ["W1"])


def test_onnx_module_trains_only_the_adapters_of_a_4bit_model(tmp_path: Path) -> None:
    """The torch bridge: the packed 4-bit weights are buffers that do not move."""
    torch = pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    adapted = lora.add_adapters(quantized("int4_nbits", tmp_path), ["W1", "W2"], rank=RANK)
    module = OnnxModule(adapted, session_options=lora.session_options())
    assert sorted(module.onnx_names[n] for n, _ in module.named_parameters()) == lora.adapter_names(adapted)
    packed = {n: b.clone() for n, b in module.named_buffers()}
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    x = torch.from_numpy(_batch(8)["x"])
    target = torch.tanh(2 * x[:, :OUT])
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    for n, b in module.named_buffers():
        assert torch.equal(b, packed[n])
    trained = module.to_onnx()
    uint8 = {t.name: numpy_helper.to_array(t) for t in trained.graph.initializer if t.name.endswith("_Q4")}
    assert set(uint8) == {"W1_Q4", "W2_Q4"}


@pytest.mark.parametrize("kind", ["int4_nbits", "int8_dynamic"])
def test_save_and_load_adapters_of_a_quantized_model(kind: str, tmp_path: Path) -> None:
    """save_adapters / load_adapters on a quantized base: the same adapted model back."""
    q, _ = _pair(kind, tmp_path)
    lora.save_adapters(q, tmp_path / "adapters.safetensors")
    base = quantized(kind, tmp_path)
    again = lora.load_adapters(base, tmp_path / "adapters.safetensors")
    assert lora.adapter_names(again) == lora.adapter_names(q)
    feeds = _batch(9)
    np.testing.assert_array_equal(_run(again, feeds), _run(q, feeds))


def test_gemm_trans_b_behind_blocked_int4_dequantize_linear() -> None:
    """Gemm(x, DequantizeLinear(W [out, in]), bias, transB=1, alpha=0.5), W int4 in blocks of 8 along
    `in` (axis 1): outputs and gradients of the adapters equal the float Gemm's with the dequantized
    weight (computed here by hand) and the same adapters."""
    from onnx import TensorProto, helper

    r = np.random.default_rng(11)
    q = r.integers(-8, 8, size=(6, 16)).astype(np.int8)
    scale = (r.uniform(0.01, 0.1, size=(6, 2))).astype(F32)
    zp = r.integers(-2, 3, size=(6, 2)).astype(np.int8)
    w = (q.astype(F32) - np.repeat(zp, 8, axis=1)) * np.repeat(scale, 8, axis=1)
    bias = r.standard_normal(6).astype(F32)

    def model(quantized: bool) -> onnx.ModelProto:
        gemm = helper.make_node("Gemm", ["x", "Wd" if quantized else "W", "bias"], ["y"], transB=1, alpha=0.5)
        nodes, inits = [gemm], [numpy_helper.from_array(bias, "bias")]
        if quantized:
            nodes.insert(
                0, helper.make_node("DequantizeLinear", ["W_q", "W_s", "W_z"], ["Wd"], axis=1, block_size=8)
            )
            q4 = helper.make_tensor("W_q", TensorProto.INT4, q.shape, q.flatten().tolist())
            zp4 = helper.make_tensor("W_z", TensorProto.INT4, zp.shape, zp.flatten().tolist())
            inits += [q4, zp4, numpy_helper.from_array(scale, "W_s")]
        else:
            inits.append(numpy_helper.from_array(w, "W"))
        graph = helper.make_graph(
            nodes,
            "gemm",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 16])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 6])],
            inits,
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        m.ir_version = 10
        return m

    q_model = lora.add_adapters(model(True), ["W_q"], rank=2, alpha=3)
    ref = lora.add_adapters(model(False), ["W"], rank=2, alpha=3)
    values = _random_adapters(q_model, 12)
    q_model = lora.with_values(q_model, values)
    ref = lora.with_values(ref, {k.replace("W_q", "W"): v for k, v in values.items()})
    feeds = {"x": r.standard_normal((5, 16)).astype(F32)}
    dy = r.standard_normal((5, 6)).astype(F32)
    got = onnxgrad.ForwardBackward(q_model, session_options=lora.session_options()).forward(feeds)
    want = onnxgrad.ForwardBackward(ref).forward(feeds)
    assert_allclose_scaled(got.outputs[0], want.outputs[0])
    g_got, g_want = got.backward([dy]), want.backward([dy])
    for name, g in g_got.items():
        assert_allclose_scaled(g, g_want[name.replace("W_q", "W")], err_msg=name)
    with pytest.warns(UserWarning, match="written as float weights"):
        merged = lora.merge(q_model)
    assert_allclose_scaled(_run(merged, feeds), want.outputs[0])


def test_matmul_nbits_at_a_low_accuracy_level_warns(tmp_path: Path) -> None:
    """A MatMulNBits node that runs with int8 activations (accuracy_level 4) is not the float product
    its rule differentiates: add_adapters says so."""
    from onnxgrad.errors import GradientWarning

    model = quantized("int4_nbits", tmp_path)
    model.graph.node[0].attribute.append(onnx.helper.make_attribute("accuracy_level", 4))
    low = r"MatMulNBits node\(s\) compute in low precision: 'mm1_Q4' \(accuracy_level=4\)"
    with pytest.warns(GradientWarning, match=low):
        lora.add_adapters(model, ["W1", "W2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lora.add_adapters(quantized("int4_nbits", tmp_path), ["W1", "W2"])


def _nbits_with_bias(tmp_path: Path) -> onnx.ModelProto:
    """The int4 MatMulNBits MLP with each product's bias as MatMulNBits's own input 5 (which
    onnxruntime's quantizer never writes): mm1 takes b1 (its Add removed), mm2 a new b2."""
    model = quantized("int4_nbits", tmp_path)
    graph = model.graph
    b2 = np.random.default_rng(11).standard_normal(OUT).astype(F32)
    graph.initializer.append(numpy_helper.from_array(b2, "b2"))
    nodes = []
    for node in graph.node:
        if node.op_type == "Add":
            continue  # folded into mm1's bias
        if node.op_type == "MatMulNBits":
            first = node.input[0] == "x"
            node.input.extend(["", "b1" if first else "b2"])  # g_idx absent, then the bias
            if first:
                node.output[0] = "hb"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def test_merge_keeps_the_bias_input_of_matmul_nbits(tmp_path: Path) -> None:
    """A MatMulNBits with a bias (input 5): the merged float MatMul adds it, so the merged model
    computes what the adapted one does (without the bias it is off by the bias, about 1 of scale)."""
    base = _nbits_with_bias(tmp_path)
    assert sum(len(n.input) == 6 and bool(n.input[5]) for n in base.graph.node) == 2
    adapted = lora.add_adapters(base, ["W1", "W2"], rank=RANK)
    adapted = lora.with_values(adapted, _random_adapters(adapted, 6))
    with pytest.warns(UserWarning, match="written as float weights"):
        merged = lora.merge(adapted)
    assert not QUANT_OPS & {n.op_type for n in merged.graph.node}
    assert {"b1", "b2"} <= {i for n in merged.graph.node for i in n.input}
    feeds = _batch(9)
    want = _run(adapted, feeds)
    assert_allclose_scaled(_run(merged, feeds), want, rtol=1e-5)
