"""Data-parallel training on torch.distributed: ``Trainer(distributed=True)`` and
``onnxgrad train --distributed`` under ``torchrun --nproc-per-node 2`` (gloo on CPU) train as one
process at the global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxgrad.errors import InputError
from onnxgrad.train import BatchLoader, Trainer
from onnxgrad.train.distributed import ShardedLoader

from ..models import mlp

pytest.importorskip("torch.distributed")

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _problem(tmp_path: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    model = mlp(np.float32, n_in=4, hidden=8, n_out=2)
    onnx.save(model, tmp_path / "model.onnx")
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(32, 4)).astype(np.float32),
        "target": rng.uniform(size=(32, 2)).astype(np.float32),
    }
    np.savez(tmp_path / "data.npz", **data)
    return model, data


def _torchrun(args: list[str], cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    result = subprocess.run([*TORCHRUN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shards_make_the_global_batch() -> None:
    """Step k of the ranks (every world-th index of one permutation, padded as torch pads) covers
    exactly step k of one process at the global batch; the generator advances alike."""
    data = {"i": np.arange(24)}
    one = BatchLoader(data, 6, rng=5)
    ranks = [ShardedLoader(data, 2, rank=r, world=3, rng=5) for r in range(3)]
    for _ in range(2):  # two epochs: one permutation each, the same on every rank
        shards = [list(r) for r in ranks]
        for k, batch in enumerate(one):
            assert sorted(np.concatenate([s[k]["i"] for s in shards])) == sorted(batch["i"])
    padded = ShardedLoader({"i": np.arange(5)}, 2, rank=1, world=2, shuffle=False)
    assert [b["i"].tolist() for b in padded] == [[1, 3], [0]]  # 5 -> 6 samples: index 0 again


def test_torchrun_two_processes_equal_one_process(tmp_path: Path) -> None:
    """Two processes at batch 4 (Adam, shuffled, two epochs) end with the parameters of one process
    at batch 8, within 1e-5, on every rank; only rank 0 writes its checkpoint."""
    model, data = _problem(tmp_path)
    _torchrun([str(HERE / "ddp_worker.py"), "model.onnx", "data.npz", str(tmp_path)], tmp_path)
    one = Trainer(model, loss="mse", optimizer="adam", lr=0.01, batch_size=8, seed=3, progress=False)
    history = one.fit(data, epochs=2)
    for rank in (0, 1):
        with np.load(tmp_path / f"rank{rank}.npz") as f:
            for name, value in one.parameters.items():
                np.testing.assert_allclose(f[name], value, rtol=0, atol=1e-5)
            np.testing.assert_allclose(f["loss"], history["loss"], rtol=1e-5)
    assert (tmp_path / "checkpoint0.npz").exists()
    assert not (tmp_path / "checkpoint1.npz").exists()


def test_cli_distributed(tmp_path: Path) -> None:
    """``onnxgrad train --distributed`` under torchrun writes (rank 0) the model one process at the
    global batch writes."""
    _model, _ = _problem(tmp_path)
    common = [
        "--data",
        "data.npz",
        "--target",
        "target",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--epochs",
        "2",
    ]
    _torchrun(
        [
            "-m",
            "onnxgrad",
            "train",
            "model.onnx",
            *common,
            "--batch-size",
            "4",
            "--distributed",
            "--no-progress",
            "-o",
            "ddp.onnx",
            "--history",
            "ddp.json",
        ],
        tmp_path,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxgrad",
            "train",
            "model.onnx",
            *common,
            "--batch-size",
            "8",
            "--no-progress",
            "-o",
            "one.onnx",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        check=True,
        capture_output=True,
    )
    ddp = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(tmp_path / "ddp.onnx").graph.initializer}
    one = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(tmp_path / "one.onnx").graph.initializer}
    assert sorted(ddp) == sorted(one)
    for name, value in one.items():
        np.testing.assert_allclose(ddp[name], value, rtol=0, atol=1e-5)
    assert (tmp_path / "ddp.json").exists()


def test_without_a_process_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    model, _ = _problem(tmp_path)
    with pytest.raises(InputError, match="launch with torchrun"):
        Trainer(model, loss="mse", distributed=True, progress=False)
