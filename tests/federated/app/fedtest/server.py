"""The server of tests/federated: onnxgrad's ServerApp with the strategy the run config names."""

from __future__ import annotations

import numpy as np
import onnx
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian

from onnxgrad.federated import server_app
from onnxgrad.train import Trainer, with_parameters

app = ServerApp()


def _strategy(context: Context):
    config = context.run_config
    nodes, kind = int(config["nodes"]), str(config["strategy"])
    # every node in every round (a node that died leaves the round to the others); evaluation on
    # the nodes only when the run config asks for it
    evaluate = bool(config["evaluate"])
    options = {
        "min_available_nodes": int(config["min-nodes"]) or nodes,
        "min_train_nodes": int(config["min-nodes"]) or nodes,
        "fraction_evaluate": 1.0 if evaluate else 0.0,
        "min_evaluate_nodes": 1 if evaluate else 0,
    }
    return {"fedmedian": FedMedian, "fedadam": FedAdam, "fedavg": FedAvg}[kind](**options)


def _held_out(context: Context):
    """The server's evaluation on the run config's ``held-out`` examples (none when empty)."""
    config = context.run_config
    if not config["held-out"]:
        return None
    with np.load(str(config["held-out"])) as f:
        data = {k: f[k] for k in f.files}
    model = onnx.load(str(config["model"]))

    def evaluate(server_round: int, params: dict[str, np.ndarray]) -> dict[str, float]:
        trainer = Trainer(with_parameters(model, params), loss=str(config["loss"]), progress=False)
        return {"held_out_loss": trainer.evaluate(data)["loss"]}

    return evaluate


@app.main()
def main(grid: Grid, context: Context) -> None:
    model = str(context.run_config["model"])
    server_app(model, strategy=_strategy, evaluate=_held_out(context))(grid, context)
