"""The onnxgrad command line: grad, coverage, info, and one-line errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest

from onnxgrad.cli import main
from onnxgrad.demo import build_mlp


@pytest.fixture
def mlp_path(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(build_mlp((8, 16, 3), np.random.default_rng(0)), path)
    return path


def test_grad_writes_two_checked_models(mlp_path, tmp_path, capsys):
    out = tmp_path / "graphs"
    assert (
        main(
            [
                "grad",
                str(mlp_path),
                "-o",
                str(out),
                "--trainable",
                "fc1.weight",
                "fc2.weight",
                "--inputs-requiring-grad",
                "pixels",
            ]
        )
        == 0
    )
    for name in ("forward", "backward"):
        model = onnx.load(out / f"{name}.onnx")
        onnx.checker.check_model(model, full_check=True)
    text = capsys.readouterr().out
    assert "trainable (2): fc1.weight, fc2.weight" in text
    assert "inputs requiring grad (1): pixels" in text
    assert "saved for the backward" in text and "nodes)" in text


def test_coverage_lists_rules(capsys):
    assert main(["coverage"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ops = {line.split()[0] for line in lines if line.strip()}
    assert {"Relu", "Gemm"} <= ops
    assert "ops (" in lines[-1]


def test_coverage_markdown(capsys):
    assert main(["coverage", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| op | domain | opsets | status | tested in |"
    gemm = next(line for line in lines if line.startswith("| Gemm |"))
    assert gemm.startswith("| Gemm | ai.onnx | 1+ | rule | ") and "test_rules_linalg.py" in gemm


def test_info_prints_parameters(mlp_path, capsys):
    assert main(["info", str(mlp_path)]) == 0
    text = capsys.readouterr().out
    assert "pixels  float  [N, 8]" in text
    assert "trainable parameters: 4 tensors, 195 values" in text
    assert "fc1.weight  float  [8, 16]" in text
    assert "Gemm  2" in text
    assert "ops without a gradient rule: none" in text


def test_missing_model_is_one_line_exit_2(tmp_path, capsys):
    missing = tmp_path / "nope.onnx"
    for argv in (["info", str(missing)], ["grad", str(missing), "-o", str(tmp_path)]):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("onnxgrad: error: ")
        assert "does not exist" in lines[0]


def test_unknown_trainable_is_one_line_exit_2(mlp_path, tmp_path, capsys):
    assert main(["grad", str(mlp_path), "-o", str(tmp_path), "--trainable", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope'" in err and "Traceback" not in err


def test_python_dash_m(mlp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "onnxgrad", "info", str(mlp_path) + ".missing"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("onnxgrad: error:")
    assert "Traceback" not in done.stderr


# ---- train -------------------------------------------------------------------------------------
def regression_files(tmp_path, n=120, features=8):
    """A CSV and an NPZ file of the same regression data (target y = x . w)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, features))
    y = x @ rng.standard_normal(features) / 3
    header = ",".join([f"f{i}" for i in range(features)] + ["y"])
    np.savetxt(tmp_path / "data.csv", np.c_[x, y], delimiter=",", header=header, comments="")
    np.savez(tmp_path / "data.npz", pixels=x, y=y[:, None])
    return x.astype(np.float32), y.astype(np.float32)


def model_mse(path, x, y):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float(((sess.run(None, {"pixels": x})[0].ravel() - y) ** 2).mean())


