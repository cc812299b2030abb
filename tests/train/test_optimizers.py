"""The optimizer registry: one definition per optimizer, and every backend made from it agrees.

* torch family: the numpy update (:mod:`onnxgrad.train.optim`), the ONNX update graph
  (:func:`onnxgrad.artifacts.optim.emit_updates`, run by onnxruntime) and ``torch.optim`` over
  several steps in float64;
* onnxruntime-training family: the 1.19.2-layout optimizer model written by
  ``onnxblock.optim.AdamW()`` / ``SGD()`` under ``empty_base()`` (run by onnxruntime) against the
  kernel's formulas written out in float64 here, with and without ``ClipGradNorm``;
* one default optimizer and one way to pass options across front ends.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.artifacts import generate
from onnxgrad.artifacts.optim import STATE_KEYS, Param, emit_updates, hyperparameters
from onnxgrad.compat.training import graphs as compat_graphs
from onnxgrad.compat.training import onnxblock as ob
from onnxgrad.errors import InputError
from onnxgrad.train import Trainer
from onnxgrad.train.losses import _Emitter
from onnxgrad.train.optim import OPTIMIZERS, optimizer_class
from onnxgrad.train.optimizers import DEFAULT_OPTIMIZER, DEFINITIONS, definition
from tests.models import mlp

SHAPES = {"w": (3, 4), "b": (4,)}
STEPS = 5
F64_EPS = np.finfo(np.float64).eps
F32_EPS = np.finfo(np.float32).eps

TORCH_CASES = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9, "weight_decay": 0.1}),
    ("sgd", {"momentum": 0.9, "nesterov": True}),
    ("sgd", {"momentum": 0.8, "dampening": 0.3}),
    ("adam", {}),
    ("adam", {"weight_decay": 0.1, "betas": (0.8, 0.99)}),
    ("adamw", {}),
    ("adamw", {"weight_decay": 0.3, "eps": 1e-6}),
]
TORCH_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _update_model(name: str, hyper: dict, dtype: int) -> tuple[onnx.ModelProto, list[str]]:
    """A model running one update of the parameters of SHAPES: inputs lr (double), step (int64),
    each parameter, its gradient and its state; outputs the new parameters and state."""
    graph = helper.make_graph([], "update", [], [])
    e = _Emitter(graph, 17, dtype, "t")
    graph.input.extend(
        [
            helper.make_tensor_value_info("lr", TensorProto.DOUBLE, []),
            helper.make_tensor_value_info("step", TensorProto.INT64, []),
        ]
    )
    keys = STATE_KEYS(name, hyper)
    state = {}
    for p, shape in SHAPES.items():
        names = [p, f"{p}.grad", *(f"{p}.{k}" for k in keys)]
        graph.input.extend(helper.make_tensor_value_info(n, dtype, list(shape)) for n in names)
        state.update({(p, k): f"{p}.{k}" for k in keys})
    e.taken |= {i.name for i in graph.input}
    params = [Param(p, f"{p}.grad", dtype) for p in SHAPES]
    new_params, new_state = emit_updates(e, name, hyper, params, state, "lr", "step")
    news = {f"new.{p}": (p, new_params[p]) for p in SHAPES}
    news.update({f"new.{p}.{k}": (p, value) for (p, k), value in new_state.items()})
    for out, (p, value) in news.items():
        graph.node.append(helper.make_node("Identity", [value], [out]))
        graph.output.append(helper.make_tensor_value_info(out, dtype, list(SHAPES[p])))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model, keys


def _graph_step(session, model, keys, params, state, grads, lr, step):
    """One run of the ONNX update graph: (new parameters, new state)."""
    feeds = {"lr": np.array(lr), "step": np.array(step, np.int64)}
    for p in SHAPES:
        feeds[p], feeds[f"{p}.grad"] = params[p], grads[p]
        feeds.update({f"{p}.{k}": state[(p, k)] for k in keys})
    out = dict(zip([o.name for o in model.graph.output], session.run(None, feeds)))
    return {p: out[f"new.{p}"] for p in SHAPES}, {(p, k): out[f"new.{p}.{k}"] for p in SHAPES for k in keys}


@pytest.mark.parametrize(("name", "options"), TORCH_CASES)
def test_numpy_onnx_and_torch_updates_agree(name, options):
    """Five updates in float64 of the same parameters with the same gradients: the numpy optimizer
    and the ONNX update graph give the same bits (one program, same operations in the same order),
    and both follow torch.optim, which orders some operations differently, to float64 rounding:
    64 eps, one rounding for each of some ten operations per step over five steps, none of them
    amplified (the division by √v̂ + eps is well conditioned), relative to the operands: to the
    value, and to the largest parameter (of order 1) where a parameter passes near zero."""
    rng = np.random.default_rng(0)
    start = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    hyper = hyperparameters(name, options)
    model, keys = _update_model(name, hyper, TensorProto.DOUBLE)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = {k: v.copy() for k, v in start.items()}
    numpy_opt = OPTIMIZERS[name](ours, lr=0.05, **options)
    graph_params = {k: v.copy() for k, v in start.items()}
    graph_state = {(p, k): np.zeros(s) for p, s in SHAPES.items() for k in keys}
    tparams = {k: torch.tensor(v, requires_grad=True) for k, v in start.items()}
    torch_opt = TORCH_CLASSES[name](list(tparams.values()), lr=0.05, **options)
    for step in range(STEPS):
        grads = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
        numpy_opt.step(grads)
        graph_params, graph_state = _graph_step(
            session, model, keys, graph_params, graph_state, grads, 0.05, step
        )
        for p, t in tparams.items():
            t.grad = torch.tensor(grads[p])
        torch_opt.step()
        for p in SHAPES:
            np.testing.assert_array_equal(ours[p], graph_params[p])
            scale = max(float(np.abs(v).max()) for v in start.values())
            np.testing.assert_allclose(
                ours[p], tparams[p].detach().numpy(), rtol=64 * F64_EPS, atol=64 * F64_EPS * scale
            )
            for k in keys:
                np.testing.assert_array_equal(numpy_opt.state[p][k], graph_state[(p, k)])


@pytest.mark.parametrize(("name", "options"), [TORCH_CASES[1], TORCH_CASES[5], TORCH_CASES[7]])
def test_float32_numpy_and_onnx_updates_are_the_same_bits(name, options):
    """In float32 too: the scalars are computed in double and cast once, as numpy rounds a Python
    float meeting a float32 array, so the one-graph step and the numpy step cannot drift apart."""
    rng = np.random.default_rng(1)
    hyper = hyperparameters(name, options)
    model, keys = _update_model(name, hyper, TensorProto.FLOAT)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    graph_params = {k: v.copy() for k, v in ours.items()}
    graph_state = {(p, k): np.zeros(s, np.float32) for p, s in SHAPES.items() for k in keys}
    numpy_opt = OPTIMIZERS[name](ours, lr=0.01, **options)
    for step in range(STEPS):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        numpy_opt.step(grads)
        graph_params, graph_state = _graph_step(
            session, model, keys, graph_params, graph_state, grads, 0.01, step
        )
        for p in SHAPES:
            np.testing.assert_array_equal(ours[p], graph_params[p])


def test_one_definition_per_optimizer():
    """Each name is defined once; the numpy classes, the step graph and the compat graph read it."""
    assert set(OPTIMIZERS) == {n for n, d in DEFINITIONS.items() if d.family == "torch"}
    for name, cls in OPTIMIZERS.items():
        assert cls.definition is DEFINITIONS[name]
    assert definition("AdamW").defaults == {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    assert definition("AdamWOptimizer", family="onnxruntime-training").family == "onnxruntime-training"
    with pytest.raises(
        InputError, match=r"unknown optimizer 'lamb'; expected one of \['sgd', 'adam', 'adamw'\]"
    ):
        definition("lamb")
    with pytest.raises(InputError, match=r"unknown option\(s\) \['momentum'\] of optimizer 'adamw'"):
        hyperparameters("adamw", {"momentum": 0.9})
    with pytest.raises(InputError, match="Nesterov momentum requires momentum > 0 and dampening = 0"):
        hyperparameters("sgd", {"nesterov": True})
    with pytest.raises(InputError, match=r"betas must be in \[0, 1\), got \(1.0, 0.9\)"):
        OPTIMIZERS["adam"]({"w": np.zeros(2)}, betas=(1.0, 0.9))


# ---- onnxruntime-training's family: the optimizer model written under empty_base() ----------------
def _params() -> tuple[list[onnx.TensorProto], dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    values = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return [numpy_helper.from_array(v, k) for k, v in values.items()], values


def _hf_adamw(p, g, m, v, lr, t, alpha, beta, eps, wd):
    """The AdamWOptimizer kernel with adam_mode=1 (Hugging Face), in float64."""
    m = alpha * m + (1 - alpha) * g
    v = beta * v + (1 - beta) * g * g
    lr_t = lr * np.sqrt(1 - beta**t) / (1 - alpha**t)
    p = p - lr_t * m / (np.sqrt(v) + eps)
    return p - lr * wd * p, m, v


def _clipped(grads: list[np.ndarray], max_norm: float | None) -> list[np.ndarray]:
    if max_norm is None:
        return grads
    tensors = [torch.tensor(g, dtype=torch.float64) for g in grads]
    params = [torch.zeros_like(t, requires_grad=True) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad.numpy() for p in params]


@pytest.mark.parametrize(
    "attrs",
    [
        {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-6, "weight_decay": 0.1, "correct_bias": 1, "adam_mode": 1},
        {
            "alpha": 0.9,
            "beta": 0.999,
            "epsilon": 1e-6,
            "weight_decay": 0.0,
            "correct_bias": 0,
            "adam_mode": 1,
        },
    ],
)
def test_compat_optimizer_model_and_numpy_run_the_same_definition(attrs):
    """onnxruntime-training's AdamW from the registry, on numpy (optimizer_class) and as the
    optimizer model api.Optimizer runs: three steps agree to float32 rounding of the per-step
    scalars (numpy's and onnxruntime's float32 pow may differ by an ulp: rtol 8 eps per step)."""
    spec = definition("AdamWOptimizer", family="onnxruntime-training")
    rng = np.random.default_rng(8)
    ours = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    graph_values = {k: v.copy() for k, v in ours.items()}
    moments = {(p, m): np.zeros(s, np.float32) for p, s in SHAPES.items() for m in ("momentum0", "momentum1")}
    numpy_opt = optimizer_class(spec)(ours, lr=0.01, **attrs)
    model = compat_graphs.optimizer_graph(
        "AdamWOptimizer", attrs, {k: (TensorProto.FLOAT, list(s)) for k, s in SHAPES.items()}
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for step in range(3):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        numpy_opt.step(grads)
        feeds = {"learning_rate": np.array(0.01, np.float32), "step": np.array(step, np.int64)}
        for p in SHAPES:
            feeds.update({p: graph_values[p], f"{p}/grad": grads[p]})
            feeds.update({f"{p}/{m}": moments[(p, m)] for m in ("momentum0", "momentum1")})
        out = dict(zip([o.name for o in model.graph.output], session.run(None, feeds)))
        for p in SHAPES:
            graph_values[p] = out[f"new/{p}"]
            for m in ("momentum0", "momentum1"):
                moments[(p, m)] = out[f"new/{p}/{m}"]
                np.testing.assert_array_equal(numpy_opt.state[p][m], moments[(p, m)])  # no scalar in them
            np.testing.assert_allclose(ours[p], graph_values[p], rtol=8 * (step + 1) * F32_EPS, atol=0)


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_adamw_block_writes_a_runnable_optimizer_model_into_the_base(max_norm):
    """AdamW() under empty_base() writes 1.19.2's optimizer model into accessor.model: its inputs,
    run on stock onnxruntime, update parameters and moments as the kernel's formula does (float32
    graph against float64 formula: rtol 1e2 float32 eps over three steps)."""
    protos, values = _params()
    clip = None if max_norm is None else ob.optim.ClipGradNorm(max_norm)
    block = ob.optim.AdamW(weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6, clip_grad=clip)
    with ob.empty_base() as accessor:
        flag = block((protos, []))
    model = accessor.model
    assert flag == "adamw.updated_flag"
    file_model = block.to_model_proto()  # the file's layout: one tensor per input
    assert [i.name for i in file_model.graph.input][:4] == ["learning_rate", "step", "w", "w/grad"]
    assert [i.name for i in model.graph.input] == [
        "learning_rate", "step", "params", "gradients", "first_order_moments", "second_order_moments",
    ]  # fmt: skip
    assert [o.name for o in model.graph.output] == [
        flag, "updated_params", "updated_first_order_moments", "updated_second_order_moments",
    ]  # fmt: skip
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    params = [values[k] for k in SHAPES]
    ms = [np.zeros_like(p) for p in params]
    vs = [np.zeros_like(p) for p in params]
    ref = [p.astype(np.float64) for p in params]
    ref_m = [np.zeros_like(r) for r in ref]
    ref_v = [np.zeros_like(r) for r in ref]
    for t in (1, 2, 3):
        grads = [3 * rng.standard_normal(p.shape).astype(np.float32) for p in params]
        flag_value, params, ms, vs = session.run(
            None,
            {
                "learning_rate": np.array([0.01], np.float32),
                "step": np.array([t], np.int64),
                "params": params,
                "gradients": grads,
                "first_order_moments": ms,
                "second_order_moments": vs,
            },
        )
        assert flag_value.tolist() == [1]
        clipped = _clipped([g.astype(np.float64) for g in grads], max_norm)
        for i, g in enumerate(clipped):
            ref[i], ref_m[i], ref_v[i] = _hf_adamw(
                ref[i], g, ref_m[i], ref_v[i], 0.01, t, 0.8, 0.99, 1e-6, 0.1
            )
        for got, want in zip([*params, *ms, *vs], [*ref, *ref_m, *ref_v]):
            np.testing.assert_allclose(got, want, rtol=1e2 * F32_EPS, atol=1e2 * F32_EPS * np.abs(want).max())


def test_sgd_block_with_clipping_scales_by_the_global_norm():
    """SGD(clip_grad=ClipGradNorm(c)): p - lr g min(1, c / (‖g‖ + 1e-6)), ‖g‖ over all gradients;
    without clipping the update is exactly p - lr g in float32 (1.19.2's SGDOptimizerV2)."""
    protos, values = _params()
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
    params = [values[k] for k in SHAPES]
    lr = np.array([0.1], np.float32)
    results = {}
    for max_norm in (None, 0.25):
        block = ob.optim.SGD(clip_grad=None if max_norm is None else ob.optim.ClipGradNorm(max_norm))
        with ob.empty_base() as accessor:
            assert block((protos, [])) == "sgd.updated_flag"
        model = accessor.model
        assert [i.name for i in model.graph.input] == ["learning_rate", "params", "gradients"]
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        _, results[max_norm] = session.run(None, {"learning_rate": lr, "params": params, "gradients": grads})
    for p, g, new in zip(params, grads, results[None]):
        np.testing.assert_array_equal(new, p - lr[0] * g)
    norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
    assert norm > 0.25  # the clipping acts
    for p, g, new in zip(params, _clipped([g.astype(np.float64) for g in grads], 0.25), results[0.25]):
        np.testing.assert_allclose(new, p - 0.1 * g, rtol=10 * F32_EPS, atol=10 * F32_EPS)


def test_clip_grad_norm_block_clips_a_gradient_sequence():
    """ClipGradNorm(c)("gradients") under a base, as 1.19.2's block: the sequence scaled as
    torch.nn.utils.clip_grad_norm_ scales it (float32 against float64: rtol 10 eps)."""
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
    with ob.empty_base() as accessor:
        accessor.model.graph.input.append(
            helper.make_tensor_sequence_value_info("gradients", TensorProto.FLOAT, None)
        )
        clipped = ob.optim.ClipGradNorm(0.5)("gradients")
        accessor.model.graph.output.append(
            helper.make_tensor_sequence_value_info(clipped, TensorProto.FLOAT, None)
        )
    session = ort.InferenceSession(accessor.model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"gradients": grads})
    want = _clipped([g.astype(np.float64) for g in grads], 0.5)
    assert np.sqrt(sum(np.sum(g**2) for g in want)) == pytest.approx(0.5, rel=1e-5)  # it clipped
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=10 * F32_EPS, atol=10 * F32_EPS)


