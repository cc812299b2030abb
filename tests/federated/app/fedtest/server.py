"""The server of tests/federated: onnxgrad's ServerApp with the strategy the run config names."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedMedian

from onnxgrad.federated import server_app

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
    return FedMedian(**options) if kind == "fedmedian" else FedAvg(**options)


@app.main()
def main(grid: Grid, context: Context) -> None:
    server_app(str(context.run_config["model"]), strategy=_strategy)(grid, context)
