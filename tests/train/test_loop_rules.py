"""One rule through every door of the training loop: validation losses and accuracies over the
labels that count whatever the eval batch size, a schedule held by one trainer, token ids in
[0, rows), optimizer hyperparameters within float32, schedules checked when made, targets (N,)
for outputs (N, 1) in the Runner too."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnxgrad.errors import InputError
from onnxgrad.train import EarlyStopping, Trainer, accuracy_metric
from onnxgrad.train.callbacks import accuracy
from tests.train.test_loop_contract import class_data
from tests.train.test_trainer import linear

torch = pytest.importorskip("torch")


# ---- 1. val_loss: batches whose normalizer is 0 add nothing --------------------------------------
@pytest.mark.parametrize("options", [{}, {"weight_name": "w"}])
@pytest.mark.parametrize("eval_batch", [4, 5, 16])
def test_val_loss_is_the_whole_sets_when_an_eval_batch_counts_nothing(options, eval_batch):
    """The first 4 labels ignored (or weighing 0): an eval batch of 4 had loss 0/0, and val_loss
    was NaN (EarlyStopping then never improved and stopped the run)."""
    data = class_data(16, ignored=0)
    if "weight_name" in options:
        data["w"][:4] = 0.0
    else:
        data["target"][:4] = -100
        del data["w"]
    t = Trainer(
        linear(), loss="cross_entropy", loss_options=options, eval_batch_size=eval_batch, progress=False
    )
    from onnx import numpy_helper

    W, b = (torch.tensor(numpy_helper.to_array(i)) for i in linear().graph.initializer)
    per = torch.nn.functional.cross_entropy(
        torch.tensor(data["x"]) @ W + b, torch.tensor(data["target"]), reduction="none"
    )
    w = torch.tensor(data["w"]) if "w" in data else (torch.tensor(data["target"]) != -100).double()
    expected = float((per * w).sum() / w.sum())
    assert t.evaluate(data)["loss"] == pytest.approx(expected, rel=1e-12)
    h = t.fit(data, data, epochs=1)
    assert math.isfinite(h["val_loss"][0])


# ---- 2. accuracy over the labels that count ------------------------------------------------------
def test_accuracy_leaves_ignored_labels_out_and_weighs_samples():
    logits = np.array([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0]])
    labels = np.array([0, 1, -100, 0])
    assert accuracy(logits, labels) == pytest.approx(2 / 3)  # it was 2/4: -100 counted wrong
    assert accuracy(logits, labels, weights=[1.0, 3.0, 5.0, 4.0]) == pytest.approx(4 / 8)
    assert accuracy(logits, np.array([0, 1, 0, 0]), ignore_index=None) == pytest.approx(3 / 4)
    assert math.isnan(accuracy(logits, np.full(4, -100)))


@pytest.mark.parametrize("eval_batch", [3, 4, 16])
def test_accuracy_metric_is_the_whole_sets_over_counted_labels(eval_batch):
    """val_acc of an eval batch with no counted label was NaN or 0; batches were averaged by size."""
    data = class_data(16, ignored=5)
    data["target"][:4] = -100
    del data["w"]
    t = Trainer(
        linear(), loss="cross_entropy", metrics={"acc": accuracy_metric("y")}, eval_batch_size=eval_batch,
        progress=False,
    )  # fmt: skip
    from onnx import numpy_helper

    W, b = (numpy_helper.to_array(i) for i in linear().graph.initializer)
    pred = np.argmax(data["x"] @ W + b, axis=-1)
    keep = data["target"] != -100
    assert t.evaluate(data)["acc"] == pytest.approx(np.mean(pred[keep] == data["target"][keep]), rel=1e-12)
    weighted = Trainer(
        linear(), loss="cross_entropy", loss_options={"weight_name": "w"}, eval_batch_size=eval_batch,
        metrics={"acc": accuracy_metric("y", weight="w")}, progress=False,
    )  # fmt: skip
    w = np.random.default_rng(2).uniform(0.1, 3, 16)
    expected = np.sum((pred == data["target"]) * keep * w) / np.sum(keep * w)
    assert weighted.evaluate({**data, "w": w})["acc"] == pytest.approx(expected, rel=1e-12)


def test_early_stopping_on_val_acc_is_not_fooled_by_ignored_labels():
    data = class_data(16, ignored=6)
    del data["w"]
    stopper = EarlyStopping(monitor="val_acc", patience=3)
    t = Trainer(linear(), loss="cross_entropy", metrics={"acc": accuracy_metric("y")}, callbacks=[stopper],
                eval_batch_size=4, progress=False)  # fmt: skip
    h = t.fit(data, data, epochs=2)
    assert all(0 <= a <= 1 for a in h["val_acc"]) and stopper.best == max(h["val_acc"])


# ---- 3. a ReduceLROnPlateau given to two trainers ------------------------------------------------
def test_a_plateau_given_to_two_trainers_is_not_shared():
    """Building t2 reset t1's lr to 0.1 mid-run; interleaved trainers stepped one object."""
    from onnxgrad.train.schedules import LinearWarmup, ReduceLROnPlateau
    from tests.train.test_trainer import regression_data

    plateau = ReduceLROnPlateau(0.1, monitor="loss", patience=0, factor=0.5)
    data = regression_data(16, flip=True)

    def trainer(lr):
        return Trainer(linear(), loss="mse", optimizer="sgd", lr=lr, progress=False)

    t1 = trainer(plateau)
    t1.plateau.step(1.0)
    t1.plateau.step(2.0)  # a bad epoch: halved
    assert t1.optimizer.schedule(0) == 0.05
    t2 = trainer(plateau)
    assert t1.optimizer.schedule(0) == 0.05 and t2.optimizer.schedule(0) == 0.1
    assert t1.plateau is not t2.plateau and plateau.last_epoch == 0 and plateau.current == 0.1
    alone = trainer(ReduceLROnPlateau(0.1, monitor="loss", patience=0, factor=0.5))
    a, b = trainer(plateau), trainer(LinearWarmup(plateau, warmup_steps=1))
    for _ in range(3):  # in turn: each as if it ran alone
        for t in (a, b, alone):
            t.fit(data, epochs=t.epoch + 1)
    assert a.history["lr"] == alone.history["lr"]
    assert b.plateau is not plateau and b.plateau.last_epoch == 3 and plateau.last_epoch == 0


