"""The onnxgrad command line: grad, coverage, info, train, check, bench, and one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest

import onnxgrad
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
    assert lines[0] == "| op | domain | opsets | status | rule file | tested in |"
    gemm = next(line for line in lines if line.startswith("| Gemm |"))
    assert gemm.startswith("| Gemm | ai.onnx | 1+ | rule | ") and "test_rules_linalg.py" in gemm
    assert "| rules/linalg.py |" in gemm


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
    assert (
        "6 epochs of adamw (lr 0.01, cosine schedule, batch 16, 3 warm-up updates), "
        "90 training / 30 validation" in text
    )
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
        (["--target", "y", "--loss-output", "nope"], "data.csv", "'nope' is neither an output nor a value"),
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


def test_check_nodes_is_the_library_form_of_check(mlp_path):
    """``onnxgrad.testing.check_nodes``: one NodeCheck per node, at the values the model computes."""
    from onnxgrad.testing import check_nodes

    model = onnx.load(mlp_path)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    checks = check_nodes(model, {"pixels": x})
    assert [(c.name, c.op_type, c.status, c.checked_in) for c in checks] == [
        ("#0", "Gemm", "ok", "float64 onnxruntime"),
        ("#1", "Relu", "ok", "float64 onnxruntime"),
        ("#2", "Gemm", "ok", "float64 onnxruntime"),
    ]
    assert all(c.result is not None and c.result.ok and float(c.max_error) < 1e-6 for c in checks)


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


# ---- bench -------------------------------------------------------------------------------------
def two_layer_mlp(path, n_in=8, hidden=16, n_out=3):
    """x [N, n_in] -> Gemm -> Relu -> Gemm -> y [N, n_out], written to ``path``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n_out])],
        [init("w1", n_in, hidden), init("b1", hidden), init("w2", hidden, n_out), init("b2", n_out)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def report_sections(text: str) -> dict[str, list[str]]:
    """The blocks of the printed report (separated by blank lines), by their first line."""
    blocks = [b.splitlines() for b in text.strip().split("\n\n")]
    return {b[0]: b[1:] for b in blocks}


def test_bench_prints_times_and_ops(tmp_path, capsys):
    path = two_layer_mlp(tmp_path / "mlp.onnx")
    assert main(["bench", str(path), "--steps", "2", "--batch-size", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"training step of {path}: forward + backward, output gradient of ones, ")
    assert "4 trainable tensors (195 values)" in text and "onnxruntime's default threads" in text
    assert "random inputs: x float32 [3, 8]" in text
    assert "symbolic dimensions set to 3 (x [N, 8] -> [3, 8])" in text
    times = {m[0]: float(m[1]) for m in re.findall(r"^(forward|backward|step) +([0-9.]+) ms", text, re.M)}
    assert set(times) == {"forward", "backward", "step"} and all(t > 0 for t in times.values())
    assert re.search(r"^step +[0-9.]+ ms \(median of 2 steps after 3 warm-up\)$", text, re.M)
    assert re.search(r"^gradient graphs built \(and forward session made\) in [0-9.]+ s$", text, re.M)
    sections = report_sections(text)
    heads = {k.split(":")[0]: v for k, v in sections.items() if k.startswith(("forward g", "backward g"))}
    assert set(heads) == {"forward graph", "backward graph", "backward graph, slowest nodes"}
    ops = {g: {line.split()[0] for line in heads[f"{g} graph"]} for g in ("forward", "backward")}
    # fc1 + relu run fused as one FusedGemm; fc2 stays a Gemm. The backward has the three products.
    assert ops["forward"] == {"FusedGemm", "Gemm"}
    assert "Gemm" in ops["backward"] and not ops["backward"] & {"FusedGemm", "Relu"}
    for line in heads["forward graph"] + heads["backward graph"]:
        assert re.fullmatch(r"  \w+ +[0-9.]+ ms +[0-9.]+ %", line), line
    nodes = heads["backward graph, slowest nodes"]
    bwd_nodes = len(onnxgrad.build_gradient(onnx.load(path)).backward.graph.node)
    assert len(nodes) == min(10, bwd_nodes)
    # each node line names the outputs of the backward node it runs (which of them are the slowest
    # ten varies from run to run on such a small model)
    outputs = {line.split("-> ")[1] for line in nodes}
    assert outputs & {"w1_grad", "w2_grad"}


@pytest.mark.parametrize(
    ("extra", "shape"),
    [([], [1, 8]), (["--batch-size", "4"], [4, 8]), (["--batch-size", "4", "--shape", "x=5,8"], [5, 8])],
)
def test_bench_json(tmp_path, capsys, extra, shape):
    path = two_layer_mlp(tmp_path / "mlp.onnx")
    out = tmp_path / "figures" / "bench.json"
    assert main(["bench", str(path), "--steps", "2", "--threads", "1", "--json", str(out), *extra]) == 0
    assert capsys.readouterr().out.endswith(f"every figure written to {out}\n")
    record = json.loads(out.read_text())
    assert record["model"] == str(path) and record["threads"] == 1 and record["steps"] == 2
    assert record["inputs"] == {"x": {"dtype": "float32", "shape": shape}}
    assert record["trainable"] == {"w1": 128, "b1": 16, "w2": 48, "b2": 3}
    for key in ("forward_ms", "backward_ms", "total_ms", "build_s"):
        assert record[key] > 0
    assert len(record["forward_samples_ms"]) == len(record["backward_samples_ms"]) == 2
    assert set(record["ops"]) == set(record["nodes"]) == {"forward", "backward"}
    assert set(record["ops"]["forward"]) == {"FusedGemm", "Gemm"}
    assert "Gemm" in record["ops"]["backward"]
    for graph, ops in record["ops"].items():
        nodes = record["nodes"][graph]
        assert all(ms > 0 for ms in ops.values()) and all(n["ms"] > 0 for n in nodes)
        assert {n["op_type"] for n in nodes} == set(ops)  # per-node and per-op figures agree
        assert sum(n["ms"] for n in nodes) == pytest.approx(sum(ops.values()))
        assert [n["ms"] for n in nodes] == sorted((n["ms"] for n in nodes), reverse=True)
    gemms = [n for n in record["nodes"]["backward"] if n["op_type"] == "Gemm"]
    assert len(gemms) == 3 and {"w1_grad", "w2_grad"} <= {o for n in gemms for o in n["outputs"]}
    assert [n["outputs"] for n in record["nodes"]["forward"] if n["name"] == "fc2"] == [["y"]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "y=2,8"], "--shape names ['y'], which are not inputs of the model (['x'])"),
        (["--shape", "x=-1,8"], "--shape 'x=-1,8': dimensions cannot be negative"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (
            ["--shape", "x=2,5"],
            "--shape x=2,5: input 'x' has shape (2, 5), the model expects (N, 8) (dimension 1 must be 8)",
        ),
    ],
)
def test_bench_option_errors(tmp_path, capsys, argv, message):
    path = two_layer_mlp(tmp_path / "mlp.onnx")
    assert main(["bench", str(path), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"onnxgrad: error: {message}\n"


def test_bench_bad_model_errors_like_the_other_commands(tmp_path, capsys):
    missing, garbage = tmp_path / "nope.onnx", tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not an onnx file")
    for path in (missing, garbage):
        assert main(["info", str(path)]) == 2
        expected = capsys.readouterr()
        assert main(["bench", str(path), "--steps", "2"]) == 2
        assert capsys.readouterr() == expected
    assert expected.out == ""
    assert main(["bench", str(missing)]) == 2
    assert capsys.readouterr().err == f"onnxgrad: error: model file {str(missing)!r} does not exist\n"


def test_bench_refuses_a_model_without_parameters(tmp_path, capsys):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    assert main(["bench", str(path), "--steps", "2"]) == 2
    assert capsys.readouterr().err == (
        "onnxgrad: error: nothing to differentiate: the model has no floating-point initializer to "
        "train and no input was named in inputs_requiring_grad\n"
    )


def embedding_model():
    """ids (int64) [B, T] -> Gather from a 5 x 4 float table -> ReduceSum over T -> y [B, 4]."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.arange(20, dtype=np.float32).reshape(5, 4), "table")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
            helper.make_node("ReduceSum", ["e", "axes"], ["y"], keepdims=0),
        ],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])],
        [table, axes],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_profile_step_with_an_integer_input():
    from onnxgrad.runtime.profile import profile_step, random_feeds

    model = embedding_model()
    feeds = random_feeds(model, batch=3, shapes={"ids": (2, 6)})
    assert feeds["ids"].dtype == np.int64 and feeds["ids"].shape == (2, 6)
    assert set(np.unique(feeds["ids"])) <= {0, 1}  # valid rows of any table of 2 rows or more
    prof = profile_step(model, batch=3, steps=2)
    assert prof.inputs == {"ids": {"dtype": "int64", "shape": [3, 3]}}
    assert prof.trainable == {"table": 20}  # the int64 axes are never trainable
    assert prof.forward_ms > 0 and prof.backward_ms > 0 and prof.total_ms > 0
    assert {"Gather", "ReduceSum"} <= set(prof.ops["forward"])
    # the table's gradient scatters the output gradient into the rows the ids picked
    assert "ScatterND" in prof.ops["backward"] and "ScatterND" not in prof.ops["forward"]
    assert prof.nodes["backward"] and all(n.ms > 0 for n in prof.nodes["backward"])
    assert "forward graph:" in prof.report() and "backward graph, slowest nodes:" in prof.report()


def test_random_feeds_dtypes_and_errors():
    from onnx import TensorProto, helper

    from onnxgrad.errors import InputError
    from onnxgrad.runtime.profile import random_feeds

    inputs = [
        helper.make_tensor_value_info("f", TensorProto.FLOAT16, ["N", 3]),
        helper.make_tensor_value_info("b", TensorProto.BOOL, [2, "M"]),
        helper.make_tensor_value_info("i", TensorProto.INT32, [4]),
    ]
    node = helper.make_node("Identity", ["f"], ["y"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 3])
    model = helper.make_model(helper.make_graph([node], "g", inputs, [y]), ir_version=8)
    feeds = random_feeds(model, batch=5, seed=1)
    assert {k: (str(v.dtype), v.shape) for k, v in feeds.items()} == {
        "f": ("float16", (5, 3)),
        "b": ("bool", (2, 5)),
        "i": ("int32", (4,)),
    }
    np.testing.assert_array_equal(random_feeds(model, batch=5, seed=1)["f"], feeds["f"])  # seeded
    with pytest.raises(InputError, match=r"^shapes given for \['z'\], which are not inputs of the model"):
        random_feeds(model, shapes={"z": (1,)})
    del model.graph.input[0].type.tensor_type.shape.dim[:]
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(InputError, match=r"^input 'f' has no shape in the model: give one"):
        random_feeds(model)
    assert random_feeds(model, shapes={"f": (2, 2)})["f"].shape == (2, 2)


def test_info_shows_what_is_left_out_and_the_tied_groups(tmp_path, capsys):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    inits = {
        "W": w,
        "W_T": np.ascontiguousarray(w.T),
        "p": np.array(2.0, np.float32),
        "eps": np.array([1e-5], np.float32),
        "axes": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"]),
        helper.make_node("Gemm", ["x", "W_T"], ["b"], transB=1),
        helper.make_node("Add", ["a", "b"], ["h"]),
        helper.make_node("Pow", ["h", "p"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"]),
        helper.make_node("Add", ["var", "eps"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    path = tmp_path / "tied.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), path)
    assert main(["info", str(path)]) == 0
    text = capsys.readouterr().out
    assert "trainable parameters: 1 tensors, 512 values" in text
    assert "  W     float  [16, 32]  512   read as a weight\n" in text
    assert "  parameter  also stored as  how\n  W          W_T             transpose [1, 0]\n" in text
    assert "left out of the default trainable set: 3 initializers" in text
    lines = ("p     float  []     Pow exponent", "eps   float  [1]    epsilon")
    lines += ("axes  int64  [1]    axes (int64)",)
    for line in lines:
        assert f"  {line}\n" in text
