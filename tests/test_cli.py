"""The onnxgrad command line: grad, coverage, info, and one-line errors."""

from __future__ import annotations

import os
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
    assert lines[0] == "| op | domain | since opset | kind |"
    assert "| Gemm | ai.onnx | 1 | rule |" in lines


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
