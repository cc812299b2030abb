"""``onnxruntime.training``'s on-device API on stock onnxruntime: migrating is changing an import.

onnxruntime-training (``onnxruntime.training.artifacts``, ``.api``, ``.onnxblock``) stopped at
1.19.2. This package keeps its names and numbers::

    from onnxgrad.compat.training import artifacts, api, onnxblock   # was: from onnxruntime.training

    artifacts.generate_artifacts(model, requires_grad=[...], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory="out")
    state = api.CheckpointState.load_checkpoint("out/checkpoint")
    module = api.Module("out/training_model.onnx", state, "out/eval_model.onnx")
    optimizer = api.Optimizer("out/optimizer_model.onnx", module)
    loss = module(x, labels); optimizer.step(); module.lazy_reset_grad()

The files are plain ONNX that stock onnxruntime runs; the ``checkpoint`` is onnxruntime-training's
format both ways, and folders written by 1.19.2 keep training (see docs/migrate_ort_training.md).
"""

from . import api, artifacts, onnxblock

__all__ = ["api", "artifacts", "onnxblock"]
