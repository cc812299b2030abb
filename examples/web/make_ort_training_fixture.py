"""Write the fixture of examples/web/ort_training.html: the migrated MNIST-style example of
docs/migrate_ort_training.md, run as the page shows it, and the Python API's losses on its folder.

    python examples/web/make_ort_training_fixture.py DIR   (default: examples/web/fixture/ort_training)

The first python block of the page's "After" section runs unchanged in DIR: it writes DIR/data/
(training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint) and trains. Then a fresh
session on DIR/data/checkpoint (the untrained parameters) takes ``STEPS`` steps of ``BATCH`` rows
with the Python API; DIR/digits.safetensors holds the rows and DIR/expected.json the losses, the
eval loss and the parameter count that the page's onnxruntime-web run is compared with;
DIR/nominal_checkpoint the folder's checkpoint as a nominal one.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "migrate_ort_training.md"
STEPS, BATCH, LR = 30, 50, 0.01


def example_code() -> str:
    """The python block right after the page's "## After" heading: the migrated script."""
    text = PAGE.read_text()
    after = text.index("## After")
    found = re.search(r"```python\n(.*?)```", text[after:], re.S)
    if found is None:
        raise SystemExit(f"no python block after '## After' in {PAGE}")
    return found.group(1)


def main(out: str) -> None:
    """Run the docs example in ``out``, then record the Python API's numbers on its folder."""
    import numpy as np

    from onnxgrad.artifacts import tensors
    from onnxgrad.compat.training import checkpoint_file
    from onnxgrad.compat.training.api import CheckpointState, Module, Optimizer

    os.makedirs(out, exist_ok=True)
    scope: dict = {"__name__": "__docs_example__"}
    here = os.getcwd()
    os.chdir(out)  # the example writes data/ in the current folder
    try:
        exec(compile(example_code(), str(PAGE), "exec"), scope)  # the repository's own docs page
    finally:
        os.chdir(here)
    data = os.path.join(out, "data")
    state = CheckpointState.load_checkpoint(os.path.join(data, "checkpoint"))
    model = Module(os.path.join(data, "training_model.onnx"), state, os.path.join(data, "eval_model.onnx"))
    optimizer = Optimizer(os.path.join(data, "optimizer_model.onnx"), model)
    optimizer.set_learning_rate(LR)
    x, y = scope["x_train"][: STEPS * BATCH], scope["y_train"][: STEPS * BATCH]
    losses = []
    for k in range(STEPS):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        losses.append(float(np.asarray(model(x[rows], y[rows]))))
        optimizer.step()
        model.lazy_reset_grad()
    model.eval()
    x_test, y_test = scope["x_test"], scope["y_test"]
    expected = {
        "steps": STEPS,
        "batch": BATCH,
        "lr": LR,
        "losses": losses,
        "eval_loss": float(np.asarray(model(x_test, y_test))),
        "size": model.get_parameters_size(True),
        "input_names": model.input_names(),
    }
    tensors.save(
        os.path.join(out, "digits.safetensors"), {"x": x, "y": y, "x_test": x_test, "y_test": y_test}
    )
    # the folder's checkpoint as a nominal one (names and shapes, no values): the page checks that
    # onnxruntime-web's TrainingSession names refuse to train it until every parameter is loaded
    nominal = checkpoint_file.load(os.path.join(data, "checkpoint"))
    nominal.nominal = True
    checkpoint_file.save(os.path.join(out, "nominal_checkpoint"), nominal)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
    print(f"wrote {out}: {STEPS} losses {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "fixture" / "ort_training"))
