"""Training scripts written against onnxruntime-training 1.19.2's on-device API.

Each scenario takes the ``training`` package (``onnxruntime.training`` or
``onnxgrad.compat.training``: the modules ``artifacts``, ``api`` and ``onnxblock``) and a work folder,
and returns what it measured as JSON-able values. ``tools/record_ort_training.py`` runs them on
onnxruntime-training 1.19.2 and writes ``tests/data/ort_training/recorded.json``;
``tests/compat_training/test_scenarios.py`` runs the same code, unchanged, on onnxgrad. Only numpy,
onnx and onnxruntime are imported here (the recording venv has onnx 1.16 and numpy 1.26).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

STEPS = 15
BATCH = 8


def mlp(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """x[N, 4] -> MatMul/Add/Relu -> MatMul/Add -> logits[N, 3]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((4, 8)) * 0.5).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "fc1.bias"),
        numpy_helper.from_array((rng.standard_normal((8, 3)) * 0.5).astype(np.float32), "fc2.weight"),
        numpy_helper.from_array((rng.standard_normal(3) * 0.1).astype(np.float32), "fc2.bias"),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "fc1.weight"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "fc1.bias"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "fc2.weight"], ["h3"], name="mm2"),
        helper.make_node("Add", ["h3", "fc2.bias"], ["logits"], name="add2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def bn_net(seed: int = 0) -> onnx.ModelProto:
    """x[N, 4] -> MatMul -> BatchNormalization (training mode, as torch exports it in TRAINING) ->
    Relu -> MatMul -> out[N, 1]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((4, 6)) * 0.5).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array(np.ones(6, np.float32), "bn.weight"),
        numpy_helper.from_array(np.zeros(6, np.float32), "bn.bias"),
        numpy_helper.from_array(np.zeros(6, np.float32), "bn.running_mean"),
        numpy_helper.from_array(np.ones(6, np.float32), "bn.running_var"),
        numpy_helper.from_array((rng.standard_normal((6, 1)) * 0.5).astype(np.float32), "fc2.weight"),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "fc1.weight"], ["h0"], name="mm1"),
        helper.make_node(
            "BatchNormalization",
            ["h0", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
            ["h1", "bn.new_mean", "bn.new_var"],
            name="bn",
            epsilon=1e-5,
            momentum=0.9,
            training_mode=1,
        ),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "fc2.weight"], ["out"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "bn_net",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 1])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def data(kind: str, n: int = STEPS * BATCH, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets for a loss kind: class indices, floats, or 0/1 floats."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    if kind == "classes":
        y = (rng.random(n) * 3).astype(np.int64)
    elif kind == "binary":
        y = (rng.random((n, 3)) > 0.5).astype(np.float32)
    elif kind == "one":
        y = rng.standard_normal((n, 1)).astype(np.float32)
    else:
        y = rng.standard_normal((n, 3)).astype(np.float32)
    return x, y


def batches(x: np.ndarray, y: np.ndarray, size: int = BATCH):
    for i in range(0, len(x), size):
        yield x[i : i + size], y[i : i + size]


def _f(value: Any) -> Any:
    """JSON-able: arrays to nested lists of floats, numpy scalars to floats."""
    if isinstance(value, np.ndarray):
        return value.astype(np.float64).tolist()
    if isinstance(value, (np.floating, np.integer)):
        return float(value)
    return value


def _generate(tr, work: str, model, loss, optimizer=None, **kw) -> str:
    os.makedirs(work, exist_ok=True)
    tr.artifacts.generate_artifacts(
        model,
        requires_grad=kw.pop("requires_grad", PARAMS),
        loss=loss,
        optimizer=optimizer if optimizer is not None else tr.artifacts.OptimType.AdamW,
        artifact_directory=work,
        **kw,
    )
    return work


def _session(tr, work: str, checkpoint: str | None = None):
    state = tr.api.CheckpointState.load_checkpoint(checkpoint or os.path.join(work, "checkpoint"))
    module = tr.api.Module(
        os.path.join(work, "training_model.onnx"), state, os.path.join(work, "eval_model.onnx")
    )
    optimizer = tr.api.Optimizer(os.path.join(work, "optimizer_model.onnx"), module)
    return state, module, optimizer


def _scalar(loss) -> float:
    """A loss as a float; a custom loss may have shape [1]."""
    return float(np.asarray(loss).reshape(()))


def _train(module, optimizer, x, y, lr: float | None = None) -> list[float]:
    if lr is not None:
        optimizer.set_learning_rate(lr)
    losses = []
    module.train()
    for xb, yb in batches(x, y):
        losses.append(_scalar(module(xb, yb)))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def _eval(module, x, y) -> float:
    module.eval()
    loss = _scalar(module(x, y))
    module.train()
    return loss


def _params(state) -> dict[str, Any]:
    return {name: _f(p.data) for name, p in state.parameters}


def loss_scenario(tr, work: str, loss: str, optimizer: str, target: str, lr: float) -> dict[str, Any]:
    """Generate with one LossType and OptimType, train STEPS steps, evaluate."""
    _generate(
        tr, work, mlp(), getattr(tr.artifacts.LossType, loss), getattr(tr.artifacts.OptimType, optimizer)
    )
    state, module, opt = _session(tr, work)
    x, y = data(target)
    losses = _train(module, opt, x, y, lr)
    return {
        "losses": losses,
        "eval": _eval(module, x, y),
        "params": _params(state),
        "lr": opt.get_learning_rate(),
    }


def weight_decay(tr, work: str) -> dict[str, Any]:
    """AdamW with weight decay and without bias correction, passed as an onnxblock optimizer."""
    opt_block = tr.onnxblock.optim.AdamW(weight_decay=0.1, bias_correction=False, betas=(0.8, 0.99))
    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss, opt_block)
    state, module, opt = _session(tr, work)
    x, y = data("classes")
    losses = _train(module, opt, x, y, 0.02)
    return {"losses": losses, "params": _params(state)}


def additional_outputs(tr, work: str) -> dict[str, Any]:
    """additional_output_names: the call returns the loss and the logits."""
    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss, additional_output_names=["logits"])
    _state, module, opt = _session(tr, work)
    x, y = data("classes")
    loss, logits = module(x[:BATCH], y[:BATCH])
    opt.step()
    module.eval()
    eval_loss, eval_logits = module(x[:BATCH], y[:BATCH])
    return {
        "loss": _scalar(loss),
        "logits": _f(logits),
        "eval_loss": _scalar(eval_loss),
        "eval_logits": _f(eval_logits),
        "outputs": len(module.output_names()),
    }


def offline_blocks(tr, work: str) -> dict[str, Any]:
    """The offline tooling without generate_artifacts: a TrainingBlock, an optimizer block in an
    empty base, save_checkpoint, then load_checkpoint_to_model of the trained values."""
    ob = tr.onnxblock

    class MLPTrainingBlock(ob.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = ob.loss.CrossEntropyLoss()

        def build(self, output_name):
            return self.loss(output_name)

    model = mlp()
    block = MLPTrainingBlock()
    for name in PARAMS:
        block.requires_grad(name, True)
    with ob.base(model):
        block(*[o.name for o in model.graph.output])
        training_model, eval_model = block.to_model_proto()
        params = block.parameters()
    opt_block = ob.optim.AdamW()
    with ob.empty_base():
        opt_block(params)
        optimizer_model = opt_block.to_model_proto()
    os.makedirs(work, exist_ok=True)
    onnx.save(training_model, os.path.join(work, "training_model.onnx"))
    onnx.save(eval_model, os.path.join(work, "eval_model.onnx"))
    onnx.save(optimizer_model, os.path.join(work, "optimizer_model.onnx"))
    ob.save_checkpoint(params, os.path.join(work, "checkpoint"))
    state, module, opt = _session(tr, work)
    x, y = data("classes")
    losses = _train(module, opt, x, y, 0.01)
    trained = os.path.join(work, "trained")
    tr.api.CheckpointState.save_checkpoint(state, trained)
    fresh = mlp()
    ob.load_checkpoint_to_model(trained, fresh)
    return {
        "losses": losses,
        "trainable": [t.name for t in params[0]],
        "loaded": {t.name: _f(numpy_helper.to_array(t)) for t in fresh.graph.initializer},
    }


def loss_options(tr, work: str) -> dict[str, Any]:
    """The losses' options: MSE summed, BCE with pos_weight, cross-entropy with ignore_index."""
    ob, out = tr.onnxblock, {}
    cases = {
        "mse_sum": (ob.loss.MSELoss(reduction="sum"), tr.artifacts.OptimType.SGD, "floats", 0.005),
        "bce_pos_weight": (
            ob.loss.BCEWithLogitsLoss(pos_weight=np.array([2.0, 1.0, 0.5], np.float32)),
            tr.artifacts.OptimType.AdamW,
            "binary",
            0.01,
        ),
        "ce_ignore_index": (
            ob.loss.CrossEntropyLoss(ignore_index=1),
            tr.artifacts.OptimType.AdamW,
            "classes",
            0.01,
        ),
    }
    for key, (loss, optimizer, kind, lr) in cases.items():
        folder = os.path.join(work, key)
        _generate(tr, folder, mlp(), loss, optimizer)
        _state, module, opt = _session(tr, folder)
        x, y = data(kind)
        out[key] = _train(module, opt, x[: 6 * BATCH], y[: 6 * BATCH], lr)
    return out


def weighted_cross_entropy(tr, work: str) -> dict[str, Any]:
    """CrossEntropyLoss(weight=...): class weights."""
    loss = tr.onnxblock.loss.CrossEntropyLoss(weight=np.array([1.0, 2.0, 3.0], np.float32))
    _generate(tr, work, mlp(), loss)
    _state, module, opt = _session(tr, work)
    x, y = data("classes")
    return {"losses": _train(module, opt, x[: 6 * BATCH], y[: 6 * BATCH], 0.01)}


def api_surface(tr, work: str) -> dict[str, Any]:
    """Names, orders and sizes that scripts read: inputs/outputs, parameter order, buffers."""
    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss, frozen_params=None)
    state, module, opt = _session(tr, work)
    x, y = data("classes")
    before = module.get_contiguous_parameters().numpy()
    loss = float(module(x[:BATCH], y[:BATCH]))
    out = {
        "loss": loss,
        "train_inputs": list(module.input_names()),
        "train_outputs": list(module.output_names()),
        "parameter_order": [name for name, _ in state.parameters],
        "requires_grad": {name: bool(p.requires_grad) for name, p in state.parameters},
        "grads": {name: _f(p.grad) for name, p in state.parameters},
        "size": int(module.get_parameters_size()),
        "size_all": int(module.get_parameters_size(False)),
        "contiguous": _f(before),
        "lr": opt.get_learning_rate(),
    }
    module.eval()
    out["eval_inputs"] = list(module.input_names())
    out["eval_outputs"] = list(module.output_names())
    module.train()
    opt.step()
    # the trained values handed to a second module through a contiguous buffer
    buffer = module.get_contiguous_parameters()
    state2, module2, _ = _session(tr, work)
    module2.copy_buffer_to_parameters(buffer)
    out["after_copy"] = _params(state2)
    return out