def test_train_csv_with_validation_and_plot(tmp_path, capsys):
    path = tmp_path / "reg.onnx"
    onnx.save(build_mlp((8, 16, 1), np.random.default_rng(0)), path)
    x, y = regression_files(tmp_path)
    out, png = tmp_path / "out" / "trained.onnx", tmp_path / "curves.png"
    argv = ["train", str(path), "--data", str(tmp_path / "data.csv"), "--target", "y", "--loss", "mse"]
    argv += ["--epochs", "6", "--lr", "0.01", "--batch-size", "16", "-o", str(out)]
    argv += ["--val-split", "0.25", "--plot", str(png), "--schedule", "cosine", "--warmup", "3"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "epoch 6/6" in captured.err and "val_loss=" in captured.err  # the progress bar
    text = captured.out
    assert "6 epochs of adam (lr 0.01, cosine schedule, batch 16), 90 training / 30 validation" in text
    assert "  loss  " in text and "  val loss  " in text and f"saved         {out}" in text
    trained = onnx.load(out)
    onnx.checker.check_model(trained, full_check=True)
    assert [i.name for i in trained.graph.input] == ["pixels"]  # the loss and its target are gone
    assert model_mse(out, x, y) < model_mse(path, x, y) / 3
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_train_npz_cross_entropy(tmp_path, capsys):
    path = tmp_path / "clf.onnx"
    onnx.save(build_mlp((8, 16, 3), np.random.default_rng(0)), path)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((90, 8)).astype(np.float32)
    labels = np.argmax(x[:, :3], axis=1)
    np.savez(tmp_path / "d.npz", pixels=x, label=labels)
    out = tmp_path / "clf_trained.onnx"
    argv = ["train", str(path), "--data", str(tmp_path / "d.npz"), "--target", "label"]
    argv += ["--loss", "cross_entropy", "--epochs", "8", "--lr", "0.05", "--optimizer", "sgd"]
    argv += ["--momentum", "0.9", "-o", str(out), "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    first, last = (float(v) for v in captured.out.split("  loss")[1].split()[:3:2])
    assert last < first / 2


def test_train_resume_equals_an_uninterrupted_run(tmp_path, capsys):
    path = tmp_path / "reg.onnx"
    onnx.save(build_mlp((8, 4, 1), np.random.default_rng(0)), path)
    regression_files(tmp_path)
    base = ["train", str(path), "--data", str(tmp_path / "data.npz"), "--target", "y", "--no-progress"]
    base += ["--schedule", "step", "--batch-size", "16", "--lr", "0.01"]
    assert main([*base, "--epochs", "4", "-o", str(tmp_path / "full.onnx")]) == 0
    ckpt = str(tmp_path / "ckpt.npz")
    assert main([*base, "--epochs", "2", "-o", str(tmp_path / "half.onnx"), "--checkpoint", ckpt]) == 0
    argv = [*base, "--epochs", "4", "-o", str(tmp_path / "resumed.onnx"), "--resume", ckpt]
    assert main(argv) == 0
    full, resumed = onnx.load(tmp_path / "full.onnx"), onnx.load(tmp_path / "resumed.onnx")
    for a, b in zip(full.graph.initializer, resumed.graph.initializer):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
    capsys.readouterr()


@pytest.mark.parametrize(
    ("extra", "data", "message"),
    [
        (["--target", "price"], "data.csv", "no column 'price' in"),
        (["--target", "y", "--features", "f0,f1"], "data.csv", "input 'pixels' expects 8 features per row"),
        (
            ["--target", "y", "--loss", "cross_entropy"],
            "data.csv",
            "the target 'y' (input 'target') expects integers",
        ),
        (["--target", "z"], "data.npz", "the target array 'z' is not in"),
        (["--target", "y"], "data.txt", "expected a .csv or .npz file"),
        (["--target", "y", "--momentum", "0.9"], "data.csv", "--momentum applies to --optimizer sgd only"),
        (["--target", "y", "--output", "nope"], "data.csv", "'nope' is neither an output nor a value"),
    ],
)
def test_train_errors_are_one_line(tmp_path, capsys, extra, data, message):
    path = tmp_path / "reg.onnx"
    onnx.save(build_mlp((8, 4, 1), np.random.default_rng(0)), path)
    regression_files(tmp_path)
    (tmp_path / "data.txt").write_text("")
    argv = ["train", str(path), "--data", str(tmp_path / data), *extra, "-o", str(tmp_path / "o.onnx")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxgrad: error: ") and message in lines[0]
    assert not (tmp_path / "o.onnx").exists()


# ---- check -------------------------------------------------------------------------------------
def report_rows(text: str) -> list[list[str]]:
    """The rows of the check table: node, op, checked in, max error, status."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    return [r for r in rows if len(r) == 5 and r[0] != "node"]


def test_check_passes_on_an_mlp(mlp_path, capsys):
    assert main(["check", str(mlp_path), "--shape", "pixels=3,8"]) == 0
    text = capsys.readouterr().out
    assert "random inputs: pixels float32 [3, 8]" in text
    rows = report_rows(text)
    assert [r[:2] for r in rows] == [["#0", "Gemm"], ["#1", "Relu"], ["#2", "Gemm"], ["whole model", "-"]]
    assert all(r[-1] == "ok" and float(r[3]) < 1e-4 for r in rows)
    assert rows[0][2] == "float64 onnxruntime"  # float32 nodes are checked in float64
    assert rows[3][2] == "float32 onnxruntime"
    assert "4 checks: 4 ok, 0 failed, 0 skipped" in text


def test_check_finds_a_wrong_rule(mlp_path, capsys, monkeypatch):
    """A Relu rule returning twice the right gradient fails its node and the whole model: exit 1."""
    from onnxgrad import supported_ops
    from onnxgrad.autodiff import registry

    supported_ops()  # loads the rules
    wrong = registry.Rule(
        "Relu", "", 1, lambda g, n: [g.Where(g.Greater(n.x, 0.0), n.dy * 2.0, n.dy * 0.0)], "rule"
    )
    monkeypatch.setitem(registry._RULES, ("", "Relu"), [wrong])
    assert main(["check", str(mlp_path)]) == 1
    text = capsys.readouterr().out
    assert "symbolic dimensions set to 2 (pixels [N, 8] -> [2, 8])" in text
    rows = [(r[1], r[-1]) for r in report_rows(text)]
    assert rows == [("Gemm", "ok"), ("Relu", "FAIL"), ("Gemm", "ok"), ("-", "FAIL")]
    assert "node #1 (Relu):" in text and "analytic" in text and "numeric" in text
    assert "4 checks: 2 ok, 2 failed, 0 skipped" in text


def test_check_reports_an_op_without_rule(mlp_path, capsys, monkeypatch):
    from onnxgrad import supported_ops
    from onnxgrad.autodiff import registry

    supported_ops()
    monkeypatch.delitem(registry._RULES, ("", "Relu"))
    assert main(["check", str(mlp_path)]) == 1
    text = capsys.readouterr().out
    assert "FAIL (no gradient rule)" in text
    assert "whole model" in text and "Relu" in text.split("whole model")[1]  # the engine's message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "pixels"], "--shape 'pixels': expected NAME=DIMS"),
        (["--shape", "images=2,8"], "--shape names ['images'], which are not inputs of the model"),
    ],
)
def test_check_errors(mlp_path, capsys, argv, message):
    assert main(["check", str(mlp_path), *argv]) == 2
    assert message in capsys.readouterr().err
