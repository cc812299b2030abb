"""Federated training on Flower's deployment engine: a SuperLink and SuperNodes on loopback
(subprocesses started by the fixtures), ``flwr run`` of tests/federated/app against them.

The module's nodes cannot import torch (a ``torch`` package that raises on import comes first on
their path): every node here trains with onnxruntime alone.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("flwr", reason="the federated extra (flwr) is not installed")

from flwr.app import Array

from onnxgrad.artifacts import generate
from onnxgrad.errors import GradientWarning
from onnxgrad.federated.server import CHECKPOINT
from onnxgrad.lora import adapter_names, add_adapters, read_ort_adapter
from onnxgrad.train import Trainer
from onnxgrad.train.checkpoint import read_checkpoint

from ..models import make_model, mlp
from .cluster import SRC, Cluster

LR = 0.1


def _linear(seed: int = 0) -> onnx.ModelProto:
    """y = x W + b, float32, 4 features, 2 outputs."""
    rng = np.random.default_rng(seed)
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "W"], ["h"]),
        onnx.helper.make_node("Add", ["h", "b"], ["y"]),
    ]
    inits = {"W": rng.normal(size=(4, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
    return make_model(nodes, [("x", np.float32, ["N", 4])], [("y", np.float32, ["N", 2])], inits)


def _shards(folder: Path, n_in: int, n_out: int, nodes: int = 2, n: int = 16) -> list[dict[str, np.ndarray]]:
    """Equal shards of a regression problem, one ``part{i}.npz`` per node in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    parts = []
    for i in range(nodes):
        part = {
            "x": rng.normal(size=(n, n_in)).astype(np.float32),
            "target": rng.normal(size=(n, n_out)).astype(np.float32),
        }
        np.savez(folder / f"part{i}.npz", **part)
        parts.append(part)
    return parts


def _central(model: onnx.ModelProto, data: dict[str, np.ndarray], steps: int) -> dict[str, np.ndarray]:
    """Full-batch gradient descent on ``data``: ``steps`` SGD steps at :data:`LR`."""
    n = len(data["x"])
    trainer = Trainer(model, loss="mse", optimizer="sgd", lr=LR, batch_size=n, shuffle=False, progress=False)
    trainer.fit(data, epochs=steps)
    return {k: v.copy() for k, v in trainer.parameters.items()}


