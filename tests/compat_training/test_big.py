"""Models over 2 GB (onnxruntime issue #18874): generate_artifacts -> Module training steps ->
save_checkpoint / load_checkpoint -> export_model_for_inferencing, every file's weights kept as
external data (``<file>.data`` beside it; the checkpoint's in ``<checkpoint>.data``).

The external-data path is proven on a small model with the threshold lowered to 1 MB
(``checkpoint_file.EXTERNAL_DATA_THRESHOLD``): every step gives exactly the numbers of the same
model kept in one file. ``ONNXGRAD_BIG=1`` also runs a synthetic model of 2.1 GB (random weights,
external data) through the same steps, SGD: measured on 2 shared cores, 430 s, 8.0 GiB of temporary
files (removed at the end) and 10.9 GB of peak memory, too much for CI.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad.compat.training as og
from onnxgrad.compat.training import checkpoint_file
from onnxgrad.errors import InputError

MB = 2**20
LR = 1e-4


def wide_mlp(width: int, layers: int, seed: int = 0, constant: bool = False) -> onnx.ModelProto:
    """x[N, 8] -> MatMul w0[8, width] -> (Tanh -> MatMul w_k[width, width])* -> MatMul head[width, 1].
    ``constant``: one more [width, width] weight that is not trained (stays in the training model)."""
    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "input"
    shapes = [(8, width), *[(width, width)] * (layers - 1), (width, 1)]  # weights w0..w<layers>
    names = [f"w{k}" for k in range(len(shapes))]
    for k, (name, shape) in enumerate(zip(names, shapes)):
        weight = rng.standard_normal(shape, dtype=np.float32)
        weight *= np.float32(1 / np.sqrt(shape[0]))
        inits.append(numpy_helper.from_array(weight, name))
        nodes.append(helper.make_node("MatMul", [prev, name], [f"mm{k}"], name=f"mm{k}"))
        prev = f"mm{k}"
        if k < len(shapes) - 1:
            nodes.append(helper.make_node("Tanh", [prev], [f"t{k}"], name=f"tanh{k}"))
            prev = f"t{k}"
        if constant and k == 0:
            value = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
            inits.append(numpy_helper.from_array(value, "fixed"))
            nodes.append(helper.make_node("MatMul", [prev, "fixed"], ["fixed_out"], name="fixed"))
            prev = "fixed_out"
    graph = helper.make_graph(
        nodes,
        "wide_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["batch", 1])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _save_external(model: onnx.ModelProto, path: str) -> str:
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        location=os.path.basename(path) + ".data",
        size_threshold=1024,
    )
    return path


def _data(n: int = 32, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return x, np.sin(x.sum(1, keepdims=True)).astype(np.float32)


def _pipeline(
    model_path: str, work: str, optimizer, layers: int, steps: int = 3, keep_params: bool = True
) -> dict:
    """Every step of the migration on ``wide_mlp(..., layers)``: what each returns."""
    params = [f"w{k}" for k in range(layers + 1)]
    folder = os.path.join(work, "artifacts")
    og.artifacts.generate_artifacts(
        model_path,
        requires_grad=params,
        loss=og.artifacts.LossType.MSELoss,
        optimizer=optimizer,
        artifact_directory=folder,
    )
    state = og.api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = og.api.Module(
        os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx")
    )
    opt = og.api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    x, y = _data()
    losses = []
    for _ in range(steps):
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    saved = os.path.join(work, "trained")
    state.properties["steps"] = steps
    og.api.CheckpointState.save_checkpoint(state, saved, include_optimizer_state=True)
    next_loss = float(module(x, y))  # what the saved state gives next
    module.eval()
    eval_loss = float(module(x, y))
    inference = os.path.join(work, "inference.onnx")
    module.export_model_for_inferencing(inference, [f"mm{layers}"])  # the model's output
    session = ort.InferenceSession(inference, providers=["CPUExecutionProvider"])  # from the path
    (pred,) = session.run(None, {"input": x})
    del module, opt, state, session  # one model in memory at a time
    resumed = og.api.CheckpointState.load_checkpoint(saved)
    module = og.api.Module(
        os.path.join(folder, "training_model.onnx"), resumed, os.path.join(folder, "eval_model.onnx")
    )
    og.api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)  # it takes the saved state
    return {
        "folder": folder,
        "saved": saved,
        "inference": inference,
        "losses": losses,
        "resumed_loss": float(module(x, y)),  # the next step, from the saved state
        "next_loss": next_loss,
        "eval_loss": eval_loss,
        "inference_mse": float(((pred - y) ** 2).mean()),
        "properties": dict(resumed.properties),
        "params": {n: resumed.parameters[n].data for n in params} if keep_params else {},
    }


@pytest.fixture
def low_threshold(monkeypatch):
    """The external-data path from 1 MB on: what a model over 2 GB takes."""
    monkeypatch.setattr(checkpoint_file, "EXTERNAL_DATA_THRESHOLD", 1 * MB)


def _files(folder: str) -> set[str]:
    return set(os.listdir(folder))


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_external_data_path_gives_the_numbers_of_one_file(tmp_path, monkeypatch, optimizer):
    # width 600, 3 layers: 2.9 MB of trained weights and a 1.4 MB constant, over the lowered threshold
    model = wide_mlp(600, 3, constant=True)
    path = _save_external(model, str(tmp_path / "model.onnx"))
    kind = getattr(og.artifacts.OptimType, optimizer)
    inline = _pipeline(path, str(tmp_path / "inline"), kind, 3)
    assert not any(f.endswith(".data") for f in _files(inline["folder"]))
    monkeypatch.setattr(checkpoint_file, "EXTERNAL_DATA_THRESHOLD", 1 * MB)
    ext = _pipeline(path, str(tmp_path / "external"), kind, 3)
    files = _files(ext["folder"])
    # the trained weights are inputs of the training model; the untrained constant stays in it
    assert {"checkpoint.data", "training_model.onnx.data", "eval_model.onnx.data"} <= files
    assert os.path.getsize(os.path.join(ext["folder"], "checkpoint")) < 64 * 1024
    assert os.path.getsize(os.path.join(ext["folder"], "training_model.onnx")) < 64 * 1024
    assert os.path.exists(ext["saved"] + ".data") and os.path.getsize(ext["saved"]) < 64 * 1024
    assert os.path.exists(ext["inference"] + ".data") and os.path.getsize(ext["inference"]) < 64 * 1024
    assert ext["losses"][-1] < ext["losses"][0]
    for key in ("losses", "resumed_loss", "next_loss", "eval_loss", "inference_mse"):
        np.testing.assert_array_equal(ext[key], inline[key], err_msg=key)
    assert ext["resumed_loss"] == ext["next_loss"]  # the checkpoint resumes exactly
    assert ext["properties"] == {"steps": 3}
    for name, value in inline["params"].items():
        np.testing.assert_array_equal(ext["params"][name], value)


def test_external_checkpoint_layout(tmp_path, low_threshold):
    data = checkpoint_file.CheckpointData(
        trainable={"w": np.arange(300_000, dtype=np.float32).reshape(600, 500), "b": np.ones(3, np.float32)},
        frozen={"steps": np.arange(5, dtype=np.int64)},
        groups=[
            checkpoint_file.OptimizerGroup(
                step=4, states={"w": {"momentum0": np.full((600, 500), 0.5, np.float32)}}
            )
        ],
    )
    path = str(tmp_path / "ck")
    checkpoint_file.save(path, data)
    # onnxruntime's own generated reader (the schema 1.19.2 writes with): the flags and offsets
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs import Checkpoint

    with open(path, "rb") as f:
        root = Checkpoint.Checkpoint.GetRootAs(f.read(), 0)
    module = root.ModuleState()
    assert module.HasExternalData()
    tensors = {module.RequiresGradParams(i).Name().decode(): module.RequiresGradParams(i) for i in range(2)}
    assert tensors["w"].ExternalDataOffset() == 0 and tensors["w"].RawDataLength() == 0
    assert tensors["b"].ExternalDataOffset() == -1 and tensors["b"].RawDataLength() == 12  # 12 bytes stay
    moment = root.OptimizerGroups(0).OptimizerStates(0).Momentums(0)
    assert moment.ExternalDataOffset() == 1_200_000  # after w, aligned
    back = checkpoint_file.load(path)
    np.testing.assert_array_equal(back.trainable["w"], data.trainable["w"])
    np.testing.assert_array_equal(back.frozen["steps"], data.frozen["steps"])
    np.testing.assert_array_equal(
        back.groups[0].states["w"]["momentum0"], data.groups[0].states["w"]["momentum0"]
    )
    # saved again under the threshold: one file, which does not read the .data left beside it
    small = checkpoint_file.CheckpointData(trainable={"b": np.full(30, 2.0, np.float32)})
    checkpoint_file.save(path, small)
    os.remove(path + ".data")
    np.testing.assert_array_equal(checkpoint_file.load(path).trainable["b"], np.full(30, 2.0, np.float32))


def test_external_checkpoint_errors(tmp_path, low_threshold):
    data = checkpoint_file.CheckpointData(trainable={"w": np.ones((600, 500), np.float32)})
    path = str(tmp_path / "ck")
    checkpoint_file.save(path, data)
    with open(path, "rb") as f:
        buf = f.read()
    with pytest.raises(InputError, match=r"load the checkpoint from its path, with that file beside it"):
        checkpoint_file.loads(buf)
    with open(path + ".data", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(
        InputError, match=r"past the end of .*ck\.data.* \(1000 bytes\): the file is truncated"
    ):
        og.api.CheckpointState.load_checkpoint(path)
    os.remove(path + ".data")
    with pytest.raises(InputError, match=r"keeps its data in .*ck\.data', which is missing"):
        og.api.CheckpointState.load_checkpoint(path)


def test_training_model_with_missing_external_data(tmp_path, low_threshold):
    path = _save_external(wide_mlp(600, 2, constant=True), str(tmp_path / "model.onnx"))
    folder = str(tmp_path / "art")
    og.artifacts.generate_artifacts(
        path, requires_grad=["w0", "w1", "w2"], loss=og.artifacts.LossType.MSELoss, artifact_directory=folder
    )
    os.remove(os.path.join(folder, "training_model.onnx.data"))
    state = og.api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    with pytest.raises(InputError, match=r"cannot read the external data of the training model"):
        og.api.Module(os.path.join(folder, "training_model.onnx"), state)


def test_module_takes_its_options_from_the_large_state_policy(tmp_path, monkeypatch):
    from onnxgrad.runtime import options as policy

    folder = str(tmp_path / "artifacts")
    og.artifacts.generate_artifacts(
        wide_mlp(8, 1),
        requires_grad=["w0", "w1"],
        loss=og.artifacts.LossType.MSELoss,
        artifact_directory=folder,
    )
    state = og.api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    train = os.path.join(folder, "training_model.onnx")
    assert og.api.Module(train, state)._options is None  # small: the default policy
    monkeypatch.setattr(policy, "NO_ARENA_BYTES", 1)  # the policy's threshold, not the file format's
    assert og.api.Module(train, state)._options.enable_cpu_mem_arena is False


@pytest.mark.skipif(os.environ.get("ONNXGRAD_BIG") != "1", reason="ONNXGRAD_BIG=1 runs the 2.1 GB model")
def test_model_over_2gb(tmp_path):
    # 8 weights of [8192, 8192] float32 (256 MB each) and two thin ones: 2.1 GB of random weights
    width, layers = 8192, 9
    started = time.perf_counter()
    try:
        model = wide_mlp(width, layers)
        assert sum(4 * np.prod(i.dims) for i in model.graph.initializer) > 2**31
        path = _save_external(model, str(tmp_path / "big.onnx"))
        del model
        result = _pipeline(
            path, str(tmp_path / "work"), og.artifacts.OptimType.SGD, layers, steps=2, keep_params=False
        )
        assert result["losses"][-1] < result["losses"][0]
        assert result["resumed_loss"] == result["next_loss"]
        assert os.path.getsize(os.path.join(result["folder"], "checkpoint.data")) > 2**31
        assert os.path.getsize(os.path.join(result["folder"], "checkpoint")) < 64 * 1024
        assert os.path.getsize(result["inference"] + ".data") > 2**31
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path) for f in fs)
        print(f"model over 2 GB: {time.perf_counter() - started:.0f} s, {disk / 2**30:.1f} GiB of files")
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # 8 GiB: not left for pytest's rotation


def test_model_given_in_memory_takes_the_same_path(tmp_path, low_threshold):
    path = _save_external(wide_mlp(600, 2), str(tmp_path / "model.onnx"))  # onnx.save moves its data out
    model = wide_mlp(600, 2)  # the same, its weights in memory
    runs = {}
    for name, given in (("path", path), ("proto", model)):
        folder = str(tmp_path / name)
        og.artifacts.generate_artifacts(
            given,
            requires_grad=["w0", "w1", "w2"],
            loss=og.artifacts.LossType.MSELoss,
            artifact_directory=folder,
        )
        assert os.path.exists(os.path.join(folder, "checkpoint.data"))
        state = og.api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        module = og.api.Module(os.path.join(folder, "training_model.onnx"), state)
        runs[name] = float(module(*_data()))
    assert runs["proto"] == runs["path"]
    assert (
        len(model.graph.initializer) == 3 and model.graph.initializer[0].raw_data
    )  # the caller's model kept