def frozen(tr, work: str) -> dict[str, Any]:
    """The first layer frozen: only the second one moves."""
    _generate(
        tr,
        work,
        mlp(),
        tr.artifacts.LossType.CrossEntropyLoss,
        requires_grad=["fc2.weight", "fc2.bias"],
        frozen_params=["fc1.weight", "fc1.bias"],
    )
    state, module, opt = _session(tr, work)
    x, y = data("classes")
    losses = _train(module, opt, x, y, 0.01)
    return {
        "losses": losses,
        "params": _params(state),
        "requires_grad": {name: bool(p.requires_grad) for name, p in state.parameters},
        "size": int(module.get_parameters_size()),
        "size_all": int(module.get_parameters_size(False)),
        "contiguous_all": _f(module.get_contiguous_parameters(False).numpy()),
        "train_inputs": list(module.input_names()),
    }


def accumulation(tr, work: str) -> dict[str, Any]:
    """Two half batches per update: gradients add up until lazy_reset_grad; step does not reset."""
    _generate(tr, work, mlp(), tr.artifacts.LossType.MSELoss, tr.artifacts.OptimType.SGD)
    state, module, opt = _session(tr, work)
    opt.set_learning_rate(0.05)
    x, y = data("floats")
    losses, grads = [], []
    for k, (xb, yb) in enumerate(batches(x, y)):
        half = len(xb) // 2
        losses.append(float(module(xb[:half], yb[:half])))
        losses.append(float(module(xb[half:], yb[half:])))
        grads.append(_f(state.parameters["fc2.bias"].grad))
        opt.step()
        if k % 2 == 1:  # every other update, the gradients are not reset: they keep adding up
            module.lazy_reset_grad()
    return {"losses": losses, "grads": grads, "params": _params(state)}