def _union(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _checkpoint(out: Path) -> dict:
    return read_checkpoint(out / CHECKPOINT)


def _run(cluster: Cluster, app: Path | None = None, **config: object) -> str:
    result = cluster.run(config, app=app) if app else cluster.run({"lr": LR, **config})
    logs = result.stdout + result.stderr
    # flwr run --stream exits with 0 when the ServerApp raised: its log says so
    assert result.returncode == 0 and "raised an exception" not in logs, logs + cluster.logs()
    return logs


@pytest.fixture(scope="module")
def torchless_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A path on which ``import torch`` fails (a ``torch`` package that raises), for the nodes."""
    folder = tmp_path_factory.mktemp("no_torch")
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text('raise ImportError("torch is not on this node")\n')
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(SRC)])}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, torchless_env: dict[str, str]) -> Iterator[Cluster]:
    """A SuperLink and two SuperNodes that cannot import torch."""
    c = Cluster(tmp_path_factory.mktemp("flower"), nodes=2, env=torchless_env)
    try:
        yield c
    finally:
        c.close()


def test_fedavg_equals_central_gd_and_resumes(nodes: Cluster, tmp_path: Path) -> None:
    """One local full-batch SGD step per round on equal shards is central GD on their union; a new
    run resumes from the checkpoint of the last round and continues alike."""
    model = _linear()
    onnx.save(model, tmp_path / "model.onnx")
    parts = _shards(tmp_path / "data", 4, 2)
    out = tmp_path / "out"
    config = {"model": str(tmp_path / "model.onnx"), "data": str(tmp_path / "data"), "out-dir": str(out)}
    _run(nodes, **config, **{"num-server-rounds": 2, "local-steps": 1})
    state = _checkpoint(out)
    assert state["round"] == 2
    expected = _central(model, _union(parts), 2)
    for name, value in expected.items():
        np.testing.assert_allclose(state["params"][name], value, rtol=0, atol=1e-5)

    _run(nodes, **config, **{"num-server-rounds": 3, "local-steps": 1, "resume": True})
    state = _checkpoint(out)
    assert state["round"] == 3
    expected = _central(model, _union(parts), 3)
    written = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(out / "model.onnx").graph.initializer}
    for name, value in expected.items():
        np.testing.assert_allclose(state["params"][name], value, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(written[name], state["params"][name])
    history = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in history] == [1, 2, 3]
    assert all(r["replies"] == 2 and r["rejected"] == [] for r in history)
    # the loss the nodes report is the loss before their step: it falls as central GD's does
    losses = [r["train_loss"] for r in history]
    assert losses[0] > losses[1] > losses[2]


@pytest.mark.parametrize("strategy", ["fedmedian", "fedadam"])
def test_other_strategies(nodes: Cluster, tmp_path: Path, strategy: str) -> None:
    """Flower's other strategies aggregate as they do: FedMedian of two nodes is their mean (central
    GD again); FedAdam's server-side Adam keeps the model's float32 and trains."""
    model = _linear()
    onnx.save(model, tmp_path / "model.onnx")
    parts = _shards(tmp_path / "data", 4, 2)
    out = tmp_path / "out"
    config = {"model": str(tmp_path / "model.onnx"), "data": str(tmp_path / "data"), "out-dir": str(out)}
    _run(nodes, **config, strategy=strategy, **{"num-server-rounds": 2, "local-steps": 1})
    state = _checkpoint(out)
    assert {k: v.dtype for k, v in state["params"].items()} == {"W": np.float32, "b": np.float32}
    history = json.loads((out / "history.json").read_text())
    assert [r["replies"] for r in history] == [2, 2]
    if strategy == "fedmedian":
        for name, value in _central(model, _union(parts), 2).items():
            np.testing.assert_allclose(state["params"][name], value, rtol=0, atol=1e-5)
    else:
        assert history[1]["train_loss"] < history[0]["train_loss"]


def test_bad_replies_are_rejected(nodes: Cluster, tmp_path: Path) -> None:
    """Node 1 replies with unknown names, a wrong shape, a wrong dtype, NaN (one per round): each is
    rejected with a log line naming the node, and the global model is node 0's alone."""
    model = _linear()
    onnx.save(model, tmp_path / "model.onnx")
    parts = _shards(tmp_path / "data", 4, 2)
    out = tmp_path / "out"
    kinds = ["unknown", "shape", "dtype", "nan"]
    logs = _run(
        nodes,
        model=str(tmp_path / "model.onnx"),
        data=str(tmp_path / "data"),
        **{"out-dir": str(out), "num-server-rounds": 4, "local-steps": 1},
        **{"bad-node": 1, "bad-kind": ",".join(kinds)},
    )
    history = json.loads((out / "history.json").read_text())
    reasons = ["unknown arrays", "has shape", "has dtype float64", "NaN"]
    for record, reason in zip(history, reasons, strict=True):
        assert record["replies"] == 1
        [rejected] = record["rejected"]
        assert reason in rejected["reason"]
        assert f"rejected the reply of node {rejected['node']}: {rejected['reason']}" in logs
    state = _checkpoint(out)
    expected = _central(model, parts[0], 4)  # the good node's steps alone
    for name, value in expected.items():
        np.testing.assert_allclose(state["params"][name], value, rtol=0, atol=1e-5)


def test_artifacts_folder_on_nodes_without_torch(nodes: Cluster, tmp_path: Path) -> None:
    """The nodes (no torch importable) train an artifacts folder with onnxruntime alone: one
    full-batch step is central GD's, as with the model."""
    model = _linear()
    generate(model, loss="mse", optimizer="sgd", lr=LR, out_dir=tmp_path / "folder")
    parts = _shards(tmp_path / "data", 4, 2)
    out = tmp_path / "out"
    config = {"model": str(tmp_path / "folder"), "data": str(tmp_path / "data"), "out-dir": str(out)}
    _run(nodes, **config, **{"num-server-rounds": 1, "local-steps": 1})
    state = _checkpoint(out)
    expected = _central(model, _union(parts), 1)
    for name, value in expected.items():
        np.testing.assert_allclose(state["params"][name], value, rtol=0, atol=1e-5)
    assert (out / "model.onnx").exists()


