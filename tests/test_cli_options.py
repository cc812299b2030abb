"""The command line's vocabulary (one spelling per idea, old spellings as deprecated aliases, help on
every option), and the train options that mirror the Python side: --patience, --providers,
--accumulate, --clip-norm, --history, accuracy for classifiers, what a resumed run changed and why a
run stopped."""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxgrad.cli import build_parser, main
from onnxgrad.demo import build_mlp

ROOT = Path(__file__).resolve().parents[1]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_has_help():
    """Before: demo --epochs/--seed and artifacts --optimizer had none."""
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, p in subcommands().items()
        for a in p._actions
        if a.help is None
    ]
    assert missing == []


TRAIN = ["train", "m.onnx", "--data", "d", "--target", "y"]


@pytest.mark.parametrize(
    ("argv", "dest", "value", "note"),
    [
        ([*TRAIN, "--out", "t.onnx"], "out_file", "t.onnx", "--out is deprecated, use --out-file"),
        (
            [*TRAIN, "--output-file", "t.onnx"],
            "out_file",
            "t.onnx",
            "--output-file is deprecated, use --out-file",
        ),
        (
            ["grad", "m.onnx", "--output-dir", "d"],
            "out_dir",
            "d",
            "--output-dir is deprecated, use --out-dir",
        ),
        (
            [*TRAIN, "--output", "logits", "-o", "t.onnx"],
            "loss_output",
            "logits",
            "--output is deprecated, use --loss-output",
        ),
        (
            ["demo", "--output", "d.onnx"],
            "out_file",
            "d.onnx",
            "--output is deprecated, use --out-file",
        ),
        (["bench", "m.onnx", "--batch", "4"], "batch_size", 4, "--batch is deprecated, use --batch-size"),
        (
            ["artifacts", "m.onnx", "--loss", "mse", "-o", "d", "--requires-grad", "a", "b"],
            "trainable",
            ["a", "b"],
            "--requires-grad is deprecated, use --trainable",
        ),
    ],
)
def test_old_spellings_still_work_with_a_note(capsys, argv, dest, value, note):
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    assert capsys.readouterr().err == f"onnxgrad: note: {note}\n"


@pytest.mark.parametrize(
    ("command", "shown", "hidden"),
    [
        ("train", ["--loss-output", "--out-file", "--batch-size", "--patience", "--providers",
                   "--accumulate", "--clip-norm", "--clip-value", "--history"],
         ["--out ", "--output ", "--output-file"]),
        ("artifacts", ["--trainable", "--loss-output", "--out-dir"], ["--requires-grad", "--output-dir"]),
        ("bench", ["--batch-size"], ["--batch "]),
        ("demo", ["--out-file"], ["--output ", "--output-file"]),
        ("grad", ["--trainable", "--out-dir"], ["--output-dir"]),
    ],
)  # fmt: skip
def test_help_shows_the_current_vocabulary(command, shown, hidden):
    text = subcommands()[command].format_help()
    for flag in shown:
        assert flag in text
    for flag in hidden:
        assert flag not in text.replace("\n", " ") + " "


def test_the_readme_lists_every_command():
    """Before: the README's command list omitted artifacts and bench."""
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"`onnxgrad ([a-z]+)", readme.split("- Command line")[1].split("\n\n")[0]))
    assert listed == set(subcommands())


