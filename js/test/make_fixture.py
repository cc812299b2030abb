"""Write the fixture of the JavaScript tests: the digits MLP's artifacts and the Python runner's
losses over 200 steps.

    python js/test/make_fixture.py DIR    (default: js/test/fixture)

DIR/artifacts/ is the training folder (``onnxgrad.artifacts.generate``), DIR/digits.safetensors
holds ``pixels`` (float32, scaled to [0, 1]) and ``target`` (int64), DIR/expected.json the batch
size, the learning rate, the losses of ``onnxgrad.artifacts.Runner`` and the evaluation loss, and
DIR/trained.safetensors the state after the last step.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from sklearn.datasets import load_digits

from onnxgrad.artifacts import Runner, generate, tensors
from onnxgrad.demo import build_mlp

STEPS, BATCH, LR = 200, 32, 1e-2


def batch_at(data: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """The batch of ``step``: consecutive rows, wrapping around at the last full batch."""
    n = len(data["target"]) // BATCH
    start = (step % n) * BATCH
    return {k: v[start : start + BATCH] for k, v in data.items()}


def main(out: str) -> None:
    digits = load_digits()
    data = {"pixels": (digits.data / 16.0).astype(np.float32), "target": digits.target.astype(np.int64)}
    model = build_mlp((64, 32, 10), np.random.default_rng(0))
    folder = os.path.join(out, "artifacts")
    generate(model, loss="cross_entropy", optimizer="adamw", lr=LR, out_dir=folder)
    tensors.save(os.path.join(out, "digits.safetensors"), data)
    runner = Runner(folder, threads=1)
    losses = [runner.step(batch_at(data, k)) for k in range(STEPS)]
    runner.save_state(os.path.join(out, "trained.safetensors"))
    evaluation = runner.evaluate(batch_at(data, 0))["loss"]
    expected = {"steps": STEPS, "batch_size": BATCH, "lr": LR, "losses": losses, "eval_loss": evaluation}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
    print(f"{out}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "fixture"))