def _custom(tr, work: str, scaled: bool) -> dict[str, Any]:
    ob = tr.onnxblock

    class MixedLoss(ob.Block):
        """mse + l1, or mse + l1 * Constant(0.25) (which 1.19.2's gradient builder refuses)."""

        def __init__(self):
            super().__init__()
            self.mse = ob.loss.MSELoss()
            self.l1 = ob.loss.L1Loss()
            self.add = ob.blocks.Add()
            self.mul = ob.blocks.Mul()
            self.scale = ob.blocks.Constant(0.25)

        def build(self, output_name):
            mse = self.mse(output_name, "target")
            l1 = self.l1(output_name, "target")
            return self.add(mse, self.mul(l1, self.scale()) if scaled else l1)

    _generate(tr, work, mlp(), MixedLoss(), tr.artifacts.OptimType.AdamW)
    state, module, opt = _session(tr, work)
    x, y = data("floats")
    losses = _train(module, opt, x, y, 0.01)
    return {"losses": losses, "eval": _eval(module, x, y), "params": _params(state)}


def custom_loss(tr, work: str) -> dict[str, Any]:
    """A Block subclass composing the provided losses and blocks: MSELoss + L1Loss."""
    return _custom(tr, work, scaled=False)


def custom_loss_scaled(tr, work: str) -> dict[str, Any]:
    """MSELoss + L1Loss * Constant(0.25): a [1]-shaped constant times a scalar, plus a scalar."""
    return _custom(tr, work, scaled=True)


