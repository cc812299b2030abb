"""The digits demo trains to > 90% test accuracy, and the saved ONNX file gives the same."""

from __future__ import annotations

import onnx
import pytest

from onnxgrad import demo

pytest.importorskip("sklearn")  # the demo's optional dependencies
pytest.importorskip("tqdm")


def test_demo_trains_and_reloads(tmp_path, capsys):
    path = tmp_path / "digits.onnx"
    result = demo.main(epochs=4, seed=0, path=path, progress=False)
    losses = result["epoch_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0] / 3
    assert result["test_accuracy"] > 0.9
    assert result["reloaded_accuracy"] == result["test_accuracy"]
    saved = onnx.load(path)
    onnx.checker.check_model(saved, full_check=True)
    assert [i.name for i in saved.graph.input] == ["pixels"]  # no target: the loss is gone
    assert [o.name for o in saved.graph.output] == ["logits"]
    assert "test accuracy" in capsys.readouterr().out


def test_demo_ends_with_next_steps_that_run(tmp_path, capsys):
    """The commands printed at the end work as printed (before: the demo ended without a hint)."""
    import shlex

    from onnxgrad.cli import main

    result = demo.main(epochs=1, seed=0, path=tmp_path / "digits.onnx", progress=False)
    text = capsys.readouterr().out
    assert "next steps" in text
    assert len(result["next_steps"]) == 3
    for command in result["next_steps"]:
        assert f"  {command}  # " in text
        argv = shlex.split(command)
        assert argv[0] == "onnxgrad"
        assert main([*argv[1:], *(["--no-progress"] if argv[1] == "train" else [])]) == 0, command
    out = capsys.readouterr().out
    assert "val accuracy" in out and "stopped" in out
    assert (tmp_path / "digits_tuned.onnx").exists() and (
        tmp_path / "digits_artifacts" / "manifest.json"
    ).exists()
    assert (tmp_path / "digits_history.csv").read_text().startswith("epoch,loss,lr,val_loss,val_acc,seconds")
