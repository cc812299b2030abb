"""Mixed precision (onnxgrad.train.amp): float32 master weights, dynamic loss scaling, the Trainer."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.errors import InputError
from onnxgrad.train import Callback, Trainer
from onnxgrad.train.amp import LossScaler, MixedPrecision, mixed_precision


def _linear16(w: np.ndarray) -> onnx.ModelProto:
    """y = x @ W in float16."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "linear16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n", w.shape[1]])],
        [numpy_helper.from_array(w.astype(np.float16), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


class _Record(Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []
        self.weights: list[np.ndarray] = []

    def on_step_end(self, trainer, step, logs):
        self.scales.append(logs["loss_scale"])
        self.weights.append(trainer.parameters["W"].copy())


def _trainer(model: onnx.ModelProto, **kw) -> Trainer:
    return Trainer(model, loss="mse", optimizer="sgd", batch_size=4, shuffle=False, progress=False, **kw)


def test_loss_scaler_follows_torch_grad_scaler():
    """The scale and the skipped steps of torch.amp.GradScaler, for one sequence of inf / finite
    gradients (growth every 2 good steps)."""
    torch = pytest.importorskip("torch")
    infs = [False, False, True, False, False, False, True, True, False, False]
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    ours = LossScaler(init_scale=8.0, growth_interval=2)
    want, got = [], []
    for inf in infs:
        value = float("inf") if inf else 1.0
        opt.zero_grad()
        ref.scale((p * torch.full((2,), value)).sum()).backward()
        before = p.detach().clone()
        ref.step(opt)
        ref.update()
        want.append((ref.get_scale(), bool(torch.equal(before, p.detach()))))
        _, found = ours.unscale({"p": np.full(2, value * ours.scale, np.float32)})
        ours.update(found)
        got.append((ours.scale, found))
    assert got == want
    assert ours.skipped == 3


def test_trainer_skips_overflowing_steps_and_backs_off():
    """dW = -100 per element: scaled by 2^15 it overflows float16, so the dynamic scale halves,
    each time skipping the step (W unchanged), until 512 (100 * 512 < 65504); then SGD steps in
    float32 on the unscaled gradient."""
    model = _linear16(np.zeros((3, 2)))
    data = {"x": np.ones((4, 3), np.float16), "target": np.full((4, 2), 100.0, np.float16)}
    record = _Record()
    trainer = _trainer(model, lr=1e-3, callbacks=[record], loss_scale="dynamic")
    trainer.fit(data, epochs=8)
    # 2^16 is not a float16: backed off to 2^15 before the first step, no step spent on it
    assert record.scales == [16384.0, 8192.0, 4096.0, 2048.0, 1024.0, 512.0, 512.0, 512.0]
    assert trainer.amp.scaler.skipped == 6  # at 2^15, 2^14 ... 1024
    for w in record.weights[:6]:
        assert not w.any()
    # step 7: dW = x^T (2 (y - t) / 8) = 4 * -25 = -100, W = 0.1
    np.testing.assert_allclose(record.weights[6].astype(np.float32), 0.1, rtol=1e-3)
    np.testing.assert_array_equal(record.weights[7], trainer.amp.weights.master["W"].astype(np.float16))
    losses = trainer.history["loss"]
    assert losses[:7] == [10000.0] * 7 and losses[7] < losses[6]


def test_master_weights_keep_updates_below_float16_resolution():
    """lr * grad = 4e-5 against W = 1 (half an ulp: 4.9e-4): in float16 every update is lost; the
    float32 master weights add them up (as torch's float32 parameters under autocast)."""
    w0 = np.ones((3, 1))
    data = {"x": np.full((4, 3), 0.5, np.float16), "target": np.full((4, 1), 0.5, np.float16)}
    plain = _trainer(_linear16(w0), lr=4e-5, master_weights=False, loss_scale=None)
    assert plain.amp is None
    plain.fit(data, epochs=20)
    assert (plain.parameters["W"] == 1).all()  # the failure master weights are for

    trainer = _trainer(_linear16(w0), lr=4e-5)
    trainer.fit(data, epochs=20)
    # reference: the same SGD in float64 (y = 1.5 while W rounds to 1: dW = x^T 2 (y - t) / 4 = 1)
    w = np.ones(3)
    for _ in range(20):
        y = np.float64(np.float16(0.5 * np.float16(w).astype(np.float64).sum()))
        w = w - 4e-5 * (0.5 * 2 * (y - 0.5) / 4 * 4)
    master = trainer.amp.weights.master["W"][:, 0]
    assert master.dtype == np.float32
    np.testing.assert_allclose(master, w, rtol=1e-6)
    assert master[0] < 1 - 5e-4  # moved by more than float16 resolves
    np.testing.assert_array_equal(trainer.parameters["W"], trainer.amp.weights.master["W"].astype(np.float16))


def test_checkpoint_keeps_master_weights_and_scale(tmp_path):
    data = {"x": np.ones((4, 3), np.float16), "target": np.full((4, 2), 100.0, np.float16)}
    ref = _trainer(_linear16(np.zeros((3, 2))), lr=1e-3)
    ref.fit(data, epochs=8)
    first = _trainer(_linear16(np.zeros((3, 2))), lr=1e-3)
    first.fit(data, epochs=7, checkpoint=tmp_path / "ck.npz")
    resumed = _trainer(_linear16(np.zeros((3, 2))), lr=1e-3)
    resumed.fit(data, epochs=8, resume=tmp_path / "ck.npz")
    assert resumed.amp.scaler.state_dict() == ref.amp.scaler.state_dict()
    np.testing.assert_array_equal(resumed.amp.weights.master["W"], ref.amp.weights.master["W"])
    assert resumed.history["loss"] == ref.history["loss"]


def test_auto_is_off_for_float32_and_without_scaling_for_bfloat16():
    assert mixed_precision({"W": np.ones(3, np.float32)}) is None
    bf = {"W": np.ones(3, ml_dtypes.bfloat16), "b": np.zeros(2, np.float32)}
    amp = mixed_precision(bf)
    assert isinstance(amp, MixedPrecision) and amp.scaler is None  # float32's range: no scaling
    assert amp.params["W"].dtype == np.float32 and amp.params["b"] is bf["b"]
    amp.params["W"] -= 0.25
    amp.weights.sync()
    assert bf["W"].dtype == ml_dtypes.bfloat16 and (bf["W"].astype(np.float32) == 0.75).all()
    static = mixed_precision({"W": np.ones(3, np.float32)}, loss_scale=128)
    assert static.scaler.scale == 128 and not static.scaler.dynamic and static.weights is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"master_weights": "yes"}, "master_weights must be True, False or 'auto', got 'yes'"),
        ({"loss_scale": "static"}, "loss_scale must be 'auto', 'dynamic', a number, a LossScaler or None"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(InputError, match=match):
        _trainer(_linear16(np.zeros((3, 2))), **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"init_scale": 0.0}, "init_scale must be a finite number > 0, got 0.0"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1, got 1.0"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\), got 1.0"),
        ({"growth_interval": 0}, "growth_interval must be an integer >= 1, got 0"),
    ],
)
def test_bad_scaler(kw, match):
    with pytest.raises(InputError, match=match):
        LossScaler(**kw)