# ---- train -------------------------------------------------------------------------------------
@pytest.fixture
def classifier(tmp_path):
    """A 8-16-3 MLP and an NPZ file of 120 samples whose class is the largest of the first 3 features."""
    path = tmp_path / "clf.onnx"
    onnx.save(build_mlp((8, 16, 3), np.random.default_rng(0)), path)
    x = np.random.default_rng(1).standard_normal((120, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", pixels=x, label=np.argmax(x[:, :3], axis=1))
    data = ["--data", str(tmp_path / "d.npz"), "--target", "label"]
    return ["train", str(path), *data, "--loss", "cross_entropy", "--no-progress", "--batch-size", "16"]


def test_train_reports_accuracy_and_writes_the_history(tmp_path, capsys, classifier):
    history = tmp_path / "h.csv"
    argv = [*classifier, "--val-split", "0.25", "--epochs", "4", "--lr", "0.05", "--history", str(history)]
    assert main([*argv, "-o", str(tmp_path / "o.onnx"), "--providers", "CPUExecutionProvider"]) == 0
    text = capsys.readouterr().out
    first, last = (float(v.rstrip("%")) for v in text.split("val accuracy")[1].split()[:3:2])
    assert last > first and last > 70
    assert "stopped       --epochs 4 reached" in text and f"history       {history}" in text
    with open(history, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"]
    assert float(rows[-1]["val_acc"]) == pytest.approx(last / 100, abs=1e-4)


def test_train_says_when_early_stopping_ended_the_run(tmp_path, capsys, classifier):
    """Before: the summary said '10 epochs' whatever ran. A learning rate of 0 never improves."""
    argv = [*classifier, "--val-split", "0.25", "--epochs", "10", "--lr", "0", "--patience", "2"]
    assert main([*argv, "-o", str(tmp_path / "o.onnx")]) == 0
    text = capsys.readouterr().out
    assert ": 3 epochs of adamw (lr 0.0," in text
    assert "stopped       early stopping at epoch 3: val_loss has not improved for 2 epochs (best " in text
    assert "at epoch 1); the parameters of epoch 1 kept" in text


def test_train_accumulate_and_clip_norm(tmp_path, capsys, classifier):
    argv = [*classifier, "--epochs", "3", "--lr", "0.05", "--accumulate", "3", "--clip-norm", "1.0"]
    assert main([*argv, "-o", str(tmp_path / "o.onnx")]) == 0
    text = capsys.readouterr().out
    assert "batch 16, 3 batches per update, gradient norm clipped to 1.0), 120 training samples" in text
    first, last = (float(v) for v in text.split("  loss")[1].split()[:3:2])
    assert last < first


def test_resume_says_what_changed_and_refuses_another_split(tmp_path, capsys, classifier):
    ckpt = str(tmp_path / "c.npz")
    base = [*classifier, "--val-split", "0.25", "--patience", "5", "-o", str(tmp_path / "o.onnx")]
    assert main([*base, "--epochs", "2", "--checkpoint", ckpt]) == 0
    capsys.readouterr()
    assert main([*base, "--epochs", "4", "--resume", ckpt, "--lr", "0.01"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"onnxgrad: note: resuming {ckpt} with options changed since the checkpoint: --lr 0.001 -> 0.01\n"
    )
    assert ": 2 epochs (epochs 3-4, resumed from epoch 2) of adamw" in captured.out
    assert main([*base, "--epochs", "4", "--resume", ckpt, "--val-split", "0.5"]) == 2
    assert capsys.readouterr().err == (
        f"onnxgrad: error: --resume {ckpt}: the data or its split changed (val_split 0.25 in the checkpoint, "
        "0.5 now): resuming would move samples between training and validation; use the checkpoint's values "
        "or start without --resume\n"
    )
    assert main([*base, "--epochs", "2", "--resume", ckpt]) == 0
    assert (
        "stopped       nothing to run: the checkpoint is at epoch 2, --epochs is 2" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--accumulate", "0"], "--accumulate must be >= 1, got 0"),
        (["--patience", "0"], "--patience must be >= 1, got 0"),
        (["--clip-norm", "0"], "--clip-norm must be > 0, got 0.0"),
        (
            ["--providers", "NopeExecutionProvider"],
            "execution provider 'NopeExecutionProvider' is not available",
        ),
        (["--history", "h.txt"], "history file 'h.txt': expected a .csv or .json file"),
        ([], "-o/--out-file FILE is required"),
    ],
)
def test_train_option_errors_are_one_line(tmp_path, capsys, classifier, extra, message):
    out = ["-o", str(tmp_path / "o.onnx")] if extra else []
    assert main([*classifier, *extra, *out]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