def test_lora_only_adapters_travel(nodes: Cluster, tmp_path: Path) -> None:
    """With LoRA adapters, the messages carry the adapters and nothing else: the bytes sent and
    received each round are those of the adapter arrays; the base stays as it was."""
    base = mlp(np.float32, n_in=4, hidden=16, n_out=2)
    model = add_adapters(base, ["W1", "W2"], rank=2)
    onnx.save(model, tmp_path / "model.onnx")
    _shards(tmp_path / "data", 4, 2)
    out = tmp_path / "out"
    config = {"model": str(tmp_path / "model.onnx"), "data": str(tmp_path / "data"), "out-dir": str(out)}
    _run(nodes, **config, **{"num-server-rounds": 1, "local-steps": 2, "batch-size": 4})
    names = adapter_names(model)
    state = _checkpoint(out)
    assert sorted(state["params"]) == sorted(names)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    # what Flower serializes for these arrays (the array bytes, a small header, the key)
    adapters = sum(len(Array(inits[n]).data) + len(n) for n in names)
    everything = sum(len(Array(v).data) + len(k) for k, v in inits.items())
    [record] = json.loads((out / "history.json").read_text())
    assert record["bytes_sent"] == record["bytes_received"] == 2 * adapters
    assert adapters < everything / 2
    written = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(out / "model.onnx").graph.initializer}
    for name in ("W1", "b1", "W2", "b2"):
        np.testing.assert_array_equal(written[name], inits[name])
    assert any(not np.array_equal(written[n], inits[n]) for n in names)  # the adapters trained
    assert (out / "adapters.onnx_adapter").exists()


INT4 = Path(__file__).resolve().parents[1] / "data" / "genai_llama_int4" / "model.onnx"


def _qlora_llm() -> onnx.ModelProto:
    """onnxruntime-genai's tiny int4 Llama with rank-4 adapters on every MatMulNBits, and its logits
    transposed to (batch, vocabulary, position): the classes on axis 1, as cross_entropy reads them."""
    with pytest.warns(GradientWarning, match="accuracy_level=4"):
        model = add_adapters(onnx.load(INT4), "*", rank=4, alpha=8)
    g = model.graph
    g.node.append(onnx.helper.make_node("Transpose", ["logits"], ["class_scores"], perm=[0, 2, 1]))
    g.output.append(
        onnx.helper.make_tensor_value_info(
            "class_scores", onnx.TensorProto.FLOAT, ["batch", 128, "positions"]
        )
    )
    return model