# ---- loss scaling with accumulation -------------------------------------------------------------
def test_an_overflow_in_an_earlier_micro_batch_skips_the_update():
    """As torch.amp.GradScaler over accumulated micro-batches: one overflowing micro-batch skips the
    whole update and backs the scale off once, even when the micro-batch after it is finite."""
    amp = mixed_precision({"W": np.zeros(2, np.float16)}, loss_scale=LossScaler(init_scale=64.0))
    opt = _CountSteps()
    amp.unscale({"W": np.array([np.inf, 1.0], np.float16)})
    amp.unscale({"W": np.array([1.0, 1.0], np.float16)})  # finite: must not clear the first one
    assert amp.step(opt, {"W": np.ones(2, np.float32)}) is False
    assert opt.steps == 0 and amp.scaler.scale == 32.0 and amp.scaler.skipped == 1
    amp.unscale({"W": np.array([1.0, 1.0], np.float16)})  # the next update starts clean
    assert amp.step(opt, {"W": np.ones(2, np.float32)}) is True and opt.steps == 1


class _CountSteps:
    def __init__(self) -> None:
        self.steps = 0

    def step(self, grads) -> None:
        self.steps += 1


@pytest.mark.parametrize("overflowing", [0, 1])
def test_trainer_accumulating_skips_the_update_when_any_micro_batch_overflowed(overflowing):
    """accumulate=2, one micro-batch overflows float16 once scaled (dW = -100 per element, times
    2048), the other does not (dW = -0.01): the update is skipped, W stays 0 and the scale halves
    once per update, not per micro-batch (GradScaler's rule: one inf check per step)."""
    big = {"x": np.ones((4, 3), np.float16), "target": np.full((4, 2), 100.0, np.float16)}
    small = {"x": np.ones((4, 3), np.float16), "target": np.full((4, 2), 0.01, np.float16)}
    parts = [big, small] if overflowing == 0 else [small, big]
    data = {k: np.concatenate([p[k] for p in parts]) for k in big}
    record = _Record()
    trainer = _trainer(
        _linear16(np.zeros((3, 2))),
        lr=1e-3,
        accumulate=2,
        callbacks=[record],
        loss_scale=LossScaler(init_scale=2048.0),
    )
    trainer.fit(data, epochs=1)
    assert trainer.updates == 1 and trainer.amp.scaler.skipped == 1
    assert record.scales == [1024.0]
    assert not trainer.parameters["W"].any() and not trainer.amp.weights.master["W"].any()
    assert trainer.optimizer.iterations == 0


def test_one_master_weights_rule_for_every_front_end():
    """use_master_weights decides for Trainer and OnnxModule alike: True / False as given, "auto"
    when some parameter is float16 or bfloat16 (numpy or torch dtypes); anything else refused."""
    from onnxgrad.train.amp import use_master_weights

    f16, bf16, f32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
    assert use_master_weights("auto", [f32, f16]) and use_master_weights("auto", [bf16])
    assert not use_master_weights("auto", [f32, np.dtype(np.float64)]) and not use_master_weights("auto", [])
    assert use_master_weights(True, [f32]) and not use_master_weights(False, [f16])
    torch = pytest.importorskip("torch")
    assert use_master_weights("auto", [torch.bfloat16]) and not use_master_weights("auto", [torch.float32])
    for bad in ("yes", 1, None):
        with pytest.raises(InputError, match="master_weights must be True, False or 'auto', got "):
            use_master_weights(bad, [f16])
