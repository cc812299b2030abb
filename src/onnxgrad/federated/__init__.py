"""Federated training on Flower: the two components of a Flower App.

::

    # client_app.py
    from onnxgrad.federated import client_app
    app = client_app("model.onnx", data, loss="cross_entropy", optimizer="adamw", lr=1e-3)
    # server_app.py
    from onnxgrad.federated import server_app
    app = server_app("model.onnx", num_rounds=10, out_dir="out/federated")  # FedAvg unless strategy=

Flower carries the messages and its strategies aggregate (``flwr``, the ``federated`` extra);
onnxgrad trains on each node (:mod:`.client`) and keeps the global model's files on the server
(:mod:`.server`). Only the trainable parameters travel. docs/federated.md tells the whole story.
"""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    from ..errors import DependencyError

    raise DependencyError(
        "onnxgrad.federated needs Flower, which is not installed (pip install 'onnxgrad[federated]')"
    ) from exc

from .client import client_app
from .model import GlobalModel, Spec
from .server import server_app

__all__ = ["GlobalModel", "Spec", "client_app", "server_app"]
