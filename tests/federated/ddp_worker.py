"""One process of the data-parallel test (tests/federated/test_distributed.py), started by torchrun:
``Trainer(distributed=True)`` on the test's model and data, then this rank's parameters to
``OUT/rank{RANK}.npz``; the checkpoint path names the rank, so that the test sees who wrote one."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx

from onnxgrad.train import Trainer

model_path, data_path, out = sys.argv[1:4]
rank = int(os.environ["RANK"])
with np.load(data_path) as f:
    data = {k: f[k] for k in f.files}
trainer = Trainer(
    onnx.load(model_path), loss="mse", optimizer="adam", lr=0.01, batch_size=4, seed=3, distributed=True
)
history = trainer.fit(data, epochs=2, checkpoint=os.path.join(out, f"checkpoint{rank}.npz"))
np.savez(os.path.join(out, f"rank{rank}.npz"), loss=np.array(history["loss"]), **trainer.parameters)
