"""`onnxgrad train` under the training loop's one rule: resuming with --history or --patience given
or left out, hyperparameters beyond float32, --warmup checked as LinearWarmup checks it, a resume
with nothing left to run, the summary line, -h."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.cli import main
from tests.test_cli_loop import classifier, one_line_error  # noqa: F401 (a fixture)


def run_args(tmp_path, classifier, *more):  # noqa: F811
    return [*classifier, "--data", str(tmp_path / "d.npz"), *more, "-o", str(tmp_path / "o.onnx")]


# ---- 6. --resume with --history / --patience given or left out ----------------------------------
def test_resume_matches_callbacks_by_kind(tmp_path, capsys, classifier):  # noqa: F811
    """'checkpoint has the state of 0 callbacks, this trainer has 1': a CLI user never wrote one."""
    ckpt, hist = str(tmp_path / "c.npz"), str(tmp_path / "h.csv")
    argv = run_args(tmp_path, classifier, "--val-split", "0.25", "--checkpoint", ckpt)
    assert main([*argv, "--epochs", "2"]) == 0
    capsys.readouterr()
    assert main([*argv, "--epochs", "3", "--resume", ckpt, "--history", hist, "--patience", "4"]) == 0
    err = capsys.readouterr().err
    assert f"onnxgrad: note: resuming {ckpt}: --patience given since the checkpoint (early stopping " in err
    assert f"onnxgrad: note: resuming {ckpt}: --history given since the checkpoint (starts afresh)" in err
    from onnxgrad.train.checkpoint import read_checkpoint

    saved = read_checkpoint(ckpt)
    assert saved["callback_kinds"] == ["EarlyStopping", "HistoryFile"] and saved["epoch"] == 3
    best = saved["callbacks"][0]["best_epoch"]
    assert main([*argv, "--epochs", "4", "--resume", ckpt, "--patience", "4"]) == 0  # --history left out
    err = capsys.readouterr().err
    assert err == (
        f"onnxgrad: note: resuming {ckpt}: --history left out since the checkpoint (its state in the "
        "checkpoint is left out)\n"
    )
    assert read_checkpoint(ckpt)["callbacks"][0]["best_epoch"] >= best  # restored, not afresh


# ---- 5, 7. usage errors: --warmup as LinearWarmup takes it, hyperparameters within float32 ------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
        (["--weight-decay", "1e39"], "weight_decay must fit in float32"),
        (["--optimizer", "sgd", "--momentum", "1e39"], "momentum must fit in float32"),
    ],
)
def test_usage_errors_exit_2(tmp_path, capsys, classifier, options, message):  # noqa: F811
    """--warmup -5 ran as no warm-up; --weight-decay 1e39 overflowed float32 in the update."""
    err = one_line_error(capsys, run_args(tmp_path, classifier, *options))
    assert message in err
    assert not (tmp_path / "o.onnx").exists()


# ---- 10, 11. nothing to run on resume, one note in the options' terms, the summary, -h ----------
def test_a_resume_with_nothing_to_run_says_so(tmp_path, capsys, classifier):  # noqa: F811
    """The summary said "0 epochs (epochs 4-3, resumed from epoch 3)"; the changed-schedule note
    named lr_schedule, schedule_epochs and schedule (internal names, the change twice)."""
    ckpt = str(tmp_path / "c.npz")
    argv = run_args(tmp_path, classifier, "--checkpoint", ckpt)
    assert main([*argv, "--epochs", "3", "--schedule", "cosine"]) == 0
    capsys.readouterr()
    assert main([*argv, "--epochs", "3", "--resume", ckpt]) == 0
    captured = capsys.readouterr()
    assert (
        "trained " in captured.out
        and ": no epoch (the checkpoint is at epoch 3, --epochs 3: nothing to run)" in captured.out
    )
    assert "epochs 4-3" not in captured.out
    assert captured.err == (
        f"onnxgrad: note: resuming {ckpt} with options changed since the checkpoint: --schedule cosine -> "
        "constant\n"
    )


def test_the_summary_names_the_optimizer_options_and_the_warmup(tmp_path, capsys, classifier):  # noqa: F811
    argv = run_args(tmp_path, classifier, "--epochs", "1", "--optimizer", "sgd", "--momentum", "0.9",
                    "--nesterov", "--warmup", "3")  # fmt: skip
    assert main(argv) == 0
    assert "of sgd (lr 0.001, constant schedule, batch 16, momentum 0.9, nesterov, 3 warm-up updates)" in (
        capsys.readouterr().out
    )
    assert (
        main(run_args(tmp_path, classifier, "--epochs", "1", "--optimizer", "adam", "--betas", "0.8", "0.9"))
        == 0
    )
    assert "(lr 0.001, constant schedule, batch 16, betas 0.8 0.9)" in capsys.readouterr().out


def test_help_shows_the_out_file_as_required(capsys):
    with pytest.raises(SystemExit):
        main(["train", "-h"])
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert " -o FILE" in usage and "[-o FILE]" not in usage


# ---- 12. onnxgrad check: an EMPTY check fails unless --allow-empty; the whole model's dtype ------
def partly_masked(path) -> str:
    """``y = Softmax(x + min)`` (every score masked: the step is lost in rounding, EMPTY; a
    dead branch, so that the whole model checks ``z``) beside ``z = 2 x`` (checked)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    bias = np.full(4, np.finfo(np.float32).min, np.float32)
    nodes = [
        helper.make_node("Add", ["x", "bias"], ["s"]),
        helper.make_node("Softmax", ["s"], ["y"], axis=-1),
        helper.make_node("Mul", ["x", "two"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes, "masked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(np.float32(2.0), "two")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return str(path)


def test_check_fails_on_an_empty_check_unless_allowed(tmp_path, capsys):
    """A BERT's masked attention Add and Softmax were EMPTY and the command exited 0, where the doc
    says a check that compares nothing fails."""
    from tests.test_cli import report_rows

    path = partly_masked(tmp_path / "m.onnx")
    assert main(["check", path]) == 1
    captured = capsys.readouterr()
    statuses = {r[1]: r[-1].split(" ")[0] for r in report_rows(captured.out)}
    assert statuses == {"Add": "EMPTY", "Softmax": "EMPTY", "Mul": "ok", "-": "ok"}, captured.out
    assert captured.err == (
        "2 check(s) compared no element (EMPTY) and prove nothing: probe other values (--seed, --shape) "
        "or pass --allow-empty to accept them\n"
    )
    assert main(["check", path, "--allow-empty"]) == 0
    assert capsys.readouterr().err == ""


def test_the_whole_model_row_names_the_parameters_dtype(tmp_path, capsys):
    """An embedding model (integer inputs only) printed "- onnxruntime" for the whole model."""
    import onnx

    from tests.test_cli import report_rows
    from tests.train.test_loop_rules import lm

    onnx.save(lm(), tmp_path / "lm.onnx")
    assert main(["check", str(tmp_path / "lm.onnx"), "--no-nodes"]) == 0
    (row,) = report_rows(capsys.readouterr().out)
    assert row[0] == "whole model" and row[2] == "float32 onnxruntime"


# ---- 2. the CLI's val accuracy over the labels that count ----------------------------------------
def test_val_accuracy_leaves_ignored_labels_out(tmp_path, capsys, classifier):  # noqa: F811
    """-100 labels counted as wrong answers in "val accuracy" (and val_acc of --history)."""
    import csv

    import onnxruntime as ort

    from onnxgrad.train import split

    x = np.random.default_rng(1).standard_normal((120, 8)).astype(np.float32)
    label = (x[:, 0] > 0).astype(np.int64)
    label[::3] = -100
    np.savez(tmp_path / "d.npz", pixels=x, label=label)
    hist = tmp_path / "h.csv"
    assert (
        main(run_args(tmp_path, classifier, "--epochs", "1", "--val-split", "0.5", "--history", str(hist)))
        == 0
    )
    with open(hist, newline="") as f:
        (row,) = list(csv.DictReader(f))
    _, val = split({"pixels": x, "label": label}, 0.5, seed=0)
    session = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"])
    pred = session.run(None, {"pixels": val["pixels"]})[0].argmax(axis=1)
    keep = val["label"] != -100
    assert float(row["val_acc"]) == pytest.approx(np.mean(pred[keep] == val["label"][keep]), rel=1e-12)
    assert f"val accuracy  {float(row['val_acc']):.2%} -> " in capsys.readouterr().out
