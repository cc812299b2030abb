"""Functions that call collectives, exported and trained under DistributedDataParallel: 2 gloo ranks
on loopback (CPU), the exported model against the eager module on the same rank and data.

Mirrors ORTModule's autograd_dist scenarios: an all-reduce in forward (Megatron's reduce), one in
backward (Megatron's copy), an in-place all-reduce with and without ``ctx.mark_dirty``.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import onnxgrad
from onnxgrad.errors import PythonOpError
from onnxgrad.torch import OnnxModule
from tests.pythonop.functions import ReduceMarkDirty, ReduceModel, ReduceNoMarkDirty, TensorParallel

STEPS, BATCH, WORLD = 4, 6, 2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """One batch per rank, seen at every step (so the loss must go down)."""
    gen = torch.Generator().manual_seed(3)
    x, t = torch.randn(WORLD * BATCH, 6, generator=gen), torch.randn(WORLD * BATCH, 6, generator=gen)
    return x.expand(STEPS, -1, -1), t.expand(STEPS, -1, -1)


def _train(module: torch.nn.Module, xs: torch.Tensor, ts: torch.Tensor) -> tuple[list[float], list]:
    """SGD steps; returns the losses and the parameter gradients of the first step."""
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    losses, first = [], []
    for x, t in zip(xs, ts):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), t)
        loss.backward()
        if not first:
            first = [p.grad.clone() for p in module.parameters()]
        opt.step()
        losses.append(loss.item())
    return losses, first


def _worker(rank: int, out_dir: str) -> None:
    init = "file://" + os.path.join(out_dir, "rendezvous")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        out: dict[str, np.ndarray] = {}
        xs, ts = _data()
        shard = slice(rank * BATCH, (rank + 1) * BATCH)
        xs, ts = xs[:, shard], ts[:, shard]

        # collectives in forward and in backward, trained under DDP
        torch.manual_seed(0)
        eager = TensorParallel()
        model = onnxgrad.export(
            copy.deepcopy(eager), (xs[0],), input_names=["x"], dynamic_axes={"x": {0: "batch"}}
        )
        layer = OnnxModule(model)
        losses, grads = _train(torch.nn.parallel.DistributedDataParallel(layer), xs, ts)
        want_losses, want_grads = _train(torch.nn.parallel.DistributedDataParallel(eager), xs, ts)
        out["losses"], out["want_losses"] = np.array(losses), np.array(want_losses)
        trained = {layer.onnx_names[t]: (p, g) for (t, p), g in zip(layer.named_parameters(), grads)}
        for (name, p), want_grad in zip(eager.named_parameters(), want_grads):
            out[f"param.{name}"], out[f"want_param.{name}"] = (
                trained[name][0].detach().numpy(),
                p.detach().numpy(),
            )
            out[f"grad0.{name}"], out[f"want_grad0.{name}"] = trained[name][1].numpy(), want_grad.numpy()

        # an in-place all-reduce with mark_dirty: the reduced input read again
        reduce_model = ReduceModel(ReduceMarkDirty.apply)
        x = xs[0, :, :5] * (rank + 1)
        fb = onnxgrad.ForwardBackward(onnxgrad.export(copy.deepcopy(reduce_model), (x.clone(),)))
        res = fb.forward({fb.graphs.forward.graph.input[0].name: x.numpy().copy()})
        grads_dirty = res.backward()
        leaf = x.clone()
        y = reduce_model(leaf)
        y.sum().backward()
        out["dirty_out"], out["want_dirty_out"] = res.outputs[0], y.detach().numpy()
        out["dirty_grad"], out["want_dirty_grad"] = grads_dirty["bias"], reduce_model.bias.grad.numpy()

        # without mark_dirty: refused, naming the Function and the input
        try:
            onnxgrad.export(ReduceModel(ReduceNoMarkDirty.apply), (x.clone(),))
            out["refusal"] = np.array("exported")
        except PythonOpError as exc:
            out["refusal"] = np.array(str(exc))
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
    finally:
        dist.destroy_process_group()


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def test_collective_functions_under_ddp_match_eager(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(WORLD)]
    for rank, out in enumerate(ranks):
        _close(out["losses"], out["want_losses"], f"rank {rank} losses")
        assert out["losses"][-1] < out["losses"][0]
        for key in [k for k in out if k.startswith(("param.", "grad0."))]:
            _close(out[key], out[f"want_{key}"], f"rank {rank} {key}")
        _close(out["dirty_out"], out["want_dirty_out"], f"rank {rank} mark_dirty output")
        _close(out["dirty_grad"], out["want_dirty_grad"], f"rank {rank} mark_dirty bias gradient")
        assert str(out["refusal"]).startswith(
            "tests.pythonop.functions.ReduceNoMarkDirty.forward writes into argument 0 of apply() in "
            "place without ctx.mark_dirty, and the module reads that tensor again after the call"
        ), str(out["refusal"])
    for key in [k for k in ranks[0] if k.startswith("param.")]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])  # DDP kept the ranks in step
    # the ranks' losses differ (their shards do): the all-reduce did not make them one
    assert not np.allclose(ranks[0]["losses"], ranks[1]["losses"])
