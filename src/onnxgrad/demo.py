"""End-to-end demo: train an ONNX MLP on scikit-learn's digits with onnxruntime alone.

The model is built with ``onnx.helper`` (Gemm, Relu, Gemm); :class:`onnxgrad.train.Trainer` appends
a cross-entropy loss, runs forward and backward on onnxruntime and updates the weights in place with
Adam, showing a progress bar per epoch. The trained logits model is saved and reloaded with a plain
``onnxruntime.InferenceSession`` to show it is an ordinary ONNX file. The digits are also written
next to the model (``digits.npz``), so that the commands the demo suggests at the end run as printed.
Needs scikit-learn (the bundled digits set, no download) and tqdm.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import InputError
from .model.graph import ir_version_for
from .runtime.runner import make_session
from .train import Trainer
from .train.callbacks import accuracy

DEFAULT_PATH = os.path.join("out", "digits_mlp.onnx")
INPUT, LOGITS = "pixels", "logits"


def build_mlp(sizes: tuple[int, ...], rng: np.random.Generator) -> onnx.ModelProto:
    """A float32 MLP ``sizes[0] -> ... -> sizes[-1]`` (Gemm + Relu, no Relu after the last layer).

    Weights are He-initialised (normal, std ``sqrt(2 / fan_in)``), biases zero.
    """
    nodes, inits = [], []
    x = INPUT
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes), start=1):
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"fc{i}.weight"),
            numpy_helper.from_array(np.zeros(fan_out, np.float32), f"fc{i}.bias"),
        ]
        last = i == len(sizes) - 1
        y = LOGITS if last else f"fc{i}"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [y]))
        if not last:
            nodes.append(helper.make_node("Relu", [y], [f"relu{i}"]))
            y = f"relu{i}"
        x = y
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["N", sizes[-1]])],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="onnxgrad.demo"
    )
    model.ir_version = ir_version_for(model.opset_import)
    return model


def build_cnn(rng: np.random.Generator, side: int = 8, classes: int = 10) -> onnx.ModelProto:
    """A float32 LeNet-style CNN on ``1 x side x side`` images (``side`` divisible by 4).

    Conv 3x3 (1 -> 4 channels, padding 1), Relu, MaxPool 2; Conv 3x3 (4 -> 8, padding 1), Relu,
    MaxPool 2; Flatten; Gemm (-> 32), Relu; Gemm (-> ``classes``). Input ``pixels`` of shape
    ``(N, 1, side, side)``, output ``logits``. He-initialised weights, zero biases.
    """
    if side % 4:
        raise InputError(f"side must be divisible by 4, got {side}")

    def he(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    flat = 8 * (side // 4) ** 2
    inits = [
        numpy_helper.from_array(he((4, 1, 3, 3), 9), "conv1.weight"),
        numpy_helper.from_array(np.zeros(4, np.float32), "conv1.bias"),
        numpy_helper.from_array(he((8, 4, 3, 3), 36), "conv2.weight"),
        numpy_helper.from_array(np.zeros(8, np.float32), "conv2.bias"),
        numpy_helper.from_array(he((flat, 32), flat), "fc1.weight"),
        numpy_helper.from_array(np.zeros(32, np.float32), "fc1.bias"),
        numpy_helper.from_array(he((32, classes), 32), "fc2.weight"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "fc2.bias"),
    ]
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node("Conv", [INPUT, "conv1.weight", "conv1.bias"], ["c1"], **conv),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], **pool),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], **conv),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], **pool),
        helper.make_node("Flatten", ["p2"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["fc1"]),
        helper.make_node("Relu", ["fc1"], ["r3"]),
        helper.make_node("Gemm", ["r3", "fc2.weight", "fc2.bias"], [LOGITS]),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["N", 1, side, side])],
        [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["N", classes])],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="onnxgrad.demo"
    )
    model.ir_version = ir_version_for(model.opset_import)
    return model


def load_digits_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits features scaled to [0, 1] (float32) and int64 labels: a stratified 75/25 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)  # pixel intensities are 0..16
    y = data.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)
    return x_tr, x_te, y_tr, y_te


def next_steps(model: str, data: str) -> list[tuple[str, str]]:
    """The commands the demo ends with, each with what it shows, for the model and data it wrote."""
    stem = os.path.splitext(model)[0]
    return [
        (f"onnxgrad check {model}", "every node's gradient against finite differences"),
        (
            f"onnxgrad train {model} --data {data} --target target --loss cross_entropy --val-split 0.2 "
            f"--patience 3 --history {stem}_history.csv -o {stem}_tuned.onnx",
            "fine-tune it from the shell: validation accuracy, early stopping, a history file",
        ),
        (
            f"onnxgrad artifacts {model} --loss cross_entropy -o {stem}_artifacts",
            "one ONNX graph per training step, for onnxruntime in Python, Node or the browser",
        ),
    ]


def main(
    epochs: int = 15,
    seed: int = 0,
    path: str | os.PathLike = DEFAULT_PATH,
    *,
    batch_size: int = 64,
    lr: float = 1e-2,
    progress: bool = True,
) -> dict[str, Any]:
    """Train, evaluate, save and reload the digits MLP; print a summary and return the numbers.

    The result has ``epoch_losses`` (mean training loss per epoch), ``test_accuracy``,
    ``reloaded_accuracy`` (the saved file run by a plain InferenceSession), ``path``, ``data`` (the
    digits as ``.npz``), ``next_steps`` (the commands suggested), ``seconds`` (the whole run) and
    ``train_seconds``.
    """
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    x_tr, x_te, y_tr, y_te = load_digits_split(seed)
    model = build_mlp((x_tr.shape[1], 128, 10), rng)
    # The trainer appends the loss; the logits stay an output, for the accuracy.
    trainer = Trainer(
        model,
        loss="cross_entropy",
        optimizer="adam",
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )
    train_start = time.perf_counter()
    history = trainer.fit({INPUT: x_tr, "target": y_tr}, epochs=epochs)
    train_seconds = time.perf_counter() - train_start
    epoch_losses = history["loss"] if epochs else []
    fb = trainer.fb
    test = fb.forward({INPUT: x_te, "target": y_te}, training=False)
    test_acc = accuracy(test.outputs[fb.output_names.index(LOGITS)], y_te)

    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    onnx.save(trainer.to_onnx(), path)  # the logits model with the trained weights
    session = make_session(path, ["CPUExecutionProvider"])
    reloaded_acc = accuracy(session.run([LOGITS], {INPUT: x_te})[0], y_te)
    data = os.path.join(os.path.dirname(path), "digits.npz")
    np.savez(data, **{INPUT: np.concatenate([x_tr, x_te]), "target": np.concatenate([y_tr, y_te])})
    seconds = time.perf_counter() - start

    n_params = sum(p.size for p in trainer.parameters.values())
    print(
        f"digits MLP 64-128-10 ({n_params} parameters), {len(x_tr)} train / {len(x_te)} test "
        f"samples, {epochs} epochs of Adam (lr={lr}, batch {batch_size})"
    )
    if epoch_losses:
        print(f"  training loss   {epoch_losses[0]:.4f} -> {epoch_losses[-1]:.4f}")
    print(f"  test accuracy   {test_acc:.2%}")
    print(f"  saved           {path} ({os.path.getsize(path) / 1024:.0f} KiB)")
    print(f"  reloaded        onnxruntime.InferenceSession: test accuracy {reloaded_acc:.2%}")
    print(f"  time            {seconds:.1f} s ({train_seconds:.1f} s training)")
    steps = next_steps(path, data)
    print("\nnext steps (onnxgrad is also python -m onnxgrad):")
    for command, what in steps:  # a shell comment: each line pastes as it is
        print(f"  {command}  # {what}")
    return {
        "epoch_losses": epoch_losses,
        "test_accuracy": test_acc,
        "reloaded_accuracy": reloaded_acc,
        "path": path,
        "data": data,
        "next_steps": [command for command, _ in steps],
        "seconds": seconds,
        "train_seconds": train_seconds,
    }


if __name__ == "__main__":
    main()