# ---- 4. token ids in [0, rows) by every door -----------------------------------------------------
def lm():
    """``y = mean(emb[ids], axis=1)``: a 10-row, 3-wide embedding table."""
    import onnx
    from onnx import helper, numpy_helper

    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),
        helper.make_node("ReduceMean", ["e"], ["y"], axes=[1], keepdims=0),
    ]
    table = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32), "emb"
    )
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])], [table],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("bad", [-1, -10, 10])
def test_negative_token_ids_are_refused_by_every_door(tmp_path, bad):
    """-1 was read as the last row (torch's nn.Embedding raises); the Runner checked no id."""
    from onnxgrad.artifacts import Runner, generate

    ids = np.random.default_rng(1).integers(0, 10, (6, 4))
    ids[3, 2] = bad
    data = {"ids": ids, "target": np.zeros((6, 3), np.float32)}
    message = (
        rf"input 'ids' of {{}} holds index {bad} at row 3 \(position \[3, 2\]\), outside the 10 rows "
        r"of 'emb' that Gather #\d reads \(indices must lie in \[0, 10\)"
    )
    with pytest.raises(InputError, match=message.format("the training data")):
        Trainer(lm(), loss="mse", progress=False).fit(data, epochs=1)
    generate(lm(), loss="mse", out_dir=tmp_path)
    runner = Runner(tmp_path)
    for run in (runner.step, runner.evaluate):
        with pytest.raises(InputError, match=message.format("the batch")):
            run(data)
    data["ids"][3, 2] = 9
    assert math.isfinite(runner.step(data))


