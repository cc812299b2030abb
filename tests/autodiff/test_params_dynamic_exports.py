"""Exporter constants of decoders exported with dynamic shapes (a KV cache: past length symbolic)
stay out of the default trainable set, as they do in static exports.

Found on the zoo's GPT-2 / Llama exported the way optimum does (tests/zoo/test_decoders_kv.py):
the attention scale multiplied into a key transposed to (..., head size, past + sequence), the
scalar 1 expanded into an attention mask of ones and cast to bool, and RoPE's inverse frequencies
(folded into a table in a static export, here multiplied by positions at run time) were trained,
and the training drifted from torch's (1.2e-4 relative after 10 steps on GPT-2).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.autodiff.params import parameter_reasons

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_scale_along_a_symbolic_last_dim_is_a_constant_where_another_use_is_static():
    model = _model(
        [
            helper.make_node("Mul", ["q", "scale"], ["qs"]),  # (..., head size 8)
            helper.make_node("Mul", ["kt", "scale"], ["ks"]),  # (..., past + sequence)
            helper.make_node("MatMul", ["qs", "ks"], ["scores"]),
            helper.make_node("Add", ["scores", "bias"], ["y"]),  # (..., past + sequence) only
        ],
        [
            helper.make_tensor_value_info("q", F, ["b", 4, "s", 8]),
            helper.make_tensor_value_info("kt", F, ["b", 4, 8, "t"]),
        ],
        [helper.make_tensor_value_info("y", F, ["b", 4, "s", "t"])],
        {"scale": np.array([0.59], np.float32), "bias": np.array([0.1], np.float32)},
    )
    reasons = parameter_reasons(model)
    assert reasons["scale"] == "scalar constant"
    # one value against symbolic last dims only: kept (it may be a one-output layer's bias)
    assert reasons["bias"] is None


def test_a_value_read_by_boolean_ops_only_is_not_trained():
    model = _model(
        [
            helper.make_node("Expand", ["one", "shape"], ["ones"]),
            helper.make_node("Cast", ["ones"], ["ones_b"], to=TensorProto.BOOL),
            helper.make_node("And", ["ones_b", "keep"], ["mask"]),
            helper.make_node("Where", ["mask", "x", "w"], ["y"]),
        ],
        [
            helper.make_tensor_value_info("shape", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("keep", TensorProto.BOOL, ["s"]),
            helper.make_tensor_value_info("x", F, ["s"]),
        ],
        [helper.make_tensor_value_info("y", F, ["s"])],
        {"one": np.array(1.0, np.float32), "w": np.array([0.5, 0.25], np.float32)},
    )
    reasons = parameter_reasons(model)
    assert reasons["one"] == "read as a boolean"
    assert reasons["w"] is None


def _rope(freqs: np.ndarray):
    return _model(
        [
            helper.make_node("Cast", ["positions"], ["pos_f"], to=F),
            helper.make_node("MatMul", ["freqs", "pos_f"], ["angles"]),
            helper.make_node("Cos", ["angles"], ["y"]),
        ],
        [helper.make_tensor_value_info("positions", TensorProto.INT64, [1, 1, "s"])],
        [helper.make_tensor_value_info("y", F, [1, 4, "s"])],
        {"freqs": freqs.reshape(1, 4, 1).astype(np.float32)},
    )


def test_rotary_inverse_frequencies_are_not_trained():
    inv_freq = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)  # transformers' RoPE, head size 8
    assert parameter_reasons(_rope(inv_freq))["freqs"] == "rotary inverse frequencies"
    # not a geometric sequence from 1: a weight
    assert parameter_reasons(_rope(np.array([1.0, 0.5, 0.3, 0.1])))["freqs"] is None


def test_uses_inside_if_branches_are_followed():
    """optimum's merged decoder: the initializers are in the main graph, every read is in a branch
    of an If; a branch's values are followed as the main graph's are (Expand, Cast, then And)."""
    then = helper.make_graph(
        [
            helper.make_node("Expand", ["one", "shape"], ["ones"]),
            helper.make_node("Cast", ["ones"], ["ones_b"], to=TensorProto.BOOL),
            helper.make_node("And", ["ones_b", "keep"], ["mask"]),
            helper.make_node("Where", ["mask", "x", "w"], ["y"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("y", F, ["s"])],
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        "else",
        [],
        [helper.make_tensor_value_info("y", F, ["s"])],
    )
    model = _model(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, [1]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("keep", TensorProto.BOOL, ["s"]),
            helper.make_tensor_value_info("x", F, ["s"]),
        ],
        [helper.make_tensor_value_info("y", F, ["s"])],
        {"one": np.array(1.0, np.float32), "w": np.array([0.5, 0.25], np.float32)},
    )
    reasons = parameter_reasons(model)
    assert reasons["one"] == "read as a boolean"
    assert reasons["w"] is None


def test_a_constant_sliced_into_rnn_initial_states_is_not_trained():
    # the dynamo exporter's zero initial state of a 2-layer GRU with a dynamic batch: a scalar
    # Expanded to (layers, batch, hidden), then Sliced per layer into each GRU's initial_h
    w = np.full((1, 6, 2), 0.1, np.float32)
    r = np.full((1, 6, 2), 0.2, np.float32)
    model = _model(
        [
            helper.make_node("Expand", ["zero", "shape"], ["zeros"]),
            helper.make_node("Slice", ["zeros", "start", "end", "axis"], ["h0"]),
            helper.make_node("GRU", ["x", "W", "R", "", "", "h0"], ["y"], hidden_size=2),
        ],
        [
            helper.make_tensor_value_info("x", F, [3, "b", 2]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
        ],
        [helper.make_tensor_value_info("y", F, [3, 1, "b", 2])],
        {
            "zero": np.array(0.0, np.float32), "W": w, "R": r, "start": np.array([0]),
            "end": np.array([1]), "axis": np.array([0]),
        },
    )  # fmt: skip
    reasons = parameter_reasons(model)
    assert reasons["zero"] == "RNN initial state"
    assert reasons["W"] is None and reasons["R"] is None


def test_dynamo_rnns_without_an_initial_state_train_like_torch():
    # issue 37 §15: exported with a dynamic batch, torch's GRU / LSTM start from a scalar zero
    # (val_2) expanded and sliced per layer; trained as a weight, the model drifted from torch's
    # (1e-4 to 6e-3 after 3 SGD steps) and started every sequence from a nonzero state
    import warnings

    import pytest

    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import onnxruntime as ort

    from onnxgrad.train import Trainer

    class First(torch.nn.Module):
        def __init__(self, rnn: torch.nn.Module) -> None:
            super().__init__()
            self.rnn = rnn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 3, generator=gen)
    target = torch.randn(4, 5, 6, generator=gen)
    for cls in (torch.nn.GRU, torch.nn.LSTM):
        torch.manual_seed(0)
        module = First(cls(3, 6, num_layers=2, batch_first=True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batch = torch.export.Dim("batch")
            model = torch.onnx.export(
                module, (x,), dynamo=True, verbose=False, dynamic_shapes=({0: batch},)
            ).model_proto
        reasons = parameter_reasons(model)
        states = [n for n, r in reasons.items() if r == "RNN initial state"]
        assert states, reasons
        trainer = Trainer(model, loss="mse", optimizer="sgd", lr=0.5, batch_size=4, shuffle=False,
                          progress=False)  # fmt: skip
        name = model.graph.input[0].name
        trainer.fit({name: x.numpy(), "target": target.numpy()}, epochs=3)
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(module(x), target).backward()
            opt.step()
        with torch.no_grad():
            want = module(x).numpy()
        sess = ort.InferenceSession(trainer.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(None, {name: x.numpy()})[0]
        # float32 noise over 3 steps is ~1e-7; a trained initial state moved outputs by 1e-4 and more
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=cls.__name__)
        saved = {i.name: numpy_helper.to_array(i) for i in trainer.to_onnx().graph.initializer}
        for n in states:
            assert not saved[n].any()  # the saved model still starts every sequence from zero
