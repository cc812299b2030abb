"""Write the fixture of js/test/ort_training.test.js: a folder of onnxgrad.compat.training (the MLP
of tests/compat_training/scenarios.py, cross-entropy, AdamW) and what the Python API computes on it.

    python js/test/make_ort_training_fixture.py DIR    (default: js/test/ort_training_fixture)

DIR/artifacts/ is the folder, DIR/data.safetensors holds the inputs and labels, DIR/expected.json
the losses of 6 updates (each from two half batches: the gradients accumulate), the eval loss, the
contiguous parameters after training and the parameter sizes; DIR/external/checkpoint the trained
state with its tensors in checkpoint.data (the layout of checkpoints over 2 GB); DIR/nominal/checkpoint
the folder's checkpoint as a nominal one (names and shapes, no values); DIR/properties/checkpoint the
trained state with int, float and str properties (an int beyond 2**53 among them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "compat_training"))

import scenarios  # noqa: E402

import onnxgrad.compat.training as og  # noqa: E402
from onnxgrad.compat.training import checkpoint_file  # noqa: E402
from onnxgrad.artifacts import tensors  # noqa: E402

UPDATES, HALF, LR = 6, 4, 0.01
PROPERTIES = {"big": 2**60 + 1, "low": -(2**63), "epoch": 3, "rate": 0.5, "note": "text"}


def main(out: str) -> None:
    """Generate the folder, train it with the Python API, write what the JS test compares."""
    folder = os.path.join(out, "artifacts")
    scenarios._generate(og, folder, scenarios.mlp(), og.artifacts.LossType.CrossEntropyLoss)
    state, module, opt = scenarios._session(og, folder)
    opt.set_learning_rate(LR)
    x, y = scenarios.data("classes")
    losses = []
    for k in range(UPDATES):
        for h in range(2):
            at = (2 * k + h) * HALF
            losses.append(float(module(x[at : at + HALF], y[at : at + HALF])))
        opt.step()
        module.lazy_reset_grad()
    module.eval()
    eval_loss = float(module(x, y))
    expected = {
        "updates": UPDATES,
        "half": HALF,
        "lr": LR,
        "losses": losses,
        "eval_loss": eval_loss,
        "contiguous": module.get_contiguous_parameters(True).numpy().astype(float).tolist(),
        "size": module.get_parameters_size(True),
        "size_all": module.get_parameters_size(False),
        "input_names": module.input_names(),
        "output_names": module.output_names(),
    }
    tensors.save(os.path.join(out, "data.safetensors"), {"input": x, "labels": y})
    # the checkpoint as a model over 2 GB writes it (tensors in checkpoint.data): the JS reader refuses it
    external = os.path.join(out, "external")
    os.makedirs(external, exist_ok=True)
    threshold = checkpoint_file.EXTERNAL_DATA_THRESHOLD
    checkpoint_file.EXTERNAL_DATA_THRESHOLD = 0
    try:
        og.api.CheckpointState.save_checkpoint(state, os.path.join(external, "checkpoint"))
    finally:
        checkpoint_file.EXTERNAL_DATA_THRESHOLD = threshold
    # the untrained checkpoint as a nominal one: the JS session must refuse to train it
    start = checkpoint_file.load(os.path.join(folder, "checkpoint"))
    start.nominal = True
    os.makedirs(os.path.join(out, "nominal"), exist_ok=True)
    checkpoint_file.save(os.path.join(out, "nominal", "checkpoint"), start)
    os.makedirs(os.path.join(out, "properties"), exist_ok=True)
    for name, value in PROPERTIES.items():
        state.properties[name] = value
    og.api.CheckpointState.save_checkpoint(state, os.path.join(out, "properties", "checkpoint"))
    expected["properties"] = {k: str(v) for k, v in PROPERTIES.items()}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "ort_training_fixture"))
