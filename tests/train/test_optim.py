"""The numpy optimizers follow torch.optim step by step, updating arrays in place."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.errors import InputError
from onnxgrad.train import SGD, Adam, AdamW, Cosine

torch = pytest.importorskip("torch")  # an optional dependency: the reference optimizers

STEPS = 5
SHAPES = {"w": (3, 4), "b": (4,)}


def run_both(make_ours, make_torch):
    """Apply the same gradients for STEPS steps to numpy and torch copies of the same parameters."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    buffers = {k: v.copy() for k, v in params.items()}
    ours = make_ours(buffers)
    tparams = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    theirs = make_torch(list(tparams.values()))
    for _ in range(STEPS):
        grads = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
        ours.step(grads)
        for k, p in tparams.items():
            p.grad = torch.tensor(grads[k])
        theirs.step()
        for k, p in tparams.items():
            np.testing.assert_allclose(buffers[k], p.detach().numpy(), rtol=1e-6, atol=1e-12)
    # the caller's arrays are the ones updated
    assert all(ours.params[k] is buffers[k] for k in buffers)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.9, "weight_decay": 0.01},
        {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05},
        {"momentum": 0.9, "dampening": 0.3},
        {"weight_decay": 0.1},
    ],
)
def test_sgd_matches_torch(kwargs):
    run_both(lambda p: SGD(p, lr=0.1, **kwargs), lambda p: torch.optim.SGD(p, lr=0.1, **kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"lr": 0.01, "betas": (0.8, 0.99)},
        {"lr": 0.05, "weight_decay": 0.1},
        {"lr": 0.02, "eps": 1e-3},
    ],
)
def test_adam_matches_torch(kwargs):
    run_both(lambda p: Adam(p, **kwargs), lambda p: torch.optim.Adam(p, **kwargs))


def test_float32_parameters_stay_float32():
    p = {"w": np.ones(3, dtype=np.float32)}
    opt = Adam(p, lr=0.1, weight_decay=0.01)
    opt.step({"w": np.full(3, 0.5, dtype=np.float32)})
    assert p["w"].dtype == np.float32
    assert all(s.dtype == np.float32 for s in opt.state["w"].values() if isinstance(s, np.ndarray))


def test_missing_gradients_are_skipped():
    p = {"a": np.ones(2), "b": np.ones(2)}
    SGD(p, lr=1.0).step({"a": np.ones(2)})
    np.testing.assert_array_equal(p["a"], 0)
    np.testing.assert_array_equal(p["b"], 1)


def test_errors():
    with pytest.raises(InputError, match="floating-point"):
        SGD({"i": np.ones(2, dtype=np.int64)}, lr=0.1)
    ro = np.ones(2)
    ro.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        Adam({"r": ro})
    with pytest.raises(InputError, match="Nesterov"):
        SGD({"a": np.ones(2)}, lr=0.1, nesterov=True)
    with pytest.raises(InputError, match="lr must be >= 0"):
        SGD({"a": np.ones(2)}, lr=-1)
    opt = SGD({"a": np.ones(2)}, lr=0.1)
    with pytest.raises(InputError, match="not optimizer parameters"):
        opt.step({"z": np.ones(2)})
    with pytest.raises(InputError, match="shape"):
        opt.step({"a": np.ones(3)})


@pytest.mark.parametrize(
    "make",
    [
        lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda p: SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
        lambda p: Adam(p, lr=0.1, weight_decay=0.01),
        lambda p: AdamW(p, lr=Cosine(0.1, 10), weight_decay=0.01),
    ],
)
def test_steps_allocate_nothing_after_the_first(make):
    import tracemalloc

    p = {"w": np.ones(1 << 18)}  # 2 MiB
    g = {"w": np.full(1 << 18, 0.5)}
    opt = make(p)
    opt.step(g)  # state and scratch buffers are allocated here
    tracemalloc.start()
    try:
        for _ in range(3):
            opt.step(g)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.0}],
)
def test_adamw_matches_torch(kwargs):
    run_both(lambda p: AdamW(p, **kwargs), lambda p: torch.optim.AdamW(p, **kwargs))


def test_adamw_decay_is_decoupled():
    """With a zero gradient Adam's update is zero: only the decay p *= 1 - lr wd remains."""
    p = {"w": np.full(3, 2.0)}
    AdamW(p, lr=0.1, weight_decay=0.5).step({"w": np.zeros(3)})
    np.testing.assert_allclose(p["w"], 2.0 * (1 - 0.1 * 0.5))
    q = {"w": np.full(3, 2.0)}
    Adam(q, lr=0.1, weight_decay=0.5).step({"w": np.zeros(3)})  # L2: the decay goes through Adam
    np.testing.assert_allclose(q["w"], 2.0 - 0.1, rtol=1e-6)


def test_state_dict_resumes_exactly():
    """An optimizer restored from state_dict() continues with the very same updates."""
    rng = np.random.default_rng(1)
    grads = [{"w": rng.standard_normal(4)} for _ in range(6)]
    for make in (
        lambda p: Adam(p, lr=0.1),
        lambda p: SGD(p, lr=lambda t: 0.1 / (t + 1), momentum=0.9, nesterov=True),
    ):
        p_full = {"w": np.ones(4)}
        full = make(p_full)
        for g in grads:
            full.step(g)
        p_part = {"w": np.ones(4)}
        part = make(p_part)
        for g in grads[:3]:
            part.step(g)
        saved, saved_w = part.state_dict(), p_part["w"].copy()
        part.step(grads[3])  # diverge, then restore
        p_new = {"w": saved_w}
        resumed = make(p_new)
        resumed.load_state_dict(saved)
        assert resumed.iterations == 3
        for g in grads[3:]:
            resumed.step(g)
        np.testing.assert_array_equal(p_new["w"], p_full["w"])
    with pytest.raises(InputError, match="optimizer state is for parameters"):
        SGD({"v": np.ones(4)}, lr=0.1).load_state_dict(saved)
