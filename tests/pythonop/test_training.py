"""End to end: a torch model with a custom Function, exported with onnxgrad.export, trains on
onnxruntime to the same weights as in torch; and nothing leaks over many steps."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import onnxgrad
from onnxgrad.pythonop import contexts
from onnxgrad.torch import OnnxModule
from tests.pythonop import functions as F

STEPS, LR = 15, 0.05


def _batches(n=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(16, 4, generator=g, dtype=torch.float64),
            torch.randn(16, 1, generator=g, dtype=torch.float64),
        )
        for _ in range(n)
    ]


def _torch_training(net, batches):
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for x, t in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), t).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in net.state_dict().items()}


def _net():
    torch.manual_seed(3)
    return F.Net().double()


def test_forward_backward_trains_to_the_same_weights_as_torch(no_leaks):
    batches = _batches()
    net = _net()
    fb = onnxgrad.ForwardBackward(onnxgrad.export(net, (batches[0][0],)))
    want = _torch_training(net, batches)
    for x, t in batches:
        res = fb.forward({"x": x.numpy()})
        dy = 2 * (res.outputs[0] - t.numpy()) / t.numel()  # d mse / d y
        for name, grad in res.backward([dy]).items():
            fb.parameters[name] -= LR * grad  # the live buffers: seen by the next forward
    for name, value in fb.parameters.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_onnx_module_trains_to_the_same_weights_as_torch(no_leaks):
    batches = _batches(seed=1)
    net = _net()
    module = OnnxModule(onnxgrad.export(net, (batches[0][0],)))
    want = _torch_training(net, batches)
    got = _torch_training(module, batches)
    for tname, oname in module.onnx_names.items():
        np.testing.assert_allclose(got[tname], want[oname], rtol=1e-10, atol=1e-12, err_msg=oname)
    with torch.no_grad():  # inference through the module keeps no ctx
        module(batches[0][0])
    assert len(contexts) == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_ten_thousand_steps_leave_no_ctx_and_no_memory_growth():
    model = onnxgrad.export(
        F.Apply(F.Cube.apply, n=2, out=2).double(), (torch.randn(1, 2, dtype=torch.float64),)
    )
    fb = onnxgrad.ForwardBackward(model)
    x = np.ones((1, 2))

    def steps(n):
        for _ in range(n):
            fb.forward({"x": x}).backward()
            fb.forward({"x": x}, training=False)

    steps(500)  # warm up allocators and caches
    gc.collect()
    before = _rss()
    steps(10_000)
    gc.collect()
    assert len(contexts) == 0
    growth = _rss() - before
    assert growth < 5 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MB"


def test_onnx_module_output_dropped_without_backward_releases_the_ctx():
    x = torch.randn(4, 4, dtype=torch.float64)
    module = OnnxModule(onnxgrad.export(_net(), (x,)))
    gc.collect()
    before = len(contexts)
    out = module(x)  # a training forward: the ctx waits for a backward
    assert len(contexts) == before + 1
    del out
    gc.collect()
    assert len(contexts) == before


def test_trainer_falls_back_to_two_sessions_on_python_ops(no_leaks, caplog):
    """Stock onnxruntime cannot run PythonOp in one step graph: Trainer says so in a debug log and
    trains with forward + backward + the numpy optimizer, to torch's weights."""
    import logging

    from onnxgrad.train import Trainer

    caplog.set_level(logging.DEBUG, logger="onnxgrad.train.onegraph")
    batches = _batches()
    net = _net()
    model = onnxgrad.export(net, (batches[0][0],))
    want = _torch_training(net, batches)
    trainer = Trainer(model, loss="mse", optimizer="sgd", lr=LR, batch_size=16, shuffle=False, progress=False)
    assert trainer.step_path == "two sessions"
    assert "PythonOp" in caplog.text
    x = np.concatenate([b[0].numpy() for b in batches])
    t = np.concatenate([b[1].numpy() for b in batches])
    trainer.fit({"x": x, "target": t}, epochs=1)
    for name, value in trainer.parameters.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-10, atol=1e-12, err_msg=name)