def resume(tr, work: str) -> dict[str, Any]:
    """Save after 5 steps with the optimizer state, load, train on; properties round trip."""
    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss)
    state, module, opt = _session(tr, work)
    x, y = data("classes")
    first = _train(module, opt, x[: 5 * BATCH], y[: 5 * BATCH], 0.01)
    state.properties["epoch"] = 5
    state.properties["best"] = 0.125
    state.properties["note"] = "resumed"
    path = os.path.join(work, "saved_checkpoint")
    tr.api.CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    state2, module2, opt2 = _session(tr, work, path)
    props = {name: value for name, value in state2.properties}
    second = _train(module2, opt2, x[5 * BATCH :], y[5 * BATCH :], 0.01)
    return {"first": first, "second": second, "properties": props, "params": _params(state2)}


def export(tr, work: str) -> dict[str, Any]:
    """Train a few steps, export for inference, run the exported model on stock onnxruntime."""
    import onnxruntime as ort

    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss)
    _state, module, opt = _session(tr, work)
    x, y = data("classes")
    _train(module, opt, x[: 5 * BATCH], y[: 5 * BATCH], 0.01)
    path = os.path.join(work, "inference.onnx")
    module.export_model_for_inferencing(path, ["logits"])
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (logits,) = sess.run(None, {"input": x[:BATCH]})
    return {"logits": _f(logits), "inputs": [i.name for i in sess.get_inputs()]}


def scheduler(tr, work: str) -> dict[str, Any]:
    """LinearLRScheduler(optimizer, warmup_step_count=3, total_step_count=10, initial_lr=0.01)."""
    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss)
    _state, module, opt = _session(tr, work)
    sched = tr.api.lr_scheduler.LinearLRScheduler(opt, 3, 10, 0.01)
    x, y = data("classes")
    lrs, losses = [], []
    for xb, yb in batches(x[: 10 * BATCH], y[: 10 * BATCH]):
        lrs.append(opt.get_learning_rate())
        losses.append(_scalar(module(xb, yb)))
        opt.step()
        sched.step()
        module.lazy_reset_grad()
    return {"lrs": lrs, "losses": losses}


def batchnorm(tr, work: str) -> dict[str, Any]:
    """A training-mode BatchNormalization: losses, running statistics, eval loss."""
    _generate(
        tr,
        work,
        bn_net(),
        tr.artifacts.LossType.MSELoss,
        requires_grad=["fc1.weight", "bn.weight", "bn.bias", "fc2.weight"],
        frozen_params=["bn.running_mean", "bn.running_var"],
    )
    out: dict[str, Any] = {}
    try:
        state, module, opt = _session(tr, work)
    except Exception as exc:  # 1.19.2: the eval model of a training-mode export does not load
        out["eval_error"] = f"{type(exc).__name__}: {str(exc)[-200:]}"
        state = tr.api.CheckpointState.load_checkpoint(os.path.join(work, "checkpoint"))
        module = tr.api.Module(os.path.join(work, "training_model.onnx"), state)
        opt = tr.api.Optimizer(os.path.join(work, "optimizer_model.onnx"), module)
    x, y = data("one")
    out["losses"] = _train(module, opt, x, y, 0.01)
    out["params"] = _params(state)
    if "eval_error" not in out:
        out["eval"] = _eval(module, x, y)
    return out


