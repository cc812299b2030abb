"""One-graph training steps (onnxgrad.artifacts): the same numbers as the numpy trainer."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgrad.artifacts import Runner, generate, tensors
from onnxgrad.demo import build_mlp
from onnxgrad.errors import InputError
from onnxgrad.testing import assert_allclose_scaled
from onnxgrad.train import Callback, LinearWarmup, Trainer
from tests.models import make_model

STEPS, BATCH = 12, 16


def digits_like(n: int = STEPS * BATCH, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"pixels": rng.random((n, 8)).astype(np.float32), "target": rng.integers(0, 4, n)}


def small_mlp(seed: int = 0) -> onnx.ModelProto:
    return build_mlp((8, 16, 4), np.random.default_rng(seed))


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_batch_end(self, trainer, step, logs) -> None:
        self.losses.append(logs["loss"])


def train_both(model, data, *, loss="cross_entropy", optimizer="adamw", lr=1e-2, tmp_path, **options):
    """(trainer losses, trainer params, runner losses, runner) after the same STEPS batches."""
    record = Losses()
    trainer = Trainer(
        model, loss=loss, optimizer=optimizer, lr=lr, optimizer_options=options, batch_size=BATCH,
        shuffle=False, progress=False, callbacks=[record],
    )  # fmt: skip
    trainer.fit(data, epochs=1)
    generate(
        model,
        loss=loss,
        optimizer=optimizer,
        lr=lr if not callable(lr) else 0.0,
        out_dir=tmp_path,
        optimizer_options=options,
    )
    runner = Runner(tmp_path, lr=lr, threads=1)
    n = len(next(iter(data.values())))
    losses = [runner.step({k: v[i : i + BATCH] for k, v in data.items()}) for i in range(0, n, BATCH)]
    return record.losses, trainer.parameters, losses, runner


OPTIMIZERS = [
    ("adamw", {}),
    ("adamw", {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    ("adam", {}),
    ("adam", {"weight_decay": 0.05}),
    ("sgd", {}),
    ("sgd", {"momentum": 0.9, "weight_decay": 0.01}),
    ("sgd", {"momentum": 0.9, "nesterov": True}),
    ("sgd", {"momentum": 0.5, "dampening": 0.3}),
]


@pytest.mark.parametrize(
    ("optimizer", "options"), OPTIMIZERS, ids=[f"{o}-{i}" for i, (o, _) in enumerate(OPTIMIZERS)]
)
def test_step_matches_trainer(optimizer, options, tmp_path):
    ref_losses, ref_params, losses, runner = train_both(
        small_mlp(), digits_like(), optimizer=optimizer, tmp_path=tmp_path, **options
    )
    assert len(losses) == STEPS
    assert_allclose_scaled(losses, ref_losses, rtol=1e-5)
    params = runner.parameters
    assert params.keys() == ref_params.keys()
    for name in params:
        assert_allclose_scaled(params[name], ref_params[name], rtol=1e-5)


@pytest.mark.parametrize("loss", ["mse", "huber", "l1"])
def test_regression_losses_match(loss, tmp_path):
    rng = np.random.default_rng(3)
    data = {"pixels": rng.random((STEPS * BATCH, 8)).astype(np.float32)}
    data["target"] = rng.standard_normal((STEPS * BATCH, 4)).astype(np.float32)
    ref_losses, ref_params, losses, runner = train_both(small_mlp(), data, loss=loss, tmp_path=tmp_path)
    assert_allclose_scaled(losses, ref_losses, rtol=1e-5)
    for name, value in runner.parameters.items():
        assert_allclose_scaled(value, ref_params[name], rtol=1e-5)


def test_schedule_matches_trainer(tmp_path):
    schedule = LinearWarmup(0.05, warmup_steps=5)
    ref_losses, ref_params, losses, runner = train_both(
        small_mlp(), digits_like(), lr=schedule, tmp_path=tmp_path
    )
    assert_allclose_scaled(losses, ref_losses, rtol=1e-5)
    for name, value in runner.parameters.items():
        assert_allclose_scaled(value, ref_params[name], rtol=1e-5)


def test_adamw_matches_torch(tmp_path):
    torch = pytest.importorskip("torch")
    model = small_mlp(seed=2)
    data = digits_like(seed=5)
    generate(
        model,
        loss="cross_entropy",
        optimizer="adamw",
        lr=1e-2,
        optimizer_options={"weight_decay": 0.05},
        out_dir=tmp_path,
    )
    runner = Runner(tmp_path, threads=1)
    start = {k: torch.tensor(v) for k, v in runner.parameters.items()}
    params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.05)
    for i in range(0, STEPS * BATCH, BATCH):
        batch = {k: v[i : i + BATCH] for k, v in data.items()}
        x, t = torch.tensor(batch["pixels"]), torch.tensor(batch["target"])
        h = torch.relu(x @ params["fc1.weight"] + params["fc1.bias"])
        logits = h @ params["fc2.weight"] + params["fc2.bias"]
        ref = torch.nn.functional.cross_entropy(logits, t)
        opt.zero_grad()
        ref.backward()
        opt.step()
        loss = runner.step(batch)
        assert loss == pytest.approx(ref.item(), rel=1e-5)
    for name, value in runner.parameters.items():
        assert_allclose_scaled(value, params[name], rtol=1e-5)


def batchnorm_model() -> onnx.ModelProto:
    rng = np.random.default_rng(4)
    inits = {
        "W1": (rng.standard_normal((8, 6)) * 0.5).astype(np.float32),
        "b1": np.zeros(6, np.float32),
        "gamma": np.ones(6, np.float32),
        "beta": np.zeros(6, np.float32),
        "mean": np.zeros(6, np.float32),
        "var": np.ones(6, np.float32),
        "W2": (rng.standard_normal((6, 4)) * 0.5).astype(np.float32),
        "b2": np.zeros(4, np.float32),
    }
    from onnx import helper

    nodes = [
        helper.make_node("Gemm", ["pixels", "W1", "b1"], ["h"]),
        helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["n"]),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"]),
    ]
    return make_model(nodes, [("pixels", np.float32, ["N", 8])], [("logits", np.float32, ["N", 4])], inits)


def test_running_statistics_are_carried(tmp_path):
    model = batchnorm_model()
    data = digits_like()
    record = Losses()
    trainer = Trainer(model, loss="cross_entropy", optimizer="adamw", lr=1e-2, batch_size=BATCH,
                      shuffle=False, progress=False, callbacks=[record])  # fmt: skip
    trainer.fit(data, epochs=1)
    art = generate(model, loss="cross_entropy", optimizer="adamw", lr=1e-2, out_dir=tmp_path)
    assert [b["name"] for b in art.manifest["buffers"]] == ["mean", "var"]
    assert "mean" not in art.manifest["parameters"]
    runner = Runner(tmp_path, threads=1)
    losses = [
        runner.step({k: v[i : i + BATCH] for k, v in data.items()}) for i in range(0, STEPS * BATCH, BATCH)
    ]
    assert_allclose_scaled(losses, record.losses, rtol=1e-5)
    state = runner.state_dict()
    for name, value in trainer.fb.buffers.items():
        assert_allclose_scaled(state[name], value, rtol=1e-5)
    for name, value in trainer.parameters.items():
        assert_allclose_scaled(state[name], value, rtol=1e-5)
    # evaluation uses the running statistics, as the trainer's inference mode does
    batch = {k: v[:BATCH] for k, v in data.items()}
    assert runner.evaluate(batch)["loss"] == pytest.approx(trainer.evaluate(batch)["loss"], rel=1e-5)


def test_folder_is_self_describing(tmp_path):
    art = generate(
        small_mlp(),
        loss="cross_entropy",
        optimizer="sgd",
        optimizer_options={"momentum": 0.9},
        out_dir=tmp_path,
    )
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest == json.loads(json.dumps(art.manifest))
    train = onnx.load(tmp_path / "train_step.onnx")
    onnx.checker.check_model(train, full_check=True)
    opset = {o.domain or "ai.onnx": o.version for o in train.opset_import}
    assert opset == {"ai.onnx": 18} and train.ir_version <= 10
    assert all(n.domain in ("", "ai.onnx") for n in train.graph.node)
    inputs = [i.name for i in train.graph.input]
    outputs = [o.name for o in train.graph.output]
    assert manifest["train_step"]["inputs"] == [s for s in manifest["train_step"]["inputs"]]
    assert inputs[:4] == ["pixels", "target", "lr", "step"] and outputs[0] == "loss"
    feedback = manifest["train_step"]["feedback"]
    assert list(feedback) == outputs[1:]
    assert sorted(feedback.values()) == sorted(inputs[4:])
    values, meta = tensors.load(tmp_path / "state.safetensors")
    assert meta["step"] == "0" and sorted(values) == sorted(inputs[4:])
    assert manifest["optimizer"] == {"name": "sgd", "momentum": 0.9, "dampening": 0.0, "nesterov": False,
                                     "weight_decay": 0.0}  # fmt: skip
    # a plain session runs every file
    sess = ort.InferenceSession(str(tmp_path / "train_step.onnx"))
    feeds = {"pixels": np.zeros((2, 8), np.float32), "target": np.zeros(2, np.int64)}
    feeds |= {"lr": np.array(0.1), "step": np.array(0, np.int64), **values}
    loss, *rest = sess.run(None, feeds)
    assert loss.shape == () and len(rest) == len(feedback)
    inference = ort.InferenceSession(str(tmp_path / "inference.onnx"))
    assert [i.name for i in inference.get_inputs()] == [
        "pixels",
        *[p["name"] for p in manifest["parameters"]],
    ]


def test_save_writes_trained_inference_model(tmp_path):
    data = digits_like()
    _, _ref_params, _, runner = train_both(small_mlp(), data, tmp_path=tmp_path / "a")
    path = runner.save(tmp_path / "trained.onnx")
    model = onnx.load(path)
    assert [i.name for i in model.graph.input] == ["pixels"]
    logits = ort.InferenceSession(path).run(None, {"pixels": data["pixels"][:5]})[0]
    ev = runner.evaluate({k: v[:5] for k, v in data.items()})
    assert_allclose_scaled(logits, ev["logits"], rtol=1e-5)
    # the saved state resumes training where it stopped
    runner.save_state(tmp_path / "resume.safetensors")
    again = Runner(tmp_path / "a", state=tmp_path / "resume.safetensors", lr=1e-2, threads=1)
    batch = {k: v[:BATCH] for k, v in data.items()}
    assert again.iterations == STEPS
    assert again.step(batch) == pytest.approx(runner.step(batch), rel=1e-6)


def test_safetensors_round_trip(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array(3, np.int64),
              "c": np.linspace(0, 1, 5)}  # fmt: skip
    path = tensors.save(tmp_path / "t.safetensors", arrays, {"step": "4"})
    back, meta = tensors.load(path)
    assert meta == {"step": "4"}
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype


def test_errors(tmp_path):
    with pytest.raises(InputError, match="unknown optimizer"):
        generate(small_mlp(), loss="cross_entropy", optimizer="lion")
    with pytest.raises(InputError, match="frozen"):
        generate(small_mlp(), loss="cross_entropy", frozen=["nope"])
    with pytest.raises(InputError, match="betas"):
        generate(small_mlp(), loss="cross_entropy", optimizer_options={"betas": (1.5, 0.9)})
    art = generate(small_mlp(), loss="cross_entropy", frozen=["fc1.weight", "fc1.bias"], out_dir=tmp_path)
    assert [p["name"] for p in art.manifest["parameters"]] == ["fc2.weight", "fc2.bias"]
    runner = Runner(tmp_path)
    with pytest.raises(InputError, match="missing batch"):
        runner.step({"pixels": np.zeros((2, 8), np.float32)})


def test_cli_writes_the_folder(tmp_path, capsys):
    from onnxgrad.cli import main

    path = tmp_path / "mlp.onnx"
    onnx.save(small_mlp(), path)
    out = tmp_path / "art"
    argv = [str(path), "--loss", "cross_entropy", "--optimizer", "sgd", "--momentum", "0.9", "--nesterov"]
    assert main(["artifacts", *argv, "--lr", "0.05", "-o", str(out)]) == 0
    assert "parameters (4)" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["optimizer"]["nesterov"] is True and manifest["lr"]["default"] == 0.05
    ref_losses, _, _, _ = train_both(
        small_mlp(),
        digits_like(),
        optimizer="sgd",
        lr=0.05,
        momentum=0.9,
        nesterov=True,
        tmp_path=tmp_path / "b",
    )
    runner = Runner(out, threads=1)
    data = digits_like()
    losses = [
        runner.step({k: v[i : i + BATCH] for k, v in data.items()}) for i in range(0, STEPS * BATCH, BATCH)
    ]
    assert_allclose_scaled(losses, ref_losses, rtol=1e-5)
    assert (
        main(
            [
                "artifacts",
                str(path),
                "--loss",
                "mse",
                "--optimizer",
                "adam",
                "--betas",
                "2",
                "0.9",
                "-o",
                str(out),
            ]
        )
        == 2
    )


@pytest.mark.parametrize(("opset", "step_opset", "ir"), [(13, 18, 8), (18, 18, 8), (21, 21, 10)])
def test_opset_and_ir_version(opset, step_opset, ir, tmp_path):
    model = small_mlp()
    model.opset_import[0].version = opset  # Gemm and Relu are the same from opset 13 to 21
    art = generate(model, loss="cross_entropy", optimizer="adam", out_dir=tmp_path)
    for proto in (art.train_step, art.eval_step, art.inference):
        assert {o.domain or "ai.onnx": o.version for o in proto.opset_import}["ai.onnx"] <= max(opset, 18)
        assert proto.ir_version <= 10
    assert art.manifest["opset"] == step_opset and art.train_step.ir_version == ir
    runner = Runner(tmp_path, threads=1)
    data = digits_like()
    first = runner.step({k: v[:BATCH] for k, v in data.items()})
    assert np.isfinite(first)


# ---- the batch is checked, the runner describes itself ------------------------------------------
@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            {"pixels": np.zeros((4, 7), np.float32), "target": np.zeros(4, np.int64)},
            r"input 'pixels' has shape \(4, 7\), the model expects \(N, 8\) \(dimension 1 must be 8\)",
        ),
        (
            {"pixels": np.zeros((4, 8, 1), np.float32), "target": np.zeros(4, np.int64)},
            r"input 'pixels' has rank 3 \(shape \(4, 8, 1\)\), the model expects rank 2",
        ),
        (
            {"pixels": np.zeros((4, 8), np.float32), "target": np.zeros(3, np.int64)},
            r"inputs 'pixels' and 'target' disagree on dimension 'N': 'pixels' has 4 \(shape \(4, 8\)\), "
            r"'target' has 3 \(shape \(3,\)\)",
        ),
        (
            {"pixels": np.zeros((4, 8), np.float32), "target": np.full(4, 0.5)},
            r"batch input 'target' expects integers \(int64\), the data has non-integers such as 0.5",
        ),
    ],
)
def test_a_wrong_batch_is_an_input_error_naming_the_input(tmp_path, batch, message):
    """Before: onnxruntime's raw 'Got invalid dimensions' / broadcast failure in the loss."""
    generate(small_mlp(), loss="cross_entropy", out_dir=tmp_path)
    runner = Runner(tmp_path)
    with pytest.raises(InputError, match=message):
        runner.step(batch)
    with pytest.raises(InputError, match=message):
        runner.evaluate(batch)
    assert runner.iterations == 0
    # a safe cast is still taken: float64 pixels, int32 targets
    loss = runner.step({"pixels": np.zeros((4, 8)), "target": np.zeros(4, np.int32)})
    assert loss == pytest.approx(np.log(4), rel=1e-3)  # zero pixels: the logits are the bias, near 0