@pytest.mark.parametrize("block", [ob.optim.AdamW(), ob.optim.SGD(clip_grad=ob.optim.ClipGradNorm(1.0))])
def test_optimizer_models_without_parameters_run(block):
    """Nothing to train (a frozen model): both layouts still load and run, returning the flag."""
    with ob.empty_base() as accessor:
        flag = block(([], []))
    adamw = isinstance(block, ob.optim.AdamW)
    scalars = {"learning_rate": np.array([0.1], np.float32), **({"step": np.array([1])} if adamw else {})}
    seqs = ["params", "gradients", *(["first_order_moments", "second_order_moments"] if adamw else [])]
    session = ort.InferenceSession(accessor.model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {**scalars}
    for name in seqs:  # an empty sequence cannot be fed from Python: one unused tensor each
        feeds[name] = [np.zeros(1, np.float32)]
    assert session.run([flag], feeds)[0].tolist() == [1]
    file_model = block.to_model_proto()
    session = ort.InferenceSession(file_model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"learning_rate": np.array(0.1, np.float32), "step": np.array(0)}
    assert [o.name for o in file_model.graph.output] == [flag]
    assert session.run(None, feeds)[0].tolist() == [1]


def test_clip_grad_arguments_are_checked():
    with pytest.raises(InputError, match=r"ClipGradNorm\(max_norm\) takes a number > 0, got 0"):
        ob.optim.ClipGradNorm(0)
    with pytest.raises(
        InputError, match=r"AdamW\(clip_grad=...\) takes an onnxblock.optim.ClipGradNorm, got float"
    ):
        ob.optim.AdamW(clip_grad=1.0)
    with pytest.raises(InputError, match=r"betas must be in \[0, 1\)"):
        ob.optim.AdamW(betas=(0.9, 1.5))
    with pytest.raises(InputError, match="call them inside"):
        ob.optim.SGD()(([], []))


def test_api_optimizer_clips_as_the_file_says(tmp_path):
    """generate_artifacts with SGD(clip_grad=ClipGradNorm(c)): api.Optimizer.step applies
    p - lr g c / (‖g‖ + 1e-6); the gradient is read off an unclipped run from the same state (lr 1).
    Tolerance: the moves are differences of float32 parameters, exact to a few eps of max |p|."""
    from onnxgrad.compat import training as tr

    model = mlp(np.float32)
    x = np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32)
    y = np.random.default_rng(6).standard_normal((8, 3)).astype(np.float32)
    names = ["W1", "b1", "W2", "b2"]

    def moved(max_norm: float | None) -> tuple[dict[str, np.ndarray], float]:
        work = os.fspath(tmp_path / str(max_norm))
        clip = None if max_norm is None else ob.optim.ClipGradNorm(max_norm)
        tr.artifacts.generate_artifacts(
            model,
            requires_grad=names,
            loss=tr.artifacts.LossType.MSELoss,
            optimizer=ob.optim.SGD(clip_grad=clip),
            artifact_directory=work,
        )
        state = tr.api.CheckpointState.load_checkpoint(os.path.join(work, "checkpoint"))
        module = tr.api.Module(
            os.path.join(work, "training_model.onnx"), state, os.path.join(work, "eval_model.onnx")
        )
        opt = tr.api.Optimizer(os.path.join(work, "optimizer_model.onnx"), module)
        opt.set_learning_rate(1.0)
        before = {k: np.array(state.parameters[k].data) for k in names}
        module.train()
        module(x, y)
        opt.step()
        scale = max(float(np.abs(v).max()) for v in before.values())
        return {k: before[k].astype(np.float64) - np.array(state.parameters[k].data) for k in names}, scale

    grads, scale = moved(None)  # lr 1: the parameters moved by the gradient itself
    norm = np.sqrt(sum(float(np.sum(g**2)) for g in grads.values()))
    clipped, _ = moved(norm / 3)
    for k, g in grads.items():
        np.testing.assert_allclose(clipped[k], g / 3 * norm / (norm + 1e-6), rtol=0, atol=8 * F32_EPS * scale)
    assert any(float(np.abs(g).max()) > 100 * 8 * F32_EPS * scale for g in grads.values())  # not vacuous


