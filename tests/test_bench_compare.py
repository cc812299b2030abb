"""bench/compare_torch.py runs on any machine: ``--threads N``, and a torch outside onnxgrad's
supported range (the OnnxModule row left out, the reason printed). Smoke runs of a few steps only:
no timing is checked."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("torch")

from bench import compare_torch

import onnxgrad.deps

ARGS = ["--models", "tiny", "--steps", "2", "--build-layers", "0", "--no-memory", "--in-process"]


def _run(tmp_path, capsys, threads: int, full_steps: int = 0) -> tuple[dict, str]:
    out = tmp_path / "figures.json"
    argv = [*ARGS, "--full-steps", str(full_steps), "--threads", str(threads), "--json", str(out)]
    try:
        assert compare_torch.main(argv) == 0
    finally:
        compare_torch.THREADS = 2  # main sets the module's threads for the run
    return json.loads(out.read_text()), capsys.readouterr().out


def test_threads_option_reaches_the_figures(tmp_path, capsys):
    figures, printed = _run(tmp_path, capsys, threads=1)
    assert figures["threads"] == 1 and "threads: 1" in printed
    assert set(figures["models"]["tiny"]["step"]) == {"onnxgrad numpy", "onnxgrad OnnxModule", "torch eager"}
    assert figures["onnx_module_skipped"] is None


def test_a_torch_outside_the_supported_range_skips_the_onnxmodule_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(onnxgrad.deps.SUPPORTED, "torch", "99.0")
    monkeypatch.delitem(sys.modules, "onnxgrad.torch", raising=False)  # imported again, and refused
    figures, printed = _run(tmp_path, capsys, threads=1, full_steps=2)
    reason = "onnxgrad needs torch>=99.0"
    assert figures["onnx_module_skipped"].startswith(reason)
    assert f"onnxgrad OnnxModule not timed: {reason}" in printed
    assert set(figures["models"]["tiny"]["step"]) == {"onnxgrad numpy", "torch eager"}
    assert set(figures["models"]["tiny"]["full_step"]) == {
        "onnxgrad one graph",
        "onnxgrad 2 sessions+np",
        "torch eager AdamW",
    }


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        compare_torch.main([*ARGS, "--threads", "0"])
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err
