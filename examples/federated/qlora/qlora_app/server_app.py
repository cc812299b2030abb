"""The ServerApp: FedAvg of the adapters; out-dir gets the model, the history, the checkpoint and
adapters.onnx_adapter (onnxruntime's adapter format, for onnxruntime.LoraAdapter)."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from onnxgrad.federated import server_app

from .task import adapted

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(fraction_evaluate=0.0, min_evaluate_nodes=0)  # the nodes' train losses suffice
    server_app(adapted(str(context.run_config["model"])), strategy=strategy)(grid, context)
