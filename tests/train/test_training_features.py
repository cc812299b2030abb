"""Gradient accumulation, gradient clipping, ReduceLROnPlateau, the history file, the step hook and
the metrics on the progress bar: each against torch or against the run it must equal."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from onnx import numpy_helper

from onnxgrad.errors import InputError
from onnxgrad.train import SGD, Callback, Trainer
from onnxgrad.train.callbacks import HistoryFile, accuracy_metric
from onnxgrad.train.optim import clip_grad_norm, clip_grad_value
from onnxgrad.train.schedules import ReduceLROnPlateau
from tests.train.test_trainer import linear, regression_data

torch = pytest.importorskip("torch")


def random_grads(seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((3, 4)) * scale, "b": rng.standard_normal(5) * scale, "c": np.zeros(2)}


# ---- clipping ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("max_norm", "norm_type"), [(0.5, 2.0), (100.0, 2.0), (1.0, 1.0), (0.3, math.inf)])
def test_clip_grad_norm_equals_torch(max_norm, norm_type):
    grads = random_grads(scale=2.0)
    tensors = [torch.tensor(g) for g in grads.values()]
    params = [torch.zeros_like(t, requires_grad=True) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    total = clip_grad_norm(grads, max_norm, norm_type=norm_type)
    assert total == pytest.approx(float(expected_norm), rel=1e-12)
    for g, p in zip(grads.values(), params):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-12, atol=0)


def test_clip_grad_value_equals_torch():
    grads = random_grads(scale=2.0)
    params = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads.values()]
    for p, g in zip(params, grads.values()):
        p.grad = torch.tensor(g)
    torch.nn.utils.clip_grad_value_(params, 0.7)
    clip_grad_value(grads, 0.7)
    for g, p in zip(grads.values(), params):
        np.testing.assert_array_equal(g, p.grad.numpy())


def test_clipping_errors():
    with pytest.raises(InputError, match="max_norm must be > 0, got 0"):
        clip_grad_norm(random_grads(), 0)
    with pytest.raises(InputError, match=r"the gradients' global norm is nan: they cannot be clipped"):
        clip_grad_norm({"a": np.array([np.nan, 1.0])}, 1.0)
    with pytest.raises(InputError, match="clip_norm must be > 0, got -1"):
        Trainer(linear(), loss="mse", clip_norm=-1, progress=False)
    with pytest.raises(InputError, match="accumulate must be an integer >= 1, got 0"):
        Trainer(linear(), loss="mse", accumulate=0, progress=False)


def test_trainer_clip_norm_equals_a_torch_loop_with_clip_grad_norm():
    model, data = linear(), regression_data(24)
    trainer = Trainer(
        model, loss="mse", optimizer="sgd", lr=0.1, batch_size=8, shuffle=False, clip_norm=0.5, progress=False
    )
    norms = []

    class Norms(Callback):
        def on_step_end(self, trainer, step, logs):
            norms.append(logs["grad_norm"])

    trainer.callbacks.append(Norms())
    trainer.fit(data, epochs=2)
    assert trainer.step_path == "two sessions"

    inits = {i.name: np.array(__import__("onnx").numpy_helper.to_array(i)) for i in model.graph.initializer}
    w, b = (torch.tensor(inits[k], requires_grad=True) for k in ("W", "b"))
    opt = torch.optim.SGD([w, b], lr=0.1)
    expected = []
    for _ in range(2):
        for lo in range(0, 24, 8):
            x, t = torch.tensor(data["x"][lo : lo + 8]), torch.tensor(data["target"][lo : lo + 8])
            opt.zero_grad()
            torch.nn.functional.mse_loss(x @ w + b, t).backward()
            expected.append(float(torch.nn.utils.clip_grad_norm_([w, b], 0.5)))
            opt.step()
    np.testing.assert_allclose(norms, expected, rtol=1e-10)
    assert max(expected) > 0.5  # the clipping did act
    np.testing.assert_allclose(trainer.parameters["W"], w.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(trainer.parameters["b"], b.detach().numpy(), rtol=1e-10, atol=1e-13)


# ---- accumulation --------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "batch", "accumulate"), [(12, 4, 3), (10, 4, 3), (9, 2, 5)])
def test_accumulation_equals_one_step_on_the_concatenated_batch(n, batch, accumulate):
    """k micro-batches (the last one smaller) then one SGD update == one update on all n samples."""
    data = regression_data(n)
    steps = []

    class Steps(Callback):
        def on_step_end(self, trainer, step, logs):
            steps.append((step, logs["loss"]))

    micro = Trainer(
        linear(), loss="mse", optimizer="sgd", lr=0.1, batch_size=batch, shuffle=False,
        accumulate=accumulate, progress=False, callbacks=[Steps()],
    )  # fmt: skip
    micro.fit(data, epochs=1)
    whole = Trainer(
        linear(), loss="mse", optimizer="sgd", lr=0.1, batch_size=n, shuffle=False, progress=False
    )
    whole_loss = whole.fit(data, epochs=1)["loss"][0]
    assert micro.optimizer.iterations == len(steps) == 1 == math.ceil(math.ceil(n / batch) / accumulate)
    for name, p in whole.parameters.items():
        np.testing.assert_allclose(micro.parameters[name], p, rtol=1e-12, atol=1e-14)
    assert steps[0][1] == pytest.approx(whole_loss, rel=1e-12)  # the mean loss of the update


def test_accumulation_with_two_updates_per_epoch():
    """16 samples, batches of 4, accumulate 2: the updates of a batch-8 run."""
    data = regression_data(16)
    micro = Trainer(
        linear(),
        loss="mse",
        optimizer="sgd",
        lr=0.1,
        batch_size=4,
        shuffle=False,
        accumulate=2,
        progress=False,
    )
    micro.fit(data, epochs=2)
    big = Trainer(linear(), loss="mse", optimizer="sgd", lr=0.1, batch_size=8, shuffle=False, progress=False)
    big.fit(data, epochs=2)
    assert micro.optimizer.iterations == big.optimizer.iterations == 4
    for name, p in big.parameters.items():
        np.testing.assert_allclose(micro.parameters[name], p, rtol=1e-12, atol=1e-14)


# ---- ReduceLROnPlateau ---------------------------------------------------------------------------
LOSSES = [1.0, 0.9, 0.9, 0.95, 0.91, 0.9, 0.899995, 0.97, 0.5, 0.6, 0.6, 0.6, 0.6, 0.7, 0.8, 0.55, 0.6, 0.6]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"patience": 1},
        {"patience": 2, "factor": 0.5, "cooldown": 2},
        {"patience": 0, "factor": 0.5, "min_lr": 0.02},
        {"patience": 1, "threshold": 0.05, "threshold_mode": "abs"},
        {"patience": 1, "mode": "max"},
        {"patience": 1, "mode": "max", "threshold_mode": "abs", "threshold": 0.01, "cooldown": 1},
    ],
)
def test_reduce_lr_on_plateau_equals_torch(options):
    ours = ReduceLROnPlateau(0.1, **options)
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.1)
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **options)
    ours_lrs, torch_lrs = [], []
    for loss in LOSSES:
        ours.step(loss)
        theirs.step(loss)
        ours_lrs.append(ours(123))
        torch_lrs.append(opt.param_groups[0]["lr"])
    assert ours_lrs == pytest.approx(torch_lrs, rel=1e-15)
    assert len(set(torch_lrs)) > 1 or options == {}  # the sequences do change


def test_trainer_steps_the_plateau_and_checkpoints_it(tmp_path):
    data, val = regression_data(32), regression_data(16, seed=2, flip=True)  # val gets worse

    def make():
        plateau = ReduceLROnPlateau(0.05, patience=1, factor=0.5)
        return Trainer(linear(), loss="mse", optimizer="sgd", lr=plateau, batch_size=16, progress=False)

    trainer = make()
    history = trainer.fit(data, val, epochs=6)
    lrs = history["lr"]
    assert lrs[0] == 0.05 and lrs[-1] < 0.05 and sorted(lrs, reverse=True) == lrs
    # a run resumed from epoch 3 continues with the plateau's state
    first = make()
    first.fit(data, val, epochs=3, checkpoint=tmp_path / "c.npz")
    resumed = make()
    assert resumed.fit(data, val, epochs=6, resume=tmp_path / "c.npz")["lr"] == lrs
    with pytest.raises(
        InputError, match="ReduceLROnPlateau monitors 'val_loss' but fit\\(\\) got no validation"
    ):
        make().fit(data, epochs=1)


# ---- history file, step hook, progress bar -------------------------------------------------------
def classification(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3))
    return {"x": x, "target": (x[:, 0] > x[:, 1]).astype(np.int64)}


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_history_file_has_one_row_per_epoch(tmp_path, suffix):
    path = tmp_path / "logs" / f"history{suffix}"
    trainer = Trainer(
        linear(), loss="cross_entropy", lr=0.05, batch_size=8, progress=False,
        metrics={"acc": accuracy_metric("y")}, callbacks=[HistoryFile(path)],
    )  # fmt: skip
    history = trainer.fit(classification(32), classification(16, seed=1), epochs=3)
    if suffix == ".json":
        rows = json.loads(path.read_text())
    else:
        with open(path, newline="") as f:
            rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
        assert path.read_text().splitlines()[0] == "epoch,loss,lr,val_loss,val_acc,seconds"
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for key in ("loss", "val_loss", "val_acc", "lr"):
        assert [r[key] for r in rows] == pytest.approx(history[key], rel=1e-12)
    assert all(0 <= r["val_acc"] <= 1 for r in rows)
    with pytest.raises(InputError, match=r"history file .*h\.txt.*: expected a \.csv or \.json file"):
        HistoryFile(tmp_path / "h.txt")


def test_progress_bar_shows_the_validation_metrics(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # tqdm cuts the bar to the terminal's width (80 by default)
    trainer = Trainer(linear(), loss="cross_entropy", batch_size=8, metrics={"acc": accuracy_metric("y")})
    trainer.fit(classification(16), classification(8, seed=1), epochs=2)
    err = capsys.readouterr().err
    assert "val_loss=" in err and "val_acc=" in err


def test_step_hook_counts_updates_on_the_one_graph_path():
    seen = []

    class Steps(Callback):
        def on_step_end(self, trainer, step, logs):
            seen.append((step, logs["lr"]))

    trainer = Trainer(linear(dtype=np.float32), loss="mse", optimizer=lambda p: SGD(p, lr=0.01),
                      batch_size=8, progress=False, callbacks=[Steps()])  # fmt: skip
    trainer.fit(regression_data(24), epochs=2)
    assert trainer.step_path == "one graph"
    assert [s for s, _ in seen] == list(range(1, 7)) and {lr for _, lr in seen} == {0.01}


def test_resuming_with_other_settings_warns_with_both_values(tmp_path):
    data = regression_data(32)
    first = Trainer(linear(), loss="mse", optimizer="sgd", lr=0.05, batch_size=16, progress=False)
    first.fit(data, epochs=1, checkpoint=tmp_path / "c.npz")
    same = Trainer(linear(), loss="mse", optimizer="sgd", lr=0.05, batch_size=16, progress=False)
    same.load_checkpoint(tmp_path / "c.npz")
    assert same.changed_since_checkpoint == {}
    other = Trainer(
        linear(), loss="mse", optimizer="sgd", lr=0.1, batch_size=8, clip_norm=1.0, progress=False
    )
    with pytest.warns(UserWarning, match=r"settings changed since the checkpoint: batch_size 16 -> 8; "
                      r"clip_norm None -> 1\.0; lr 0\.05 -> 0\.1"):  # fmt: skip
        other.fit(data, epochs=2, resume=tmp_path / "c.npz")
    assert other.epoch == 2


@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulation_applies_the_leftover_batches(accumulate):
    """5 batches, accumulate=2: 3 updates per epoch, the last on the leftover batch alone (3: 2
    updates, the last on 2 batches). Each update is the gradient of the mean loss over the samples
    of the batches it accumulated, as one batch of their concatenation would give (not torch's
    plain ``loss / accumulate`` recipe, which would shrink the leftover update by 1/accumulate)."""
    n, batch, epochs = 10, 2, 2
    data = regression_data(n)
    trainer = Trainer(
        linear(), loss="mse", optimizer="sgd", lr=0.1, batch_size=batch, shuffle=False,
        accumulate=accumulate, progress=False,
    )  # fmt: skip
    trainer.fit(data, epochs=epochs)
    per_epoch = math.ceil(n // batch / accumulate)
    assert per_epoch == {2: 3, 3: 2}[accumulate]
    assert trainer.updates == trainer.optimizer.iterations == epochs * per_epoch

    inits = {i.name: numpy_helper.to_array(i) for i in linear().graph.initializer}
    w, b = (torch.tensor(inits[k], requires_grad=True) for k in ("W", "b"))
    opt = torch.optim.SGD([w, b], lr=0.1)
    group = batch * accumulate
    for _ in range(epochs):
        for lo in range(0, n, group):  # the last group holds the leftover batches
            x, t = torch.tensor(data["x"][lo : lo + group]), torch.tensor(data["target"][lo : lo + group])
            opt.zero_grad()
            torch.nn.functional.mse_loss(x @ w + b, t).backward()
            opt.step()
    np.testing.assert_allclose(trainer.parameters["W"], w.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(trainer.parameters["b"], b.detach().numpy(), rtol=1e-12, atol=1e-14)
