"""`onnxgrad train` as the training loop's command-line door: labels outside the classes, empty
data and token ids beyond the vocabulary are one line and exit 2; the optimizer options come from
the registry (--nesterov, --betas, --eps as `artifacts` has them); --warmup longer than the run is
said; a resumed run keeps the length its schedule was made for, and says so."""

from __future__ import annotations

import csv

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxgrad.cli import main
from onnxgrad.demo import build_mlp
from onnxgrad.train.schedules import Cosine


@pytest.fixture
def classifier(tmp_path):
    """An 8-16-2 MLP and an NPZ file of 120 samples in 2 classes (8 batches of 16 per epoch)."""
    path = tmp_path / "clf.onnx"
    onnx.save(build_mlp((8, 16, 2), np.random.default_rng(0)), path)
    x = np.random.default_rng(1).standard_normal((120, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", pixels=x, label=(x[:, 0] > 0).astype(np.int64))
    return [
        "train",
        str(path),
        "--target",
        "label",
        "--loss",
        "cross_entropy",
        "--no-progress",
        "--batch-size",
        "16",
    ]


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("onnxgrad: error: "), err
    return err


def test_labels_outside_the_classes_exit_2(tmp_path, capsys, classifier):
    """Labels {0, 5} on 2 classes trained and exited 0 (the 5s added nothing to the loss)."""
    x = np.zeros((6, 8), np.float32)
    np.savez(tmp_path / "bad.npz", pixels=x, label=np.array([0, 5, 0, 5, 0, 0]))
    err = one_line_error(
        capsys, [*classifier, "--data", str(tmp_path / "bad.npz"), "-o", str(tmp_path / "o.onnx")]
    )
    assert "holds class 5 at row 1: class labels must lie in [0, 2)" in err
    assert not (tmp_path / "o.onnx").exists()
    np.savez(tmp_path / "ignored.npz", pixels=x, label=np.array([0, -100, 1, 0, 1, 0]))
    assert main([*classifier, "--data", str(tmp_path / "ignored.npz"), "-o", str(tmp_path / "o.onnx")]) == 0


def test_empty_data_exits_2(tmp_path, capsys, classifier):
    np.savez(tmp_path / "empty.npz", pixels=np.zeros((0, 8), np.float32), label=np.zeros(0, np.int64))
    err = one_line_error(
        capsys, [*classifier, "--data", str(tmp_path / "empty.npz"), "-o", str(tmp_path / "o.onnx")]
    )
    assert "empty.npz' holds 0 samples: there is nothing to train on" in err


def test_a_token_id_beyond_the_vocabulary_exits_2(tmp_path, capsys):
    """Was an onnxruntime traceback from the middle of the first epoch."""
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),
        helper.make_node("ReduceMean", ["e"], ["y"], axes=[1], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "lm",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])],
        [
            numpy_helper.from_array(
                np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32), "emb"
            )
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "lm.onnx")
    ids = np.random.default_rng(1).integers(0, 10, (20, 4))
    ids[13, 2] = 10
    np.savez(tmp_path / "ids.npz", ids=ids, y=np.zeros((20, 3), np.float32))
    argv = ["train", str(tmp_path / "lm.onnx"), "--data", str(tmp_path / "ids.npz"), "--target", "y"]
    err = one_line_error(capsys, [*argv, "--no-progress", "-o", str(tmp_path / "o.onnx")])
    assert (
        "input 'ids' of the training data holds index 10 at row 13 (position [13, 2]), outside the 10 rows"
        in err
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--optimizer", "sgd", "--momentum", "0.9", "--nesterov"], {"momentum": 0.9, "nesterov": True}),
        (
            ["--optimizer", "adam", "--betas", "0.8", "0.95", "--eps", "1e-6"],
            {"betas": (0.8, 0.95), "eps": 1e-6},
        ),
        (
            ["--optimizer", "sgd", "--dampening", "0.1", "--momentum", "0.5"],
            {"dampening": 0.1, "momentum": 0.5},
        ),
    ],
)
def test_train_takes_every_optimizer_option_of_the_registry(
    tmp_path, capsys, classifier, monkeypatch, options, expected
):
    import onnxgrad.train.trainer as trainer_module

    seen = {}
    real = trainer_module.make_optimizer

    def spy(optimizer, params, lr=None, options=None):
        seen.update(options or {})
        return real(optimizer, params, lr, options)

    monkeypatch.setattr(trainer_module, "make_optimizer", spy)
    argv = [
        *classifier,
        "--data",
        str(tmp_path / "d.npz"),
        "--epochs",
        "1",
        *options,
        "-o",
        str(tmp_path / "o.onnx"),
    ]
    assert main(argv) == 0
    assert seen == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--optimizer", "sgd", "--betas", "0.9", "0.99"],
            "--betas applies to --optimizer adamw or adam only",
        ),
        (["--optimizer", "adam", "--nesterov"], "--nesterov applies to --optimizer sgd only"),
        (["--optimizer", "adam", "--eps", "-1"], "eps"),
    ],
)
def test_optimizer_option_errors(tmp_path, capsys, classifier, options, message):
    err = one_line_error(
        capsys, [*classifier, "--data", str(tmp_path / "d.npz"), *options, "-o", str(tmp_path / "o")]
    )
    assert message in err


