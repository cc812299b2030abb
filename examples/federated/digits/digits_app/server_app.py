"""The ServerApp: FedAvg over the SuperNodes; the global model's accuracy on held-out digits after
every round goes into out-dir/history.json beside the nodes' losses."""

import numpy as np
import onnxruntime as ort
from flwr.serverapp.strategy import FedAvg

from onnxgrad.federated import server_app
from onnxgrad.train.losses import with_parameters

from .task import held_out, model

BASE = model()


def accuracy(server_round: int, params: dict[str, np.ndarray]) -> dict[str, float]:
    session = ort.InferenceSession(with_parameters(BASE, params).SerializeToString())
    test = held_out()
    logits = session.run(None, {"x": test["x"]})[0]
    return {"held_out_accuracy": float((logits.argmax(1) == test["target"]).mean())}


# FedAvg over every node; the global model is evaluated here, on held-out digits, not on the nodes
app = server_app(
    BASE,
    strategy=FedAvg(fraction_evaluate=0.0, min_evaluate_nodes=0),
    num_rounds=5,
    out_dir="out/federated",
    evaluate=accuracy,
)