# ---- 5. optimizer hyperparameters within float32 -------------------------------------------------
@pytest.mark.parametrize(
    ("optimizer", "options", "message"),
    [
        (
            "adamw",
            {"weight_decay": 1e39},
            r"weight_decay must fit in float32 \(at most 3\.403e\+38 in size\), got 1e\+39",
        ),
        (
            "sgd",
            {"momentum": np.float64(1e39)},
            r"momentum must fit in float32 .*, got (np\.float64\()?1e\+39",
        ),
        ("adam", {"eps": 1e300}, r"eps must fit in float32"),
        ("sgd", {"weight_decay": "0.1"}, r"weight_decay must be a number, got '0\.1'"),
        ("sgd", {"momentum": True}, r"momentum must be a number, got True"),
    ],
)
def test_hyperparameters_beyond_float32_are_refused_by_every_door(
    tmp_path, capsys, optimizer, options, message
):
    """weight_decay=1e39 overflowed float32 in the update (inf parameters, a raw RuntimeWarning)."""
    from onnxgrad.artifacts import generate
    from onnxgrad.train.optimizers import definition

    with pytest.raises(InputError, match=message):
        definition(optimizer).resolve(options)
    with pytest.raises(InputError, match=message):
        Trainer(linear(dtype=np.float32), loss="mse", optimizer=optimizer, optimizer_options=options)
    with pytest.raises(InputError, match=message):
        generate(linear(dtype=np.float32), loss="mse", optimizer=optimizer, optimizer_options=options,
                 out_dir=tmp_path)  # fmt: skip


# ---- 6. resuming with other callbacks ------------------------------------------------------------
def test_resume_restores_the_callbacks_that_match_by_kind(tmp_path):
    """The count had to match: any callback added or dropped refused the checkpoint."""
    from onnxgrad.train import HistoryFile
    from tests.train.test_trainer import regression_data

    ckpt = tmp_path / "c.npz"
    data, val = regression_data(16), regression_data(8, seed=2)
    stopper = EarlyStopping(patience=5)
    Trainer(linear(), loss="mse", callbacks=[stopper], progress=False).fit(
        data, val, epochs=2, checkpoint=ckpt
    )
    again = EarlyStopping(patience=5)
    t = Trainer(linear(), loss="mse", callbacks=[HistoryFile(tmp_path / "h.csv"), again], progress=False)
    with pytest.warns(UserWarning, match=r"other callbacks than the checkpoint's \(matched by kind, the "
                      r"others restored\): added \['HistoryFile'\] \(starting afresh\)$"):  # fmt: skip
        t.fit(data, val, epochs=3, resume=ckpt)
    assert again.best_epoch >= stopper.best_epoch > 0 and t.epoch == 3
    bare = Trainer(linear(), loss="mse", progress=False)
    with pytest.warns(
        UserWarning, match=r"restored\): dropped \['EarlyStopping'\] \(their states left out\)$"
    ):
        bare.fit(data, val, epochs=3, resume=ckpt)


# ---- 7, 8. schedules checked when made; one warm-up warning; lr=None the default ---------------
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda s: s.LinearWarmup(0.01, warmup_steps=2.5), r"warmup_steps must be an integer >= 1, got 2\.5"),
        (lambda s: s.LinearWarmup(0.01, warmup_steps="3"), r"warmup_steps must be an integer >= 1, got '3'"),
        (lambda s: s.LinearWarmup(0.01, warmup_steps=-5), r"warmup_steps must be an integer >= 1, got -5"),
        (lambda s: s.Cosine(0.01, total_steps=True), r"total_steps must be an integer >= 1, got True"),
        (lambda s: s.StepDecay(0.01, step_size=0.5), r"step_size must be an integer >= 1, got 0\.5"),
        (lambda s: s.Cosine(math.inf, total_steps=10), r"lr must be >= 0, got inf"),
        (lambda s: s.StepDecay(math.nan, step_size=2), r"lr must be >= 0, got nan"),
        (lambda s: s.InverseScaling(-0.1), r"lr must be >= 0, got -0\.1"),
        (lambda s: s.ReduceLROnPlateau(math.inf), r"lr must be >= 0, got inf"),
        (lambda s: s.ReduceLROnPlateau(0.1, factor="x"), r"factor must be a number, got 'x'"),
        (
            lambda s: s.Cosine(0.01, total_steps=10, min_lr=math.inf),
            r"min_lr must be a finite number, got inf",
        ),
    ],
)
def test_schedules_check_their_arguments_when_made(make, message):
    """Cosine(inf) was made and failed at its first use; warmup_steps=2.5 ran as 2; "3" and a
    string lr were raw TypeErrors."""
    from onnxgrad.train import schedules

    with pytest.raises(InputError, match=message):
        make(schedules)


