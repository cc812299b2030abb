"""Trained weights applied back to the model file (issue 37 §3): ``with_parameters`` applies the tie
judgement every front end makes. A tied copy follows its parameter (the runner's saved model and
``with_parameters(model, runner.parameters)`` are one model), an alias trained apart becomes an
initializer, a rebuilt table writes its copy; a mapping that would leave a copy stale is refused."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnxgrad.artifacts import Runner, generate, tensors
from onnxgrad.errors import InputError
from onnxgrad.train import with_parameters
from tests.models import make_model

RNG = np.random.default_rng(5)
F32 = np.float32
VOCAB, DIM = 32, 16


def tied_lm():
    """ids -> E[ids] -> @ E_T: a tied embedding and its folded transposed copy (GPT-2's head)."""
    e = RNG.standard_normal((VOCAB, DIM)).astype(F32)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("MatMul", ["h", "E_T"], ["y"])]
    inits = {"E": e, "E_T": np.ascontiguousarray(e.T)}
    return make_model(nodes, [("ids", np.int64, ["N"])], [("y", F32, ["N", VOCAB])], inits)


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def inits_of(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_trained_tied_weights_applied_back_are_the_runners_model(tmp_path):
    model = tied_lm()
    ids = RNG.integers(0, VOCAB, 8)
    target = RNG.standard_normal((8, VOCAB)).astype(F32)
    generate(model, loss="mse", optimizer="sgd", lr=0.5, out_dir=tmp_path, targets=("onnxruntime",))
    runner = Runner(tmp_path)
    for _ in range(5):
        runner.step({"ids": ids, "target": target})
    assert list(runner.parameters) == ["E"]
    runner.save_state(tmp_path / "trained.safetensors")
    params, meta = tensors.load(tmp_path / "trained.safetensors")  # (tensors, metadata)
    assert meta["step"] == "5"
    applied = with_parameters(model, {"E": params["E"]})
    got = inits_of(applied)
    np.testing.assert_array_equal(got["E_T"], params["E"].T)  # the copy follows its parameter
    np.testing.assert_array_equal(run(applied, {"ids": ids}), run(runner.to_onnx(), {"ids": ids}))


def test_a_mapping_that_would_leave_a_copy_stale_is_refused():
    model = tied_lm()
    e = RNG.standard_normal((VOCAB, DIM)).astype(F32)
    with pytest.raises(
        InputError, match=r"'E_T' \(computed from 'E': transpose \[1, 0\]\) would be left stale"
    ):
        with_parameters(model, {"E_T": e.T})
    with pytest.raises(InputError, match=r"'E_T' \(computed from 'E'"):
        with_parameters(model, {"E": e, "E_T": np.zeros((DIM, VOCAB), F32)})
    both = inits_of(with_parameters(model, {"E": e, "E_T": e.T}))  # consistent: accepted
    np.testing.assert_array_equal(both["E_T"], e.T)
    # trained apart (tie_weights=False): each written as given
    apart = inits_of(with_parameters(model, {"E_T": np.zeros((DIM, VOCAB), F32)}, tie_weights=False))
    assert not apart["E_T"].any()
    with pytest.raises(InputError, match=r"\['nope'\] are not initializers"):
        with_parameters(model, {"nope": e})
    with pytest.raises(InputError, match=r"'E' has shape \(32, 16\), got \(16, 32\)"):
        with_parameters(model, {"E": e.T})


def test_identity_aliases_trained_apart_are_applied_apart():
    # TorchScript BERT: b1 reads the zeros b0 through Identity; trained apart, written apart
    nodes = [
        helper.make_node("Identity", ["b0"], ["b1"]),
        helper.make_node("Add", ["x", "b0"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Add", ["t", "b1"], ["y"]),
    ]
    model = make_model(nodes, [("x", F32, [2, 8])], [("y", F32, [2, 8])], {"b0": np.zeros(8, F32)})
    applied = with_parameters(model, {"b0": np.full(8, 0.5, F32), "b1": np.full(8, -1.0, F32)})
    got = inits_of(applied)
    np.testing.assert_array_equal(got["b0"], np.full(8, 0.5, F32))
    np.testing.assert_array_equal(got["b1"], np.full(8, -1.0, F32))
    x = RNG.standard_normal((2, 8)).astype(F32)
    # float32 tanh within a few ulps of 1 (the sum cancels where tanh is near 1)
    np.testing.assert_allclose(run(applied, {"x": x}), np.tanh(x + 0.5) - 1.0, rtol=0, atol=4e-7)


def test_a_rebuilt_table_writes_its_gathered_copy():
    # a relative-position bias stored as its gathered copy trains as a table, bias_core
    window, heads = 4, 2
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + window - 1
    index = rel[0] * (2 * window - 1) + rel[1]
    table = RNG.standard_normal(((2 * window - 1) ** 2, heads)).astype(F32)
    copy = np.ascontiguousarray(table[index].transpose(2, 0, 1)[None])
    nodes = [
        helper.make_node("Add", ["s", "bias"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["y"]),
    ]
    model = make_model(nodes, [("s", F32, list(copy.shape))], [("y", F32, list(copy.shape))], {"bias": copy})
    import onnxgrad

    core = onnxgrad.ForwardBackward(model).parameters["bias_core"]
    got = inits_of(with_parameters(model, {"bias_core": 2 * core}))
    assert sorted(got) == ["bias"]
    np.testing.assert_array_equal(got["bias"], 2 * copy)


def test_a_copy_named_with_its_table_must_agree():
    window, heads = 4, 2
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + window - 1
    index = rel[0] * (2 * window - 1) + rel[1]
    copy = np.ascontiguousarray(RNG.standard_normal((49, heads)).astype(F32)[index].transpose(2, 0, 1)[None])
    nodes = [
        helper.make_node("Add", ["s", "bias"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["y"]),
    ]
    model = make_model(nodes, [("s", F32, list(copy.shape))], [("y", F32, list(copy.shape))], {"bias": copy})
    import onnxgrad

    core = onnxgrad.ForwardBackward(model).parameters["bias_core"]
    with pytest.raises(InputError, match=r"'bias' \(computed from 'bias_core': gather of 98 entries"):
        with_parameters(model, {"bias_core": 2 * core, "bias": copy})
    got = inits_of(with_parameters(model, {"bias_core": 2 * core, "bias": 2 * copy}))
    np.testing.assert_array_equal(got["bias"], 2 * copy)


def test_a_scalar_initializer_keeps_its_shape():
    """A 0-d weight (skl2onnx's `negate`) is written back 0-d: np.ascontiguousarray made it (1,),
    which the next apply refused and a rebuilt model then trained as a parameter."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from onnxgrad.train import with_parameters

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["y"])],
        "scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        [numpy_helper.from_array(np.array(-1.0, np.float32), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    out = with_parameters(model, {"s": np.array(2.0, np.float32)})
    (s,) = out.graph.initializer
    assert list(s.dims) == [] and numpy_helper.to_array(s) == 2.0
    onnx.checker.check_model(out)
