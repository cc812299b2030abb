"""One input contract through every door: what a given array may be fed as, decided once
(:func:`onnxgrad.runtime.values.coerce`) and held by ForwardBackward, OnnxModule, the Trainer and
artifacts.Runner alike."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad import artifacts
from onnxgrad.errors import InputError, InputTypeError
from onnxgrad.runtime.values import coerce, feed_dtype
from onnxgrad.train import Trainer

torch = pytest.importorskip("torch")
from onnxgrad.torch import OnnxModule  # noqa: E402

VOCAB, DIM, CLASSES, N = 10, 4, 3, 6
IDS = np.array([0, 3, 9, 1, 1, 7], np.int64)
TARGET = np.array([0, 2, 1, 1, 0, 2], np.int64)


def embedding_classifier() -> onnx.ModelProto:
    """ids (N,) int64 -> Gather(E) -> MatMul(W) -> logits (N, 3)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["logits"])],
        "embedding_classifier",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        [
            numpy_helper.from_array(rng.standard_normal((VOCAB, DIM)).astype(np.float32), "E"),
            numpy_helper.from_array(rng.standard_normal((DIM, CLASSES)).astype(np.float32), "W"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


# the contract: (the ids given, what every door does: None = the same result as int64 ids, else the
# error type and message)
CASES = {
    "int64": (IDS, None),
    "int32": (IDS.astype(np.int32), None),
    "uint8": (IDS.astype(np.uint8), None),
    "float32 whole numbers": (IDS.astype(np.float32), None),
    "float64 whole numbers": (IDS.astype(np.float64), None),
    "float32 with a fraction": (
        IDS.astype(np.float32) + np.float32(0.5),
        (InputError, r"expects integers \(int64\), the data has non-integers such as 0.5"),
    ),
    "NaN": (np.full(N, np.nan, np.float32), (InputError, "non-integers such as nan")),
    "bool": (np.ones(N, bool), None),
    "uint64 beyond int64": (
        np.full(N, 2**64 - 1, np.uint64),
        (InputError, r"holds 18446744073709551615, outside the range of int64"),
    ),
    "float beyond int64": (
        np.full(N, 1e19, np.float64),
        (InputError, r"holds 1e\+19, outside the range of int64"),
    ),
    "strings": (np.array(["a"] * N), (InputTypeError, r"has dtype str32, the model expects int64")),
}


def _ids(given: np.ndarray) -> dict[str, np.ndarray]:
    return {"ids": given}


def door_forward_backward(given: np.ndarray) -> np.ndarray:
    fb = onnxgrad.ForwardBackward(embedding_classifier())
    return fb.forward(_ids(given)).outputs[0]


def door_onnx_module(given: np.ndarray) -> np.ndarray:
    module = OnnxModule(embedding_classifier())
    t = torch.from_numpy(given) if given.dtype.kind != "U" else given
    return module(t).detach().numpy()


def door_trainer(given: np.ndarray) -> np.ndarray:
    trainer = Trainer(
        embedding_classifier(),
        loss="cross_entropy",
        optimizer="sgd",
        lr=0.1,
        batch_size=N,
        shuffle=False,
        progress=False,
    )
    trainer.fit({**_ids(given), "target": TARGET}, epochs=1)
    return np.concatenate([trainer.parameters[n].ravel() for n in sorted(trainer.parameters)])


def door_runner(given: np.ndarray, tmp_path=None) -> np.ndarray:
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        artifacts.generate(embedding_classifier(), loss="cross_entropy", optimizer="sgd", lr=0.1, out_dir=out)
        runner = artifacts.Runner(out)
        runner.step({**_ids(given), "target": TARGET})
        return np.concatenate([runner.parameters[n].ravel() for n in sorted(runner.parameters)])


DOORS = {
    "ForwardBackward": door_forward_backward,
    "OnnxModule": door_onnx_module,
    "Trainer": door_trainer,
    "Runner": door_runner,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("door", list(DOORS))
def test_every_door_holds_the_contract(door, case):
    given, refused = CASES[case]
    run = DOORS[door]
    if door == "OnnxModule" and given.dtype.kind == "U":
        with pytest.raises(InputError, match=r"must be a torch\.Tensor"):
            run(given)
        return
    if refused is None:
        want = run(IDS if case != "bool" else np.ones(N, np.int64))
        np.testing.assert_array_equal(run(given), want)
    else:
        kind, message = refused
        with pytest.raises(kind, match=message):
            run(given)


@pytest.mark.parametrize("door", ["ForwardBackward", "Trainer", "Runner"])
def test_every_door_refuses_an_array_the_model_does_not_take(door):
    extra = {"ids": IDS, "mask": np.ones(N, np.int64)}
    with pytest.raises(InputError, match="'mask'"):
        if door == "ForwardBackward":
            onnxgrad.ForwardBackward(embedding_classifier()).forward(extra)
        elif door == "Trainer":
            Trainer(embedding_classifier(), loss="cross_entropy", progress=False).fit(
                {**extra, "target": TARGET}
            )
        else:
            door_runner_extra(extra)


def door_runner_extra(extra: dict[str, np.ndarray]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        artifacts.generate(embedding_classifier(), loss="cross_entropy", optimizer="sgd", out_dir=out)
        artifacts.Runner(out).step({**extra, "target": TARGET})


def test_onnx_module_refuses_an_unknown_keyword_input():
    module = OnnxModule(embedding_classifier())
    with pytest.raises(
        InputError, match=r"unknown input name\(s\) \['idz'\]; the model's inputs are \['ids'\]"
    ):
        module(idz=torch.from_numpy(IDS))
    np.testing.assert_array_equal(
        module(ids=torch.from_numpy(IDS)).detach(), module(torch.from_numpy(IDS)).detach()
    )


def test_floats_take_the_model_float_type():
    assert coerce("input 'x'", np.ones(3, np.float64), np.dtype(np.float32)).dtype == np.float32
    assert coerce("input 'x'", [1, 2], np.dtype(np.float32)).dtype == np.float32
    assert feed_dtype("input 'x'", "bfloat16", "float32") == "float32"
    with pytest.raises(InputTypeError, match=r"input 'x' has dtype float32, the model expects bool"):
        feed_dtype("input 'x'", "float32", "bool")
    with pytest.raises(InputError, match=r"input 'x' holds 300, outside the range of int8"):
        coerce("input 'x'", np.array([1, 300]), np.dtype(np.int8))
    with pytest.raises(InputError, match=r"input 'x' holds -1, outside the range of uint8"):
        coerce("input 'x'", np.array([-1, 3]), np.dtype(np.uint8))