@pytest.mark.parametrize("make", ["Cosine", "StepDecay", "InverseScaling", "ReduceLROnPlateau"])
def test_a_schedules_lr_goes_through_the_one_lr_check(monkeypatch, make):
    """Whatever rule check_lr has (a string, lr beyond float32...), every schedule applies it."""
    from onnxgrad.train import schedules

    def refuse(lr):
        raise InputError(f"refused {lr!r}")

    monkeypatch.setattr(schedules, "check_lr", refuse)
    args = {"Cosine": (10,), "StepDecay": (2,)}.get(make, ())
    with pytest.raises(InputError, match=r"refused '0\.01'"):
        getattr(schedules, make)("0.01", *args)


def test_a_warmup_longer_than_the_run_is_said_by_the_trainer():
    """The CLI said it, the Trainer did not: the rule is below both (warmup_past_run)."""
    from onnxgrad.train import LinearWarmup
    from tests.train.test_trainer import regression_data

    t = Trainer(linear(), loss="mse", lr=LinearWarmup(0.01, warmup_steps=100), batch_size=4, progress=False)
    with pytest.warns(UserWarning, match=r"^the warm-up of 100 updates is as long as the run or longer \(4 "
                      r"updates: 1 epochs of 4\): the learning rate never reaches 0\.01$"):  # fmt: skip
        t.fit(regression_data(16), epochs=1)
    import warnings

    short = Trainer(linear(), loss="mse", lr=LinearWarmup(0.01, warmup_steps=3), batch_size=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short.fit(regression_data(16), epochs=1)


def test_generate_takes_lr_none_as_the_default(tmp_path):
    from onnxgrad.artifacts import Runner, generate
    from onnxgrad.train.optimizers import DEFAULT_LR

    generate(linear(dtype=np.float32), loss="mse", lr=None, out_dir=tmp_path)
    assert Runner(tmp_path).lr == DEFAULT_LR == Runner(tmp_path, lr=None).lr


# ---- 9. targets (N,) for an output (N, 1), in the Runner too ------------------------------------
def test_the_runner_takes_targets_without_the_trailing_axis_as_the_trainer(tmp_path):
    """Runner.step wanted the target as (N, 1) where Trainer and CLI take (N,)."""
    from onnx import helper

    from onnxgrad.artifacts import Runner, generate
    from tests.models import make_model

    rng = np.random.default_rng(0)
    W = rng.standard_normal((3, 1)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"])], [("x", np.float32, ["N", 3])],
                       [("y", np.float32, ["N", 1])], {"W": W})  # fmt: skip
    generate(model, loss="mse", optimizer="sgd", lr=0.1, out_dir=tmp_path)
    x, y = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    flat, column = Runner(tmp_path), Runner(tmp_path)
    assert (
        flat.evaluate({"x": x, "target": y})["loss"]
        == column.evaluate({"x": x, "target": y[:, None]})["loss"]
    )
    assert flat.step({"x": x, "target": y}) == column.step({"x": x, "target": y[:, None]})
    np.testing.assert_array_equal(flat.parameters["W"], column.parameters["W"])
    t = Trainer(model, loss="mse", optimizer="sgd", lr=0.1, batch_size=5, shuffle=False, progress=False)
    t.fit({"x": x, "target": y}, epochs=1)
    np.testing.assert_allclose(t.parameters["W"], flat.parameters["W"], rtol=1e-5)


# ---- 11. a progress bar per epoch, as the docs say ------------------------------------------------
def test_one_progress_bar_per_epoch(monkeypatch):
    """One bar ran over the whole run, where docs/finetune.md says a tqdm bar per epoch."""
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, *args, total=0, desc="", **kwargs):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            bars.append(self)

        def set_description(self, desc, refresh=True):
            self.desc = desc

        def set_postfix(self, *args, **kwargs): ...

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    from tests.train.test_trainer import regression_data

    Trainer(linear(), loss="mse", batch_size=4).fit(regression_data(10), epochs=3)
    assert [(b.desc, b.total, b.n, b.closed) for b in bars] == [
        (f"epoch {e}/3", 3, 3, True) for e in (1, 2, 3)
    ]


def test_an_extra_validation_array_without_metrics_names_the_data_and_the_way_out():
    from tests.train.test_trainer import regression_data

    t = Trainer(linear(), loss="mse", progress=False)
    val = {**regression_data(4, seed=2), "group": np.arange(4)}
    with pytest.raises(
        InputError,
        match=r"^the validation data has arrays \['group'\] that are not model inputs \(\['x', 'target'\]\): "
        r"a trainer with metrics= passes such arrays \(extra targets\) to its metrics",
    ):
        t.fit(regression_data(8), val, epochs=1)
