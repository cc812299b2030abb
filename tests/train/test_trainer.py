"""The Trainer: the same updates as a hand-written torch loop, checkpoints that resume exactly,
validation, early stopping, callbacks, the progress bar and the loss plot."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgrad.errors import InputError, OnnxGradRuntimeError
from onnxgrad.testing import assert_allclose_scaled
from onnxgrad.train import SGD, Callback, Cosine, EarlyStopping, LinearWarmup, Trainer
from tests.models import make_model

torch = pytest.importorskip("torch")

F_IN, F_OUT = 3, 2


def linear(seed: int = 0, dtype: type = np.float64) -> onnx.ModelProto:
    """``y = x @ W + b`` with random W, b."""
    rng = np.random.default_rng(seed)
    from onnx import helper

    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])]
    inits = {"W": rng.standard_normal((F_IN, F_OUT)).astype(dtype), "b": np.zeros(F_OUT, dtype)}
    return make_model(nodes, [("x", dtype, ["N", F_IN])], [("y", dtype, ["N", F_OUT])], inits)


def regression_data(n: int, seed: int = 1, flip: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, F_IN))
    true_w = np.arange(F_IN * F_OUT).reshape(F_IN, F_OUT) / 3 * (-1 if flip else 1)
    return {"x": x, "target": x @ true_w + 0.05 * rng.standard_normal((n, F_OUT))}


@pytest.mark.parametrize("drop_last", [False, True])
def test_same_updates_as_a_torch_loop(drop_last):
    """Shuffled mini-batches (seeded), SGD with Nesterov momentum and a warm-up + cosine schedule:
    the parameters and the epoch losses equal a torch loop fed the same batches."""
    model, data = linear(), regression_data(45)
    sched = LinearWarmup(Cosine(0.05, total_steps=20), warmup_steps=4)
    trainer = Trainer(
        model,
        loss="mse",
        optimizer=lambda p: SGD(p, lr=sched, momentum=0.9, nesterov=True),
        batch_size=8,
        drop_last=drop_last,
        seed=3,
        progress=False,
    )
    history = trainer.fit(data, epochs=4)

    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    w, b = (torch.tensor(inits[k], requires_grad=True) for k in ("W", "b"))
    opt = torch.optim.SGD([w, b], lr=1.0, momentum=0.9, nesterov=True)
    rng, step, losses = np.random.default_rng(3), 0, []
    for _ in range(4):
        order = rng.permutation(45)
        stop = 45 - 45 % 8 if drop_last else 45
        total = 0.0
        for lo in range(0, stop, 8):
            idx = order[lo : min(lo + 8, stop)]
            x, t = torch.tensor(data["x"][idx]), torch.tensor(data["target"][idx])
            loss = torch.nn.functional.mse_loss(x @ w + b, t)
            opt.zero_grad()
            loss.backward()
            opt.param_groups[0]["lr"] = sched(step)
            opt.step()
            step += 1
            total += loss.item() * len(idx)
        losses.append(total / stop)
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-12)
    np.testing.assert_allclose(trainer.parameters["W"], w.detach().numpy(), rtol=1e-11)
    np.testing.assert_allclose(trainer.parameters["b"], b.detach().numpy(), rtol=1e-11, atol=1e-14)
    assert trainer.optimizer.iterations == step == (20 if drop_last else 24)
    assert losses[-1] < losses[0] / 4


def test_validation_metrics_history_and_export():
    model, data, val = linear(dtype=np.float32), regression_data(64), regression_data(32, seed=2)
    mae = lambda outputs, batch: float(np.abs(outputs["y"] - batch["target"]).mean())
    trainer = Trainer(model, loss="mse", lr=0.05, batch_size=16, progress=False, metrics={"mae": mae})
    history = trainer.fit(data, val, epochs=5)  # float64 data cast to the model's float32
    assert history.keys() == ["epoch", "loss", "lr", "val_loss", "val_mae", "seconds"]
    assert history["epoch"] == [1, 2, 3, 4, 5] and history["lr"] == [0.05] * 5
    assert history["val_loss"][-1] < history["val_loss"][0] / 3
    assert history["val_mae"][-1] < history["val_mae"][0]
    assert trainer.evaluate(val)["loss"] == pytest.approx(history["val_loss"][-1], rel=1e-6)
    # the trained inference model: no target input, no loss output, the trained weights
    exported = trainer.to_onnx()
    assert [i.name for i in exported.graph.input] == ["x"]
    assert [o.name for o in exported.graph.output] == ["y"]
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    x = val["x"].astype(np.float32)
    expected = x @ trainer.parameters["W"] + trainer.parameters["b"]
    assert_allclose_scaled(sess.run(None, {"x": x})[0], expected, rtol=1e-5)
    # fit() again continues up to the new total
    assert len(trainer.fit(data, epochs=7)) == 7


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append("begin")

    def on_epoch_begin(self, trainer, epoch):
        self.events.append(f"epoch{epoch}")

    def on_batch_end(self, trainer, step, logs):
        self.events.append(f"batch{step}:{logs['batch_size']}")

    def on_epoch_end(self, trainer, epoch, logs):
        self.events.append(f"end{epoch}:{sorted(logs)}")

    def on_train_end(self, trainer):
        self.events.append("done")


def test_callbacks_and_stop_training():
    rec = Recorder()

    def stop_after_two(trainer, epoch, logs):
        trainer.stop_training = epoch == 2

    trainer = Trainer(linear(), loss="mse", batch_size=4, callbacks=[rec, stop_after_two], progress=False)
    history = trainer.fit(regression_data(10), epochs=5)
    assert len(history) == 2 and trainer.epoch == 2
    logs = "['epoch', 'loss', 'lr', 'seconds']"
    assert rec.events == [
        "begin",
        "epoch1",
        "batch0:4",
        "batch1:4",
        "batch2:2",
        f"end1:{logs}",
        "epoch2",
        "batch0:4",
        "batch1:4",
        "batch2:2",
        f"end2:{logs}",
        "done",
    ]


def test_early_stopping_restores_the_best_weights():
    """Validation data that disagrees with the training data: val_loss rises after the first epochs."""
    kept = {}

    def keep(trainer, epoch, logs):
        kept[epoch] = {k: v.copy() for k, v in trainer.parameters.items()}

    stopper = EarlyStopping(patience=2)
    trainer = Trainer(linear(), loss="mse", lr=0.1, batch_size=8, callbacks=[keep, stopper], progress=False)
    history = trainer.fit(regression_data(64), regression_data(64, seed=5, flip=True), epochs=30)
    val = history["val_loss"]
    best = int(np.argmin(val)) + 1
    assert len(history) == best + 2 < 30  # two epochs without improvement, then stop
    assert stopper.best_epoch == best and stopper.stopped_epoch == best + 2
    for name, value in trainer.parameters.items():
        np.testing.assert_array_equal(value, kept[best][name])
        assert not np.array_equal(value, kept[best + 2][name])


def test_checkpoint_resume_gives_the_uninterrupted_run(tmp_path):
    """Stop after 3 of 6 epochs, resume in a new trainer: the same losses, bit for bit."""
    data, val = regression_data(50), regression_data(20, seed=2)

    def make():
        return Trainer(
            linear(),
            loss="huber",
            optimizer="adamw",
            lr=LinearWarmup(Cosine(0.05, 30), warmup_steps=5),
            batch_size=8,
            drop_last=True,
            seed=11,
            callbacks=[EarlyStopping(patience=10)],
            progress=False,
        )

    full = make().fit(data, val, epochs=6)
    path = tmp_path / "ckpt" / "run.npz"
    first = make()
    first.fit(data, val, epochs=3, checkpoint=path)
    resumed = make()
    history = resumed.fit(data, val, epochs=6, resume=path)
    assert len(history) == 6
    assert history["loss"] == full["loss"] and history["val_loss"] == full["val_loss"]
    assert history["lr"] == full["lr"]
    again = make()
    again.fit(data, val, epochs=6)
    for name, value in resumed.parameters.items():
        np.testing.assert_array_equal(value, again.parameters[name])
    assert resumed.callbacks[0].best == again.callbacks[0].best
    # a checkpoint belongs to one model and one optimizer
    other = Trainer(
        linear(), loss="mse", optimizer="sgd", lr=0.1, progress=False, callbacks=[EarlyStopping()]
    )
    with pytest.raises(InputError, match="was written with AdamW, this trainer uses SGD"):
        other.load_checkpoint(path)
    with pytest.raises(InputError, match="does not exist"):
        other.load_checkpoint(tmp_path / "nope.npz")


def test_progress_bar_shows_the_loss(capsys):
    Trainer(linear(), loss="mse", batch_size=16).fit(regression_data(32), regression_data(8), epochs=2)
    err = capsys.readouterr().err
    assert "epoch 1/2" in err and "epoch 2/2" in err and "2/2 [" in err  # 2 epochs of 2 batches
    assert "loss=" in err and "val_loss=" in err
    assert err.count("\n") == 2, err  # a bar per epoch, as docs/finetune.md says: a line each


def test_plot_writes_a_png(tmp_path):
    import matplotlib.image

    trainer = Trainer(linear(), loss="mse", lr=0.05, batch_size=16, progress=False)
    trainer.fit(regression_data(32), regression_data(16), epochs=4)
    path = trainer.plot(tmp_path / "plots" / "curves.png", title="linear")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (400, 640)
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_non_finite_loss_stops_with_a_clear_error():
    data = regression_data(8)
    data["x"][3, 0] = np.nan
    trainer = Trainer(linear(), loss="mse", batch_size=4, shuffle=False, progress=False)
    with pytest.raises(OnnxGradRuntimeError, match="the loss is nan at epoch 1, batch 1"):
        trainer.fit(data)


def test_errors():
    with pytest.raises(
        InputError, match=r"the model has no output 'loss' \(outputs: \['y'\]\); pass loss= to append one"
    ):
        Trainer(linear())
    with pytest.raises(InputError, match="unknown optimizer 'lbfgs'"):
        Trainer(linear(), loss="mse", optimizer="lbfgs")
    with pytest.raises(InputError, match="factory sets its own lr"):
        Trainer(linear(), loss="mse", optimizer=lambda p: SGD(p, lr=0.1), lr=0.1)
    trainer = Trainer(linear(), loss="mse", callbacks=[EarlyStopping()], progress=False)
    with pytest.raises(InputError, match="monitors 'val_loss' but fit\\(\\) got no validation data"):
        trainer.fit(regression_data(8))
    with pytest.raises(InputError, match=r"no array for input\(s\) \['target'\]"):
        trainer.fit({"x": np.zeros((4, F_IN))})
    with pytest.raises(InputError, match=r"input 'x' expects shape \[N, 3\], the data has shape \(4, 2\)"):
        trainer.fit({"x": np.zeros((4, 2)), "target": np.zeros((4, F_OUT))})


def test_only_the_loss_takes_a_gradient():
    """A ForwardBackward whose other outputs could take gradients too: the trainer seeds the loss
    alone, so it trains exactly like a trainer built from the model."""
    from onnxgrad import ForwardBackward
    from onnxgrad.train import add_loss

    every_output = ForwardBackward(add_loss(linear(), "mse"))  # y and loss both take a gradient
    assert set(every_output.graphs.grad_inputs) == {"y", "loss"}
    kwargs = {"optimizer": "sgd", "lr": 0.1, "batch_size": 4, "shuffle": False, "progress": False}
    a = Trainer(every_output, **kwargs)
    b = Trainer(linear(), loss="mse", **kwargs)
    data = regression_data(12)
    assert a.fit(data, epochs=2)["loss"] == b.fit(data, epochs=2)["loss"]
    for name, value in a.parameters.items():
        np.testing.assert_array_equal(value, b.parameters[name])


def test_the_split_modules_keep_the_old_import_paths():
    """train/trainer.py was split by idea (callbacks, history, checkpoint, accumulate): every name
    it exported is still importable from it, the very same object."""
    from onnxgrad.train import callbacks, checkpoint, history, trainer

    for name in ("Callback", "EarlyStopping", "HistoryFile", "accuracy", "accuracy_metric", "Metric"):
        assert getattr(trainer, name) is getattr(callbacks, name)
    assert trainer.History is history.History
    assert trainer.CHECKPOINT_FORMAT == checkpoint.CHECKPOINT_FORMAT
    assert set(trainer.__all__) <= set(dir(trainer))