def test_reprs_say_what_the_object_holds(tmp_path):
    from onnxgrad import ForwardBackward, build_gradient

    model = small_mlp()
    generate(model, loss="cross_entropy", optimizer="sgd", lr=0.1, out_dir=tmp_path)
    assert repr(Runner(tmp_path)) == (
        f"Runner({str(tmp_path)!r}, batch=(pixels: (N, 8), target: (N,)), parameters=4 tensors "
        "(212 values), optimizer=sgd, lr=0.1, step=0, outputs=['loss', 'logits'])"
    )
    assert repr(ForwardBackward(model)) == (
        "ForwardBackward(inputs=(pixels: (N, 8)), outputs=['logits'], parameters=4 tensors (212 values), "
        "inputs_requiring_grad=[])"
    )
    assert repr(build_gradient(model, inputs_requiring_grad=["pixels"])) == (
        "GradientGraphs(inputs=['pixels'], outputs=['logits'], trainable=4 tensors, "
        "inputs_requiring_grad=['pixels'], saved=4 values, forward=3 nodes, backward=11 nodes)"
    )


def test_forward_backward_checks_that_the_batch_dimensions_agree():
    from onnxgrad import ForwardBackward
    from onnxgrad.train import add_loss

    fb = ForwardBackward(add_loss(small_mlp(), "cross_entropy"), outputs=["loss"])
    with pytest.raises(InputError, match=r"inputs 'pixels' and 'target' disagree on dimension 'N'"):
        fb.forward({"pixels": np.zeros((4, 8), np.float32), "target": np.zeros(3, np.int64)})
