"""Learning-rate schedules equal torch.optim.lr_scheduler step by step, alone and driving optimizers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from onnxgrad.errors import InputError
from onnxgrad.train import (
    SGD,
    Adam,
    AdamW,
    Constant,
    Cosine,
    InverseScaling,
    LinearWarmup,
    StepDecay,
)

torch = pytest.importorskip("torch")  # the reference schedulers
L = torch.optim.lr_scheduler
STEPS = 30
BASE = 0.1

# (our schedule, torch scheduler factory over an optimizer whose lr is BASE)
SCHEDULES = {
    "constant": (Constant(BASE), lambda o: L.LambdaLR(o, lambda t: 1.0)),
    "step": (StepDecay(BASE, step_size=4, gamma=0.5), lambda o: L.StepLR(o, step_size=4, gamma=0.5)),
    # beyond total_steps torch's cosine goes back up: STEPS covers 2.5 half-periods
    "cosine": (
        Cosine(BASE, total_steps=12, min_lr=0.01),
        lambda o: L.CosineAnnealingLR(o, T_max=12, eta_min=0.01),
    ),
    "invscaling": (InverseScaling(BASE, power=0.25), lambda o: L.LambdaLR(o, lambda t: (t + 1) ** -0.25)),
    "warmup+cosine": (
        LinearWarmup(Cosine(BASE, total_steps=20), warmup_steps=5, start_factor=0.2),
        lambda o: L.SequentialLR(
            o, [L.LinearLR(o, 0.2, 1.0, total_iters=5), L.CosineAnnealingLR(o, T_max=20)], milestones=[5]
        ),
    ),
    "warmup+step": (
        LinearWarmup(StepDecay(BASE, 3, 0.5), warmup_steps=4),
        lambda o: L.SequentialLR(
            o, [L.LinearLR(o, 0.1, 1.0, total_iters=4), L.StepLR(o, 3, 0.5)], milestones=[4]
        ),
    ),
}


def torch_lrs(make_scheduler) -> list[float]:
    """The lr torch's optimizer uses at each of STEPS steps (scheduler stepped after each)."""
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([p], lr=BASE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR's deprecation chatter
        sched = make_scheduler(opt)
        lrs = []
        for _ in range(STEPS):
            lrs.append(opt.param_groups[0]["lr"])
            p.grad = torch.zeros_like(p)
            opt.step()
            sched.step()
    return lrs


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_values_match_torch(name):
    ours, make = SCHEDULES[name]
    np.testing.assert_allclose([ours(t) for t in range(STEPS)], torch_lrs(make), rtol=1e-13, atol=0)


@pytest.mark.parametrize(
    ("ours", "theirs", "schedule"),
    [
        (
            lambda p, lr: SGD(p, lr=lr, momentum=0.9, nesterov=True),
            lambda p: torch.optim.SGD(p, lr=BASE, momentum=0.9, nesterov=True),
            "warmup+cosine",
        ),
        (
            lambda p, lr: Adam(p, lr=lr, weight_decay=0.01),
            lambda p: torch.optim.Adam(p, lr=BASE, weight_decay=0.01),
            "step",
        ),
        (lambda p, lr: AdamW(p, lr=lr), lambda p: torch.optim.AdamW(p, lr=BASE), "cosine"),
        (
            lambda p, lr: SGD(p, lr=lr, momentum=0.5),
            lambda p: torch.optim.SGD(p, lr=BASE, momentum=0.5),
            "invscaling",
        ),
    ],
)
def test_scheduled_optimizers_match_torch(ours, theirs, schedule):
    """Same gradients, same schedule: the float64 parameters agree at every step."""
    sched, make_scheduler = SCHEDULES[schedule]
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((3, 2))
    mine = {"w": w0.copy()}
    opt = ours(mine, sched)
    tw = torch.tensor(w0, requires_grad=True)
    topt = theirs([tw])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tsched = make_scheduler(topt)
        for t in range(STEPS):
            g = rng.standard_normal((3, 2))
            opt.step({"w": g})
            assert opt.lr == pytest.approx(topt.param_groups[0]["lr"], rel=1e-13)
            tw.grad = torch.tensor(g)
            topt.step()
            tsched.step()
            np.testing.assert_allclose(
                mine["w"], tw.detach().numpy(), rtol=1e-12, atol=1e-14, err_msg=f"step {t}"
            )


def test_callable_lr_and_number():
    p = {"w": np.zeros(1)}
    opt = SGD(p, lr=lambda t: 10.0**-t)
    for _ in range(3):
        opt.step({"w": -np.ones(1)})
    np.testing.assert_allclose(p["w"], [1.11])
    assert opt.iterations == 3 and opt.lr == pytest.approx(0.01)
    bad = SGD({"w": np.zeros(1)}, lr=lambda t: 1.0 - t)
    bad.step({"w": np.ones(1)})
    bad.step({"w": np.ones(1)})
    with pytest.raises(InputError, match=r"lr must be >= 0, got -1\.0"):
        bad.step({"w": np.ones(1)})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StepDecay(0.1, step_size=0), "step_size must be an integer >= 1"),
        (lambda: Cosine(0.1, total_steps=0), "total_steps must be an integer >= 1"),
        (lambda: Constant(-1), "lr must be >= 0"),
        (lambda: LinearWarmup(0.1, warmup_steps=5, start_factor=2), "start_factor must be <= 1"),
        (lambda: LinearWarmup(0.1, warmup_steps=0), "warmup_steps must be an integer >= 1"),
        (lambda: SGD({"w": np.zeros(1)}, lr="fast"), "lr must be a number or a callable"),
    ],
)
def test_errors(make, message):
    with pytest.raises(InputError, match=message):
        make()
