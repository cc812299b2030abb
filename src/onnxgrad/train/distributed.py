"""Data-parallel training of :class:`~onnxgrad.train.Trainer` on ``torch.distributed``.

Launched with ``torchrun``, every process runs the same :class:`Trainer` on its share of the data:

- the data are split as torch's ``DistributedSampler`` splits them: each epoch, every rank draws the
  same permutation (the trainer's seeded generator), pads it to a multiple of the world size by
  repeating its first indices, and rank ``r`` takes every world-th index from ``r``;
- ``batch_size`` is per process, so ``N`` processes at batch ``b`` take, at step ``k``, exactly the
  examples one process at batch ``N·b`` takes at its step ``k``;
- after each backward the gradients are averaged over the processes (``all_reduce``, then divided by
  the world size), so every rank makes the same update; with equal batches this is the gradient of
  the mean loss over the global batch.

The gradients are host (numpy) arrays, so the reduction runs on CPU tensors: the ``gloo`` backend.
A process group the caller initialised (any backend that reduces CPU tensors) is used as it is;
otherwise one is made from torchrun's environment (``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``...).
Only rank 0 writes (checkpoints, history files, the progress bar): :attr:`DataParallel.is_writer`.
"""

from __future__ import annotations

import atexit
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..deps import require_torch
from ..errors import InputError
from .data import BatchLoader

__all__ = ["DataParallel", "ShardedLoader"]


class ShardedLoader(BatchLoader):
    """The mini-batches of one rank: :class:`BatchLoader`'s permutation (one draw per pass, so a
    resumed run continues alike), padded to a multiple of ``world``, then every ``world``-th index
    from ``rank`` (``torch.utils.data.DistributedSampler``'s split)."""

    def __init__(self, data: Mapping[str, np.ndarray], batch_size: int, *, rank: int, world: int, **kw: Any):
        super().__init__(data, batch_size, **kw)
        self.rank, self.world = rank, world
        self.n_rank = math.ceil(self.n / world)  # the samples of each rank, padding included
        if self.drop_last and self.n_rank < self.batch_size:
            raise InputError(
                f"drop_last with {self.n} samples over {world} processes and batch_size {batch_size} "
                "leaves no batch"
            )

    def __len__(self) -> int:
        if self.drop_last:
            return self.n_rank // self.batch_size
        return math.ceil(self.n_rank / self.batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        order = self.rng.permutation(self.n) if self.shuffle else np.arange(self.n)
        padded = np.resize(order, self.n_rank * self.world)  # repeats the first indices, as torch does
        mine = padded[self.rank :: self.world]
        for k in range(len(self)):
            idx = mine[k * self.batch_size : (k + 1) * self.batch_size]
            yield {name: arr[idx] for name, arr in self.data.items()}


def _end_group() -> None:
    """Destroy the default process group, if it still exists (at exit)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class DataParallel:
    """The process group of a data-parallel run: rank, world size, the gradient average."""

    def __init__(self) -> None:
        require_torch()
        import torch.distributed as dist

        if not dist.is_available():
            raise InputError("Trainer(distributed=True): this torch build has no torch.distributed")
        if not dist.is_initialized():
            missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise InputError(
                    f"Trainer(distributed=True) needs a process group: launch with torchrun "
                    f"(environment variables {missing} are not set) or call "
                    "torch.distributed.init_process_group first"
                )
            dist.init_process_group("gloo")
            # the group made here is ended here: left to the interpreter's exit, gloo's threads may
            # abort the process ("terminate called without an active exception") after training
            atexit.register(_end_group)
        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes checkpoints, history and the progress bar; the others only train."""
        return self.rank == 0

    def loader(self, data: Mapping[str, np.ndarray], batch_size: int, **kw: Any) -> ShardedLoader:
        """This rank's mini-batches of ``data``."""
        return ShardedLoader(data, batch_size, rank=self.rank, world=self.world, **kw)

    def average(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``grads`` averaged over the processes (in place where they are writable float arrays)."""
        import torch

        out = {}
        for name in sorted(grads):  # the same order on every rank
            t = torch.from_numpy(np.ascontiguousarray(grads[name]))
            if not t.is_floating_point():
                raise InputError(f"the gradient of {name!r} has dtype {grads[name].dtype}, not a float")
            work = t.to(torch.float64) if t.dtype in (torch.float16, torch.bfloat16) else t
            self._dist.all_reduce(work)
            work /= self.world
            out[name] = work.to(t.dtype).numpy() if work is not t else t.numpy()
        return out

    def sum(self, *values: float) -> list[float]:
        """Each value summed over the processes (epoch losses and sample counts)."""
        import torch

        t = torch.tensor(values, dtype=torch.float64)
        self._dist.all_reduce(t)
        return [float(v) for v in t]
