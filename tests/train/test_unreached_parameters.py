"""Parameters the loss never reaches are not trained (issue 38 §4): with the loss on ``y2`` of a
two-head model, torch gives ``h1``'s weights no gradient (``grad is None``) and its optimizers leave
them untouched, weight decay and momentum included. The one parameter choice below every door drops
them, with a warning naming them: ``Trainer`` (and so the CLI), ``artifacts.generate`` + ``Runner``
(and so Node and the browser)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from onnxgrad.artifacts import Runner, generate
from onnxgrad.autodiff.params import select_parameters
from onnxgrad.errors import InputError
from onnxgrad.train import Trainer, add_loss
from tests.models import make_model

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(3)
F32 = np.float32
N, STEPS, LR = 8, 5, 0.05
OPTIMIZERS = {
    "adam_wd": ("adam", {"weight_decay": 0.1}),
    "adamw": ("adamw", {}),
    "sgd_momentum": ("sgd", {"momentum": 0.9}),
}


def two_heads():
    """x -> Linear(4, 6) -> Relu -> t; y1 = Linear(6, 3)(t), y2 = Linear(6, 2)(t); weights as torch's."""
    shapes = {"trunk.weight": (6, 4), "trunk.bias": (6,), "h1.weight": (3, 6), "h1.bias": (3,),
              "h2.weight": (2, 6), "h2.bias": (2,)}  # fmt: skip
    inits = {k: (0.5 * RNG.standard_normal(s)).astype(F32) for k, s in shapes.items()}
    nodes = [
        helper.make_node("Gemm", ["x", "trunk.weight", "trunk.bias"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["t"]),
        helper.make_node("Gemm", ["t", "h1.weight", "h1.bias"], ["y1"], transB=1),
        helper.make_node("Gemm", ["t", "h2.weight", "h2.bias"], ["y2"], transB=1),
    ]
    model = make_model(nodes, [("x", F32, ["N", 4])], [("y1", F32, ["N", 3]), ("y2", F32, ["N", 2])], inits)
    return model, inits


def torch_trained(inits, x, target, optimizer, options):
    p = {k: torch.tensor(v, requires_grad=True) for k, v in inits.items()}
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    opt = cls(list(p.values()), lr=LR, **options)
    xt, tt = torch.tensor(x), torch.tensor(target)
    for _ in range(STEPS):
        opt.zero_grad()
        t = torch.relu(xt @ p["trunk.weight"].T + p["trunk.bias"])
        y1 = t @ p["h1.weight"].T + p["h1.bias"]  # computed, as the model computes it: no loss on it
        y2 = t @ p["h2.weight"].T + p["h2.bias"]
        torch.nn.functional.mse_loss(y2, tt).backward()
        assert p["h1.weight"].grad is None and y1 is not None
        opt.step()
    return {k: v.detach().numpy() for k, v in p.items()}


def check(got: dict[str, np.ndarray], want: dict[str, np.ndarray], inits: dict[str, np.ndarray]) -> None:
    for k in ("h1.weight", "h1.bias"):
        np.testing.assert_array_equal(got[k], inits[k])  # untouched, as torch leaves them
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def data():
    return RNG.standard_normal((N, 4)).astype(F32), RNG.standard_normal((N, 2)).astype(F32)


def test_selection_names_what_the_outputs_do_not_reach():
    model, _ = two_heads()
    with pytest.warns(UserWarning, match=r"\['h1.weight', 'h1.bias'\] reach none of the outputs \['y2'\]"):
        selection = select_parameters(model, outputs=["y2"])
    assert selection.trainable == ["trunk.weight", "trunk.bias", "h2.weight", "h2.bias"]
    assert selection.unreached == ["h1.weight", "h1.bias"]
    assert selection.reasons["h1.weight"] == "reaches none of the outputs ['y2']"
    # every output, or none named: everything trains, as before
    assert len(select_parameters(model, outputs=["y1", "y2"]).trainable) == 6
    assert len(select_parameters(model).trainable) == 6
    with pytest.raises(InputError, match=r"nothing to train: no parameter reaches the outputs \['y2'\]"):
        select_parameters(
            model, outputs=["y2"], frozen=["trunk.weight", "trunk.bias", "h2.weight", "h2.bias"]
        )
    # named in trainable=: the caller's choice, kept, with a warning saying what moves them
    with pytest.warns(
        UserWarning, match=r"\['h1.weight'\] \(named in trainable=\) reach none of the outputs"
    ):
        assert select_parameters(model, ["h1.weight", "h2.bias"], outputs=["y2"]).trainable == [
            "h1.weight",
            "h2.bias",
        ]


@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_trainer_leaves_unreached_parameters_as_torch(case):
    optimizer, options = OPTIMIZERS[case]
    model, inits = two_heads()
    x, target = data()
    with pytest.warns(UserWarning, match=r"\['h1.weight', 'h1.bias'\] reach none of the outputs \['loss'\]"):
        trainer = Trainer(
            model, loss="mse", loss_options={"output": "y2"}, optimizer=optimizer, lr=LR,
            optimizer_options=options, batch_size=N, shuffle=False, progress=False,
        )  # fmt: skip
    assert sorted(trainer.parameters) == ["h2.bias", "h2.weight", "trunk.bias", "trunk.weight"]
    trainer.fit({"x": x, "target": target}, epochs=STEPS)
    got = {i.name: numpy_helper.to_array(i) for i in trainer.to_onnx().graph.initializer}
    check(got, torch_trained(inits, x, target, optimizer, options), inits)


@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_artifacts_leave_unreached_parameters_as_torch(case, tmp_path):
    optimizer, options = OPTIMIZERS[case]
    model, inits = two_heads()
    x, target = data()
    with pytest.warns(UserWarning, match=r"\['h1.weight', 'h1.bias'\] reach none of the outputs \['loss'\]"):
        art = generate(
            model, loss="mse", loss_options={"output": "y2"}, optimizer=optimizer, lr=LR,
            optimizer_options=options, out_dir=tmp_path, targets=("onnxruntime",),
        )  # fmt: skip
    names = [p["name"] for p in art.manifest["parameters"]]
    assert names == ["trunk.weight", "trunk.bias", "h2.weight", "h2.bias"]
    runner = Runner(tmp_path)
    for _ in range(STEPS):
        runner.step({"x": x, "target": target})
    got = {i.name: numpy_helper.to_array(i) for i in runner.to_onnx().graph.initializer}
    check(got, torch_trained(inits, x, target, optimizer, options), inits)


def test_a_penalty_on_an_unreached_head_reaches_it():
    # an L2 penalty in the loss reads h1.weight: then it trains (torch: a penalty term in the loss)
    model, _ = two_heads()
    with_loss = add_loss(model, "mse", output="y2", l2={"h1.weight": 0.1})
    with pytest.warns(UserWarning, match=r"\['h1.bias'\] reach none"):
        selection = select_parameters(with_loss, outputs=["loss"])
    assert "h1.weight" in selection.trainable
