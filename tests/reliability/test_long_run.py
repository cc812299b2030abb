"""10,000 training steps: resident memory stays flat and nothing accumulates.

After a warm-up (allocator pools, lazily built sessions), the rest of the run may grow resident
memory by less than 5 MB and the number of live Python objects by less than a few hundred, and no
internal registry (graph variants, PythonOp contexts) may grow at all. The loop
also drops training forwards without their backward and runs inference forwards, the two ways a
forward's saved values could be left behind.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import onnxgrad
from onnxgrad.pythonop import contexts
from tests.models import mlp
from tests.reliability._util import REPO, rss_bytes

STEPS = 10_000
WARMUP = 1_000
MAX_RSS_GROWTH = 5 << 20
MAX_OBJECT_GROWTH = 300
RNG = np.random.default_rng(3)
X = RNG.standard_normal((8, 4)).astype(np.float32)
TARGET = RNG.random((8, 3)).astype(np.float32)


def _measure(step: Callable[[int], float], registry: Callable[[], int] = lambda: 0) -> dict[str, Any]:
    """Run ``step(i)`` STEPS times; what grew after the warm-up: resident memory, live Python
    objects, the size of an internal ``registry``; and the losses."""
    losses = [step(i) for i in range(WARMUP)]
    gc.collect()
    rss, objects, entries = rss_bytes(), len(gc.get_objects()), registry()
    losses += [step(i) for i in range(WARMUP, STEPS)]
    gc.collect()
    return {
        "rss": rss_bytes() - rss,
        "objects": len(gc.get_objects()) - objects,
        "registry": registry() - entries,
        "losses": losses,
    }


def _check(grown: dict[str, Any]) -> None:
    losses = grown["losses"]
    assert losses[-1] < 0.5 * losses[0], "the model did not train: the loop is not doing real steps"
    assert grown["rss"] < MAX_RSS_GROWTH, f"resident memory grew by {grown['rss'] / 2**20:.1f} MB"
    assert grown["objects"] < MAX_OBJECT_GROWTH, f"{grown['objects']} more live Python objects"
    assert grown["registry"] == 0, f"{grown['registry']} more entries in an internal registry"


def _isolated(fn: str) -> None:
    """Run ``fn`` of this module in a fresh interpreter: resident memory of a process that ran
    other tests before (an xdist worker) reflects their heap, not this loop."""
    code = f"from tests.reliability.test_long_run import {fn}; {fn}()"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_forward_backward_10k_steps_memory_flat():
    _isolated("forward_backward_run")


def test_onnx_module_10k_steps_memory_flat():
    pytest.importorskip("torch")
    _isolated("onnx_module_run")


def forward_backward_run() -> None:
    fb = onnxgrad.ForwardBackward(mlp(np.float32, n_in=4, hidden=8, n_out=3))
    params = fb.parameters  # live buffers: updated in place, as the optimizers do

    def step(i: int) -> float:
        res = fb.forward({"x": X})
        y = res.outputs[0]
        if i % 10 == 0:
            fb.forward({"x": X})  # a training forward whose backward never runs
            fb.forward({"x": X}, training=False)
        grads = res.backward({"y": 2 * (y - TARGET) / y.size})
        for name, g in grads.items():
            params[name] -= 0.5 * g
        return float(np.mean((y - TARGET) ** 2))

    _check(_measure(step, lambda: len(contexts)))  # PythonOp contexts: none may be left behind


def onnx_module_run() -> None:
    import torch

    from onnxgrad.torch import OnnxModule

    module = OnnxModule(mlp(np.float32, n_in=4, hidden=8, n_out=3))
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    x, target = torch.from_numpy(X), torch.from_numpy(TARGET)

    def step(i: int) -> float:
        if i % 10 == 0:
            module(x)  # an autograd graph dropped without a backward
            with torch.no_grad():
                module(x)
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(module(x), target)
        loss.backward()
        opt.step()
        return loss.item()

    # the graph variants (training, inference) are built during the warm-up, never again
    _check(_measure(step, lambda: len(module._variants) + len(contexts)))
