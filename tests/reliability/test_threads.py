"""Four threads running forward and backward on one shared object give the serial run's results.

Each object is fresh, so the threads also race on what is built on first use (the backward session of
``ForwardBackward``, the graph variant of ``OnnxModule``). Every thread keeps several forwards alive
before running their backwards, in reverse order, and mixes in inference-only forwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import onnxgrad
from onnxgrad.compat import OrtGradientForwardBackward
from tests.models import mlp

THREADS = 4
STEPS = 12  # per thread
RNG = np.random.default_rng(7)
XS = [[RNG.standard_normal((3, 4)) for _ in range(STEPS)] for _ in range(THREADS)]
DYS = [[RNG.standard_normal((3, 3)) for _ in range(STEPS)] for _ in range(THREADS)]


def _concurrently(work: Callable[[int], list[Any]]) -> list[list[Any]]:
    """``work(thread_index)`` in THREADS threads released together; exceptions re-raised here."""
    barrier = threading.Barrier(THREADS)

    def run(t: int) -> list[Any]:
        barrier.wait()
        return work(t)

    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(run, t) for t in range(THREADS)]
        return [f.result(timeout=300) for f in futures]


def _assert_same(
    serial: list[list[dict[str, np.ndarray]]], threaded: list[list[dict[str, np.ndarray]]]
) -> None:
    for t, (want_steps, got_steps) in enumerate(zip(serial, threaded)):
        for step, (want, got) in enumerate(zip(want_steps, got_steps)):
            assert set(want) == set(got)
            for name in want:
                np.testing.assert_allclose(
                    got[name], want[name], rtol=1e-12, atol=0, err_msg=f"thread {t} step {step} {name}"
                )


# ---- ForwardBackward --------------------------------------------------------------------------------
def _fb_steps(fb: onnxgrad.ForwardBackward, t: int) -> list[dict[str, np.ndarray]]:
    """Forwards in pairs (two alive at once), backwards in reverse order, plus an inference."""
    out: list[dict[str, np.ndarray]] = []
    for step in range(0, STEPS, 2):
        first = fb.forward({"x": XS[t][step]})
        second = fb.forward({"x": XS[t][step + 1]})
        inference = fb.forward({"x": XS[t][step]}, training=False)
        g2 = second.backward({"y": DYS[t][step + 1]})
        g1 = first.backward({"y": DYS[t][step]})
        np.testing.assert_array_equal(inference.outputs[0], first.outputs[0])
        out.append({"y": first.outputs[0], **g1})
        out.append({"y": second.outputs[0], **g2})
    return out


def test_forward_backward_shared_by_four_threads():
    model = mlp()
    serial_fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["x"])
    serial = [_fb_steps(serial_fb, t) for t in range(THREADS)]
    shared = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["x"])
    _assert_same(serial, _concurrently(lambda t: _fb_steps(shared, t)))


# ---- OnnxModule ----------------------------------------------------------------------------------------
def _module_steps(module: Any, t: int) -> list[dict[str, np.ndarray]]:
    import torch

    params = dict(module.named_parameters())
    out = []
    for step in range(STEPS):
        x = torch.from_numpy(XS[t][step]).requires_grad_(step % 3 != 0)  # sometimes no input grad
        y = module(x)
        wrt = [x, *params.values()] if x.requires_grad else list(params.values())
        grads = torch.autograd.grad(y, wrt, torch.from_numpy(DYS[t][step]))
        names = ["x", *params] if x.requires_grad else list(params)
        out.append({"y": y.detach().numpy(), **{n: g.numpy() for n, g in zip(names, grads)}})
        with torch.no_grad():
            np.testing.assert_array_equal(module(x).numpy(), out[-1]["y"])
    return out


def test_onnx_module_shared_by_four_threads():
    pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    model = mlp()
    serial_module = OnnxModule(model)
    serial = [_module_steps(serial_module, t) for t in range(THREADS)]
    shared = OnnxModule(model)
    _assert_same(serial, _concurrently(lambda t: _module_steps(shared, t)))
    # each graph variant (input with / without a gradient, inference) built once, not once per thread
    assert len(shared._variants) == len(serial_module._variants)


# ---- the compat class: one instance per thread, graphs and sessions shared -------------------------------
def _compat_steps(factory: OrtGradientForwardBackward, weights: list[np.ndarray], t: int) -> list[dict]:
    fn = factory.new_instance()
    out = []
    for step in range(STEPS):
        (y,) = fn.forward([XS[t][step], *weights], training=True)
        grads = fn.backward([DYS[t][step]])
        names = ["x", *factory.weights_to_train]
        out.append({"y": y.numpy(), **{n: g.numpy() for n, g in zip(names, grads)}})
    return out


def test_compat_class_shared_by_four_threads():
    factory = OrtGradientForwardBackward(mlp())
    weights = [factory.get_initializer(n) for n in factory.weights_to_train]
    serial = [_compat_steps(factory, weights, t) for t in range(THREADS)]
    _assert_same(serial, _concurrently(lambda t: _compat_steps(factory, weights, t)))