def test_artifacts_and_train_offer_the_same_optimizer_options():
    from tests.test_cli_options import subcommands

    def flags(command):
        return {s for a in subcommands()[command]._actions for s in a.option_strings}

    options = {"--weight-decay", "--momentum", "--dampening", "--nesterov", "--betas", "--eps"}
    assert options <= flags("train") and options <= flags("artifacts")


def test_warmup_longer_than_the_run_is_said(tmp_path, capsys, classifier):
    argv = [*classifier, "--data", str(tmp_path / "d.npz"), "--epochs", "2", "-o", str(tmp_path / "o.onnx")]
    assert main([*argv, "--warmup", "16"]) == 0
    assert capsys.readouterr().err == (
        "onnxgrad: warning: --warmup 16 is longer than the run (16 updates: 2 epochs of 8): the learning "
        "rate never reaches --lr 0.001\n"
    )
    assert main([*argv, "--warmup", "15"]) == 0
    assert capsys.readouterr().err == ""


def lrs(path) -> list[float]:
    with open(path, newline="") as f:
        return [float(r["lr"]) for r in csv.DictReader(f)]


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_a_resumed_run_keeps_its_schedule_and_says_so(tmp_path, capsys, classifier, schedule):
    """A 3-epoch cosine run resumed to 8 jumped from 6.8e-5 back to 0.0064: the schedule was sized
    anew from --epochs. It keeps the 3 epochs (24 updates) it was made for, and says so."""
    ckpt, history = tmp_path / "c.npz", tmp_path / "h.csv"
    common = [*classifier, "--data", str(tmp_path / "d.npz"), "--lr", "0.05", "--history", str(history)]
    common += ["-o", str(tmp_path / "o.onnx")]
    base = [*common, "--schedule", schedule]
    assert main([*base, "--epochs", "3", "--checkpoint", str(ckpt)]) == 0
    capsys.readouterr()
    assert main([*base, "--epochs", "8", "--resume", str(ckpt)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(
        f"onnxgrad: note: resuming {ckpt}: the {schedule} schedule keeps the length it was made for, 3 epochs "
        "(24 updates), not --epochs 8; "
    )
    assert err.endswith("to size a schedule for 8 epochs, start a run without --resume\n")
    got = lrs(history)  # the rate of each epoch's last update
    if schedule == "cosine":
        expected = [Cosine(0.05, total_steps=24)(8 * e - 1) for e in range(1, 9)]
    else:
        expected = [0.05 * 0.1 ** ((8 * e - 1) // 8) for e in range(1, 9)]
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    # resumed with the same length: nothing to say
    assert main([*base, "--epochs", "3", "--resume", str(ckpt)]) == 0
    assert capsys.readouterr().err == ""
    # another schedule is a change, sized for --epochs, and named
    assert main([*common, "--schedule", "constant", "--epochs", "4", "--resume", str(ckpt)]) == 0
    assert "lr_schedule '" + schedule + "' -> 'constant'; schedule_epochs 3 -> 4" in capsys.readouterr().err