# ---- one default, one way to pass options -----------------------------------------------------------
def test_every_front_end_defaults_to_the_registry_default():
    assert DEFAULT_OPTIMIZER == "adamw"
    trainer = Trainer(mlp(), loss="mse")
    assert type(trainer.optimizer) is OPTIMIZERS[DEFAULT_OPTIMIZER]
    art = generate(mlp(), loss="mse")
    assert art.manifest["optimizer"]["name"] == DEFAULT_OPTIMIZER


def test_every_front_end_defaults_to_the_registry_learning_rate(monkeypatch):
    """Each door's default learning rate is the registry's DEFAULT_LR object itself (``is``: a door
    writing its own ``1e-3`` holds an equal but distinct float, and would drift if the default moved)."""
    import inspect

    from onnxgrad import sklearn as og_sklearn
    from onnxgrad.cli import build_parser
    from onnxgrad.train import optim as optim_mod
    from onnxgrad.train import trainer as trainer_mod
    from onnxgrad.train.optimizers import DEFAULT_LR

    assert DEFAULT_LR == 1e-3  # torch.optim.Adam's and AdamW's
    doors = {
        "Adam": optim_mod.Adam.__init__,
        "AdamW": optim_mod.AdamW.__init__,
        "generate": generate,
        "OnnxRegressor": og_sklearn.OnnxRegressor,
        "OnnxClassifier": og_sklearn.OnnxClassifier,
    }
    for door, fn in doors.items():
        assert inspect.signature(fn).parameters["lr"].default is DEFAULT_LR, door
    parser = build_parser()
    train = parser.parse_args(["train", "m.onnx", "--data", "d.csv", "--target", "y"])
    artifacts = parser.parse_args(["artifacts", "m.onnx", "--loss", "mse"])
    assert train.lr is DEFAULT_LR and artifacts.lr is DEFAULT_LR
    # Trainer (make_optimizer) reads it when called: a moved default moves the trainer's
    monkeypatch.setattr(trainer_mod, "DEFAULT_LR", 0.25)
    params = {"w": np.zeros(3, np.float32)}
    assert trainer_mod.make_optimizer("adam", params).lr == 0.25
    assert trainer_mod.make_optimizer("adam", params, lr=0.5).lr == 0.5


