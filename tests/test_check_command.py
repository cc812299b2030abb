"""`onnxgrad check` and `onnxgrad.testing` where the check itself went wrong: an Add reading
finfo(float32).min (every Hugging Face BERT export's attention mask) divided by zero and failed;
options that check nothing (--max-elements 0, an empty --shape) reported success; bad option values
gave a numpy traceback."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.cli import main
from onnxgrad.errors import InputError
from onnxgrad.testing import check_gradients, check_nodes
from tests.test_cli import report_rows

MIN = float(np.finfo(np.float32).min)


def masked_softmax(path) -> str:
    """``Softmax(x + bias)`` with ``bias = [0, min, 0, min]``: scores of masked positions, as an
    exported BERT adds ``(1 - mask) * finfo(float32).min`` to its attention scores."""
    bias = np.array([0.0, MIN, 0.0, MIN], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["s"]), helper.make_node("Softmax", ["s"], ["y"], axis=-1)],
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(bias, "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return str(path)


def test_an_add_reading_finfo_min_is_checked_not_failed(tmp_path, capsys):
    """Was: ZeroDivisionError ("float division by zero") in the kink test, false FAILs, exit 1.
    The step is lost in rounding at 3.4e38 (x ± h == x): those elements are not probed, and said."""
    path = masked_softmax(tmp_path / "m.onnx")
    assert main(["check", path]) == 0
    text = capsys.readouterr().out
    rows = report_rows(text)
    assert [r[1] for r in rows] == ["Add", "Softmax", "-"]
    assert all(r[-1].startswith("ok") for r in rows), text
    assert "element(s) not probed: the step is lost in rounding at their magnitude" in rows[0][-1]
    assert "3 checks: 3 ok, 0 failed, 0 skipped" in text
    # the library form says which values lost elements
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    add = check_nodes(onnx.load(path), {"x": x})[0]
    # bias[1], bias[3] (x ± h == x at 3.4e38) and x[:, 1], x[:, 3] (x + min == min: their step
    # changes nothing the scalar can resolve); the other 6 elements are compared
    assert add.status == "ok" and add.result.unprobed == {"in0": 4, "in1": 2}
    assert add.result.probed == {"in0": 4, "in1": 2} and add.result.mismatches == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-elements", "-5"],
            "--max-elements must be an integer >= 1 (elements probed per value), got -5",
        ),
        (
            ["--max-elements", "0"],
            "--max-elements must be an integer >= 1 (elements probed per value), got 0",
        ),
        (["--rtol", "-1"], "--rtol must be a finite number >= 0, got -1.0"),
        (["--atol", "nan"], "--atol must be a finite number >= 0, got nan"),
    ],
)
def test_bad_option_values_are_usage_errors(tmp_path, capsys, argv, message):
    """--max-elements -5 was a raw numpy traceback; 0 checked nothing and said "4 ok"."""
    assert main(["check", masked_softmax(tmp_path / "m.onnx"), *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"onnxgrad: error: {message}\n"


def test_an_empty_input_checks_nothing_and_says_so(tmp_path, capsys):
    """--shape x=0,4 printed "3 checks: 3 ok" and exited 0: no element was compared."""
    assert main(["check", masked_softmax(tmp_path / "m.onnx"), "--shape", "x=0,4"]) == 1
    captured = capsys.readouterr()
    rows = report_rows(captured.out)
    assert [r[-1] for r in rows] == ["EMPTY", "EMPTY", "EMPTY"]
    assert "3 checks: 0 ok, 0 failed, 0 skipped, 3 with no element to check" in captured.out
    assert captured.err == "nothing was checked: no check compared a single element\n"


def test_check_gradients_refuses_settings_that_check_nothing(tmp_path):
    path = masked_softmax(tmp_path / "m.onnx")
    x = {"x": np.zeros((2, 4), np.float32)}
    with pytest.raises(InputError, match=r"max_elements must be an integer >= 1 .*got 0"):
        check_gradients(path, x, max_elements=0)
    with pytest.raises(InputError, match="eps must be a finite number > 0, got 0"):
        check_gradients(path, x, eps=0)
    with pytest.raises(InputError, match="rtol must be a finite number >= 0, got -1"):
        check_nodes(onnx.load(path), x, rtol=-1)
    result = check_gradients(path, {"x": np.zeros((0, 4), np.float32)})
    assert result.ok and result.checked == 0  # nothing compared: result_status says EMPTY
