"""The scripts of scenarios.py, written for onnxruntime-training 1.19.2, run unchanged on
onnxgrad.compat.training and give 1.19.2's numbers (recorded by tools/record_ort_training.py).

Where 1.19.2 failed (a custom loss its gradient builder refused, the eval model of a training-mode
BatchNormalization, an Optimizer over a nominal checkpoint) onnxgrad computes the answer, checked
here another way; where 1.19.2 was wrong (LinearLRScheduler's swapped counts) onnxgrad gives the
documented schedule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnxgrad.compat.training as og

from . import scenarios

DATA = Path(__file__).resolve().parents[1] / "data" / "ort_training"
RTOL = 1e-4  # float32 sums in another order on another CPU: relative bounds only


@pytest.fixture(scope="module")
def recorded() -> dict:
    with open(DATA / "recorded.json") as f:
        return json.load(f)


def close(ours, theirs, rtol: float = RTOL) -> None:
    """Every number of ``ours`` within ``rtol`` of ``theirs`` (scaled by the magnitude of the values)."""
    if isinstance(theirs, dict):
        assert sorted(ours) == sorted(theirs)
        for key in theirs:
            close(ours[key], theirs[key], rtol)
        return
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    assert a.shape == b.shape
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-3)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def run(name: str, tmp_path) -> dict:
    return scenarios.SCENARIOS[name](og, str(tmp_path / name))


@pytest.mark.parametrize("name", ["adamw_cross_entropy", "sgd_mse", "adamw_bce", "sgd_l1"])
def test_every_loss_type_and_optimizer(name, tmp_path, recorded):
    ours, theirs = run(name, tmp_path), recorded[name]
    assert len(ours["losses"]) == scenarios.STEPS
    for key in ("losses", "eval", "params", "lr"):
        close(ours[key], theirs[key])
    assert ours["losses"][-1] != ours["losses"][0]  # it trained


def test_api_surface(tmp_path, recorded):
    ours, theirs = run("api_surface", tmp_path), recorded["api_surface"]
    for key in ("train_inputs", "eval_inputs", "parameter_order", "requires_grad", "size", "size_all"):
        assert ours[key] == theirs[key], key
    for key in ("train_outputs", "eval_outputs"):  # generated names: onnx::loss::<counter>
        assert [re.sub(r"\d+$", "N", n) for n in ours[key]] == ["onnx::loss::N"]
    assert ours["parameter_order"] == sorted(ours["parameter_order"])  # alphabetical, as 1.19.2
    for key in ("loss", "grads", "contiguous", "lr", "after_copy"):
        close(ours[key], theirs[key])


def test_frozen_parameters(tmp_path, recorded):
    ours, theirs = run("frozen", tmp_path), recorded["frozen"]
    for key in ("losses", "params", "contiguous_all"):
        close(ours[key], theirs[key])
    for key in ("requires_grad", "size", "size_all", "train_inputs"):
        assert ours[key] == theirs[key]
    first = scenarios.mlp()
    start = {t.name: np.frombuffer(t.raw_data, np.float32) for t in first.graph.initializer}
    for name in ("fc1.weight", "fc1.bias"):  # frozen: unchanged
        np.testing.assert_array_equal(np.ravel(ours["params"][name]), start[name])


def test_gradient_accumulation(tmp_path, recorded):
    ours, theirs = run("accumulation", tmp_path), recorded["accumulation"]
    for key in ("losses", "grads", "params"):
        close(ours[key], theirs[key])


def test_custom_onnxblock_loss(tmp_path, recorded):
    ours, theirs = run("custom_loss", tmp_path), recorded["custom_loss"]
    for key in ("losses", "eval", "params"):
        close(ours[key], theirs[key])


def test_custom_loss_that_1192_refused(tmp_path, recorded):
    """``mse + l1 * Constant(0.25)``: 1.19.2's gradient builder fails; onnxgrad trains it. Its
    first loss is the first MSE loss plus a quarter of the first L1 loss (same parameters, batch)."""
    assert "ReduceSum" in recorded["custom_loss_scaled"]["error"]
    ours = run("custom_loss_scaled", tmp_path)
    first = recorded["sgd_mse"]["losses"][0] + 0.25 * recorded["sgd_l1"]["losses"][0]
    close(ours["losses"][0], first)
    before = scenarios._custom(og, str(tmp_path / "again"), scaled=True)  # same script, same numbers
    close(before["losses"], ours["losses"])
    x, y = scenarios.data("floats")
    _state, module, _ = scenarios._session(og, str(tmp_path / "custom_loss_scaled"))
    assert ours["eval"] < scenarios._eval(module, x, y)  # trained beats the fresh folder's parameters


def test_resume_from_checkpoint(tmp_path, recorded):
    ours, theirs = run("resume", tmp_path), recorded["resume"]
    for key in ("first", "second", "params"):
        close(ours[key], theirs[key])
    assert ours["properties"] == theirs["properties"] == {"best": 0.125, "epoch": 5, "note": "resumed"}


def test_export_for_inference(tmp_path, recorded):
    ours, theirs = run("export", tmp_path), recorded["export"]
    close(ours["logits"], theirs["logits"])
    assert ours["inputs"] == theirs["inputs"] == ["input"]


def test_linear_lr_scheduler_follows_its_documentation(tmp_path, recorded):
    """1.19.2 swapped warm-up and total (onnxruntime PR #13882): it warmed up over 10 steps.
    onnxgrad warms up over 3 steps and decays to 0 at step 10, as documented."""
    warmup, total, lr = 3, 10, 0.01
    swapped = [np.float32(lr * k / total) for k in range(total)]
    close(recorded["scheduler"]["lrs"], swapped, rtol=1e-6)
    ours = run("scheduler", tmp_path)
    documented = [lr * (k / warmup if k < warmup else (total - k) / (total - warmup)) for k in range(total)]
    close(ours["lrs"], documented, rtol=1e-6)


def test_scheduler_rates_give_1192_losses(tmp_path, recorded):
    """Fed 1.19.2's learning rates by hand, the steps give its losses."""
    work = str(tmp_path / "lrs")
    scenarios._generate(og, work, scenarios.mlp(), og.artifacts.LossType.CrossEntropyLoss)
    _, module, opt = scenarios._session(og, work)
    x, y = scenarios.data("classes")
    losses = []
    for lr, (xb, yb) in zip(recorded["scheduler"]["lrs"], scenarios.batches(x, y)):
        opt.set_learning_rate(lr)
        losses.append(float(module(xb, yb)))
        opt.step()
        module.lazy_reset_grad()
    close(losses, recorded["scheduler"]["losses"])


def _bn_eval(params: dict, x: np.ndarray, y: np.ndarray) -> float:
    """The bn_net in inference mode, in numpy: the MSE loss."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = x.astype(np.float64) @ p["fc1.weight"]
    h = (h - p["bn.running_mean"]) / np.sqrt(p["bn.running_var"] + 1e-5) * p["bn.weight"] + p["bn.bias"]
    out = np.maximum(h, 0) @ p["fc2.weight"]
    return float(np.mean((out - y) ** 2))


def test_batchnorm_training_and_eval(tmp_path, recorded):
    """Training matches 1.19.2, running statistics included (momentum, biased batch variance);
    1.19.2 could not load the eval model, onnxgrad evaluates with the running statistics."""
    ours, theirs = run("batchnorm", tmp_path), recorded["batchnorm"]
    close(ours["losses"], theirs["losses"])
    close(ours["params"], theirs["params"])
    assert "training_mode" in theirs["eval_error"].lower() or "Training_mode" in theirs["eval_error"]
    assert "eval_error" not in ours
    x, y = scenarios.data("one")
    close(ours["eval"], _bn_eval(ours["params"], x, y), rtol=1e-5)


def test_nominal_checkpoint(tmp_path, recorded):
    ours, theirs = run("nominal", tmp_path), recorded["nominal"]
    assert ours["size"] == theirs["size"]
    close(ours["losses"], theirs["losses"])
    close(ours["lr"], theirs["lr"])


def test_nominal_checkpoint_learning_rate_where_1192_crashed(tmp_path, recorded):
    assert "crashed" in recorded["nominal_lr"]
    assert run("nominal_lr", tmp_path) == {"lr": pytest.approx(1e-3)}


def test_adamw_weight_decay_without_bias_correction(tmp_path, recorded):
    """onnxblock.optim.AdamW(weight_decay=, bias_correction=, betas=) as the optimizer: the
    decay applied after the step, as 1.19.2's Hugging Face variant."""
    ours, theirs = run("weight_decay", tmp_path), recorded["weight_decay"]
    close(ours["losses"], theirs["losses"])
    close(ours["params"], theirs["params"])


def test_additional_output_names(tmp_path, recorded):
    ours, theirs = run("additional_outputs", tmp_path), recorded["additional_outputs"]
    assert ours["outputs"] == theirs["outputs"] == 2
    for key in ("loss", "logits", "eval_loss", "eval_logits"):
        close(ours[key], theirs[key])


def test_offline_tooling_blocks(tmp_path, recorded):
    """TrainingBlock, an optimizer block in empty_base(), onnxblock.save_checkpoint and
    load_checkpoint_to_model, as scripts wrote them before generate_artifacts existed."""
    ours, theirs = run("offline_blocks", tmp_path), recorded["offline_blocks"]
    assert ours["trainable"] == theirs["trainable"] == scenarios.PARAMS
    close(ours["losses"], theirs["losses"])
    close(ours["loaded"], theirs["loaded"])
    close(ours["losses"], recorded["adamw_cross_entropy"]["losses"])  # the same training


def test_loss_options(tmp_path, recorded):
    """MSELoss(reduction="sum"), BCEWithLogitsLoss(pos_weight=...), CrossEntropyLoss(ignore_index=...)."""
    ours, theirs = run("loss_options", tmp_path), recorded["loss_options"]
    close(ours, theirs)


def test_weighted_cross_entropy_where_1192_failed(tmp_path, recorded):
    """1.19.2's CrossEntropyLoss tested ``if self._weight:`` on an array and raised; onnxgrad
    computes the weighted mean, checked in numpy on the first batch."""
    assert "truth value of an array" in recorded["weighted_cross_entropy"]["error"]
    ours = run("weighted_cross_entropy", tmp_path)
    session = ort.InferenceSession(scenarios.mlp().SerializeToString(), providers=["CPUExecutionProvider"])
    x, y = scenarios.data("classes")
    (logits,) = session.run(None, {"input": x[: scenarios.BATCH]})
    logits = logits.astype(np.float64)
    log_p = logits - logits.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    w = np.array([1.0, 2.0, 3.0])[y[: scenarios.BATCH]]
    expected = -(w * log_p[np.arange(scenarios.BATCH), y[: scenarios.BATCH]]).sum() / w.sum()
    close(ours["losses"][0], expected, rtol=1e-5)
    assert len(ours["losses"]) == 6