def test_generate_options_come_in_optimizer_options_and_the_old_keywords_warn():
    new = generate(mlp(), loss="mse", optimizer="sgd", optimizer_options={"momentum": 0.9})
    with pytest.warns(
        DeprecationWarning, match=r"generate: passing optimizer options as keywords \(momentum\)"
    ):
        old = generate(mlp(), loss="mse", optimizer="sgd", momentum=0.9)
    assert new.manifest["optimizer"] == old.manifest["optimizer"]
    assert new.manifest["optimizer"]["momentum"] == 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(mlp(), loss="mse", optimizer_options={"weight_decay": 0.0})
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(InputError, match=r"\['momentum'\] given both as keywords and in optimizer_options"),
    ):
        generate(mlp(), loss="mse", optimizer="sgd", optimizer_options={"momentum": 0.9}, momentum=0.5)


# ---- many small parameters updated as one -----------------------------------------------------------
@pytest.mark.parametrize(("name", "options"), [TORCH_CASES[i] for i in (0, 2, 3, 5, 7)])
def test_small_parameters_updated_together_give_each_ones_own_update(name, options):
    """The numpy optimizers update small parameters of one type as one flat buffer. Against one
    optimizer per parameter (nothing to group), the same bits for every parameter and state
    tensor: float32 and float64 parameters (16 of each: enough to be grouped for every
    optimizer), one too large to join, a step where some parameters get no gradient, earlier
    states loaded from checkpoints, new values copied into the parameters, and one parameter
    array replaced."""
    rng = np.random.default_rng(9)
    start = {"big": rng.standard_normal((300, 100))}
    for i in range(16):
        shape = (i % 5 + 1,) if i % 2 else (2, i % 3 + 1)
        start[f"a{i}"] = rng.standard_normal(shape)
        start[f"e{i}"] = rng.standard_normal(shape).astype(np.float32)
    together = {k: v.copy() for k, v in start.items()}
    opt = OPTIMIZERS[name](together, lr=0.05, **options)
    alone = {k: v.copy() for k, v in start.items()}
    singles = {k: OPTIMIZERS[name]({k: alone[k]}, lr=0.05, **options) for k in alone}
    saved = {}
    for step in range(7):
        given = list(start) if step != 2 else ["a1", "a4", "e0", "big"]
        grads = {k: rng.standard_normal(start[k].shape).astype(start[k].dtype) for k in given}
        saved[step] = opt.state_dict()
        if step in (4, 6):  # the state before step 1, then before any step, loaded into both
            back = saved[1 if step == 4 else 0]
            opt.load_state_dict(back)
            for k, single in singles.items():
                single.load_state_dict({"iterations": back["iterations"], "state": {k: back["state"][k]}})
        if step == 3:  # new values copied into the live arrays, as Trainer.set_parameters does
            for k in start:
                together[k][...] = alone[k][...] = rng.standard_normal(start[k].shape)
        if step == 5:  # one array replaced in the optimizer's own mapping: it updates that one
            opt.params["a3"] = together["a3"] = together["a3"].copy()
            singles["a3"].params["a3"] = alone["a3"] = alone["a3"].copy()
        opt.step(grads)
        for k in given:
            singles[k].step({k: grads[k]})
        for k in start:
            np.testing.assert_array_equal(together[k], alone[k])
            assert set(opt.state[k]) == set(singles[k].state[k])
            for key, value in opt.state[k].items():
                np.testing.assert_array_equal(value, singles[k].state[k][key])
    assert len(opt._groups) == 2  # the a's, the e's: the grouped path ran


def test_parameters_sharing_memory_are_updated_one_after_the_other():
    """Two names for one array (or overlapping views) are not gathered together: each update
    applies in turn, as with one optimizer per name applied in order."""
    rng = np.random.default_rng(10)
    w = rng.standard_normal(8)
    params = {"w": w, "w_again": w, "head": w[:3], "other": rng.standard_normal(8)}
    expected = {k: v.copy() for k, v in params.items()}
    expected["w_again"] = expected["w"]
    expected["head"] = expected["w"][:3]
    grads = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    OPTIMIZERS["adamw"](params, lr=0.1).step(grads)
    for k in params:
        OPTIMIZERS["adamw"]({k: expected[k]}, lr=0.1).step({k: grads[k]})
    for k in params:
        np.testing.assert_array_equal(params[k], expected[k])