def _nominal(tr, work: str):
    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss, nominal_checkpoint=True)
    full = tr.api.CheckpointState.load_checkpoint(os.path.join(work, "checkpoint"))
    fm = tr.api.Module(os.path.join(work, "training_model.onnx"), full, os.path.join(work, "eval_model.onnx"))
    buffer = fm.get_contiguous_parameters(False)
    state = tr.api.CheckpointState.load_checkpoint(os.path.join(work, "nominal_checkpoint"))
    module = tr.api.Module(
        os.path.join(work, "training_model.onnx"), state, os.path.join(work, "eval_model.onnx")
    )
    return buffer, state, module


def nominal(tr, work: str) -> dict[str, Any]:
    """A nominal checkpoint (parameters without data), filled from a buffer, then trained."""
    buffer, _state, module = _nominal(tr, work)
    out: dict[str, Any] = {"size": int(module.get_parameters_size())}
    module.copy_buffer_to_parameters(buffer, False)
    opt = tr.api.Optimizer(os.path.join(work, "optimizer_model.onnx"), module)
    out["lr"] = opt.get_learning_rate()
    x, y = data("classes")
    out["losses"] = _train(module, opt, x[: 3 * BATCH], y[: 3 * BATCH], 0.01)
    return out


def nominal_lr(tr, work: str) -> dict[str, Any]:
    """An Optimizer made over a nominal checkpoint before it is filled, asked for its learning
    rate (1.19.2 crashes the process)."""
    _, _, module = _nominal(tr, work)
    opt = tr.api.Optimizer(os.path.join(work, "optimizer_model.onnx"), module)
    return {"lr": opt.get_learning_rate()}


SCENARIOS = {
    "adamw_cross_entropy": lambda tr, w: loss_scenario(tr, w, "CrossEntropyLoss", "AdamW", "classes", 0.01),
    "sgd_mse": lambda tr, w: loss_scenario(tr, w, "MSELoss", "SGD", "floats", 0.05),
    "adamw_bce": lambda tr, w: loss_scenario(tr, w, "BCEWithLogitsLoss", "AdamW", "binary", 0.01),
    "sgd_l1": lambda tr, w: loss_scenario(tr, w, "L1Loss", "SGD", "floats", 0.05),
    "api_surface": api_surface,
    "loss_options": loss_options,
    "weighted_cross_entropy": weighted_cross_entropy,
    "offline_blocks": offline_blocks,
    "weight_decay": weight_decay,
    "additional_outputs": additional_outputs,
    "frozen": frozen,
    "accumulation": accumulation,
    "custom_loss": custom_loss,
    "custom_loss_scaled": custom_loss_scaled,
    "resume": resume,
    "export": export,
    "scheduler": scheduler,
    "batchnorm": batchnorm,
    "nominal": nominal,
    "nominal_lr": nominal_lr,
}


def write_checkpoint(tr, work: str, path: str) -> None:
    """Train the MLP 5 steps, set properties, save with the optimizer state to ``path``."""
    _generate(tr, work, mlp(), tr.artifacts.LossType.CrossEntropyLoss)
    state, module, opt = _session(tr, work)
    x, y = data("classes")
    _train(module, opt, x[: 5 * BATCH], y[: 5 * BATCH], 0.01)
    state.properties["epoch"] = 5
    state.properties["best"] = 0.25
    state.properties["note"] = "written elsewhere"
    tr.api.CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)


def continue_from(tr, folder: str, checkpoint: str, lr: float | None = None) -> dict[str, Any]:
    """Load ``checkpoint`` with the models of ``folder`` and train on the 10 batches after the
    first 5 (at the checkpoint's learning rate unless ``lr``)."""
    state, module, opt = _session(tr, folder, checkpoint)
    x, y = data("classes")
    return {
        "lr_loaded": opt.get_learning_rate(),
        "properties": {k: v for k, v in state.properties},
        "losses": _train(module, opt, x[5 * BATCH :], y[5 * BATCH :], lr),
        "params": _params(state),
    }
