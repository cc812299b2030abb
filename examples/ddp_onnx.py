"""Data-parallel training of an ONNX model with torchrun (gloo backend, CPU).

    torchrun --nproc_per_node=2 examples/ddp_onnx.py model.onnx

Each process trains an OnnxModule wrapped in DistributedDataParallel on its own shard of random
data (a toy objective: drive the outputs to zero); gradients are averaged across processes, so
every rank ends with the same weights.
"""

from __future__ import annotations

import sys

import onnx
import torch
import torch.distributed as dist

from onnxgrad.torch import OnnxModule


def main(path: str, steps: int = 20, batch: int = 8) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    dims = onnx.load(path).graph.input[0].type.tensor_type.shape.dim
    features = [d.dim_value for d in dims[1:]]  # the first dimension is the batch
    model = torch.nn.parallel.DistributedDataParallel(OnnxModule(path))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        loss = model(torch.randn(batch, *features, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
