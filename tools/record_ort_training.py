"""Record what onnxruntime-training 1.19.2 computes, for onnxgrad.compat.training's tests.

onnxruntime-training is not a dependency of onnxgrad (its last release is 1.19.2); this script runs
in a separate virtual environment that has it::

    python3.11 -m venv /tmp/ortt-venv
    /tmp/ortt-venv/bin/pip install torch==2.13.0 onnxruntime-training==1.19.2 onnx==1.16.2 "numpy<2"
    /tmp/ortt-venv/bin/python tools/record_ort_training.py

It runs every scenario of ``tests/compat_training/scenarios.py`` (the same code the tests run on
onnxgrad) and writes ``tests/data/ort_training/``:

* ``recorded.json``: scenario name -> what it measured (losses, parameters, names, errors);
* ``ort1192/``: the artifacts folder 1.19.2 generated for the MLP, cross-entropy and AdamW
  (``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx``, ``checkpoint``) and
  ``checkpoint_step5`` (saved after 5 steps with the optimizer state), for the tests that continue
  training from 1.19.2's files; ``ort1192_bn/``: the folder of the BatchNormalization scenario
  (an eval model 1.19.2 itself cannot load);
* ``ours_in_ort.json`` when ``tests/data/ort_training/ours/checkpoint`` exists: 1.19.2 loads that
  checkpoint (written by onnxgrad) with the models of ``ort1192/``, trains 10 steps and records the
  losses, learning rate, properties and parameters.

Write ``ours/checkpoint`` first, with onnxgrad (``scenarios.write_checkpoint`` run on
``onnxgrad.compat.training``)::

    PYTHONPATH=src python tools/record_ort_training.py --write-ours
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "ort_training"
sys.path.insert(0, str(ROOT / "tests" / "compat_training"))

import scenarios  # noqa: E402


def _isolated(scenario, tr, work: str) -> dict:
    """Run ``scenario`` in a forked child: 1.19.2 crashes the process in some of them."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child() -> None:
        try:
            queue.put(scenario(tr, work))
        except Exception as exc:
            traceback.print_exc()
            queue.put({"error": f"{type(exc).__name__}: {str(exc)[:500]}"})

    proc = ctx.Process(target=child)
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        return {"crashed": f"the process died with exit code {proc.exitcode}"}
    return queue.get()


def write_ours() -> int:
    """Write ``ours/checkpoint`` with onnxgrad (run in onnxgrad's environment)."""
    import onnxgrad.compat.training as tr

    (DATA / "ours").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        scenarios.write_checkpoint(tr, tmp, str(DATA / "ours" / "checkpoint"))
    print("wrote", DATA / "ours" / "checkpoint")
    return 0


def main() -> int:
    """Run every scenario on onnxruntime-training and write the fixtures."""
    import onnxruntime
    import onnxruntime.training as tr
    import onnxruntime.training.api
    import onnxruntime.training.api.lr_scheduler
    import onnxruntime.training.artifacts
    import onnxruntime.training.onnxblock

    onnxruntime.set_default_logger_severity(3)

    print("onnxruntime-training", onnxruntime.__version__)
    DATA.mkdir(parents=True, exist_ok=True)
    recorded: dict[str, object] = {"onnxruntime": onnxruntime.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for name, scenario in scenarios.SCENARIOS.items():
            recorded[name] = _isolated(scenario, tr, os.path.join(tmp, name))
            print(name, ("error" in recorded[name] and recorded[name]["error"]) or "ok")
        files = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
        for scenario, kept in (("resume", "ort1192"), ("batchnorm", "ort1192_bn")):
            keep = DATA / kept
            shutil.rmtree(keep, ignore_errors=True)
            keep.mkdir()
            for file in files:
                shutil.copy(Path(tmp) / scenario / file, keep / file)
        keep, folder = DATA / "ort1192", Path(tmp) / "resume"
        state, module, opt = scenarios._session(tr, str(folder))
        x, y = scenarios.data("classes")
        scenarios._train(module, opt, x[: 5 * scenarios.BATCH], y[: 5 * scenarios.BATCH], 0.01)
        tr.api.CheckpointState.save_checkpoint(
            state, str(keep / "checkpoint_step5"), include_optimizer_state=True
        )
    with open(DATA / "recorded.json", "w") as f:
        json.dump(recorded, f, indent=None, separators=(",", ":"))
        f.write("\n")
    ours = DATA / "ours" / "checkpoint"
    if ours.exists():
        result = scenarios.continue_from(tr, str(DATA / "ort1192"), str(ours))
        with open(DATA / "ours_in_ort.json", "w") as f:
            json.dump(result, f, separators=(",", ":"))
            f.write("\n")
        print("ours_in_ort ok")
    return 0


if __name__ == "__main__":
    sys.exit(write_ours() if "--write-ours" in sys.argv[1:] else main())
