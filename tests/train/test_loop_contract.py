"""The training loop's contract with its losses: class labels as torch takes them (ignore_index
skipped, any other label outside [0, C) refused before anything runs, NaN in a graph that runs
anyway), batches combined by the loss's own normalizer (sample weights, ignored labels,
reduction="sum") in accumulation and in validation, empty data refused, metrics that read extra
targets, EarlyStopping's direction, a ReduceLROnPlateau reused by a second trainer, the progress
bar's epoch."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnxgrad.errors import InputError
from onnxgrad.train import Callback, EarlyStopping, Trainer, add_loss
from onnxgrad.train.callbacks import infer_mode
from onnxgrad.train.losses import check_labels, loss_spec, remove_loss
from onnxgrad.train.schedules import ReduceLROnPlateau
from tests.models import make_model
from tests.train.test_trainer import linear, regression_data

torch = pytest.importorskip("torch")

C = 2  # linear()'s outputs: the classes of a class loss


def class_data(n: int, seed: int = 3, ignored: int = 0) -> dict[str, np.ndarray]:
    """Features, labels in [0, C) (``ignored`` of them -100) and sample weights in U(0.1, 3)."""
    rng = np.random.default_rng(seed)
    target = rng.integers(0, C, n)
    target[rng.permutation(n)[:ignored]] = -100
    return {"x": rng.standard_normal((n, 3)), "target": target, "w": rng.uniform(0.1, 3, n)}


def scores(shape: list) -> object:
    """``y = Identity(x)``, float32 scores of ``shape``."""
    from onnx import helper

    node = helper.make_node("Identity", ["x"], ["y"])
    return make_model([node], [("x", np.float32, shape)], [("y", np.float32, shape)], {})


def session(model) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


# ---- labels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cross_entropy", "nll"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignore_index_as_torch(kind, weighted, reduction):
    """-100 labels add nothing; the mean is over the others (weighted: Σ w l / Σ w over them)."""
    model = add_loss(linear(), kind, weight_name="w" if weighted else None, reduction=reduction)
    data = class_data(12, ignored=4)
    feeds = {k: v for k, v in data.items() if weighted or k != "w"}
    ours = session(model).run(["loss"], feeds)[0]
    from onnx import numpy_helper

    W, b = (torch.tensor(numpy_helper.to_array(i)) for i in linear().graph.initializer)
    scores = torch.tensor(data["x"]) @ W + b
    fn = torch.nn.functional.cross_entropy if kind == "cross_entropy" else torch.nn.functional.nll_loss
    t = torch.tensor(data["target"])
    if weighted:  # torch's weights are per class: per sample, weigh the unreduced losses
        per = fn(scores, t, reduction="none") * torch.tensor(data["w"])
        keep = (t != -100).double() * torch.tensor(data["w"])
        expected = per.sum() if reduction == "sum" else per.sum() / keep.sum()
    else:
        expected = fn(scores, t, reduction=reduction)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-12)


def test_ignore_index_per_position_and_other_values():
    """Rank-3 scores, a chosen ignore_index inside [0, C) (its rows skipped too)."""
    model = add_loss(scores(["N", 3, 4]), "cross_entropy", ignore_index=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    t = rng.integers(0, 3, (2, 4))
    ours = session(model).run(["loss"], {"x": x, "target": t})[0]
    expected = torch.nn.functional.cross_entropy(torch.tensor(x), torch.tensor(t), ignore_index=1)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)


@pytest.mark.parametrize("labels", [[1, 2, 3, 1], [-1] * 4, [0, 7, -100, 2]])
def test_a_graph_fed_labels_outside_the_classes_gives_nan(labels):
    """Zero logits over 3 classes: labels [1, 2, 3, 1] gave 0.824 and [-1]*4 gave 0.0 (ln 3 is
    right for valid ones); a graph that runs anyway (the one-graph step, JS) now says NaN."""
    model = add_loss(scores(["N", 3]), "cross_entropy")
    s = session(model)
    assert np.isnan(s.run(["loss"], {"x": np.zeros((4, 3), np.float32), "target": np.array(labels)})[0])
    valid = s.run(["loss"], {"x": np.zeros((4, 3), np.float32), "target": np.array([0, 1, 2, -100])})[0]
    assert valid == pytest.approx(np.log(3), rel=1e-6)


def test_the_loss_spec_is_recorded_and_removed_with_the_loss():
    model = add_loss(linear(), "nll", weight_name="w", ignore_index=-1)
    spec = loss_spec(model)
    assert (spec.kind, spec.target, spec.weight, spec.classes, spec.ignore_index) == (
        "nll",
        "target",
        "w",
        C,
        -1,
    )
    assert loss_spec(remove_loss(model)) is None
    assert loss_spec(add_loss(linear(), "mse")).ignore_index is None


def test_labels_outside_the_classes_are_refused_before_anything_runs():
    trainer = Trainer(linear(), loss="cross_entropy", lr=0.1, batch_size=4, progress=False)
    before = {k: v.copy() for k, v in trainer.parameters.items()}
    data = class_data(8)
    del data["w"]
    bad = {**data, "target": np.array([0, 1, 1, 0, 5, 0, 1, 0])}
    message = (
        r"the target 'target' of the training data holds class 5 at row 4: class labels must lie in "
        r"\[0, 2\); only ignore_index -100 may lie outside \(1 such label"
    )
    with pytest.raises(InputError, match=message):
        trainer.fit(bad, epochs=1)
    with pytest.raises(InputError, match=r"of the validation data holds class -1 at row 2"):
        trainer.fit(data, {**data, "target": np.array([0, 1, -1, 0, 1, 0, 1, 0])}, epochs=1)
    with pytest.raises(InputError, match=r"holds class 2 at row 0"):
        trainer.evaluate({**data, "target": np.full(8, 2)})
    for k, v in trainer.parameters.items():
        np.testing.assert_array_equal(v, before[k])
    assert trainer.epoch == 0
    with_ignored = class_data(8, ignored=3)
    del with_ignored["w"]
    trainer.fit(with_ignored, epochs=1)  # -100 is skipped, not refused
    assert trainer.epoch == 1


def test_check_labels_names_the_position():
    with pytest.raises(InputError, match=r"holds class -3 at row 1 \(position \[1, 2\]\).*\[0, C\)"):
        check_labels(np.array([[0, 1, 2], [1, 0, -3]]), None, None)
    check_labels(np.array([0, 99]), None)  # a symbolic class count: the graph's NaN covers the top


# ---- batches combined by the loss's normalizer ------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "options", "ignored"),
    [
        ("mse", {"weight_name": "w"}, 0),
        ("mse", {"reduction": "sum"}, 0),
        ("cross_entropy", {"weight_name": "w"}, 5),
        ("cross_entropy", {}, 5),
        ("nll", {"reduction": "sum", "weight_name": "w"}, 3),
    ],
)
def test_accumulation_and_validation_equal_the_concatenated_batch(kind, options, ignored):
    """accumulate=2 over batches of 6 == one update on all 12 samples, and val_loss over eval
    batches of 5 == the loss of the whole validation set. Weighted, the parameters were 3.2e-3 off
    (batches averaged by count, not weight); with sum, the update was halved."""
    data = (
        class_data(12, ignored=ignored)
        if kind != "mse"
        else {**regression_data(12), "w": class_data(12)["w"]}
    )
    val = (
        class_data(13, seed=8, ignored=ignored)
        if kind != "mse"
        else {**regression_data(13, seed=8), "w": class_data(13, seed=8)["w"]}
    )
    if "weight_name" not in options:
        data, val = ({k: v for k, v in d.items() if k != "w"} for d in (data, val))

    def trainer(batch: int, eval_batch: int) -> Trainer:
        return Trainer(
            linear(), loss=kind, loss_options=options, optimizer="sgd", lr=0.1, batch_size=batch,
            shuffle=False, accumulate=2 if batch < 12 else 1, eval_batch_size=eval_batch, progress=False,
        )  # fmt: skip

    micro, whole = trainer(6, 5), trainer(12, 13)
    hm, hw = micro.fit(data, val, epochs=1), whole.fit(data, val, epochs=1)
    for name, p in whole.parameters.items():
        np.testing.assert_allclose(micro.parameters[name], p, rtol=1e-12, atol=1e-14)
    # the epoch's loss and val_loss, at the same parameters for val_loss
    assert hm["loss"][0] == pytest.approx(hw["loss"][0], rel=1e-12)
    assert hm["val_loss"][0] == pytest.approx(hw["val_loss"][0], rel=1e-12)
    assert micro.evaluate(val)["loss"] == pytest.approx(whole.evaluate(val)["loss"], rel=1e-12)


# ---- empty data, extra targets ----------------------------------------------------------------
def test_empty_data_is_refused():
    trainer = Trainer(linear(), loss="mse", progress=False)
    empty = {"x": np.zeros((0, 3)), "target": np.zeros((0, 2))}
    with pytest.raises(InputError, match="the training data has 0 samples: there is nothing to train on"):
        trainer.fit(empty, epochs=1)
    with pytest.raises(InputError, match="the validation data has 0 samples"):
        trainer.fit(regression_data(4), empty, epochs=1)
    with pytest.raises(InputError, match="the data has 0 samples"):
        trainer.evaluate(empty)


def test_metrics_read_extra_targets_of_the_validation_data():
    """A second target (not a model input) reaches the metrics in `batch`; not the model."""
    seen = []

    def second(outputs, batch):
        seen.append(sorted(batch))
        return float(np.mean(np.abs(outputs["y"][:, 0] - batch["other"])))

    trainer = Trainer(linear(), loss="mse", metrics={"other": second}, eval_batch_size=3, progress=False)
    val = {**regression_data(7, seed=2), "other": np.arange(7.0)}
    h = trainer.fit(regression_data(8), val, epochs=1)
    assert seen[0] == ["other", "target", "x"] and len(seen) == 3  # 3 eval batches
    y = session(linear()).run(["y"], {"x": val["x"]})  # before training: only to check the shape
    assert np.isfinite(h["val_other"][0]) and y[0].shape == (7, 2)
    expected = trainer.evaluate(val)["other"]
    out = session(remove_loss(trainer.fb.to_onnx())).run(["y"], {"x": val["x"]})[0]
    assert expected == pytest.approx(np.mean(np.abs(out[:, 0] - val["other"])), rel=1e-12)
    with pytest.raises(
        InputError, match=r"the array 'other' \(for the metrics\) has shape \(2,\), the model inputs have 7"
    ):
        trainer.evaluate({**val, "other": np.zeros(2)})
    plain = Trainer(linear(), loss="mse", progress=False)  # no metrics: an extra array is a mistake
    with pytest.raises(InputError, match=r"the data has arrays \['other'\] that are not model inputs"):
        plain.evaluate(val)


# ---- EarlyStopping's direction -----------------------------------------------------------------
def test_infer_mode():
    assert [infer_mode(m) for m in ("val_acc", "acc", "val_accuracy", "val_auc", "f1")] == ["max"] * 5
    assert [infer_mode(m) for m in ("val_loss", "loss", "val_mae", "dice_loss", "acc_error")] == ["min"] * 5


@pytest.mark.parametrize(("mode", "monitor"), [("auto", "val_acc"), ("max", "val_acc"), ("min", "val_err")])
def test_early_stopping_follows_the_metric_direction(mode, monitor):
    """Accuracy 0.658 -> 0.675 -> 0.725 then flat: "max" keeps going while it rises and restores
    epoch 3 (it restored the 0.658 weights); an error metric the same values reversed."""
    values = [0.658, 0.675, 0.725, 0.70, 0.71]
    if monitor == "val_err":
        values = [1 - v for v in values]
    stopper = EarlyStopping(monitor=monitor, patience=2, mode=mode)

    class Logs(Callback):
        def on_epoch_end(self, trainer, epoch, logs):
            logs[monitor] = values[epoch - 1]  # the metric's figures, made up

    kept = {}

    def keep(trainer, epoch, logs):
        kept[epoch] = {k: v.copy() for k, v in trainer.parameters.items()}

    trainer = Trainer(linear(), loss="mse", lr=0.05, callbacks=[Logs(), keep, stopper], progress=False)
    trainer.fit(regression_data(16), regression_data(8, seed=2), epochs=10)
    assert (stopper.best_epoch, stopper.stopped_epoch, trainer.epoch) == (3, 5, 5)
    assert stopper.best == values[2]
    for name, value in trainer.parameters.items():
        np.testing.assert_array_equal(value, kept[3][name])
    with pytest.raises(InputError, match="mode must be 'min', 'max' or 'auto', got 'up'"):
        EarlyStopping(mode="up")


# ---- ReduceLROnPlateau reused, the progress bar ------------------------------------------------
def test_a_plateau_schedule_reused_by_a_second_trainer_starts_afresh():
    plateau = ReduceLROnPlateau(0.1, monitor="loss", patience=0, factor=0.5)
    first = Trainer(linear(), loss="mse", optimizer="sgd", lr=plateau, progress=False)
    first.fit(regression_data(16, flip=True), regression_data(8, seed=4), epochs=3)
    assert plateau.current < 0.1 or plateau.last_epoch == 3
    second = Trainer(linear(), loss="mse", optimizer="sgd", lr=plateau, progress=False)
    assert (plateau.current, plateau.best, plateau.last_epoch, plateau.num_bad_epochs) == (0.1, np.inf, 0, 0)
    assert second.optimizer.lr == 0.1


def test_the_progress_bar_shows_each_epoch_when_it_starts(monkeypatch):
    """The epoch label was set without a refresh: after fast first batches tqdm refreshes rarely,
    so the bar could say "epoch 1/2" all run long."""
    import tqdm.auto

    shown = []

    class Bar:
        def __init__(self, *args, desc="", **kwargs):
            shown.append(desc)

        def set_description(self, desc, refresh=True):
            if refresh:
                shown.append(desc)

        def set_postfix(self, *args, **kwargs): ...

        def update(self, n=1): ...

        def close(self): ...

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    Trainer(linear(), loss="mse", batch_size=4).fit(regression_data(8), epochs=3)
    assert shown[-3:] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]


# ---- the one-graph step (Python's Runner and JS run it) ------------------------------------------
def test_the_step_graph_gives_nan_for_labels_outside_the_classes_and_describes_its_loss(tmp_path):
    """The step graph runs where no Python checks the labels first (JS): a label outside [0, C)
    makes its loss NaN (the runners skip and report a non-finite loss); the loss description it
    carries lets a runner refuse such labels before the step, as the Trainer does."""
    from onnxgrad.artifacts import generate
    from onnxgrad.demo import build_mlp

    generate(build_mlp((4, 8, 3), np.random.default_rng(0)), loss="cross_entropy", out_dir=tmp_path)
    step = ort.InferenceSession(str(tmp_path / "train_step.onnx"), providers=["CPUExecutionProvider"])
    spec = loss_spec(step.get_modelmeta().custom_metadata_map)
    assert (spec.kind, spec.target, spec.classes, spec.ignore_index) == ("cross_entropy", "target", 3, -100)
    with pytest.raises(InputError, match=r"the target 'target' of the batch holds class 3 at row 3"):
        spec.check({"target": np.array([0, 1, 2, 3])}, "the batch")
    from onnxgrad.artifacts.runner import Runner

    runner = Runner(tmp_path)
    x = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    assert np.isfinite(runner.evaluate({"pixels": x, "target": np.array([0, 1, 2, -100])})["loss"])
    assert np.isnan(runner.evaluate({"pixels": x, "target": np.array([0, 1, 2, 3])})["loss"])
