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
