"""Trainer's ``session_options=``: on a 4-bit QDQ model (blocked DequantizeLinear -> MatMul, which
onnxruntime fuses into an activation-quantizing MatMulNBits by default) the Trainer computes the
float product onnxgrad differentiates, as ``ForwardBackward`` under ``lora.session_options()``;
options given without that setting are kept, with a warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad import lora
from onnxgrad.errors import InputError
from onnxgrad.runtime.runner import NBITS_ACCURACY_KEY, default_options, fuses_blocked_dequantize
from onnxgrad.testing import assert_allclose_scaled
from onnxgrad.train import SGD, Trainer, add_loss

from .quantized_models import IN, OUT, quantized

pytest.importorskip("onnxruntime.quantization")

F32 = np.float32
LR, STEPS = 0.05, 5


def _model(tmp_path: Path) -> onnx.ModelProto:
    """The 4-bit QDQ MLP with rank-4 adapters, B random (the adapters change the output)."""
    q = lora.add_adapters(quantized("int4_qdq", tmp_path), ["W1", "W2"], rank=4)
    r = np.random.default_rng(5)
    shapes = {t.name: tuple(t.dims) for t in q.graph.initializer}
    values = {n: (r.standard_normal(shapes[n]) * 0.2).astype(F32) for n in lora.adapter_names(q)}
    return lora.with_values(q, values)


def _data() -> dict[str, np.ndarray]:
    r = np.random.default_rng(1)
    return {"x": r.standard_normal((16, IN)).astype(F32), "target": r.standard_normal((16, OUT)).astype(F32)}


def _reference_losses(model: onnx.ModelProto, options: object) -> list[float]:
    """STEPS full-batch SGD steps with ForwardBackward on the model with its mse loss appended."""
    fb = onnxgrad.ForwardBackward(add_loss(model, "mse"), outputs=["loss"], session_options=options)
    opt = SGD(fb.parameters, lr=LR)
    losses = []
    for _ in range(STEPS):
        result = fb.forward(_data())
        losses.append(float(result.outputs[fb.output_names.index("loss")]))
        opt.step(result.backward())
    return losses


def _level(session: object) -> str:
    """The fused MatMulNBits accuracy level a session runs under ("" when left unset)."""
    try:
        return session.get_session_options().get_session_config_entry(NBITS_ACCURACY_KEY)  # type: ignore[attr-defined]
    except RuntimeError:  # not set
        return ""


def _trainer_losses(trainer: Trainer) -> list[float]:
    trainer.fit(_data(), epochs=STEPS)  # one batch per epoch: the epoch's loss is the step's
    return [float(v) for v in trainer.history["loss"]]


def _trainer(model: onnx.ModelProto, one_graph: bool, **kw: object) -> Trainer:
    return Trainer(
        model, loss="mse", optimizer="sgd", lr=LR, batch_size=16, shuffle=False, progress=False,
        one_graph=one_graph, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("one_graph", [True, False], ids=["one-graph", "two-sessions"])
def test_trainer_on_4bit_qdq_matches_forward_backward_under_lora_options(
    tmp_path: Path, one_graph: bool
) -> None:
    model = _model(tmp_path)
    assert fuses_blocked_dequantize(model)
    want = _reference_losses(model, lora.session_options())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the options are picked: nothing to warn about
        trainer = _trainer(model, one_graph)
    assert trainer.step_path == ("one graph" if one_graph else "two sessions")
    assert _level(trainer.fb._runner.fwd) == "1"  # the policy of make_session, for every session
    if one_graph:
        assert _level(trainer._one_graph.session) == "1"
    got = _trainer_losses(trainer)
    assert got[-1] < got[0]
    assert_allclose_scaled(got, want, rtol=1e-5)


def test_given_options_without_the_level_are_kept_with_a_warning(tmp_path: Path) -> None:
    """The user's options run as given (the fused kernel quantizes x): the losses then differ from
    the float product's by far more than float32 rounding."""
    model = _model(tmp_path)
    with pytest.warns(UserWarning, match=r"session_options=onnxgrad\.lora\.session_options\(your_options\)"):
        trainer = _trainer(model, False, session_options=default_options())
    got = _trainer_losses(trainer)
    want = _reference_losses(model, lora.session_options())
    assert np.max(np.abs(np.subtract(got, want)) / np.abs(want)) > 1e-4
    with pytest.warns(UserWarning, match="quantizes the activations to int8"):
        fused = _reference_losses(model, default_options())
    assert_allclose_scaled(got, fused, rtol=1e-5)


def test_session_options_reach_the_sessions_of_a_float_model(tmp_path: Path) -> None:
    """A model without quantized MatMul keeps the options given (the same object), no warning."""
    model = lora.add_adapters(
        onnx.load_from_string(quantized("int8_qdq", tmp_path).SerializeToString()), ["W1"]
    )
    options = default_options()
    options.intra_op_num_threads = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _trainer(model, True, session_options=options)
    assert trainer.fb._options is options
    assert trainer._one_graph is not None


def test_session_options_with_a_forward_backward_are_refused(tmp_path: Path) -> None:
    fb = onnxgrad.ForwardBackward(add_loss(_model(tmp_path), "mse"), outputs=["loss"])
    with pytest.raises(InputError, match=r"session_options= and providers= go to the ForwardBackward"):
        Trainer(fb, session_options=default_options(), progress=False)


def test_the_accuracy_level_warning_comes_once_per_trainer(tmp_path: Path) -> None:
    """Every session of a Trainer (training, evaluation) shares the caller's options: the warning
    about them comes once, not per session; other options warn again."""
    model = _model(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(model, True, session_options=default_options())  # one-graph step, evaluation
        trainer.fit(_data(), epochs=2)
        trainer.evaluate(_data())
        onnxgrad.ForwardBackward(model, session_options=default_options())  # other options
    said = [w for w in caught if "quantizes the activations to int8" in str(w.message)]
    assert len(said) == 2, [str(w.message)[:80] for w in said]
