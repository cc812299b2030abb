"""The session-option policy for QLoRA models is the runtime's, not one front end's: a 4-bit QDQ
model (blocked DequantizeLinear -> MatMul, which onnxruntime fuses into a MatMulNBits that quantizes
the activations to int8 unless told otherwise) computes the float product onnxgrad differentiates
through every door that makes sessions without options given: ForwardBackward, OnnxModule and the
artifacts Runner (the Trainer's own test: test_trainer_session_options.py).

The yardstick: the float model holding the dequantized weights and the same adapters. Under the
policy the outputs and gradients agree to float32 reordering (1e-5 of scale); the fused level-4
kernel is off by about 5e-3 (test_qlora.py measures both), so each test fails without the policy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad import lora
from onnxgrad.runtime.options import NBITS_ACCURACY_KEY, default_options, fuses_blocked_dequantize
from onnxgrad.runtime.runner import make_session
from onnxgrad.testing import assert_allclose_scaled

from .quantized_models import IN, OUT, dequantized_weights, float_mlp, quantized

pytest.importorskip("onnxruntime.quantization")

F32 = np.float32
RTOL = 1e-5  # float32 reordering of 64-term sums, two layers; the int8 activations cost ~5e-3


def _pair(tmp_path: Path) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(the 4-bit QDQ model with adapters, B random; the float model with its dequantized weights
    and the same adapters)."""
    q = lora.add_adapters(quantized("int4_qdq", tmp_path), ["W1", "W2"], rank=4)
    ref = lora.add_adapters(lora.with_values(float_mlp(), dequantized_weights(q)), ["W1", "W2"], rank=4)
    r = np.random.default_rng(3)
    shapes = {t.name: tuple(t.dims) for t in q.graph.initializer}
    values = {n: (r.standard_normal(shapes[n]) * 0.2).astype(F32) for n in lora.adapter_names(q)}
    assert fuses_blocked_dequantize(q)
    return lora.with_values(q, values), lora.with_values(ref, values)


def _x(seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, IN)).astype(F32)


def _level(session: object) -> str:
    """The fused MatMulNBits accuracy level a session runs under ("" when left unset)."""
    try:
        return session.get_session_options().get_session_config_entry(NBITS_ACCURACY_KEY)  # type: ignore[attr-defined]
    except RuntimeError:  # not set
        return ""


def test_make_session_applies_the_policy_to_quantized_models_only(tmp_path: Path) -> None:
    q, ref = _pair(tmp_path)
    assert _level(make_session(q, ["CPUExecutionProvider"])) == "1"
    path = tmp_path / "q.onnx"
    onnx.save(q, path)
    assert _level(make_session(str(path), ["CPUExecutionProvider"])) == "1"  # a file: the same
    assert _level(make_session(ref, ["CPUExecutionProvider"])) == ""  # nothing fused: as onnxruntime has it
    options = lora.session_options()
    options.intra_op_num_threads = 1
    assert _level(make_session(q, ["CPUExecutionProvider"], options)) == "1"
    with pytest.warns(UserWarning, match=r"session_options=onnxgrad\.lora\.session_options\(your_options\)"):
        session = make_session(q, ["CPUExecutionProvider"], default_options())
    assert _level(session) == ""  # the user's options, as given


def test_forward_backward_without_options_differentiates_what_runs(tmp_path: Path) -> None:
    q, ref = _pair(tmp_path)
    dy = np.random.default_rng(4).standard_normal((16, OUT)).astype(F32)
    fb = onnxgrad.ForwardBackward(q)
    assert _level(fb._runner.fwd) == "1"
    got, want = fb.forward({"x": _x()}), onnxgrad.ForwardBackward(ref).forward({"x": _x()})
    assert_allclose_scaled(got.outputs[0], want.outputs[0], rtol=RTOL)
    g_got, g_want = got.backward([dy]), want.backward([dy])
    for name in lora.adapter_names(q):
        assert_allclose_scaled(g_got[name], g_want[name], rtol=RTOL, err_msg=name)


def test_onnx_module_without_options_differentiates_what_runs(tmp_path: Path) -> None:
    """OnnxModule feeds the frozen float initializers (the scales) as buffers at each call, so
    onnxruntime has no constant DequantizeLinear to fuse: the float product with or without the
    policy (this checks that it stays so)."""
    torch = pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    q, ref = _pair(tmp_path)
    dy = np.random.default_rng(4).standard_normal((16, OUT)).astype(F32)
    module = OnnxModule(q)
    x = torch.from_numpy(_x())
    y = module(x)
    y.backward(torch.from_numpy(dy))
    want = onnxgrad.ForwardBackward(ref).forward({"x": _x()})
    assert_allclose_scaled(y.detach().numpy(), want.outputs[0], rtol=RTOL)
    g_want = want.backward([dy])
    for name, param in module.named_parameters():
        onnx_name = module.onnx_names[name]
        assert_allclose_scaled(param.grad.numpy(), g_want[onnx_name], rtol=RTOL, err_msg=onnx_name)


@pytest.mark.parametrize("threads", [None, 1])
def test_artifacts_runner_without_options_computes_the_float_product(
    tmp_path: Path, threads: int | None
) -> None:
    from onnxgrad.artifacts import Runner, generate

    q, ref = _pair(tmp_path)
    folder = tmp_path / "artifacts"
    generate(q, loss="mse", optimizer="sgd", out_dir=folder)
    runner = Runner(folder, threads=threads)
    assert _level(runner._train) == "1"
    target = np.tanh(2 * _x()[:, :OUT]).astype(F32)
    loss = runner.step({"x": _x(), "target": target})  # the loss before the update
    y = onnxgrad.ForwardBackward(ref).forward({"x": _x()}, training=False).outputs[0]
    want = float(np.mean((y.astype(np.float64) - target) ** 2))
    assert loss == pytest.approx(want, rel=RTOL)


def test_estimators_validation_session_keeps_the_policy(tmp_path: Path) -> None:
    """The estimators' validation session is quiet (its initializers are also inputs), and still
    computes the float product of a quantized model: no fused level-4 kernel, no warning."""
    import warnings

    from onnxgrad.sklearn import OnnxRegressor

    q, _ = _pair(tmp_path)
    X = _x()
    y = np.tanh(2 * X[:, :OUT]).astype(F32)
    est = OnnxRegressor(q, trainable=lora.adapter_names(q), early_stopping=True, max_iter=2, batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X, y)
    assert not [w for w in caught if "MatMulNBits" in str(w.message)]
    assert _level(est._val_session_) == "1"
