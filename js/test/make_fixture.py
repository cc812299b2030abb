"""Write the fixtures of the JavaScript tests: the artifacts of the digits MLP and of a LeNet-style
CNN on the same digits, and the Python runner's losses over 200 steps of each.

    python js/test/make_fixture.py DIR    (default: js/test/fixture)

DIR/ holds the MLP's fixture, DIR/cnn/ the CNN's (pixels as ``1 x 8 x 8`` images). In each,
artifacts/ is the training folder (``onnxgrad.artifacts.generate``), artifacts_webgpu/ the same for
target ``onnxruntime-web-webgpu``, digits.safetensors holds
``pixels`` (float32, scaled to [0, 1]) and ``target`` (int64), expected.json the batch size, the
learning rate, the losses of ``onnxgrad.artifacts.Runner`` and the evaluation loss, and
trained.safetensors the state after the last step.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from sklearn.datasets import load_digits

from onnxgrad.artifacts import Runner, generate, tensors
from onnxgrad.demo import build_cnn, build_mlp

STEPS, BATCH, LR = 200, 32, 1e-2
MODELS = {"mlp": "", "cnn": "cnn"}  # model -> subfolder of DIR


def batch_at(data: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """The batch of ``step``: consecutive rows, wrapping around at the last full batch."""
    n = len(data["target"]) // BATCH
    start = (step % n) * BATCH
    return {k: v[start : start + BATCH] for k, v in data.items()}


def digits(kind: str) -> dict[str, np.ndarray]:
    """The digits set, ``pixels`` of shape (N, 64) for the MLP and (N, 1, 8, 8) for the CNN."""
    d = load_digits()
    pixels = (d.data / 16.0).astype(np.float32)
    if kind == "cnn":
        pixels = pixels.reshape(-1, 1, 8, 8)
    return {"pixels": pixels, "target": d.target.astype(np.int64)}


def model_of(kind: str):
    rng = np.random.default_rng(0)
    return build_mlp((64, 32, 10), rng) if kind == "mlp" else build_cnn(rng)


def write(out: str, kind: str) -> list[float]:
    data = digits(kind)
    folder = os.path.join(out, "artifacts")
    generate(model_of(kind), loss="cross_entropy", optimizer="adamw", lr=LR, out_dir=folder)
    # the same model for onnxruntime-web's WebGPU provider (examples/web/test-web.mjs)
    generate(model_of(kind), loss="cross_entropy", optimizer="adamw", lr=LR,
             out_dir=os.path.join(out, "artifacts_webgpu"), targets=["onnxruntime-web-webgpu"])  # fmt: skip
    tensors.save(os.path.join(out, "digits.safetensors"), data)
    runner = Runner(folder, threads=1)
    losses = [runner.step(batch_at(data, k)) for k in range(STEPS)]
    runner.save_state(os.path.join(out, "trained.safetensors"))
    evaluation = runner.evaluate(batch_at(data, 0))["loss"]
    expected = {
        "model": kind,
        "steps": STEPS,
        "batch_size": BATCH,
        "sample_shape": list(data["pixels"].shape[1:]),
        "lr": LR,
        "losses": losses,
        "eval_loss": evaluation,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
    print(f"{out} ({kind}): loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps")
    return losses


def main(out: str) -> None:
    for kind, sub in MODELS.items():
        write(os.path.join(out, sub) if sub else out, kind)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "fixture"))
