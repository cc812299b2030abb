"""DistributedDataParallel over an OnnxModule: 2 processes, gloo on loopback, CPU.

Both ranks must end with identical weights, equal to one process trained on the concatenated
batches (DDP averages gradients; each rank's loss is a mean over an equal shard).
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from onnxgrad.torch import OnnxModule  # noqa: E402

STEPS, BATCH, WORLD = 5, 8, 2


def _model_bytes() -> bytes:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    buf = io.BytesIO()
    torch.onnx.export(
        net,
        (torch.randn(2, 6),),
        buf,
        dynamo=False,
        input_names=["x"],
        dynamic_axes={"x": {0: "batch"}},
    )
    return buf.getvalue()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, WORLD * BATCH, 6, generator=gen), torch.randn(
        STEPS, WORLD * BATCH, 2, generator=gen
    )


def _train(module: torch.nn.Module, xs: torch.Tensor, ts: torch.Tensor) -> None:
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for x, t in zip(xs, ts):
        opt.zero_grad()
        torch.nn.functional.mse_loss(module(x), t).backward()
        opt.step()


def _worker(rank: int, model: bytes, out_dir: str) -> None:
    # a rendezvous file, not a port: a port found free here can be taken by another test before
    # the ranks bind it (this test failed that way on a busy machine)
    init = "file://" + os.path.join(out_dir, "rendezvous")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        ddp = torch.nn.parallel.DistributedDataParallel(OnnxModule(model))
        xs, ts = _data()
        shard = slice(rank * BATCH, (rank + 1) * BATCH)
        _train(ddp, xs[:, shard], ts[:, shard])
        state = {k: v.numpy() for k, v in ddp.module.state_dict().items()}
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **state)
    finally:
        dist.destroy_process_group()


def test_ddp_two_ranks_equal_single_process(tmp_path):
    model = _model_bytes()
    mp.spawn(_worker, args=(model, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(WORLD)]
    single = OnnxModule(model)
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    _train(single, *_data())
    for name, value in single.state_dict().items():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])
        np.testing.assert_allclose(ranks[0][name], value.numpy(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(value, initial[name])  # training did move every weight