def _token_shards(folder: Path, nodes: int = 2, n: int = 8) -> None:
    """Next-token examples per node: node ``i`` counts by ``i + 1`` modulo the vocabulary."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(nodes):
        ids = (rng.integers(0, 128, (n, 1)) + (i + 1) * np.arange(9)) % 128
        part = {"input_ids": ids[:, :-1], "attention_mask": np.ones((n, 8), np.int64), "target": ids[:, 1:]}
        for layer in range(2):
            for kind in ("key", "value"):
                part[f"past_key_values.{layer}.{kind}"] = np.zeros((n, 2, 0, 16), np.float32)
        np.savez(folder / f"part{i}.npz", **part)


def test_federated_qlora_of_the_int4_llm(nodes: Cluster, tmp_path: Path) -> None:
    """Federated QLoRA of the int4 LLM onnxruntime-genai's builder writes: only the adapters travel
    (the messages' bytes are theirs), the 4-bit base stays as it was, the loss falls."""
    model = _qlora_llm()
    onnx.save(model, tmp_path / "model.onnx")
    _token_shards(tmp_path / "data")
    out = tmp_path / "out"
    _run(
        nodes,
        model=str(tmp_path / "model.onnx"),
        data=str(tmp_path / "data"),
        loss="cross_entropy",
        lr=0.5,
        **{"loss-output": "class_scores", "out-dir": str(out), "num-server-rounds": 2, "local-steps": 2},
    )
    names = adapter_names(model)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    adapters = sum(len(Array(inits[n]).data) + len(n) for n in names)
    history = json.loads((out / "history.json").read_text())
    assert all(r["bytes_sent"] == r["bytes_received"] == 2 * adapters for r in history)
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert sorted(_checkpoint(out)["params"]) == sorted(names)
    written = {t.name: t for t in onnx.load(out / "model.onnx").graph.initializer}
    for t in model.graph.initializer:
        if t.name not in names:  # the 4-bit weights, scales, norms, rotary tables: as they were
            assert written[t.name].SerializeToString() == t.SerializeToString(), t.name
    served = read_ort_adapter(out / "adapters.onnx_adapter")
    for name in names:
        np.testing.assert_array_equal(served[name], onnx.numpy_helper.to_array(written[name]))


def _digits(folder: Path, nodes: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """An MLP (64 -> 32 -> 10 logits) and non-IID shards of sklearn's digits: node ``i`` holds the
    classes ``c`` with ``c % nodes == i``. Returns the model and the held-out data."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    test, train = order[:300], order[300:]
    folder.mkdir(parents=True)
    for i in range(nodes):
        mine = train[y[train] % nodes == i]
        np.savez(folder / f"part{i}.npz", x=x[mine], target=y[mine].astype(np.int64))
    inits = {
        "W1": (rng.normal(size=(64, 32)) / 8).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "W2": (rng.normal(size=(32, 10)) / 6).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }
    nodes_ = [
        onnx.helper.make_node("Gemm", ["x", "W1", "b1"], ["h"]),
        onnx.helper.make_node("Relu", ["h"], ["r"]),
        onnx.helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"]),
    ]
    model = make_model(nodes_, [("x", np.float32, ["N", 64])], [("logits", np.float32, ["N", 10])], inits)
    return model, {"x": x[test], "target": y[test].astype(np.int64)}


def test_non_iid_digits_loss_falls_and_survives_a_dead_node(new_cluster, tmp_path: Path) -> None:
    """Three nodes with non-IID digits: the global model's held-out loss falls round after round; a
    node killed after round 2 leaves the run to the other two, every checkpoint is intact, and a new
    run resumes from the last one."""
    cluster = new_cluster(3)
    model, held_out = _digits(tmp_path / "data", 3)
    onnx.save(model, tmp_path / "model.onnx")
    np.savez(tmp_path / "held_out.npz", **held_out)
    out = tmp_path / "out"
    config = {
        "model": str(tmp_path / "model.onnx"),
        "data": str(tmp_path / "data"),
        "held-out": str(tmp_path / "held_out.npz"),
        "out-dir": str(out),
        "loss": "cross_entropy",
        "lr": 0.2,
        "batch-size": 32,
        "nodes": 3,
        "min-nodes": 2,
        "round-timeout": 30.0,
    }

    def rounds_done() -> int:
        try:
            return len(json.loads((out / "history.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    def kill_after_round_2() -> None:
        while rounds_done() < 2:
            time.sleep(0.2)
        cluster.kill(cluster.nodes[2])

    killer = threading.Thread(target=kill_after_round_2, daemon=True)
    killer.start()
    result = cluster.run({**config, "num-server-rounds": 3})
    killer.join(1)
    assert result.returncode == 0, result.stdout + result.stderr + cluster.logs()
    history = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in history] == [1, 2, 3]
    assert [r["replies"] for r in history] == [3, 3, 2]
    assert _checkpoint(out)["round"] == 3
    initial = Trainer(model, loss="cross_entropy", progress=False).evaluate(held_out)["loss"]
    losses = [r["held_out_loss"] for r in history]
    assert initial > losses[0] > losses[1]  # all three nodes
    assert losses[2] < initial  # the two left

    result = cluster.run({**config, "num-server-rounds": 4, "resume": True})
    assert result.returncode == 0, result.stdout + result.stderr + cluster.logs()
    history = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in history] == [1, 2, 3, 4]
    assert history[3]["replies"] == 2
    assert _checkpoint(out)["round"] == 4
    written = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(out / "model.onnx").graph.initializer}
    for name, value in _checkpoint(out)["params"].items():
        np.testing.assert_array_equal(written[name], value)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "federated"


@pytest.mark.parametrize("name", ["digits", "qlora"])
def test_example_apps_run(nodes: Cluster, tmp_path: Path, name: str) -> None:
    """examples/federated's Flower Apps, as docs/federated.md runs them (one round here)."""
    config: dict[str, object] = {"out-dir": str(tmp_path / "out"), "num-server-rounds": 1}
    if name == "qlora":
        config["model"] = str(INT4)
    _run(nodes, app=EXAMPLES / name, **config)
    [record] = json.loads((tmp_path / "out" / "history.json").read_text())
    assert record["replies"] == 2 and record["rejected"] == []
    assert (tmp_path / "out" / "model.onnx").exists()
    if name == "digits":
        assert 0 <= record["held_out_accuracy"] <= 1
    else:
        assert (tmp_path / "out" / "adapters.onnx_adapter").exists()
